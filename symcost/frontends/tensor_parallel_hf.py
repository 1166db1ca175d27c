"""transformers' own tensor-parallel plans for :mod:`symcost.frontends.tensor_parallel`: the plan
``transformers`` runs for a model with ``tp_plan="auto"`` (its config's ``base_model_tp_plan``),
written as PyTorch's ``torch.distributed.tensor.parallel`` styles where one does the same, and
transformers' own style objects (and its ``replicated_with_grad_allreduce`` hook) applied as
transformers applies them where none does (docs/parallel.md, "Tensor and sequence parallelism").
"""
from __future__ import annotations

import re
from typing import Mapping

from symcost.errors import SymcostError


def model_tp_plan(model) -> dict[str, str] | None:
    """The tensor-parallel plan ``transformers`` itself runs for ``model`` with
    ``tp_plan="auto"`` (``{module fqn pattern: style name}``, ``*`` a block index), or None where
    the model has none: ``model.tp_plan`` where transformers resolves it (v5: the config's
    ``base_model_tp_plan`` under the base model's prefix, the vocabulary-parallel
    ``embed_tokens`` it adds to every plan, ``"embedding_rowwise"``, and the model class's own
    entries such as ``lm_head: "colwise_gather_output"``), else the config's
    ``base_model_tp_plan`` under the prefix (older transformers). None also where the config has
    no ``base_model_tp_plan`` (GPT-2, Falcon, GPT-J): the Megatron plan runs there."""
    config = getattr(model, "config", None)
    tp_plan = getattr(config, "base_model_tp_plan", None) if config is not None else None
    if not tp_plan:
        # no plan for the blocks (transformers' tp_plan="auto" refuses such a model): the
        # Megatron plan (module docstring), not the head-and-embedding rules the class adds
        return None
    resolved = getattr(model, "tp_plan", None)
    if isinstance(resolved, Mapping) and resolved:
        return dict(resolved)
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and not hasattr(model, prefix):
        prefix = ""
    return {f"{prefix}.{k}" if prefix else k: v for k, v in tp_plan.items()}


