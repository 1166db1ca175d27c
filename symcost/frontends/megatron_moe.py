"""transformers' MoE experts run as Megatron-Core runs its MoE layer (``--precision megatron-*``).

Under a Megatron-LM policy (:func:`symcost.frontends.megatron.for_run`) the experts module of a
transformers MoE model (``@use_experts_implementation``: ``gate_up_proj`` ``[E, 2F, M]``,
``down_proj`` ``[E, M, F]``) runs Megatron-Core's alltoall token dispatcher and grouped experts in
place of transformers' ``grouped_mm_experts_forward``, step by step as Megatron-LM has them
(NVIDIA/Megatron-LM at d98e8a64ddf34856e74b24714e3bedb2f5a39553; files under
``megatron/core/transformer/moe/`` unless said):

1. **Routing tensors** (router.py ``TopKRouter.routing`` → moe_utils.py
   ``topk_routing_with_score_function``, l. 766, 952–955): the router's top-k choice as Megatron's ``routing_map``
   ``[N, E]`` bool (``zeros_like(logits).int().scatter(1, top_indices, 1).bool()``) and ``probs``
   ``[N, E]`` (``zeros_like(logits).scatter(1, top_indices, probs)``). The scores and the top-k
   themselves are the model's router (a softmax over E then the top R, renormalised for Qwen3:
   the same values as Megatron's ``softmax`` score function over the top-R logits); Megatron's
   auxiliary load-balancing loss is not run (an ``[N, E]`` computation).
2. **Count exchange** (token_dispatcher.py ``MoEAlltoAllTokenDispatcher.preprocess``, l. 543, 569–576):
   the tokens per expert ``routing_map.sum(dim=0)`` all-gathered over the EP group
   (``gather_from_sequence_parallel_region``); under EP only. Its values are not read: under the
   routing model the split sizes are fixed (balanced: N·R/E rows per expert from each rank).
3. **Permutation 1** (moe_utils.py ``permute``, l. 344, 462–486, the dropless argsort path Megatron
   calls with ``num_out_tokens = N·R``, token_dispatcher.py l. 556): ``routing_map.T`` flattened,
   ``argsort(descending=True, stable=True)``, the first N·R positions, ``% N`` the token of each
   slot (expert-major, tokens ascending within an expert); the probs gathered alike
   (``probs.T.contiguous().reshape(-1)[flat_sorted]``); the tokens by ``index_select``
   (``[N·R, M]``).
4. **Token dispatch** (token_dispatcher.py ``token_dispatch``, l. 682–726): ``all_to_all`` of the
   permuted tokens and of the permuted probs over the EP group (none on one rank:
   ``_AllToAll.forward`` returns its input at world size 1, tensor_parallel/mappings.py l. 424–436).
5. **Permutation 2** (``dispatch_postprocess``, l. 728, 757–790): with more than one local expert the
   received rows, rank-major, sorted to expert-major (``sort_chunks_by_idxs``: ``split`` by the
   counts then ``cat`` in expert order). Under the routing model every chunk has the same size,
   so this is the ``view(EP, E/EP, q, M).transpose(0, 1).contiguous()`` Megatron runs for equal
   chunks (its drop-and-pad branch, l. 758–769): the same values and bytes (one copy of the
   rows). On one rank the chunks are already in order and ``cat`` copies them once (a ``clone``
   here: the same bytes).
6. **Experts** (experts.py ``TEGroupedMLP.forward``, l. 840; fc1 l. 932, SwiGLU l. 943–966, fc2
   l. 1028): ``linear_fc1`` one grouped GEMM
   over the local experts (Transformer Engine's ``GroupedLinear``: ``torch._grouped_mm`` here,
   offsets from the tokens per local expert), the SwiGLU weighted by the permuted probs
   (``bias_act_func`` → fusions/fused_bias_swiglu.py ``weighted_bias_swiglu_impl``:
   ``WeightedSwiGLUFunction``, which saves its input and the probs only, :func:`weighted_swiglu`),
   ``linear_fc2`` one grouped GEMM. The probabilities are applied here, not at the unpermutation.
7. **Unpermutation 2** (``combine_preprocess``, l. 796, 803–822): the inverse sort of step 5.
8. **Token combine** (``token_combine``, l. 837, 864–870): ``all_to_all`` back.
9. **Unpermutation 1** (``combine_postprocess``, l. 876, 891 → moe_utils.py ``unpermute``, l. 497,
   603–625, called without probs): ``zeros [N, M]`` and the rows added at their tokens (the sum
   over a token's R slots; :func:`unpermute`).

Megatron's recipes may fuse steps 3, 5, 7 and 9 (``--moe-permute-fusion``: Transformer Engine's
permute kernels, which read and write the same rows in fewer kernels) and compile the SwiGLU
(``jit_fuser`` = ``torch.compile``, megatron/core/jit.py): those fusions are not modelled, the
PyTorch code above is what is traced (its ops and saved tensors). Under ``--routing capacity=c``
transformers' experts keep symcost's padded dispatch (Megatron's drop-and-pad path is not
modelled).

Torch is imported only inside the functions that need it.
"""
from __future__ import annotations

