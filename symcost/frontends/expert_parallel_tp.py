"""Expert parallelism composed with tensor parallelism (``--ep N --tp M``): torchtitan's
``apply_moe_ep_tp`` with experts whole per EP rank (expert-tensor-parallel degree 1), one rank
recorded on a fake process group (docs/parallel.md §14.8).

torchtitan (``torchtitan/models/llama4/parallelize.py`` ``apply_moe_ep_tp`` and
``torchtitan/models/common/token_dispatcher.py`` ``AllToAllTokenDispatcher``, commit 83e4904,
2026-05-20; its later ``moe_sharding.py`` says the same with ``spmd_types`` layouts) lays a MoE
layer over the ``tp`` group as follows, after the dense tensor-parallel plan:

* the MoE layer's input is made ``Replicate`` over TP (``PrepareModuleInputOutput``; without
  sequence parallelism it already is: every TP rank holds all N = B·S tokens of its micro-batch)
  and taken local with a ``Partial`` gradient: the input's gradient is summed over the TP ranks
  once, at the layer's boundary (an all-reduce in the backward, :func:`enter`);
* the router runs on all N tokens on every TP rank (``NoParallel``: replicated compute), its
  output's gradient ``Partial``: each rank's router weight gradient covers the tokens it routed,
  summed over TP (torchtitan's FSDP2 redistributes the ``Partial`` gradient to ``Replicate``, an
  all-reduce; here a post-accumulate all-reduce, :func:`symcost.frontends.tensor_parallel.
  _grad_all_reduce`);
* the routed experts: TP rank r takes the r-th N/TP of the tokens and their routing
  (``_split_along_sp``: ``sp_size`` = TP, ``sp_rank`` its TP coordinate) and dispatches them over
  the ``ep`` group as :mod:`symcost.frontends.expert_parallel` does; the combined outputs are
  placed at the rank's token positions of an N-row zero tensor (``scatter_add`` into
  ``zeros_like(x)``): a partial sum over TP;
* shared experts (DeepSeek-V3, Qwen2-MoE) TP-split: gate and up ``ColwiseParallel`` with the
  input's gradient left ``Partial`` (``ColwiseParallelWithGradPlacement``), down ``RowwiseParallel``
  with a ``Partial`` output (no reduction inside the layer);
* the layer's output, the sum of those partial outputs, is reduced once: an all-reduce over TP
  (``PrepareModuleInputOutput(output_layouts=Partial(), desired_output_layouts=Replicate())``,
  :func:`leave`).

The ``ep`` group borrows the TP ranks (torchtitan's ``ParallelDims``: ``efsdp · ep = dp_shard ·
cp · tp``, ``ep`` innermost): with EP·(data-parallel) ranks per stage, the TP groups are TP
consecutive ranks and an EP group EP consecutive ones, so TP must divide EP (without ``--dp``).
Every TP group runs its own micro-batch; an EP group holds EP/TP of them.

Torch is imported only inside the functions that need it.
"""
from __future__ import annotations

from symcost.errors import SymcostError


def _all_reduce(x, mesh):
    """``x`` summed over ``mesh``'s group (``_c10d_functional.all_reduce``, waited)."""
    import torch.distributed._functional_collectives as funcol

    out = funcol.all_reduce(x, "sum", (mesh, 0))
    return out.wait() if hasattr(out, "wait") else out


def enter(x, mesh):
    """The MoE layer's input on a TP rank: ``x`` forward; its gradient all-reduced over ``mesh``
    backward (the ``Partial`` input gradient made ``Replicate`` at the boundary; Megatron-LM's
    ``copy_to_tensor_model_parallel_region``)."""
    import torch

    class Enter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, g):
            return _all_reduce(g.contiguous(), mesh)

    return Enter.apply(x)


