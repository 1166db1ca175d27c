"""``hf:MODEL_TYPE``, ``hf:ORG/NAME`` and ``path/config.json``: a Hugging Face ``transformers``
causal LM built from a config.

Nothing is downloaded: ``hf:MODEL_TYPE`` starts from ``transformers.AutoConfig.for_model(MODEL_TYPE)``
(the library's built-in defaults), a ``config.json`` file (``symcost report path/config.json``) or
``hf:ORG/NAME`` (the ``config.json`` of that repository in the local Hugging Face cache, never the
network) from the values in the file, whose sizes become the defaults. The user's
``--config key=value`` overrides come on top, and the model is ``AutoModelForCausalLM.from_config``
on whatever device the caller has made current (``meta`` for tracing). Symbol binding
(shared/conventions.md):

====== ===========================================================================================
symbol config attribute
====== ===========================================================================================
H      ``num_attention_heads``
D      ``head_dim`` where the config has one (not None), else ``hidden_size / num_attention_heads``
M      ``hidden_size``, a symbol only where the config sets it apart from ``head_dim`` (a
       settable ``head_dim`` that does not follow ``hidden_size``: qwen3, gemma, a file or
       ``--config`` giving ``head_dim``); elsewhere ``hidden_size`` is built as ``H*D``
L      ``num_hidden_layers``
V      ``vocab_size``
F      ``intermediate_size`` (``ffn_dim`` for opt, ``n_inner`` for gpt2/gptj when set) when the
       config sets it on its own; a width the config derives from ``hidden_size`` (gpt2's
       ``n_inner=None``, falcon's ``ffn_hidden_size``) is no symbol: it comes out of the trace
K      ``num_key_value_heads`` wherever the config has it; where the config leaves it unset (None:
       multi-head attention) K follows H unless the user sets K (``ModelSpec.follows``). Its regime
       (K = 1, 1 < K < H, K = H) is not fixed here: ``symcost.trace`` traces the one the
       requested sizes are in (K = H ties K to H where that changes the ops; K = 1 pins K)
====== ===========================================================================================

Sizes PyTorch rejects are :class:`~symcost.frontends.spec.Constraint` s (K divides H; an even rotary
dimension; D at least a fixed ``rotary_dim``; S within a learned position table), checked before
tracing. Sizes that only change which ops run (K = H, K = 1, ALiBi slopes of a head count that is
not a power of two, D equal to ``rotary_dim``) are regimes, not errors.

Every build re-runs the config class's constructor with the overrides and the symbol values, so
attributes the config derives from the sizes (falcon's ``ffn_hidden_size``, opt's
``word_embed_proj_dim``, qwen's per-layer ``layer_types``) follow the symbols the way they would
for a user writing ``LlamaConfig(hidden_size=...)``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import operator
from math import lcm as _lcm
from typing import Any, Mapping

import torch

from symcost.frontends import moe
from symcost.errors import SymcostError
from symcost.frontends.hf_infer import infer  # noqa: F401 - the inference call of hf: specs (hf.infer)
from symcost.frontends.spec import Constraint, ModelSpec, check_constraints

#: Decoder architectures checked (transformers 5.24, torch 2.13) to build from their default config,
#: run forward + loss + backward with real CPU tensors and under ``FakeTensorMode`` (built on
#: ``meta``), and trace the same aten op sequence at two size tuples with the same L, with eager and
#: sdpa attention (bloom: eager only, transformers has no sdpa for it); phi, gemma (d_model apart
#: from H*D: the symbol M) and gptj (a fixed rotary_dim) with eager attention. tests/test_regimes.py
#: checks each at random sizes in every regime against PyTorch's own measurements.
VERIFIED = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gpt2",
    "gpt_neox",
    "opt",
    "olmo",
    "olmo2",
    "stablelm",
    "falcon",
    "granite",
    "starcoder2",
    "bloom",
    "phi",
    "gemma",
    "gptj",
)

#: Dotted path of the ModuleList holding the L blocks, for the architectures we know.
_LAYERS = {
    "llama": "model.layers",
    "phi": "model.layers",
    "mistral": "model.layers",
    "qwen2": "model.layers",
    "qwen3": "model.layers",
    "phi3": "model.layers",
    "gemma": "model.layers",
    "olmo": "model.layers",
    "olmo2": "model.layers",
    "stablelm": "model.layers",
    "granite": "model.layers",
    "starcoder2": "model.layers",
    "gpt2": "transformer.h",
    "gptj": "transformer.h",
    "falcon": "transformer.h",
    "bloom": "transformer.h",
    "gpt_neox": "gpt_neox.layers",
    "opt": "model.decoder.layers",
}

ATTENTION = ("eager", "sdpa")

#: Config attributes that may set the feed-forward width F, first present and not None wins.
_F_ATTRS = ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size")
#: Token ids that must lie inside the vocabulary (pad_token_id becomes the embedding's padding_idx).
_TOKEN_ATTRS = ("pad_token_id", "bos_token_id", "eos_token_id")

_NEED_TRANSFORMERS = (
    "hf: models need the optional dependency transformers; install it with: pip install 'symcost[hf]'"
)


def parse_value(text: str) -> Any:
    """Parse one ``--config`` value without eval: int, then float, then a JSON list of numbers,
    then true/false/none, else str.

    ``"8"`` -> 8, ``"1e-5"`` -> 1e-05, ``"[3,3,9,3]"`` -> [3, 3, 9, 3], ``"True"`` -> True,
    ``"none"``/``"null"`` -> None, ``"silu"`` -> ``"silu"``. Raises nothing.
    """
    s = text.strip()
    try:
        return int(s)
    except ValueError:
        pass
    try:
        return float(s)
    except ValueError:
        pass
    if s.startswith("[") and s.endswith("]"):  # a list of numbers (a staged model's depths=[3,3,9,3])
        import json

        try:
            got = json.loads(s)
        except ValueError:
            got = None
        if isinstance(got, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in got):
            return got
    low = s.lower()
    if low == "true":
        return True
    if low == "false":
        return False
    if low in ("none", "null"):
        return None
    return text


def _import_transformers():
    try:
        import transformers  # noqa: F401
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError as e:
        raise SymcostError(_NEED_TRANSFORMERS) from e
    return AutoConfig, AutoModelForCausalLM, CONFIG_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def _config_keys(cfg) -> set[str]:
    """Names a ``--config`` key may take: the config class's fields and its attribute_map aliases."""
    keys = set(getattr(type(cfg), "attribute_map", {}) or {})
    if dataclasses.is_dataclass(cfg):
        keys |= {f.name for f in dataclasses.fields(cfg)}
    keys |= {k for k in cfg.to_dict() if not k.startswith("_")}
    keys -= {"model_type", "transformers_version", "architectures"}
    return keys


