"""Pipeline-parallel training of a :class:`ModelSpec`: the stage split of the block list and the
schedules of ``torch.distributed.pipelining`` (docs/parallel.md, "Pipeline parallelism"; the schedules
themselves in :mod:`symcost.frontends.pipeline_schedule`, re-exported here).

A pipeline of ``PP`` ranks splits the L blocks into ``PP`` stages (``PP·v`` with ``v`` virtual
stages per rank for the interleaved schedule) of L/(PP·v) blocks each. A stage module is the
model with the other blocks deleted, as torchtitan's ``pipeline_llm`` builds it
(torchtitan/distributed/pipeline_parallel.py): the first stage keeps what runs before the blocks
(the embeddings), the last what runs after them (final norm, head; the loss is its ``loss_fn``),
a middle stage only its blocks. Here the deletion is generic (no model code changes):

* the modules with parameters that the model calls before its first block (``pre``) and after
  its last (``post``) are found by one forward on the meta device;
* on a stage that does not own them they are replaced by :class:`Absent` (no parameters; it
  returns empty tensors of the shapes and dtypes the module returned in a step of the traced
  precision, so what the model computes from the micro-batch's inputs before its blocks, e.g. a
  causal mask, positions or a rotary embedding's cos/sin in the embeddings' dtype, still runs as
  in the whole model, as torchtitan's stages recompute their rotary tables and masks);
* a stage after the first takes the activation received from the previous stage and puts it
  in place of its first block's input (a forward pre-hook); a stage before the last returns its
  last block's output (a forward hook ends the model's forward there).

The schedules are PyTorch's own (:func:`schedule_order`): their per-rank action lists
(``pipeline_order``: F, B, I, W actions per micro-batch and stage) are read from the schedule
objects built on a fake process group of ``PP`` ranks.

Torch is imported only inside the functions that need it.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Mapping

from symcost.errors import SymcostError
from symcost.frontends.pipeline_schedule import (  # noqa: F401  (re-exported: the schedules)
    SCHEDULES, _executed, _fake_pg, check_schedule, schedule_order, simulate,
)

#: the three kinds of stage module
PARTS = ("first", "middle", "last")


#: ``--pp-split`` words: ``even`` (Megatron-LM's default split, and torch.distributed.pipelining's
#: ``pipeline`` split points spaced evenly), ``torchtitan`` (its default: the embedding and the
#: output each weigh one block, ``pipeline_parallel_{first,last}_stage_less_layers = 1``)
SPLITS = ("even", "torchtitan")


def parse_split(text: str | None):
    """``--pp-split`` as :func:`stage_blocks` takes it: None (``even``), ``"torchtitan"`` (weights
    1, 1), ``("torchtitan", a, b)`` from ``torchtitan:A,B``, or the blocks of each stage as a tuple
    of ints from ``N,N,...`` (Megatron's ``--decoder-first/last-pipeline-num-layers`` and
    torchtitan's ``module_fqns_per_model_part`` name such splits stage by stage).

    Raises:
        SymcostError: text that is none of those (one line, what is accepted)."""
    if text is None or text.strip() in ("", "even"):
        return None
    t = text.strip().replace(" ", "")
    accepted = "accepted: even, torchtitan, torchtitan:A,B (first/last stage weights), or N,N,... (blocks per stage)"
    try:
        if t == "torchtitan":
            return "torchtitan"
        if t.startswith("torchtitan:"):
            a, b = (int(x) for x in t.split(":", 1)[1].split(","))
            if a < 0 or b < 0:
                raise ValueError
            return ("torchtitan", a, b)
        blocks = tuple(int(x) for x in t.split(","))
        if any(x < 1 for x in blocks):
            raise ValueError
        return blocks
    except ValueError:
        raise SymcostError(f"bad --pp-split {text!r}; {accepted}") from None


def split_words(split) -> str:
    """``split`` as ``--pp-split`` names it: ``even``, ``torchtitan:1,1`` or ``2,3,1``."""
    if split is None or split == "even":
        return "even"
    if split == "torchtitan":
        return "torchtitan:1,1"
    if split[0] == "torchtitan":
        return f"torchtitan:{split[1]},{split[2]}"
    return ",".join(map(str, split))


def _torchtitan_split(L: int, n: int, input_weight: int, output_weight: int) -> list[int]:
    """torchtitan's ``_generate_llm_fqn_per_model_part`` (torchtitan/distributed/pipeline_parallel.py),
    counting blocks: ``L + input_weight + output_weight`` effective layers dealt out evenly, the
    first ``mod`` stages one more; the first stage gives ``input_weight`` of its share to the
    embedding, the last ``output_weight`` to the norm and head; blocks run out at the last stage."""
    eff = L + input_weight + output_weight
    if n > eff:
        raise SymcostError(f"{n} pipeline stages exceed the {eff} effective layers of torchtitan's split "
                           f"(L = {L} + input weight {input_weight} + output weight {output_weight})")
    per, extra = divmod(eff, n)
    if input_weight > per or output_weight > per:
        raise SymcostError(f"torchtitan's split: a first/last stage weight ({input_weight}, {output_weight}) exceeds "
                           f"the {per} layers per stage (L = {L}, {n} stages)")
    out, left = [], L
    for s in range(n):
        share = per + (1 if s < extra else 0) - (input_weight if s == 0 else output_weight if s == n - 1 else 0)
        take = min(max(share, 0), left)
        out.append(take)
        left -= take
    if left:  # (torchtitan leaves them out of every stage: a model it would run without them)
        raise SymcostError(f"torchtitan's split leaves {left} of L = {L} blocks in no stage ({n} stages)")
    return out


def stage_blocks(L: int, n_stages: int, split=None) -> list[int]:
    """Blocks of each of ``n_stages`` stages for ``L`` blocks.

    ``split`` (:func:`parse_split`): None, ``even``: L // n each, the first L mod n stages one
    more; ``"torchtitan"`` or ``("torchtitan", a, b)``: torchtitan's default split, the embedding
    and the output weighing ``a`` and ``b`` blocks (1 and 1 by default: Llama-3-8B's 32 blocks on
    4 stages are 8, 9, 8, 7); a tuple: the blocks of each stage as given.

    Raises:
        SymcostError: fewer blocks than stages, a stage left without blocks, a tuple that is not
            ``n_stages`` long or does not add up to ``L``.
    """
    if L < n_stages:
        raise SymcostError(f"L = {L} blocks cannot fill {n_stages} pipeline stages (one block each at least)")
    if split is None or split == "even":
        return [L // n_stages + (1 if s < L % n_stages else 0) for s in range(n_stages)]
    if split == "torchtitan" or (isinstance(split, tuple) and split and split[0] == "torchtitan"):
        a, b = (1, 1) if split == "torchtitan" else split[1:]
        blocks = _torchtitan_split(L, n_stages, a, b)
    else:
        blocks = [int(x) for x in split]
        if len(blocks) != n_stages or sum(blocks) != L:
            raise SymcostError(f"--pp-split {','.join(map(str, blocks))}: {len(blocks)} stages of {sum(blocks)} blocks, "
                               f"the pipeline has {n_stages} stages of L = {L} blocks")
    if min(blocks) < 1:
        raise SymcostError(f"the split {blocks} of L = {L} blocks leaves a stage without blocks ({n_stages} stages)")
    return blocks


def part_of(stage: int, n_stages: int) -> str:
    """``first``, ``middle`` or ``last``."""
    return "first" if stage == 0 else "last" if stage == n_stages - 1 else "middle"


def stage_kind(stage: int, blocks, lead: int) -> tuple[str, int]:
    """``(kind, before)`` of stage ``stage`` of a pipeline whose stages hold ``blocks`` blocks
    each (:func:`stage_blocks`), for a model whose first ``lead`` blocks are of another kind
    (``ModelSpec.lead_blocks``: DeepSeek-V3's ``first_k_dense_replace`` dense blocks).

    ``before``: the leading blocks that come before the stage, min(Σ blocks[:stage], lead) (the
    stage module is built with L + before blocks and the first ``before`` dropped,
    :func:`build_blocks`), so the stage holds ``lead - before`` leading blocks at its front (all of
    its blocks where that is at least its block count). ``kind`` names the stage kind one trace
    stands for: :func:`part_of`'s ``first``, ``middle`` or ``last`` for the first stage and for a
    stage after all the leading blocks (the one kind every such stage shares), else
    ``"{part}:lead{k}"``, k = lead - before (a stage that still holds leading blocks: at L = 8 over
    8 stages, DeepSeek-V3's stages 1 and 2 hold its dense blocks 1 and 2, ``middle:lead2`` and
    ``middle:lead1``; each such kind is one stage)."""
    part = part_of(stage, len(blocks))
    before = min(sum(blocks[:stage]), lead)
    if stage == 0 or before == lead:
        return part, before
    return f"{part}:lead{lead - before}", before


# ----------------------------------------------------------------------------------------------
# the schedule: PyTorch's action lists


# ----------------------------------------------------------------------------------------------
# the stage module


class _StageOut(Exception):
    def __init__(self, value):
        super().__init__("stage output")
        self.value = value


def _absent_class():
    import torch
    from torch import nn
    from torch.utils._pytree import tree_map

    class Absent(nn.Module):
        """A module deleted from this stage: no parameters; returns empty tensors of the shapes
        and dtypes of the deleted module's output (``template``: its output when probed at these
        sizes in the step's precision, :func:`probe_spec`)."""

        def __init__(self, template):
            super().__init__()
            self.template = template

        def forward(self, *args, **kwargs):
            if self.template is None:
                raise SymcostError("a module deleted from this pipeline stage was called")
            dev = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
            return tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device=dev)
                            if isinstance(t, torch.Tensor) else t, self.template)

    return Absent


