"""Issue 30 item 4: ``hf:`` beyond causal LMs (symcost/frontends/hf_tasks.py): encoders with the
masked-LM loss, encoder-decoders with the seq2seq loss, ViT with the classification loss. Each
traced at tiny sizes and checked at random others against independent oracles (FlopCounterMode on
the real step, saved_tensors_hooks on real tensors, a meta-device parameter count: test_own_symbols'
``_check``), and the published figures reproduced with their convention stated:

- BERT-base: "Total Parameters=110M" (Devlin et al. 2019, §3: L=12, H=768, A=12; the
  bert-base-uncased model card's config: intermediate 3072, vocab 30522, 512 positions). The
  masked-LM model (encoder, MLM head, decoder tied to the embedding) has 109,514,298 (110M to three
  significant digits), BertModel (with the pooler) 109,482,240 (109.5M: 110M to two).
- T5-small: 60.5M (google-t5/t5-small's model card; Raffel et al. 2020), transformers' T5Config
  defaults are t5-small's sizes.
- ViT-B/16 at 224²: 86.6M parameters and 17.6 GMACs forward (timm's model card of
  vit_base_patch16_224.augreg2_in21k_ft_in1k: "Params (M): 86.6, GMACs: 17.6"; Dosovitskiy et al.
  2021, Table 1: 86M). The "17.6 GFLOPs" quoted for it are multiply-accumulates: symcost's model
  FLOPs (2 per multiply-add, shared/conventions.md) of the forward are 2 x 17.56e9.
"""
from __future__ import annotations

import random

import pytest
import torch

import symcost
from conftest import run_cli
from test_own_symbols import _check

pytest.importorskip("transformers")


def _spec(name: str):
    from symcost.frontends.models import resolve

    return resolve(name, attention="eager")  # (FlopCounterMode counts no CPU flash attention)


def _meta_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.heavy
def test_bert_masked_lm_exact_and_bert_base_110m():
    """hf:bert trains BertForMaskedLM on its own loss; exact at random sizes; BERT-base's 110M."""
    spec = _spec("hf:bert")
    assert spec.extra["task"] == "masked-lm" and spec.extra["model_class"] == "BertForMaskedLM"
    an = symcost.trace(spec, sizes={"B": 2, "S": 5, "H": 2, "D": 4, "L": 2, "F": 10, "V": 37},
                       precision="fp32", torch_device="cpu")
    assert not an.pinned, an.pinned
    rng = random.Random("bert")
    v = {"B": rng.randint(2, 3), "S": rng.randint(3, 12), "H": rng.randint(2, 4), "D": rng.choice((4, 6, 8)),
         "L": rng.randint(1, 3), "F": rng.randint(6, 30), "V": rng.randint(20, 80)}
    _check(an, spec, v)
    base = {"H": 12, "D": 64, "L": 12, "F": 3072, "V": 30522}  # bert-base-uncased
    got = an.subs(B=1, S=512, **base)["params"]
    assert got == _meta_params(spec.build_meta({**spec.defaults, **base}))
    assert round(got / 1e6) == 110, got
    from transformers import BertConfig, BertModel

    with torch.device("meta"):
        # the paper's model, with the pooler: 109,482,240, 110M to two significant digits
        assert round(_meta_params(BertModel(BertConfig())), -7) == 110_000_000


def test_roberta_positions_limit_is_the_tables():
    """RoBERTa's positions start at padding_idx + 1: S's limit is max_position_embeddings - 2,
    where a real step still runs and one more token fails (PyTorch's own answer)."""
    from symcost.errors import SymcostError

    spec = symcost.resolve("hf:roberta", config={"max_position_embeddings": "12"})
    assert spec.extra["task"] == "masked-lm"
    small = {"B": 1, "H": 2, "D": 4, "L": 1, "F": 8, "V": 30}
    model = spec.build({**small, "S": 10})
    for s, runs in ((10, True), (11, False)):
        ids = torch.randint(2, 30, (1, s))
        try:
            model(input_ids=ids, labels=ids)
            ran = True
        except (IndexError, RuntimeError):  # (the position table's gather or lookup)
            ran = False
        assert ran == runs, s
    assert spec.check({**small, "S": 10}) is None and "at most 10" in spec.check({**small, "S": 11})
    with pytest.raises(SymcostError, match="has no image-classification head"):
        symcost.resolve("hf:roberta", task="image-classification")


@pytest.mark.heavy
def test_bart_seq2seq_exact():
    """hf:bart: source ids [B, S_enc], labels [B, S], the model's own loss; both stacks follow L
    (encoder_layers = decoder_layers), traced unfolded with L pinned; exact at random sizes."""
    spec = _spec("hf:bart")
    assert spec.extra["task"] == "seq2seq" and "S_enc" in spec.symbols
    an = symcost.trace(spec, sizes={"B": 2, "S": 5, "S_enc": 7, "H": 2, "D": 4, "F": 10, "V": 37, "L": 2},
                       precision="fp32", torch_device="cpu")
    assert an.pinned == {"L": 2}, an.pinned
    rng = random.Random("bart")
    v = {"B": rng.randint(2, 3), "S": rng.randint(3, 9), "S_enc": rng.randint(3, 11), "H": rng.randint(2, 4),
         "D": rng.choice((4, 6, 8)), "F": rng.randint(6, 30), "V": rng.randint(20, 80), "L": 2}
    _check(an, spec, v)


