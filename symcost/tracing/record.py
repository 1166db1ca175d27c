"""Record one training step at concrete sizes, without allocating memory.

The model is built on the meta device and materialised as ``FakeTensor``s on the CPU device
(``torch._subclasses.fake_tensor.FakeTensorMode``), so PyTorch picks the same kernels it would
pick for real CPU tensors (e.g. the CPU flash-attention kernel behind
``F.scaled_dot_product_attention``) while no storage is allocated: a 70B configuration records
on a laptop. A ``TorchDispatchMode`` sees every aten op that runs, forward and the backward ops
autograd really executes; module forward hooks and labels on autograd nodes tell which module each
op came from (backward ops inherit the module of the forward op whose autograd node runs them).
A ``saved_tensors_hooks`` pair records what autograd saves for backward.

The probes of a fit are tiny (B < 10, S < 25, d_model < 200): there a real CPU step costs a
fraction of FakeTensorMode's Python bookkeeping, so they run on real tensors (zero-filled
parameters; :func:`real_tensors_suffice`), as does a small request unless it reads a value
(``strict``), and large steps are fake. Both run the same kernels and record the same ops, saved
storages and memory events (checked on every built-in model, the real configurations and the
data- and tensor-parallel layouts: tests/test_real_probes.py); the places a real step differs
are made equal: a host read of a value (``_local_scalar_dense``) is no op of the step, a
constant lifted into the step (``lift_fresh``) is an allocation and a new tensor in both,
autograd replays views by their view functions on real tensors too (as it must on fake ones, a
tensor subclass; eager would use ``as_strided``: a view either way), and on the fake process
group collectives wait at once, FSDP2's lazy initialisation runs before the step and
``nn.Parameter`` of a fake tensor's detach is not recorded (docs/tracing.md §1).

The recording is concrete; :mod:`symcost.tracing.fit` turns several recordings at different sizes into
symbolic shapes.
"""
from __future__ import annotations

import contextlib
from typing import Mapping

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from symcost.errors import SymcostError
from symcost.frontends.layout import layout_of
from symcost.frontends.models import ModelSpec
from symcost.frontends.spec import model_stdout
from symcost.frontends.precision import precision_context
from symcost.tracing.device_kernels import device_kernels
from symcost.tracing.one_hot import scatter_one_hot
from symcost.tracing import grouped_mm
from symcost.tracing.modules import (_containers, called_as, module_paths, outside_its_block, shared_by_blocks,
                                     shared_name)
from symcost.tracing.recording import (  # noqa: F401 (re-exported: the recording's types)
    IntRef, MemoryEvent, OpCall, Recording, SavedTensor, TensorInfo, TensorRef)
from symcost.tracing.recorder import (  # noqa: F401 (the dispatch mode and its helpers)
    FAKE_ONLY_OPS, _COMM_NAMESPACES, _LIFT_FRESH, _LOCAL_SCALAR_DENSE, _MESH_GROUPS, _MESH_WORLD, _META_ALIASED_OUTPUTS,
    _META_KEY, _PADDING_IDX, _PRIM_DEVICE, _VALUE_TAGS, _WAIT_TENSOR, _FakeOnly, _Recorder, _dispatch_unaliased,
    _grad_fns, _label_graph, _module_names, _storage_key)


@contextlib.contextmanager
def _observe_resize(rec: _Recorder):
    """While recording, every ``UntypedStorage.resize_`` is reported to ``rec``
    (:meth:`_Recorder.resized`): in-place storage resizes dispatch no aten op, so the recorder's
    dispatch mode and weak references would not see them."""
    orig = torch.UntypedStorage.resize_

    def resize_(self, size):
        old = self.nbytes()
        out = orig(self, size)
        rec.resized(self, old)
        return out

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = orig


