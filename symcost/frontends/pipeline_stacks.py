"""Pipeline stages of a model with several stacks of blocks (an encoder-decoder's encoder and
decoder; docs/parallel.md §1.1 and "Pipeline parallelism", "Several stacks").

The stacks' blocks, in the order the forward runs them (encoder blocks, then decoder blocks), make
one sequence of ``L_enc + L_dec`` blocks, which the pipeline cuts into ``PP`` stages by the split
rule of one block list (:func:`symcost.frontends.pipeline.stage_blocks`: even, L // n each, the
first L mod n stages one more; ``torchtitan``; or given per stage). A stage is the model with the
blocks of other stages deleted, as for one block list (:mod:`symcost.frontends.pipeline`), and
what crosses a stage boundary is:

* the hidden state of the stack the boundary cuts (the next block's input: ``[B, S_enc, d]`` in
  the encoder, ``[B, S, d]`` in the decoder), and
* the output of every stack that has ended before the boundary (the encoder's output, the
  ``memory`` every decoder block's cross-attention reads), carried through every later stage: a
  decoder stage receives it, uses it and sends it on, and its gradient (its own blocks'
  cross-attention's plus the next stage's) goes back the same way.

This is what Megatron-LM's schedules send for an encoder-decoder (megatron/core/pipeline_parallel/
schedules.py ``get_tensor_shapes``: a stage after the split carries ``(decoder_seq_length, mbs,
hidden)`` and ``(seq_length, mbs, hidden)``, the encoder's output), and what a manual
``torch.distributed.pipelining.PipelineStage`` with several inputs and outputs runs. Megatron cuts
at a stage given by ``--pipeline-model-parallel-split-rank`` (encoder stages before it, decoder
stages from it, never both in one stage); here the cut is over the concatenated blocks, so a stage
may end the encoder and start the decoder (where the split falls at the stacks' boundary the two
are the same). A stage that holds a stack's last block also runs what follows it inside that
stack's module (the encoder's final norm) and sends the stack's output; the modules between two
stacks (the decoder's token embedding) belong to the stage that holds the next stack's first block
(Megatron's split rank holds the decoder's embedding the same way: a copy of a shared table).

A module the model calls several times (a table shared by encoder and decoder) is held by each
stage that makes one of its calls, and each of its calls outside the stage returns an empty tensor
of that call's shape (no parameters where the stage makes none of them).

Not here yet: keyword-input models (``hf:`` T5, BART, Whisper: their stacks' masks and T5's
position bias, computed in block 0 of each stack, would cross the boundaries too), the other mesh
dimensions (``--dp``, ``--tp``, ``--ac``), interleaved schedules (one stage per rank).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from symcost.frontends.pipeline import _peers, _recv_fn, _StageOut, fake_step, send_output, stage_blocks


@dataclasses.dataclass(frozen=True)
class StackStage:
    """Stage ``index`` of a pipeline over several stacks: ``held`` {container: (first, stop)} the
    blocks of each stack it holds (only stacks with blocks here), ``recv`` and ``send`` what
    crosses its boundaries (``"x"``: the hidden state of the stack cut there; ``"mem:<container>"``:
    the output of that stack, which has ended), ``part`` first/middle/last."""

    index: int
    held: tuple
    recv: tuple
    send: tuple
    part: str

    @property
    def blocks(self) -> int:
        return sum(b - a for _, (a, b) in self.held)


def refusal(spec, values: Mapping[str, int], containers, inner=None, virtual: int = 1) -> str | None:
    """Why ``--pp`` on this model of several stacks (``containers``: their block containers,
    :func:`symcost.tracing.stacks.pipeline_stacks`) is not staged here (one line), or None."""
    a, k = _inputs_meta(spec, values)
    what = []
    if k:
        what.append("keyword inputs (its stacks' masks, T5's position bias from each stack's block 0, would cross "
                    "the stage boundaries too)")
    if inner is not None and (inner.traced_dims or inner.ac is not None or getattr(inner, "offload", False)):
        what.append("another mesh dimension or --ac beside --pp")
    if virtual > 1:
        what.append("interleaved stages")
    if not what:
        return None
    return (f"--pp: {spec.name} has several stacks of blocks ({', '.join(containers)}); symcost stages them "
            f"(encoder then decoder blocks cut as one list, the encoder's output carried) for a model called with "
            f"positional tensors and --pp alone, not yet with {' or '.join(what)}; accepted for this model: --dp "
            "(any --shard), --ac, --tp where its blocks have a plan")


def _inputs_meta(spec, values):
    import torch

    with torch.device("meta"):
        return spec.make_inputs(dict(values), torch.device("meta"))


@dataclasses.dataclass
class Probe:
    """One forward of the whole model at some sizes (fake tensors, the step's precision): the
    stacks in forward order, each stack's blocks' first-input shape and dtype, each stack
    module's output template and call interval, and each candidate module's calls (time, output)."""

    order: list
    lengths: dict
    stack_module: dict
    block_in: dict
    block_end: dict
    stack_span: dict
    stack_out: dict
    calls: dict


def _first_tensor(value):
    import torch
    from torch.utils._pytree import tree_flatten

    return next((t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)), None)


def _stack_modules(model, containers) -> dict[str, str]:
    """{container: its stack module}: the outermost ancestor of the container (itself included, the
    root excluded) that holds no other container (T5's ``encoder`` for ``encoder.block``; the
    guide's ``encoder`` for itself)."""
    out = {}
    for c in containers:
        parts = c.split(".")
        best = c
        for k in range(len(parts) - 1, 0, -1):
            anc = ".".join(parts[:k])
            if any(o != c and (o == anc or o.startswith(anc + ".")) for o in containers):
                break
            best = anc
        out[c] = best
    return out


def _candidates(model, containers, stack_mods) -> dict[str, Any]:
    """The modules with parameters outside every stack module, children of the stacks' ancestors,
    and the stack modules' own children outside their containers (an encoder's final norm)."""
    from symcost.frontends.pipeline import _split_points

    inside = set(containers) | set(stack_mods.values())
    cands = {}
    for c in containers:
        for name, mod in _split_points(model, c)[1].items():
            if any(name == o or o.startswith(name + ".") for o in inside):
                continue  # (an ancestor of a container or a stack module: not one module to delete)
            cands[name] = mod
    return cands


def probe(spec, values: Mapping[str, int], containers, precision: str = "fp32") -> Probe:
    """:class:`Probe` of ``spec``'s step at ``values`` as the step of ``precision`` runs it (as
    :func:`symcost.frontends.pipeline.probe_spec`)."""
    import contextlib

    import torch

    context = spec.record_context or contextlib.nullcontext
    clock = [0]
    calls: dict[str, list] = {}
    block_in, block_end, span, out_t = {}, {}, {}, {}

    def tick():
        clock[0] += 1
        return clock[0]

    hooks = []
    with fake_step(spec, values, precision) as (m, a, k, autocast):
        stack_mods = _stack_modules(m, containers)
        cands = _candidates(m, containers, stack_mods)
        for name, mod in cands.items():
            hooks.append(mod.register_forward_hook(
                lambda mod, i, o, name=name: calls.setdefault(name, []).append((tick(), o))))
        lengths = {}
        for c in containers:
            blocks = list(m.get_submodule(c).children())
            lengths[c] = len(blocks)
            for i, b in enumerate(blocks):
                def pre(mod, args, kwargs, c=c, i=i):
                    t = _first_tensor(args) if args else kwargs.get("hidden_states")
                    block_in.setdefault((c, i), (tuple(t.shape), t.dtype))
                    tick()

                def post(mod, args, out, c=c, i=i):
                    block_end[(c, i)] = tick()
                hooks.append(b.register_forward_pre_hook(pre, with_kwargs=True))
                hooks.append(b.register_forward_hook(post))
            sm = m.get_submodule(stack_mods[c])

            def spre(mod, args, c=c):
                span[c] = [tick(), None]

            def spost(mod, args, out, c=c):
                span[c][1] = tick()
                out_t[c] = out
            hooks.append(sm.register_forward_pre_hook(spre))
            hooks.append(sm.register_forward_hook(spost))
        try:
            with torch.no_grad(), context(), autocast():
                m(*a, **k)
        finally:
            for h in hooks:
                h.remove()
    order = sorted(containers, key=lambda c: span[c][0])
    return Probe(order, lengths, stack_mods, block_in, block_end, span, out_t, calls)


def plan(lengths: Mapping[str, int], order, n: int, split=None) -> list[StackStage]:
    """The ``n`` stages of the blocks of the stacks ``order`` (forward order, ``lengths`` blocks
    each) cut as one list of Σ lengths blocks by :func:`symcost.frontends.pipeline.stage_blocks`
    (``split``): each stage's blocks per stack and what crosses its boundaries (:class:`StackStage`).

    Raises:
        SymcostError: fewer blocks than stages, a split that does not fit (stage_blocks')."""
    from symcost.frontends.pipeline import part_of

    flat = [(c, i) for c in order for i in range(int(lengths[c]))]
    per = stage_blocks(len(flat), n, split)
    starts = [sum(per[:s]) for s in range(n)]
    stages = []
    for s in range(n):
        mine = flat[starts[s]: starts[s] + per[s]]
        held = {}
        for c, i in mine:
            a, _ = held.get(c, (i, i))
            held[c] = (a, i + 1)
        recv: list[str] = []
        if s:
            c0, i0 = mine[0]
            if i0 > 0:
                recv.append("x")
            # (every stack ended before the stage: its output, carried)
            recv += [f"mem:{c}" for c in order[: order.index(c0)]]
        stages.append([s, tuple(held.items()), tuple(recv), part_of(s, n)])
    out = []
    for s in range(n):
        send = tuple(stages[s + 1][2]) if s < n - 1 else ()
        out.append(StackStage(stages[s][0], stages[s][1], stages[s][2], send, stages[s][3]))
    return out


def _absent(templates):
    """A module deleted from this stage: no parameters; its k-th call returns empty tensors of the
    shapes and dtypes of the deleted module's k-th call in the whole model."""
    import torch
    from torch import nn
    from torch.utils._pytree import tree_map

    class Absent(nn.Module):
        def __init__(self):
            super().__init__()
            self.templates = templates
            self.calls = 0

        def forward(self, *args, **kwargs):
            k = min(self.calls, len(self.templates) - 1)
            self.calls += 1
            dev = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
            return tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device=dev)
                            if isinstance(t, torch.Tensor) else t, self.templates[k])

    return Absent()


