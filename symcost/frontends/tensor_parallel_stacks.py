"""Tensor and sequence parallelism on several stacks of blocks (an encoder-decoder: T5, BART,
Whisper; docs/parallel.md §1.1): the check that the Megatron plan covers every block's Linear, and
sequence parallelism where a stack's residual stream does not start at a vocabulary-parallel token
embedding (Whisper's encoder, a Conv1d stem): the stack's sequence-parallel region starts at its
first block; and the one-line refusal where a block flattens the sequence-sharded stream with the
batch (OPT). Used by :func:`symcost.frontends.tensor_parallel.apply`.

Torch is imported only inside the functions that need it.
"""
from __future__ import annotations

from symcost.errors import SymcostError


def _check_stacks_planned(model, containers: list[str], styles: dict, linear_like) -> None:
    """Several stacks under the Megatron plan (an encoder-decoder without a ``base_model_tp_plan``):
    every Linear inside the blocks must be column- or row-parallel: where a block's Linear has no
    style (T5's ``wi``, whose output feeds the row-parallel ``wo``) the plan would feed a whole
    activation into a row-parallel projection expecting 1/TP of it. ``linear_like``: the plan's
    test of a Linear (:func:`symcost.frontends.tensor_parallel._linear_like`).

    Raises:
        SymcostError: the first Linear of a block without a style, in one line with the names
            the plan accepts.
    """
    for c in containers:
        for n, m in model.get_submodule(c).named_modules():
            full = f"{c}.{n}" if n else c
            if linear_like(m) and full not in styles:
                cls = type(model).__name__
                raise SymcostError(
                    f"--tp: {full} ({type(m).__name__}) has no tensor-parallel style: {cls} has no "
                    "base_model_tp_plan in its config and the Megatron plan matches projections by name "
                    "(column-parallel: q, k, v, qkv, q_proj, k_proj, v_proj, up_proj, gate_proj, fc1, w1, w3, ...; "
                    "row-parallel: o, o_proj, out_proj, dense, fc2, w2, down_proj, ...); accepted: --dp, --ac, "
                    "or a model whose block projections follow those names")


def _stacks_entering_whole(roles: dict, containers: list[str]) -> list[str]:
    """Sequence parallelism over several stacks: the block containers whose stack's residual
    stream does not start at a vocabulary-parallel token embedding (BART's and T5's
    ``embed_tokens``, whose output the plan reduce-scatters over the sequence). Whisper's encoder
    starts at a ``Conv1d`` stem over the mel frames, whose output is whole on every rank; the
    stack's sequence-parallel region then starts at its first block (:func:`_scatter_first_block`),
    everything before it (the stem, its learned position table and their add, the dropout) runs
    whole on every rank, as Megatron-LM's embedding runs before its
    ``scatter_to_sequence_parallel_region``. (Splitting only the position table, as on a stream
    that enters sharded, made the add mix a whole tensor and a DTensor, which DTensor refuses:
    'aten.add.Tensor got mixed torch.Tensor and DTensor'.) ``roles``: the Megatron plan's module
    roles (:func:`symcost.frontends.tensor_parallel._roles`)."""
    embeddings = [n for n, r in roles.items() if r == "embedding"]
    out = []
    for c in containers:
        stack = c.rpartition(".")[0]
        if stack and not any(n.startswith(stack + ".") for n in embeddings):
            out.append(c)
    return out


