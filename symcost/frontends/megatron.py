"""What a Megatron-LM run does where the traced PyTorch step would do otherwise (``--precision megatron-*``).

The ``megatron-*`` precision policies name the framework (Megatron-LM's ``--bf16`` / ``--fp16``
and its optimizers, docs/memory.md "Policies of training frameworks"). Under them a traced step
also runs two parts of Megatron-LM's step that change what a rank holds, as PyTorch code:

* **The loss** (:func:`vocab_parallel_cross_entropy`): Megatron's vocabulary-parallel cross
  entropy, ``megatron/core/tensor_parallel/cross_entropy.py`` (``_VocabParallelCrossEntropy``
  with the steps of ``VocabParallelCrossEntropy``, NVIDIA/Megatron-LM at 00611e6e), in place of
  the model's own loss. It casts the rank's logits ``[..., V/TP]`` to fp32 once, works in that
  buffer in place (max subtracted, ``exp``, divided by the sum: the softmax), saves it with the
  target mask and the local targets, and in backward turns it into the gradient in place. The
  16-bit logits and the fp32 buffer are live together at the end of the forward (6 bytes per
  local logit in bf16), the buffer and its 16-bit cast gradient at the start of the backward.
  transformers' loss (``logits.float()`` then ``cross_entropy``, whose ``log_softmax`` and its
  backward each allocate another fp32 tensor) and ``loss_parallel`` hold more. The targets are
  the input tokens shifted left by one (``roll``), as Megatron's data loader gives
  ``labels = tokens[1:]`` of an ``S + 1`` sample; every position has a target, the loss is their
  mean (``loss_mask`` all ones).
* **Data parallelism** (:func:`wrap_in_place`): Megatron's ``DistributedDataParallel`` uses
  the parameters in place (views of one contiguous buffer) and reduces each gradient over the
  data-parallel group once it is accumulated (``_make_backward_post_hook``; the buckets'
  all-reduce, or reduce-scatter with ``--use-distributed-optimizer``: the same bytes per rank
  under the ring). symcost's ``--shard ddp|zero1`` otherwise traces PyTorch's
  ``replicate_with_fsdp.replicate``, which on its shard group of 1 copies every parameter into
  an all-gather buffer for the forward and backward. The fp32 main-gradient buffer is a model
  state of the policy (``symcost.passes.memory.POLICIES``), not a traced tensor.
* **The vocabulary-parallel embedding** under ``--tp`` (:func:`vocab_parallel_embedding`):
  Megatron-LM's ``VocabParallelEmbedding`` looks the rank's ``[V/TP, d]`` rows up with masked
  local ids and so computes only those rows' gradient, where PyTorch's ``RowwiseParallel``
  embedding gives back the whole ``[V, d]`` one (DTensor's ``embedding_dense_backward`` has no
  ``Shard(0)`` strategy).
* **The MoE layers** (:mod:`symcost.frontends.megatron_moe`): a transformers MoE model's experts
  run Megatron-Core's alltoall token dispatcher and grouped experts (argsort permutation, one
  grouped GEMM per projection over the local experts, the probabilities in the weighted SwiGLU,
  ``index_add`` unpermutation), alone or under ``--ep``, in place of transformers' code.

Torch is imported only inside the functions that need it.
"""
from __future__ import annotations

from typing import Any

#: the loss a ``megatron-*`` trace runs (``spec.extra["loss"]``, shown by the report)
LOSS = ("Megatron-LM vocab-parallel cross entropy (megatron/core/tensor_parallel/cross_entropy.py): "
        "fp32 softmax computed and turned into its gradient in place")
#: the data-parallel engine a ``megatron-*`` trace runs under --shard ddp|zero1
ENGINE = "megatron-ddp"


def is_megatron(precision: str | None) -> bool:
    """Whether ``precision`` is one of Megatron-LM's policies (``megatron-*``)."""
    return bool(precision) and str(precision).startswith("megatron-")