@contextlib.contextmanager
def _no_host_reads():
    """``Tensor.tolist`` and ``Tensor.numpy`` read values without an op a dispatch mode sees (a
    fake tensor has none to read): in a strict real recording they give way to a fake one."""
    saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def refuse(name):
        def read(self, *args, **kwargs):
            raise _FakeOnly(f"Tensor.{name} reads tensor values")
        return read

    for name in saved:
        setattr(torch.Tensor, name, refuse(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


@contextlib.contextmanager
def _wait_at_once():
    """Functional collectives wait at once, as they do under FakeTensorMode
    (torch/distributed/_functional_collectives.py ``_maybe_wrap_tensor``: ``wait_tensor``
    when tracing, else an ``AsyncCollectiveTensor`` that waits at its first use): a real
    recording then dispatches the fake one's ops (the wait's place moves by a few ops; it
    frees nothing and costs nothing)."""
    import torch.distributed._functional_collectives as fc

    orig = fc._maybe_wrap_tensor
    fc._maybe_wrap_tensor = fc.wait_tensor
    try:
        yield
    finally:
        fc._maybe_wrap_tensor = orig


@contextlib.contextmanager
def _quiet_parameter_new(rec):
    """``nn.Parameter(t)`` of a tensor subclass (a FakeTensor, FSDP2's unsharded parameter at
    its first all-gather) detaches ``t`` (torch/nn/parameter.py), of a plain tensor it wraps
    it: the detach is an artifact of fake tensors, not an op of the step, so not recorded."""
    orig = nn.Parameter.__new__

    def new(cls, data=None, requires_grad=True):
        rec.quiet += 1
        try:
            return orig(cls, data, requires_grad)
        finally:
            rec.quiet -= 1

    nn.Parameter.__new__ = staticmethod(new)
    try:
        yield
    finally:
        nn.Parameter.__new__ = orig


def _lazy_init(model) -> None:
    """FSDP2's (and ``replicate``'s) lazy initialisation, before the step: the first forward
    runs it (torch/distributed/fsdp/_fully_shard/_fsdp_state.py ``_lazy_init``), once per
    training run, and on fake tensors it re-views every shard (``reset_sharded_param`` compares
    storages of plain tensors only): no op of a step."""
    state = model._get_fsdp_state() if hasattr(model, "_get_fsdp_state") else None
    if state is None:
        from torch.distributed._composable.replicate_with_fsdp import _get_module_replicate_state

        state = _get_module_replicate_state(model)
    if state is not None:
        state._lazy_init()


#: the largest step recorded on real CPU tensors (see :func:`real_tensors_suffice`): every size
#: at most this, parameters at most :data:`REAL_MAX_PARAMS` elements and 6·B·S·params at most
#: :data:`REAL_MAX_FLOP` (Kaplan et al. 2020's training FLOPs, an upper bound with experts: a
#: real step of 8 GFLOP took about as long as its fake recording on this 2-core VM, one thread)
REAL_MAX_SIZE = 128
REAL_MAX_PARAMS = 64_000_000
REAL_MAX_FLOP = 8e9


def real_tensors_suffice(values: Mapping[str, int], model: nn.Module, step: str = "train") -> bool:
    """Whether a ``step`` ("train", "prefill", "decode") of ``model`` (on the meta device) at
    ``values`` is recorded on real CPU tensors instead of fake ones.

    The probes of a fit are tiny (:data:`symcost.tracing.fit.POOLS`: B < 10, S < 25, H·D < 200):
    their real step costs less than FakeTensorMode's bookkeeping of it (a third of the time or
    less: fake dispatch is Python around every op, and its cache misses at every new size), up
    to about 8 GFLOP of real work (:data:`REAL_MAX_FLOP`; DeepSeek-V3's probes hold 10-60M
    parameters at B·S = 24, its fixed low-rank and expert widths). The
    ops recorded are the same: FakeTensorMode exists to run the kernels real CPU tensors run, and
    a recording that reads a value is made on fake tensors (the request's, ``record``'s
    ``strict``). Larger steps (a 70B configuration, a probe drawn near large requested sizes)
    stay fake: no memory is allocated for them.

    A training step with a size of 1 (B = 1, S = 1, K = 1 multi-query, one block, top-1 routing)
    runs the same ops on real and fake tensors (tests/test_real_probes.py draws them); an
    inference step with a 1 stays fake: a dimension of size 1 takes any stride, fake kernels
    choose other strides there than real ones, and falcon's decode step (S = 1) then dispatches
    ``matmul`` as ``bmm`` on fake tensors and ``mm`` on real ones.
    """
    if any(v > REAL_MAX_SIZE or (v < 2 and step != "train") for v in values.values()):
        return False
    n = sum(p.numel() for p in model.parameters())
    return n <= REAL_MAX_PARAMS and 6 * values.get("B", 1) * values.get("S", 1) * n <= REAL_MAX_FLOP


def materialize(model: nn.Module, device: torch.device, dtype: torch.dtype = torch.float32,
                zero: bool = False) -> None:
    """Like ``model.to_empty(device)``, but tied parameters stay tied (one new tensor each).

    Floating-point parameters and buffers become ``dtype`` (as ``model.to(dtype)`` would).
    ``zero``: fill the new tensors with zeros (real tensors: an integer buffer used as indices
    must hold valid ones, and uninitialised floats may be denormals, slow on a CPU).

    Inside a ``FakeTensorMode`` the new tensors are fake: shapes and dtypes, no storage.
    """
    memo: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for table in (mod._parameters, mod._buffers):
            for name, t in list(table.items()):
                if t is None:
                    continue
                if id(t) not in memo:
                    new = (torch.zeros_like if zero else torch.empty_like)(
                        t, device=device, dtype=dtype if t.is_floating_point() else t.dtype
                    )
                    if isinstance(t, nn.Parameter):
                        new = nn.Parameter(new, requires_grad=t.requires_grad)
                    memo[id(t)] = new
                table[name] = memo[id(t)]


def find_layer_container(spec: ModelSpec, model: nn.Module, values: Mapping[str, int]) -> str | None:
    """Dotted path ("" for the root) of the ``nn.ModuleList``/``nn.Sequential`` of the L blocks (or
    an ``nn.ModuleDict`` keyed "0".."L-1", see :func:`_containers`).

    It is the container whose length is L in ``model`` and L + 1 in the same model built (on the
    meta device) with L + 1.

    Raises:
        SymcostError: no container, or several, follow L.
    """
    n = values["L"]
    here = {k for k, v in _containers(model).items() if v == n}
    if not here:
        found = set()
    else:
        other = _containers(spec.build_meta(dict(values, L=n + 1)))
        found = {k for k in here if other.get(k) == n + 1}
    if len(found) == 1:
        return found.pop()
    what = ("no nn.ModuleList, nn.Sequential or nn.ModuleDict keyed 0..L-1 has" if not found
            else f"several containers ({', '.join(sorted(found))}) have")
    # (an hf: model's user cannot set ModelSpec.layers: say what runs without one block list)
    fix = ("the layout asked for wraps blocks it cannot find here; without a layout the step is traced unfolded "
           "at the requested L" if spec.name.startswith("hf:")
           else "set ModelSpec.layers to the blocks' container")
    err = SymcostError(f"{spec.name}: {what} length L, so no one list of the L repeated blocks is found; {fix}")
    err.found = sorted(found)  # (record: the step is then recorded unfolded, L pinned by the tracer)
    raise err


def _kv_storages(layers) -> tuple[list[int], int, set[int], list[tuple[int, ...]]]:
    """Per-layer bytes of the storages of floating-point tensors a KV cache holds (each storage
    once, in the first layer holding it), the number of those tensors that view fewer elements
    than their storage holds, the storage keys, and per layer each storage's bytes in the order
    the layer holds them (their sum is the layer's bytes: a hybrid layer's keys, values and
    recurrent states, fitted one by one where the sum is no polynomial the fit finds)."""
    seen: set[int] = set()
    per_layer, evicted, parts = [], 0, []
    for tensors in layers:
        total, part = 0, []
        for t in tensors:
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                continue
            st = t.untyped_storage()
            if t.numel() * t.element_size() < st.nbytes():
                evicted += 1
            key = StorageWeakRef(st).cdata
            if key not in seen:
                seen.add(key)
                total += st.nbytes()
                part.append(st.nbytes())
        per_layer.append(total)
        parts.append(tuple(part))
    return per_layer, evicted, seen, parts


def _inference_step(rec: _Recorder, model: nn.Module, args, kwargs, kv_layers, autocast):
    """Record one forward of an inference step without gradients; returns ``(ops recorded,
    len(events), (bytes per KV-cache layer, evicted tensors, kv_start per layer))``.

    The KV cache's storages are counted apart: the cache after the step is static memory
    (``Recording.kv_layers``). A storage the step allocates for the cache (a DynamicCache's
    concatenation) keeps its allocation in ``rec.events`` (``MemoryEvent.kv``); a storage the
    cache held before the step and the step frees (the tensor the concatenation replaced) gets a
    free event (``kv``) paired with the allocation of its replacement (the op that allocated a
    storage of the cache after the step and read the freed one), so the schedule holds both
    tensors live together from the concatenation until the old one is freed, as the allocator
    does. ``kv_start`` (per cache layer: bytes of the freed storages minus those of the allocated
    ones) is where the running total of those events starts, so that static + running total is
    the cache's bytes at every point of the step: before the step the cache holds its old
    tensors, not the new ones. A freed storage no allocation of the cache read is left out (as
    any free whose allocation is not seen). Storages held before and after the step (a
    StaticCache, written in place) are static and make no event.

    Each op's inputs that are the cache's storages (held before the step, e.g. a DynamicCache's
    tensors a concatenation reads, or after it, e.g. a StaticCache's or the concatenation's result
    the attention reads) are marked in ``OpCall.kv_reads``; the outputs that allocate a storage the
    cache holds after the step (a DynamicCache's concatenation) in ``OpCall.kv_writes``."""
    # weak references keep the StorageImpls of the cache before the step allocated while it runs,
    # so their keys (addresses) are not reused by the step's own storages
    old_layers = [[(StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes()) for t in ts
                   if isinstance(t, torch.Tensor) and t.is_floating_point()] for ts in kv_layers()]
    before = [r for refs in old_layers for r, _ in refs]
    old_layer: dict[int, int] = {}  # storage key -> the first cache layer holding it before the step
    for i, refs in enumerate(old_layers):
        for r, nbytes in refs:
            if r.cdata not in old_layer:
                old_layer[r.cdata] = i
                rec.kv_watch[r.cdata] = (r, nbytes)
    rec.storage_keys = True
    with rec, torch.no_grad(), autocast():
        out = model(*args, **kwargs)
    del out
    rec.watch_kv()
    rec.kv_watch = {}
    after = kv_layers()
    per_layer, evicted, cache_keys, parts = _kv_storages(after)
    new_layer: dict[int, int] = {}  # storage key -> the first cache layer holding it after the step
    for i, ts in enumerate(after):
        for t in ts:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                new_layer.setdefault(StorageWeakRef(t.untyped_storage()).cdata, i)
    del after
    # a live storage's allocation is the last event of its key (an address freed earlier in the
    # step may have been reused by it, so earlier events of the same key are other storages)
    drop, pending = set(), set(cache_keys)
    since = {r.cdata: -1 for r in before}  # storage key -> the op that allocated it (-1: before the step)
    alloc_event: dict[int, int] = {}  # cache storage allocated by the step -> its event's position
    for k in range(len(rec.events) - 1, -1, -1):
        e = rec.events[k]
        if e.storage in pending and e.nbytes > 0:
            pending.discard(e.storage)
            if e.storage in old_layer:  # held before the step too: a view taken as an allocation
                drop.add(k)
                since[e.storage] = e.index
            else:
                alloc_event[e.storage] = k
                since[e.storage] = e.index
    for j, op in enumerate(rec.ops):
        reads = tuple(k for k, t in enumerate(op.inputs) if t.storage in since and j > since[t.storage])
        if reads:
            op.kv_reads = reads
    for key, j in since.items():
        if j >= 0 and key in cache_keys:
            op = rec.ops[j]
            op.kv_writes = tuple(sorted(set(op.kv_writes) | {k for k, t in enumerate(op.outputs) if t.storage == key}))
    kv_start = [0] * len(per_layer)
    for key, k in alloc_event.items():
        rec.events[k].kv = True
        kv_start[new_layer[key]] -= rec.events[k].nbytes
    # the free of a storage the cache held before the step: paired with the allocation that
    # replaced it (the op that allocated a cache storage and read the old one)
    replaced = {}  # old storage key -> the new storage's key
    for key, k in alloc_event.items():
        op = rec.ops[rec.events[k].index]
        for t in op.inputs:
            if t.storage in old_layer and t.storage not in cache_keys:
                replaced.setdefault(t.storage, key)
    for k, e in enumerate(rec.events):
        if e.kv and e.nbytes < 0:
            if e.storage in replaced and old_layer[e.storage] < len(kv_start):
                kv_start[old_layer[e.storage]] -= e.nbytes  # (a free: nbytes < 0)
                e.storage = replaced[e.storage]
            else:
                drop.add(k)
    del before, old_layers
    rec.events = [e for k, e in enumerate(rec.events) if k not in drop]
    return len(rec.ops), len(rec.events), (per_layer, evicted, kv_start, parts)


def record(spec: ModelSpec, values: Mapping[str, int], precision: str = "fp32",
           optimizer=None, strict: bool = False) -> Recording:
    """Record one step of ``spec`` at concrete ``values``: forward + loss + backward for a
    training spec; for an inference spec (``spec.step`` "prefill" or "decode",
    :meth:`ModelSpec.for_step`) one forward without gradients through the model's own KV cache
    (``spec.infer`` prepares it; filling a decode step's cache with T tokens is not recorded).

    Args:
        spec: the model.
        values: a concrete int for B, S and every config symbol of the model.
        precision: one of :data:`symcost.frontends.precision.PRECISIONS` (see :func:`precision_context`).
        optimizer: optional ``callable(params) -> torch.optim.Optimizer``; its ``step()`` runs
            after the backward (phase ``"optimizer"``).
        strict: a real recording that reads a tensor's value (an op PyTorch tags
            ``data_dependent_output``: ``.item()``, ``if tensor:``; ``Tensor.tolist``) or runs
            an op whose output shape depends on values (tagged ``dynamic_output_shape``:
            ``nonzero``, boolean indexing) is made again on fake tensors, where such a step
            raises or is answered as a fake one would (the request of a trace: a real step
            would silently take a branch on the zero-filled weights).

    Returns:
        The :class:`Recording`: ops in execution order with shapes and dtypes, unique
        parameters (tied ones once), and the storages autograd saved for backward; for an
        inference step, the KV cache's storages per layer (``kv_layers``).

    Raises:
        SymcostError: the model cannot be built or run at these sizes, or its control flow
            depends on tensor data (which cannot be traced without data).

    A small step (:func:`real_tensors_suffice`) runs on real CPU tensors; where
    that fails (a kernel that checks values a fake tensor has none of, or an op whose real
    outputs are sized by the library, :data:`FAKE_ONLY_OPS`), it is recorded on fake ones.
    """
    with model_stdout():  # (the model's prints go to stderr, never into symcost's output)
        try:
            return _record(spec, values, precision, optimizer, real_ok=True, strict=strict)
        except SymcostError as e:
            if not getattr(e, "real_tensors", False):
                raise
        return _record(spec, values, precision, optimizer, real_ok=False)


def _record(spec: ModelSpec, values: Mapping[str, int], precision: str, optimizer, real_ok: bool,
            strict: bool = False) -> Recording:
    """:func:`record` on fake tensors, or on real ones where ``real_ok`` and the step is small;
    an error of a real recording carries ``real_tensors = True``."""
    values = dict(values)
    for a, b in spec.tied.items():
        values[a] = values[b]
    try:
        model = spec.build_meta(values)
    except SymcostError:
        raise
    except Exception as e:  # noqa: BLE001
        raise SymcostError(f"building {spec.name} failed at {values}: {type(e).__name__}: {e}") from e
    inference = spec.step != "train"
    if inference and spec.infer is None:
        raise SymcostError(f"{spec.name} has no KV cache, so it has no {spec.step} step")
    model.train(not inference)
    names = _module_names(model)
    paths = module_paths(model)  # (a module shared by the blocks: its path under each)
    layers = spec.layers
    no_fold = None
    if layers is None and "L" in spec.symbols:
        try:
            layers = find_layer_container(spec, model, values)
        except SymcostError as e:
            if (layout_of(spec).traced_dims and not e.found) or spec.lead_blocks or not hasattr(e, "found"):
                raise  # (a layout without any block list, or lead blocks, works on the block list)
            # no single block list follows L (an encoder-decoder's two stacks, or none): the step
            # is recorded as it is, and the tracer pins L (never refused for lack of one); under a
            # parallel layout every block of every stack is wrapped (below)
            no_fold = (f"several block stacks follow L ({', '.join(e.found)}), so no one block stands for all"
                       if e.found else "no nn.ModuleList, nn.Sequential or nn.ModuleDict follows L") + \
                ": the model is traced unfolded at the requested L"

    param_dtype, autocast = precision_context(precision)
    layout = layout_of(spec)
    loss_context = contextlib.nullcontext
    groups: dict[str, str] = {}
    if layout.traced_dims:
        if param_dtype != torch.float32:
            model.to(param_dtype)  # on the meta device, before the parameters become DTensors
        # one rank of the layout's mesh on the fake process group (torchtitan's layout: tensor
        # parallelism inside, data parallelism across)
        labels: dict[str, str] = {}
        mesh = layout.fake_mesh(values, labels)
        if len(layout.traced_dims) > 1 or layout.cp:  # (CP: the ring's collectives name their group)
            # every multi-dimensional mesh's group names so far, this one's last: DTensor's caches
            # keep the DeviceMesh of an earlier recording whose mesh compares equal (same shape and
            # names), so a collective can name that mesh's group (seen: sequence parallelism's
            # backward all-gathers in every recording after the first of a process)
            # (within one fake world: group names restart from 0 in a new one, where an earlier
            # world's labels would name other groups, e.g. HSDP's "DP_replicate" on a TP group)
            world = torch.distributed.distributed_c10d._get_default_group()
            if _MESH_WORLD and _MESH_WORLD[0] is not world:
                _MESH_GROUPS.clear()
            _MESH_WORLD[:] = [world]
            _MESH_GROUPS.update(labels)
            groups = dict(_MESH_GROUPS)
    if layout:
        # tensor parallelism first, then activation checkpointing, then the data-parallel engine
        # over its DTensors (torchtitan's parallelize order: fully_shard of a TP-sharded parameter
        # shards its local rows again)
        ac_stacks = ()
        if layers is None:  # (several stacks: each block of each checkpointed, wrapped, planned)
            from symcost.tracing.stacks import checkpointed_stacks

            ac_stacks = checkpointed_stacks(spec, values)
        loss_context = layout.parallelize(model, layers, mesh if layout.traced_dims else {},
                                          spec.extra.get("dp_engine"), spec.extra.get("compile_cuts"),
                                          spec.extra.get("torch_device"), ac_stacks=ac_stacks)
        if layout.fp8 is not None:  # (the Float8Linear modules that replaced the linears: new objects)
            names.update(_module_names(model))
            paths = module_paths(model)
        # a module the plan added outside the blocks (sequence parallelism's split of a stack's
        # stream that enters whole, frontends.tensor_parallel_stacks._scatter_first_block, called from
        # block 0's pre-hook): named, so its ops are the stack's, not block 0's
        names.update({id(m): n for n, m in model.named_modules() if getattr(m, "symcost_outside_blocks", False)})
    # the recording's ``parallel``: the data-parallel strategy, else "tp" / "tp+sp"; on the 2-D
    # mesh the tensor parallelism is its ``tensor_parallel``
    parallel = layout.label
    tensor_parallel = layout.tensor_parallel
    # data and tensor parallelism too: the fake process group's collectives complete at once on
    # real tensors as on fake ones (their outputs hold whatever memory held: values are not read)
    real = real_ok and real_tensors_suffice(values, model, spec.step)
    # real tensors: autograd replays views by their view functions, as it does for fake ones (a
    # tensor subclass); plain eager CPU/CUDA would regenerate them with as_strided instead (in
    # place on a view, then its backward): views either way, no cost, one op sequence for both
    with torch.autograd._force_original_view_tracking(True) if real else FakeTensorMode(allow_non_fake_inputs=True):
        if parallel is None or (not layout.tp and spec.extra.get("dp_engine") == "megatron-ddp"):
            # (Megatron's engine leaves the parameters plain: tied ones stay tied, as on one device)
            materialize(model, torch.device("cpu"), param_dtype, zero=real)
        else:
            model.to_empty(device=torch.device("cpu"))
            if real:
                with torch.no_grad():
                    for t in list(model.parameters()) + list(model.buffers()):
                        _local(t).zero_()
            if layout.shard is not None:
                _lazy_init(model)
        leaf_names: dict[int, str] = {}
        params: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        param_module: dict[str, str] = {}
        tied: dict[str, list[str]] = {}
        param_shards: dict[str, tuple[int, ...]] = {}
        param_names: dict[int, list[str]] = {}  # (every name: a parameter of a module shared by blocks)
        shared_params: set[int] = set()
        frozen: set[str] = set()  # requires_grad=False: no gradient, no optimizer state
        for name, p in model.named_parameters(remove_duplicate=False):
            param_names.setdefault(id(p), []).append(name)
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in leaf_names:  # a tied alias: counted once, under its first name
                tied.setdefault(leaf_names[id(p)][6:], []).append(name)
                continue
            name = shared_name(param_names[id(p)])  # in several blocks: one parameter in no block
            if name != param_names[id(p)][0] or shared_by_blocks(param_names[id(p)]):
                shared_params.add(id(p))
            leaf_names[id(p)] = f"param:{name}"
            local = getattr(p, "_local_tensor", None)  # (to_local() would make a new view each call)
            if (layout.tp or layout.ep) and local is not None:  # the shard DTensor's local ops read
                leaf_names[id(local)] = f"param:{name}"
            params[name] = (tuple(p.shape), p.dtype)
            if not p.requires_grad:
                frozen.add(name)
            if parallel is not None:
                local = p.to_local() if hasattr(p, "to_local") else p
                param_shards[name] = tuple(local.shape)
            param_module[name] = name.rpartition(".")[0]
        buffers: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        buffer_storages: set[int] = set()
        buffer_names: dict[int, list[str]] = {}  # (each storage's names: a module shared by blocks)
        for name, b in model.named_buffers(remove_duplicate=False):
            buffer_names.setdefault(StorageWeakRef(b.untyped_storage()).cdata, []).append(name)
        for name, b in model.named_buffers():
            bkey = StorageWeakRef(b.untyped_storage()).cdata
            name = shared_name(buffer_names[bkey])  # in several blocks: counted once, not per block
            leaf_names[id(b)] = f"buffer:{name}"
            if bkey not in buffer_storages:
                buffer_storages.add(bkey)
                buffers[name] = (tuple(b.shape), b.dtype)
        static_storages = {
            StorageWeakRef(_storage_tensor(t).untyped_storage()).cdata
            for t in list(model.parameters()) + list(model.buffers())
        }
        kv_layers = None
        if inference:
            try:
                with torch.no_grad(), autocast(), grouped_mm.kernels():
                    args, kwargs, kv_layers = spec.infer(model, values, torch.device("cpu"), spec.step,
                                                         spec.kv_cache)
            except SymcostError as e:
                e.real_tensors = real
                raise
            except Exception as e:  # noqa: BLE001
                err = SymcostError(f"filling the KV cache of {spec.name} at {values} failed: "
                                   f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
                err.real_tensors = real
                raise err from e
        else:
            args, kwargs = spec.make_inputs(values, torch.device("cpu"))
            if layout.cp:  # the rank's shard of the sequence, load-balanced (symcost.frontends.context_parallel)
                from symcost.frontends.context_parallel import shard_inputs

                args, kwargs = shard_inputs(spec, values, (args, kwargs), mesh["CP"])
        if param_dtype != torch.float32:
            args, kwargs = tree_map(
                lambda t: t.to(param_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                (args, kwargs),
            )
        input_storages: dict[int, int] = {}
        for i, t in enumerate(tree_flatten((args, kwargs))[0]):
            if isinstance(t, torch.Tensor):
                leaf_names[id(t)] = f"input:{i}"
                st = t.untyped_storage()
                input_storages[StorageWeakRef(st).cdata] = st.nbytes()

        rec = _Recorder(leaf_names)
        rec.module_names = names
        rec.real = real
        rec.strict = real and strict
        rec.groups = groups
        rec.param_module = param_module
        if parallel is not None:
            rec.model = model
        if layout.tp or layout.ep:  # (expert parallelism: the experts' DTensor shards)
            from torch.distributed.tensor import DTensor

            rec.dtensor = DTensor
        if layout.cp:  # (context parallelism: the attention's q, k, v as sequence-sharded DTensors)
            from torch.distributed.tensor import DTensor

            rec.dtensor = DTensor
        if layout.fp8 is not None:
            from symcost.frontends.fp8 import fp8_tensor_types

            rec.unwrap = fp8_tensor_types()
        rec.preexisting = static_storages | set(input_storages)
        saved: list[SavedTensor] = []

        seen_saved: dict[int, SavedTensor] = {}
        # a weak reference to every saved storage keeps its StorageImpl (not its data) allocated
        # for the whole step, so its address (the key) cannot be reused: a storage autograd saved
        # and freed early (a branch of the graph the loss does not reach, e.g. DeepSeek-V3's
        # group scores) is never taken for a later storage allocated at the same address, which
        # the allocator's history, not the sizes, would decide
        saved_refs: list[StorageWeakRef] = []

        def pack(t: torch.Tensor):
            t0, t = t, _local(t)  # tensor parallelism: autograd saves DTensors; a rank holds their shards
            extra = 0
            if rec.unwrap and isinstance(t, rec.unwrap):
                # FP8 training: a float8 tensor saved (the weight FSDP2 all-gathered in fp8, the
                # input torchao's float8 TP styles cast before the linear) holds its fp8 data and
                # its scale: the data's storage is the saved one (a parameter's where it is FSDP2's
                # unsharded weight), the scale's bytes are added
                scale = getattr(t, "_scale", None)
                extra = scale.untyped_storage().nbytes() if isinstance(scale, torch.Tensor) else 0
                t = _storage_tensor(t)
            st = t.untyped_storage()
            ref = StorageWeakRef(st)
            key = ref.cdata
            if key in static_storages or key in rec.param_storages or (
                    parallel is not None and any((rec.leaf_name(x) or "").startswith("param:") for x in {t, t0})) or (
                    parallel is not None and key in _param_storages(rec.model)):
                # a parameter (FSDP's unsharded one included: on the 2-D mesh a DTensor whose
                # local tensor is saved before the op names it, as autograd saves a DTensor op's
                # inputs before it runs: sequence parallelism's replicated norm weights) or buffer
                return t0
            if layout.compile and t is t0:  # (the object autograd keeps holds the storage: rec.hold)
                rec.hold(t)
            if key not in seen_saved:
                saved_refs.append(ref)
                seen_saved[key] = SavedTensor(st.nbytes() + extra, t.dtype, rec.module_stack[-1], tuple(t.shape),
                                              made_in=rec.made_by.get(key))
                saved.append(seen_saved[key])
            else:
                seen_saved[key].also.add(rec.module_stack[-1])
            return t0

        unlabelled = frozenset(shared_params)  # (their gradients' accumulation: in no block)
        entered: set[str] = set()  # blocks (ModuleList items) whose own call has run (modules.outside_its_block)

        def pre_hook(module, inputs):
            if torch.compiler.is_compiling():  # (--compile: Dynamo traces the hooks; the block's ops are its own)
                return
            for fn in _grad_fns(inputs):
                _label_graph(fn, rec.module_stack[-1], unlabelled)
            name = names.get(id(module), rec.module_stack[-1])
            if len(paths.get(id(module), ())) > 1:  # a module shared by the blocks: the caller's
                name = called_as(paths[id(module)], rec.module_stack[-1]) or name
            if rec.phase == "forward":
                name = outside_its_block(name, rec.module_stack, entered)
            rec.module_stack.append(name)

        def post_hook(module, inputs, output):
            if torch.compiler.is_compiling():
                return
            label = rec.module_stack.pop()
            for fn in _grad_fns(output):
                _label_graph(fn, label, unlabelled)

        h1 = nn.modules.module.register_module_forward_pre_hook(pre_hook)
        h2 = nn.modules.module.register_module_forward_hook(post_hook)
        kv: tuple = ([], 0)

        def parallel_contexts():  # a data- or tensor-parallel step's, for its forward and backward
            stack = contextlib.ExitStack()
            if parallel is not None:
                stack.enter_context(_observe_resize(rec))
                stack.enter_context(_quiet_parameter_new(rec))
                if real:
                    stack.enter_context(_wait_at_once())
            if layout.offload:  # FSDP2's CPU offload: its copies as ops (symcost.frontends.offload)
                from symcost.frontends.offload import offload_transfers, transfer_ops

                rec.host_ops = rec.host_ops | frozenset(transfer_ops()[1:])
                stack.enter_context(offload_transfers())
            return stack

        if layout.tp or layout.ep:
            from symcost.frontends.dtensor_recording import hide_shape_propagation as hide
        else:
            hide = contextlib.nullcontext
        def cp_contexts():  # context parallelism's, for the forward and the backward
            stack = contextlib.ExitStack()
            if layout.cp:  # PyTorch's CP dispatcher (F.scaled_dot_product_attention as ring attention)
                from symcost.frontends.context_parallel import enabled

                stack.enter_context(enabled(mesh["CP"], layout.cp_rotate))
                if real:
                    stack.enter_context(_wait_at_once())
            return stack

        if layout.cp:
            from symcost.frontends.dtensor_recording import hide_shape_propagation as hide
        guard = contextlib.ExitStack()
        if rec.strict:
            guard.enter_context(_no_host_reads())
        try:
            context = spec.record_context or contextlib.nullcontext  # (hf: the masks the real step builds)
            kernels = spec.extra.get("torch_device")  # (--torch-device: its dropout and attention kernels)
            if inference:
                # (a tensor-parallel decode or prefill: DTensor's shape propagation hidden, as in
                # training, so the first recording of a process holds the rank's ops only)
                with context(), parallel_contexts(), hide(), scatter_one_hot():
                    n_forward, events_end, kv = _inference_step(rec, model, args, kwargs, kv_layers, autocast)
                n_backward = 0
            else:
                hooks = (pack, lambda t: t)
                if layout.offload_activations:
                    # activation offload: save_on_cpu(pin_memory=True)'s copies as ops, the host's
                    # kept out of the device's schedule (symcost.frontends.offload.save_on_host)
                    from symcost.frontends.offload import save_on_host, save_ops

                    rec.host_ops = rec.host_ops | {save_ops()[1]}
                    hooks = save_on_host(pack)
                with rec, torch.autograd.graph.saved_tensors_hooks(*hooks), context(), \
                        parallel_contexts(), hide(), loss_context(), cp_contexts(), device_kernels(kernels), \
                        scatter_one_hot():
                    with autocast():
                        out = model(*args, **kwargs)
                        loss = spec.loss(out, (args, kwargs))
                    del out
                for fn in _grad_fns(loss):
                    _label_graph(fn, "")
                n_forward = len(rec.ops)
                if layout.cp:
                    from symcost.frontends.context_parallel import ring_calls

                    if not ring_calls(reset=True):
                        raise SymcostError(f"--cp: {spec.name}'s attention does not call "
                                           "F.scaled_dot_product_attention, which PyTorch's context parallelism "
                                           "runs as ring attention (an hf: model with --attention sdpa does)")
                rec.phase = "backward"
                with rec, parallel_contexts(), \
                        hide(), loss_context(), cp_contexts(), device_kernels(kernels):
                    loss.backward()
                    del loss
                n_backward = len(rec.ops) - n_forward
                if optimizer is not None:
                    opt = optimizer([p for p in model.parameters() if p.requires_grad])
                    rec.phase = "optimizer"
                    with rec:
                        opt.step()
                events_end = len(rec.events)
        except SymcostError as e:
            e.real_tensors = real
            raise
        except Exception as e:  # noqa: BLE001
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            if "data-dependent" in str(e) or "DataDependent" in type(e).__name__:
                err = SymcostError(
                    f"{spec.name}: control flow depends on tensor values ({type(e).__name__}); symcost "
                    "traces shapes without data, so such models cannot be traced")
            else:
                err = SymcostError(f"running {spec.name} at {values} failed: {type(e).__name__}: {msg}")
            err.real_tensors = real
            raise err from e
        finally:
            h1.remove()
            h2.remove()
            guard.close()
    return Recording(values, rec.ops, params, param_module, saved, layers, rec.events,
                     n_forward, n_backward, precision, tied, buffers, sum(input_storages.values()),
                     events_end, spec.step, kv[0], kv[1], parallel, param_shards,
                     tensor_parallel if parallel != tensor_parallel else None,
                     replicate=layout.replicate, kv_start=list(kv[2]) if len(kv) > 2 else [], no_fold=no_fold,
                     kv_parts=list(kv[3]) if len(kv) > 3 else [], frozen=frozenset(frozen))


def _param_storages(model) -> set[int]:
    """Storages of ``model``'s parameters as they are now (FSDP2's unsharded parameters between
    its all-gather and reshard, a replicated module's weight on the 2-D mesh): a tensor autograd
    saves on one of them (the transposed weight an ``mm`` backward keeps) is a parameter, not an
    activation (shared/conventions.md), as ``saved_tensors_hooks`` measurements count it."""
    # (a DTensor's ``_local_tensor``, not ``to_local()``: an autograd function, run inside the
    # forward it would add edges to the sharded parameters and move FSDP's gradient reduction)
    return {StorageWeakRef(_storage_tensor(getattr(p, "_local_tensor", p)).untyped_storage()).cdata
            for p in model.parameters()}


def _storage_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``t``'s data: a DTensor's local shard (:func:`_local`), and
    inside torchao's float8 wrapper subclasses (FP8 training, symcost.frontends.fp8) the tensor
    they wrap (``WeightWithDynamicFloat8CastTensor._tensor``, ``Float8TrainingTensor._data``): a
    wrapper subclass has no storage of its own, and the temporary one ``untyped_storage()`` gives
    it is freed at once, so its address, taken as a key, could name a later tensor's storage."""
    t = _local(t)
    for attr in ("_tensor", "_data"):
        inner = getattr(t, attr, None)
        if isinstance(inner, torch.Tensor) and type(t).__name__ in _FP8_WRAPPERS:
            return _storage_tensor(inner)
    return t


#: torchao's float8 wrapper subclasses (symcost.frontends.fp8.fp8_tensor_types; by name: torchao is optional)
_FP8_WRAPPERS = ("WeightWithDynamicFloat8CastTensor", "Float8TrainingTensor")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's sharded parameters), else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t
