"""The graph library: traced analyses shipped with symcost (the top-level ``graphs/`` folder,
installed to ``<prefix>/share/symcost/graphs`` by ``pip install``), served before anything is
traced.

Each ``graphs/<name>.json`` is one analysis as the trace cache holds it (:meth:`Analysis.to_dict`
and the cache's entry meta, :func:`symcost.graph.cache.entry_meta`), with what it was traced from
(model, ``--config``, attention, precision, the sizes asked for) and with which versions (torch,
transformers, symcost and the digest of its tracing sources). ``graphs/index.json`` lists them;
``symcost graphs build`` (:mod:`symcost.commands.graphs`) writes them all again.

**Which requests a graph serves** (:func:`lookup`; only a request the trace cache does not hold,
a training step on one device with the default probe plan and device kernels, no other options):

* the same *family*: a built-in model by name, ``hf:MODEL_TYPE`` with the same ``--config``
  overrides, or a ``config.json`` (any path, or a Hub name ``hf:ORG/NAME`` whose config.json the
  local Hugging Face cache holds) whose fields other than its sizes (:data:`SIZE_FIELDS`)
  and bookkeeping (:data:`INERT_FIELDS`) equal the traced file's: rotary scaling, sliding windows,
  activation, tied embeddings, biases must match, as must precision and attention;
* the same *regime*, as the trace cache matches one (``symcost.graph.cache``: request facts such as
  B = 1 or K = H, pinned symbols at their values, residues, leading blocks);
* its *config sizes* (H, D, K, V, F, M, E, R): where they equal the traced ones the graph is served
  as the cache would serve it (no torch imported). Where they differ (another size of the family:
  Llama-3-70B from the Llama-3-8B graph, or ``--set H=...``) the model is built at the requested
  sizes on the meta device and every parameter's shape compared with its fitted formula
  (:func:`symcost.graph.reuse.mismatch`, the check :meth:`Analysis.subs` makes before using
  formulas away from the sizes they were traced at): a width that is a step function of a symbol
  (torchtitan's SwiGLU width) differs there, and the request is traced instead. Never
  extrapolated silently.

A graph traced with other versions (torch, transformers, symcost's tracing sources, a built-in
model's file) is still served and the report says so; ``--no-cache`` traces afresh.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

#: Bumped when the layout of a library file changes (older files are not read).
FORMAT = 1

#: ``config.json`` fields that only size the model: they bind symbols (or shape parameters that the
#: meta-device check compares), so a graph of one size serves the family's other sizes.
SIZE_FIELDS = frozenset({
    "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers",
    "vocab_size", "intermediate_size", "moe_intermediate_size", "n_routed_experts", "num_experts",
    "num_local_experts", "num_experts_per_tok", "n_shared_experts", "shared_expert_intermediate_size",
    "n_embd", "n_head", "n_layer", "n_inner", "max_position_embeddings", "n_positions", "n_ctx",
    "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "num_key_value_heads", "multi_query_group_num", "ffn_hidden_size",
})
#: ``config.json`` fields that change no op and no shape (names, token ids, initialisation,
#: epsilons, the rotary base, the dtype the weights were saved in: symcost's precision decides).
INERT_FIELDS = frozenset({
    "_name_or_path", "architectures", "transformers_version", "torch_dtype", "dtype", "bos_token_id",
    "eos_token_id", "pad_token_id", "initializer_range", "rms_norm_eps", "layer_norm_eps",
    "layer_norm_epsilon", "rope_theta", "use_cache", "auto_map", "model_name", "tokenizer_class",
    "output_attentions", "output_hidden_states", "return_dict",
})


def library_dir() -> Path | None:
    """The folder of the graph library: ``$SYMCOST_GRAPHS_DIR`` if set (an empty value: no
    library), else ``graphs/`` beside the package in a source checkout (an editable install), else
    where ``pip install`` put it (``<prefix>/share/symcost/graphs``: pyproject's data-files, under
    the environment's prefix or the user's); None where none has an ``index.json``."""
    env = os.environ.get("SYMCOST_GRAPHS_DIR")
    if env is not None:
        return Path(env) if env and (Path(env) / "index.json").is_file() else None
    here = Path(__file__).resolve().parent.parent.parent / "graphs"
    if (here / "index.json").is_file():
        return here
    import sys
    import sysconfig

    roots = [sysconfig.get_path("data"), sys.prefix]
    try:
        roots.append(sysconfig.get_path("data", sysconfig.get_preferred_scheme("user")))
    except (AttributeError, KeyError):  # (Python < 3.10)
        pass
    for root in roots:
        p = Path(root) / "share" / "symcost" / "graphs"
        if (p / "index.json").is_file():
            return p
    return None


def config_family(path: str) -> dict | None:
    """The fields of a ``config.json`` that a graph of its family must share (all but
    :data:`SIZE_FIELDS` and :data:`INERT_FIELDS`), with its ``model_type``; None if unreadable."""
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        return None
    return {k: cfg[k] for k in sorted(cfg) if k not in SIZE_FIELDS and k not in INERT_FIELDS}


def library_key(model: str, config: Mapping[str, str], attention: str | None, precision: str) -> dict | None:
    """What a request must share with a library graph to be served by it (besides the regime and
    the sizes' check, :func:`lookup`); None where the library never serves it (a model file of the
    user's, a Hub name whose config.json is not in the local Hugging Face cache)."""
    config = {str(k): str(v) for k, v in dict(config or {}).items()}
    base = {"format": FORMAT, "config": config, "attention": attention, "precision": precision}
    if model.startswith("hf:"):
        if "/" in model:  # a Hub name: its config.json in the local Hugging Face cache, as a config file
            path = hub_config(model)
            fam = config_family(path) if path else None
            return None if fam is None else {**base, "kind": "config.json", "family": fam}
        return {**base, "kind": "hf", "model_type": model[3:]}
    if ".py:" in model:
        return None
    if model.endswith(".json"):
        fam = config_family(model) if os.path.isfile(model) else None
        return None if fam is None else {**base, "kind": "config.json", "family": fam}
    from symcost.frontends.spec import BUILTINS

    return {**base, "kind": "builtin", "name": model} if model in BUILTINS else None


def hub_config(model: str) -> str | None:
    """The path of ``hf:ORG/NAME``'s ``config.json`` in the local Hugging Face cache (never the
    network: ``huggingface_hub.try_to_load_from_cache``), or None (not there, no huggingface_hub)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        path = try_to_load_from_cache(model[3:], "config.json")
    except Exception:  # noqa: BLE001 - an odd name: not served, the resolver says why
        return None
    return path if isinstance(path, str) else None


def _request_file(model: str) -> str | None:
    """The config file a request names: ``path/config.json``, or a Hub name's in the local cache."""
    if model.endswith(".json"):
        return model
    if model.startswith("hf:") and "/" in model:
        return hub_config(model)
    return None


def _file_digest(path: str) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def index(folder: Path | None = None) -> list[dict]:
    """The entries of ``graphs/index.json`` (name, file, library key, the cache meta, versions);
    empty where there is no library or it cannot be read."""
    folder = folder or library_dir()
    if folder is None:
        return []
    try:
        data = json.loads((folder / "index.json").read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return []
    return [e for e in data.get("graphs", []) if isinstance(e, dict)]


def versions() -> dict:
    """The versions a graph is traced with and served under: torch, transformers, symcost, the
    digest of symcost's tracing sources and of its built-in models' files."""
    from symcost.graph.entries import _source_digest, _version, model_source

    builtin = (model_source("gpt2", {}) or {}).get("graphs")
    return {"torch": _version("torch"), "transformers": _version("transformers"), "symcost": _version("symcost"),
            "symcost_sources": _source_digest(), "builtin_models": builtin}


def differences(traced: Mapping, here: Mapping | None = None) -> list[str]:
    """What differs between the versions a graph was traced with and these (empty: none), in
    words: ``torch 2.12.0 (here 2.13.0)``, ``symcost's tracing sources``, ..."""
    here = here or versions()
    out = []
    for k in ("torch", "transformers", "symcost"):
        if traced.get(k) != here.get(k):
            out.append(f"{k} {traced.get(k)} (here {here.get(k)})")
    if traced.get("symcost_sources") != here.get("symcost_sources"):
        out.append("symcost's tracing sources (frontends, tracing, graph)")
    if traced.get("kind") == "builtin" and traced.get("builtin_models") != here.get("builtin_models"):
        out.append("the built-in models' files")
    return out


def _same_defaults(entry: Mapping, model: str) -> bool:
    """Whether the request's model has the traced model's default sizes without building it: a
    built-in or ``hf:`` name (its defaults are its source's), or a config file with the same bytes."""
    path = _request_file(model)
    if path is None:
        return True
    return _file_digest(path) == entry.get("file_sha256")


def lookup(model: str, config: Mapping[str, str], attention: str | None, precision: str,
           sizes: Mapping[str, int], options: Mapping[str, Any] | None = None):
    """The analysis a library graph gives for this request, or None (no graph of this family and
    regime, or its formulas do not hold at these sizes: the caller traces). The analysis carries
    ``library`` (name, versions traced with, what differs here, the sizes it was traced at where the
    request's config sizes differ) and ``cached_from`` (the file)."""
    if options:
        return None
    lk = library_key(model, config, attention, precision)
    if lk is None:
        return None
    folder = library_dir()
    entries = [e for e in index(folder) if e.get("library_key") == lk]
    if not entries:
        return None
    from symcost.graph.entries import FORMAT as CACHE_FORMAT
    from symcost.graph.entries import _config_values, _matches

    live = None
    for e in entries:
        meta = e.get("meta") or {}
        if meta.get("key", {}).get("format") != CACHE_FORMAT:
            continue
        same = _same_defaults(e, model)
        if not same:
            if live is None:
                live = _live_spec(model, config, attention)
                if live is None:
                    return None
            if not _same_structure(meta, live):
                continue
            meta = {**meta, "defaults": dict(live.defaults)}
        try:
            if not _matches(meta, sizes, config=False):
                continue
            exact = same and _config_values(meta, sizes) == meta["config_values"]
        except (KeyError, TypeError, ValueError):
            continue
        an = _read(folder / e["file"], e, model, live)
        if an is None:
            continue
        if not exact:
            if live is None:
                live = _live_spec(model, config, attention)
            if live is None or not _holds(an, sizes, live, precision):
                continue
            an.__dict__["library"]["traced_at"] = dict(e.get("sizes_traced") or {})
        return an
    return None


def _live_spec(model, config, attention):
    """The request's model resolved (torch and, for ``hf:`` and config files, transformers
    imported); None where it cannot be (the trace will say why in one line)."""
    from symcost.errors import SymcostError

    try:
        from symcost.frontends.models import resolve

        return resolve(model, dict(config or {}), attention)
    except SymcostError:
        return None


def _same_structure(meta: Mapping, spec) -> bool:
    """Whether ``spec`` binds the symbols the traced model bound, with the same ties."""
    return (set(meta.get("defaults", {})) == set(spec.defaults) and dict(spec.tied) == meta.get("tied", {})
            and dict(getattr(spec, "follows", {}) or {}) == meta.get("follows", {})
            and int(getattr(spec, "lead_blocks", 0) or 0) == meta.get("lead_blocks", 0))


def _read(path: Path, entry: Mapping, model: str, live):
    """The analysis in a library file, labelled; with the request's model name, and ``live``'s
    defaults and constraints where the request is another size of the family. None if unreadable."""
    from symcost.errors import SymcostError
    from symcost.graph.analysis import Analysis

    try:
        data = json.loads(path.read_text())
        d = dict(data["analysis"])
        if live is not None:
            sd = dict(d["spec"])
            from symcost.graph.serialize import _jsonable

            sd.update(defaults=dict(live.defaults), name=live.name, extra={**sd.get("extra", {}), **_jsonable(live.extra)},
                      constraints=[[c.kind, c.a, c.b, c.why] for c in live.constraints])
            d["spec"] = sd
        d["model"] = model if _request_file(model) else d["model"]  # (a config file or Hub name: the request's)
        an = Analysis.from_dict(d)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, SymcostError):
        return None
    traced = dict(data.get("traced_with") or {})
    an.__dict__["cached_from"] = str(path)
    an.__dict__["library"] = {"name": entry.get("name"), "torch": traced.get("torch"),
                              "transformers": traced.get("transformers"), "differs": differences(traced)}
    return an


def _holds(an, sizes: Mapping[str, int], live, precision: str) -> bool:
    """Whether the formulas of ``an`` hold at the request, checked as :meth:`Analysis.subs` and
    :meth:`Analysis.in_regime` check a live trace: every parameter of the model built at those
    sizes on the meta device has its fitted shape (:func:`symcost.graph.reuse.mismatch`: a width
    that is a step function of a symbol), and one step recorded there with L = 2 runs the ops of
    the traced regime (its :func:`symcost.tracing.regime.regime_signature`: BLOOM's ALiBi at a head
    count that is not a power of two runs others)."""
    from symcost.errors import SymcostError
    from symcost.frontends.megatron import for_run
    from symcost.graph import reuse

    try:
        values = {str(k): int(v) for k, v in an.bind(**dict(sizes)).items()}
        run = for_run(live, precision, "cuda")  # (the CLI's default device kernels, as the library traced)
        if reuse.mismatch(an, values, spec=run) is not None:
            return False
        sig = getattr(an, "signature", None)
        if not sig:
            return False
        from symcost.tracing.fit import FIT_L
        from symcost.tracing.record import record
        from symcost.tracing.regime import digest, regime_signature

        for s in run.input_symbols:  # (not requested: the regime of any size other than 1)
            values[s] = int(sizes.get(s, an.pinned.get(s, {"B": 2, "S": 16, "T": 16}[s])))
        if "L" in values and "L" not in an.pinned:
            values["L"] = FIT_L + (getattr(run, "lead_blocks", 0) or 0)
        for st in set((getattr(an, "stacks", None) or {}).values()):  # (each stack's probe blocks)
            values[st] = (getattr(an, "stack_blocks", None) or {}).get(st, FIT_L)
        values.update({a: values[b] for a, b in run.tied.items() if b in values})
        return digest(regime_signature(record(run, values, an.precision))) == sig
    except SymcostError:
        return False
    except Exception:  # noqa: BLE001 - a model that does not build here: traced, and the trace says why
        return False


#: What ``symcost graphs build`` traces: name -> (model, ``--config`` overrides, attention, sizes
#: asked for). The default precision (bf16-mixed) and attention (transformers' default, sdpa),
#: the regimes a request hits by default: a request that leaves B unset (traced with B free, B > 1)
#: and one that sets B = 1 (pinned: its own regime), any S (S is free), grouped-query (1 < K < H), multi-query (K = 1) and multi-head (K = H)
#: attention as each config sets it, mixture-of-experts layers; the built-in models at their
#: default sizes.
CATALOGUE: dict[str, tuple[str, dict, str | None, dict]] = {
    # real configs (tests/data/configs), grouped-query attention unless noted; "-b1": --set B=1
    # (B = 1 is a regime of its own, pinned; a request that leaves B unset is traced at B > 1)
    "llama-3-8b": ("tests/data/configs/llama-3-8b.json", {}, None, {}),
    "llama-3-8b-b1": ("tests/data/configs/llama-3-8b.json", {}, None, {"B": 1}),
    "llama-2-70b": ("tests/data/configs/llama-2-70b.json", {}, None, {}),
    "mistral-7b": ("tests/data/configs/mistral-7b.json", {}, None, {}),
    "mistral-7b-b1": ("tests/data/configs/mistral-7b.json", {}, None, {"B": 1}),
    "mixtral-8x7b": ("tests/data/configs/mixtral-8x7b.json", {}, None, {}),
    "mixtral-8x7b-b1": ("tests/data/configs/mixtral-8x7b.json", {}, None, {"B": 1}),
    "qwen2.5-7b": ("tests/data/configs/qwen2.5-7b.json", {}, None, {}),
    "qwen3-4b": ("tests/data/configs/qwen3-4b.json", {}, None, {}),
    "qwen3-4b-b1": ("tests/data/configs/qwen3-4b.json", {}, None, {"B": 1}),
    "qwen3-30b-a3b": ("tests/data/configs/qwen3-30b-a3b.json", {}, None, {}),
    "deepseek-v3": ("tests/data/configs/deepseek-v3.json", {}, None, {}),
    "deepseek-v3-b1": ("tests/data/configs/deepseek-v3.json", {}, None, {"B": 1}),
    "gemma-2b": ("tests/data/configs/gemma-2b.json", {}, None, {}),  # multi-query: K = 1
    "gemma-2b-b1": ("tests/data/configs/gemma-2b.json", {}, None, {"B": 1}),
    "phi-3-mini": ("tests/data/configs/phi-3-mini.json", {}, None, {}),  # multi-head: K = H
    "olmo-2-7b": ("tests/data/configs/olmo-2-7b.json", {}, None, {}),  # K = H
    "olmoe-1b-7b": ("tests/data/configs/olmoe-1b-7b.json", {}, None, {}),
    "falcon-7b": ("tests/data/configs/falcon-7b.json", {}, None, {}),
    "pythia-1b": ("tests/data/configs/pythia-1b.json", {}, None, {}),  # gpt-neox, K = H
    "gpt-j-6b": ("tests/data/configs/gpt-j-6b.json", {}, None, {}),
    # transformers' default configs
    "hf-llama": ("hf:llama", {}, None, {}),  # K unset: K = H
    "hf-gpt2": ("hf:gpt2", {}, None, {}),
    "hf-gemma3": ("hf:gemma3_text", {}, None, {}),
    "hf-granite": ("hf:granite", {}, None, {}),
    # built-in models at their default sizes
    "cs336-lm": ("cs336-lm", {}, None, {}),
    "gpt2": ("gpt2", {}, None, {}),
    "megatron-gpt": ("megatron-gpt", {}, None, {}),
    "mlp": ("mlp", {}, None, {}),
}
#: The precision every library graph is traced at (the CLI's default).
PRECISION = "bf16-mixed"