def _function():
    import torch
    import torch.distributed as dist

    class VocabParallelCrossEntropy(torch.autograd.Function):
        """Megatron-LM's ``_VocabParallelCrossEntropy`` without label smoothing, ported step by
        step (module docstring). ``forward(logits [..., Vp], target [...], group, rank)`` ->
        per-position loss ``[...]`` fp32; ``group`` None: one rank holds the whole vocabulary."""

        @staticmethod
        def forward(ctx, logits, target, group, rank):
            ctx.dtensor = None
            if hasattr(logits, "to_local"):  # (the rank's shard, worked on as Megatron works on its logits)
                ctx.dtensor = (logits.device_mesh, logits.placements, logits.shape, logits.stride())
                logits = logits.to_local()
            buf = logits.float()  # (a new fp32 tensor for 16-bit logits; fp32 logits are used in place)
            top = torch.max(buf, dim=-1)[0]
            if group is not None:
                dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            buf -= top.unsqueeze(dim=-1)
            part = buf.size()[-1]
            first, last = rank * part, (rank + 1) * part
            outside = (target < first) | (target >= last)
            local = target.clone() - first
            local[outside] = 0
            rows = buf.view(-1, part)
            local_1d = local.view(-1)
            arange = torch.arange(start=0, end=rows.size()[0], device=rows.device)
            picked = rows[arange, local_1d].clone().contiguous().view_as(target)
            picked[outside] = 0.0
            torch.exp(buf, out=buf)
            total = buf.sum(dim=-1)
            if group is not None:
                dist.all_reduce(picked, op=dist.ReduceOp.SUM, group=group)
                dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
            loss = torch.log(total) - picked
            buf.div_(total.unsqueeze(dim=-1))
            ctx.save_for_backward(buf, outside, local_1d)
            return loss

        @staticmethod
        def backward(ctx, grad_output):
            softmax, outside, local_1d = ctx.saved_tensors
            grad = softmax
            rows = grad.view(-1, grad.size()[-1])
            arange = torch.arange(start=0, end=rows.size()[0], device=rows.device)
            update = 1.0 - outside.view(-1).float()
            rows[arange, local_1d] -= update
            grad.mul_(grad_output.unsqueeze(dim=-1))
            if ctx.dtensor is not None:
                from torch.distributed.tensor import DTensor

                mesh, placements, shape, stride = ctx.dtensor
                grad = DTensor.from_local(grad, mesh, placements, run_check=False, shape=shape, stride=stride)
            return grad, None, None, None

    return VocabParallelCrossEntropy


_FN = None


def vocab_parallel_cross_entropy(logits, target):
    """Per-position cross entropy of ``logits [..., V]`` against ``target [...]`` (int64 token
    ids in ``[0, V)``) computed as Megatron-LM computes it (module docstring): -> fp32 ``[...]``.

    ``logits`` may be a ``DTensor`` sharded on its last (vocabulary) dimension over a 1-D mesh
    (the tensor-parallel plan's column-parallel head): the rank's local shard ``[..., V/TP]`` is
    used, its vocabulary range is ``[rank·V/TP, (rank + 1)·V/TP)``, and the row maximum, the
    target logit and the sum of exponentials are all-reduced over the mesh's group, as Megatron
    all-reduces them over the tensor-parallel group. A replicated ``DTensor`` is used whole.
    Numerically equal to ``F.cross_entropy(logits, target, reduction="none")`` (tests).

    Raises:
        SymcostError: a ``DTensor`` sharded on another dimension or over a mesh of more than
            one dimension.
    """
    global _FN
    if _FN is None:
        _FN = _function()
    group, rank = None, 0
    if hasattr(logits, "device_mesh") and hasattr(logits, "to_local"):
        from symcost.errors import SymcostError

        mesh, placements = logits.device_mesh, logits.placements
        if mesh.ndim != 1:
            raise SymcostError("the Megatron loss takes logits on a 1-D tensor-parallel mesh")
        p = placements[0]
        if p.is_shard():
            if p.dim not in (-1, logits.ndim - 1):
                raise SymcostError(f"the Megatron loss takes logits sharded on the vocabulary (last) dimension, "
                                   f"not {p}")
            group, rank = mesh.get_group(), mesh.get_local_rank()
    return _FN.apply(logits, target, group, rank)


def megatron_loss(out: Any, inputs) -> Any:
    """The mean of :func:`vocab_parallel_cross_entropy` over every position of a language
    model's output (``out``: the logits ``[B, S, V]``, or a ``transformers`` output with
    ``.logits``), the targets being the input tokens (``inputs``: the first positional input or
    ``input_ids``) shifted left by one."""
    logits = getattr(out, "logits", out)
    args, kwargs = inputs
    tokens = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
    return vocab_parallel_cross_entropy(logits, tokens.roll(-1, dims=1)).mean()


#: ``--loss``: the model's own loss, or Megatron-LM's (the default: Megatron's under ``megatron-*``)
LOSSES = ("model", "megatron")


