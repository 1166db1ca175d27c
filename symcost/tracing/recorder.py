"""The dispatch mode that records one step (:class:`_Recorder`): every aten op with its module and
phase, the storages autograd saves, the storages allocated and freed, collectives with their
mesh group; and the helpers it needs (autograd-node labels, ops a real step cannot run). Driven by
:func:`symcost.tracing.record.record`."""
from __future__ import annotations

import weakref

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from symcost.errors import SymcostError
from symcost.frontends.checkpointing import recomputing, recomputing_block
from symcost.tracing import grouped_mm, onednn_rnn
from symcost.tracing.recording import IntRef, MemoryEvent, OpCall, TensorInfo, TensorRef

_META_KEY = "symcost_module"


def _module_names(model: nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in model.named_modules()}


def _label_graph(root_fn, label: str, unlabelled: frozenset = frozenset()) -> None:
    """Label every not-yet-labelled autograd node reachable from ``root_fn``, but the
    ``AccumulateGrad`` nodes of the parameters whose ``id`` is in ``unlabelled`` (a parameter of a
    module shared by the blocks: its gradient's accumulation is named by the parameter's module,
    in no block, not by the first block whose graph reaches it)."""
    stack = [root_fn]
    while stack:
        fn = stack.pop()
        if fn is None:
            continue
        md = fn.metadata
        if _META_KEY in md:
            continue
        if unlabelled and id(getattr(fn, "variable", None)) in unlabelled:
            continue
        md[_META_KEY] = label
        stack.extend(nf for nf, _ in fn.next_functions)


def _grad_fns(obj) -> list:
    leaves, _ = tree_flatten(obj)
    out = []
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            out.append(t.grad_fn)
    return out


#: the namespaces of the collectives (symcost.graph.rules.COMM_OPS)
_COMM_NAMESPACES = frozenset({"c10d", "_c10d_functional"})

#: ops whose meta kernel returns one tensor twice where the real kernel returns two tensors
#: (``mkldnn_rnn_layer_backward``: the LSTM's bias gradient, once per bias)
_META_ALIASED_OUTPUTS = {torch.ops.aten.mkldnn_rnn_layer_backward.default}


_PRIM_DEVICE = torch.ops.prim.device.default
_LOCAL_SCALAR_DENSE = torch.ops.aten._local_scalar_dense.default
_LIFT_FRESH = torch.ops.aten.lift_fresh.default
_MKLDNN_RNN_LAYER = getattr(getattr(torch.ops.aten, "mkldnn_rnn_layer", None), "default", None)
#: normalisations whose CPU kernel keeps its statistics (mean and rstd, or save_mean and
#: save_invstd: outputs 1 and 2) in fp32 where a bf16/fp16 input meets an fp32 weight, bias or
#: running statistic (the "mixed type" kernels: aten/src/ATen/native/layer_norm.cpp
#: ``layer_norm_cpu``, group_norm.cpp, Normalization.cpp ``batch_norm_cpu``: ``param_scalar_type``
#: / ``opmath_type``), as ``torch.autocast("cpu")`` runs them; PyTorch's meta kernels (fake
#: tensors) give the input's dtype, so a step recorded on fake tensors held statistics of half the
#: size the real one saves (BERT-base under bf16-mixed: 128 bytes, and every symbol pinned)
_MIXED_NORMS = frozenset(op for op in (
    getattr(torch.ops.aten.native_layer_norm, "default", None),
    getattr(torch.ops.aten.native_group_norm, "default", None),
    getattr(torch.ops.aten.native_batch_norm, "default", None),
    getattr(torch.ops.aten._native_batch_norm_legit, "default", None),
    getattr(torch.ops.aten._native_batch_norm_legit, "no_stats", None),
    getattr(torch.ops.aten._native_batch_norm_legit_functional, "default", None)) if op is not None)