def _field_name(cfg, key: str) -> str:
    """The constructor field behind a standard name (gpt2: ``num_attention_heads`` -> ``n_head``)."""
    return (getattr(type(cfg), "attribute_map", {}) or {}).get(key, key)


def _is_field(cfg, key: str) -> bool:
    return dataclasses.is_dataclass(cfg) and key in {f.name for f in dataclasses.fields(cfg)}


def _make_config(AutoConfig, model_type: str, kwargs: Mapping[str, Any]):
    """``AutoConfig.for_model(model_type, **kwargs)``, its log warnings silenced (starcoder2's own
    defaults warn that bos/eos ids lie outside its vocabulary); failures become SymcostError."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return AutoConfig.for_model(model_type, **kwargs)
    except Exception as e:  # noqa: BLE001 - config constructors validate with any exception type
        shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        why = " ".join(str(e).split())  # one line: config validators print multi-line messages
        raise SymcostError(f"hf:{model_type}: the config rejected {shown}: {type(e).__name__}: {why}") from e
    finally:
        hf_logging.set_verbosity(level)


def _reads_head_dim(model_type: str) -> bool:
    """Whether transformers' modeling code of ``model_type`` sizes its attention heads by ``config.head_dim`` where the
    config class has no such field (``getattr(config, "head_dim", hidden_size //
    num_attention_heads)``: Qwen3-MoE, Mixtral, Qwen2-MoE): a ``head_dim`` in a config file or
    ``--config`` then sets the attention's head dimension apart from ``hidden_size``, as the field
    does for dense Qwen3 (Qwen3-30B-A3B: head_dim 128, hidden_size 2048, 32 heads)."""
    import inspect
    import sys

    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        _, _, CONFIG_MAPPING, _ = _import_transformers()
        src = inspect.getsource(sys.modules[MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[model_type]].__module__])
    except Exception:  # noqa: BLE001 - no modeling code to read: the config's fields decide
        return False
    # (the attention's own ``self.head_dim = getattr(config, "head_dim", ...)``; a rotary
    # embedding's ``getattr(config, "head_dim", None)``, in nearly every model's code, does not
    # make it the attention's: DeepSeek's MLA sizes its heads by qk_nope/qk_rope/v_head_dim)
    return 'self.head_dim = getattr(config, "head_dim"' in src


def _settable(cfg, name: str) -> bool:
    """Whether ``name`` can be set on the config object ``cfg``: not a read-only property of its
    class (Falcon's ``head_dim`` is computed, ``hidden_size // num_attention_heads``)."""
    prop = getattr(type(cfg), name, None)
    return not (isinstance(prop, property) and prop.fset is None)


def _apply_overrides(AutoConfig, model_type: str, base, overrides: Mapping[str, str],
                     base_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Turn ``key=value`` strings into constructor kwargs (field names), validating every key.

    ``parent.key=value`` sets one entry of a dict-valued attribute (e.g.
    ``rope_parameters.partial_rotary_factor=0.5``). ``base_kwargs`` (a config file's values) come
    first; the result holds them with the overrides on top. ``head_dim`` is a key wherever the
    model's code reads it (:func:`_reads_head_dim`).
    """
    known = _config_keys(base)
    if ("head_dim" in overrides and "head_dim" not in known and _settable(base, "head_dim")
            and _reads_head_dim(model_type)):
        known.add("head_dim")
    kwargs: dict[str, Any] = dict(base_kwargs or {})
    for key, text in overrides.items():
        key = key.strip()
        value = parse_value(text)
        if "." in key:
            parent, _, sub = key.partition(".")
            current = getattr(base, parent, None) if parent in known else None
            if not isinstance(current, dict):
                raise SymcostError(
                    f"hf:{model_type}: unknown config key {key!r}: {parent!r} is not a dict-valued "
                    f"attribute of {type(base).__name__}"
                )
            merged = dict(kwargs.get(parent, current))
            merged[sub] = value
            kwargs[parent] = merged
            continue
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            nested = [k for k, v in base.to_dict().items() if isinstance(v, dict) and key in v]
            if nested:
                hint = f"; it is inside {nested[0]!r}: use --config {nested[0]}.{key}={text}"
            raise SymcostError(f"hf:{model_type}: unknown config key {key!r} for {type(base).__name__}{hint}")
        kwargs[_field_name(base, key)] = value
    cfg = _make_config(AutoConfig, model_type, kwargs)
    for key, value in kwargs.items():
        if base_kwargs and key in base_kwargs and base_kwargs[key] is value:
            continue  # a config file's own value: the config class may normalise it (rope_scaling)
        got = getattr(cfg, key, value)
        if got != value and not isinstance(value, dict) and str(got).rpartition(".")[2] != str(value):
            raise SymcostError(
                f"hf:{model_type}: --config {key}={value!r} did not take effect "
                f"({type(cfg).__name__} made it {getattr(cfg, key)!r})"
            )
    return kwargs


def _rope(cfg) -> tuple[bool, float | None, int | None]:
    """(uses rotary embeddings, partial_rotary_factor or None, fixed rotary_dim or None)."""
    rp = getattr(cfg, "rope_parameters", None)
    rotary_dim = getattr(cfg, "rotary_dim", None)
    if getattr(cfg, "alibi", False) or (rp is None and rotary_dim is None):
        return False, None, None
    factor = None
    if isinstance(rp, dict):
        factor = rp.get("partial_rotary_factor")
    if factor is None:
        factor = getattr(cfg, "partial_rotary_factor", None)
    if factor is not None and float(factor) == 1.0:
        factor = None
    return True, factor, rotary_dim


#: Keys of a config.json that describe the file, not the model.
_FILE_META = ("architectures", "transformers_version", "_name_or_path", "torch_dtype", "dtype",
              "auto_map", "model_type", "task_specific_params", "_commit_hash")


def read_config_file(path: str) -> tuple[str, dict[str, Any]]:
    """``(model_type, constructor kwargs)`` of a ``transformers`` ``config.json`` file.

    Raises:
        SymcostError: the file is missing, is not a JSON object, or has no ``model_type``.
    """
    import json

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError as e:
        raise SymcostError(f"config file {path!r} not found") from e
    except (OSError, ValueError) as e:
        raise SymcostError(f"config file {path!r} is not readable JSON: {' '.join(str(e).split())}") from e
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise SymcostError(
            f"config file {path!r} has no \"model_type\"; symcost reads transformers config.json files "
            "(e.g. {\"model_type\": \"llama\", \"hidden_size\": 4096, ...})"
        )
    return data["model_type"], {k: v for k, v in data.items() if k not in _FILE_META}


def cached_config_path(repo: str) -> str:
    """Path of ``config.json`` of Hugging Face repository ``ORG/NAME`` in the local cache.

    Never uses the network (``huggingface_hub.try_to_load_from_cache``).

    Raises:
        SymcostError: not in the cache (with how to get it), or huggingface_hub missing.
    """
    try:
        from huggingface_hub import try_to_load_from_cache
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError as e:
        raise SymcostError(_NEED_TRANSFORMERS) from e
    path = try_to_load_from_cache(repo, "config.json")
    if not isinstance(path, str):
        raise SymcostError(
            f"hf:{repo}: no config.json of {repo!r} in the local Hugging Face cache ({HF_HUB_CACHE}); "
            f"symcost never downloads: fetch it with `hf download {repo} config.json` (huggingface_hub "
            f"before 0.34: `huggingface-cli download {repo} config.json`) "
            "or pass the path of a config.json file"
        )
    return path


def spec_from_file(path: str, overrides: Mapping[str, str] | None = None, attention: str | None = None,
                   name: str | None = None) -> ModelSpec:
    """The :class:`ModelSpec` of the causal LM a ``config.json`` file describes (its sizes are the
    defaults); see :func:`spec`. Raises SymcostError as :func:`read_config_file` and :func:`spec`."""
    model_type, kwargs = read_config_file(path)
    return spec(model_type, overrides, attention, base_kwargs=kwargs, name=name or path)


def spec(model_type: str, overrides: Mapping[str, str] | None = None, attention: str | None = None,
         base_kwargs: Mapping[str, Any] | None = None, name: str | None = None) -> ModelSpec:
    """Build the :class:`~symcost.frontends.spec.ModelSpec` of ``hf:MODEL_TYPE`` from its default config.

    Args:
        model_type: a ``transformers`` model type with a causal-LM head (``llama``, ``gpt2``, ...);
            see :data:`VERIFIED` for those checked to trace.
        overrides: ``--config key=value`` strings applied to the config (values parsed as
            int, float, true/false/none, else string; never evaluated). Standard names
            (``hidden_size``) and the config's own (``n_embd``) are both accepted;
            ``parent.key=value`` sets an entry of a dict attribute such as ``rope_parameters``.
        attention: ``"eager"`` or ``"sdpa"``, the ``attn_implementation`` the model is built with;
            ``None`` (the default) is what ``transformers`` picks by default: sdpa where the
            model class supports it, else eager.
        base_kwargs: a config file's values (constructor kwargs), under the overrides.
        name: the model's name in the output (default ``hf:MODEL_TYPE``).

    The spec's ``build(values)`` returns the model in train mode with hidden_size = M (or H*D where
    M is no symbol); ``make_inputs(values, device)`` gives ``input_ids`` and ``labels``, both int64
    ``[B, S]`` (the model shifts the labels itself); ``loss`` is the model's mean next-token cross
    entropy.

    Raises:
        SymcostError: transformers missing; unknown or non-causal-LM model type; bad attention;
            unknown or rejected config key; a config symcost cannot bind (no heads, or a
            hidden_size that is no multiple of the heads and no head_dim).
    """
    AutoConfig, AutoModelForCausalLM, CONFIG_MAPPING, CAUSAL = _import_transformers()
    overrides = dict(overrides or {})
    if attention is not None and attention not in ATTENTION:
        raise SymcostError(f"unknown attention implementation {attention!r}; accepted: {', '.join(ATTENTION)}")
    shown_name = name or f"hf:{model_type}"
    if model_type not in CONFIG_MAPPING and model_type.replace("-", "_") in CONFIG_MAPPING:
        model_type = model_type.replace("-", "_")
    if model_type not in CONFIG_MAPPING:
        raise SymcostError(
            f"unknown Hugging Face model type {model_type!r}; verified decoder models: {', '.join(VERIFIED)} "
            "(other transformers causal-LM model types may work too)"
        )
    if model_type not in CAUSAL:
        raise SymcostError(
            f"hf:{model_type} has no causal-LM head in transformers (AutoModelForCausalLM); "
            f"verified decoder models: {', '.join(VERIFIED)}"
        )
    if attention in (None, "sdpa"):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        try:
            model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[model_type]]
        except Exception:  # noqa: BLE001 - a mapping that cannot load its class: let build report it
            model_cls = None
        sdpa_ok = model_cls is None or getattr(model_cls, "_supports_sdpa", True)
        if attention is None:  # transformers' own default
            attention = "sdpa" if sdpa_ok else "eager"
        elif not sdpa_ok:
            raise SymcostError(
                f"hf:{model_type} ({model_cls.__name__}) has no sdpa attention in transformers; "
                "use --attention eager"
            )
    base_kwargs = dict(base_kwargs or {})
    base = _make_config(AutoConfig, model_type, base_kwargs)
    ov = _apply_overrides(AutoConfig, model_type, base, overrides, base_kwargs)
    cfg = _make_config(AutoConfig, model_type, ov)
    cls = type(cfg).__name__

    def attr(key):
        return getattr(cfg, key, None)

    H, hidden = attr("num_attention_heads"), attr("hidden_size")
    L, V = attr("num_hidden_layers"), attr("vocab_size")
    for key, v in (("num_attention_heads", H), ("hidden_size", hidden), ("num_hidden_layers", L), ("vocab_size", V)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise SymcostError(
                f"hf:{model_type}: {cls} has no usable {key} ({v!r}); symcost binds H, D, L, V to "
                "num_attention_heads, head_dim, num_hidden_layers, vocab_size"
            )
    # (a class without the field whose modeling code reads config.head_dim, given one by a file or
    # --config: Qwen3-30B-A3B's head_dim 128 apart from hidden_size 2048 / 32 heads)
    settable_head_dim = _is_field(cfg, "head_dim") or (attr("head_dim") is not None and _settable(cfg, "head_dim")
                                                       and _reads_head_dim(model_type))
    head_dim = attr("head_dim") if settable_head_dim else None
    wide = dict(ov)
    wide[_field_name(cfg, "hidden_size")] = 2 * hidden
    # M = d_model is a symbol where head_dim is set on its own: it does not follow hidden_size
    has_m = head_dim is not None and getattr(_make_config(AutoConfig, model_type, wide), "head_dim", None) == head_dim
    if has_m:
        D = head_dim
    else:
        if hidden % H:
            raise SymcostError(
                f"hf:{model_type}: hidden_size={hidden} is not a multiple of num_attention_heads={H} and "
                "the config has no head_dim; set --config hidden_size=... or num_attention_heads=..."
            )
        D = hidden // H

    # F: the first feed-forward width attribute that is set, unless the config derives it from the
    # width (then it follows the width through the trace and is no symbol).
    f_attr, F = None, None
    for key in _F_ATTRS:
        if attr(key) is not None:
            f_attr, F = key, attr(key)
            break
    if f_attr is not None and _field_name(cfg, f_attr) not in ov:
        probe = dict(wide)
        if settable_head_dim and not has_m:
            probe["head_dim"] = 2 * D
        if getattr(_make_config(AutoConfig, model_type, probe), f_attr, None) != F:
            f_attr, F = None, None

    # Mixture of experts (symcost.frontends.moe): E, R and the routed experts' width F, traced under a
    # routing model (balanced by default: transformers' own grouped_mm experts code; capacity=c:
    # symcost's padded dispatch), through the experts implementation "symcost".
    moe_b = moe.hf_binding(cfg)
    if moe_b is not None:
        f_attr, F = moe_b.f_attr, moe_b.F

    # K: a symbol wherever the config has num_key_value_heads; the trace picks its regime.
    has_k = hasattr(cfg, "num_key_value_heads")
    K = attr("num_key_value_heads") if has_k else None
    if has_k and K is None:
        K = H
    follows: dict[str, str] = {}
    if has_k and _field_name(cfg, "num_key_value_heads") not in ov:
        more = dict(ov)
        more[_field_name(cfg, "num_attention_heads")] = 2 * H
        more[_field_name(cfg, "hidden_size")] = 2 * hidden
        try:
            if getattr(_make_config(AutoConfig, model_type, more), "num_key_value_heads", None) in (None, 2 * H):
                follows["K"] = "H"  # the config leaves K unset: K = H unless the user sets K
        except SymcostError:
            pass

    symbols = tuple(s for s, present in (("H", 1), ("D", 1), ("L", 1), ("V", 1), ("F", f_attr), ("K", has_k),
                                         ("M", has_m), ("E", moe_b), ("R", moe_b)) if present)
    maxpos = attr("max_position_embeddings") or attr("n_positions")
    defaults = {"B": 1, "S": min(2048, maxpos) if maxpos else 2048, "H": H, "D": D, "L": L, "V": V}
    if f_attr:
        defaults["F"] = F
    if has_k:
        defaults["K"] = K
    if has_m:
        defaults["M"] = hidden
    if moe_b is not None:
        defaults.update(E=moe_b.E, R=moe_b.R)

    uses_rope, rope_factor, rotary_dim = _rope(cfg)
    alibi = model_type == "bloom" or bool(attr("alibi"))
    constraints: list[Constraint] = []
    moduli: dict[str, int] = {}
    if has_k:
        constraints.append(Constraint(
            "divides", "K", "H", "K must divide H: each of the K key/value heads serves H/K query heads"))
    if rotary_dim is not None:
        constraints.append(Constraint(
            "min", "D", int(rotary_dim),
            f"D must be at least rotary_dim={rotary_dim} (PyTorch cannot apply a wider rotation to a "
            "narrower head); lower it with --config rotary_dim=..."))
    elif rope_factor is not None:
        # the rotary part int(D*f) is linear in D within a residue class of D (whether an odd
        # part runs is the model's business: PyTorch rejects it for phi, not for gpt_neox)
        moduli["D"] = _multiple(rope_factor)
    elif uses_rope:
        constraints.append(Constraint(
            "multiple", "D", 2, f"D must be even: hf:{model_type} uses rotary position embeddings, which rotate pairs"))
    if has_m and hidden % H == 0 and _rejects(AutoConfig, model_type, ov, cfg, hidden + 1):
        # the config class validates hidden_size % num_attention_heads (deepseek_v2/v3's
        # validate_architecture) although M is a symbol of its own: probes keep H | M
        constraints.append(Constraint(
            "divides", "H", "M",
            f"H must divide M: {cls} rejects a hidden_size that is no multiple of num_attention_heads"))
    lead = 0
    first_dense = attr("first_k_dense_replace")
    if moe_b is not None and isinstance(first_dense, int) and first_dense >= 2:
        # DeepSeek-V3: the first k blocks are dense, the others MoE (k = 1 is a special first
        # block, which the tracer finds on its own); L <= k is all dense, a regime of its own
        lead = first_dense
    if moe_b is not None:
        constraints.append(Constraint("max", "R", "E", "R (experts per token) must not exceed E (experts)"))
        constraints.extend(moe_b.constraints)
        moduli.update(dict(moe_b.moduli))
        for sym in moe.row_widths(has_m):  # the grouped experts' 16-byte rows (moe.GROUPED_ROW_MODULUS)
            moduli[sym] = _lcm(moduli.get(sym, 1), moe.GROUPED_ROW_MODULUS)
    if maxpos and not uses_rope and not alibi:  # a learned position table
        constraints.append(Constraint(
            "max", "S", int(maxpos),
            f"S must be at most max_position_embeddings={maxpos} (a learned position table); raise it "
            f"with --config max_position_embeddings=..."))

    def config_for(values: Mapping[str, int]):
        values = {k: operator.index(v) for k, v in values.items() if k in ("B", "S", *symbols)}
        h, d = values["H"], values["D"]
        kw = dict(ov)
        kw[_field_name(cfg, "num_attention_heads")] = h
        kw[_field_name(cfg, "hidden_size")] = values["M"] if has_m else h * d
        if settable_head_dim:
            kw["head_dim"] = d
        kw[_field_name(cfg, "num_hidden_layers")] = values["L"]
        kw[_field_name(cfg, "vocab_size")] = values["V"]
        if f_attr:
            kw[_field_name(cfg, f_attr)] = values["F"]
        if has_k:
            kw[_field_name(cfg, "num_key_value_heads")] = values["K"]
        kw["use_cache"] = False
        pattern = kw.get("layer_types")
        if isinstance(pattern, (list, tuple)) and pattern and len(pattern) != values["L"]:
            # a config file's per-layer list (gpt-oss: sliding and full attention alternate) follows
            # L by its shortest period, as the config class derives it when the file has none
            kw["layer_types"] = _resize_pattern(list(pattern), values["L"])
        if moe_b is not None:
            kw.update(moe_b.config_kwargs(values, lambda k: _field_name(cfg, k)))
        for key in _TOKEN_ATTRS:  # ids outside a small probe vocabulary would break the embedding
            t = kw.get(key, attr(key))
            ids = t if isinstance(t, (list, tuple)) else [t]
            if any(isinstance(i, int) and i >= values["V"] for i in ids):
                kw[key] = None
        c = _make_config(AutoConfig, model_type, kw)
        c._attn_implementation = attention
        if moe_b is not None:
            c._experts_implementation = moe.HF_IMPLEMENTATION
        return c

    def build(values: Mapping[str, int]) -> torch.nn.Module:
        """The causal LM for these symbol values, in train mode, on the current default device.

        Raises SymcostError when a constraint rejects the values or transformers cannot build it.
        """
        why = check_constraints(constraints, {k: values.get(k) for k in ("B", "S", *symbols)})
        if why:
            raise SymcostError(f"{shown_name}: {why}")
        c = config_for(values)
        try:
            model = AutoModelForCausalLM.from_config(c, attn_implementation=attention)
        except Exception as e:  # noqa: BLE001 - transformers raises many types
            why = " ".join(str(e).split())
            raise SymcostError(f"{shown_name}: building the model failed: {type(e).__name__}: {why}") from e
        return model.train()

    def make_inputs(values: Mapping[str, int], device) -> tuple[tuple, dict]:
        """``((), {"input_ids": ids, "labels": ids})``, ids int64 ``[B, S]`` in ``[0, V)``."""
        shape = (operator.index(values["B"]), operator.index(values["S"]))
        ids = torch.randint(0, operator.index(values["V"]), shape, dtype=torch.long, device=device)
        return (), {"input_ids": ids, "labels": ids}

    def loss(out, inputs) -> torch.Tensor:
        """The model's own loss: mean cross entropy of logits[:, :-1] against labels[:, 1:]."""
        return out.loss

    extra = {
        "config_class": cls,
        "model_type": model_type,
        "attention": attention,
        "hidden_size_note": ("hidden_size = M, apart from H*D (head_dim = D)" if has_m
                             else "hidden_size = H*D" + (" (head_dim = D)" if settable_head_dim else "")),
        "tie_word_embeddings": bool(attr("tie_word_embeddings")),
        "config_overrides": {k: (v if isinstance(v, (int, float, bool, str, type(None))) else repr(v))
                             for k, v in ov.items() if k not in base_kwargs or base_kwargs[k] != v},
    }
    try:  # (the class AutoModelForCausalLM builds: the report's task line)
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        extra["model_class"] = MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)].__name__
    except Exception:  # noqa: BLE001 - a mapping that cannot load its class: no name to show
        pass
    if base_kwargs:
        extra["config_file"] = shown_name
    if f_attr:
        extra["F_attribute"] = f_attr
    if has_k:
        extra["kv_heads"] = "K = num_key_value_heads (regime from the requested K: K = 1, 1 < K < H or K = H)"
    if lead:
        extra["lead_blocks_note"] = (f"first_k_dense_replace={lead}: blocks 0..{lead - 1} are dense, the "
                                     "others mixture-of-experts")
    if moe_b is not None:
        extra.update(routing=moe.BALANCED.name, routing_description=moe.BALANCED.describe(),
                     moe_attributes=f"E={moe_b.e_attr}, R={moe_b.r_attr}, F={moe_b.f_attr}",
                     hf_experts=True, experts_code=moe.experts_code(moe.BALANCED))
    if model_type not in VERIFIED and model_type not in moe.VERIFIED_HF:
        extra["unverified"] = f"hf:{model_type} is not among the verified architectures ({', '.join(VERIFIED)})"
    return ModelSpec(
        name=shown_name,
        symbols=symbols,
        defaults=defaults,
        build=build,
        make_inputs=make_inputs,
        loss=loss,
        constraints=tuple(constraints),
        moduli=moduli,
        follows=follows,
        layers=_LAYERS.get(model_type),
        extra=extra,
        probe_check=moe.model_code_probe_check if moe_b is not None else None,
        record_context=unpacked_masks,
        lead_blocks=lead,
        infer=infer,
    )


