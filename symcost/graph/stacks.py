"""The fold of several stacks of repeated blocks, each under its own length symbol.

The probes hold ``FIT_L`` (2) blocks in every stack (:func:`symcost.tracing.stacks.find_stacks`
says which containers are stacks and which symbol counts each). Per stack, as
:func:`symcost.graph.align._layer_roles` does for the one block list of L blocks: block 0 stands
for the stack's X blocks (``repeat = X``, named ``{container}.{i}``) and block 1 is dropped; where
the two blocks differ (T5's block 0 computes the relative-attention bias the others are given),
one more recording with X = 3 tells which end block is special: it is kept on its own
(``repeat = 1``) and the other stands for X - 1. Saved tensors follow the same rules per stack
(:func:`saved_role`).

Where both end blocks stand apart (T5: block 0 computes the position bias, and every block but
the last adds the gradient of that bias, which all later blocks use, to the one flowing back),
the probes hold three blocks of that stack's symbol (:func:`probe_blocks`): block 0 stays as it
ran, block 1 stands for the X - 2 middle blocks, block 2 is the last (valid for X >= 2).
docs/tracing.md §4, "Several stacks".
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

import sympy

from symcost.frontends.spec import ModelSpec
from symcost.tracing.fit import CHECK_L, FIT_L, SYMS, Unvariable
from symcost.tracing.modules import _fold_name, _rename_block
from symcost.tracing.stacks import (_following, find_stacks, fold_layout_words, layout_folds, stack_candidates,
                                    stack_fit_blocks, stack_of)

if TYPE_CHECKING:  # pragma: no cover
    from symcost.tracing.record import Recording


def _block_seqs(rec: Recording, stacks: Mapping[str, str]) -> dict[tuple[str, int], list[str]]:
    """Each stack block's ops with their shapes, then the tensors it alone saves (as
    ``_layer_roles`` compares the blocks of one list). A block that runs no op in the step (an
    encoder's, in a decoder step: the encoder ran in the prefill) is told by its parameters
    instead, their names within the block and shapes (T5's first encoder block holds the
    position bias the others do not)."""
    out: dict[tuple[str, int], list[str]] = {}
    for op in rec.ops:
        where = stack_of(op.module, stacks)
        if where is not None:
            out.setdefault(where, []).append(
                f"{op.name}{[t.shape for t in op.inputs]}{[t.shape for t in op.outputs]}")
    ran = set(out)
    for name, (shape, _) in rec.params.items():
        where = stack_of(name.rpartition(".")[0], stacks)
        if where is not None and where not in ran:
            out.setdefault(where, []).append(f"param {name.removeprefix(f'{where[0]}.{where[1]}.')}{list(shape)}")
    for s in rec.saved:
        blocks = {stack_of(m, stacks) for m in s.also | {s.module}}
        if len(blocks) == 1 and None not in blocks:
            out.setdefault(blocks.pop(), []).append(f"saved {s.dtype}")
    return out


def _unvariable(sym: str, msg: str) -> Unvariable:
    e = Unvariable(sym, msg)
    e.stack = True  # (the tracer pins the symbol with this message as its reason)
    return e


def _which_differ(seqs: list, sym: str) -> str:
    differ = [i for i in range(len(seqs)) if seqs[i] != seqs[0]]
    return (f"traced at {sym} = {len(seqs)}: block{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))} of {len(seqs)} "
            f"differ{'s' if len(differ) == 1 else ''} from block 0")


def probe_blocks(spec: ModelSpec, stacks: Mapping[str, str], req: Recording, rec_at,
                 request: Mapping[str, int]) -> dict[str, int]:
    """How many blocks each stack symbol's probes hold: ``FIT_L`` (2), or 3 where a stack of it
    has both end blocks apart from the others (recordings at X = 3 and 4 tell: blocks 0, 1, 2
    all differ at 3, and blocks 1 and 2 are alike at 4), and 3 for every stack under a
    data-parallel layout (:func:`symcost.tracing.stacks.stack_fit_blocks`).

    Args:
        spec: the model (its layout).
        stacks: container -> symbol.
        req: the request's recording with every stack at ``FIT_L`` blocks.
        rec_at: ``values -> Recording`` (or a SymcostError), the tracer's cached recorder.
        request: the request's values (stacks at ``FIT_L``).

    Raises:
        Unvariable: a stack whose blocks follow no such pattern (its symbol is pinned).
    """
    s2 = _block_seqs(req, stacks)
    out: dict[str, int] = {}
    if stack_fit_blocks(spec) == 3:
        # a data- or sequence-parallel layout: first, middle and last block of every stack (as the
        # one block list's middle block under --dp), the request recorded with three. The last
        # block may run other ops (encdec.py's decoder: no gradient of the encoder's output comes
        # back into it). A stack whose first block differs from the middle one (T5's block 0
        # computes the position bias and holds its table) is not folded there: the first
        # block's unit holds other buffers than the middle one's, which the three-block fold
        # does not tell from per-pass ones (hf:t5 --dp fsdp folded was 8.6 KiB per middle block
        # off MemTracker's peak, 2026-12-05)
        for c, sym in stacks.items():
            seqs = [s2.get((c, i)) for i in range(3)]
            if seqs[0] != seqs[1]:
                raise _unvariable(sym, (f"under {fold_layout_words(spec)} the blocks of {c} are not folded where they run "
                                        f"different ops or sizes ({_which_differ(seqs, sym)}): traced unfolded at the "
                                        f"requested {sym}"))
        return {sym: 3 for sym in stacks.values()}
    for c, sym in stacks.items():
        if s2.get((c, 0)) == s2.get((c, 1)):
            continue
        s3 = _seqs_at(rec_at, request, sym, 3, stacks, c)
        if s3[0] != s3[1] and s3[1] != s3[2] and s3[0] != s3[2]:
            s4 = _seqs_at(rec_at, request, sym, 4, stacks, c)
            if s4[1] != s4[2]:
                raise _unvariable(sym, (f"the blocks of {c} run different ops or sizes ({_which_differ(s4, sym)}), "
                                        f"so {sym} is not folded"))
            out[sym] = 3
    return out


def _seqs_at(rec_at, request, sym: str, n: int, stacks, c: str) -> list:
    rec = rec_at(dict(request, **{sym: n}))
    if isinstance(rec, Exception):
        raise _unvariable(sym, f"the model does not run with {sym} = {n} at the probe sizes ({rec}), so {sym} is not folded")
    seqs = _block_seqs(rec, stacks)
    return [seqs.get((c, i)) for i in range(n)]


def own_stacks(spec: ModelSpec, values: Mapping[str, int], symbols) -> tuple[list[str], dict[str, str]]:
    """Before the request is recorded: ``(own, stacks)``, the model's own sizes that may count a
    stack (``L_enc``, ``L_dec``: :func:`symcost.tracing.stacks.stack_candidates`) and, where there
    are any, the stacks found at ``values`` (:func:`symcost.tracing.stacks.find_stacks`: they are
    fixed in every probe, so the request is recorded with them at ``FIT_L``); ``{}`` otherwise
    (L's stacks are found from the request's recording: :func:`request_stacks`)."""
    own = [s for s in stack_candidates(spec, symbols) if s != "L"]
    stacks = find_stacks(spec, values, symbols) if own else {}
    from symcost.frontends.layout import layout_of

    lay = layout_of(spec)
    if own and not stacks and lay.traced_dims and not layout_folds(spec):
        # a stack counted by a model's own size under a layout that works on one block list
        # (pipeline stages, context or expert parallelism: find_stacks does not fold it): pinned
        # at once with that reason, not after probes that could only show its other values
        # running other ops
        found = _following(spec, values, own, least=1)
        if found:
            sym = next(iter(found.values()))
            what = "a parallel layout other than data and tensor parallelism"
            raise _unvariable(sym, f"{what} does not fold several stacks "
                                   f"({', '.join(c for c, x in found.items() if x == sym)}): traced unfolded at the requested {sym}")
    return own, stacks


def request_stacks(spec: ModelSpec, own, stacks: Mapping[str, str], symbols, req: Recording, rec_at,
                   request: Mapping[str, int]) -> tuple[dict[str, str], dict[str, int]]:
    """After the request is recorded (every stack at ``FIT_L``): ``(stacks, blocks)``. Where the
    model has no own stack sizes, L's stacks are looked for only where the recording found no
    single block list of L (``Recording.no_fold``: no model build more for a model of one block
    list); ``blocks``: :func:`probe_blocks`.

    Raises:
        Unvariable: see :func:`probe_blocks`.
    """
    stacks = dict(stacks)
    if not own and "L" in symbols and req.layer_container is None and req.no_fold:
        stacks = find_stacks(spec, request, symbols)
    blocks = probe_blocks(spec, stacks, req, rec_at, request) if stacks else {}
    return stacks, blocks


def stack_roles(spec: ModelSpec, ref: Recording, stacks: Mapping[str, str], precision: str,
                blocks: Mapping[str, int] | None = None):
    """How each module of the fit recordings folds when several stacks fold (``stacks``:
    container -> length symbol; ``blocks``: symbol -> probe blocks where not ``FIT_L``,
    :func:`probe_blocks`): ``role(module, name=None) -> (keep, repeat, folded name)``, as
    :func:`symcost.graph.align._layer_roles` gives it for one block list.

    With two probe blocks: block 0 stands for all X (repeat X) where the blocks are alike, else
    the special end block (one more recording at X = 3 tells which) is kept with repeat 1 and
    the other stands for X - 1. With three: block 0 (repeat 1), block 1 (X - 2, ``{i}``), block 2
    (1, ``{X-1}``). The function carries ``role.special`` (container -> ``0``, ``1``, ``None``,
    or ``"both"`` with three probe blocks) and ``role.blocks`` (container -> probe blocks).

    Raises:
        Unvariable: a stack whose blocks differ in a way neither end block explains (the stack's
            symbol is then pinned, its blocks traced one by one).
    """
    from symcost.tracing.record import record  # (imports torch: on first use)

    blocks = dict(blocks or {})
    one = sympy.Integer(1)
    s2 = _block_seqs(ref, stacks)
    special: dict[str, int | str | None] = {}
    extra: dict[str, dict] = {}  # symbol -> the block sequences of a recording with that symbol at 3
    for c, sym in stacks.items():
        if blocks.get(sym, FIT_L) == 3:
            special[c] = "both"
            continue
        b0, b1 = s2.get((c, 0)), s2.get((c, 1))
        if b0 is None or b1 is None or b0 == b1:
            special[c] = None
            continue
        if sym not in extra:
            extra[sym] = _block_seqs(record(spec, dict(ref.values, **{sym: FIT_L + 1}), precision), stacks)
        s3 = [extra[sym].get((c, i)) for i in range(3)]
        if s3[1] == s3[2] and s3[0] != s3[1]:
            special[c] = 0
        elif s3[0] == s3[1] and s3[2] != s3[1]:
            special[c] = 1
        else:
            raise _unvariable(sym, (f"the blocks of {c} run different ops or sizes ({_which_differ(s3, sym)}), "
                                    f"so {sym} is not folded"))

    def role(module: str, name: str | None = None):
        full = module if name is None else name
        where = stack_of(module, stacks)
        if where is None:
            return True, one, full
        c, layer = where
        X, sp = SYMS[stacks[c]], special[c]
        last = _rename_block(full, c, "{" + f"{stacks[c]}-1" + "}")
        if sp == "both":
            return ((True, one, full) if layer == 0 else (True, X - 2, _fold_name(full, c)) if layer == 1
                    else (True, one, last) if layer == 2 else (False, one, full))
        if sp is None:
            return (True, X, _fold_name(full, c)) if layer == 0 else (False, one, full)
        generic = 1 - sp
        if layer == generic:
            return True, X - 1, _fold_name(full, c)
        if layer == sp:
            return True, one, full if sp == 0 else last
        return False, one, full

    role.special = special
    role.stacks = dict(stacks)
    return role


def check_blocks(blocks: Mapping[str, int]) -> dict[str, int]:
    """Symbol -> the stack length the fresh recordings of the check hold (``CHECK_L``, one more
    where the probes hold three blocks)."""
    return {s: (CHECK_L + 1 if n == 3 else CHECK_L) for s, n in blocks.items()}


def saved_role(s, stacks: Mapping[str, str], role):
    """``(keep, repeat, module)`` of a saved storage ``s`` (``Recording.saved``) under the fold of
    several stacks. A storage one block makes and the next block of its stack saves too (a block
    ending in a ReLU whose output the next block's first layer keeps) is one per pair of
    neighbouring blocks, X - 1 in all (the pair the probe's generic block makes stands for all
    but the others'); a storage saved by blocks of several blocks or stacks (T5's position bias,
    made by block 0 and kept by every block of its stack; an encoder's output, which every
    decoder block's cross-attention keeps) is counted once."""
    keep, repeat, module = role(s.module)
    blocks = {stack_of(m, stacks) for m in s.also | {s.module}}
    made = stack_of(s.made_in, stacks) if s.made_in is not None else None
    if made is not None and blocks == {made, (made[0], made[1] + 1)}:
        X = SYMS[stacks[made[0]]]
        keep, module = True, role(s.made_in)[2]
        if getattr(role, "special", {}).get(made[0]) == "both":
            repeat = X - 2 if made[1] == 1 else sympy.Integer(1)
        else:
            repeat = X - FIT_L + 1 if made[1] == 0 else sympy.Integer(1)
    elif len(blocks) > 1:
        keep, repeat, module = True, sympy.Integer(1), "(shared by blocks)"
    return keep, repeat, module
