"""One pipeline rank's step run through ``torch.distributed.pipelining`` itself, on PyTorch's fake
process group under ``FakeTensorMode``: the rank's memory over the whole schedule (docs/parallel.md,
"Pipeline parallelism").

The stage modules of the rank (:func:`symcost.frontends.pipeline.make_stage`, at its own block
count) are wrapped in ``PipelineStage`` with their input and output shapes given, and the
schedule (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``) runs ``step`` over m
micro-batches, twice: the first allocates what the engine keeps between steps (its receive
buffers, the gradients); the second is measured. A ``TorchDispatchMode`` follows every storage an
op allocates and when its last tensor dies, as :class:`symcost.tracing.record._Recorder` does;
no memory is allocated. The transfers complete at once on the fake backend (a real one may keep
a send buffer a little longer).
"""
from __future__ import annotations

import weakref
from typing import Any, Mapping

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from symcost.errors import SymcostError
from symcost.frontends.pipeline import SCHEDULES, make_stage, part_of, probe_spec, stage_blocks
from symcost.tracing.record import materialize, precision_context


class _Live(TorchDispatchMode):
    """Bytes of the storages ops allocate while it is active, live at each moment; ``top`` the
    largest level above the level at entry."""

    def __init__(self):
        super().__init__()
        self.level = self.top = 0
        self.entries: dict[int, list] = {}

    def _free(self, key):
        e = self.entries.get(key)
        if e is None:
            return
        e[0] -= 1
        if e[0] == 0:
            del self.entries[key]
            self.level -= e[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
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
            weakref.finalize(t, self._free, key)
        return out


def rank_memory(spec, values: Mapping[str, int], layers: str, pp: int, schedule: str, microbatches: int,
                rank: int, virtual: int = 1, precision: str = "fp32") -> dict[str, Any]:
    """The memory of ``rank``'s steady-state pipeline step at concrete ``values`` (B the
    micro-batch size, L the whole model's blocks).

    Returns:
        ``params`` (bytes of the rank's parameters), ``grads`` (bytes of their gradients after a
        step), ``kept`` (bytes the engine keeps between steps besides them: receive buffers),
        ``top`` (the highest level of storages allocated during the measured step, above the
        level at its start) and ``peak`` = params + grads + kept + top.

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
    if len(a) != 1 or k:
        raise SymcostError(f"{spec.name}: the pipeline peak runs models called with one input tensor "
                           "(the built-in models); this one takes keyword inputs")
    n = pp * virtual
    blocks = stage_blocks(values["L"], n)
    mine = [s for s in range(n) if s % pp == rank]
    param_dtype, autocast = precision_context(precision)
    cpu = torch.device("cpu")
    values = dict(values)
    # the boundary as the step of this precision runs it (the deleted modules' outputs in its
    # dtypes: a rotary embedding computes its tables in the embeddings' dtype)
    pre, post, templates, x_shape, x_dtype = probe_spec(spec, values, layers, precision)
    with torch.device("meta"):
        meta = spec.build(values)
    a, k = spec.make_inputs(values, torch.device("meta"))
    with torch.no_grad():
        logits = meta(*a, **k)
    models = []
    for s in mine:
        with torch.device("meta"):
            m = spec.build(dict(values, L=blocks[s]))
        models.append((s, make_stage(m, layers, part_of(s, n), pre, post, templates)))
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=pp)
    cls = getattr(S, SCHEDULES[schedule][0])
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            (mb,), _ = spec.make_inputs(values, cpu)
            (tokens,), _ = spec.make_inputs(dict(values, B=values["B"] * microbatches), cpu)
            stages = []
            for s, m in models:
                materialize(m, cpu, param_dtype)
                inp = (mb,) if s == 0 else (torch.empty(x_shape, dtype=x_dtype),)
                out = (torch.empty(logits.shape, dtype=logits.dtype if param_dtype == torch.float32 else param_dtype,
                                   requires_grad=True) if s == n - 1
                       else torch.empty(x_shape, dtype=x_dtype, requires_grad=True),)
                stages.append(PipelineStage(m, s, n, cpu, input_args=inp, output_args=out))
            sched = cls(stages if SCHEDULES[schedule][1] else stages[0], microbatches,
                        loss_fn=lambda out, target: spec.loss(out, ((target,), {})))

            def static(sts, has_backward, p2p_done):  # the shape vote reads tensor values
                for st in sts:
                    st._inference_mode = InferenceMode.STATIC
            sched._warmup_p2p = static

            def step():
                with autocast():
                    first = (tokens,) if 0 in mine else ()
                    target = {"target": tokens} if (n - 1) in mine else {}
                    sched.step(*first, _in0=tokens, **target)

            params = sum(p.numel() * p.element_size() for _, m in models for p in m.parameters())
            with _Live() as warm:
                step()
            with _Live() as live:
                step()
            grads = sum(p.grad.numel() * p.grad.element_size() for _, m in models for p in m.parameters()
                        if p.grad is not None)
    except SymcostError:
        raise
    except Exception as e:  # noqa: BLE001
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SymcostError(f"running rank {rank} of the {schedule} pipeline failed: {msg}") from e
    finally:
        dist.destroy_process_group()
    kept = warm.level - grads
    return {"params": params, "grads": grads, "kept": kept, "top": live.top,
            "peak": params + grads + kept + live.top}