def configs(model_type: str, overrides: Mapping[str, str] | None, base_kwargs: Mapping[str, Any] | None):
    """``(AutoConfig, base_kwargs, ov, cfg)`` of an ``hf:`` task spec (:mod:`symcost.frontends.hf_tasks`,
    :mod:`symcost.frontends.hf_vision`): the config class's defaults with a config file's values
    (``base_kwargs``), the user's ``--config`` overrides applied on top (``ov``: the keyword
    arguments) and the config they make.

    Raises:
        SymcostError: as :func:`_apply_overrides` (an unknown or rejected key, one line)."""
    import transformers

    AutoConfig = transformers.AutoConfig
    base_kwargs = dict(base_kwargs or {})
    base = _make_config(AutoConfig, model_type, base_kwargs)
    ov = _apply_overrides(AutoConfig, model_type, base, dict(overrides or {}), base_kwargs)
    return AutoConfig, base_kwargs, ov, _make_config(AutoConfig, model_type, ov)


def head_builder(shown: str, constraints, symbols, model_cls, config_for, attention: str | None, check=None):
    """The ``build(values) -> nn.Module`` of an ``hf:`` spec built from its task's model class
    (:mod:`symcost.frontends.hf_tasks`, :mod:`symcost.frontends.hf_vision`): ``constraints``
    checked on B, S and ``symbols``, then ``model_cls._from_config(config_for(values))`` (with
    ``attn_implementation=attention`` where given) on the current default device, in train mode.
    ``check``: ``check(values) -> str | None`` in place of ``constraints`` (a spec's own rule).

    The returned ``build`` raises SymcostError: a constraint the values break, or the config
    transformers refuses (its message on one line, prefixed with ``shown``)."""

    def build(values: Mapping[str, int]):
        """The model for these symbol values, in train mode, on the current default device."""
        given = {k: values.get(k) for k in ("B", "S", *symbols)}
        why = check(given) if check is not None else check_constraints(constraints, given)
        if why:
            raise SymcostError(f"{shown}: {why}")
        try:
            model = model_cls._from_config(config_for(values), **({"attn_implementation": attention}
                                                                  if attention is not None else {}))
        except Exception as e:  # noqa: BLE001 - transformers raises many types
            raise SymcostError(f"{shown}: building the model failed: {type(e).__name__}: "
                               f"{' '.join(str(e).split())}") from e
        return model.train()

    return build


