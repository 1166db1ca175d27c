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
from test_own_symbols import _check, _six_n_p_per_stack

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


def _peak_close(an, spec, v: dict) -> None:
    """The memory pass's peak of a training step at ``v`` within 1% of the profiler's
    (tests/memory_oracle.py ``step_peak``: torch.profiler's allocator level, fp32, AdamW foreach)."""
    from memory_oracle import step_peak

    from symcost.passes.memory import memory_model

    got, want = memory_model(an).peak(**v), step_peak(spec, v, "fp32")["peak"]
    assert abs(got / want - 1) < 0.01, (got, want, v)


@pytest.mark.heavy
def test_bart_seq2seq_exact():
    """hf:bart: source ids [B, S_enc], labels [B, S], the model's own loss; both stacks follow L
    (encoder_layers = decoder_layers) and fold each under L (the decoder's last block apart: it
    adds no gradient of the encoder's output to another's); exact at a random L never traced."""
    spec = _spec("hf:bart")
    assert spec.extra["task"] == "seq2seq" and "S_enc" in spec.symbols
    an = symcost.trace(spec, sizes={"B": 2, "S": 5, "S_enc": 7, "H": 2, "D": 4, "F": 10, "V": 37, "L": 2},
                       precision="fp32", torch_device="cpu")
    assert not an.pinned and an.stacks == {"model.encoder.layers": "L", "model.decoder.layers": "L"}, an.pinned
    rng = random.Random("bart")
    v = {"B": rng.randint(2, 3), "S": rng.randint(3, 9), "S_enc": rng.randint(3, 11), "H": rng.randint(2, 4),
         "D": rng.choice((4, 6, 8)), "F": rng.randint(6, 30), "V": rng.randint(20, 80), "L": rng.randint(4, 6)}
    _check(an, spec, v)


@pytest.mark.heavy
def test_t5_by_name_exact_and_t5_small_60_5m():
    """hf:t5 (T5Config's defaults are t5-small's): D = d_kv apart from M = d_model; both stacks
    follow L and fold each under L, probed with three blocks (block 0 computes the relative
    position bias, and every block but the last adds the bias's gradient to the later blocks'):
    exact at a random L never traced, the peak within 1% of the profiler's; T5-small's 60.5M from
    the folded formula at L = 6."""
    spec = _spec("hf:t5")
    assert spec.extra["task"] == "seq2seq" and {"M", "S_enc"} <= set(spec.symbols)
    an = symcost.trace(spec, sizes={"B": 2, "S": 5, "S_enc": 7, "H": 2, "D": 4, "M": 12, "F": 10, "V": 37, "L": 6},
                       precision="fp32", torch_device="cpu")
    assert not an.pinned and an.stacks == {"encoder.block": "L", "decoder.block": "L"}, an.pinned
    assert an.stack_blocks == {"L": 3} and an.flops("train").has(symcost.SYMS["L"])
    rng = random.Random("t5")
    v = {"B": rng.randint(2, 3), "S": rng.randint(3, 9), "S_enc": rng.randint(3, 11), "H": rng.randint(2, 4),
         "D": rng.choice((4, 6, 8)), "M": rng.randint(6, 24), "F": rng.randint(6, 30), "V": rng.randint(20, 80),
         "L": rng.choice((2, 5, 7))}
    _check(an, spec, v)
    _peak_close(an, spec, v)
    _six_n_p_per_stack(an, spec, {**v, "S": v["S_enc"] + 1})  # (6·N·P per stack: the cross-attention's k, v on S_enc)
    with pytest.raises(symcost.SymcostError, match="L >= 2"):  # (one block per stack: a regime of its own)
        an.subs(L=1)
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
    """An image side smaller than one patch (PyTorch's convolution refuses it) and a size outside
    BERT's position table are one line each, before any trace; an unknown task is refused by name."""
    from test_cli import assert_one_line_error

    from symcost.errors import SymcostError

    monkeypatch.setenv("SYMCOST_CACHE_DIR", str(tmp_path))
    assert_one_line_error(*run_cli(capsys, "eval", "hf:vit", "--set", "IMG=8"), "IMG must be at least the patch side 16")
    assert_one_line_error(*run_cli(capsys, "eval", "hf:bert", "--set", "S=600"), "S must be at most 512")
    with pytest.raises(SymcostError, match="unknown task 'mlm'"):
        symcost.resolve("hf:bert", task="mlm")
    causal = symcost.resolve("hf:bert", task="causal-lm")  # (the causal LM: hf.spec, the head named)
    assert (causal.extra.get("task"), causal.extra.get("model_class")) == ("causal-lm", "BertLMHeadModel")
    assert symcost.resolve("hf:llama").extra.get("task") is None  # (a decoder LM without --task: JSON null)


