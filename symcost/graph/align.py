"""Probe recordings aligned op by op, and the roles of their ops in the L repeated blocks.

:func:`_align` checks that every probe ran the same ops (one formula per op needs one op list);
:func:`_layer_roles` says, for each recorded op, whether it belongs to a block, which one and its
folded name (so the L blocks fold into one with ``repeat = L``; lead blocks and a middle block
where a layout needs them, :func:`_lead_roles`, :func:`_middle`); :func:`_matmul_params` finds
the parameters the matmul-class ops use (through views and FP8 casts, :func:`_fp8_cast`). Used by
:func:`symcost.graph.build.trace`.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import sympy

from symcost._lazy import LazyModule
from symcost.errors import SymcostError
from symcost.frontends.layout import layout_of
from symcost.frontends.spec import ModelSpec
from symcost.tracing.fit import FIT_L, SYMS, Unvariable
from symcost.tracing.modules import _fold_name, _layer_of, _rename_block

if TYPE_CHECKING:  # pragma: no cover
    from symcost.tracing.record import Recording

rules = LazyModule("symcost.graph.rules")


#: the ops of an FP8 training cast (torchao's hp_tensor_to_float8_dynamic: x · scale, clamped to
#: the fp8 range, then ``_to_copy`` to float8) that keep a weight "the same weight" on its way to
#: ``aten._scaled_mm`` (:func:`_fp8_cast`)
FP8_CAST_OPS = {"aten.mul", "aten.clamp"}


def _fp8_cast(op, origin) -> bool:
    """Whether ``op`` scales or clamps a tensor with an origin (a parameter) into a tensor of its
    shape, its other tensor inputs being smaller (the amax scales): a step of an FP8 cast."""
    if str(op.op.overloadpacket) not in FP8_CAST_OPS or not op.inputs or not op.outputs:
        return False
    x = op.inputs[0]
    if not ((x.source or "").startswith("param:") or x.tid in origin) or op.outputs[0].shape != x.shape:
        return False
    return all(math.prod(t.shape) < math.prod(x.shape) for t in op.inputs[1:])


def _matmul_params(rec: Recording) -> tuple[set[str], set[int]]:
    """Parameters that reach a matmul-class op (through views, casts and, in an FP8 training step,
    the float8 cast's scaling and clamping: :func:`_fp8_cast`) in the forward, and those ops."""
    origin: dict[int, str] = {}
    used: set[str] = set()
    ops_with_param: set[int] = set()
    fp8 = any(op.name.startswith("aten._scaled_mm") for op in rec.ops)
    for i, op in enumerate(rec.ops):
        if op.phase != "forward":
            break
        srcs = set()
        fam = rules.classify(op.op)
        operands = op.inputs
        if fam == "model":  # bias operands are not matmul weights (flop_counter ignores bias adds)
            operands = [t for k, t in enumerate(op.inputs) if k not in rules.bias_positions(op.op)]
        for t in operands:
            if t.source and t.source.startswith("param:"):
                srcs.add(t.source[6:])
            elif t.tid in origin:
                srcs.add(origin[t.tid])
        passes = fam == "view" or str(op.op.overloadpacket) in rules.PASS_THROUGH or (fp8 and _fp8_cast(op, origin))
        if passes and srcs:
            for t in op.outputs:
                origin[t.tid] = next(iter(srcs))
        if fam == "model" and srcs:
            used |= srcs
            ops_with_param.add(i)
    return used, ops_with_param


def _layer_roles(spec: ModelSpec, ref: Recording, container: str | None, precision: str):
    """How each layer of the L=2 fit recordings folds: ``role(module, name=None)``.

    Returns a function giving ``(keep, repeat, folded_name)`` for a module path (and an optional
    parameter name). When both blocks run the same ops, block 0 stands for all L. When they
    differ (the first block needs no input gradient, say), one more recording at L = 3 tells
    which end block is special: it is kept with repeat 1 and the other stands for the L - 1
    generic blocks.

    Raises:
        SymcostError: both end blocks differ from the middle one.
    """
    L = SYMS["L"]
    one = sympy.Integer(1)

    def seqs(rec):
        # each block's ops with their shapes, then the tensors it saves: a block whose input
        # another module already saved (the first block of a CNN after the stem's ReLU, whose
        # output it is) saves one tensor less than the others while running the same ops; blocks
        # that run the same ops on other sizes (a WaveNet's dilations 1, 2, 4: each pads by its
        # own) are no repeats of one block either
        out: dict[int, list[str]] = {}
        for op in rec.ops:
            layer = _layer_of(op.module, container)
            if layer is not None:
                out.setdefault(layer, []).append(
                    f"{op.name}{[t.shape for t in op.inputs]}{[t.shape for t in op.outputs]}")
        for s in rec.saved:
            layers = {_layer_of(m, container) for m in s.also | {s.module}}
            if len(layers) == 1 and None not in layers:
                out.setdefault(layers.pop(), []).append(f"saved {s.dtype}")
        return out

    generic, special, repeat = 0, None, L
    if container is not None and spec.lead_blocks:
        n = spec.lead_blocks  # n leading blocks of one kind, recorded at L = n + 2
        s2 = seqs(ref)
        if len(s2) != n + 2 or any(s2[i] != s2[0] for i in range(n)) or s2[n] != s2[n + 1]:
            raise Unvariable("L", f"the blocks of {container} are not {n} leading blocks of one kind and "
                                  "the others of another, so L is not folded")
        return _lead_roles(container, n)
    if container is not None:
        s2 = seqs(ref)
        if len(s2) >= 2 and s2[0] != s2[1]:
            from symcost.tracing.record import record  # (imports torch: on first use)

            s3 = seqs(record(spec, dict(ref.values, L=FIT_L + 1), precision))
            if s3[1] == s3[2] and s3[0] != s3[1]:
                generic, special = 1, 0
            elif s3[0] == s3[1] and s3[2] != s3[1]:
                generic, special = 0, 1
            else:
                differ = sorted(i for i in s3 if s3[i] != s3[0])
                raise Unvariable("L", (
                    f"the blocks of {container} run different ops or sizes (traced at L = {FIT_L + 1}: "
                    f"block{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))} of {len(s3)} "
                    f"differ{'s' if len(differ) == 1 else ''} from block 0), so L is not folded"))
            repeat = L - 1

    def role(module: str, name: str | None = None):
        layer = _layer_of(module, container)
        full = module if name is None else name
        if layer is None:
            return True, one, full
        if layer == generic:
            return True, repeat, _fold_name(full, container)
        if layer == special:
            if special == 0:
                return True, one, full
            return True, one, _rename_block(full, container, "{L-1}")
        return False, one, full

    return role


def _lead_roles(container: str, n: int):
    """The fold of n leading blocks of one kind before L - n blocks of another
    (``ModelSpec.lead_blocks``; recorded at L = n + 2): block 0 stands for the n leading blocks
    (repeat n, named ``{container}.{0..n-1}``), block n for the others (repeat L - n, named
    ``{container}.{i}``); blocks 1..n-1 and n+1 are dropped."""
    L = SYMS["L"]
    one = sympy.Integer(1)

    def role(module: str, name: str | None = None):
        layer = _layer_of(module, container)
        full = module if name is None else name
        if layer is None:
            return True, one, full
        if layer == 0:
            return True, sympy.Integer(n), _rename_block(full, container, f"{{0..{n - 1}}}")
        if layer == n:
            return True, L - n, _fold_name(full, container)
        return False, one, full

    return role


def _middle(spec: ModelSpec) -> int:
    """1 where the probes hold one more block, so that a middle block stands for the L - 2
    between the first and the last, else 0: a data-parallel trace (FSDP2 keeps each unit's
    collective buffers until the next unit's, ``tracing.schedule.fit_schedule(middle=True)``)
    and a sequence-parallel one (the first block can free what the layers before it left
    whole: cs336-lm's first block holds 2·B·S·d/TP bytes less than the others, so block 0
    cannot stand for the L - 1 before the last). Tensor parallelism without SP keeps two
    blocks: its peak equals MemTracker's on megatron-gpt (tests), gpt2 and cs336-lm
    (docs/parallel.md §11)."""
    layout = layout_of(spec)
    return 1 if (layout.shard or layout.sp) and not spec.lead_blocks and "L" in spec.symbols else 0


def _align(recs: list[Recording], spec: ModelSpec) -> None:
    ref = recs[0]
    for r in recs[1:]:
        if len(r.ops) != len(ref.ops) or any(a.name != b.name for a, b in zip(r.ops, ref.ops)):
            i = next((i for i, (a, b) in enumerate(zip(r.ops, ref.ops)) if a.name != b.name),
                     min(len(r.ops), len(ref.ops)))
            a = ref.ops[i].name if i < len(ref.ops) else "<end>"
            b = r.ops[i].name if i < len(r.ops) else "<end>"
            raise SymcostError(
                f"{spec.name}: the ops it runs change with the sizes ({a} at {ref.values} but {b} "
                f"at {r.values}, op #{i}); size-dependent control flow cannot get one formula"
            )
        if len(r.saved) != len(ref.saved) or set(r.params) != set(ref.params):
            raise SymcostError(f"{spec.name}: saved tensors or parameters change with the sizes")
