"""``hf:`` models that are no causal LM: encoders (masked-LM loss), encoder-decoders (sequence-to-
sequence loss, speech ones included: Whisper) and vision transformers (classification loss), each
trained with the loss its ``transformers`` head computes from ``labels``; and the state-space
causal LMs (Mamba: :func:`ssm_spec`), which have no attention heads to bind.

A model type's task is the first of these its ``transformers`` auto mappings have (or the one
``task`` names): ``seq2seq`` (``AutoModelForSeq2SeqLM``: T5, BART), ``speech-seq2seq``
(``AutoModelForSpeechSeq2Seq``: Whisper), ``masked-lm``
(``AutoModelForMaskedLM``: BERT, RoBERTa, ModernBERT), ``causal-lm`` (``AutoModelForCausalLM``,
:mod:`symcost.frontends.hf`), ``image-classification`` (``AutoModelForImageClassification``: ViT;
ConvNeXt and Swin, whose configs list stages: :mod:`symcost.frontends.hf_vision`).
Symbols are bound to config fields through the config class's own ``attribute_map`` (T5's
``num_heads`` is its ``num_attention_heads``), exactly as for causal LMs:

=========== =====================================================================================
symbol      config attribute
=========== =====================================================================================
H           ``num_attention_heads`` (an encoder-decoder's decoder heads follow where equal)
D           ``head_dim`` where the config sets it apart from ``hidden_size`` (T5's ``d_kv``; then
            M = ``hidden_size`` is a symbol), else ``hidden_size / num_attention_heads``
L           ``num_hidden_layers``; an encoder-decoder's decoder stack (``num_decoder_layers``,
            ``decoder_layers``) follows L where the config has them equal, else is ``L_dec``
V, F        ``vocab_size``; ``intermediate_size``/``d_ff``/``encoder_ffn_dim`` (decoder's follows)
S           tokens per sequence: an encoder's input, an encoder-decoder's **target** (decoder)
S_enc       an encoder-decoder's source tokens per sequence (the encoder's input); Whisper's audio
            positions, ``max_source_positions`` (its encoder takes exactly 2·S_enc mel frames)
N_mel       Whisper's mel-frequency bins (``num_mel_bins``)
IMG, C      a vision model's image side (pixels; at least the config's ``patch_size``, which
            stays a config value: the ⌊IMG/P⌋^2 patches are no polynomial in P) and input channels
NCLS        a classifier's classes (``num_labels``)
=========== =====================================================================================

Inputs: masked-LM ``input_ids`` and ``labels`` ``[B, S]`` (labels at every position: a real
batch's ignored positions, -100, run the same ops); seq2seq ``input_ids [B, S_enc]`` and
``labels [B, S]`` (the model shifts the labels into its decoder inputs itself); speech-seq2seq
(``AutoModelForSpeechSeq2Seq``: Whisper) ``input_features [B, N_mel, 2·S_enc]`` float32 and
``labels [B, S]`` (S at most ``max_target_positions``; other speech models, whose inputs are not
Whisper's, are refused in one line); vision
``pixel_values [B, C, IMG, IMG]`` and ``labels [B]`` in ``[0, NCLS)`` (cross entropy: the head's
``single_label_classification``).

Layer patterns: where a config lists per-layer kinds (ModernBERT's ``layer_types``: global
attention every third block, local sliding-window attention between, each kind with its own rotary
table, saved by the first block of its kind) the blocks do not repeat alike, so L is pinned at the
request (``ModelSpec.pin``, said in the report) and the list follows L by its shortest period.

State-space models (:func:`ssm_spec`; Mamba-1 style configs, :func:`is_ssm`): symbols M, L, V and
the model's own N_state, K_conv, EXPAND, R_dt; S pinned (transformers' CPU scan loops over S).
"""
from __future__ import annotations

import operator
from typing import Any, Mapping

import torch

from symcost.errors import SymcostError
from symcost.frontends import hf
from symcost.frontends.spec import Constraint, ModelSpec

#: Tasks, in the order a model type's default is chosen, with their auto-model mapping.
TASKS = {
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING",
    "speech-seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING",
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING",
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING",
}