def _split_conv1d(monkeypatch):
    """FlopCounterMode's oracle for a grouped (depthwise) conv1d: each ``F.conv1d`` with groups > 1
    run as ``groups`` separate convolutions on the channel slices (same weights), which it counts
    right (it counts a grouped convolution's weight gradient as if ungrouped; docs/conventions.md,
    test_kernels' SplitConv)."""
    import torch.nn.functional as F

    orig = F.conv1d

    def conv1d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        if groups == 1:
            return orig(input, weight, bias, stride, padding, dilation, 1)
        bs = bias.chunk(groups) if bias is not None else [None] * groups
        return torch.cat([orig(x, w, b, stride, padding, dilation, 1)
                          for x, w, b in zip(input.chunk(groups, 1), weight.chunk(groups, 0), bs)], 1)

    monkeypatch.setattr(F, "conv1d", conv1d)


@pytest.mark.heavy
def test_whisper_speech_seq2seq_exact_and_whisper_tiny_params():
    """hf:whisper trains WhisperForConditionalGeneration on its own loss: input_features [B, N_mel,
    2*S_enc] (the conv stem halves them to S_enc = max_source_positions), labels [B, S]; traced at
    Whisper-tiny's L = 4 (both stacks follow L and fold each under L), exact at random other
    sizes, L one never traced.

    Whisper-tiny's parameters: published "39M" (Radford et al. 2022, "Robust Speech Recognition via
    Large-Scale Weak Supervision", Table 1; the openai/whisper-tiny model card), a rounded figure
    whose count rule is not stated. WhisperConfig's defaults are tiny's sizes (d_model 384, 4 + 4
    layers, 6 heads, FFN 1536, vocab 51865, 80 mel bins, 1500 audio and 448 text positions); the
    rule here: every distinct parameter tensor of WhisperForConditionalGeneration (proj_out tied to
    the decoder's token embedding, counted once; the encoder's frozen sinusoidal position table,
    1500 x 384, counted: transformers stores it as a parameter) = 37,760,640, 37.8M, 3.2% under
    the rounded 39M; without the frozen table (OpenAI's code keeps it as a buffer) 37,184,640."""
    spec = _spec("hf:whisper")
    assert spec.extra["task"] == "speech-seq2seq" and spec.extra["model_class"] == "WhisperForConditionalGeneration"
    assert {"S_enc", "N_mel"} <= set(spec.symbols)
    an = symcost.trace(spec, sizes={"B": 2, "S": 5, "S_enc": 7, "H": 2, "D": 4, "F": 10, "V": 37, "L": 4, "N_mel": 6},
                       precision="fp32", torch_device="cpu")
    assert not an.pinned and set(an.stacks.values()) == {"L"} and len(an.stacks) == 2, an.pinned
    rng = random.Random("whisper")
    v = {"B": rng.randint(2, 3), "S": rng.randint(3, 9), "S_enc": rng.randint(3, 11), "H": rng.randint(2, 4),
         "D": rng.choice((4, 6, 8)), "F": rng.randint(6, 30), "V": rng.randint(20, 80), "L": rng.choice((1, 5)),
         "N_mel": rng.randint(2, 12)}
    _check(an, spec, v)
    tiny = {k: spec.defaults[k] for k in ("H", "D", "F", "V", "L", "S_enc", "N_mel")}
    assert tiny == {"H": 6, "D": 64, "F": 1536, "V": 51865, "L": 4, "S_enc": 1500, "N_mel": 80}  # whisper-tiny
    got = an.subs(B=1, S=448, **tiny)["params"]
    model = spec.build_meta({**spec.defaults, **tiny})
    assert got == _meta_params(model) == 37_760_640
    frozen = model.model.encoder.embed_positions.weight.numel()
    assert got - frozen == 37_184_640 and abs(got / 39e6 - 1) < 0.035


