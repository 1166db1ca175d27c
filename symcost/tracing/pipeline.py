"""One pipeline rank's step run through ``torch.distributed.pipelining`` itself, on PyTorch's fake
process group under ``FakeTensorMode``: the rank's memory over the whole schedule (docs/parallel.md,
"Pipeline parallelism").

The stage modules of the rank (:func:`symcost.frontends.pipeline.make_stage`, at its own block
count) are wrapped in ``PipelineStage`` with their input and output shapes given, and the
schedule (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``) runs ``step`` over m
micro-batches, twice: the first allocates what the engine keeps between steps (its receive
buffers, the gradients); the second is measured. A ``TorchDispatchMode`` follows every storage an
op allocates and when its last tensor dies, as :class:`symcost.tracing.record._Recorder` does
(and FSDP2's in-place storage resizes); no memory is allocated. The transfers complete at once on
the fake backend; a sent tensor is held as long as the schedule holds its work, as a real
backend's work holds it. The last stage keeps each micro-batch's loss, not its output
(``return_outputs=False``, as torchtitan's trainer steps the schedule).
"""
from __future__ import annotations

import contextlib
import math
import weakref
from typing import Any, Mapping

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from symcost.errors import SymcostError
from symcost.frontends.parallel import destroy_world
from symcost.frontends.pipeline import (SCHEDULES, build_blocks, cp_values, local_boundary, make_stage, part_of,
                                       probe_spec, stage_blocks, stage_kind)
from symcost.tracing import grouped_mm
from symcost.tracing.device_kernels import device_kernels
from symcost.tracing.record import _lazy_init, materialize, precision_context
from symcost.tracing.recorder import weak_method


#: process group name -> (mesh symbol, size) of every group a measured step here ran a collective on
_GROUPS: dict[str, tuple] = {}