#: Families checked (transformers 5.x, torch 2.13) against FlopCounterMode, saved_tensors_hooks and
#: a meta count at random tiny sizes (tests/test_hf_tasks.py).
VERIFIED = ("bert", "roberta", "t5", "bart", "vit", "whisper", "modernbert", "mamba")

#: An encoder-decoder's decoder fields that follow the encoder's where the config has them equal.
_DECODER_TWINS = {"num_layers": "num_decoder_layers", "encoder_layers": "decoder_layers",
                  "encoder_attention_heads": "decoder_attention_heads", "encoder_ffn_dim": "decoder_ffn_dim"}
#: Feed-forward width fields, first present wins.
_F_FIELDS = ("intermediate_size", "d_ff", "encoder_ffn_dim", "ffn_dim")
#: Token ids that must lie inside the vocabulary (a probe's small V).
_TOKENS = hf._TOKEN_ATTRS + ("decoder_start_token_id", "forced_eos_token_id", "forced_bos_token_id")


def task_of(model_type: str, task: str | None = None) -> str:
    """The task ``hf:model_type`` trains with: ``task`` if given (checked), else the first of
    :data:`TASKS` whose ``transformers`` mapping has the model type.

    Raises:
        SymcostError: an unknown task, or a model type without that head.
    """
    from transformers.models.auto import modeling_auto

    has = {t: model_type in getattr(modeling_auto, f"{m}_NAMES") for t, m in TASKS.items()}
    if task is not None:
        if task not in TASKS:
            raise SymcostError(f"unknown task {task!r}; accepted: {', '.join(TASKS)}")
        if not has[task]:
            raise SymcostError(f"hf:{model_type} has no {task} head in transformers; it has: "
                               f"{', '.join(t for t, h in has.items() if h) or 'none of ' + ', '.join(TASKS)}")
        return task
    for t, h in has.items():
        if h:
            return t
    raise SymcostError(f"hf:{model_type} has none of the heads symcost trains ({', '.join(TASKS)})")


def any_spec(model_type: str, overrides: Mapping[str, str] | None = None, attention: str | None = None,
             base_kwargs: Mapping[str, Any] | None = None, name: str | None = None,
             task: str | None = None) -> ModelSpec:
    """The :class:`ModelSpec` of ``hf:MODEL_TYPE`` for its task (:func:`task_of`): a causal LM by
    :func:`symcost.frontends.hf.spec`, any other task by :func:`spec`. Arguments as
    :func:`symcost.frontends.hf.spec`; ``task`` one of :data:`TASKS` or None (the default head).

    Raises:
        SymcostError: as :func:`task_of` and the spec functions (an unknown model type: hf.spec's line).
    """
    _, _, CONFIG_MAPPING, _ = hf._import_transformers()  # (one line where transformers is missing)

    mt = model_type if model_type in CONFIG_MAPPING else model_type.replace("-", "_")
    if mt not in CONFIG_MAPPING:
        return hf.spec(model_type, overrides, attention, base_kwargs=base_kwargs, name=name)  # (its error line)
    chosen = task_of(mt, task)
    from symcost.frontends import hf_vision

    if hf_vision.handles(mt, chosen):  # (staged image classifiers: ConvNeXt, Swin)
        return hf_vision.spec(mt, overrides, attention, base_kwargs, name or f"hf:{model_type}")
    if chosen == "causal-lm":
        import transformers

        from symcost.frontends import hf_ssm

        if hf_ssm.handles(mt):  # (Mamba-2 and the attention/Mamba hybrids)
            return hf_ssm.spec(mt, overrides, attention, base_kwargs, name or f"hf:{model_type}")
        if is_ssm(hf._make_config(transformers.AutoConfig, mt, dict(base_kwargs or {}))):
            return ssm_spec(mt, overrides, attention, base_kwargs, name or f"hf:{model_type}")
        out = hf.spec(mt, overrides, attention, base_kwargs=base_kwargs, name=name or f"hf:{model_type}")
        if task is not None:  # (asked for by --task: the report says which head; a plain decoder LM's JSON keeps null)
            out.extra["task"] = "causal-lm"
        return out
    return spec(mt, chosen, overrides, attention, base_kwargs, name or f"hf:{model_type}")