def leave(x, mesh):
    """The MoE layer's output on a TP rank: ``x`` (a partial sum over TP) all-reduced forward; its
    gradient passed through backward (Megatron-LM's ``reduce_from_tensor_model_parallel_region``)."""
    import torch

    class Leave(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return _all_reduce(t.contiguous(), mesh)

        @staticmethod
        def backward(ctx, g):
            return g

    return Leave.apply(x)


def token_slice(n: int, mesh) -> tuple[int, int]:
    """``(start, rows)`` of this TP rank's tokens among ``n`` (torchtitan's ``_split_along_sp``).

    Raises:
        SymcostError: TP does not divide n (torchtitan pads; not modelled).
    """
    tp = mesh.size()
    if n % tp:
        raise SymcostError(f"--ep with --tp {tp}: the MoE layer's N = B·S = {n} tokens do not split over the TP "
                           "ranks (each routes N/TP of them); accepted: B·S a multiple of TP")
    rows = n // tp
    return mesh.get_local_rank() * rows, rows


def place(out, start: int, n: int):
    """The rank's ``[rows, M]`` routed outputs at rows ``start…`` of an ``[n, M]`` zero tensor
    (torchtitan's ``scatter_add`` into ``zeros_like(x)`` at the rank's global token indices): a
    ``constant_pad_nd``, whose backward is the slice."""
    import torch.nn.functional as F

    return F.pad(out, (0, 0, start, n - start - out.shape[0]))


def _colwise_partial_grad():
    """torchtitan's ``ColwiseParallelWithGradPlacement(local_input_grad_placements=(Partial(),))``
    (torchtitan/distributed/tensor_parallel.py): ``ColwiseParallel`` whose replicated local input
    takes its gradient as ``Partial`` (no all-reduce there: the layer's boundary reduces it)."""
    from functools import partial

    from torch import nn
    from torch.distributed.tensor import DTensor, Partial, distribute_module
    from torch.distributed.tensor.parallel import ColwiseParallel

    class ColwisePartialGrad(ColwiseParallel):
        @staticmethod
        def _prepare_input_partial(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, input_layouts, run_check=False,
                                       grad_placements=(Partial(),))
            if input_layouts != desired_input_layouts:
                x = x.redistribute(placements=desired_input_layouts, async_op=True)
            return x

        def _apply(self, module, device_mesh):
            if not isinstance(module, nn.Linear):
                raise SymcostError(f"--ep with --tp: a shared expert's {type(module).__name__} is no nn.Linear")
            return distribute_module(
                module, device_mesh, self._partition_linear_fn,
                partial(self._prepare_input_partial, self.input_layouts, self.desired_input_layouts),
                partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))

    return ColwisePartialGrad()


def moe_layers(model, experts) -> list[tuple[str, object, str, object]]:
    """``[(name, layer, experts attribute, experts module)]``: the MoE layers of ``model``, each the
    module whose child is one of ``experts`` (``[(name, module, kind)]``,
    :func:`symcost.frontends.expert_parallel.experts_modules`: passed in, so that this module,
    which :mod:`symcost.frontends.expert_parallel` uses, does not import it back)."""
    out = []
    for name, m, _ in experts:
        parent, _, attr = name.rpartition(".")
        out.append((parent, model.get_submodule(parent) if parent else model, attr, m))
    return out


def skipped(model, experts) -> list[str]:
    """The module names the dense tensor-parallel plan leaves to this module under ``--ep --tp``:
    each MoE layer (its router and shared experts are laid out here, as torchtitan's
    ``apply_moe_ep_tp`` does after ``apply_non_moe_tp``); ``experts`` as :func:`moe_layers`."""
    return [name for name, *_ in moe_layers(model, experts)]


def apply(model, tp_mesh, experts) -> None:
    """Lay every MoE layer of ``model`` over ``tp_mesh`` (module docstring), after its experts were
    sharded over the EP group (:func:`symcost.frontends.expert_parallel.apply`, which reads
    ``tp_mesh`` from the experts module to route the rank's N/TP tokens): the boundary
    (:func:`enter`, :func:`leave`), shared experts TP-split, the other parameters of the layer
    (the router) replicated with their gradients all-reduced over TP. ``experts``: the model's
    experts modules, ``[(name, module, kind)]`` (:func:`moe_layers`).

    Raises:
        SymcostError: a shared expert that is no SwiGLU of ``nn.Linear`` modules
            (gate/up/down projections, or ``w1``/``w3``/``w2``).
    """
    import re

    from torch import nn
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    from symcost.frontends.tensor_parallel_hf import _grad_all_reduce

    col = re.compile(r"(gate_proj|up_proj|w1|w3)$")
    row = re.compile(r"(down_proj|w2)$")
    replicated = []
    for name, layer, attr, _ in moe_layers(model, experts):
        plan = {}
        for sub, m in layer.named_modules():
            if not sub or sub == attr or sub.startswith(attr + "."):
                continue
            last = sub.rpartition(".")[2]
            if isinstance(m, nn.Linear) and "." in sub and col.match(last):
                plan[sub] = _colwise_partial_grad()
            elif isinstance(m, nn.Linear) and "." in sub and row.match(last):
                plan[sub] = RowwiseParallel(output_layouts=Partial())
            elif any(True for _ in m.parameters(recurse=False)):
                replicated.append(f"{name}.{sub}" if name else sub)
        if plan:
            parallelize_module(layer, tp_mesh, plan)
        if any(True for _ in layer.parameters(recurse=False)):
            replicated.append(name)

        def pre(module, args, kwargs, mesh=tp_mesh):
            if args:
                return (enter(args[0], mesh),) + tuple(args[1:]), kwargs
            return args, dict(kwargs, hidden_states=enter(kwargs["hidden_states"], mesh))

        def post(module, args, kwargs, output, mesh=tp_mesh):
            if isinstance(output, tuple):
                return (leave(output[0], mesh),) + tuple(output[1:])
            return leave(output, mesh)

        layer.register_forward_pre_hook(pre, with_kwargs=True)
        layer.register_forward_hook(post, with_kwargs=True)
    if replicated:
        _grad_all_reduce(model, replicated, tp_mesh)