@pytest.mark.heavy
def test_mamba_selective_scan_exact_and_mamba_130m(monkeypatch):
    """hf:mamba (MambaForCausalLM; refused before: "no usable num_attention_heads"): the model's own
    symbols M, N_state, K_conv, EXPAND, R_dt; S pinned (transformers' CPU scan is a Python loop over
    S, stated); exact at random other sizes (FLOPs against FlopCounterMode with the depthwise conv
    split, the true count). Mamba-130m: "130M" (Gu & Dao 2023, the state-spaces/mamba-130m-hf model
    card; its config: d_model 768, 24 layers, vocab 50277 padded to 50280, state 16, conv 4,
    expand 2, time_step_rank auto = 48): 129,135,360 (130M to two significant digits), the meta
    count of MambaForCausalLM with the embedding tied to the LM head."""
    spec = symcost.resolve("hf:mamba")  # (no attention layers: --attention is refused)
    assert spec.extra["model_class"] == "MambaForCausalLM"
    with pytest.raises(symcost.SymcostError, match="has no attention layers"):
        _spec("hf:mamba")
    assert set(spec.symbols) == {"M", "L", "V", "N_state", "K_conv", "EXPAND", "R_dt"}
    an = symcost.trace(spec, sizes={"B": 2, "S": 3, "M": 8, "L": 2, "V": 37, "N_state": 3, "K_conv": 3, "EXPAND": 2,
                                    "R_dt": 2}, precision="fp32", torch_device="cpu")
    assert an.pinned == {"S": 3} and "loop over the S positions" in an.pin_reasons["S"], an.pinned
    rng = random.Random("mamba")
    v = {"B": rng.randint(2, 3), "S": 3, "M": rng.randint(4, 16), "L": rng.randint(1, 3), "V": rng.randint(20, 80),
         "N_state": rng.randint(2, 6), "K_conv": rng.randint(2, 5), "EXPAND": rng.randint(1, 3), "R_dt": rng.randint(1, 4)}
    _split_conv1d(monkeypatch)
    _check(an, spec, v)
    m130 = {"M": 768, "L": 24, "V": 50280, "N_state": 16, "K_conv": 4, "EXPAND": 2, "R_dt": 48}
    got = an.subs(B=1, S=3, **m130)["params"]
    assert got == _meta_params(spec.build_meta({**spec.defaults, **m130})) == 129_135_360
    assert round(got, -7) == 130_000_000


@pytest.mark.heavy
def test_modernbert_masked_lm_exact():
    """hf:modernbert (ModernBertForMaskedLM): rotary positions, global and local (sliding-window)
    attention alternating every third block, the first block without its attention norm; L pinned
    (each attention kind has its own rotary table, saved by its first block: the blocks do not
    repeat alike; stated) at L = 4 (global, local, local, global); exact at random other sizes."""
    spec = _spec("hf:modernbert")
    assert spec.extra["task"] == "masked-lm" and spec.extra["model_class"] == "ModernBertForMaskedLM"
    an = symcost.trace(spec, sizes={"B": 2, "S": 5, "H": 2, "D": 4, "L": 4, "F": 10, "V": 37},
                       precision="fp32", torch_device="cpu")
    assert an.pinned == {"L": 4} and "rotary table" in an.pin_reasons["L"], an.pinned
    rng = random.Random("modernbert")
    v = {"B": rng.randint(2, 3), "S": rng.randint(3, 12), "H": rng.randint(2, 4), "D": rng.choice((4, 6, 8)),
         "L": 4, "F": rng.randint(6, 30), "V": rng.randint(20, 80)}
    _check(an, spec, v)


def test_whisper_mamba_bad_input_one_line(capsys, tmp_path, monkeypatch):
    """A decoder longer than Whisper's position table (448: a real step fails there), a speech
    model whose inputs are not Whisper's, and --attention on Mamba (no attention layers) are one
    line each, before any trace."""
    from test_cli import assert_one_line_error

    from symcost.errors import SymcostError

    monkeypatch.setenv("SYMCOST_CACHE_DIR", str(tmp_path))
    assert_one_line_error(*run_cli(capsys, "eval", "hf:whisper", "--set", "S=449"),
                          "S must be at most max_target_positions=448")
    assert_one_line_error(*run_cli(capsys, "eval", "hf:mamba", "--attention", "eager"), "has no attention layers")
    with pytest.raises(SymcostError, match="Speech2TextConfig has no num_mel_bins; .* whisper is accepted"):
        symcost.resolve("hf:speech_to_text")
    spec = symcost.resolve("hf:whisper", config={"max_target_positions": "4"})
    small = {"B": 1, "S": 4, "S_enc": 3, "H": 2, "D": 4, "L": 1, "F": 8, "V": 30, "N_mel": 5}
    model = spec.build(small)
    for s, runs in ((4, True), (5, False)):  # (PyTorch's own answer at the limit)
        args, kwargs = spec.make_inputs({**small, "S": s}, torch.device("cpu"))
        try:
            model(*args, **kwargs)
            ran = True
        except (IndexError, RuntimeError, ValueError):
            ran = False
        assert ran == runs and (spec.check({**small, "S": s}) is None) == runs, s