def _scatter_first_block(model, container: str, mesh, keep: bool) -> None:
    """With sequence parallelism: the first block of ``container`` (a stack whose stream enters
    whole, :func:`_stacks_entering_whole`) takes this rank's ``1/TP`` of its hidden states
    ``[B, S, h]`` over the sequence as ``PrepareModuleInput(input_layouts=Replicate(),
    desired_input_layouts=Shard(1), use_local_output=not keep)`` does (DTensor's redistribute: the
    rank's chunk copied out forward, an all-gather of its gradient backward; ``keep``: handed on as
    a DTensor sharded over the sequence), by position or as ``hidden_states``. The split runs in
    a module of its own registered on the stack (``<stack>.sp_scatter``, no parameters), called
    from the block's forward pre-hook: the recorder names it (``symcost_outside_blocks``), so its
    ops are the stack's, not block 0's, and the blocks still run the same ops and fold over the
    stack's length.

    Raises:
        SymcostError: at the step, where the block's first input is no ``[..., S, h]`` tensor
            whole on every rank (nothing to split), in one line.
    """
    from torch import nn
    from torch.distributed.tensor import DTensor, Replicate, Shard

    first = next(iter(model.get_submodule(container).children()), None)
    if first is None:
        return

    class SequenceScatter(nn.Module):
        """This rank's 1/TP of the stream over the sequence (a slice; its gradient all-gathered)."""

        def forward(self, x):
            if isinstance(x, DTensor) or getattr(x, "dim", lambda: 0)() < 2:
                raise SymcostError(f"--sp: {container}'s first block's input is {type(x).__name__} "
                                   f"{tuple(getattr(x, 'shape', ()))}, not the stream whole on every rank; nothing to "
                                   "split over the sequence: accepted for this model: --tp without --sp, --dp, --ac")
            # PyTorch's PrepareModuleInput(Replicate -> Shard): the rank's chunk copied out
            # contiguous (the first norm saves it: a slice would keep the whole stream's storage)
            got = DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(
                mesh, [Shard(x.dim() - 2)])
            return got if keep else got.to_local()

    split = SequenceScatter()
    split.symcost_outside_blocks = True  # (the recorder names it: tracing/record.py)
    stack = container.rpartition(".")[0]
    (model.get_submodule(stack) if stack else model).add_module("sp_scatter", split)

    def hook(module, args, kwargs):
        if args:
            return (split(args[0]),) + tuple(args[1:]), kwargs
        if "hidden_states" not in kwargs:
            raise SymcostError(f"--sp: {container}'s first block takes no positional input and no hidden_states; "
                               "nothing to split over the sequence: accepted for this model: --tp without --sp, "
                               "--dp, --ac")
        return args, {**kwargs, "hidden_states": split(kwargs["hidden_states"])}

    first.register_forward_pre_hook(hook, with_kwargs=True)


def refuse_flattened_sequence(model, styles: dict, blocks: list[str]) -> None:
    """Sequence parallelism on a transformers model (the residual stream a DTensor sharded over the
    sequence): each sequence-parallel norm and column-parallel projection inside the blocks checks,
    before its style lays its input out, that the input is not the stream flattened with the batch.
    OPT's decoder layer reshapes its hidden states to ``(-1, h)`` before its MLP
    (``OPTDecoderLayer.forward``: ``hidden_states.reshape(-1, hidden_states.size(-1))``) and back
    after it; DTensor lays ``[B, S/TP, h]`` flattened out as ``_StridedShard(0)``, which
    ``SequenceParallel`` (sequence dim 1) and the MLP's styles lay out again over the hidden
    dimension. PyTorch runs that on real tensors (loss and gradients equal the untouched model's on
    2 threaded ranks, checked by hand), but it is not the sequence-parallel step: with the
    recording's gather of a ``_StridedShard`` made to run on fake tensors, hf:opt at TP = 2
    all-gathered 6× and reduce-scattered 1.5× the bytes of Megatron's sequence parallelism per
    layer, all-reduced 4·B·S·h bytes more, and ran an all-to-all (which the CPU's process group
    emulates by an all-gather); on fake tensors it fails inside DTensor
    (``_StridedShard.local_shard_size_and_offset`` reads ``.tolist()``: DataDependentOutputException).
    Relabelling the rank's flattened rows ``Shard(0)`` around the MLP (row-wise until the row-parallel
    reduce-scatter, which returns each rank its rows) computes the same loss and gradients, but
    DTensor 2.13 cannot view ``_StridedShard(0)`` back to ``[B, S, h]`` sharded over S: it all-gathers
    the stream at the layer's ``.view`` (tried). A plan without that gather is not written yet.

    Raises:
        SymcostError: at the step, in one line, where a block's planned module receives such an
            input.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel

    from symcost.frontends.tensor_parallel_hf import _fqn_match

    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # pragma: no cover - an older torch has no such placement
        return
    prefixes = tuple(f"{b}." for b in blocks)
    planned = [p for p, st in styles.items() if isinstance(st, (SequenceParallel, ColwiseParallel))]

    def check(name):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs.get("hidden_states")
            if isinstance(x, DTensor) and any(isinstance(p, _StridedShard) for p in x.placements):
                raise SymcostError(
                    f"--sp: {name} receives the sequence-sharded hidden states flattened with the batch "
                    f"({tuple(x.shape)}: the block reshapes [B, S, h] to (-1, h), as OPT's decoder layer does before "
                    "its MLP), which DTensor lays out as _StridedShard(0) and the sequence-parallel styles lay out "
                    "again over the hidden dimension: not the sequence-parallel step, and a plan that keeps the "
                    "flattened tokens sharded is not written yet; accepted for this model: --tp without --sp, --dp, --ac")
        return hook

    for n, m in model.named_modules():
        if n.startswith(prefixes) and any(p == n or _fqn_match(p, n) for p in planned):
            m.register_forward_pre_hook(check(n), with_kwargs=True, prepend=True)
