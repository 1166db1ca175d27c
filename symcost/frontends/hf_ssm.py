"""``hf:`` state-space and hybrid causal LMs beyond Mamba-1 (:func:`symcost.frontends.hf_tasks.ssm_spec`):
Mamba-2 (``hf:mamba2``: :func:`mamba2_spec`), the hybrid of attention, Mamba and
mixture-of-experts blocks Jamba (``hf:jamba``: :func:`hybrid_spec`) and Zamba2's Mamba-2 blocks
with shared transformer blocks (``hf:zamba2``: :func:`zamba2_spec`), and Zamba's multi-head Mamba
blocks with one shared transformer block (``hf:zamba``: :func:`zamba_spec`). Each
trains the model's own next-token loss (``input_ids`` and ``labels`` int64 ``[B, S]``), on
transformers' torch paths (its fallback where the mamba-ssm and causal-conv1d kernels are absent or do
not run on the device, as on CPU and the meta device).

Symbols (the model's own, bound to config fields; shared/conventions.md):

========== ==========================================================================================
symbol     config field
========== ==========================================================================================
H, D       Mamba-2: ``num_heads`` (SSM heads) and ``head_dim`` (channels per head, the SSD paper's
           P); the inner width ``H*D`` = ``expand * hidden_size``, so d_model = H·D/expand with
           ``expand`` a config value (default 2; ``--config expand=...``): H·D/EXPAND is no
           polynomial, so expand is no symbol. Jamba: the attention's heads and head dimension
           (``num_attention_heads``; d_model = H·D), with K, F, E, R as for causal LMs. Zamba2: the
           shared attention's heads and ``attention_head_dim`` (= 2·d_model/H: d_model = H·D/2),
           with K = ``num_key_value_heads`` (none with the attention adapters: K = H) and F.
           Zamba: H, D = ``attention_head_dim`` (a field of its own), K, M = ``hidden_size``, F
K          Mamba-2: ``n_groups``, the groups of heads sharing the SSM's B and C (H/K heads each, as
           grouped-query attention's K key/value heads serve H/K query heads: the SSD paper's
           grouped heads; K divides H, and K = 1, 1 < K < H, K = H are regimes as for attention)
N_state    ``state_size`` / ``mamba_d_state`` (the SSM state per channel)
K_conv     ``conv_kernel`` / ``mamba_d_conv`` (the causal depthwise convolution's width)
EXPAND     Jamba's ``mamba_expand`` (its Mamba blocks' inner width EXPAND·H·D)
R_dt       Jamba's and Zamba's ``mamba_dt_rank`` (the rank of the Δ projection)
L, V       ``num_hidden_layers``, ``vocab_size``
========== ==========================================================================================

Mamba-2's chunked scan (``modeling_mamba2.mamba2_chunk_scan``, the SSD algorithm in plain torch)
pads S up to whole chunks of ``chunk_size`` (a config value): c·⌈S/c⌉ is the constant c below one
chunk and S plus a constant within S's residue class mod c (class 0 runs no padding op), and one
chunk runs other ops than two or more, so S is probed in the request's regime
(:attr:`ModelSpec.pads`: 2 <= S < c, any class; or S's class mod c from two chunks on; S = c alone,
pinned) and is a formula there, as every other symbol of Mamba-2 is. The
depthwise convolution's padded output, B·(H·D + 2·K·N_state)·(S + K_conv − 1) elements, six
monomials in seven sizes, is fitted as the convolution's channels (a size fitted before) times the
rest (``symcost.tracing.fit.Fitter._fit_factored``). Jamba pins L (its blocks are not alike) and S
(its Mamba blocks' CPU scan loops over S); Zamba2 pins L (Mamba-2 and hybrid blocks); Zamba pins L
and S (its CPU scan).

Inference (``step="prefill"`` / ``"decode"``, ``symcost serve``; docs/inference.md): every family
runs through the cache ``generate`` builds, ``DynamicCache(config=...)`` (or ``StaticCache``), by
:func:`symcost.frontends.hf.infer`; transformers picks each layer's class from the config's
``layer_types``: a Mamba or Mamba-2 block a ``LinearAttentionLayer`` (its conv state and SSM state,
fixed in size, written in place), Jamba's attention blocks a ``DynamicLayer`` (keys and values,
one token more per step), Zamba's and Zamba2's hybrid blocks a ``LinearAttentionAndFullAttentionLayer``
(the shared attention's keys and values and the Mamba block's states).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Mapping

import torch

from symcost.errors import SymcostError
from symcost.frontends import hf
from symcost.frontends.spec import Constraint, ModelSpec

#: Families checked (transformers 5.x, torch 2.13) against FlopCounterMode, saved_tensors_hooks and
#: a meta count at random tiny sizes (tests/test_hf_ssm.py).
VERIFIED = ("mamba2", "jamba", "zamba", "zamba2")

#: Mamba-2's symbols and the config fields they set (``hidden_size`` = H*D/expand is built).
MAMBA2_FIELDS = {"H": "num_heads", "D": "head_dim", "K": "n_groups", "N_state": "state_size",
                 "K_conv": "conv_kernel", "L": "num_hidden_layers", "V": "vocab_size"}


#: A hybrid's Mamba-block symbols and the config fields they set (Jamba's names).
HYBRID_SSM_FIELDS = {"jamba": {"N_state": "mamba_d_state", "K_conv": "mamba_d_conv", "EXPAND": "mamba_expand",
                               "R_dt": "mamba_dt_rank"}}


def handles(model_type: str) -> bool:
    """Whether ``hf:model_type`` (a causal LM) is traced by this module."""
    return model_type in ("mamba2", "zamba", "zamba2") or model_type in HYBRID_SSM_FIELDS


def spec(model_type: str, overrides: Mapping[str, str] | None = None, attention: str | None = None,
         base_kwargs: Mapping[str, Any] | None = None, name: str | None = None) -> ModelSpec:
    """The :class:`ModelSpec` of ``hf:model_type`` (one :func:`handles`); arguments as
    :func:`symcost.frontends.hf.spec`. Raises SymcostError as :func:`mamba2_spec` and :func:`hybrid_spec`."""
    if model_type == "mamba2":
        return mamba2_spec(model_type, overrides, attention, base_kwargs, name)
    if model_type == "zamba2":
        return zamba2_spec(model_type, overrides, attention, base_kwargs, name)
    if model_type == "zamba":
        return zamba_spec(model_type, overrides, attention, base_kwargs, name)
    return hybrid_spec(model_type, overrides, attention, base_kwargs, name)


def _tokens_inside(kw: dict, cfg, V: int) -> None:
    for key in hf._TOKEN_ATTRS:  # ids outside a small probe vocabulary would break the embedding
        t = kw.get(key, getattr(cfg, key, None))
        if isinstance(t, int) and t >= V:
            kw[key] = V - 1


def _inputs(values: Mapping[str, int], device) -> tuple[tuple, dict]:
    """``input_ids`` and ``labels``, int64 ``[B, S]`` in ``[0, V)``."""
    ids = torch.randint(0, operator.index(values["V"]), (operator.index(values["B"]), operator.index(values["S"])),
                        dtype=torch.long, device=device)
    return (), {"input_ids": ids, "labels": ids}


def _loss(out, inputs) -> torch.Tensor:
    """The model's own loss: mean cross entropy of logits[:, :-1] against labels[:, 1:]."""
    return out.loss