from symcost.errors import SymcostError

#: ``spec.extra["moe_code"]`` of a spec whose experts run Megatron-Core's code
MEGATRON = "megatron"
#: what the report says the experts run (``spec.extra["experts_code"]``)
EXPERTS_CODE = ("Megatron-Core's alltoall token dispatcher and TEGroupedMLP (symcost.frontends.megatron_moe: "
                "argsort permute, grouped GEMMs, probs in the weighted SwiGLU, index_add unpermute)")
#: the ``git`` commit of NVIDIA/Megatron-LM the steps are read from
MEGATRON_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"


def is_megatron(module) -> bool:
    """Whether an experts module runs Megatron-Core's MoE code (:func:`mark` set it)."""
    from symcost.frontends.moe import CODE_ATTR

    return getattr(module, CODE_ATTR, None) == (forward, ep_forward)


def for_megatron(spec):
    """A copy of a transformers MoE :class:`~symcost.frontends.spec.ModelSpec`
    (``extra["hf_experts"]``) whose experts modules run Megatron-Core's MoE code (module
    docstring); any other spec is returned as it is. Applying it twice is applying it once."""
    import dataclasses

    if not spec.extra.get("hf_experts") or spec.extra.get("moe_code") == MEGATRON:
        return spec
    base = spec.build

    def build(values):
        model = base(values)
        mark(model)
        return model

    extra = dict(spec.extra, moe_code=MEGATRON)
    from symcost.frontends.moe import routing_of_spec

    routing = routing_of_spec(spec)
    if routing is None or routing.kind != "capacity":
        extra["experts_code"] = EXPERTS_CODE
    return dataclasses.replace(spec, build=build, extra=extra)


def mark(model):
    """Set :data:`symcost.frontends.moe.CODE_ATTR` on every transformers experts module of ``model``
    to ``(forward, ep_forward)``: its forward (:func:`symcost.frontends.moe.experts_forward`) and
    its expert-parallel forward (:func:`symcost.frontends.expert_parallel.apply`) run
    Megatron-Core's code; returns ``model``."""
    from symcost.frontends.moe import CODE_ATTR, _is_hf_experts

    for m in model.modules():
        if _is_hf_experts(m):
            object.__setattr__(m, CODE_ATTR, (forward, ep_forward))
    return model


# -- Megatron-Core's pieces, in PyTorch ----------------------------------------------------------------


def routing_tensors(top_k_index, top_k_weights, n_experts: int):
    """Megatron's ``routing_map [N, E]`` (bool) and ``probs [N, E]`` (``top_k_weights``' dtype)
    from the router's choice ``top_k_index [N, R]`` (int64) and weights ``[N, R]``
    (moe_utils.py ``topk_routing_with_score_function``: two ``scatter`` s into zeros)."""
    import torch

    n = top_k_index.shape[0]
    shape = (n, n_experts)
    probs = torch.zeros(shape, dtype=top_k_weights.dtype, device=top_k_weights.device).scatter(
        1, top_k_index, top_k_weights)
    routing_map = torch.zeros(shape, dtype=torch.int32, device=top_k_index.device).scatter(
        1, top_k_index, 1).bool()
    return routing_map, probs


def permute(tokens, routing_map, probs, num_out_tokens: int):
    """Megatron-Core's ``permute`` (moe_utils.py, the dropless argsort path): ``tokens [N, M]``,
    ``routing_map [N, E]`` bool, ``probs [N, E]``, ``num_out_tokens`` = N·R ->
    ``(permuted tokens [N·R, M], permuted probs [N·R], sorted_indices [N·R] int64)``, expert-major
    (the tokens of expert 0 in ascending order, then expert 1's, ...)."""
    n = tokens.shape[0]
    routing_map = routing_map.bool().T.contiguous()
    flat_sorted = routing_map.reshape(-1).argsort(descending=True, stable=True)
    flat_sorted = flat_sorted[:num_out_tokens]
    sorted_indices = flat_sorted % n
    permuted_probs = probs.T.contiguous().reshape(-1)[flat_sorted]
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


_SCATTER_ADD = None