def make_stage(model, pr: Probe, stage: StackStage, n: int, p2p: bool = False):
    """Turn ``model`` (built whole at the probe's sizes) into stage ``stage`` of ``n``, in place:
    the other stages' blocks deleted from each container, the modules none of whose calls fall in
    the stage deleted (:func:`_absent`), a stack that has ended before the stage replaced by a
    stand-in returning the received output, the received hidden state put in place of the first
    block's input, the forward stopped after the stage's last block (or, where that block ends its
    stack and the next stage starts the next stack, after the stack's module). Returns the model,
    whose forward is ``forward(*received, **inputs)`` (a later stage: the micro-batch's positional
    inputs as ``_in0, _in1, ...``) and returns the tensors :attr:`StackStage.send` names (a tuple;
    one tensor alone as it is), the model's output on the last stage.

    ``p2p``: the received tensors pass through ``torch.distributed.recv`` and the sent ones through
    :func:`symcost.frontends.pipeline.send_output` (symcost's recording on the fake process group)."""
    import torch
    from torch import nn
    from torch.utils._pytree import tree_flatten, tree_unflatten

    held = dict(stage.held)
    order = pr.order
    first_c = next(c for c in order if c in held)
    last_c = [c for c in order if c in held][-1]
    first_i, last_i = held[first_c][0], held[last_c][1] - 1
    start = -math.inf if stage.index == 0 else _start(pr, first_c, first_i)
    ends_stack = last_i == pr.lengths[last_c] - 1 and last_c != order[-1]
    end = (math.inf if stage.part == "last"
           else pr.stack_span[last_c][1] if ends_stack else pr.block_end[(last_c, last_i)])
    state: dict[str, Any] = {"mem": {}}
    model.symcost_stage = stage.part
    # the blocks of the other stages deleted
    for c in order:
        parent, _, attr = c.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        box = getattr(owner, attr)
        a, b = held.get(c, (0, 0))
        if isinstance(box, nn.ModuleDict):  # (keyed 0..n-1: the stage's keys kept)
            kept = nn.ModuleDict(dict(list(box.items())[a:b]))
        elif isinstance(box, nn.Sequential):
            kept = nn.Sequential(*list(box.children())[a:b])
        else:
            kept = nn.ModuleList(list(box.children())[a:b])
        setattr(owner, attr, kept)
    # stacks that ended before the stage: stand-ins returning the received output
    ended = [c for c in order if pr.stack_span[c][1] <= start]
    for c in ended:
        name = pr.stack_module[c]
        flat, spec_ = tree_flatten(pr.stack_out[c])
        k = next(j for j, t in enumerate(flat) if isinstance(t, torch.Tensor))

        def stand_in(*args, c=c, flat=flat, spec_=spec_, k=k, **kwargs):
            got = state["recv"][f"mem:{c}"]
            out = [torch.empty(t.shape, dtype=t.dtype, device=got.device) if isinstance(t, torch.Tensor) else t
                   for t in flat]
            out[k] = got
            return tree_unflatten(out, spec_)

        mod = _Fn(stand_in)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, mod)
    # the candidate modules: deleted where none of their calls is the stage's, else each call
    # outside the stage answered by its template
    counters: list = []
    for name, calls in pr.calls.items():
        if any(name == pr.stack_module[c] or name.startswith(pr.stack_module[c] + ".") for c in ended):
            continue  # (inside a stand-in: gone with it)
        mine = [start < t <= end for t, _ in calls]
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        if not any(mine):
            mod = _absent([o for _, o in calls])
            setattr(owner, attr, mod)
            counters.append(mod)
        elif not all(mine):
            mod = getattr(owner, attr)
            absent = _absent([o for _, o in calls])
            counters.append(absent)
            real = mod.forward

            def partial(*args, real=real, mine=mine, absent=absent, **kwargs):
                k = absent.calls
                if k < len(mine) and mine[k]:
                    absent.calls += 1
                    return real(*args, **kwargs)
                return absent(*args, **kwargs)
            mod.forward = partial
    recv_names = stage.recv

    def capture(c):
        def hook(mod, args, out):
            state["mem"][c] = _first_tensor(out)
        return hook

    def swap(mod, args, kwargs):
        x = state.pop("x", None)
        if x is None:
            return None
        if args:
            a0 = args[0]
            if isinstance(a0, torch.Tensor):
                return (x,) + tuple(args[1:]), kwargs
            a0 = list(a0)
            a0[0] = x
            return (type(args[0])(a0),) + tuple(args[1:]), kwargs
        return args, dict(kwargs, hidden_states=x)

    def stop(mod, args, out):
        raise _StageOut(out)

    def hooks():
        if "hooked" in state:
            return
        state["hooked"] = True
        for c in order:
            if c not in ended:
                model.get_submodule(pr.stack_module[c]).register_forward_hook(capture(c))
        if "x" in recv_names:
            list(model.get_submodule(first_c).children())[0].register_forward_pre_hook(swap, with_kwargs=True)
        if stage.part != "last":
            where = (model.get_submodule(pr.stack_module[last_c]) if ends_stack
                     else list(model.get_submodule(last_c).children())[-1])
            where.register_forward_hook(stop)

    inner = model.forward

    def forward(*args, **kwargs):
        hooks()
        for mod in counters:
            mod.calls = 0
        state["mem"] = {}
        if stage.index:
            got, args = args[: len(recv_names)], args[len(recv_names):]
            if p2p:
                got = tuple(_recv_fn().apply(t) for t in got)
            state["recv"] = dict(zip(recv_names, got))
            if "x" in state["recv"]:
                state["x"] = state["recv"]["x"]
            pos = sorted((k for k in kwargs if k.startswith("_in") and k[3:].isdigit()), key=lambda k: int(k[3:]))
            args = tuple(args) + tuple(kwargs.pop(k) for k in pos)
        else:
            kwargs = {k: v for k, v in kwargs.items() if not (k.startswith("_in") and k[3:].isdigit())}
        try:
            out = inner(*args, **kwargs)
        except _StageOut as e:
            sent = []
            for name in stage.send:
                if name == "x":
                    sent.append(_first_tensor(e.value))
                else:
                    c = name[4:]
                    sent.append(state["mem"][c] if c in state["mem"] else state["recv"][name])
            return sent[0] if len(sent) == 1 else tuple(sent)
        return out

    model.forward = forward
    return model