def _extra(cfg, model_type, model_cls, ov, base_kwargs, shown, **more) -> dict:
    extra = {"config_class": type(cfg).__name__, "model_type": model_type, "task": "causal-lm",
             "model_class": model_cls.__name__, **more,
             "config_overrides": {k: (v if isinstance(v, (int, float, bool, str, type(None))) else repr(v))
                                  for k, v in ov.items() if k not in base_kwargs or base_kwargs[k] != v}}
    if base_kwargs:
        extra["config_file"] = shown
    if model_type not in VERIFIED:
        extra["unverified"] = f"{shown} is not among the verified state-space families ({', '.join(VERIFIED)})"
    return extra


def mamba2_spec(model_type: str, overrides: Mapping[str, str] | None = None, attention: str | None = None,
                base_kwargs: Mapping[str, Any] | None = None, name: str | None = None) -> ModelSpec:
    """The :class:`ModelSpec` of a Mamba-2 causal LM (``hf:mamba2``: ``Mamba2ForCausalLM``, the
    state space duality of Dao & Gu 2024), trained on the model's own next-token loss.

    Symbols (:data:`MAMBA2_FIELDS`): H = ``num_heads``, D = ``head_dim``, K = ``n_groups``,
    N_state = ``state_size``, K_conv = ``conv_kernel``, L, V; d_model ``hidden_size`` = H·D/EXPAND
    (``Mamba2Config`` requires ``hidden_size * expand == num_heads * head_dim``; ``expand`` stays a
    config value). ``chunk_size`` is a config value and S is probed within its regime: below one
    chunk, or its class modulo ``chunk_size`` from two chunks on (module docstring).
    ``time_step_rank`` is unused by the model (Δ comes out of ``in_proj``, one per head), so no
    symbol.

    Per block (transformers' ``Mamba2Mixer`` without kernels): ``in_proj`` M → 2·H·D + 2·K·N_state + H,
    a depthwise causal conv1d of width K_conv over H·D + 2·K·N_state channels, the chunked scan
    (per chunk of c positions: C·Bᵀ scores [c, c] per head, their product with X, the chunk's state
    Bᵀ·X [D, N_state] per head, the chunk-to-chunk recurrence and C·state), a gated RMSNorm over K
    groups and ``out_proj`` H·D → M. The scan's einsums are bmm's, model FLOPs as FlopCounterMode
    counts them.

    Raises:
        SymcostError: an unknown or rejected config key, ``attention`` given (the model has none).
    """
    shown = name or f"hf:{model_type}"
    if attention is not None:
        raise SymcostError(f"{shown} has no attention layers (a state-space model), so --attention does not apply; "
                           "leave it out")
    AutoConfig, base_kwargs, ov, cfg = hf.configs(model_type, overrides, base_kwargs)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]
    expand, chunk = int(cfg.expand), int(cfg.chunk_size)
    symbols = tuple(MAMBA2_FIELDS)
    defaults = {"B": 8, "S": 2 * chunk, **{s: getattr(cfg, f) for s, f in MAMBA2_FIELDS.items()}}
    constraints = (Constraint("divides", "K", "H", "K (n_groups) must divide H (num_heads): each group's B and C "
                              "serve H/K heads"),
                   Constraint("multiple", "H*D", expand, f"H*D must be a multiple of expand={expand} (Mamba2Config: "
                              "hidden_size * expand == num_heads * head_dim; another expand: --config expand=...)"))
    meanings = {"H": "SSM heads (num_heads)", "D": "channels per SSM head (head_dim)",
                "K": "groups of SSM heads sharing B and C (n_groups; H/K heads per group, as grouped-query attention)",
                "N_state": "SSM state size per head channel (state_size)",
                "K_conv": "width of the causal depthwise convolution (conv_kernel)",
                "L": "number of Mamba-2 blocks",
                "S": f"tokens per sequence (the scan pads them to whole chunks of {chunk}; --config chunk_size=...)"}
    # hidden_size = H*D/expand: the probes keep H and D in the request's classes mod expand, so
    # that H*D stays a multiple of expand; the scan pads S up to whole chunks, c*ceil(S/c) = S plus
    # a constant within S's class mod chunk_size (and no padding op at all in class 0): S keeps its
    # class too. The depthwise convolution's padded output, whose storage its SiLU saves, holds
    # B*(H*D + 2*K*N_state)*(S + K_conv - 1) elements: six monomials in seven sizes, fitted as the
    # convolution's channels (a size fitted before) times B*(S + K_conv - 1) (fit.Fitter._fit_factored)
    moduli = {"H": expand, "D": expand} if expand > 1 else {}
    # (S below one chunk: one padded chunk of constant length, S a formula for 2 <= S < chunk;
    # from two chunks on, S's class mod chunk: ModelSpec.pads)
    pads = {"S": chunk} if chunk > 1 else {}
    pin: dict[str, str] = {}

    def config_for(values: Mapping[str, int]):
        kw = dict(ov)
        for s, f in MAMBA2_FIELDS.items():
            kw[f] = operator.index(values[s])
        kw["hidden_size"] = kw["num_heads"] * kw["head_dim"] // expand
        kw["use_cache"] = False
        _tokens_inside(kw, cfg, kw["vocab_size"])
        return hf._make_config(AutoConfig, model_type, kw)

    build = hf.head_builder(shown, constraints, symbols, model_cls, config_for, None)

    extra = _extra(cfg, model_type, model_cls, ov, base_kwargs, shown, attention="none (no attention layers)",
                   state_space=f"chunked SSD scan (chunks of {chunk}), transformers' torch path",
                   hidden_size_note=f"hidden_size = H*D/{expand} (expand = {expand})")
    return ModelSpec(name=shown, symbols=symbols, defaults=defaults, build=build, make_inputs=_inputs, loss=_loss,
                     constraints=constraints, moduli=moduli, pads=pads, pin=pin, meanings=meanings,
                     extra=extra, record_context=hf.unpacked_masks, infer=hf.infer)


