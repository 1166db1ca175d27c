"""Several stacks of repeated blocks, each folded under its own length symbol.

An encoder-decoder has two block lists: T5's ``encoder.block`` and ``decoder.block`` (both of
``L`` blocks where the config gives the two stacks one depth), or ``encoder`` and ``decoder`` of
``L_enc`` and ``L_dec`` blocks (a factory's own sizes, docs/user-guide.md). Where one container
alone follows ``L`` the tracer folds it as it always has (``Recording.layer_container``); where
several do, or a model's own size counts a stack, each stack folds on its own:
``{container: length symbol}`` (:func:`find_stacks`), the probes hold ``FIT_L`` blocks in every
stack, and block 0 of a stack stands for all its blocks (:mod:`symcost.graph.stacks`).
docs/tracing.md §4, "Several stacks".
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from symcost.frontends.layout import layout_of
from symcost.frontends.spec import INPUT_SYMBOLS, ModelSpec
from symcost.tracing.modules import _containers, _layer_of
from symcost.tracing.probes import FIT_L

if TYPE_CHECKING:  # pragma: no cover
    from symcost.tracing.record import Recording


def stack_candidates(spec: ModelSpec, symbols) -> list[str]:
    """The symbols of ``symbols`` that may count a stack of blocks: ``L`` and the model's own
    sizes (``L_enc``, ``L_dec``, any name outside the conventions' alphabet), inputs excluded."""
    own = set(spec.own_symbols)
    return [s for s in symbols if (s == "L" and "L" in spec.symbols) or (s in own and s not in INPUT_SYMBOLS)]


def find_stacks(spec: ModelSpec, values: Mapping[str, int], symbols) -> dict[str, str]:
    """``{container: length symbol}`` of the stacks of repeated blocks that fold separately, or
    ``{}`` where the single-container fold applies (one container follows ``L`` and no own size
    counts a stack) or no fold of several stacks is done.

    A container (an ``nn.ModuleList``, ``nn.Sequential`` or ``nn.ModuleDict`` keyed 0..n-1:
    :func:`symcost.tracing.modules._containers`) follows a symbol X of ``symbols``
    (:func:`stack_candidates`) when its length is X's value in the model built (on the meta
    device) at ``values`` and X + 1 in the model built with X + 1, as
    :func:`symcost.tracing.record.find_layer_container` finds L's. Several containers may follow
    one symbol (T5's two stacks of L blocks). A symbol whose value is below 2 counts no stack
    here (a stack of one block is traced as it is: size 1 is pinned).

    Under a parallel layout of data and tensor parallelism (``--dp`` with any ``--shard``,
    HSDP, ``--tp``: :func:`layout_folds`) the stacks fold too: every block of every stack is
    its own DDP/FSDP2 unit, then the root, as torchtitan wraps blocks, and the probes hold three
    blocks of each stack where the data-parallel engine makes the first and last blocks differ
    (:func:`stack_fit_blocks`). Not done (``{}``: the step is traced as before, the lengths
    pinned): any other layout (pipeline stages, context or expert parallelism), leading blocks
    of another kind (``ModelSpec.lead_blocks``), a spec naming its block list
    (``ModelSpec.layers``). An inference step folds too: its KV cache's layers fold with the one
    stack whose blocks read or write the cache (:func:`kv_stack`).

    A model that does not build at ``values`` has no stacks here (its request's recording says
    why); a symbol whose X + 1 breaks the model's constraints, or does not build, counts no stack.
    """
    if spec.layers is not None or spec.lead_blocks or not layout_folds(spec):
        return {}
    found = _following(spec, values, stack_candidates(spec, symbols), least=2)
    if not found:
        return {}
    if list(found.values()) == ["L"]:
        return {}  # one block list of L blocks: the single-container fold
    return found


#: the mesh dimensions under which several stacks fold (``Layout.traced_dims``): data parallelism
#: (DDP, FSDP2, HSDP: every block of every stack a unit, then the root) and tensor parallelism
#: (the plan over every block of every stack); pipeline stages, context and expert parallelism
#: work on one block list
FOLDED_DIMS = frozenset({"dp_shard", "dp_replicate", "tp"})


def layout_folds(spec: ModelSpec) -> bool:
    """Whether several stacks of ``spec``'s model fold under its layout (``layout_of(spec)``): no
    layout, or one whose traced mesh dimensions are all in :data:`FOLDED_DIMS` (``--compile``
    excluded: it compiles one block list)."""
    lay = layout_of(spec)
    return set(lay.traced_dims) <= FOLDED_DIMS and not lay.compile


def stack_fit_blocks(spec: ModelSpec) -> int:
    """The blocks each stack's probes hold under ``spec``'s layout: 3 where the layout is data-
    or sequence-parallel (FSDP2 and DDP keep a unit's collective buffers until the next unit's
    collective, so the first and the last block of each direction free what the others do not:
    block 1 stands for the X - 2 between them, as the one block list's middle block does,
    ``graph.align._middle``), else ``FIT_L`` (2; more where a stack's own blocks need it:
    :func:`symcost.graph.stacks.probe_blocks`)."""
    lay = layout_of(spec)
    return FIT_L + 1 if (lay.shard or lay.sp) else FIT_L


def fold_layout_words(spec: ModelSpec) -> str:
    """The layout that makes :func:`stack_fit_blocks` hold three blocks, in words for a reason
    ("a data-parallel layout", "sequence parallelism", or both): what the user asked for
    (``--dp``/``--shard``, ``--sp``), not always data parallelism."""
    lay = layout_of(spec)
    words = [w for w, on in (("a data-parallel layout", lay.shard), ("sequence parallelism", lay.sp)) if on]
    return " with ".join(words) or "this layout"


def _following(spec: ModelSpec, values: Mapping[str, int], cands, least: int) -> dict[str, str]:
    """``{container: symbol}`` of the outermost containers whose length follows a symbol of
    ``cands`` valued at least ``least`` (length X at ``values``, X + 1 built with X + 1), as
    :func:`find_stacks` describes; ``{}`` where the model does not build at ``values``."""
    cands = [s for s in cands if int(values.get(s, 0) or 0) >= least]
    if not cands:
        return {}

    values = _with_ties(spec, values)
    try:
        here = _containers(spec.build_meta(values))
    except Exception:  # noqa: BLE001 - the request's own recording says why the model does not build
        return {}
    found: dict[str, str] = {}
    for sym in cands:
        n = int(values[sym])
        same = [c for c, k in here.items() if k == n and c not in found]
        if not same:
            continue
        more = _with_ties(spec, dict(values, **{sym: n + 1}))
        if spec.check(more) is not None:  # (X + 1 breaks a constraint: G + 1 need not divide W)
            continue
        try:
            other = _containers(spec.build_meta(more))
        except Exception:  # noqa: BLE001 - X + 1 is no model (a check the spec does not declare): no stack of X
            continue
        for c in same:
            if other.get(c) == n + 1:
                found[c] = sym
    if not found:
        return {}
    # nested containers (a stack inside a block of another): the outer one folds, the inner
    # ones are parts of its blocks
    return {c: s for c, s in found.items()
            if not any(o != c and (o == "" or c.startswith(o + ".")) for o in found)}


def checkpointed_stacks(spec: ModelSpec, values: Mapping[str, int]) -> list[str]:
    """The block containers activation checkpointing (``--ac``) wraps where no one block list
    follows ``L``: every stack of repeated blocks, each block of each checkpointed on its own, as
    ``transformers``' ``gradient_checkpointing_enable()`` checkpoints every layer of T5's or
    BART's encoder and decoder. The containers following ``L`` or a model's own stack size
    (:func:`stack_candidates`) at any length, one block included (a stack of one block is
    checkpointed too, though not folded); outermost only. ``[]`` where there is none."""
    return sorted(_following(spec, values, stack_candidates(spec, spec.symbols), least=1))


def pipeline_stacks(spec: ModelSpec, values: Mapping[str, int]) -> list[str]:
    """The stacks' containers a pipeline cuts as one list (:mod:`symcost.frontends.pipeline_stacks`):
    :func:`checkpointed_stacks` where there are two or more, else [] (one block list: the
    pipeline's own, :mod:`symcost.frontends.pipeline`; a spec naming ``ModelSpec.layers`` too)."""
    from symcost.errors import SymcostError

    if spec.layers is not None:
        return []
    try:
        found = checkpointed_stacks(spec, values)
    except SymcostError:
        return []
    return found if len(found) > 1 else []


def stack_length_symbols(spec: ModelSpec, containers, values: Mapping[str, int]) -> list[str]:
    """The symbols that count the blocks of ``containers`` (``L_enc``, ``L_dec``; ``L`` where both
    stacks follow it), as :func:`checkpointed_stacks` finds them."""
    found = _following(spec, values, stack_candidates(spec, spec.symbols), least=1)
    return sorted({found[c] for c in containers if c in found})


def _with_ties(spec: ModelSpec, values: Mapping[str, int]) -> dict[str, int]:
    out = dict(values)
    for a, b in spec.tied.items():
        if b in out:
            out[a] = out[b]
    return out


def stack_of(module: str, stacks: Mapping[str, str]) -> tuple[str, int] | None:
    """``(container, block index)`` of the stack block a module path lies in, else None (the
    innermost container where stacks nest: :func:`find_stacks` keeps the outer ones only)."""
    best = None
    for c in stacks:
        i = _layer_of(module, c)
        if i is not None and (best is None or len(c) > len(best[0])):
            best = (c, i)
    return best


def kv_stack(rec: Recording, stacks: Mapping[str, str]) -> str | None:
    """Of several stacks of blocks (container -> length symbol, :func:`symcost.tracing.stacks.find_stacks`),
    the one whose blocks read or write the KV cache in ``rec``'s inference step (an op of it with
    ``kv_reads`` or ``kv_writes``: an encoder-decoder's decoder, whose self- and cross-attention
    read the cache; its encoder reads none), else None (no stack, or several, touch it)."""
    found = set()
    for op in rec.ops:
        if getattr(op, "kv_reads", ()) or getattr(op, "kv_writes", ()):
            where = stack_of(op.module, stacks)
            if where is not None:
                found.add(where[0])
    return found.pop() if len(found) == 1 else None


def stack_units(info, n: int, stacks: Mapping[str, str], special: Mapping[str, int | str | None], name: str):
    """The units of a storage schedule where several stacks fold (``tracing.schedule._fit_events``):
    ``(units, siblings, firsts, middles)``.

    ``info[k] = (op, (container, block) or None)`` says where event k happened; each stack holds
    two probe blocks. A stack's forward runs its blocks 0, 1 and its backward 1, 0 (a
    forward-only step: no backward); the stacks follow each other (an encoder's forward, the
    decoder's forward, the decoder's backward, the encoder's backward), and what lies between
    them runs once; a stack none of whose blocks makes an event (an encoder in a decoder step)
    has no unit. Per stack and direction, as the one block list of L blocks folds
    (docs/memory.md, "Folding over L"): where block 1 stands apart (``special[c] == 1``) block 0
    is run X - 1 times and block 1 once, else block 0 once and block 1 X - 1 times (X the stack's
    symbol; ``(start, stop, repeat, min_L, label, X)``, repeat a sympy expression or 1). A stack
    probed with three blocks (``special[c] == "both"``: T5's first and last blocks stand apart)
    runs its first block once, its middle one X - 2 times and its last once, in each direction,
    as the data-parallel fold's middle block does (valid for X >= 2).
    ``siblings``: ``(repeated events, the other block's)`` per repeated unit; ``firsts``: unit ->
    whether its probe block is the stack's first (the last block stands apart; a three-block
    stack's middle block is its first middle pass forward and its last backward); ``middles``:
    index of ``siblings`` of a three-block stack -> the events of the block that follows the
    middle one in that direction (the last block forward, the first backward): the sibling that
    tells a free each pass makes of the storage the pass before it allocated (a running sum of
    the position bias's gradient) from a free of a storage allocated once before the stack (the
    bias block 0 computed, freed after its last use, by the backward of block 1).

    Raises:
        SymcostError: the blocks' events interleave (within a stack or between stacks), or a
            stack's probe blocks are missing.
    """
    from symcost.errors import SymcostError
    from symcost.tracing.symbols import SYMS

    spans: dict[tuple, tuple[int, int]] = {}
    for k in range(n):
        op, where = info[k]
        if where is None:
            continue
        key = ("forward" if op.phase == "forward" else "backward",) + tuple(where)
        a, b = spans.get(key, (k, k))
        spans[key] = (min(a, k), max(b, k))
    forward_only = not any(k[0] == "backward" for k in spans)
    dirs = ("forward",) if forward_only else ("forward", "backward")
    # a stack whose blocks make no memory event runs nothing in this step (an encoder-decoder's
    # decoder step: the encoder ran in the prefill): no unit of it
    stacks = {c: sym for c, sym in stacks.items() if any(k[1] == c for k in spans)}
    nb = {c: 3 if special.get(c) == "both" else 2 for c in stacks}
    want = {(d, c, i) for d in dirs for c in stacks for i in range(nb[c])}
    if set(spans) != want:
        raise SymcostError(f"{name}: the memory events of the stacks' blocks are not the probe blocks of each stack in each "
                           "direction; the peak cannot be folded over the stacks")
    pieces: list[tuple] = []  # (start, stop, repeat, min_L, label, sym)
    siblings: list[tuple[range, range]] = []
    firsts_of: dict[int, bool] = {}  # (index in pieces) -> the probe block is the stack's first
    middles: dict[int, range] = {}
    for c, sym in stacks.items():
        X, sp = SYMS[sym], special.get(c)
        for d in dirs:
            ends = [spans[(d, c, i)] for i in range(nb[c])]
            if d == "backward":
                ends.reverse()
            if any(not a[1] < b[0] for a, b in zip(ends, ends[1:])):
                raise SymcostError(f"{name}: the memory events of the blocks of {c} interleave; the peak "
                                   "cannot be folded")
        f0, f1 = spans[("forward", c, 0)], spans[("forward", c, 1)]
        F0, F1 = range(f0[0], f0[1] + 1), range(f1[0], f1[1] + 1)
        if nb[c] == 3:  # first, middle, last: each pass from its block's first event to the next's
            f2 = spans[("forward", c, 2)]
            firsts_of[len(pieces) + 1] = True  # (block 1: the first middle pass forward, the last backward)
            pieces += [(f0[0], f1[0], 1, 2, f"forward, {c}: first block", sym),
                       (f1[0], f2[0], X - 2, 3, f"forward, {c}: block", sym),
                       (f2[0], f2[1] + 1, 1, 2, f"forward, {c}: last block", sym)]
            middles[len(siblings)] = range(f2[0], f2[1] + 1)
            siblings.append((range(f1[0], f2[0]), range(f0[0], f1[0])))
            if not forward_only:
                b2, b1, b0 = (spans[("backward", c, i)] for i in (2, 1, 0))
                firsts_of[len(pieces) + 1] = True
                pieces += [(b2[0], b1[0], 1, 2, f"backward, {c}: last block", sym),
                           (b1[0], b0[0], X - 2, 3, f"backward, {c}: block", sym),
                           (b0[0], b0[1] + 1, 1, 2, f"backward, {c}: first block", sym)]
                middles[len(siblings)] = range(b0[0], b0[1] + 1)
                siblings.append((range(b1[0], b0[0]), range(b2[0], b1[0])))
            continue
        if sp == 1:  # the last block stands apart: blocks 0..X-2 are like block 0
            firsts_of[len(pieces)] = True
            pieces += [(f0[0], f1[0], X - 1, 2, f"forward, {c}: block", sym),
                       (f1[0], f1[1] + 1, 1, 1, f"forward, {c}: last block", sym)]
            siblings.append((F0, F1))
        else:
            firsts_of[len(pieces) + 1] = False
            pieces += [(f0[0], f0[1] + 1, 1, 1, f"forward, {c}: first block", sym),
                       (f0[1] + 1, f1[1] + 1, X - 1, 2, f"forward, {c}: block", sym)]
            siblings.append((F1, F0))
        if forward_only:
            continue
        b1, b0 = spans[("backward", c, 1)], spans[("backward", c, 0)]
        B1, B0 = range(b1[0], b1[1] + 1), range(b0[0], b0[1] + 1)
        if sp == 1:
            firsts_of[len(pieces) + 1] = True
            pieces += [(b1[0], b1[1] + 1, 1, 1, f"backward, {c}: last block", sym),
                       (b1[1] + 1, b0[1] + 1, X - 1, 2, f"backward, {c}: block", sym)]
            siblings.append((B0, B1))
        else:
            firsts_of[len(pieces)] = False
            pieces += [(b1[0], b0[0], X - 1, 2, f"backward, {c}: block", sym),
                       (b0[0], b0[1] + 1, 1, 1, f"backward, {c}: first block", sym)]
            siblings.append((B1, B0))
    order = sorted(range(len(pieces)), key=lambda j: pieces[j][0])
    units: list[tuple] = []
    firsts: dict[int, bool] = {}
    at = 0
    for j in order:
        a, b = pieces[j][:2]
        if a < at:
            raise SymcostError(f"{name}: the memory events of the stacks {', '.join(stacks)} interleave; the peak "
                               "cannot be folded over the stacks")
        if a > at:
            units.append((at, a, 1, 1, "before the blocks" if not units else "between the stacks' blocks"))
        if j in firsts_of:
            firsts[len(units)] = firsts_of[j]
        units.append(pieces[j])
        at = b
    units.append((at, n, 1, 1, "after the blocks"))
    return units, siblings, firsts, middles