def hf_plan(model, sp: bool) -> tuple[dict, bool] | None:
    """The plan ``transformers`` runs for ``model`` (:func:`model_tp_plan`) as PyTorch styles
    (``{fqn pattern: ParallelStyle}``, ``loss_parallel`` False: transformers' head,
    ``colwise_gather_output``, holds 1/TP of the vocabulary's rows and all-gathers the logits,
    so the loss sees them whole), or None where the model has no plan.

    Each style name is transformers' registry entry (transformers/distributed/tensor_parallel.py,
    ``ALL_PARALLEL_STYLES``) written with PyTorch's styles where one does the same:
    ``embedding_rowwise`` (vocabulary-parallel lookup, partial sums all-reduced) is
    ``RowwiseParallel(input_layouts=Replicate())`` on the ``nn.Embedding``,
    ``colwise_gather_output`` ``ColwiseParallel(output_layouts=Replicate())``, and so on. A style
    with no PyTorch counterpart (``mla_kv_a_proj``: DeepSeek's replicated compressed-KV projection
    whose rotary part's gradient is all-reduced; ``unit_*``, ``packed_*``, ``all_reduce``) is
    transformers' own style object, applied to the module as transformers applies it
    (:data:`_TRANSFORMERS`).

    Raises:
        SymcostError: a style neither PyTorch nor the installed transformers has.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    tp_plan = model_tp_plan(model)
    if not tp_plan:
        return None
    styles = {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        # the vocabulary split over the ranks (Shard(0) of the [V, h] table), every rank's
        # partial lookup summed (an all-reduce); on an nn.Embedding PyTorch's row-wise style
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        # the hidden dimension split (Shard(1)), the slices all-gathered
        "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
        "sequence_parallel": lambda: SequenceParallel() if sp else None,
        "local_colwise": lambda: ColwiseParallel(),
        "local_rowwise": lambda: RowwiseParallel(),
        "gather": lambda: None,
        "local": lambda: None,
        "replicate": lambda: None,
        # a norm between a column- and a row-parallel projection that normalises this rank's
        # heads (Qwen3's q_norm, k_norm): replicated, its gradient all-reduced over the group
        # (transformers' ReplicatedWithGradAllReduce: dist.all_reduce in a post-accumulate hook)
        "replicated_with_grad_allreduce": lambda: _GRAD_ALL_REDUCE,
    }
    registry = _transformers_styles()
    out = {}
    for pattern, style in tp_plan.items():
        if style in styles:
            s = styles[style]()
        elif style in registry:
            s = (_TRANSFORMERS, style)
        else:
            raise SymcostError(f"transformers' tp_plan style {style!r} ({pattern}) is not mapped yet; "
                               f"mapped: {', '.join(sorted(set(styles) | set(registry)))}")
        if s is not None:
            out[pattern] = s
    return out, False


def _transformers_styles() -> dict:
    """transformers' registry of tensor-parallel styles (``ALL_PARALLEL_STYLES``: name -> style
    object), or {} where the installed transformers has none."""
    try:
        from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES
    except ImportError:
        return {}
    try:
        return {k: ALL_PARALLEL_STYLES[k] for k in ALL_PARALLEL_STYLES}
    except Exception:  # noqa: BLE001 - a registry of another shape: none usable
        return {}


#: the plan's marker for a style applied by transformers' own code (:func:`_apply_transformers`)
_TRANSFORMERS = "transformers"


def _apply_transformers(model, entries: dict[str, str], mesh) -> None:
    """Apply transformers' own style objects (``ALL_PARALLEL_STYLES[name]``) to the modules whose
    name matches a pattern of ``entries`` (``{pattern: style name}``) as transformers'
    ``apply_tensor_parallelism`` does: each of the module's own parameters sharded
    (``style.shard_param``), then the forward hooks installed (``style.install_forward``)."""
    registry = _transformers_styles()
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    manager = getattr(model, "_mesh_manager", None)
    for name, module in model.named_modules():
        style = next((registry[s] for p, s in entries.items() if _fqn_match(p, name)), None)
        if style is None:
            continue
        for pname, _ in list(module.named_parameters(recurse=False)):
            style.shard_param(module, pname, mesh, config=config, mesh_manager=manager)
        style.install_forward(module, mesh, config=config, mesh_manager=manager)


#: the plan's marker for transformers' ``replicated_with_grad_allreduce`` (:func:`_grad_all_reduce`)
_GRAD_ALL_REDUCE = "replicated_with_grad_allreduce"


def _fqn_match(pattern: str, name: str) -> bool:
    """Whether module ``name`` matches a tp_plan ``pattern`` (``*`` a block index)."""
    return re.fullmatch(pattern.replace(".", r"\.").replace("*", r"\d+"), name) is not None


def _grad_all_reduce(model, patterns: list[str], mesh) -> None:
    """transformers' ``ReplicatedWithGradAllReduce`` (transformers/distributed/tensor_parallel.py):
    the matching modules' parameters stay replicated, and each gradient, once accumulated, is
    summed over the group (``dist.all_reduce(param.grad, group)`` in a post-accumulate-grad
    hook): each rank's gradient covers only its own heads. As there, the hooks are put on the
    parameters at the forward (a forward pre-hook): the model is materialised after the plan
    (``to_empty``), which makes new parameter objects."""
    import torch
    import torch.distributed as dist

    group = mesh.get_group()

    def all_reduce(param):
        dist.all_reduce(param.grad, group=group)

    def hook_params(module, args):
        if torch.is_grad_enabled():
            done = module.__dict__.setdefault("_symcost_grad_all_reduce", {})
            for n, p in module.named_parameters(recurse=False):
                if p.requires_grad and done.get(n) is not p:
                    p.register_post_accumulate_grad_hook(all_reduce)
                    done[n] = p

    for name, module in model.named_modules():
        if any(_fqn_match(p, name) for p in patterns):
            module.register_forward_pre_hook(hook_params)


def _transformers_model(model) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (without importing transformers)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
               for c in type(model).__mro__)