def hybrid_spec(model_type: str, overrides: Mapping[str, str] | None = None, attention: str | None = None,
                base_kwargs: Mapping[str, Any] | None = None, name: str | None = None) -> ModelSpec:
    """The :class:`ModelSpec` of a hybrid of attention and Mamba blocks (``hf:jamba``:
    ``JambaForCausalLM``; Lieber et al. 2024), trained on the model's own next-token loss.

    The attention, feed-forward and mixture-of-experts symbols are the causal LM's
    (:func:`symcost.frontends.hf.spec`: H, D, K, L, V, F, E, R; d_model = H·D; the experts traced
    under the balanced routing model, :mod:`symcost.frontends.moe`); the Mamba blocks add the
    model's own (:data:`HYBRID_SSM_FIELDS`): N_state = ``mamba_d_state``, K_conv = ``mamba_d_conv``,
    EXPAND = ``mamba_expand`` (inner width EXPAND·H·D), R_dt = ``mamba_dt_rank``.

    Pinned (:attr:`ModelSpec.pin`, the reasons in the report): L, since the blocks are not alike
    (attention every ``attn_layer_period`` blocks from ``attn_layer_offset``, Mamba elsewhere; a
    mixture of experts every ``expert_layer_period`` from ``expert_layer_offset``, a dense MLP
    elsewhere: traced unfolded at the request's L, the periods and offsets config values); S, since
    the Mamba blocks' CPU selective scan (``modeling_jamba.mamba_selective_scan`` without mamba-ssm's
    kernels; its associative scan runs only under torch.compile) is a Python loop over the S
    positions, as for ``hf:mamba``.

    Raises:
        SymcostError: as :func:`symcost.frontends.hf.spec` (an unknown or rejected config key, a bad
            attention implementation).
    """
    fields = HYBRID_SSM_FIELDS[model_type]
    overrides = dict(overrides or {})
    base = hf.spec(model_type, overrides, attention, base_kwargs=base_kwargs, name=name)
    shown = base.name
    _, _, ov, cfg = hf.configs(model_type, overrides, base_kwargs)
    own = {s: getattr(cfg, f) for s, f in fields.items()}
    for s, v in own.items():
        if not isinstance(v, int) or isinstance(v, bool):
            raise SymcostError(f"{shown}: {type(cfg).__name__}.{fields[s]} is {v!r}; symcost binds {s} to it: set "
                               f"--config {fields[s]}=N")
    symbols = base.symbols + tuple(own)

    def build(values: Mapping[str, int]) -> torch.nn.Module:
        """The model for these symbol values (the Mamba fields set from them), in train mode."""
        more = {**overrides, **{f: str(operator.index(values[s])) for s, f in fields.items()}}
        return hf.spec(model_type, more, attention, base_kwargs=base_kwargs, name=name).build(values)

    kinds = ", ".join(f"{k}={getattr(cfg, k)}" for k in ("attn_layer_period", "attn_layer_offset",
                                                           "expert_layer_period", "expert_layer_offset")
                      if hasattr(cfg, k))
    pin = {"L": (f"the blocks are not alike (attention or Mamba, mixture of experts or dense MLP by layer index: "
                 f"{kinds}): traced unfolded at this L (another: --set L=...)"),
           "S": ("transformers' CPU selective scan (mamba_selective_scan without mamba-ssm's CUDA kernels) is a "
                 "Python loop over the S positions: the op list grows with S, so formulas hold at this S "
                 "(another: --set S=...)")}
    meanings = {**base.meanings,
                "L": "number of blocks (attention or Mamba mixer, each with an MLP or a mixture of experts)",
                "N_state": f"SSM state size per inner channel ({fields['N_state']})",
                "K_conv": f"width of the causal depthwise convolution ({fields['K_conv']})",
                "EXPAND": f"inner-width factor of the Mamba blocks ({fields['EXPAND']}): inner width EXPAND*H*D",
                "R_dt": f"rank of the time-step (delta) projection ({fields['R_dt']})"}
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    extra = {**base.extra, "task": "causal-lm", "model_class": MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)].__name__,
             "state_space": "selective scan (Mamba blocks), transformers' sequential CPU path", "layer_pattern": kinds}
    extra.pop("unverified", None)
    if model_type not in VERIFIED:
        extra["unverified"] = f"{shown} is not among the verified state-space families ({', '.join(VERIFIED)})"
    return dataclasses.replace(base, symbols=symbols, defaults={**base.defaults, "B": 8, "S": 64, **own},
                               build=build, pin={**base.pin, **pin}, meanings=meanings, extra=extra,
                               check=None, infer=hf.infer)