_REDUCED = (torch.bfloat16, torch.float16)
#: its backward: the real CPU kernel gives the input's gradient the input's dtype; the meta kernel
#: takes the statistics' (fp32 once they are, above), where autograd would then add a cast
_GROUP_NORM_BACKWARD = torch.ops.aten.native_group_norm_backward.default
_EMBEDDING_BAG = torch.ops.aten._embedding_bag.default
#: ops whose ``padding_idx`` argument (position in the ``ints`` the recorder keeps) selects the one
#: row whose gradient is zeroed: no FLOP or byte depends on it, and under a vocabulary-parallel
#: embedding (transformers' ``embedding_rowwise``) the rank's local value is the config's pad id
#: where the rank's rows hold it and -1 elsewhere, a step function of V/TP no size formula fits
#: (gpt-oss's pad id 199999: the fitter searched for minutes before failing). Recorded as -1.
_PADDING_IDX = {torch.ops.aten.embedding.default: 0, torch.ops.aten.embedding_dense_backward.default: 1}

#: ops whose real CPU kernel sizes an output by the library's own choice, which no polynomial in
#: the model's sizes gives (oneDNN's RNN workspace: 53,248 bytes at B = 3 and at D = 12, 69,632 at
#: B = 5 and at S = 11), where the meta kernel's size is a formula: a recording that meets one on
#: real tensors is made again on fake ones
FAKE_ONLY_OPS = frozenset(getattr(torch.ops.aten, name).default for name in (
    "mkldnn_rnn_layer", "mkldnn_rnn_layer_backward") if hasattr(torch.ops.aten, name))


class _FakeOnly(Exception):
    """A real recording met an op of :data:`FAKE_ONLY_OPS`, or a strict one read values."""


#: tags of ops whose output (a host value, or a shape) depends on tensor values: FakeTensorMode
#: raises at them unless it knows the value; a strict real recording gives way to a fake one
_VALUE_TAGS = frozenset((torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape))
_INDEX = torch.ops.aten.index.Tensor


def _integer_index(func, args) -> bool:
    """Whether ``func`` is ``aten.index.Tensor`` with integer indices only: tagged
    ``dynamic_output_shape`` for boolean masks (their output has as many rows as true values),
    its output shape is the indices' broadcast shape otherwise, read from no value (Swin's
    relative position bias, ``table[index]``: such a step need not be recorded on fake tensors)."""
    if func is not _INDEX or len(args) < 2:
        return False
    return all(i is None or (isinstance(i, torch.Tensor) and not i.dtype.is_floating_point
                             and i.dtype not in (torch.bool, torch.uint8)) for i in args[1])


_WAIT_TENSOR = getattr(getattr(torch.ops, "_c10d_functional", None), "wait_tensor", None)
_WAIT_TENSOR = getattr(_WAIT_TENSOR, "default", None)


def _mixed_norm_stats(args, kwargs, out):
    """A normalisation's outputs on fake tensors with the statistics in the dtype the real CPU
    kernel gives them (:data:`_MIXED_NORMS`): fp32 where a bf16/fp16 input meets an fp32 weight,
    bias or running statistic; the others as PyTorch's meta kernel gives them. Checked against the
    real kernels in tests/test_foreign_models.py."""
    x = args[0]
    if x.dtype not in _REDUCED:
        return out
    others = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.Tensor)]
    if not any(a.dtype == torch.float32 for a in others):
        return out
    fixed = tuple(t.new_empty(t.shape, dtype=torch.float32) if k in (1, 2) and t.dtype in _REDUCED else t
                  for k, t in enumerate(out))
    return fixed


def _dispatch_unaliased(func, args, kwargs):
    """Run ``func``; where its meta kernel aliases two outputs that the real kernel keeps apart,
    give the later one its own storage, as the real kernel does.

    FakeTensorMode runs the meta kernel on a cache miss (aliased outputs) but rebuilds the outputs
    one by one on a cache hit (separate), so without this AccumulateGrad would copy or steal the
    gradient depending on the cache's history and the op sequence would change between probes.
    """
    if func is grouped_mm.GROUPED_MM:  # any dtype and size, fake or real (symcost.tracing.grouped_mm)
        return grouped_mm.run(func, args, kwargs)
    out = func(*args, **kwargs)
    if func in _META_ALIASED_OUTPUTS and isinstance(out, (tuple, list)):
        seen: set[int] = set()
        fixed = []
        for t in out:
            if isinstance(t, torch.Tensor) and id(t) in seen:
                t = t.clone()
            elif isinstance(t, torch.Tensor):
                seen.add(id(t))
            fixed.append(t)
        out = type(out)(fixed)
    return out


