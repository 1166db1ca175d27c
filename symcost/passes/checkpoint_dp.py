"""The exact search over activation-checkpoint plans of a chain of blocks (plain integers).

A *plan* checkpoints some segments ``[i, j)`` of the chain ``0 .. n-1``; the other blocks run
plainly. What a plan costs is given by :class:`Costs`, tables in bytes and FLOPs indexed by
position, so one search serves the cost models of :mod:`symcost.passes.checkpoint`: the textbook
segment model (:meth:`Costs.segment_model`, Chen et al. 2016) and the step's peak composed from
the traced schedules (``StepSchedule.costs``). Walking the chain from the first block, ``K`` is
what the blocks so far keep for the backward and ``D`` what they hold only until the forward
ends (autocast's cache of weight casts); an item (a plain block or a segment) that starts at
``(K, D)`` fits under a peak ``P`` when its offsets do:

* plain block i: ``K += kp[i]``, ``D += dp[i]``; fits when ``K + cp[i] <= P`` and
  ``K + D + cpf[i] <= P``;
* segment [i, j): ``K += ks[i][j]``, ``D += ds[i][j]``; fits when ``K + W[i][j] <= P`` and
  ``K + D + Wf[i][j] <= P``; recomputes ``rec[i][j]``;
* the plan's peak is ``max(floor, every such left-hand side)``, its recompute the sum.

Every offset only adds to ``K`` and ``K + D``, so less of either is never worse: this is what
makes the search exact with a bounded state (docs/checkpoint.md, "The exact optimum").

* :func:`search` with ``objective="peak"``: the least peak; the states after each block are the
  front of (K, K + D, running peak) — a state is dropped when another has none of the three
  larger — at most one per distinct (K, D).
* :func:`search` with ``objective="recompute"``: the least recompute within a peak P, ties to
  the least peak; the front of (K, K + D, (recompute, running peak) in lexicographic order).
* :meth:`Costs.optimal`: (a) without a budget the least peak, then the least recompute at that
  peak; (b) with a budget the least recompute, ties to the least peak.

Only canonical plans are searched (:func:`_forbidden`): on a chain of alike blocks, "segments,
then plain blocks", so the states that start segments are one per number of segments, and a
state after which only plain blocks can follow is settled at once. With blocks of arbitrary sizes
the least-recompute problem contains 0/1 knapsack (segments of one block with free inputs: each
block either keeps its bytes or reruns its FLOPs under a byte cap), so no exact algorithm is
polynomial in n alone; the front is bounded by the distinct values of (K, D).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Sequence

from symcost.errors import SymcostError


@dataclass
class Costs:
    """Per-position costs of a chain of ``n`` blocks (see the module docstring).

    ``kp``, ``dp``, ``cp``, ``cpf``: lists of n integers; ``ks``, ``ds``, ``W``, ``Wf``,
    ``rec``: (n+1)×(n+1) nested lists, ``[i][j]`` for the segment ``[i, j)``,
    ``0 <= i < j <= n``; ``floor``: the plan-independent part of the peak (bytes). A ``None``
    offset is no constraint (a ``W[i][j]`` of None: the segment is not allowed); ``dp``,
    ``ds``, ``cpf``, ``Wf`` may be None as a whole (no ``D``: nothing held only in the forward).
    """

    kp: list
    cp: list
    ks: list
    W: list
    rec: list
    floor: int = 0
    dp: list | None = None
    cpf: list | None = None
    ds: list | None = None
    Wf: list | None = None
    _np: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def n(self) -> int:
        return len(self.kp)

    @classmethod
    def segment_model(cls, a: Sequence[int], x: Sequence[int], f: Sequence[int], head: int = 0,
                      fr: Sequence[int] | None = None) -> "Costs":
        """The segment model of Chen et al. 2016 (Sec. 4) with the order of the backward of
        Griewank & Walther's revolve, per block ``a`` (bytes saved inside), ``x`` (bytes a
        checkpoint keeps: the block's input), ``f`` (forward FLOPs), ``fr`` (FLOPs rerun when the
        block ends its segment, default ``f``) and ``head`` (bytes the step holds at the end of
        the forward besides the blocks' activations). A plain block keeps ``a_i``; a segment
        keeps ``x_i`` and, while recomputed in the backward, holds ``x_i + Σ a`` on top of what
        was kept before it; the end of the forward holds everything kept plus ``head``.
        """
        n = len(a)
        fr = list(f) if fr is None else list(fr)
        if not (len(x) == len(f) == len(fr) == n):
            raise SymcostError(f"a, x, f, fr need one entry per block; got lengths {n}, {len(x)}, {len(f)}, {len(fr)}")
        pa, pf = _prefix(a), _prefix(f)
        cp: list = [None] * n
        if n:
            cp[n - 1] = a[n - 1] + head
        ks = [[0] * (n + 1) for _ in range(n + 1)]
        W: list = [[None] * (n + 1) for _ in range(n + 1)]
        rec = [[0] * (n + 1) for _ in range(n + 1)]
        for i in range(n):
            for j in range(i + 1, n + 1):
                ks[i][j] = x[i]
                w = x[i] + pa[j] - pa[i]
                W[i][j] = max(w, x[i] + head) if j == n else w
                rec[i][j] = pf[j - 1] - pf[i] + fr[j - 1]
        return cls(list(a), cp, ks, W, rec, 0 if n else max(0, head))

    def cost(self, segments: Sequence[tuple[int, int]]) -> tuple[int, int]:
        """(peak, recompute) of checkpointing ``segments`` (``[start, end)`` pairs, disjoint).

        Raises:
            SymcostError: segments out of range, empty or overlapping, or not allowed.
        """
        n = self.n
        starts: dict = {}
        for s, e in sorted(segments):
            if not (0 <= s < e <= n) or any(s < e2 and s2 < e for s2, e2 in starts.items()):
                raise SymcostError(f"segments must be disjoint [start, end) ranges within 0..{n}; got {list(segments)}")
            starts[s] = e
        K, D, peak, rec, i = 0, 0, self.floor, 0, 0

        def top(v, off):
            return peak if off is None else max(peak, v + off)

        while i < n:
            if i in starts:
                e = starts[i]
                if self.W[i][e] is None:
                    raise SymcostError(f"the segment [{i}, {e}) is not allowed by this cost model")
                peak = top(K, self.W[i][e])
                if self.Wf is not None:
                    peak = top(K + D, self.Wf[i][e])
                rec += self.rec[i][e]
                K += self.ks[i][e]
                D += self.ds[i][e] if self.ds is not None else 0
                i = e
            else:
                peak = top(K, self.cp[i])
                if self.cpf is not None:
                    peak = top(K + D, self.cpf[i])
                K += self.kp[i]
                D += self.dp[i] if self.dp is not None else 0
                i += 1
        return peak, rec

    def optimal(self, budget: int | None = None) -> tuple[list[tuple[int, int]], int, int]:
        """The exact optimum: without ``budget`` the least peak (ties: least recompute); with
        ``budget`` (bytes) the least recompute whose peak is ``<= budget`` (ties: least peak).

        Returns ``(segments, peak, recompute)`` with ``cost(segments) == (peak, recompute)``.

        Raises:
            SymcostError: no plan fits ``budget`` (the message gives the least peak).
        """
        if budget is None:
            pk = least_peak(self)
            segs, rec = search(self, pk, "recompute")
            return segs, pk, rec  # nothing peaks lower: the least recompute within pk peaks at pk
        found = search(self, budget, "recompute")
        if found is None:
            raise SymcostError(f"no checkpoint plan keeps the peak under {budget} bytes "
                               f"(the least possible is {least_peak(self)} bytes)")
        segs, rec = found
        return segs, self.cost(segs)[0], rec

    # -- numpy tables ------------------------------------------------------------------------------
    def _tables(self) -> dict:
        """The tables as numpy arrays (cached): int64 where every sum the search forms fits,
        else Python integers (``object``); ``none`` is an offset that never fits."""
        import numpy as np

        t = self._np.get("tables")
        if t is not None:
            return t
        n = self.n
        rows = lambda m: [v for row in m for v in row] if m is not None else []  # noqa: E731
        vals = self.kp + (self.dp or []) + [self.floor] + rows(self.ks) + rows(self.ds) + rows(self.rec)
        vals += [v for v in self.cp + (self.cpf or []) + rows(self.W) + rows(self.Wf) if v is not None]
        big = 4 * sum(abs(v) for v in vals) + 1
        dt = np.int64 if big < 2**60 else object
        # NONE: a segment that is not allowed never fits; NEG: no constraint always does (any
        # budget the search gets lies between them, "no budget" at NONE // 2)
        NONE = 2**61 if dt is np.int64 else 4 * big
        arr = lambda m, x: np.array([[x if v is None else v for v in row] for row in m], dtype=dt)  # noqa: E731
        vec = lambda v: np.array([-NONE if x is None else x for x in v], dtype=dt)  # noqa: E731
        zeros2 = [[0] * (n + 1) for _ in range(n + 1)]
        t = {"dt": dt, "none": NONE, "kp": vec(self.kp), "dp": vec(self.dp or [0] * n),
             "cp": vec(self.cp), "cpf": vec(self.cpf or [None] * n),
             "ks": arr(self.ks, 0), "ds": arr(self.ds or zeros2, 0), "W": arr(self.W, NONE),
             "Wf": arr(self.Wf or [[None] * (n + 1) for _ in range(n + 1)], -NONE), "rec": arr(self.rec, 0),
             "flat": self.dp is None and self.ds is None}
        for key, src in (("wmin", "W"), ("wfmin", "Wf")):  # least offset of a segment from i ending at j or later
            m = t[src].copy()
            for j in range(n - 1, -1, -1):
                m[:, j] = np.minimum(m[:, j], m[:, j + 1])
            t[key] = m
        forbid = _forbidden(self)
        t["forbid"] = np.array(forbid, dtype=bool)
        never = [all(forbid[i][i + 1:]) for i in range(n + 1)]
        t["never"] = np.array(never)
        # after a plain block at j where no segment may start again only plain blocks follow:
        # their largest offsets on K and on K + D (tail[j], tailf[j]; None: none)
        tail: list = [None] * (n + 1)
        tailf: list = [None] * (n + 1)
        only = [False] * (n + 1)
        dp = self.dp or [0] * n
        cpf = self.cpf or [None] * n
        for j in range(n - 1, 0, -1):
            only[j] = never[j] and (j == n - 1 or only[j + 1])
            for store, own, step in ((tail, self.cp[j], self.kp[j]), (tailf, cpf[j], self.kp[j] + dp[j])):
                nxt = store[j + 1]
                cands = [v for v in (own, None if nxt is None else step + nxt) if v is not None]
                store[j] = max(cands) if cands else None
        t["only"], t["tail"], t["tailf"] = only, tail, tailf
        self._np["tables"] = t
        return t


def _prefix(v: Sequence[int]) -> list[int]:
    out = [0]
    for t in v:
        out.append(out[-1] + t)
    return out


def least_peak(c: Costs) -> int:
    """The least peak (bytes) of any plan of ``c`` (:func:`search`, exact; cached)."""
    if "least_peak" not in c._np:
        segs, _ = search(c, None, "peak")
        c._np["least_peak"] = c.cost(segs)[0]
    return c._np["least_peak"]


def _forbidden(c: Costs) -> list[list[bool]]:
    """``forbid[i][j]``: after a plain block ``i-1``, the search starts no segment ``[i, j)``.

    Canonical plans: a plain block ``i-1`` followed by the segment ``[i, j)`` can be swapped for
    the segment ``[i-1, j-1)`` followed by the plain block ``j-1`` whenever, from the tables,
    the swap leaves no more ``K`` and no more ``D`` after both, recomputes no more, and peaks no
    higher within them on ``K`` and on ``K + D`` alike (what is kept before them is the same,
    and what comes after sees no more). Swapping moves a plain block to the right, so repeated
    swaps end, in a plan without such a pair that is no worse in peak and recompute. On a chain
    of alike blocks where a block keeps more than its segment's input this is "segments first,
    then plain blocks".
    """
    n = c.n
    ds = c.ds
    dp = c.dp or [0] * n
    cpf = c.cpf or [None] * n
    Wf = c.Wf
    forbid = [[False] * (n + 1) for _ in range(n + 1)]

    def mx(*vs):
        vs = [v for v in vs if v is not None]
        return max(vs) if vs else None

    def le(a, b):  # offset a never above offset b (None: no constraint)
        return a is None or (b is not None and a <= b)

    for i in range(1, n):
        for j in range(i + 1, n + 1):
            w_old, w_new = c.W[i][j], c.W[i - 1][j - 1]
            if w_old is None or w_new is None:
                continue
            ks_new, ks_old = c.ks[i - 1][j - 1], c.ks[i][j]
            ds_new = ds[i - 1][j - 1] if ds is not None else 0
            ds_old = ds[i][j] if ds is not None else 0
            if ks_new + c.kp[j - 1] > c.kp[i - 1] + ks_old or ds_new + dp[j - 1] > dp[i - 1] + ds_old:
                continue
            if c.rec[i - 1][j - 1] > c.rec[i][j]:
                continue
            kp0 = c.kp[i - 1]
            new_b = mx(w_new, None if c.cp[j - 1] is None else ks_new + c.cp[j - 1])
            old_b = mx(c.cp[i - 1], kp0 + w_old)
            if not le(new_b, old_b):
                continue
            if Wf is not None or c.cpf is not None:
                wf_new = Wf[i - 1][j - 1] if Wf is not None else None
                wf_old = Wf[i][j] if Wf is not None else None
                new_f = mx(wf_new, None if cpf[j - 1] is None else ks_new + ds_new + cpf[j - 1])
                old_f = mx(cpf[i - 1], None if wf_old is None else kp0 + dp[i - 1] + wf_old)
                if not le(new_f, old_f):
                    continue
            forbid[i][j] = True
    return forbid


def _front(K, KF, pair, PH, flat):
    """Indices (into the arrays) of the states no other state beats: ``PH`` marks a state after a
    plain block (any state may beat it), the others are beaten by states not after a plain block
    only. A state is beaten by one with no more ``K``, no more ``KF`` and no larger ``pair``
    (ties: the first in (K, KF, PH, pair) order). ``flat``: ``KF - K`` is the same for all
    (one dimension less, numpy only)."""
    import numpy as np

    order = np.lexsort((pair, PH, KF, K))
    big = np.iinfo(np.int64).max
    if flat or len(order) <= 1:
        ps, ph = pair[order], PH[order]
        inf = np.array([big], dtype=np.int64)
        all_min = np.minimum.accumulate(np.concatenate([inf, ps]))[:-1]
        seg_min = np.minimum.accumulate(np.concatenate([inf, np.where(ph, big, ps)]))[:-1]
        keep = np.where(ph, ps < all_min, ps < seg_min)
        return order[keep]
    # two kept quantities: staircases over (KF, pair) of the states so far, in K order
    out = []
    stairs = ([], [], [], [])  # KF and pair of the kept states after a segment; of all kept states
    KFl, pl, phl = KF[order].tolist(), pair[order].tolist(), PH[order].tolist()
    for q in range(len(order)):
        kf, p, ph = KFl[q], pl[q], phl[q]
        xs, ys = (stairs[2], stairs[3]) if ph else (stairs[0], stairs[1])
        at = bisect.bisect_right(xs, kf)
        if at and ys[at - 1] <= p:
            continue  # an earlier state with no more K, KF and pair
        out.append(order[q])
        for xs, ys in [(stairs[2], stairs[3])] + ([] if ph else [(stairs[0], stairs[1])]):
            at = bisect.bisect_right(xs, kf)
            end = at
            while end < len(xs) and ys[end] >= p:
                end += 1
            del xs[at:end], ys[at:end]
            xs.insert(at, kf)
            ys.insert(at, p)
    return np.array(out, dtype=np.int64)


def search(c: Costs, P: int | None, objective: str = "recompute"):
    """``(segments, recompute)`` of the best canonical plan with peak ``<= P`` (None: no bound),
    or None if no plan fits. ``objective``: ``"recompute"`` — the least (recompute, peak) in
    lexicographic order; ``"peak"`` — the least peak (its recompute not minimised).

    The DP over the blocks: after each block the front of states (K, K + D, objective) — a
    state is dropped when another has no more K, no more K + D and an objective no worse, since
    whatever follows the dropped one fits the other too with no more recompute and peak. So the
    front holds at most one state per distinct (K, D) (and recompute). A state that follows a
    plain block starts no segment :func:`_forbidden` rules out; one after which only plain blocks
    can follow is settled at once. numpy, exact integers (int64, or Python integers where the
    sums could overflow it).
    """
    import numpy as np

    n = c.n
    t = c._tables()
    dt, NONE = t["dt"], t["none"]
    if P is None:
        P = NONE // 2
    if c.floor > P:
        return None
    if n == 0:
        return [], 0
    KP, DP, CP, CPF = t["kp"], t["dp"], t["cp"], t["cpf"]
    KS, DS, WW, WF, RC = t["ks"], t["ds"], t["W"], t["Wf"], t["rec"]
    wmin, wfmin, forbid, never = t["wmin"], t["wfmin"], t["forbid"], t["never"]
    by_rec = objective == "recompute"
    parents, starts = [np.array([-1])], [np.array([-1])]  # per state id: parent id, segment start (-1: plain)
    nid = 1
    i64 = lambda v: np.asarray(v, dtype=np.int64)  # noqa: E731
    zero = np.zeros(1, dtype=dt)
    # a state: (id, position, K, K + D, recompute, running peak, follows a plain block)
    front = (i64([0]), i64([0]), zero, zero, zero, np.array([c.floor], dtype=dt), np.zeros(1, dtype=bool))
    alive = front
    done = None  # the best plan settled early: (key, id, position, recompute)

    def better(key):
        return done is None or key < done[0]

    for j in range(1, n + 1):
        fid, _, fk, fkf, frec, fpk, _ = front
        okp = (fk + CP[j - 1] <= P) & (fkf + CPF[j - 1] <= P)
        pk_p = np.maximum(fpk, np.maximum(fk + CP[j - 1], fkf + CPF[j - 1]))
        aid, apos, ak, akf, ar, apk, aph = alive
        still = (ak + wmin[apos, j] <= P) & (akf + wfmin[apos, j] <= P)
        alive = tuple(v[still] for v in alive)
        aid, apos, ak, akf, ar, apk, aph = alive
        wb, wf = ak + WW[apos, j], akf + WF[apos, j]
        go = (wb <= P) & (wf <= P) & ~(aph & forbid[apos, j])
        nplain = int(okp.sum())
        K = np.concatenate([(fk + KP[j - 1])[okp], ak[go] + KS[apos[go], j]])
        KF = np.concatenate([(fkf + KP[j - 1] + DP[j - 1])[okp], akf[go] + KS[apos[go], j] + DS[apos[go], j]])
        R = np.concatenate([frec[okp], ar[go] + RC[apos[go], j]])
        PKs = np.maximum(apk[go], np.maximum(wb[go], wf[go]))
        PK = np.concatenate([pk_p[okp], PKs])
        PH = np.concatenate([np.ones(nplain, dtype=bool), np.zeros(len(K) - nplain, dtype=bool)])
        par = np.concatenate([fid[okp], aid[go]])
        st = np.concatenate([np.full(nplain, -1, dtype=np.int64), apos[go]])
        if j < n and t["only"][j] and nplain:
            # plain blocks to the end are all that can follow these: settle them now
            tl, tf = t["tail"][j], t["tailf"][j]
            k_, kf_, r_, p_ = K[:nplain], KF[:nplain], R[:nplain], PK[:nplain]
            fits = np.ones(nplain, dtype=bool)
            if tl is not None:
                fits &= k_ + tl <= P
                p_ = np.maximum(p_, k_ + tl)
            if tf is not None:
                fits &= kf_ + tf <= P
                p_ = np.maximum(p_, kf_ + tf)
            for q in np.flatnonzero(fits):
                key = (int(r_[q]), int(p_[q])) if by_rec else (int(p_[q]),)
                if better(key):
                    parents.append(par[q:q + 1])
                    starts.append(st[q:q + 1])
                    done = (key, nid, j, int(r_[q]))
                    nid += 1
            K, KF, R, PK, PH, par, st = (v[nplain:] for v in (K, KF, R, PK, PH, par, st))
        if len(K) == 0:
            front = (i64([]), i64([]), K, K, K, K, np.zeros(0, dtype=bool))
            if len(alive[0]) == 0:
                break
            continue
        # the objective as one integer that orders like it: dense ranks
        _, p_rank = np.unique(PK, return_inverse=True)
        if by_rec:
            _, r_rank = np.unique(R, return_inverse=True)
            pair = r_rank.astype(np.int64) * (len(PK) + 1) + p_rank
        else:
            pair = p_rank.astype(np.int64)
        idx = _front(K, KF, pair, PH, t["flat"])
        ids = np.arange(nid, nid + len(idx), dtype=np.int64)
        nid += len(idx)
        parents.append(par[idx])
        starts.append(st[idx])
        front = (ids, np.full(len(idx), j, dtype=np.int64), K[idx], KF[idx], R[idx], PK[idx], PH[idx])
        if j < n:
            okn = (K[idx] + wmin[j, j + 1] <= P) & (KF[idx] + wfmin[j, j + 1] <= P) & ~(PH[idx] & never[j])
            alive = tuple(np.concatenate([u, v[okn]]) for u, v in zip(alive, front))
    fid, fpos, _, _, frec, fpk, _ = front
    for q in range(len(fid)):
        if fpos[q] == n:
            key = (int(frec[q]), int(fpk[q])) if by_rec else (int(fpk[q]),)
            if better(key):
                done = (key, int(fid[q]), n, int(frec[q]))
    if done is None:
        return None
    _, g, pos, rec = done
    par_all, st_all = np.concatenate(parents), np.concatenate(starts)
    segs = []
    while g > 0:
        s = int(st_all[g])
        if s >= 0:
            segs.append((s, pos))
            pos = s
        else:
            pos -= 1
        g = int(par_all[g])
    return sorted(segs), rec
