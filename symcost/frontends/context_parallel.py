"""Context parallelism of a :class:`ModelSpec`: the sequence split over ``CP`` ranks and the
attention run as ring attention by PyTorch's own ``torch.distributed.tensor.experimental.
context_parallel`` (docs/parallel.md, "Context parallelism").

A context-parallel spec is the model's own spec with one more symbol, ``CP`` (the
context-parallel group size), and a layout (:class:`symcost.frontends.layout.Layout`) with a
``cp`` dimension. One rank (rank 0 of the ``cp`` group, on the fake process group) is recorded:

* its inputs are the rank's shard of the sequence, as ``context_parallel(mesh, buffers=[inputs,
  labels], buffer_seq_dims=[1, 1])`` leaves them (torchtitan's ``train_context``): with a causal
  mask PyTorch's default load balancer (``_HeadTailLoadBalancer``, round robin: the sequence cut
  into 2·CP chunks, rank r keeping chunks r and 2·CP-1-r) permutes the sequence first, then each
  rank keeps S/CP tokens (:func:`shard_inputs`);
* every ``F.scaled_dot_product_attention`` call runs through PyTorch's CP dispatcher: q, k, v
  become DTensors sharded on the sequence, and ``_templated_ring_attention`` (forward) and
  ``_templated_ring_attention_backward`` run the rank's CP attention blocks, merging them by
  their log-sum-exps, while the keys and values go round the ring: ``set_rotate_method
  ("allgather")`` (PyTorch's and torchtitan's default) all-gathers them once per attention
  forward; ``"alltoall"`` passes them to the next rank CP-1 times (``permute_tensor``, an
  ``all_to_all_single``); the backward passes the key/value gradients round the ring by
  all-to-all in both (Liu et al. 2023, Ring Attention; the load balancing of Brandon et al.
  2023, Striped Attention, as PyTorch writes it).

PyTorch 2.13 runs this only for CUDA's fused kernels: its CP handler and sharding rules cover
``_scaled_dot_product_flash_attention``, ``_efficient_attention`` and ``_cudnn_attention``,
while on the CPU SDPA dispatches ``_scaled_dot_product_flash_attention_for_cpu``, for which
DTensor has no sharding rule ("does not have a sharding strategy registered"). :func:`cpu_ring`
registers the same handler for the CPU's fused kernel: its sharding rule (q, k, v, out and
log-sum-exp all ``Shard(2)``, as PyTorch's CP rule for the flash kernel) and a handler that calls
PyTorch's ``_templated_ring_attention`` / ``_templated_ring_attention_backward`` with the CPU
kernel as the attention op. Everything else (the load balancing, the rotation, the merge, the
collectives) is PyTorch's code, unchanged; the CPU kernel returns (out, log-sum-exp) as the
flash kernel does and saves the same tensors (symcost.tracing.device_kernels). The real gloo run
in tests/test_context_parallel.py checks that the ring's output equals one device's attention.

Not modelled: a model whose attention does not call ``F.scaled_dot_product_attention`` (eager
attention, a model of its own), an attention mask (PyTorch's CP refuses ``attn_mask``), sequence
lengths that 2·CP does not divide (PyTorch then runs without load balancing, another regime).

Torch is imported only inside the functions that need it.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Mapping

from symcost.errors import SymcostError

#: ``set_rotate_method``'s methods: how the keys and values go round the ring in the forward
ROTATE_METHODS = ("allgather", "alltoall")


def check_rotate(method: str) -> str:
    """``method`` if PyTorch's ``set_rotate_method`` takes it.

    Raises:
        SymcostError: another name.
    """
    if method not in ROTATE_METHODS:
        raise SymcostError(f"unknown --cp-rotate {method!r}; accepted: {', '.join(ROTATE_METHODS)} "
                           "(torch.distributed.tensor.experimental._attention.set_rotate_method)")
    return method


def context_parallel(spec):
    """The context-parallel dimension's part of a layout's spec (:meth:`symcost.frontends.layout.
    Layout.spec` calls it): ``spec`` with the symbol ``CP`` and the size rules below.

    PyTorch's round-robin load balancing cuts the sequence into 2·CP chunks, so S must be a
    multiple of 2·CP (a constraint: elsewhere PyTorch runs without load balancing, another
    regime, not modelled). Probes keep S a multiple of 2·CP and at least 4·CP (two tokens per
    chunk). CP itself is pinned at the request's value (:func:`symcost.graph.build.trace`): the
    ring runs CP steps per attention call, so the rank's ops follow CP; the formulas hold for that
    CP and any S it allows (S/CP appears as S over the pinned CP).

    Raises:
        SymcostError: an inference step (CP trains).
    """
    if spec.step != "train":
        raise SymcostError(f"--cp traces a training step, not an inference step ({spec.step})")
    if "CP" in spec.symbols:
        return spec
    inner_probe = spec.probe_check

    def probe_check(values: Mapping[str, int]):
        why = inner_probe(values) if inner_probe else None
        if why or "CP" not in values or "S" not in values:
            return why
        cp, s = values["CP"], values["S"]
        if s % (2 * cp) or s < 4 * cp:
            return f"S={s} is no multiple of 2·CP={2 * cp} of at least 4·CP (two tokens per load-balancing chunk)"
        return None

    inner_check = spec.check

    def check(values: Mapping[str, int]):
        why = inner_check(values) if inner_check else None
        if why or "CP" not in values or "S" not in values or values["S"] % (2 * values["CP"]) == 0:
            return why
        return (f"--cp splits the sequence into 2·CP load-balancing chunks (PyTorch's round-robin CP): S must "
                f"be a multiple of 2·CP = {2 * values['CP']} (got S={values['S']}, CP={values['CP']})")

    defaults = dict(spec.defaults, CP=spec.defaults.get("CP", 2))
    return dataclasses.replace(spec, symbols=tuple(spec.symbols) + ("CP",), defaults=defaults,
                               probe_check=probe_check, check=check)


# --- the CPU's fused attention under PyTorch's CP dispatcher ------------------------------------

def _ops():
    import torch

    aten = torch.ops.aten
    return (aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default)


def _forward_strategy(op_schema):
    """DTensor's sharding rule of ``_scaled_dot_product_flash_attention_for_cpu`` under CP:
    (out, logsumexp, q, k, v) all replicated, all sharded on the heads (tensor parallelism), or
    all sharded on the sequence (dim 2: PyTorch's CP rule for the flash kernel,
    torch/distributed/tensor/experimental/_context_parallel/_sharding_rules.py)."""
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.placement_types import Replicate, Shard

    mesh = op_schema.get_mesh_from_args()
    return expand_to_full_mesh_op_strategy(mesh, op_schema, [[Replicate()] * 5, [Shard(1)] * 5, [Shard(2)] * 5],
                                           input_index=2)


def _backward_strategy(op_schema):
    """The backward's rule, as :func:`_forward_strategy`: (grad q, k, v; grad_out, q, k, v, out,
    logsumexp)."""
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.placement_types import Replicate, Shard

    mesh = op_schema.get_mesh_from_args(validate=False)
    return expand_to_full_mesh_op_strategy(mesh, op_schema, [[Replicate()] * 9, [Shard(1)] * 9, [Shard(2)] * 9],
                                           input_index=3)


class _Calls:
    n = 0  # ring attention calls since the last reset (a model without SDPA makes none)


def _ring_forward(mesh, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention

    if attn_mask is not None:
        raise SymcostError("--cp: the attention passes a mask; PyTorch's ring attention takes is_causal only "
                           "(attn_mask is not supported)")
    _Calls.n += 1
    fwd, _ = _ops()
    return _templated_ring_attention(mesh.get_group(), 2, fwd, query=query, key=key, value=value,
                                     is_causal=is_causal, dropout_p=dropout_p, scale=scale)


def _ring_backward(mesh, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,
                   scale=None):
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention_backward)

    _, bwd = _ops()
    return _templated_ring_attention_backward(mesh.get_group(), 2, bwd, grad_out=grad_out, grad_out_name="grad_out",
                                              query=query, key=key, value=value, out=out, logsumexp=logsumexp,
                                              is_causal=is_causal, dropout_p=dropout_p, scale=scale)


def _handler(op_call, args, kwargs):
    """PyTorch's ``_sdpa_handler`` (torch/distributed/tensor/experimental/_context_parallel/
    _attention.py) for the CPU's fused kernel: unwrap, propagate, run the ring on the local
    shards, wrap."""
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(info)
    sharding = info.output_sharding
    if sharding is None or sharding.needs_redistribute:
        raise SymcostError("--cp: the attention's inputs are not sharded on the sequence as ring attention needs")
    fwd, _ = _ops()
    ring = _ring_forward if op_call is fwd else _ring_backward
    out = ring(info.compute_mesh, *info.local_args, **info.local_kwargs)
    return dispatcher.wrap(tuple(out), sharding.output_spec)


@contextlib.contextmanager
def cpu_ring():
    """While it lasts, DTensor runs the CPU's fused attention (``_scaled_dot_product_flash_
    attention_for_cpu`` and its backward) on sequence-sharded inputs as PyTorch's CP runs the
    CUDA flash kernel: the sharding rules of :func:`_forward_strategy` and a custom op handler
    that calls PyTorch's ring attention (module docstring). Restores DTensor's tables after."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import register_op_strategy

    fwd, bwd = _ops()
    dispatcher = DTensor._op_dispatcher
    prop = dispatcher.sharding_propagator
    saved = {op: (prop.op_strategy_funcs.get(op), prop.op_to_schema_info.get(op)) for op in (fwd, bwd)}
    handlers = dispatcher._custom_op_handlers
    register_op_strategy(fwd, schema_info=RuntimeSchemaInfo(3))(_forward_strategy)
    register_op_strategy(bwd, schema_info=RuntimeSchemaInfo(6))(_backward_strategy)
    dispatcher._custom_op_handlers = {**handlers, fwd: _handler, bwd: _handler}
    try:
        yield
    finally:
        dispatcher._custom_op_handlers = {k: v for k, v in dispatcher._custom_op_handlers.items()
                                          if k not in (fwd, bwd)}
        for op, (f, s) in saved.items():
            for table, old in ((prop.op_strategy_funcs, f), (prop.op_to_schema_info, s)):
                if old is None:
                    table.pop(op, None)
                else:
                    table[op] = old