def _scatter_add_function():
    import torch

    class ScatterAddRows(torch.autograd.Function):
        """``zeros(shape).scatter_add_(0, index.unsqueeze(1).expand(-1, M), src)`` with the autograd
        PyTorch gives ``scatter_add`` (tools/autograd/derivatives.yaml: ``src: grad.gather(dim,
        index)``, saving the index only): the forward as ``index_add_`` of the rows, the backward
        as ``index_select`` of the gradient's rows, over the 1-D index (the same values and rows)."""

        @staticmethod
        def forward(ctx, src, index, shape):
            ctx.save_for_backward(index)
            out = torch.zeros(shape, dtype=src.dtype, device=src.device)
            return out.index_add_(0, index, src)

        @staticmethod
        def backward(ctx, grad):
            (index,) = ctx.saved_tensors
            return grad.index_select(0, index), None, None

    return ScatterAddRows


def unpermute(permuted_tokens, sorted_indices, restore_shape):
    """Megatron-Core's ``unpermute`` without probs (moe_utils.py l. 497, 600–625): ``permuted_tokens
    [N·R, M]`` summed into ``zeros(restore_shape)`` ``[N, M]`` at the rows ``sorted_indices
    [N·R]``: its default branch, ``scatter_add_`` of the index expanded to ``[N·R, M]`` (l.
    613–617), whose autograd keeps the index only. Recorded as that op's rows over the 1-D index
    (``index_add_`` forward, ``index_select`` backward: the same values, rows and saved index),
    since symcost counts an op's inputs by their shapes and would read the expanded int64 index
    as N·R·M elements; plain ``index_add_`` (Megatron's deterministic branch, l. 604–612) would
    also keep the ``[N·R, M]`` rows for its backward (derivatives.yaml: ``expand_as(source)``)."""
    global _SCATTER_ADD
    if _SCATTER_ADD is None:
        _SCATTER_ADD = _scatter_add_function()
    return _SCATTER_ADD.apply(permuted_tokens, sorted_indices, tuple(restore_shape))


def sort_chunks(x, outer: int, inner: int):
    """Megatron's ``sort_chunks_by_idxs`` for equal chunks: ``x [outer·inner·q, ...]`` as
    ``outer × inner`` chunks of q rows, reordered ``inner × outer`` (rank-major to expert-major
    with ``outer`` = EP, ``inner`` = E/EP; the inverse with the two swapped): one copy."""
    rows = x.shape[0] // (outer * inner)
    return x.view(outer, inner, rows, *x.shape[1:]).transpose(0, 1).contiguous().view(x.shape)


_WEIGHTED_SWIGLU = None


def _weighted_swiglu_function():
    import torch
    import torch.nn.functional as F

    class WeightedSwiGLUFunction(torch.autograd.Function):
        """fusions/fused_bias_swiglu.py ``WeightedSwiGLUFunction`` (no clamp, no fp8 store):
        forward ``weighted_swiglu`` (``silu(y_1) * y_2 * w``), saving ``y`` and ``w`` only;
        backward ``weighted_swiglu_back``: the input gradient ``swiglu_back(g·w, y)`` (written with
        aten's ``silu_backward``: g·w·y_2·silu'(y_1) for y_1, g·w·silu(y_1) for y_2) and the
        weights' gradient ``sum(swiglu(y)·g, -1)``."""

        @staticmethod
        def forward(ctx, y, w):
            ctx.save_for_backward(y, w)
            y_1, y_2 = torch.chunk(y, 2, -1)
            return (F.silu(y_1) * y_2 * w).to(y.dtype)

        @staticmethod
        def backward(ctx, g):
            y, w = ctx.saved_tensors
            y_1, y_2 = torch.chunk(y, 2, -1)
            gw = g * w
            act = F.silu(y_1)
            grad = torch.cat((torch.ops.aten.silu_backward(gw * y_2, y_1), gw * act), -1)
            w_grad = (act * y_2 * g.to(w.dtype)).sum(dim=-1, keepdim=True)
            return grad.to(y.dtype), w_grad.to(w.dtype)

    return WeightedSwiGLUFunction


def weighted_swiglu(y, w):
    """Megatron's probs-weighted SwiGLU (``weighted_bias_swiglu_impl`` without bias):
    ``y [S, 2F]`` (the gate's F columns, then the up's), ``w [S, 1]`` -> ``[S, F]`` in y's dtype."""
    global _WEIGHTED_SWIGLU
    if _WEIGHTED_SWIGLU is None:
        _WEIGHTED_SWIGLU = _weighted_swiglu_function()
    return _WEIGHTED_SWIGLU.apply(y, w)


def experts(self, h, probs, offsets, w_up, w_down):
    """``TEGroupedMLP.forward`` on the rows ``h [S, M]`` sorted by local expert, their ``probs
    [S]`` and the grouped GEMMs' ``offsets`` (int32 cumulative rows per local expert): fc1, the
    weighted SwiGLU (a gated experts module; else the activation times the probs, as
    ``bias_act_func``'s unfused branch), fc2 -> ``[S, M]``."""
    from transformers.integrations.moe import _grouped_linear

    out = _grouped_linear(h, w_up, offsets, is_transposed=self.is_transposed)
    p = probs.unsqueeze(-1)
    if self.has_gate:
        out = weighted_swiglu(out, p)
    else:
        out = (self.act_fn(out) * p).to(out.dtype)
    out = _grouped_linear(out, w_down, offsets, is_transposed=self.is_transposed)
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    return out


