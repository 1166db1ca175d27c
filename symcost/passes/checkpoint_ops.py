"""Op-level selective recomputation: which tensors inside a block to keep, solved as an ILP.

Takes an :class:`~symcost.graph.analysis.Analysis`, returns plain data. The block's forward ops come
from the traced graph (one generic block); each non-view op ("base") either keeps its outputs for
the backward (``save``) or is recomputed during the backward (``recompute``), as in Checkmate
(Jain et al. 2020, "Checkmate: Breaking the Memory Wall with Optimal Tensor Rematerialization",
Sec. 4, here with one recomputation phase per block, i.e. a block checkpointed with PyTorch's
selective checkpoint API):

    minimise   Σ_b cost_b · r_b                (recompute FLOPs, all-FLOPs count of symcost.graph.rules)
    subject to s_b + r_b ≥ 1                   for every base whose output the backward reads
               r_b ≤ s_u + r_u                 for every in-block base u that b reads
               Σ_b bytes_b · s_b ≤ budget      (bytes kept per block)
               s_b, r_b ∈ {0, 1}

and r_b = 0, s_b = 1 for a collective (a ``c10d``/``_c10d_functional`` op: recomputing it would run the
communication again, and under tensor parallelism the other ranks would have to join it; torchtitan's
selective policy saves every collective's output, ``_save_list`` in
torchtitan/distributed/activation_checkpoint.py, and so does :meth:`OpPlan.policy`),
solved with ``scipy.optimize.milp`` (HiGHS). Views are free and follow their base; inputs from
outside the block (the block input, parameters, buffers) are always there (a checkpoint keeps
the block input). Korthikanti et al. 2022's selective recomputation (recompute the attention
core, keep the rest) is the solution at the budget that drops the s²-sized tensors.

:meth:`OpPlan.apply` checkpoints each block with ``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False, context_fn=...)`` and a policy from
``torch.utils.checkpoint.create_selective_checkpoint_contexts`` that saves the chosen ops' outputs
(``MUST_SAVE``) and recomputes the rest (``PREFER_RECOMPUTE``); ops are told apart by their aten
overload and their occurrence in the block's forward, as the trace recorded them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import sympy

from symcost.errors import SymcostError
from symcost.tracing.fit import SYMS


@dataclass
class BlockGraph:
    """The generic block's forward: bases (non-view ops) and the tensors they output.

    A tensor is ``(base op index, output position)``; views are free and stand for their base's
    tensor. ``needed``: tensors the backward reads; ``inputs[b]``: in-block tensors base b reads.
    """

    bases: list[int]  # op indices
    name: dict[int, str]  # op index -> aten overload name
    occurrence: dict[int, int]  # op index -> occurrence of that overload in the block's forward
    tensors: list[tuple[int, int]]
    bytes: dict[tuple[int, int], sympy.Expr]  # bytes of a tensor (its storage)
    flops: dict[int, sympy.Expr]  # all-FLOPs of the base (rules)
    model_flops: dict[int, sympy.Expr]  # model FLOPs (FlopCounterMode's convention)
    needed: set[tuple[int, int]]
    inputs: dict[int, set[tuple[int, int]]]
    collectives: set[int] = dataclasses.field(default_factory=set)  # bases never recomputed


#: namespaces of the collectives: their outputs are always kept, never recomputed
COMM_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


def is_collective(name: str) -> bool:
    """Whether an op (``"ns.op.overload"``) is a collective (:data:`COMM_NAMESPACES`)."""
    return name.split(".", 1)[0] in COMM_NAMESPACES


def block_graph(an) -> BlockGraph:
    """The generic block of ``an`` (ops with ``repeat`` in L) as a :class:`BlockGraph`: symbolic
    sizes from ``an.ops``, tensor identity (which output each op reads) from the trace's data
    flow (``Analysis.dataflow``: the reference recording's, kept with a cached analysis).

    Raises:
        SymcostError: no one list of repeated blocks (several stacks:
            :func:`require_block_list`).
    """
    from symcost.graph import rules

    require_block_list(an)
    L = SYMS["L"]
    ops = [op for op in an.ops if op.phase == "forward" and op.layer is not None
           and sympy.sympify(op.repeat).has(L)]
    if not ops:
        raise SymcostError(f"{an.model} has no repeated blocks (no symbol L); nothing to checkpoint")
    flow = an.dataflow()
    if flow is None:
        raise SymcostError(f"{an.model}: this analysis has no data flow (trace it again)")
    inblock = {op.index: op for op in ops}
    first, last = min(inblock), max(inblock)
    tensor_of: dict[tuple[int, int], tuple[int, int]] = {}  # a tensor (op, output) -> its base tensor
    bases, name, occurrence, counts = [], {}, {}, {}
    inputs: dict[int, set] = {}
    nbytes, flops, mflops = {}, {}, {}
    for i in range(first, last + 1):
        if i not in inblock:
            continue
        op = inblock[i]
        reads = [tuple(t) for t in flow["inputs"][i]]
        made = [(i, k) for k in range(flow["outputs"][i])]
        occurrence[i] = counts.get(op.name, 0)
        counts[op.name] = occurrence[i] + 1
        name[i] = op.name
        ins = {tensor_of[t] for t in reads if t in tensor_of}
        if op.family == "view":
            src = [tensor_of[t] for t in reads if t in tensor_of]
            for t in made:
                if src:
                    tensor_of[t] = src[0]
            continue
        bases.append(i)
        inputs[i] = ins
        flops[i], mflops[i] = op.cost.flops_all, op.cost.flops
        for k, t in enumerate(made):
            tensor_of[t] = (i, k)
            nbytes[(i, k)] = rules.nbytes(op.out_shapes[k], op.out_dtypes[k])
    needed = set()
    nf, nb = flow["n_forward"], flow["n_backward"]
    for reads in flow["inputs"][nf:nf + nb]:
        for t in reads:
            if tuple(t) in tensor_of:
                needed.add(tensor_of[tuple(t)])
    return BlockGraph(bases, name, occurrence, sorted(nbytes), nbytes, flops, mflops, needed, inputs,
                      {b for b in bases if is_collective(name[b])})


@dataclass
class OpPlan:
    """Bases kept (``save``) and recomputed (``recompute``) in every block, with the per-block
    bytes kept and the recompute FLOPs (all-FLOPs and model FLOPs) at the sizes it was solved."""

    container: str
    L: int
    save: set[int]
    recompute: set[int]
    saved_bytes: int
    recompute_flops: int
    recompute_model_flops: int
    keys: set[tuple[str, int]]  # (aten overload, occurrence) of the saved ops

    def policy(self):
        """A fresh ``policy_fn(ctx, op, *args, **kwargs)`` for
        ``torch.utils.checkpoint.create_selective_checkpoint_contexts``."""
        from torch.utils.checkpoint import CheckpointPolicy

        counts = {True: {}, False: {}}

        def policy_fn(ctx, op, *args, **kwargs):
            c = counts[bool(ctx.is_recompute)]
            name = str(op)
            k = c.get(name, 0)
            c[name] = k + 1
            if (name, k) in self.keys or is_collective(name):  # (a collective's output: always kept)
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return policy_fn

    def context_fn(self):
        """``context_fn`` for ``checkpoint(..., use_reentrant=False, context_fn=...)``."""
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        return create_selective_checkpoint_contexts(self.policy())

    def apply(self, model):
        """Checkpoint every block of ``model`` with this selective policy, in place (non-reentrant,
        parameter names unchanged); returns the model.

        Raises:
            SymcostError: the container does not hold ``L`` blocks.
        """
        from torch.utils.checkpoint import checkpoint

        blocks = list((model.get_submodule(self.container) if self.container else model).children())
        if len(blocks) != self.L:
            raise SymcostError(f"the plan is for {self.L} blocks, the model has {len(blocks)}")
        for b in blocks:
            orig = b.forward

            def forward(*args, _orig=orig, **kwargs):
                return checkpoint(_orig, *args, use_reentrant=False, context_fn=self.context_fn, **kwargs)

            b.forward = forward
        return model


def solve(bg: BlockGraph, env: Mapping, budget: int | None = None) -> tuple[set, set[int]]:
    """The ILP above at sizes ``env`` with ``scipy.optimize.milp`` (HiGHS), with one keep
    variable per tensor and one recompute variable per base: ``(kept tensors, recomputed bases)``.

    ``budget`` None: keep every tensor the backward reads (no recomputation).

    Raises:
        SymcostError: no assignment keeps the block under ``budget`` bytes.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    ts, bases = bg.tensors, bg.bases
    nt, nb = len(ts), len(bases)
    tpos = {t: i for i, t in enumerate(ts)}
    bpos = {b: nt + i for i, b in enumerate(bases)}
    ev = lambda e: float(sympy.sympify(e).xreplace(env))  # noqa: E731
    size = np.array([ev(bg.bytes[t]) for t in ts])
    cost = np.array([ev(bg.flops[b]) for b in bases])
    eps = 1.0 / (1.0 + size.sum())  # ties: fewer bytes kept, fewer ops rerun
    c = np.concatenate([eps * size, cost + eps])
    rows, lo, hi = [], [], []

    def row(entries, low, high):
        r = np.zeros(nt + nb)
        for k, v in entries:
            r[k] += v
        rows.append(r), lo.append(low), hi.append(high)

    for t in bg.needed:
        row([(tpos[t], 1)] + ([] if budget is None else [(bpos[t[0]], 1)]), 1, np.inf)
    for b, ins in bg.inputs.items():
        for t in ins:
            row([(bpos[b], 1), (tpos[t], -1), (bpos[t[0]], -1)], -np.inf, 0)
    if budget is not None:
        row([(tpos[t], size[tpos[t]]) for t in ts], -np.inf, budget)
    lower, upper = np.zeros(nt + nb), np.ones(nt + nb)
    for b in bg.collectives:  # a collective is never recomputed, its outputs are kept (module docstring)
        upper[bpos[b]] = 0
    for t in ts:
        if t[0] in bg.collectives:
            lower[tpos[t]] = 1
    res = milp(c, constraints=LinearConstraint(np.array(rows), lo, hi), integrality=np.ones(nt + nb),
               bounds=Bounds(lower, upper))
    if res.status != 0 or res.x is None:
        raise SymcostError(f"no selective plan keeps a block under {budget} bytes")
    x = np.round(res.x).astype(int)
    keep = {t for t in ts if x[tpos[t]]}
    rec = {b for b in bases if x[bpos[b]]}
    return keep, rec


def op_plan(an, env: Mapping, budget: int | None = None, bg: BlockGraph | None = None) -> OpPlan:
    """The least-recompute :class:`OpPlan` keeping at most ``budget`` bytes per block."""
    bg = bg or block_graph(an)
    keep, rec = solve(bg, env, budget)
    ev = lambda e: int(sympy.sympify(e).xreplace(env))  # noqa: E731
    L = int(env[SYMS["L"]])
    save = {b for b, _ in keep} - rec
    return OpPlan(an.layer_container or "", L, save, rec,
                  sum(ev(bg.bytes[t]) for t in keep), sum(ev(bg.flops[b]) for b in rec),
                  sum(ev(bg.model_flops[b]) for b in rec), {(bg.name[b], bg.occurrence[b]) for b in save})


def tradeoff(an, env: Mapping, steps: int = 8) -> list[dict]:
    """Op-level trade-off: for budgets from keeping everything the backward reads down to the
    least that works, the ILP's least recompute: ``[{"budget", "saved_bytes",
    "recompute_flops", "recompute_model_flops", "recompute_ops"}]`` per block."""
    bg = block_graph(an)
    full = op_plan(an, env, None, bg)
    out = []
    for i in range(steps, -1, -1):
        budget = full.saved_bytes * i // steps
        try:
            p = op_plan(an, env, budget, bg)
        except SymcostError:
            break
        out.append({"budget": budget, "saved_bytes": p.saved_bytes, "recompute_flops": p.recompute_flops,
                    "recompute_model_flops": p.recompute_model_flops,
                    "recompute_ops": sorted(bg.name[b].removeprefix("aten.") for b in p.recompute)})
    return out


def require_block_list(an) -> None:
    """Check that ``an`` has the one list of ``L`` repeated blocks the checkpoint planner plans
    over (a chain of blocks: the √L law, optimal segments, docs/checkpoint.md).

    Raises:
        SymcostError: several stacks of blocks (an encoder-decoder's, each folded under its own
            length symbol, :attr:`Analysis.stacks`): one line saying this planner plans one block
            list, that :func:`symcost.passes.checkpoint.stacks.analyse_stacks` plans several and that
            ``--ac full|selective`` checkpoints every block of every stack; or no
            repeated blocks (L is not a symbol).
    """
    stacks = getattr(an, "stacks", None) or {}
    if stacks:
        raise SymcostError(
            f"{an.model} has {len(stacks)} stacks of blocks ({', '.join(f'{c}: {s}' for c, s in stacks.items())}); "
            "this planner plans one chain of L blocks (symcost checkpoint plans each stack's blocks: "
            "symcost.passes.checkpoint.stacks.analyse_stacks); report --ac full|selective checkpoints every block "
            "of every stack")
    if "L" not in an.symbols or an.layer_container is None:
        raise SymcostError(f"{an.model} has no repeated blocks (no symbol L); nothing to checkpoint")