class _Live(TorchDispatchMode):
    """Bytes of the storages ops allocate while it is active, live at each moment; ``top`` the
    largest level above the level at entry."""

    def __init__(self, groups: Mapping[str, str] | None = None):
        super().__init__()
        self.level = self.top = 0
        self.entries: dict[int, list] = {}
        self.groups = dict(groups or {})
        self.collectives: list[tuple] = []
        # FSDP2's CPU offload (symcost.frontends.offload): bytes each copy op moved, by direction;
        # activation offload's (save_h2d, save_d2h) apart, and the host bytes its packed tensors
        # hold at each moment (``host_level``) and at most (``host_top``)
        self.transfers = {"h2d": 0, "d2h": 0, "save_h2d": 0, "save_d2h": 0}
        self.host_level = self.host_top = 0
        # the finalizers' callbacks, not keeping this mode alive (recorder.weak_method)
        self._free_cb, self._host_free_cb = weak_method(self._free), weak_method(self._host_free)

    def _count(self, func, args, out):
        """A c10d op's group (its symbol in ``groups``, else None), size, and the bytes of its
        tensor arguments and of its outputs in order, appended to ``collectives``."""
        import torch.distributed as dist

        flat = tree_flatten(args)[0]
        pg = next((a for a in flat if isinstance(a, torch.ScriptObject)
                   and a._type().qualified_name().endswith(".ProcessGroup")), None)
        if pg is not None:
            pg = dist.ProcessGroup.unbox(pg)
        else:  # a functional collective (DTensor's): the group by name
            from torch.distributed.distributed_c10d import _resolve_process_group

            name = next((a for a in reversed(flat) if isinstance(a, str)), None)  # (after a reduce op's name)
            if name is None:
                return
            try:
                pg = _resolve_process_group(name)
            except (RuntimeError, ValueError, KeyError):
                # DTensor's caches keep the DeviceMesh of an earlier run in this process whose mesh
                # compares equal (symcost.tracing.record's _MESH_GROUPS): that group, as it was
                if name not in _GROUPS:
                    raise
                sym, n = _GROUPS[name]
                self.collectives.append((str(func.overloadpacket), sym, n, _sizes(flat), _sizes(tree_flatten(out)[0])))
                return
        sym = self.groups.get(pg.group_name) or _GROUPS.get(pg.group_name, (None,))[0]
        self.collectives.append((str(func.overloadpacket), sym, pg.size(),
                                 _sizes(flat), _sizes(tree_flatten(out)[0]), _split_sent(func, args, pg)))
        _GROUPS[pg.group_name] = (sym, pg.size())

    def __enter__(self):
        # FSDP2 frees and allocates an unsharded parameter with ``UntypedStorage.resize_``
        # (torch/distributed/fsdp/_fully_shard/_fsdp_param.py ``free_storage``,
        # ``alloc_storage``), which dispatches no op: followed here, also for storages allocated
        # before (an earlier step's all-gather outputs, resized again each step)
        orig = self._resize = torch.UntypedStorage.resize_
        live = self

        def resize_(storage, size):
            old = storage.nbytes()
            out = orig(storage, size)
            new = storage.nbytes()
            e = live.entries.get(StorageWeakRef(storage).cdata)
            if e is not None:
                e[1] = new
            live.level += new - old
            live.top = max(live.top, live.level)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def _host_free(self, n):
        self.host_level -= n

    def _free(self, key):
        e = self.entries.get(key)
        if e is None:
            return
        e[0] -= 1
        if e[0] == 0:
            del self.entries[key]
            self.level -= e[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            # DTensor runs its op first and hands its local ops (and the collectives its own
            # handlers issue: ``loss_parallel``'s all-reduces) back to this mode, as PyTorch's
            # MemTracker does (torch/distributed/_tools/mem_tracker.py); this mode handling the
            # DTensor op itself would run DTensor's handler with the mode off, unseen
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if func.namespace in ("c10d", "_c10d_functional"):
            self._count(func, args, out)
        if func.namespace == "symcost" and func._opname in self.transfers:
            self.transfers[func._opname] += _nbytes(args[0])
            if func._opname == "d2h":
                return out  # (its output is host memory: a gradient shard's copy, not the device's)
            if func._opname == "save_d2h":  # (a packed saved tensor: host memory until unpacked and freed)
                n = out.untyped_storage().nbytes()
                self.host_level += n
                self.host_top = max(self.host_top, self.host_level)
                weakref.finalize(out, self._host_free_cb, n)
                return out
        ins = set()
        for a in tree_flatten((args, kwargs))[0]:
            if isinstance(a, torch.Tensor):
                try:
                    ins.add(StorageWeakRef(a.untyped_storage()).cdata)
                except (RuntimeError, NotImplementedError):
                    pass
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            key = StorageWeakRef(st).cdata
            e = self.entries.get(key)
            if e is None:
                if key in ins:
                    continue  # a view of (or an in-place op on) a storage from before
                e = self.entries[key] = [0, st.nbytes()]
                self.level += st.nbytes()
                self.top = max(self.top, self.level)
            e[0] += 1
            weakref.finalize(t, self._free_cb, key)
        return out


def rank_memory(spec, values: Mapping[str, int], layers: str, pp: int, schedule: str, microbatches: int,
                rank: int, virtual: int = 1, precision: str = "fp32", inner=None, split=None,
                stacks=None) -> dict[str, Any]:
    """The memory of ``rank``'s steady-state pipeline step at concrete ``values`` (B the
    micro-batch size, L the whole model's blocks).

    ``inner``: the layout's other dimensions (a :class:`~symcost.frontends.layout.Layout`
    without a pipeline: data parallelism, tensor/sequence parallelism, activation
    checkpointing), applied to each stage module as torchtitan's ``parallelize`` applies them
    after ``pipeline_llm`` has split the model: the mesh is ``(pp, dp_*, tp)`` (torchtitan's
    order, pp outermost) on a fake process group of PP·DP·TP ranks, the traced rank is pipeline
    rank ``rank`` at coordinate 0 of the others, and ``PipelineStage`` sends over the mesh's pp
    group. FSDP2 under the pipeline runs as ``PipelineStage`` drives it (gradients reduced once
    per step, after the last micro-batch's backward). ``split``: the blocks of each stage
    (:func:`symcost.frontends.pipeline.stage_blocks`; None: the even split). ``stacks``: the
    stages of a model of several stacks (:func:`symcost.frontends.pipeline_stacks.plan`; ``layers``
    unused): each stage built by :func:`symcost.frontends.pipeline_stacks.make_stage`, its
    ``PipelineStage`` given the tensors that stage receives and sends (the cut stack's hidden
    state and the ended stacks' outputs), the micro-batch's positional inputs given to every stage
    (as ``_in0, _in1, ...``) and the last stage computing the model's loss.

    Returns:
        ``params`` (bytes of the rank's parameters: its shards), ``buffers`` (bytes of its
        stage modules' buffers), ``grads`` (bytes of their
        gradients after a step), ``kept`` (bytes the engine keeps between steps besides them:
        receive buffers), ``top`` (the highest level of storages allocated during the measured
        step, above the level at its start), ``peak`` = params + buffers + grads + kept + top, and
        ``comm``: ``{group symbol: {kind: bytes}}`` each rank sends per step (ring algorithm,
        :func:`symcost.graph.rules.comm_volume`; ``PP``'s ``send`` and ``recv`` the point-to-point
        bytes), counted as the step dispatches the collectives.

        Under FSDP2's CPU offload (``inner.offload``, docs/parallel.md §0.2) the step runs with
        FSDP2's two copies as ops (:func:`symcost.frontends.offload.offload_transfers`): a
        parameter shard's copy to the device before each all-gather is device memory like any
        op's output, a reduced gradient shard's copy to the host is not (left out of the live
        set). ``params`` and ``grads`` are then the device's (0: the shards and their gradients
        live on the host), ``host`` ``{params, grads}`` their host bytes, and ``transfers``
        ``{h2d, d2h}`` the bytes the measured step copied each way.

        Under activation offload (``inner.offload_activations``) the step runs with
        ``save_on_cpu(pin_memory=True)``'s copies as ops
        (:func:`symcost.frontends.offload.save_on_host`): a packed saved tensor is host memory,
        left out of the live set, each unpacked copy the device's; ``activation_offload``
        ``{host, d2h, h2d}``: the most bytes the packed tensors held on the host at once (the
        micro-batches in flight) and the bytes copied each way per step.

    Raises:
        SymcostError: PyTorch refuses the pipeline or the stage does not run.
    """
    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as S
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.stage import InferenceMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    with torch.device("meta"):
        a, k = spec.make_inputs(dict(values), torch.device("meta"))
    # a model called with keyword inputs (transformers': input_ids, labels; its loss computed by
    # the model) runs with them given to every stage, as the traced stages take them
    # (frontends.pipeline.stage_inputs); its last stage returns the model's loss
    keywords = bool(k)
    positional = stacks is not None  # (several stacks: every positional input to every stage)
    if not positional and (len(a) != 1 or k) and not (keywords and not a):
        raise SymcostError(f"{spec.name}: the pipeline peak runs models called with one input tensor or with "
                           "keyword inputs only; this one takes both")
    n = pp * virtual
    blocks = [st.blocks for st in stacks] if positional else stage_blocks(values["L"], n, split)
    mine = [s for s in range(n) if s % pp == rank]
    param_dtype, autocast = precision_context(precision)
    cpu = torch.device("cpu")
    values = dict(values)
    # the boundary as the step of this precision runs it (the deleted modules' outputs in its
    # dtypes: a rotary embedding computes its tables in the embeddings' dtype)
    # (under context parallelism at the rank's S/CP tokens: frontends.pipeline.cp_values)
    if positional:
        from symcost.frontends import pipeline_stacks as ps

        from symcost.tracing.stacks import pipeline_stacks

        pr = ps.probe(spec, values, pipeline_stacks(spec, values), precision)
        pre = post = templates = None
        x_shape, x_dtype = (), None
    else:
        pre, post, templates, x_shape, x_dtype = probe_spec(spec, cp_values(values, bool(inner and inner.cp)), layers,
                                                            precision)
    with torch.device("meta"):
        meta = spec.build(values)
    # (under context parallelism the last stage's output is the rank's S/CP tokens' logits)
    a, k = spec.make_inputs(dict(values, S=values["S"] // int(values["CP"])) if inner and inner.cp else values,
                            torch.device("meta"))
    if not keywords and not positional:
        with torch.no_grad():
            logits = meta(*a, **k)
    models = []
    lead = int(getattr(spec, "lead_blocks", 0) or 0)
    for s in mine:
        # (a stage after the first: the blocks after those of the stages before it, the leading ones
        # it holds included: frontends.pipeline.stage_kind)
        if positional:
            with torch.device("meta"):
                m = ps.make_stage(spec.build(values), pr, stacks[s], n)
            if s == n - 1:
                m.forward = _loss_of_positional(m.forward, spec)
            models.append((s, m))
            continue
        with torch.device("meta"):
            m = build_blocks(spec, dict(values, L=blocks[s]), layers, stage_kind(s, blocks, lead)[1])
        m = make_stage(m, layers, part_of(s, n), pre, post, templates)
        if keywords and s == n - 1:
            m.forward = _loss_of(m.forward, spec)
        models.append((s, m))
    dims, shape = inner.mesh_shape(lambda s: int(values[s])) if inner else ((), ())
    others = math.prod(shape)
    if dims:
        # the composed mesh: this process is global rank 0 of a fake world kept across the
        # pipeline ranks' runs (DTensor's caches keep the DeviceMesh of an earlier run whose mesh
        # compares equal, so its groups must stay alive), placed at pipeline coordinate ``rank``
        if not dist.is_initialized() or dist.get_world_size() != pp * others or dist.get_rank() != 0:
            if dist.is_initialized():
                destroy_world()
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pp * others)
    else:
        if dist.is_initialized():
            destroy_world()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=pp)
    sp = bool(inner and inner.sp)
    offload = bool(inner and inner.offload)
    cp = bool(inner and inner.cp)
    x_local = local_boundary(x_shape, values, sp) if not positional else None
    cls = getattr(S, SCHEDULES[schedule][0])
    try:
        group, loss_context, groups = None, contextlib.nullcontext, {}
        if dims:
            from torch.distributed.device_mesh import DeviceMesh

            ranks = torch.arange(pp * others).reshape((pp,) + shape).roll(rank, dims=0)
            mesh = DeviceMesh("cpu", ranks, mesh_dim_names=("pp",) + dims)
            group = mesh["pp"].get_group()
            sub, groups = inner.engine_meshes(mesh)
            groups[mesh["pp"].get_group().group_name] = "PP"
            for _, m in models:
                if param_dtype != torch.float32:
                    m.to(param_dtype)  # on the meta device, before the parameters become DTensors
                loss_context = inner.parallelize(m, layers, sub, spec.extra.get("dp_engine"))
        elif inner is not None and inner.ac is not None:
            # activation checkpointing alone under the pipeline (no other mesh dimension): each
            # stage's blocks checkpointed as Layout.parallelize does it (it was left out here)
            for _, m in models:
                inner.parallelize(m, layers, {})
        with FakeTensorMode(allow_non_fake_inputs=True):
            mb_args, _ = spec.make_inputs(values, cpu)
            all_args, all_kw = spec.make_inputs(dict(values, B=values["B"] * microbatches), cpu)
            if cp:
                # context parallelism: the step's inputs sharded over the cp mesh before the schedule
                # splits them into micro-batches (torchtitan's train step shards each micro-batch's,
                # the same tokens: the load balancer permutes every sequence alike), so each stage
                # computes on, and sends, the rank's S/CP tokens
                from symcost.frontends.context_parallel import shard_inputs

                all_args, all_kw = shard_inputs(spec, dict(values, B=values["B"] * microbatches),
                                                (all_args, all_kw), sub["CP"])
            mb, tokens = (mb_args[0], all_args[0]) if not keywords else (None, next(iter(all_kw.values())))
            if positional:
                mb = tuple(mb_args)
            if cp and not keywords:  # (the first stage's micro-batch: the rank's S/CP tokens)
                mb = tokens[: values["B"]]
            stages = []
            for s, m in models:
                if dims:
                    m.to_empty(device=cpu)
                    if inner.shard is not None:
                        _lazy_init(m)
                else:
                    materialize(m, cpu, param_dtype)
                # (a later stage's input requires grad: its backward computes the gradient it
                # sends back, as PyTorch's stage does when the input's meta says so)
                if positional:  # (what the stage receives and sends: frontends.pipeline_stacks.boundary_meta)
                    inp = mb if s == 0 else tuple(torch.empty(shape, dtype=dt, requires_grad=True)
                                                  for shape, dt in ps.boundary_meta(pr, stacks[s], "recv"))
                    out = ((torch.empty((), dtype=torch.float32, requires_grad=True),) if s == n - 1 else
                           tuple(torch.empty(shape, dtype=dt, requires_grad=True)
                                 for shape, dt in ps.boundary_meta(pr, stacks[s], "send")))
                    stages.append(PipelineStage(m, s, n, cpu, input_args=inp, output_args=out, group=group))
                    continue
                inp = (() if keywords else (mb,)) if s == 0 else (torch.empty(x_local, dtype=x_dtype, requires_grad=True),)
                if s == n - 1 and keywords:  # (the model's own loss: a 0-dim fp32 tensor)
                    last = torch.empty((), dtype=torch.float32, requires_grad=True)
                elif s == n - 1:
                    last = torch.empty(logits.shape, dtype=logits.dtype if param_dtype == torch.float32 else param_dtype,
                                       requires_grad=True)
                out = (last if s == n - 1 else torch.empty(x_local, dtype=x_dtype, requires_grad=True),)
                stages.append(PipelineStage(m, s, n, cpu, input_args=inp, output_args=out, group=group))
            if dims:
                # (this process is pipeline rank ``rank`` of the rolled mesh; the pp group's own rank
                # order is the sorted global ranks, where it is 0: a multi-stage schedule picks its
                # actions by the stage's group rank, so it is set to the rank the mesh places it at)
                for st in stages:
                    st.group_rank = rank
            sched = cls(stages if SCHEDULES[schedule][1] else stages[0], microbatches,
                        loss_fn=(lambda out, target: out) if keywords or positional
                        else (lambda out, target: spec.loss(out, ((target,), {}))))

            def static(sts, has_backward, p2p_done):  # the shape vote reads tensor values
                for st in sts:
                    st._inference_mode = InferenceMode.STATIC
            sched._warmup_p2p = static

            record_context = spec.record_context or contextlib.nullcontext
            if cp:  # PyTorch's CP dispatcher around the schedule's step (torchtitan's train_context)
                from symcost.frontends.context_parallel import enabled as cp_enabled
            if offload:  # FSDP2's CPU offload: its two copies as ops (symcost.frontends.offload)
                from symcost.frontends.offload import offload_transfers
            hooks = (_same, _same)
            if inner is not None and inner.offload_activations:
                # activation offload: save_on_cpu(pin_memory=True)'s copies as ops (the packed
                # tensors are host memory, each unpacked copy the device's)
                from symcost.frontends.offload import save_on_host

                hooks = save_on_host()

            def step():
                # (the model's own recording context: transformers' mask decisions as the real
                # step makes them, frontends.hf.unpacked_masks; without it fake tensors build a
                # (B, 1, S, S) mask and SDPA falls back to its math kernel)
                # (identity saved-tensor hooks: autograd then holds each saved tensor's Python
                # object, so a saved output whose other references die stays followed by _Live
                # until the backward frees it, as its storage does; without them autograd keeps
                # the output's data only and _Live would count it freed)
                # (grouped_mm.kernels: transformers' experts' fp32 grouped GEMMs, which the meta kernel refuses)
                # (CP's dispatcher before --torch-device's kernels, as the recorder enters them:
                # PyTorch's monkey patch replaces F's function by the patched one's own name)
                with autocast(), loss_context(), record_context(), \
                        (cp_enabled(sub["CP"], inner.cp_rotate) if cp else contextlib.nullcontext()), \
                        device_kernels(spec.extra.get("torch_device")), \
                        grouped_mm.kernels(), _sends_held(S), torch.autograd.graph.saved_tensors_hooks(*hooks), \
                        (offload_transfers() if offload else contextlib.nullcontext()):
                    first = (tokens,) if 0 in mine and not keywords else ()
                    target = {"target": tokens} if (n - 1) in mine else {}
                    if positional:  # (every positional input to every stage; stage 0 takes them as its call)
                        first = tuple(all_args) if 0 in mine else ()
                        sched.step(*first, **{f"_in{i}": t for i, t in enumerate(all_args)}, **target,
                                   return_outputs=False)
                        return
                    # the last stage keeps each micro-batch's loss, not its output (the logits):
                    # torchtitan's trainer calls ``step(..., return_outputs=False)``, and
                    # Megatron-LM's schedule frees the output after the loss
                    sched.step(*first, **(all_kw if keywords else {"_in0": tokens}), **target,
                               return_outputs=False)

            params = sum(_nbytes(p) for _, m in models for p in m.parameters())
            # (the stage modules' buffers: a rotary embedding's tables, kept on every stage as
            # torchtitan's pipeline_llm keeps the root's freqs_cis)
            buffers = sum(_nbytes(b) for _, m in models for b in m.buffers())
            with _Live() as warm:
                step()
            with _Live(groups) as live:
                step()
            if cp:
                from symcost.frontends.context_parallel import ring_calls

                if not ring_calls(reset=True):  # (the attention ran as one device's: not the step asked for)
                    raise SymcostError(f"--cp: {spec.name}'s attention did not run as ring attention in the "
                                       "pipeline step (it does not call F.scaled_dot_product_attention)")
            grads = sum(_nbytes(p.grad) for _, m in models for p in m.parameters() if p.grad is not None)
    except SymcostError:
        raise
    except Exception as e:  # noqa: BLE001
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SymcostError(f"running rank {rank} of the {schedule} pipeline failed: {msg}") from e
    finally:
        if not dims:
            destroy_world()
    host = {}
    if inner is not None and inner.offload_activations:
        host["activation_offload"] = {"host": live.host_top, "d2h": live.transfers["save_d2h"],
                                      "h2d": live.transfers["save_h2d"]}
    if offload:
        # FSDP2's CPU offload: the parameter shards and their gradients live on the host (the
        # gradient copies were left out of the live set); the device holds neither between steps
        host.update({"host": {"params": params, "grads": grads},
                     "transfers": {k: live.transfers[k] for k in ("h2d", "d2h")}})
        params = grads = 0
    kept = warm.level - grads
    return {"params": params, "buffers": buffers, "grads": grads, "kept": kept, "top": live.top,
            "peak": params + buffers + grads + kept + live.top, "collectives": live.collectives, **host}