def _start(pr: Probe, c: str, i: int) -> float:
    """The time the stage starting at block ``i`` of stack ``c`` starts after: the end of block
    i − 1, or, at a stack's first block, the end of the stack before it."""
    if i > 0:
        return pr.block_end[(c, i - 1)]
    k = pr.order.index(c)
    return pr.stack_span[pr.order[k - 1]][1] if k else -math.inf


def _Fn(fn):
    """A parameter-free module calling ``fn``."""
    from torch import nn

    class Fn(nn.Module):
        def forward(self, *args, **kwargs):
            return fn(*args, **kwargs)

    return Fn()


def boundary_meta(pr: Probe, stage: StackStage, which: str) -> list[tuple]:
    """(shape, dtype) of the tensors ``stage`` receives (``which="recv"``) or sends (``"send"``),
    in :attr:`StackStage.recv`/``send`` order."""
    names = stage.recv if which == "recv" else stage.send
    held = dict(stage.held)
    if which == "recv":
        c = next(c for c in pr.order if c in held)
        i = held[c][0]
    else:
        c = [c for c in pr.order if c in held][-1]
        i = held[c][1]  # (the next block's input)
    out = []
    for name in names:
        if name == "x":
            out.append(pr.block_in[(c, i)])
        else:
            t = _first_tensor(pr.stack_out[name[4:]])
            out.append((tuple(t.shape), t.dtype))
    return out