def _check(self):
    if self.has_bias or not getattr(self, "is_concatenated", True):
        raise SymcostError(f"--precision megatron-*: {type(self).__name__} has expert biases or interleaved "
                           "gate/up weights (gpt-oss); Megatron-Core's MoE code for them is not modelled yet")


def forward(self, hidden_states, top_k_index, top_k_weights):
    """The experts module on one rank without expert parallelism, as Megatron-Core runs it (module
    docstring, steps 1, 3, 5–7, 9): ``hidden_states [N, M]``, ``top_k_index``, ``top_k_weights
    [N, R]`` -> ``[N, M]``. The grouped GEMMs' offsets are the cumulative tokens per expert
    (``routing_map.sum(0)``), so any routing (the balanced one included) gives the same shapes."""
    import torch

    _check(self)
    n, r = top_k_index.shape
    e = self.num_experts
    routing_map, probs = routing_tensors(top_k_index, top_k_weights, e)
    tokens_per_expert = routing_map.sum(dim=0)
    x, p, idx = permute(hidden_states, routing_map, probs, n * r)
    x, p = x.clone(), p.clone()  # (permutation 2 on one rank: the E chunks cat in their own order)
    offsets = tokens_per_expert.cumsum(0, dtype=torch.int32)
    w_up = self.gate_up_proj if self.has_gate else self.up_proj
    out = experts(self, x, p, offsets, w_up, self.down_proj)
    out = out.clone()  # (unpermutation 2: the chunks back, in their own order)
    return unpermute(out, idx, hidden_states.shape).to(hidden_states.dtype)


def ep_forward(self, hidden_states, top_k_index, top_k_weights):
    """The experts module on one expert-parallel rank as Megatron-Core's alltoall dispatcher runs
    it (module docstring, steps 1–9), the weights the rank's ``[E/EP, ...]`` shards
    (:func:`symcost.frontends.expert_parallel.apply`): ``hidden_states [N, M]``, ``top_k_index``,
    ``top_k_weights [N, R]`` -> ``[N, M]``.

    Under balanced routing every rank sends N·R/EP rows to every rank and each local expert
    receives N·R/E rows from each (the all-to-alls' split sizes); under ``--routing skew=X`` the
    rank is the most loaded one (X·N·R/E rows per local expert from each rank) and its own N·R
    rows go out balanced, as :func:`symcost.frontends.expert_parallel.hf_forward`. With the
    ``tp_mesh`` of ``--ep --tp`` each TP rank routes its N/TP tokens (docs/parallel.md §14.8)."""
    import torch
    from torch.distributed._functional_collectives import all_gather_single

    from symcost.frontends.expert_parallel import _local, exchange, rank_slots
    _check(self)
    mesh = self.ep_mesh
    ep, e = mesh.size(), self.num_experts
    local = e // ep
    full = hidden_states
    tp_mesh = getattr(self, "tp_mesh", None)
    hidden_states, top_k_index, top_k_weights, start, xq = rank_slots(self, hidden_states, top_k_index, top_k_weights)
    n, m = hidden_states.shape
    r = top_k_index.shape[-1]
    s = n * r
    routing_map, probs = routing_tensors(top_k_index, top_k_weights, e)
    with torch.no_grad():  # (step 2: the counts' all-gather over the EP group; the values are not read)
        counts = routing_map.sum(dim=0).long()
        torch.ops._c10d_functional.wait_tensor(all_gather_single(counts, 0, mesh.get_group()))
    x, p, idx = permute(hidden_states, routing_map, probs, s)
    x = exchange(x, mesh, local * xq)  # (step 4: tokens, then probs)
    p = exchange(p, mesh, local * xq)
    x, p = sort_chunks(x, ep, local), sort_chunks(p, ep, local)  # (step 5: expert-major)
    offsets = torch.full((local,), ep * xq, dtype=torch.int32, device=x.device).cumsum(0, dtype=torch.int32)
    w_up = _local(self.gate_up_proj if self.has_gate else self.up_proj)
    out = experts(self, x, p, offsets, w_up, _local(self.down_proj))
    out = sort_chunks(out, local, ep)  # (step 7: rank-major again)
    out = exchange(out, mesh, local * (s // e))  # (step 8)
    out = unpermute(out, idx, hidden_states.shape).to(hidden_states.dtype)  # (step 9)
    if tp_mesh is not None:
        from symcost.frontends.expert_parallel_tp import place

        out = place(out, start, full.shape[0])
    return out