def for_run(spec, precision: str | None, torch_device: str | None = None, loss: str | None = None):
    """``spec`` as the run traces it: ``extra["torch_device"]`` (the target device whose kernels
    the recording runs, :mod:`symcost.tracing.device_kernels`) where given; under a
    Megatron-LM policy (:func:`is_megatron`) ``extra["dp_engine"]`` (Megatron's data-parallel
    engine for ``--shard ddp|zero1``) and, for a transformers MoE model, its experts as
    Megatron-Core runs them (:func:`symcost.frontends.megatron_moe.for_megatron`); and with
    ``loss`` ``"megatron"`` (None: under a
    Megatron-LM policy) a training step's loss replaced by :func:`megatron_loss` (the inputs
    lose ``labels``: the model returns its logits) and ``extra["loss"]`` set (module
    docstring); ``loss="model"`` keeps the model's own. Only a language model (one with the
    symbol ``V``) takes Megatron's loss; under a Megatron-LM policy another model keeps its own.
    Applying it twice is applying it once.

    Raises:
        SymcostError: a ``loss`` not in :data:`LOSSES`; ``"megatron"`` for a model without ``V``.
    """
    import dataclasses

    if loss is not None and loss not in LOSSES:
        from symcost.errors import SymcostError

        raise SymcostError(f"unknown --loss {loss!r}; accepted: {', '.join(LOSSES)}")
    extra = dict(spec.extra)
    if torch_device is not None:
        extra["torch_device"] = str(torch_device)
    if is_megatron(precision) and spec.step == "train":
        extra["dp_engine"] = ENGINE
        from symcost.frontends import megatron_moe

        spec = megatron_moe.for_megatron(spec)  # (a transformers MoE's experts as Megatron-Core runs them)
        extra.update({k: v for k, v in spec.extra.items() if k in ("moe_code", "experts_code")})
    lm = "V" in spec.symbols  # (a language model: logits over a vocabulary V, token-id inputs)
    if loss is None:  # (a spec this has run through keeps its choice)
        loss = extra.get("loss_choice") or ("megatron" if is_megatron(precision) and lm else "model")
    if loss == "megatron" and not lm:
        from symcost.errors import SymcostError

        raise SymcostError(f"--loss megatron is a language model's loss (logits over a vocabulary V); "
                           f"{spec.name} has no symbol V")
    extra["loss_choice"] = loss
    if (loss != "megatron" or spec.step != "train" or extra.get("loss") == LOSS
            or "pipeline_stage" in extra):  # (a stage takes its loss from the model's spec, run through this)
        return dataclasses.replace(spec, extra=extra) if extra != spec.extra else spec
    inner = spec.make_inputs

    def make_inputs(values, device):
        """The model's inputs without ``labels`` (its logits are the output)."""
        args, kwargs = inner(values, device)
        return args, {k: v for k, v in kwargs.items() if k != "labels"}

    extra["loss"] = LOSS
    return dataclasses.replace(spec, make_inputs=make_inputs, loss=megatron_loss, extra=extra)