def _same(t):
    return t


def _split_sent(func, args, pg):
    """The bytes this rank sends in an ``all_to_all_single`` (``(input, output_split_sizes,
    input_split_sizes, group)``) that keeps none of its input, its own input split 0 (ring
    attention's ``permute_tensor``, which passes the whole input to the next rank): the whole
    input, as :func:`symcost.graph.rules.comm_volume` counts it (``_keeps_nothing``); None for any
    other collective (the ring factor of its kind applies,
    :func:`symcost.passes.pipeline.comm_by_group`)."""
    import torch.distributed as dist

    if str(func.overloadpacket) != "_c10d_functional.all_to_all_single" or len(args) < 3:
        return None
    splits = list(args[2] or ())
    if len(splits) < 2 or int(splits[dist.get_rank(pg)]) != 0:
        return None
    return _nbytes(args[0])


class _Works(list):
    """The works of one batch of point-to-point ops, holding the tensors they send."""


@contextlib.contextmanager
def _sends_held(schedules):
    """A send's tensor lives as long as the schedule holds its work, as a real backend's work
    holds its tensors (gloo's send work keeps the tensor it sends, NCCL's work keeps its tensors
    until its completion is observed): the schedule waits a batch of sends one micro-batch later
    (``Schedule1F1B``: "Clear previous chunk's forward sends"; ``PipelineScheduleMulti`` keeps
    ``send_ops`` until its next wait) and drops the works then. The fake backend's works hold
    nothing, so without this a gradient sent back would be freed at once."""
    import torch.distributed as dist

    orig = schedules._batch_p2p

    def batch(p2p_ops, desc=None):
        works = _Works(orig(p2p_ops, desc=desc))
        works.tensors = [op.tensor for op in p2p_ops if op.op is dist.isend]
        return works

    schedules._batch_p2p = batch
    try:
        yield
    finally:
        schedules._batch_p2p = orig


def _loss_of(forward, spec):
    """The last stage's forward of a model that computes its own loss (keyword inputs, e.g.
    transformers' ``labels``): ``spec.loss`` of its output (the model's loss, a 0-dim tensor)."""
    def run(*args, **kwargs):
        return spec.loss(forward(*args, **kwargs), (args, kwargs))
    return run


def _loss_of_positional(forward, spec):
    """The last stage's forward of a model of several stacks (:mod:`symcost.frontends.pipeline_stacks`):
    ``spec.loss`` of its output with the micro-batch's positional inputs (given as ``_in0, ...``)."""
    def run(*args, **kwargs):
        pos = sorted((k for k in kwargs if k.startswith("_in") and k[3:].isdigit()), key=lambda k: int(k[3:]))
        return spec.loss(forward(*args, **kwargs), (tuple(kwargs[k] for k in pos), {}))
    return run


def _sizes(flat) -> list[int]:
    return [_nbytes(t) for t in flat if isinstance(t, torch.Tensor)]


def _nbytes(t) -> int:
    """Bytes of ``t`` on this rank (a DTensor's local shard)."""
    t = getattr(t, "_local_tensor", t)
    return t.numel() * t.element_size()