def _split_points(model, layers: str):
    """``(blocks, candidates)``: the block modules, and the maximal modules with parameters outside
    the block container (children of the container's ancestors), by dotted name."""
    blocks = list(model.get_submodule(layers).children())
    ancestors = {""}
    parts = layers.split(".") if layers else []
    for k in range(1, len(parts) + 1):
        ancestors.add(".".join(parts[:k]))
    cands = {}
    for anc in ancestors:
        if anc == layers:
            continue
        for name, child in model.get_submodule(anc).named_children():
            full = f"{anc}.{name}" if anc else name
            if full in ancestors:
                continue
            if any(True for _ in child.parameters()):
                cands[full] = child
    return blocks, cands


def probe_boundary(model, layers: str, args, kwargs):
    """One forward of ``model`` (on the meta device, no gradients): which candidate modules run
    before the first block and after the last one, their outputs (meta templates), and the first
    block's input activation (the tensor a stage receives).

    Returns:
        ``(pre, post, templates, x)``: module names, ``{name: output}``, the activation.
    """
    import torch

    blocks, cands = _split_points(model, layers)
    if not blocks:
        raise SymcostError("the block container is empty: no stage to split")
    clock = {"t": 0}
    first_call: dict[str, int] = {}
    templates: dict[str, Any] = {}
    marks = {}
    hooks = []

    def cand_hook(name):
        def hook(mod, inp, out):
            first_call.setdefault(name, clock["t"])
            clock["t"] += 1
            templates.setdefault(name, out)
        return hook

    def block_pre(mod, a, k):
        marks.setdefault("start", clock["t"])
        clock["t"] += 1
        if "x" not in marks:
            marks["x"] = a[0] if a else k.get("hidden_states")

    def block_post(mod, a, out):
        marks["end"] = clock["t"]
        clock["t"] += 1

    for name, m in cands.items():
        hooks.append(m.register_forward_hook(cand_hook(name)))
    hooks.append(blocks[0].register_forward_pre_hook(block_pre, with_kwargs=True))
    hooks.append(blocks[-1].register_forward_hook(block_post))
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    if not isinstance(marks.get("x"), torch.Tensor):
        raise SymcostError("the first block takes no tensor as its first argument (or hidden_states): "
                           "the stage boundary is not found")
    pre = [n for n, t in first_call.items() if t < marks["start"]]
    post = [n for n, t in first_call.items() if t > marks["end"]]
    return pre, post, templates, marks["x"]