def any_spec_from_file(path: str, overrides: Mapping[str, str] | None = None, attention: str | None = None,
                       name: str | None = None, task: str | None = None) -> ModelSpec:
    """:func:`any_spec` of a ``config.json`` file (its sizes the defaults). Raises SymcostError as
    :func:`symcost.frontends.hf.read_config_file` and :func:`any_spec`."""
    model_type, kwargs = hf.read_config_file(path)
    return any_spec(model_type, overrides, attention, base_kwargs=kwargs, name=name or path, task=task)


def _field(cfg, key: str) -> str:
    return hf._field_name(cfg, key)


def spec(model_type: str, task: str, overrides: Mapping[str, str] | None = None, attention: str | None = None,
         base_kwargs: Mapping[str, Any] | None = None, name: str | None = None) -> ModelSpec:
    """The :class:`ModelSpec` of ``hf:MODEL_TYPE`` trained on ``task`` (not ``causal-lm``:
    :func:`symcost.frontends.hf.spec`), from the config's defaults, a config file's values
    (``base_kwargs``) and ``--config`` overrides. Arguments as :func:`symcost.frontends.hf.spec`.

    Raises:
        SymcostError: a config symcost cannot bind (no heads, a hidden size no multiple of the
            heads), an unknown or rejected config key, a bad attention implementation.
    """
    from transformers.models.auto import modeling_auto

    shown = name or f"hf:{model_type}"
    AutoConfig, base_kwargs, ov, cfg = hf.configs(model_type, overrides, base_kwargs)
    cls = type(cfg).__name__
    mapping = getattr(modeling_auto, TASKS[task])
    model_cls = mapping[type(cfg)]
    if attention is None:
        attention = "sdpa" if getattr(model_cls, "_supports_sdpa", False) else "eager"
    elif attention not in hf.ATTENTION:
        raise SymcostError(f"unknown attention implementation {attention!r}; accepted: {', '.join(hf.ATTENTION)}")
    elif attention == "sdpa" and not getattr(model_cls, "_supports_sdpa", False):
        raise SymcostError(f"{shown} ({model_cls.__name__}) has no sdpa attention in transformers; use --attention eager")

    def attr(key):
        return getattr(cfg, key, None)

    H, hidden, L = attr("num_attention_heads"), attr("hidden_size"), attr("num_hidden_layers")
    for key, v in (("num_attention_heads", H), ("hidden_size", hidden), ("num_hidden_layers", L)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise SymcostError(f"{shown}: {cls} has no usable {key} ({v!r}); symcost binds H, D, L to "
                               "num_attention_heads, head_dim, num_hidden_layers")
    head_dim = attr("head_dim") if _field(cfg, "head_dim") != "head_dim" or hf._is_field(cfg, "head_dim") else None
    has_m = isinstance(head_dim, int)
    if has_m:
        D = head_dim
    elif hidden % H:
        raise SymcostError(f"{shown}: hidden_size={hidden} is not a multiple of num_attention_heads={H}; "
                           "set --config hidden_size=... or num_attention_heads=...")
    else:
        D = hidden // H
    f_field = next((k for k in _F_FIELDS if isinstance(attr(k), int)), None)
    V = attr("vocab_size") if task != "image-classification" else None

    # (symbol, config field it sets, default) and the decoder twins that follow it
    binds: list[tuple[str, str, int]] = [("H", _field(cfg, "num_attention_heads"), H),
                                         ("L", _field(cfg, "num_hidden_layers"), L)]
    if f_field:
        binds.append(("F", f_field, attr(f_field)))
    if V is not None:
        binds.append(("V", "vocab_size", V))
    if has_m:
        binds += [("D", _field(cfg, "head_dim"), D), ("M", _field(cfg, "hidden_size"), hidden)]
    twins, l_dec = {}, None
    for field_, twin in _DECODER_TWINS.items():
        if isinstance(attr(field_), int) and isinstance(attr(twin), int):
            if attr(twin) == attr(field_):
                twins[field_] = twin
            elif twin in ("num_decoder_layers", "decoder_layers"):
                l_dec = twin
    if l_dec:
        binds.append(("L_dec", l_dec, attr(l_dec)))

    meanings: dict[str, str] = {}
    constraints: list[Constraint] = []
    moduli: dict[str, int] = {}
    pin: dict[str, str] = {}
    defaults: dict[str, int] = {"B": 8}
    maxpos = attr("max_position_embeddings")
    if isinstance(maxpos, int) and model_type in ("roberta", "xlm-roberta", "camembert"):
        maxpos -= int(attr("pad_token_id") or 0) + 1  # positions count from padding_idx + 1
    if task == "image-classification":
        image, patch = attr("image_size"), attr("patch_size")
        if not (isinstance(image, int) and isinstance(patch, int)):
            raise SymcostError(f"{shown}: {cls} gives image_size={image!r}, patch_size={patch!r}; symcost binds "
                               "IMG to the side of square images of square patches: set --config image_size=N patch_size=N")
        binds += [("IMG", "image_size", image), ("C", "num_channels", attr("num_channels")),
                  ("NCLS", "num_labels", cfg.num_labels if cfg.num_labels > 1 else 1000)]
        defaults["S"] = 1
        meanings.update(IMG=f"image side (pixels; patches of {patch}x{patch}: --config patch_size=...)",
                        C="input channels", NCLS="classes", B="images per step", S="unused (the model reads images)")
        # the patch side is the config's, no symbol: the tokens (IMG/P)^2 + 1 are no polynomial in
        # P; at a fixed P they are one in IMG, within IMG's residue class mod P (probes keep it)
        moduli["IMG"] = patch
        pin["IMG"] = (f"the attention scores' storage holds (IMG/{patch})^4 terms, above the fit's cubes: "
                      "formulas for this image side (another: --set IMG=...)")
        # a side off the multiples runs too (the patch convolution floors: floor(IMG/P)^2 + 1 tokens, a
        # polynomial in IMG within its class mod P, pinned as every side is); below one patch PyTorch refuses
        constraints.append(Constraint("min", "IMG", patch, f"IMG must be at least the patch side {patch} (one whole "
                                      "patch; another patch side: --config patch_size=...)"))
        constraints.append(Constraint("min", "NCLS", 2, "NCLS must be at least 2 (one class is regression)"))
    elif task == "speech-seq2seq":
        frames, mels, maxtgt = attr("max_source_positions"), attr("num_mel_bins"), attr("max_target_positions")
        if not (isinstance(frames, int) and isinstance(mels, int)):
            lacks = " and ".join(k for k, v in (("max_source_positions", frames), ("num_mel_bins", mels))
                                 if not isinstance(v, int))
            raise SymcostError(f"{shown}: {cls} has no {lacks}; symcost traces speech encoder-decoders whose input "
                               "is Whisper's (input_features [B, num_mel_bins, 2*max_source_positions]); whisper "
                               "is accepted")
        # Whisper's encoder takes exactly 2*max_source_positions mel frames (its conv stem halves
        # them to S_enc; a check in WhisperEncoder.forward): S_enc is the config's field
        binds += [("S_enc", "max_source_positions", frames), ("N_mel", "num_mel_bins", mels)]
        defaults["S"] = min(128, maxtgt) if isinstance(maxtgt, int) else 128
        meanings.update(S="target tokens per sequence (the decoder's)",
                        S_enc="audio positions per sequence (the encoder's: 2*S_enc mel frames, halved by "
                              "the conv stem; max_source_positions)",
                        N_mel="mel-frequency bins of the input features (num_mel_bins)")
        if isinstance(maxtgt, int):
            constraints.append(Constraint("max", "S", maxtgt, f"S must be at most max_target_positions={maxtgt} "
                                          "(the decoder's learned position table)"))
    elif task == "seq2seq":
        defaults.update(S=128, S_enc=512)
        meanings.update(S="target tokens per sequence (the decoder's)",
                        S_enc="source tokens per sequence (the encoder's)")
        if isinstance(maxpos, int):
            for s in ("S", "S_enc"):
                constraints.append(Constraint("max", s, maxpos, f"{s} must be at most max_position_embeddings="
                                              f"{maxpos} (a learned position table)"))
    else:
        defaults["S"] = min(512, maxpos) if isinstance(maxpos, int) else 512
        if isinstance(maxpos, int) and attr("position_embedding_type") in (None, "absolute"):
            constraints.append(Constraint("max", "S", maxpos, f"S must be at most {maxpos} (a learned position "
                                          "table): raise it with --config max_position_embeddings=..."))
    kinds = attr("layer_types")
    if isinstance(kinds, (list, tuple)) and len(set(kinds)) > 1:
        # ModernBERT: global and local (sliding-window) attention alternate, each kind with its own
        # rotary table, saved once by the first block of its kind: the blocks do not repeat alike
        pin["L"] = (f"the blocks alternate {' and '.join(sorted(set(kinds)))} (each kind with its own "
                    "rotary table, saved by its first block): traced unfolded at this L (another: --set L=...)")
    symbols = tuple(dict.fromkeys(["H", "D"] + [s for s, _, _ in binds] + (["S_enc"] if task == "seq2seq" else [])))
    defaults.update({s: v for s, _, v in binds}, D=D)

    def config_for(values: Mapping[str, int]):
        kw = dict(ov)
        for s, field_, _ in binds:
            kw[field_] = operator.index(values[s])
            if field_ in twins:
                kw[twins[field_]] = kw[field_]
        if not has_m:
            kw[_field(cfg, "hidden_size")] = values["H"] * values["D"]
        kw["use_cache"] = False
        pattern = kw.get("layer_types")
        if isinstance(pattern, (list, tuple)) and pattern and len(pattern) != values["L"]:
            kw["layer_types"] = hf._resize_pattern(list(pattern), values["L"])  # (as for causal LMs)
        if task in ("seq2seq", "speech-seq2seq") and kw.get("decoder_start_token_id", attr("decoder_start_token_id")) is None:
            # (T5's class default has none; its published configs start the decoder at the pad id)
            kw["decoder_start_token_id"] = attr("pad_token_id") or 0
        if "V" in values:
            for key in _TOKENS:  # ids outside a small probe vocabulary would break the embedding
                t = kw.get(key, attr(key))
                if isinstance(t, int) and t >= values["V"]:
                    kw[key] = values["V"] - 1
        c = hf._make_config(AutoConfig, model_type, kw)
        c._attn_implementation = attention
        return c

    build = hf.head_builder(shown, constraints, symbols, model_cls, config_for, attention)

    def make_inputs(values: Mapping[str, int], device) -> tuple[tuple, dict]:
        """The step's batch (module docstring): ids int64, pixels and mel features float32, labels int64."""
        i = lambda k: operator.index(values[k])  # noqa: E731
        if task == "image-classification":
            return (), {"pixel_values": torch.randn(i("B"), i("C"), i("IMG"), i("IMG"), device=device),
                        "labels": torch.randint(0, i("NCLS"), (i("B"),), dtype=torch.long, device=device)}
        ids = torch.randint(0, i("V"), (i("B"), i("S")), dtype=torch.long, device=device)
        if task == "speech-seq2seq":
            mel = torch.randn(i("B"), i("N_mel"), 2 * i("S_enc"), device=device)
            return (), {"input_features": mel, "labels": ids}
        if task == "seq2seq":
            src = torch.randint(0, i("V"), (i("B"), i("S_enc")), dtype=torch.long, device=device)
            return (), {"input_ids": src, "labels": ids}
        return (), {"input_ids": ids, "labels": ids}

    def loss(out, inputs) -> torch.Tensor:
        """The model's own loss from ``labels``: mean cross entropy over the target tokens (masked
        LM, seq2seq) or the images' classes."""
        return out.loss

    extra = {"config_class": cls, "model_type": model_type, "task": task, "model_class": model_cls.__name__,
             "attention": attention,
             "hidden_size_note": "hidden_size = M, apart from H*D (head_dim = D)" if has_m else "hidden_size = H*D",
             "config_overrides": {k: (v if isinstance(v, (int, float, bool, str, type(None))) else repr(v))
                                  for k, v in ov.items() if k not in base_kwargs or base_kwargs[k] != v}}
    if twins:
        extra["decoder_follows"] = ", ".join(f"{t} = {f}" for f, t in twins.items())
    if base_kwargs:
        extra["config_file"] = shown
    if model_type not in VERIFIED:
        extra["unverified"] = f"{shown} ({task}) is not among the verified families ({', '.join(VERIFIED)})"
    return ModelSpec(name=shown, symbols=symbols, defaults=defaults, build=build, make_inputs=make_inputs,
                     loss=loss, constraints=tuple(constraints), moduli=moduli, pin=pin, meanings=meanings, extra=extra,
                     record_context=hf.unpacked_masks, infer=_encdec_infer(task))


def _encdec_infer(task: str):
    """An encoder-decoder's inference steps (:mod:`symcost.frontends.hf_encdec`), None for the
    other tasks (no KV cache)."""
    from symcost.frontends import hf_encdec

    return hf_encdec.infer_for(task) if task in hf_encdec.TASKS else None


#: State-space (Mamba-1 style) config fields and the model's own symbols bound to them: a config
#: with all of these and no attention heads is traced by :func:`ssm_spec`.
SSM_FIELDS = {"M": "hidden_size", "L": "num_hidden_layers", "V": "vocab_size", "N_state": "state_size",
              "K_conv": "conv_kernel", "EXPAND": "expand", "R_dt": "time_step_rank"}


def is_ssm(cfg) -> bool:
    """Whether ``cfg`` is a selective state-space LM symcost traces by :func:`ssm_spec` (Mamba-1's
    fields :data:`SSM_FIELDS`, integers, and no attention heads nor Mamba-2's groups)."""
    return (all(isinstance(getattr(cfg, f, None), int) and not isinstance(getattr(cfg, f, None), bool)
                for f in SSM_FIELDS.values())
            and not isinstance(getattr(cfg, "num_attention_heads", None), int) and getattr(cfg, "n_groups", None) is None)


def ssm_spec(model_type: str, overrides: Mapping[str, str] | None = None, attention: str | None = None,
             base_kwargs: Mapping[str, Any] | None = None, name: str | None = None) -> ModelSpec:
    """The :class:`ModelSpec` of a selective state-space causal LM (``hf:mamba``:
    ``MambaForCausalLM``), trained on the model's own next-token loss.

    Symbols (the model's own, bound to the config's fields, :data:`SSM_FIELDS`): M = ``hidden_size``
    (d_model; Mamba has no heads, so no H or D), L, V, N_state = ``state_size`` (the SSM state per
    channel), K_conv = ``conv_kernel`` (the causal depthwise convolution's width), EXPAND =
    ``expand`` (inner width ``intermediate_size`` = EXPAND·M, as ``MambaConfig.__post_init__``
    derives it), R_dt = ``time_step_rank`` (the rank of the Δ projection; a config's ``"auto"`` is
    ⌈M/16⌉ at the config's M, fixed as the default: a ceiling is no polynomial, so ``--set M=...``
    leaves R_dt at the config's value unless set too).

    Inputs: ``input_ids`` and ``labels`` int64 ``[B, S]``. S is pinned at the request
    (:attr:`ModelSpec.pin`): transformers' CPU path of the selective scan
    (``modeling_mamba.mamba_selective_scan``, without the mamba-ssm CUDA kernels; its associative
    scan runs only under torch.compile) is a Python loop over the S positions, so the step's op list
    grows with S; the formulas are exact at that S and polynomial in every other symbol. The scan's
    FLOPs there: per position a state update (2 elementwise ops on [B, EXPAND·M, N_state]) and a
    [B, EXPAND·M, N_state] x [B, N_state, 1] matmul (2·B·EXPAND·M·N_state FLOPs, a model FLOP as
    FlopCounterMode counts bmm).

    Inference (``step="decode"`` / ``"prefill"``, ``symcost serve``): through the cache ``generate``
    builds, ``DynamicCache(config=...)`` of ``LinearAttentionLayer``s (:func:`symcost.frontends.hf.infer`):
    per layer a conv state [B, EXPAND·M, K_conv] and a recurrent (SSM) state [B, EXPAND·M, N_state],
    written in place, so a decode step's cost and the cache's bytes do not grow with T.

    Raises:
        SymcostError: an unknown or rejected config key, a config that is no Mamba-1 style SSM,
            an ``attention`` given (the model has none).
    """
    import transformers

    AutoConfig = transformers.AutoConfig
    shown = name or f"hf:{model_type}"
    if attention is not None:
        raise SymcostError(f"{shown} has no attention layers (a state-space model), so --attention does not apply; "
                           "leave it out")
    base_kwargs = dict(base_kwargs or {})
    base = hf._make_config(AutoConfig, model_type, base_kwargs)
    ov = hf._apply_overrides(AutoConfig, model_type, base, dict(overrides or {}), base_kwargs)
    cfg = hf._make_config(AutoConfig, model_type, ov)
    if not is_ssm(cfg):
        raise SymcostError(f"{shown}: {type(cfg).__name__} is no Mamba-1 style state-space model (symcost binds "
                           f"{', '.join(f'{s} = {f}' for s, f in SSM_FIELDS.items())})")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]
    symbols = tuple(SSM_FIELDS)
    # (S: every position is ~20 recorded ops per block while tracing, so the default is short)
    defaults = {"B": 8, "S": 128, **{s: getattr(cfg, f) for s, f in SSM_FIELDS.items()}}
    meanings = {"M": "model width d_model (hidden_size; the model has no attention heads)",
                "N_state": "SSM state size per inner channel (state_size)",
                "K_conv": "width of the causal depthwise convolution (conv_kernel)",
                "EXPAND": "inner-width factor (expand): intermediate_size = EXPAND*M",
                "R_dt": "rank of the time-step (delta) projection (time_step_rank; 'auto' is ceil(M/16) at the config's M)"}
    pin = {"S": ("transformers' CPU selective scan (mamba_selective_scan without mamba-ssm's CUDA kernels) is a "
                 "Python loop over the S positions: the op list grows with S, so formulas hold at this S "
                 "(another: --set S=...)")}

    def config_for(values: Mapping[str, int]):
        kw = dict(ov)
        for s, f in SSM_FIELDS.items():
            kw[f] = operator.index(values[s])
        kw["use_cache"] = False
        for key in hf._TOKEN_ATTRS:  # ids outside a small probe vocabulary would break the embedding
            t = kw.get(key, getattr(cfg, key, None))
            if isinstance(t, int) and t >= values["V"]:
                kw[key] = values["V"] - 1
        return hf._make_config(AutoConfig, model_type, kw)

    build = hf.head_builder(shown, (), symbols, model_cls, config_for, None)

    def make_inputs(values: Mapping[str, int], device) -> tuple[tuple, dict]:
        """``input_ids`` and ``labels``, int64 ``[B, S]`` in ``[0, V)``."""
        ids = torch.randint(0, operator.index(values["V"]), (operator.index(values["B"]), operator.index(values["S"])),
                            dtype=torch.long, device=device)
        return (), {"input_ids": ids, "labels": ids}

    def loss(out, inputs) -> torch.Tensor:
        """The model's own loss: mean cross entropy of logits[:, :-1] against labels[:, 1:]."""
        return out.loss

    extra = {"config_class": type(cfg).__name__, "model_type": model_type, "task": "causal-lm",
             "model_class": model_cls.__name__, "attention": "none (no attention layers)",
             "state_space": "selective scan, transformers' sequential CPU path",
             "config_overrides": {k: (v if isinstance(v, (int, float, bool, str, type(None))) else repr(v))
                                  for k, v in ov.items() if k not in base_kwargs or base_kwargs[k] != v}}
    if base_kwargs:
        extra["config_file"] = shown
    if model_type not in VERIFIED:
        extra["unverified"] = f"{shown} (causal-lm, state space) is not among the verified families ({', '.join(VERIFIED)})"
    return ModelSpec(name=shown, symbols=symbols, defaults=defaults, build=build, make_inputs=make_inputs, loss=loss,
                     pin=pin, meanings=meanings, extra=extra, record_context=hf.unpacked_masks,
                     infer=hf.infer)  # (generate's DynamicCache: per layer the conv and recurrent states)