@contextlib.contextmanager
def unpacked_masks():
    """Make ``transformers``' mask decisions under ``FakeTensorMode`` the ones the real step makes.

    ``transformers.masking_utils.find_packed_sequence_indices`` asks whether ``position_ids``
    pack several sequences into one row; with real tensors it reads the values (symcost's inputs
    give none, so the model's own ``arange``: one sequence a row) and returns None, after which
    ``create_causal_mask`` lets SDPA use its ``is_causal`` flag (no mask) and eager attention builds
    the plain ``(1, 1, S, S)`` causal mask expanded over the batch. On fake tensors it cannot read
    them (``is_tracing`` is true for a ``FakeTensor``) and returns the packing ids, which disables
    the skip and materialises a ``(B, 1, S, S)`` packed-sequence mask the real step never builds.
    Within this context it runs the same ops as the real call (the ids and their check) and returns
    None, the real answer for one unpacked sequence a row, without reading a value (symcost's steps
    pass no position ids; a read would send the request's strict recording back to fake tensors).
    Nothing else changes: a sliding window shorter than S still builds its mask, as it does for real.
    """
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = masking_utils.find_packed_sequence_indices
    is_tracing = masking_utils.is_tracing

    def find_packed_sequence_indices(position_ids):
        # the ids as the original computes them, its check done here after it returns, on fake
        # and on real tensors alike (symcost records the probes of a fit on real tensors,
        # symcost.tracing.record.real_tensors_suffice): one op order, one moment its temporaries die
        masking_utils.is_tracing = lambda t: True
        try:
            packed = original(position_ids)
        finally:
            masking_utils.is_tracing = is_tracing
        if packed is not None:
            # the check the real call makes (every row one sequence), its ops run as they run
            # there; its answer is known without reading it: symcost's steps pass no position
            # ids, so they are the model's own arange, one sequence a row (and a read of a value
            # would send a strict recording, the request's, back to fake tensors)
            (packed[:, -1] == 0).all()
        return None

    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def _multiple(factor: float) -> int:
    """Smallest D for which D*factor is an even integer."""
    for d in range(1, 1025):
        r = d * float(factor)
        if abs(r - round(r)) < 1e-9 and round(r) % 2 == 0 and round(r) > 0:
            return d
    return 2


def _rejects(AutoConfig, model_type: str, ov: Mapping[str, Any], cfg, hidden: int) -> bool:
    """Whether the config class refuses ``hidden_size=hidden`` (everything else as ``ov``)."""
    kw = dict(ov)
    kw[_field_name(cfg, "hidden_size")] = hidden
    try:
        _make_config(AutoConfig, model_type, kw)
    except SymcostError:
        return True
    return False


def _resize_pattern(pattern: list, n: int) -> list:
    """``pattern`` (one entry per layer) repeated by its shortest period to ``n`` entries
    (``["sliding", "full"] * 12`` -> ``["sliding", "full", "sliding"]`` for n = 3)."""
    for p in range(1, len(pattern) + 1):
        if all(pattern[i] == pattern[i % p] for i in range(len(pattern))):
            return [pattern[i % p] for i in range(n)]
    return pattern[:n]  # pragma: no cover (p = len(pattern) always matches)