#: Zamba2's symbols and the config fields they set (``hidden_size`` = H*D/2 is built).
ZAMBA2_FIELDS = {"H": "num_attention_heads", "K": "num_key_value_heads", "F": "intermediate_size",
                 "N_state": "mamba_d_state", "K_conv": "mamba_d_conv", "L": "num_hidden_layers", "V": "vocab_size"}


def _zamba_config(model_type: str, overrides, attention: str | None, base_kwargs):
    """``(AutoConfig, base_kwargs, overrides, config, causal-LM class, attention)`` of a Zamba or
    Zamba2 spec: :func:`symcost.frontends.hf.configs`, the class AutoModelForCausalLM builds, and
    the attention implementation (transformers' default where None).

    Raises:
        SymcostError: an unknown or rejected config key, an unknown attention implementation."""
    AutoConfig, base_kwargs, ov, cfg = hf.configs(model_type, overrides, base_kwargs)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]
    if attention is None:
        attention = "sdpa" if getattr(model_cls, "_supports_sdpa", False) else "eager"
    elif attention not in hf.ATTENTION:
        raise SymcostError(f"unknown attention implementation {attention!r}; accepted: {', '.join(hf.ATTENTION)}")
    return AutoConfig, base_kwargs, ov, cfg, model_cls, attention


