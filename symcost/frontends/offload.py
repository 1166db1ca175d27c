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
#: the op names of activation offload's copies (:func:`save_on_host`): a saved tensor to the host
#: in the forward, back to the device when the backward unpacks it
SAVE_H2D, SAVE_D2H = "symcost.save_h2d", "symcost.save_d2h"

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

        for name in ("h2d", "d2h", "save_h2d", "save_d2h"):
            op = torch.library.custom_op(f"symcost::{name}", copy, mutates_args=(), schema="(Tensor t) -> Tensor")
            op.register_fake(fake)
            _OPS[name] = getattr(torch.ops.symcost, name).default
    return _OPS["h2d"], _OPS["d2h"]


def save_ops():
    """``(save_h2d, save_d2h)``: the ``torch.library`` custom ops ``symcost::save_h2d`` and
    ``symcost::save_d2h``, copies as :func:`transfer_ops`' (defined with them), for activation
    offload's copies, kept apart from FSDP2's so that each is counted on its own."""
    transfer_ops()
    return _OPS["save_h2d"], _OPS["save_d2h"]


def save_on_host(record_pack=None):
    """The ``saved_tensors_hooks`` pair ``(pack, unpack)`` of activation offload (``Layout.
    offload_activations``, ``--offload-activations``), which does in a recording what
    ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` does on an accelerator
    (torch/autograd/graph.py, torch 2.13):

    * ``pack_to_cpu`` runs for *every* tensor autograd saves, parameters included (the weight an
      ``mm`` keeps for its input gradient, a norm's weight), once per save: a tensor two ops save
      is copied twice, and no storage is shared. Each copy is ``torch.empty(tensor.size(),
      dtype, layout, pin_memory=True)`` then ``copy_``: a new contiguous pinned host tensor of the
      saved tensor's numel (a view or an expanded tensor: its own numel, not its storage's). Here
      it is ``save_d2h(t)``, whose output the recorder keeps out of the device's storage
      schedule (``_Recorder.host_ops``): host memory. The device tensor is then held by autograd
      no more, and is freed when nothing else holds it;
    * ``unpack_from_cpu`` runs when the backward node that saved the tensor runs:
      ``tensor.to(device, non_blocking=True)``, a device copy that lives while the node uses it.
      Here it is ``save_h2d(packed)``, device memory as any op's output.

    A DTensor (tensor parallelism) is copied by its local shard, rewrapped on unpack.
    ``record_pack``: the recorder's own pack hook, run first on the tensor as autograd saves it
    (it records what is saved, shared/conventions.md's activations). Torch is imported here."""
    import torch
    from torch.distributed.tensor import DTensor

    h2d, d2h = save_ops()

    def pack(t):
        if record_pack is not None:
            record_pack(t)
        with torch.no_grad():
            if isinstance(t, DTensor):
                return (d2h(t._local_tensor), t.device_mesh, t.placements, t.shape, t.stride())
            return d2h(t)

    def unpack(packed):
        with torch.no_grad():
            if isinstance(packed, tuple):
                local, mesh, placements, shape, stride = packed
                return DTensor.from_local(h2d(local), mesh, placements, run_check=False, shape=shape, stride=stride)
            return h2d(packed)

    return pack, unpack


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