@contextlib.contextmanager
def enabled(mesh, rotate: str = "allgather"):
    """The context a context-parallel step runs in: PyTorch's CP dispatcher over the 1-D ``cp``
    ``mesh`` (``F.scaled_dot_product_attention`` patched, as ``context_parallel(mesh)`` patches
    it), round-robin load balancing on, ``set_rotate_method(rotate)``, and :func:`cpu_ring`.
    PyTorch's options are restored after; :func:`ring_calls` counts from 0 again."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    check_rotate(rotate)
    old, mode = dataclasses.replace(cp._cp_options), cp._dispatch_mode
    cp._dispatch_mode = cp._DispatchMode.MONKEY_PATCH  # (context_parallel's: F.scaled_dot_product_attention patched)
    cp._cp_options.enable_load_balance = True
    cp.set_rotate_method(rotate)
    cp._enable_context_parallel_dispatcher_impl(seq_dim=2, mesh=mesh)
    _Calls.n = 0  # (ring_calls: this step's)
    try:
        with cpu_ring():
            yield
    finally:
        cp._disable_context_parallel_dispatcher_impl()
        cp._cp_options.enable_load_balance = old.enable_load_balance
        cp._cp_options.rotate_method = old.rotate_method
        cp._dispatch_mode = mode


def ring_calls(reset: bool = False) -> int:
    """Ring-attention forwards run since the last reset (``reset``: set it to 0 after reading)."""
    n = _Calls.n
    if reset:
        _Calls.n = 0
    return n


def sequence_dims(spec, values: Mapping[str, int], inputs) -> list:
    """For each tensor of ``inputs`` (``(args, kwargs)``, pytree order), the dimension that is the
    sequence (its size follows S: compared with the inputs made at S + 2·CP·TP, a length the
    ranks still split, so a pipeline stage's received activation, already the rank's S/CP tokens
    and maybe S/(CP·TP), can be made there: :func:`symcost.frontends.pipeline.stage_inputs`), or
    None. Such an activation is not S long, so it is never taken for one to split."""
    import torch
    from torch.utils._pytree import tree_flatten

    step = 2 * int(values.get("CP", 1)) * int(values.get("TP", 1))
    other = spec.make_inputs(dict(values, S=values["S"] + step), torch.device("meta"))
    a, b = tree_flatten(inputs)[0], tree_flatten(other)[0]
    out = []
    for x, y in zip(a, b):
        dim = None
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dim() == y.dim():
            moved = [d for d in range(x.dim()) if x.shape[d] == values["S"] and y.shape[d] == values["S"] + step]
            dim = moved[0] if len(moved) == 1 else None
        out.append(dim)
    return out


def shard_inputs(spec, values: Mapping[str, int], inputs, mesh):
    """``inputs`` (``(args, kwargs)``) as rank 0 of the ``cp`` ``mesh`` holds them: every tensor
    whose size follows S (:func:`sequence_dims`) permuted by PyTorch's head-tail load balancer and
    cut to the rank's S/CP tokens (``_context_parallel_buffers``), in place as ``context_parallel(mesh,
    buffers=...)`` does it (``resize_`` and ``copy_``: the storage keeps the bytes of all S tokens);
    a tensor given twice (hf's ``input_ids`` and ``labels``) is sharded once.

    Raises:
        SymcostError: no input follows S (nothing to split).
    """
    import torch
    from torch.distributed.tensor.experimental._context_parallel._attention import _context_parallel_buffers
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer
    from torch.utils._pytree import tree_flatten, tree_unflatten

    flat, tree = tree_flatten(inputs)
    dims = sequence_dims(spec, values, inputs)
    if not any(d is not None for d in dims):
        raise SymcostError(f"--cp: no input of {spec.name} has the sequence length S as a dimension")
    balancer = _HeadTailLoadBalancer(int(values["S"]), int(values["CP"]), torch.device("cpu"))
    done: dict[int, torch.Tensor] = {}
    out = []
    for t, d in zip(flat, dims):
        if d is None:
            out.append(t)
            continue
        if id(t) not in done:
            # in place, as context_parallel shards its buffers: the storage keeps the S tokens' bytes
            shard = _context_parallel_buffers(mesh, [t], [d], balancer)[0].clone()
            with torch.no_grad():
                t.resize_(shard.shape)
                t.copy_(shard)
            done[id(t)] = t
        out.append(done[id(t)])
    return tree_unflatten(out, tree)