def zamba2_spec(model_type: str, overrides: Mapping[str, str] | None = None, attention: str | None = None,
                base_kwargs: Mapping[str, Any] | None = None, name: str | None = None) -> ModelSpec:
    """The :class:`ModelSpec` of Zamba2 (``hf:zamba2``: ``Zamba2ForCausalLM``; Glorioso et al. 2024):
    Mamba-2 blocks, and at the ``"hybrid"`` entries of ``layers_block_type`` a shared transformer
    block (attention over the concatenated hidden state and input embeddings, width 2·d_model, and
    an MLP; ``num_mem_blocks`` of them, reused in turn, with LoRA adapters where
    ``use_shared_attention_adapter``) before the Mamba-2 block; trained on the next-token loss.

    Symbols (:data:`ZAMBA2_FIELDS`): H = ``num_attention_heads``, D = ``attention_head_dim``
    (= 2·``hidden_size``/H as ``Zamba2Config`` derives it; so d_model = H·D/2 is built), K =
    ``num_key_value_heads`` (no symbol with ``use_shared_attention_adapter``: the adapters add an
    H·D-wide projection to the K·D-wide keys and values, which transformers runs only with K = H,
    so K = H is built), F = ``intermediate_size``, N_state = ``mamba_d_state``, K_conv =
    ``mamba_d_conv``, L, V. ``n_mamba_heads``, ``mamba_ngroups``, ``mamba_expand``, ``adapter_rank``
    and ``num_mem_blocks`` stay config values (the Mamba head width ``mamba_expand``·d_model/
    ``n_mamba_heads`` is then H·D times a constant; the probes keep H and D in the request's classes
    mod 2·``n_mamba_heads``, so it stays whole).

    Pinned (stated): L (``layers_block_type`` mixes Mamba and hybrid blocks, followed by its shortest
    period: traced unfolded). S is a formula within its class mod ``chunk_size`` and K_conv a
    formula, as for :func:`mamba2_spec`.

    Raises:
        SymcostError: an unknown or rejected config key, a bad attention implementation.
    """
    shown = name or f"hf:{model_type}"
    AutoConfig, base_kwargs, ov, cfg, model_cls, attention = _zamba_config(model_type, overrides, attention,
                                                                           base_kwargs)
    nm, expand = int(cfg.n_mamba_heads), int(cfg.mamba_expand)
    symbols = ("H", "D", *[s for s in ZAMBA2_FIELDS if s != "H"])
    defaults = {"B": 8, "S": 64, **{s: getattr(cfg, f) for s, f in ZAMBA2_FIELDS.items()},
                "D": int(cfg.attention_head_dim)}
    constraints = (Constraint("divides", "K", "H", "K must divide H: each of the K key/value heads serves H/K "
                              "query heads"),)
    # with use_shared_attention_adapter the adapters add a [B, S, H*D] projection to the keys and
    # values, which have K*D channels: transformers runs it only with K = H, so K is no size of its own
    has_k = not cfg.use_shared_attention_adapter
    fields = {s: f for s, f in ZAMBA2_FIELDS.items() if has_k or s != "K"}
    if not has_k:
        constraints = ()
        symbols = tuple(x for x in symbols if x != "K")
        defaults.pop("K")
    moduli = {"H": 2 * nm, "D": 2 * nm}
    constraints += (Constraint("multiple", "D", 2, "D must be even (Zamba2Config's rotary validation pairs the "
                               "attention head dimension, also without use_mem_rope)"),
                    Constraint("multiple", "H*D", 2, "H*D must be even (d_model = H*D/2)"),
                    Constraint("multiple", f"{expand}*H*D/2", nm,
                               f"mamba_expand*H*D/2 must be a multiple of n_mamba_heads={nm} (the Mamba heads' width "
                               f"mamba_expand*d_model/n_mamba_heads, d_model = H*D/2; mamba_expand = {expand})"))

    pattern = list(cfg.layers_block_type)

    def config_for(values: Mapping[str, int]):
        kw = dict(ov)
        for s, f in fields.items():
            kw[f] = operator.index(values[s])
        if not has_k:
            kw["num_key_value_heads"] = kw["num_attention_heads"]
        kw["hidden_size"] = operator.index(values["H"]) * operator.index(values["D"]) // 2
        kw["layers_block_type"] = hf._resize_pattern(pattern, kw["num_hidden_layers"])
        kw["use_cache"] = False
        _tokens_inside(kw, cfg, kw["vocab_size"])
        c = hf._make_config(AutoConfig, model_type, kw)
        c._attn_implementation = attention
        return c

    build = hf.head_builder(shown, constraints, symbols, model_cls, config_for, attention)

    # S and K_conv are formulas as for mamba2_spec: S below one chunk, or within its class mod
    # chunk_size from two chunks on (the scan pads S to whole chunks: ModelSpec.pads), the
    # convolution's padded output fitted as its channels times the rest
    pads = {"S": int(cfg.chunk_size)} if int(cfg.chunk_size) > 1 else {}
    pin = {"L": ("layers_block_type mixes Mamba-2 blocks and hybrid blocks (a shared transformer block before the "
                 "Mamba-2 block): traced unfolded at this L, the pattern followed by its shortest period "
                 "(another: --set L=...)")}
    meanings = {"H": "attention heads of the shared transformer blocks (num_attention_heads)",
                "D": "per-head dimension of the shared attention (attention_head_dim = 2*hidden_size/H): d_model = H*D/2",
                "L": "number of blocks (Mamba-2, or hybrid: a shared transformer block, then Mamba-2)",
                "F": "feed-forward width of the shared blocks' MLP (intermediate_size)",
                "N_state": "SSM state size per head channel (mamba_d_state)",
                "K_conv": "width of the causal depthwise convolution (mamba_d_conv)"}
    extra = _extra(cfg, model_type, model_cls, ov, base_kwargs, shown, attention=attention,
                   state_space="chunked SSD scan (Mamba-2 blocks), transformers' torch path",
                   hidden_size_note="hidden_size = H*D/2 (attention_head_dim = D)",
                   config_values=f"n_mamba_heads={nm}, mamba_expand={expand}, mamba_ngroups={cfg.mamba_ngroups}, "
                                 f"num_mem_blocks={cfg.num_mem_blocks}, adapter_rank={cfg.adapter_rank}")
    # (the config's None is K = H: K follows H unless set)
    follows = {"K": "H"} if has_k and cfg.num_key_value_heads == cfg.num_attention_heads else {}
    return ModelSpec(name=shown, symbols=symbols, defaults=defaults, build=build, make_inputs=_inputs, loss=_loss,
                     constraints=constraints, moduli=moduli, pads=pads, pin=pin, meanings=meanings,
                     extra=extra, follows=follows, record_context=hf.unpacked_masks, infer=hf.infer)


