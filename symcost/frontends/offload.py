"""FSDP2's CPU offload in the traced rank (``--offload``, ``Layout(offload=True)``;
docs/parallel.md §0.2).

torchtitan's ``training.enable_cpu_offload`` gives every ``fully_shard`` call
``offload_policy=CPUOffloadPolicy()`` (torchtitan/models/llama3/infra/parallelize.py,
``apply_fsdp``). PyTorch then keeps each sharded parameter on the host
(torch/distributed/fsdp/_fully_shard/_fsdp_param.py ``_init_sharded_param``:
``padded_sharded_param.cpu()``), copies it to the device before each all-gather
(``FSDPParam.all_gather_inputs``: ``self._sharded_param_data.to(self.device, non_blocking=True)``),
copies each reduced gradient shard back to the host (``_fsdp_collectives.py`` ``foreach_reduce``:
``new_sharded_grad.to(torch.device("cpu"), ...)``), and the optimizer steps the host tensors (its
state on the host too: ``CPUOffloadPolicy``'s docstring, ``_fsdp_api.py``).

symcost's rank runs on CPU tensors (its mesh is ``init_device_mesh("cpu", ...)``), where both
copies are no-ops (``Tensor.to`` of a tensor already on the device returns it). So that the
recording holds what an accelerator rank does, the two copies run here as ops of their own,
:data:`H2D` and :data:`D2H` (``symcost::h2d``, ``symcost::d2h``: a copy into a new storage), at the
places PyTorch makes them (:func:`offload_transfers`). The recorder counts the output storage of
an ``h2d`` as device memory, as any op's, and that of a ``d2h`` as host memory: left out of the
rank's storage schedule (``_Recorder.host_ops``), so the schedule and its peak are the device's.
The bytes each moves are :func:`symcost.passes.offload.transfer_bytes`.

Torch is imported only inside the functions that need it.
"""
from __future__ import annotations

import contextlib

#: the op names (``str(op.overloadpacket)``) of the two copies
H2D, D2H = "symcost.h2d", "symcost.d2h"

_OPS: dict = {}


def transfer_ops():
    """``(h2d, d2h)``: the ``torch.library`` custom ops ``symcost::h2d(Tensor) -> Tensor`` and
    ``symcost::d2h(Tensor) -> Tensor`` (defined on first call): each returns a contiguous copy of
    its input in a new storage (the CPU kernel copies; the fake kernel makes an empty tensor of
    the same shape and dtype). They stand for an accelerator's host-to-device and device-to-host
    copies of a CPU recording, which has only one device."""
    if not _OPS:
        import torch

        def copy(t):
            return t.clone(memory_format=torch.contiguous_format)

        def fake(t):
            return torch.empty_like(t, memory_format=torch.contiguous_format)

        for name in ("h2d", "d2h"):
            op = torch.library.custom_op(f"symcost::{name}", copy, mutates_args=(), schema="(Tensor t) -> Tensor")
            op.register_fake(fake)
            _OPS[name] = getattr(torch.ops.symcost, name).default
    return _OPS["h2d"], _OPS["d2h"]


def policy():
    """The ``CPUOffloadPolicy`` the traced rank's ``fully_shard`` calls take: torchtitan's
    ``CPUOffloadPolicy()`` with ``pin_memory=False``, since pinning needs an accelerator (on a
    CPU-only build ``Tensor.pin_memory`` raises). Pinning decides only whether FSDP2's gradient
    copy to the host is asynchronous (``foreach_reduce``: ``non_blocking``), not which storages
    exist or their sizes."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=False)


@contextlib.contextmanager
def offload_transfers():
    """While active, FSDP2's two offload copies of a ``CPUOffloadPolicy`` unit run as the ops of
    :func:`transfer_ops`:

    * ``FSDPParam.all_gather_inputs`` of an offloaded, sharded parameter returns
      ``[h2d(sharded data)]`` cast to the unit's ``param_dtype`` where it has one, as PyTorch's
      property does with ``.to(self.device)`` (_fsdp_param.py; the extension path of tensor
      subclasses is left as PyTorch runs it);
    * in ``foreach_reduce`` the gradient shard's ``Tensor.to(torch.device("cpu"), ...)`` is
      ``d2h`` (a ``TorchFunctionMode`` active inside that function only: there the one ``to``
      with a device is that copy; its casts give a dtype).

    Restores both on exit."""
    import torch
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
    from torch.overrides import TorchFunctionMode

    h2d, d2h = transfer_ops()
    cls = _fsdp_param.FSDPParam
    orig_prop = cls.__dict__["all_gather_inputs"]
    orig_reduce = _fsdp_param_group.foreach_reduce

    def all_gather_inputs(self):
        if (self.offload_to_cpu and self.sharded_state == _fsdp_param.ShardedState.SHARDED
                and not hasattr(self._sharded_local_tensor, "fsdp_pre_all_gather")):
            return [_fsdp_param._to_dtype_if_needed(h2d(self._sharded_param_data), self.param_dtype)]
        return orig_prop.fget(self)

    class _ToHost(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.to:
                dev = kwargs.get("device", args[1] if len(args) > 1 else None)
                if isinstance(dev, torch.device) and dev.type == "cpu":
                    return d2h(args[0])
            return func(*args, **kwargs)

    def foreach_reduce(fsdp_params, *args, **kwargs):
        if not any(p.offload_to_cpu for p in fsdp_params):
            return orig_reduce(fsdp_params, *args, **kwargs)
        with _ToHost():
            return orig_reduce(fsdp_params, *args, **kwargs)

    cls.all_gather_inputs = property(all_gather_inputs)
    _fsdp_param_group.foreach_reduce = foreach_reduce
    try:
        yield
    finally:
        cls.all_gather_inputs = orig_prop
        _fsdp_param_group.foreach_reduce = orig_reduce