def weak_method(method):
    """``method`` (bound) as a function that calls it while its object lives and does nothing
    after, for ``weakref.finalize`` callbacks: a finalizer holds its callback until its tensor
    dies, and a bound method holds its object, so a recording mode whose tensors outlived the step
    (a tensor some cache keeps) was itself kept with every op it recorded (25,618 ``OpCall`` of
    one ``--ep --tp`` trace after the trace was dropped, 2026-12-06: the test workers grew by
    millions of objects per file)."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


class _Recorder(TorchDispatchMode):
    def __init__(self, names_of_leaves: dict[int, str]):
        super().__init__()
        #: :meth:`_release` for the tensors' finalizers, not keeping this mode alive
        self._release_cb = weak_method(self._release)
        self.ops: list[OpCall] = []
        self.phase = "forward"
        self.module_stack: list[str] = [""]
        #: id(module) -> its name in the model (set by :func:`record`)
        self.module_names: dict[int, str] = {}
        self._tid: dict[int, int] = {}
        self._n_tid = 0
        self._leaf_names = names_of_leaves
        self.param_module: dict[str, str] = {}
        # storage liveness: storage key -> [live tensor objects, nbytes]
        self._storages: dict[int, list] = {}
        self.events: list[MemoryEvent] = []
        #: storage key -> the module whose op allocated the storage (the key of a live storage:
        #: a freed one's key may be taken again, and then names the new storage's maker)
        self.made_by: dict[int, str] = {}
        # storages that exist before the step (parameters, buffers, inputs): a view of one is no
        # allocation
        self.preexisting: set[int] = set()
        # record each input's storage key (inference steps: the KV cache's reads, _inference_step)
        self.storage_keys = False
        self.model: nn.Module | None = None  # set for data-parallel recordings (see leaf_name)
        self.owners: list[str | None] = []  # record_function regions (see _profiler_label)
        self.dtensor = None  # the DTensor class in a tensor-parallel recording (see __torch_dispatch__)
        self.real = False  # on real tensors (see FAKE_ONLY_OPS)
        self.quiet = 0  # > 0: ops pass unrecorded (see _quiet_parameter_new)
        self.strict = False  # a real recording that may not read values (see record's strict)
        self.groups: dict[str, str] = {}  # a 2-D mesh: process group name -> mesh symbol (DP, TP)
        self.param_storages: set[int] = set()  # a 2-D mesh: storages of unsharded parameters (name_local_params)
        # an inference step: the KV cache's storages held before the step, key -> (weak
        # reference, bytes), watched until the step frees them (see watch_kv)
        self.kv_watch: dict[int, tuple[StorageWeakRef, int]] = {}
        # ops whose outputs are host memory (FSDP2's CPU offload: the gradient shards' copies to
        # the host, symcost.frontends.offload): their storages stay out of the device's schedule
        self.host_ops: frozenset = frozenset()
        self._host_refs: list = []
        # tensor subclasses looked through (FP8 training: torchao's float8 tensors,
        # symcost.frontends.fp8.fp8_tensor_types): their ops run on plain tensors, recorded
        self.unwrap: tuple = ()

    def leaf_name(self, t: torch.Tensor) -> str | None:
        """The ``param:``/``buffer:``/``input:`` name of a leaf tensor, or None. A parameter
        object not seen before (FSDP's unsharded parameter, set on its module after the
        all-gather) is looked up among the model's current parameters."""
        name = self._leaf_names.get(id(t))
        if name is None and isinstance(t, nn.Parameter) and self.model is not None:
            for n, p in self.model.named_parameters(remove_duplicate=False):
                if p is t:
                    name = self._leaf_names[id(t)] = f"param:{n}"
                    weakref.finalize(t, self._leaf_names.pop, id(t), None)
                    break
        return name

    def name_local_params(self, args) -> None:
        """Data parallelism over tensor parallelism: FSDP2's unsharded parameter is a DTensor
        whose local tensor (a view of the all-gather's output) the local ops read; at the DTensor
        op that takes the parameter, that local tensor gets the parameter's name."""
        for a in args:
            if isinstance(a, nn.Parameter):
                loc = getattr(a, "_local_tensor", None)
                if loc is not None and id(loc) not in self._leaf_names:
                    name = self.leaf_name(a)
                    if name is not None:
                        self._leaf_names[id(loc)] = name
                        weakref.finalize(loc, self._leaf_names.pop, id(loc), None)
                        # (autograd saves views of it, DTensors whose local tensors share its storage)
                        self.param_storages.add(StorageWeakRef(loc.untyped_storage()).cdata)

    def tensor_id(self, t: torch.Tensor) -> int:
        key = id(t)
        if key not in self._tid:
            self._tid[key] = self._n_tid
            self._n_tid += 1
            weakref.finalize(t, self._tid.pop, key, None)  # ids may be reused once t is gone
        return self._tid[key]

    def track(self, t: torch.Tensor, op_index: int) -> None:
        """Count ``t`` as a reference to its storage; a new storage is an allocation event."""
        st = t.untyped_storage()
        key = StorageWeakRef(st).cdata
        if key in self.preexisting:
            return
        entry = self._storages.get(key)
        if entry is None:
            entry = self._storages[key] = [0, st.nbytes()]
            self.events.append(MemoryEvent(op_index, st.nbytes(), key))
            self.made_by[key] = self.module_stack[-1]
        entry[0] += 1
        weakref.finalize(t, self._release_cb, key)

    def hold(self, t: torch.Tensor) -> None:
        """Count ``t``, a tensor object made outside this mode, as one more reference to its
        storage where the step allocated that storage (a compiled block's saved tensors: AOTAutograd's
        runtime hands ``ctx.save_for_backward`` objects made around the forward graph it ran, so
        the objects :meth:`track` saw may die while the storage is saved: ``--compile``,
        :mod:`symcost.frontends.compile`)."""
        key = StorageWeakRef(t.untyped_storage()).cdata
        entry = self._storages.get(key)
        if entry is None:
            return
        entry[0] += 1
        weakref.finalize(t, self._release_cb, key)

    def drop(self, t: torch.Tensor) -> None:
        """``t``'s storage, allocated by the op just recorded, is never allocated in the step
        that runs: a fused kernel keeps it in registers (``--compile``,
        :func:`symcost.frontends.compile._in_registers`). Its allocation event is removed and its
        free will not be recorded; the op's costs stay."""
        key = StorageWeakRef(t.untyped_storage()).cdata
        entry = self._storages.get(key)
        if entry is None or not entry[1]:
            return
        for k in range(len(self.events) - 1, -1, -1):
            e = self.events[k]
            if e.storage == key and e.nbytes > 0:
                del self.events[k]
                entry[1] = 0
                return

    def _release(self, key: int) -> None:
        entry = self._storages.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._storages[key]
            if entry[1]:
                self.events.append(MemoryEvent(len(self.ops), -entry[1], key, self._host()))

    def watch_kv(self) -> None:
        """Record the free of each watched storage (:attr:`kv_watch`: the KV cache's tensors held
        before an inference step, which no op of the step allocated, so :meth:`track` does not
        follow them) that is gone: a ``kv`` event before the next op, as :meth:`_release` stamps a
        free. Called before each recorded op and once when the step ends: a storage dies between
        two ops (a DynamicCache drops its old tensor when it assigns the concatenation)."""
        for key, (ref, nbytes) in list(self.kv_watch.items()):
            if ref.expired():
                del self.kv_watch[key]
                self.events.append(MemoryEvent(len(self.ops), -nbytes, key, self._host(), kv=True))

    def resized(self, storage, old: int) -> None:
        """A storage the step allocated was resized in place (``UntypedStorage.resize_``: FSDP2
        frees an unsharded parameter with ``resize_(0)`` and allocates it again with
        ``resize_(nbytes)``, torch/distributed/fsdp/_fully_shard/_fsdp_param.py ``free_storage``,
        ``alloc_storage``): a free of the old bytes, then an allocation of the new ones, both
        before the next op. Storages that existed before the step are not followed."""
        key = StorageWeakRef(storage).cdata
        entry = self._storages.get(key)
        new = storage.nbytes()
        if entry is None or new == old:
            return
        if old:
            self.events.append(MemoryEvent(len(self.ops), -old, key, self._host()))
        if new:
            self.events.append(MemoryEvent(len(self.ops), new, key, self._host()))
        entry[1] = new

    def _host(self) -> str | None:
        """Where a free happens (data-parallel recordings only; see ``MemoryEvent.host``)."""
        return self.current_module(owners=False) if self.model is not None else None

    def _profiler_label(self, func, args, out) -> None:
        """Follow ``record_function`` regions: FSDP2 labels the work it does for a unit with the
        unit's module path, ``"FSDP::all_gather (layers.3)"`` (torch/distributed/fsdp/
        _fully_shard/_fsdp_param_group.py ``_with_fqn``), so its collectives and copies belong to
        the block whose parameters they move, also when another block's hook prefetches them
        (the blocks then run the same ops and fold)."""
        if "enter" in func.__name__:
            label = args[0] if args and isinstance(args[0], str) else ""
            owner = None
            if label.startswith("FSDP::"):
                head = label.split(" [pg=")[0]
                owner = head[head.rindex("(") + 1:-1] if head.endswith(")") else ""
            self.owners.append(owner)
        elif self.owners:
            self.owners.pop()

    def current_module(self, owners: bool = True) -> str:
        """The module the next op belongs to: the innermost FSDP2 unit whose work it is
        (``owners``), else the module running (forward), the autograd node's (backward)."""
        owner = next((o for o in reversed(self.owners) if o is not None), None) if owners else None
        if owner is not None:
            return owner
        if self.phase != "forward" and recomputing():
            # activation checkpointing's recomputation in the backward runs the block's modules
            # again: their forward hooks name the op's module, as in the forward; an op of the
            # block's own body (a residual add) is the block's (no hook fires for the block: its
            # forward is called, not the module), not the autograd node's that asked for it
            block = self.module_names.get(id(recomputing_block()))
            top = self.module_stack[-1]
            if block is not None and not (top == block or top.startswith(block + ".")):
                return block
            if len(self.module_stack) > 1:
                return top
        if self.phase == "forward":
            return self.module_stack[-1]
        if self.phase == "optimizer":
            return ""
        node = torch._C._current_autograd_node()
        if node is None:
            return ""
        md = node.metadata
        if _META_KEY in md:
            return md[_META_KEY]
        var = getattr(node, "variable", None)  # AccumulateGrad
        if var is not None:
            name = self._leaf_names.get(id(var), "")
            return self.param_module.get(name.partition(":")[2], "")
        return ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _PRIM_DEVICE and len(args) == 1 and type(args[0]) is FakeTensor:
            # a FakeTensor's device, which C++ code (the autograd engine, TensorIterator) asks of
            # every fake tensor it touches: most calls that reach this mode (70% in cs336-lm).
            # Answered as FakeTensor.__torch_dispatch__ answers it (torch/_subclasses/fake_tensor.py),
            # without a pass through FakeTensorMode; no op of the step.
            t = args[0]
            return torch.device("meta") if t.fake_mode.in_kernel_invocation else t.fake_device
        kwargs = kwargs or {}
        if self.quiet:  # no op of the step (see _quiet_parameter_new)
            return func(*args, **kwargs)
        if func in FAKE_ONLY_OPS and self.real:
            raise _FakeOnly(str(func))
        if self.strict and _VALUE_TAGS.intersection(func.tags) and not _integer_index(func, args):
            raise _FakeOnly(f"{func} reads tensor values")
        if self.unwrap and any(issubclass(t, self.unwrap) for t in types):
            # FP8 training: torchao's Float8TrainingTensor runs each op on its fp8 data and scale
            # (the matmul as aten._scaled_mm), whose ops come back here, as DTensor's do
            return NotImplemented
        if self.dtensor is not None:
            # tensor parallelism: DTensor desugars each op into local ops and collectives, which
            # come back here (as torch.distributed.tensor.debug.CommDebugMode does); its shape
            # propagation on global-shape fake tensors is no op of the rank
            if any(issubclass(t, self.dtensor) for t in types):
                if self.model is not None:
                    self.name_local_params(args)
                return NotImplemented
            from symcost.frontends.dtensor_recording import hidden
            if hidden():
                return func(*args, **kwargs)
            if func is torch.ops.aten.slice.Tensor:
                out = func(*args, **kwargs)
                if out.shape == args[0].shape:
                    # DTensor's all-gather narrows its result to the logical size when the two
                    # ints are not the same object (``is not``: sizes above 256, CPython's small
                    # ints), a no-op view: not recorded, so sizes on either side of 256 run
                    # the same ops
                    return out
            else:
                out = None
        if self.dtensor is None or func is not torch.ops.aten.slice.Tensor:
            out = _dispatch_unaliased(func, args, kwargs)
            if func is _WAIT_TENSOR and isinstance(args[0], torch.Tensor) and out is not args[0]:
                # the eager kernel returns its input (c10d_functional's wait_tensor); its schema
                # declares no alias, so a FakeTensorMode cache hit rebuilds the output as a new
                # storage: a copy the rank never holds
                out = args[0]
            elif func is _MKLDNN_RNN_LAYER and isinstance(out[3], FakeTensor) and out[3].numel() == 0:
                # an LSTM layer on the CPU: PyTorch's meta kernel returns oneDNN's training
                # workspace (saved for backward) empty; the real kernel's size, from oneDNN's layout
                n = onednn_rnn.lstm_workspace(args, kwargs)
                if n:
                    out = (*out[:3], out[3].new_empty((n,)))
            elif func is _EMBEDDING_BAG and isinstance(out[1], FakeTensor) and out[1].numel() > 0:
                # nn.EmbeddingBag on the CPU: make_offset2bag_out (aten/src/ATen/native/
                # EmbeddingBag.cpp) sizes offset2bag (saved for backward) to indices + 1 for
                # make_offset2bag's cumulative sum, then resizes it down: its storage keeps the
                # one element more that the meta kernel leaves out (the CPU's, also under
                # --torch-device cuda, whose kernel allocates exactly indices)
                n = out[1].numel()
                out = (out[0], out[1].new_empty((n + 1,)).narrow(0, 0, n), *out[2:])
            elif func in _MIXED_NORMS and isinstance(out[1], FakeTensor):
                out = _mixed_norm_stats(args, kwargs, out)
            elif (func is _GROUP_NORM_BACKWARD and isinstance(out[0], FakeTensor)
                  and out[0].dtype != args[1].dtype):
                out = (out[0].new_empty(out[0].shape, dtype=args[1].dtype), *out[1:])
            elif func is _LIFT_FRESH and out is args[0]:
                # the real kernel returns its input, a fake one a new tensor: a new tensor object
                # (on the same storage) here too, so the constant and its lifted copy are two
                # tensors of the step in either recording (one graph edge, not a loop)
                out = out.detach()
        if func.namespace == "profiler":
            self._profiler_label(func, args, out)
            return out
        if func.namespace == "prim" or func is _LOCAL_SCALAR_DENSE:
            # _local_scalar_dense: a real tensor's value read on the host (``.item()``, ``if t``:
            # transformers' packed-sequence check); fake tensors have none to read (such a read
            # raises unless a record_context answers it), so neither recording counts it
            return out
        if self.kv_watch:
            self.watch_kv()
        inputs, ints = [], []

        def ref(a):
            # the argument tree with each tensor a TensorRef and each int an IntRef, in pytree's
            # order (depth first; a dict in insertion order); aten arguments nest only tuples,
            # lists and dicts, and pytree's generic flatten costs more than the op's fake kernel
            if isinstance(a, torch.Tensor):
                inputs.append(TensorInfo(tuple(a.shape), a.dtype, self.tensor_id(a), self.leaf_name(a),
                                         _storage_key(a) if self.storage_keys else None))
                return TensorRef(len(inputs) - 1)
            cls = type(a)
            if cls is int:
                ints.append(a)
                return IntRef(len(ints) - 1)
            if cls is tuple or cls is list:
                return cls([ref(x) for x in a])
            if cls is dict:
                return {k: ref(v) for k, v in a.items()}
            if isinstance(a, int) and not isinstance(a, bool):
                ints.append(a)
                return IntRef(len(ints) - 1)
            if isinstance(a, torch.SymInt):
                raise SymcostError("symbolic ints reached the recorder; trace with concrete sizes")
            if isinstance(a, (tuple, list, dict)):  # a namedtuple or another container: pytree's way
                flat, spec = tree_flatten(a)
                if not spec.is_leaf():
                    return tree_unflatten([ref(x) for x in flat], spec)
            return a

        args_tree = (ref(args), ref(kwargs))
        if func in _PADDING_IDX and len(ints) > _PADDING_IDX[func]:
            ints[_PADDING_IDX[func]] = -1
        outs = []
        if func in self.host_ops:  # (its views too: track() skips a preexisting storage)
            ref = StorageWeakRef(out.untyped_storage())
            self.preexisting.add(ref.cdata)
            # (the weak reference keeps the StorageImpl, not its data, for the whole step: a host
            # copy freed in the step, activation offload's, leaves no address that a later device
            # storage could take and be skipped as preexisting)
            self._host_refs.append(ref)
        for t in (out,) if isinstance(out, torch.Tensor) else tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                # lift_fresh: a constant the step made (``torch.tensor([...])``) enters the step;
                # its storage is allocated by the step, also where the real kernel returns its
                # input (a fake one makes a new tensor)
                known = id(t) in self._tid and func is not _LIFT_FRESH
                outs.append(TensorInfo(tuple(t.shape), t.dtype, self.tensor_id(t), None,
                                       _storage_key(t) if self.storage_keys else None))
                if not known:
                    self.track(t, len(self.ops))
        module = self.current_module()
        host = self.current_module(owners=False) if self.owners else module
        self.ops.append(
            OpCall(
                op=func,
                name=str(func),
                host=host if host != module else None,
                module=module,
                phase=self.phase,
                inputs=inputs,
                outputs=outs,
                ints=ints,
                args_tree=args_tree,
                group=self.group_of(args) if self.groups and func.namespace in _COMM_NAMESPACES else None,
                recompute=recomputing(),
            )
        )
        return out

    def group_of(self, args) -> str | None:
        """The mesh symbol of a collective's process group (:attr:`groups`): its name, an
        argument of the functional collectives, or its ``ProcessGroup`` object, of c10d's."""
        for a in args:
            if isinstance(a, str) and a in self.groups:
                return self.groups[a]
            if isinstance(a, torch.ScriptObject) and a._type().qualified_name().endswith(".ProcessGroup"):
                import torch.distributed as dist

                return self.groups.get(dist.ProcessGroup.unbox(a).group_name)
        return None


#: process group name -> label ("DP", "TP", HSDP's "DP_replicate": Layout.engine_meshes) of every
#: multi-dimensional mesh recorded in this process
_MESH_GROUPS: dict[str, str] = {}
#: the default process group those names belong to (a new fake world clears them)
_MESH_WORLD: list = []


def _storage_key(t: torch.Tensor) -> int | None:
    """The key of ``t``'s storage (None for a tensor without one)."""
    try:
        return StorageWeakRef(t.untyped_storage()).cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return None