#: Zamba's symbols and the config fields they set.
ZAMBA_FIELDS = {"H": "num_attention_heads", "D": "attention_head_dim", "K": "num_key_value_heads",
                "M": "hidden_size", "F": "intermediate_size", "N_state": "mamba_d_state", "K_conv": "mamba_d_conv",
                "R_dt": "mamba_dt_rank", "L": "num_hidden_layers", "V": "vocab_size"}


def zamba_spec(model_type: str, overrides: Mapping[str, str] | None = None, attention: str | None = None,
               base_kwargs: Mapping[str, Any] | None = None, name: str | None = None) -> ModelSpec:
    """The :class:`ModelSpec` of Zamba (``hf:zamba``: ``ZambaForCausalLM``; Glorioso et al. 2024,
    Zamba-7B-v1): multi-head Mamba blocks and, every ``attn_layer_period`` blocks from
    ``attn_layer_offset``, one shared transformer block (attention over the concatenated hidden state
    and input embeddings, ``attention_hidden_size`` = 2·d_model wide, and an MLP) with a per-use
    linear map, before the Mamba block; trained on the next-token loss.

    Symbols (:data:`ZAMBA_FIELDS`): H, D = ``attention_head_dim`` (a field of its own: the query
    projection maps 2·M to H·D), K, M = ``hidden_size``, F = ``intermediate_size``, N_state =
    ``mamba_d_state``, K_conv = ``mamba_d_conv``, R_dt = ``mamba_dt_rank`` (a config's ``"auto"`` is
    ⌈M/16⌉ at the config's M, kept as the default), L, V. ``n_mamba_heads`` (transformers loops over
    the heads) and ``mamba_expand`` stay config values; the probes keep M in the request's class mod
    ``n_mamba_heads`` (each head is ``mamba_expand``·M/``n_mamba_heads`` wide).

    Pinned (stated): L (Mamba and hybrid blocks by layer index) and S (the Mamba blocks' CPU scan is
    a Python loop over the S positions, as for ``hf:mamba``).

    Constraint L >= ``attn_layer_offset`` + 4 (data): ZambaConfig's blocks are Mamba, Mamba, hybrid,
    then hybrid at 3 + i for i % ``attn_layer_period`` == ``attn_layer_offset``
    (``configuration_zamba.ZambaConfig.__post_init__``), and ``modeling_zamba.ZambaModel`` builds
    only with a second hybrid block (its ``_tied_weights_keys`` ties the first one's shared block to
    the others'; with one, ``post_init`` raises).

    Raises:
        SymcostError: an unknown or rejected config key, a bad attention implementation, an
            ``attn_layer_offset`` outside [0, ``attn_layer_period``) (one hybrid block at any L).
    """
    shown = name or f"hf:{model_type}"
    AutoConfig, base_kwargs, ov, cfg, model_cls, attention = _zamba_config(model_type, overrides, attention,
                                                                           base_kwargs)
    nm, expand = int(cfg.n_mamba_heads), int(cfg.mamba_expand)
    period, offset = int(cfg.attn_layer_period), int(cfg.attn_layer_offset)
    if not 0 <= offset < period:  # (ZambaConfig: hybrid at block 2, then at 3 + i for i % period == offset)
        raise SymcostError(f"{shown}: attn_layer_offset={offset} with attn_layer_period={period} leaves one hybrid "
                           "block at any L (block 2; the others are at 3 + i for i % period == offset), and "
                           "transformers' ZambaModel builds only with two or more (it ties the first one's shared "
                           "transformer block to the others'); give 0 <= attn_layer_offset < attn_layer_period")
    symbols = tuple(ZAMBA_FIELDS)
    defaults = {"B": 8, "S": 64, **{s: getattr(cfg, f) for s, f in ZAMBA_FIELDS.items()}}
    constraints = (Constraint("divides", "K", "H", "K must divide H: each of the K key/value heads serves H/K "
                              "query heads"),
                   Constraint("min", "L", offset + 4,
                              f"L must be at least {offset + 4}: transformers' ZambaModel builds only with two or more "
                              "hybrid blocks (it ties the first one's shared transformer block to the others'), and "
                              "ZambaConfig's blocks are Mamba, Mamba, hybrid, then a hybrid at 3 + i for each i with "
                              f"i % attn_layer_period == attn_layer_offset (period {period}, offset {offset}: the "
                              f"second hybrid is block {offset + 3})"),
                   Constraint("multiple", f"{expand}*M", nm, f"mamba_expand*M must be a multiple of n_mamba_heads={nm} "
                              f"(each Mamba head is mamba_expand*M/n_mamba_heads wide; mamba_expand = {expand})"))
    moduli = {"M": nm} if nm > 1 else {}

    def config_for(values: Mapping[str, int]):
        kw = dict(ov)
        for s, f in ZAMBA_FIELDS.items():
            kw[f] = operator.index(values[s])
        kw["attention_hidden_size"] = 2 * kw["hidden_size"]  # (the concatenated hidden state and embeddings)
        kw.pop("layers_block_type", None)  # (derived from attn_layer_period/offset at this L)
        kw["use_cache"] = False
        _tokens_inside(kw, cfg, kw["vocab_size"])
        c = hf._make_config(AutoConfig, model_type, kw)
        c._attn_implementation = attention
        return c

    build = hf.head_builder(shown, constraints, symbols, model_cls, config_for, attention)

    kinds = f"attn_layer_period={cfg.attn_layer_period}, attn_layer_offset={cfg.attn_layer_offset}"
    pin = {"L": (f"Mamba blocks and hybrid blocks (the shared transformer block, then Mamba) by layer index ({kinds}): "
                 "traced unfolded at this L (another: --set L=...)"),
           "S": ("transformers' CPU selective scan (without mamba-ssm's CUDA kernels) is a Python loop over the S "
                 "positions: the op list grows with S, so formulas hold at this S (another: --set S=...)")}
    meanings = {"H": "attention heads of the shared transformer block (num_attention_heads)",
                "D": "per-head dimension of the shared attention (attention_head_dim)",
                "M": "model width d_model (hidden_size); the shared attention reads 2*M (hidden state and embeddings)",
                "L": "number of blocks (Mamba, or hybrid: the shared transformer block, then Mamba)",
                "F": "feed-forward width of the shared block's MLP (intermediate_size)",
                "N_state": "SSM state size per inner channel (mamba_d_state)",
                "K_conv": "width of the causal depthwise convolution (mamba_d_conv)",
                "R_dt": "rank of the time-step (delta) projection (mamba_dt_rank)"}
    follows = {"K": "H"} if cfg.num_key_value_heads == cfg.num_attention_heads else {}
    extra = _extra(cfg, model_type, model_cls, ov, base_kwargs, shown, attention=attention,
                   state_space="multi-head selective scan (Mamba blocks), transformers' sequential CPU path",
                   layer_pattern=kinds, config_values=f"n_mamba_heads={nm}, mamba_expand={expand}")
    return ModelSpec(name=shown, symbols=symbols, defaults=defaults, build=build, make_inputs=_inputs, loss=_loss,
                     constraints=constraints, moduli=moduli, pin=pin, meanings=meanings, extra=extra,
                     follows=follows, record_context=hf.unpacked_masks, infer=hf.infer)