def probe_spec(spec, values: Mapping[str, int], layers: str, precision: str = "fp32"):
    """:func:`probe_boundary` of ``spec`` at ``values``, run as the recorder runs the step of
    ``precision``: the model built on the meta device in the precision's parameter dtype, made
    fake CPU tensors (``FakeTensorMode``), its floating inputs cast to that dtype, under the
    precision's autocast and inside ``spec.record_context`` (some models read a tensor value on
    the meta device). The templates then hold the dtypes the deleted modules return in that step (an
    embedding's output is bf16 under ``bf16-true``, fp32 under ``bf16-mixed``; a rotary embedding
    computes its cos/sin tables in that dtype, so a stage must see the same). Returns ``(pre,
    post, templates, x shape, x dtype)``."""
    import contextlib

    context = spec.record_context or contextlib.nullcontext
    with fake_step(spec, values, precision) as (m, a, k, autocast):
        from symcost.frontends.expert_parallel import grouped_mm_shapes

        with context(), autocast(), grouped_mm_shapes():  # (transformers' experts: fp32 grouped GEMMs)
            pre, post, templates, x = probe_boundary(m, layers, a, k)
    return pre, post, templates, tuple(x.shape), x.dtype


@contextlib.contextmanager
def fake_step(spec, values: Mapping[str, int], precision: str = "fp32"):
    """The model of ``spec`` at ``values`` as the recorder runs the step of ``precision``: built
    on the meta device in the precision's parameter dtype, made fake CPU tensors inside a
    ``FakeTensorMode`` (kept for the ``with`` body), its floating inputs cast to that dtype.
    Yields ``(model, args, kwargs, autocast)`` (``autocast``: the precision's autocast context
    factory, :func:`symcost.frontends.precision.precision_context`)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map

    from symcost.frontends.precision import precision_context

    param_dtype, autocast = precision_context(precision)
    with torch.device("meta"):
        m = spec.build(values)
        m.to(param_dtype)  # (floating parameters and buffers, as the recorder casts them)
    with FakeTensorMode(allow_non_fake_inputs=True):
        m.to_empty(device=torch.device("cpu"))
        a, k = spec.make_inputs(values, torch.device("cpu"))
        if param_dtype != torch.float32:
            a, k = tree_map(lambda t: t.to(param_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                            else t, (a, k))
        yield m, a, k, autocast


def make_stage(model, layers: str, part: str, pre, post, templates, p2p: bool = False):
    """Turn ``model`` (built with only this stage's blocks, or with the others deleted) into the
    ``part`` stage module, in place: modules of other stages replaced by ``Absent``, its forward
    patched as the module docstring says. Returns the model.

    The stage's forward: first stage ``model(*inputs)``; later stages ``forward(x, **inputs)``
    with the micro-batch's inputs as keyword arguments ``_in0, _in1, ...`` (positional ones) and
    their own names. A stage before the last returns its last block's output (the first tensor
    of it).

    With ``p2p`` (symcost's recording, on the fake process group) the stage receives ``x`` from
    the previous rank with ``torch.distributed.recv`` and sends its gradient back in backward
    (:func:`send_output` does the output side), so the point-to-point transfers are ops of the
    recorded step.
    """
    import torch

    Absent = _absent_class()
    first, last = part == "first", part == "last"
    if part not in PARTS:
        raise SymcostError(f"unknown stage {part!r}; accepted: {', '.join(PARTS)}")
    model.symcost_stage = part  # (a stage of dense blocks only holds no experts: --ep leaves it whole)
    gone = ([] if first else [n for n in pre if n not in post]) + ([] if last else [n for n in post if n not in pre])
    for name in gone:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, Absent(templates.get(name) if name in pre else None))
    state: dict[str, Any] = {}

    def swap(mod, a, k):
        x = state.pop("x", None)
        if x is None:
            return None
        if a:
            return (x,) + tuple(a[1:]), k
        return a, dict(k, hidden_states=x)

    def stop(mod, a, out):
        raise _StageOut(out)

    inner = model.forward

    def hooks():
        # registered at the first call, after the layout's own hooks (FSDP2's pre- and
        # post-forward of each block): the swap runs after the block's all-gather and the stop
        # after its reshard, so the last block runs the ops it runs in the whole model
        if "hooked" not in state:
            state["hooked"] = True
            blocks = list(model.get_submodule(layers).children())
            if not first:
                blocks[0].register_forward_pre_hook(swap, with_kwargs=True)
            if not last:
                blocks[-1].register_forward_hook(stop)

    def forward(*args, **kwargs):
        hooks()
        if not first:
            x, args = args[0], args[1:]
            pos = sorted((k for k in kwargs if k.startswith("_in") and k[3:].isdigit()), key=lambda k: int(k[3:]))
            args = tuple(args) + tuple(kwargs.pop(k) for k in pos)
            if p2p:
                x = _recv_fn().apply(x)
            state["x"] = x
        else:
            kwargs = {k: v for k, v in kwargs.items() if not (k.startswith("_in") and k[3:].isdigit())}
        try:
            out = inner(*args, **kwargs)
        except _StageOut as e:
            out = e.value
            if isinstance(out, (tuple, list)):
                out = next(t for t in out if isinstance(t, torch.Tensor))
        return out

    model.forward = forward
    return model


_FNS: dict = {}


def _peers():
    import torch.distributed as dist

    if not dist.is_initialized():
        _fake_pg(2)
    n, r = dist.get_world_size(), dist.get_rank()
    return (r - 1) % n, (r + 1) % n


def _recv_fn():
    """autograd Function: forward receives the stage input into ``x`` from the previous rank;
    backward sends its gradient back (and gives ``x`` none: the received buffer is a leaf)."""
    if "recv" not in _FNS:
        import torch
        import torch.distributed as dist

        class RecvActivation(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                dist.recv(x.detach(), src=_peers()[0])
                return x.view_as(x)

            @staticmethod
            def backward(ctx, g):
                dist.send(g.contiguous(), dst=_peers()[0])
                return None

        _FNS["recv"] = RecvActivation
    return _FNS["recv"]


def send_output(out):
    """The loss of a stage before the last: sends ``out`` to the next rank; its backward
    receives the gradient of ``out`` into a new buffer (PyTorch's stages do the same through
    ``batch_isend_irecv``). ``out`` may be a tuple of tensors (a stage of a model of several
    stacks sends the cut stack's hidden state and the ended stacks' outputs,
    :mod:`symcost.frontends.pipeline_stacks`): one send each. Returns a 0-dim tensor to call
    ``backward()`` on."""
    if "send" not in _FNS:
        import torch
        import torch.distributed as dist

        class SendActivation(torch.autograd.Function):
            @staticmethod
            def forward(ctx, y):
                dist.send(y.detach().contiguous(), dst=_peers()[1])
                ctx.meta = (y.shape, y.dtype, y.device)
                return y.new_zeros(())

            @staticmethod
            def backward(ctx, g):
                shape, dtype, device = ctx.meta
                buf = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(buf, src=_peers()[1])
                return buf

        _FNS["send"] = SendActivation
    if isinstance(out, (tuple, list)):  # (several tensors cross the boundary: one send each, in order)
        losses = [_FNS["send"].apply(t) for t in out]
        return sum(losses[1:], losses[0])
    return _FNS["send"].apply(out)


def stage_inputs(spec, values: Mapping[str, int], part: str, x_shape, x_dtype, device, sp: bool = False):
    """The stage's call ``(args, kwargs)`` for one micro-batch: the model's inputs for the first
    stage; for a later one the received activation (an empty tensor of the boundary's shape,
    requiring grad) and the model's inputs as keyword arguments ``_in<i>``. With ``sp``
    (sequence parallelism over ``values["TP"]`` ranks) the activation is the rank's S/TP
    positions: dimension 1 split, as ``SequenceParallel``'s ``Shard(1)`` leaves it between
    blocks and as torchtitan's stages send it. (Under context parallelism ``x_shape`` is
    already the rank's S/CP tokens': :func:`cp_values`.)"""
    import torch

    args, kwargs = spec.make_inputs(values, device)
    if part == "first":
        return args, kwargs
    x_shape = local_boundary(x_shape, values, sp)
    x = torch.empty(x_shape, dtype=x_dtype, device=device, requires_grad=True)
    return (x,), {**{f"_in{i}": a for i, a in enumerate(args)}, **kwargs}


def local_boundary(x_shape, values: Mapping[str, int], sp: bool = False) -> tuple:
    """The boundary activation's shape on one rank: ``x_shape`` with dimension 1 (the sequence)
    split over ``values["TP"]`` under sequence parallelism (``sp``), else as it is.

    Raises:
        SymcostError: TP does not divide that dimension.
    """
    x_shape = tuple(x_shape)
    if not sp:
        return x_shape
    tp = int(values.get("TP", 1))
    if len(x_shape) < 2 or x_shape[1] % tp:
        raise SymcostError(f"--sp: the stage boundary {list(x_shape)} does not split over TP = {tp} in its "
                           "sequence dimension (1)")
    return (x_shape[0], x_shape[1] // tp) + x_shape[2:]


def cp_values(values: Mapping[str, int], cp: bool) -> dict:
    """The sizes a stage's boundary is probed at (:func:`probe_spec`): ``values``, with S the
    rank's S/CP tokens under context parallelism (``cp``). torchtitan shards each micro-batch's
    inputs over the ``cp`` mesh before the pipeline schedule runs (``prepare_context_parallel_input``
    in torchtitan/trainer.py ``pp_forward_backward_step``, inside the CP ``train_context``), so
    every stage computes on the rank's S/CP tokens: the activation it receives and sends, and
    what the modules deleted from it would have returned (an embedding's output, from which a
    model derives its positions and rotary tables), are of S/CP tokens. Sizes that CP does not
    divide are returned as they are: no step runs at them (the CP spec's checks refuse them,
    :func:`symcost.frontends.context_parallel.context_parallel`), but a spec's probe check may
    build the stage there to read its parameters, which S does not change.
    """
    if not cp:
        return dict(values)
    S, n = int(values["S"]), int(values["CP"])
    return dict(values, S=S // n) if S % n == 0 else dict(values)


def stage_spec(spec, part: str, layers: str, p2p: bool = True, precision: str = "fp32", probes: dict | None = None,
               sp: bool = False, cp: bool = False, before: int | None = None):
    """The :class:`~symcost.frontends.spec.ModelSpec` of one stage module of ``spec`` for one
    micro-batch, with ``L`` the blocks of this stage (its formulas turn into L/PP, or
    L/(PP·v), by substitution, :mod:`symcost.passes.pipeline`).

    ``build`` builds the model with L blocks on the current device and makes it the ``part``
    stage (:func:`make_stage`); ``make_inputs`` gives the stage's call (:func:`stage_inputs`);
    ``loss`` is the model's loss on the last stage and :func:`send_output` before it.
    ``precision``: the precision the stage is traced in; the boundary (the deleted modules'
    outputs and the received activation) is probed in it (:func:`probe_spec`), once per sizes;
    ``probes``: a dict the stage kinds of one pipeline share, so they probe each size once;
    ``sp``: the stage is traced under sequence parallelism (its received activation is the
    rank's S/TP positions, :func:`stage_inputs`); ``cp``: under context parallelism (the boundary is
    probed at the rank's S/CP tokens, :func:`cp_values`); ``before``: the model's leading blocks of
    another kind (``ModelSpec.lead_blocks``) that come before this stage (:func:`stage_kind`): the
    stage holds the other ``lead_blocks - before`` of them at its front, then blocks of the
    repeated kind (its own ``lead_blocks``, where that is 2 or more; one such block is a special
    first block, which the tracer finds on its own); None: none before the first stage, all of
    them before any other.

    Raises:
        SymcostError: an unknown part, or a model without a block container.
    """
    if part not in PARTS:
        raise SymcostError(f"unknown stage {part!r}; accepted: {', '.join(PARTS)}")
    if not layers:
        raise SymcostError(f"{spec.name}: no container of L blocks, so no stage split")
    probes = {} if probes is None else probes

    def boundary(values):
        key = tuple(sorted(values.items()))
        if key not in probes:
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            # (a probe asked for inside the recording's FakeTensorMode, as context parallelism's
            # input split asks for the inputs at another S: the probe runs in its own mode)
            with unset_fake_temporarily():
                probes[key] = probe_spec(spec, cp_values(values, cp), layers, precision)
        return probes[key]

    n_lead = int(getattr(spec, "lead_blocks", 0) or 0)
    # (the leading blocks before the stage, dropped from its build: build_blocks)
    lead = (0 if part == "first" else n_lead) if before is None else min(int(before), n_lead)
    own = n_lead - lead  # (the leading blocks the stage holds)

    def build(values):
        pre, post, templates, _, _ = boundary(values)
        model = build_blocks(spec, values, layers, lead)
        if p2p:
            _peers()
        return make_stage(model, layers, part, pre, post, templates, p2p=p2p)

    def param_bounds(values):
        # (without the boundary probe, a forward of the whole model: the distinct first dimensions
        # of the parameters outside every module the stage may delete, and of all; the stage's own
        # lie between. frontends.parallel._first_bad reads them in a probe search)
        model = build_blocks(spec, values, layers, lead)
        if p2p:
            _peers()
        _, cands = _split_points(model, layers)
        maybe_gone = {id(p) for c in cands.values() for p in c.parameters()}
        ps = [p for p in model.parameters() if p.dim()]
        return (tuple(sorted({int(p.shape[0]) for p in ps if id(p) not in maybe_gone})),
                tuple(sorted({int(p.shape[0]) for p in ps})))

    build.param_bounds = param_bounds

    def make_inputs(values, device):
        _, _, _, shape, dtype = boundary(values)
        return stage_inputs(spec, values, part, shape, dtype, device, sp)

    def loss(out, inputs):
        if part != "last":
            return send_output(out) if p2p else out.sum()
        args, kwargs = inputs
        if part == "first":
            return spec.loss(out, inputs)
        kw = dict(kwargs)
        pos = sorted((k for k in kw if k.startswith("_in") and k[3:].isdigit()), key=lambda k: int(k[3:]))
        return spec.loss(out, (tuple(kw.pop(k) for k in pos), kw))

    name = f"{spec.name}[pp:{part}]" if part == "first" or not own else f"{spec.name}[pp:{part}:lead{own}]"
    return dataclasses.replace(spec, name=name, build=build, make_inputs=make_inputs,
                               loss=loss, layers=layers, extra={**spec.extra, "pipeline_stage": part},
                               lead_blocks=own if own >= 2 else 0)


def build_blocks(spec, values: Mapping[str, int], layers: str, lead: int = 0):
    """``spec``'s model at ``values`` on the current device, its block list ``layers`` holding
    ``values["L"]`` blocks of the kind that follows the ``lead`` leading blocks (``ModelSpec.
    lead_blocks``, DeepSeek-V3's ``first_k_dense_replace`` dense blocks) that come before the
    stage: a stage after the first holds later blocks only (torchtitan's ``pipeline_llm`` cuts the
    model's own layers), so it is built with L + lead blocks and the first ``lead`` dropped.
    ``lead`` is :func:`stage_kind`'s ``before``: fewer than the model's leading blocks where the
    earlier stages do not hold them all (L = 8 over 8 stages: stage 1 is built with 2 blocks, the
    first dropped, and holds dense block 1)."""
    if not lead:
        return spec.build(values)
    from torch import nn

    model = spec.build(dict(values, L=int(values["L"]) + lead))
    parent, _, attr = layers.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    blocks = getattr(owner, attr)
    setattr(owner, attr, nn.ModuleList(list(blocks)[lead:]) if isinstance(blocks, nn.ModuleList) else blocks[lead:])
    return model