@pytest.mark.heavy
def test_t5_by_name_exact_and_t5_small_60_5m():
    """hf:t5 (T5Config's defaults are t5-small's): D = d_kv apart from M = d_model; traced at L = 6
    (both stacks follow L: pinned); exact at random other sizes; T5-small's 60.5M from the formula."""
    spec = _spec("hf:t5")
    assert spec.extra["task"] == "seq2seq" and {"M", "S_enc"} <= set(spec.symbols)
    an = symcost.trace(spec, sizes={"B": 2, "S": 5, "S_enc": 7, "H": 2, "D": 4, "M": 12, "F": 10, "V": 37, "L": 6},
                       precision="fp32", torch_device="cpu")
    assert an.pinned == {"L": 6}, an.pinned
    rng = random.Random("t5")
    v = {"B": rng.randint(2, 3), "S": rng.randint(3, 9), "S_enc": rng.randint(3, 11), "H": rng.randint(2, 4),
         "D": rng.choice((4, 6, 8)), "M": rng.randint(6, 24), "F": rng.randint(6, 30), "V": rng.randint(20, 80), "L": 6}
    _check(an, spec, v)
    small = {k: spec.defaults[k] for k in ("H", "D", "M", "F", "V", "L")}
    assert small == {"H": 8, "D": 64, "M": 512, "F": 2048, "V": 32128, "L": 6}  # t5-small
    got = an.subs(B=1, S=128, S_enc=512, **small)["params"]
    assert got == _meta_params(spec.build_meta({**spec.defaults, **small}))
    assert round(got / 1e5) / 10 == 60.5, got


@pytest.mark.heavy
def test_vit_classification_exact_and_vit_b16_published():
    """hf:vit: pixel_values [B, C, IMG, IMG], class labels, the model's cross entropy; IMG pinned
    (stated); exact at random other sizes at 224²; ViT-B/16's 86.6M parameters (= a meta count)
    and 17.6 GMACs forward (= FlopCounterMode's forward FLOPs of the meta model / 2)."""
    from torch.utils.flop_counter import FlopCounterMode

    spec = _spec("hf:vit")
    assert spec.extra["task"] == "image-classification" and {"IMG", "C", "NCLS"} <= set(spec.symbols)
    an = symcost.trace(spec, sizes={"B": 2, "H": 2, "D": 4, "L": 2, "F": 10, "IMG": 224, "C": 3, "NCLS": 5},
                       precision="fp32", torch_device="cpu")
    assert an.pinned == {"IMG": 224} and "(IMG/16)^4" in an.pin_reasons["IMG"], an.pinned
    rng = random.Random("vit")
    v = {"B": rng.randint(2, 3), "H": rng.randint(2, 3), "D": rng.choice((4, 6)), "L": rng.randint(1, 3),
         "F": rng.randint(6, 20), "IMG": 224, "C": rng.randint(1, 4), "NCLS": rng.randint(2, 12)}
    _check(an, spec, v)
    b16 = {"H": 12, "D": 64, "L": 12, "F": 3072, "IMG": 224, "C": 3, "NCLS": 1000}
    got = an.subs(B=1, **b16)
    model = spec.build_meta({**spec.defaults, **b16, "B": 1})
    assert got["params"] == _meta_params(model) == 86_567_656 and round(got["params"] / 1e5) / 10 == 86.6
    with FlopCounterMode(display=False) as fc:
        model(pixel_values=torch.empty(1, 3, 224, 224, device="meta"))
    assert got["flops.forward"] == fc.get_total_flops()
    assert round(got["flops.forward"] / 2 / 1e8) / 10 == 17.6, got["flops.forward"]


def test_bad_sizes_and_tasks_one_line(capsys, tmp_path, monkeypatch):
    """An image side that is no whole number of patches and a size outside BERT's position table
    are one line each, before any trace; an unknown task is refused by name."""
    from test_cli import assert_one_line_error

    from symcost.errors import SymcostError

    monkeypatch.setenv("SYMCOST_CACHE_DIR", str(tmp_path))
    assert_one_line_error(*run_cli(capsys, "eval", "hf:vit", "--set", "IMG=100"), "IMG must be a multiple of the patch side 16")
    assert_one_line_error(*run_cli(capsys, "eval", "hf:bert", "--set", "S=600"), "S must be at most 512")
    with pytest.raises(SymcostError, match="unknown task 'mlm'"):
        symcost.resolve("hf:bert", task="mlm")
    assert symcost.resolve("hf:bert", task="causal-lm").extra.get("task") is None  # (the causal LM: hf.spec)