def wrap_in_place(model, mesh, experts_mesh=None) -> None:
    """Megatron-LM's data-parallel engine as memory sees it (module docstring): every
    parameter of ``model`` stays where it is, and a hook all-reduces its gradient over
    ``mesh``'s group once autograd has accumulated it (``register_post_accumulate_grad_hook``).
    Megatron all-reduces (or, with the distributed optimizer, reduce-scatters) buckets of a
    contiguous gradient buffer: the same bytes per rank as one all-reduce per gradient, each of
    the parameter's local shape (with ``--tp``, the vocabulary-parallel embedding's ``[V/TP, d]``
    rows, as Megatron-LM's ``VocabParallelEmbedding`` computes its gradient on its local
    weight: megatron/core/tensor_parallel/layers.py; PyTorch's ``RowwiseParallel`` returns the
    whole ``[V, d]`` gradient, ``Replicate``, which is reduced in the weight's placements; under
    ``megatron-*`` the trace runs Megatron's embedding, :func:`vocab_parallel_embedding`, whose
    gradient has the rank's rows already, and the narrowing is left for any other). The
    hooks are registered at the model's first forward, on the parameters it has then (they are
    materialised after wrapping).

    ``experts_mesh``: under expert parallelism (docs/parallel.md §14.11), the gradients of the
    experts modules' parameters (:func:`symcost.frontends.expert_parallel.experts_modules`, their
    local ``[E/EP, ...]`` shards) are all-reduced over its group instead, Megatron's
    expert-data-parallel group: Megatron-Core keeps them in buffers of their own
    (``DistributedDataParallel.__init__``: ``expert_parallel_params`` and
    ``expert_parallel_buffers`` over ``expt_dp_group``, megatron/core/distributed/
    distributed_data_parallel.py), the dense ones over its data-parallel group."""
    import torch.distributed as dist

    group = mesh.get_group()
    expert_group = experts_mesh.get_group() if experts_mesh is not None else None

    def reduce(p, g_group):
        g = p.grad
        if hasattr(g, "placements") and g.placements != p.placements:
            # (the vocabulary-parallel embedding: PyTorch's gradient is a whole Replicate [V, d]
            # beside the Shard(0) weight; Megatron's VocabParallelEmbedding's is the local
            # [V/TP, d], which its buffer holds and reduces: this rank's rows, a view, as
            # torch.chunk splits them; DTensor's redistribute would copy them, an op of no
            # Megatron run)
            from torch.distributed.tensor import Replicate, Shard

            (w,) = p.placements if len(p.placements) == 1 else (None,)
            if isinstance(w, Shard) and all(isinstance(x, Replicate) for x in g.placements):
                n, step = p._local_tensor.shape[w.dim], -(-g.shape[w.dim] // p.device_mesh.size())
                g = g.to_local().narrow(w.dim, p.device_mesh.get_local_rank() * step, n)
            else:
                g = g.redistribute(g.device_mesh, p.placements)
        dist.all_reduce(g.to_local() if hasattr(g, "to_local") else g, group=g_group)

    hooked: set[int] = set()

    def hook(module, args):  # (at each forward: the parameters are materialised after wrapping)
        experts: set[int] = set()
        if expert_group is not None:  # (read now: the experts' parameters as they are at this forward)
            from symcost.frontends.expert_parallel import experts_modules

            experts = {id(p) for _, m, _ in experts_modules(module) for p in m.parameters()}
        for p in module.parameters():
            if p.requires_grad and id(p) not in hooked:
                hooked.add(id(p))
                g_group = expert_group if id(p) in experts else group
                p.register_post_accumulate_grad_hook(lambda p, g_group=g_group: reduce(p, g_group))

    model.register_forward_pre_hook(hook)


def vocab_parallel_embedding(model) -> list[str]:
    """Megatron-LM's ``VocabParallelEmbedding`` forward (megatron/core/tensor_parallel/layers.py,
    NVIDIA/Megatron-LM at d98e8a6) for every token embedding the tensor-parallel plan split by
    vocabulary rows (an ``nn.Embedding`` whose weight is a ``Shard(0)`` DTensor on a 1-D mesh:
    PyTorch's ``RowwiseParallel``), in place; returns their module names.

    Rank ``r`` of ``TP`` holds rows ``[r·V/TP, (r + 1)·V/TP)`` (``VocabUtility.
    vocab_range_from_global_vocab_size``). Its forward, as Megatron's: ``input_mask`` = ids
    outside that range, ``masked_input = ids.clone() - first`` with the masked ids set to 0, the
    lookup of ``masked_input`` in the local ``[V/TP, d]`` weight (the module's own forward, so a
    subclass's scaling stays), the masked positions' rows set to 0 in place; the partial sums
    leave as a ``Partial`` DTensor, which the plan's output hook reduces as before (all-reduce,
    or reduce-scatter over the sequence with ``--sp``). So the backward's
    ``embedding_dense_backward`` runs on the local ids with ``V/TP`` rows: the gradient is the
    rank's ``[V/TP, d]`` rows (a ``Shard(0)`` DTensor like the weight), where PyTorch's own
    ``RowwiseParallel`` makes it whole, ``[V, d]`` (``Replicate``: DTensor's
    ``embedding_dense_backward`` strategies have no ``Shard(0)`` output), 2·V·d·(1 − 1/TP)
    bytes (bf16) more at that point of the backward. Megatron's embedding has no padding row:
    ``padding_idx`` is not applied. Uneven rows (``V % TP``) are refused before any trace
    (:func:`symcost.frontends.tensor_parallel.uneven_vocab`)."""
    import types

    from torch import nn
    from torch.distributed.tensor import DTensor, Partial, Shard

    done = []
    for name, m in model.named_modules():
        w = getattr(m, "weight", None)
        if (not isinstance(m, nn.Embedding) or not isinstance(w, DTensor) or w.device_mesh.ndim != 1
                or tuple(w.placements) != (Shard(0),)):
            continue
        own = type(m).forward

        def forward(self, ids, *args, _own=own, **kwargs):
            weight = self.weight
            mesh = weight.device_mesh
            if isinstance(ids, DTensor):  # (the plan's input hook: the replicated ids)
                ids = ids.to_local()
            local = weight.to_local()
            rows = local.shape[0]
            first = mesh.get_local_rank() * rows
            input_mask = (ids < first) | (ids >= first + rows)
            masked_input = ids.clone() - first
            masked_input[input_mask] = 0
            pad, self.padding_idx = self.padding_idx, None
            self._parameters["weight"] = local  # (the module's own lookup on the rank's rows)
            try:
                out = _own(self, masked_input, *args, **kwargs)
            finally:
                self._parameters["weight"], self.padding_idx = weight, pad
            out[input_mask, :] = 0.0
            return DTensor.from_local(out, mesh, (Partial(),), run_check=False)

        m.forward = types.MethodType(forward, m)
        done.append(name)
    return done