def stage_spec(spec, stage: StackStage, n: int, request: Mapping[str, int], containers, stack_symbols,
               p2p: bool = True, precision: str = "fp32", probes: dict | None = None):
    """The :class:`~symcost.frontends.spec.ModelSpec` of stage ``stage`` of ``n`` for one
    micro-batch. The stacks' lengths (``stack_symbols``) are pinned at ``request``'s values, with
    the reason: the stage holds blocks of a stack given by the cut of the concatenated blocks at
    those lengths, a range that moves with every length (the other symbols stay free)."""
    probes = {} if probes is None else probes

    def pr_at(values):
        key = tuple(sorted(values.items()))
        if key not in probes:
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                probes[key] = probe(spec, values, containers, precision)
        return probes[key]

    def build(values):
        pr = pr_at(values)
        model = spec.build(values)
        if p2p:
            _peers()
        return make_stage(model, pr, stage, n, p2p=p2p)

    def make_inputs(values, device):
        import torch

        args, kwargs = spec.make_inputs(values, device)
        if stage.index == 0:
            return args, kwargs
        got = tuple(torch.empty(shape, dtype=dtype, device=device, requires_grad=True)
                    for shape, dtype in boundary_meta(pr_at(values), stage, "recv"))
        return got, {**{f"_in{i}": a for i, a in enumerate(args)}, **kwargs}

    def loss(out, inputs):
        if stage.part != "last":
            return send_output(out) if p2p else sum(t.sum() for t in (out if isinstance(out, tuple) else (out,)))
        args, kwargs = inputs
        if stage.index == 0:
            return spec.loss(out, inputs)
        kw = dict(kwargs)
        pos = sorted((k for k in kw if k.startswith("_in") and k[3:].isdigit()), key=lambda k: int(k[3:]))
        return spec.loss(out, (tuple(kw.pop(k) for k in pos), kw))

    held = ", ".join(f"{c}[{a}:{b}]" for c, (a, b) in stage.held)
    why = (f"pipeline stage {stage.index} holds {held} of the blocks cut as one list at these stack lengths "
           "(a range that moves with each length: traced at the request's)")
    pins = {s: why for s in stack_symbols}
    return dataclasses.replace(spec, name=f"{spec.name}[pp:stage{stage.index}]", build=build, make_inputs=make_inputs,
                               loss=loss, extra={**spec.extra, "pipeline_stage": stage.part},
                               pin={**dict(spec.pin or {}), **pins})
