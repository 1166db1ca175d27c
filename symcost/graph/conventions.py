"""The quantities papers reason with, derived from the op graph: Kaplan et al.'s embedding and
non-embedding parameters, the parameters outside P, the causal count of attention matmuls, and the
6·N·P form of the training FLOPs with its exact remainder. :class:`Conventions` is mixed into
:class:`~symcost.graph.analysis.Analysis`.
"""
from __future__ import annotations

import functools

import sympy

from symcost.errors import SymcostError
from symcost.tracing.fit import SYMS
from symcost.graph import opsets
from typing import TYPE_CHECKING

from symcost._lazy import LazyModule

rules = LazyModule("symcost.graph.rules")

if TYPE_CHECKING:  # pragma: no cover
    from symcost.graph.analysis import Analysis
    from symcost.graph.ops import SymOp


class Conventions:
    """Needs ``graph``, ``ops``, ``param_shapes``, ``matmul_params``, ``tied``, ``pinned`` and the
    totals of :class:`~symcost.graph.totals.Totals`."""

    # -- quantities papers use (issue 6, item 9) ------------------------------------------------
    #: how attention matmuls are counted: "full" (S_q·S_k score pairs, FlopCounterMode) or
    #: "causal" (S·(S+1)/2 pairs; q·k - q·(q-1)/2 for q queries against k keys of a KV cache);
    #: see :meth:`with_attention_flops`
    attention_count = "full"

    def params_not_in_P(self) -> dict[str, list[str]]:
        """Parameters outside P, grouped by why: embedding lookups, biases, norms/elementwise."""
        pre = self.__dict__.get("_params_not_in_P")
        if pre is not None:  # read back with the analysis (from_dict)
            return {k: list(v) for k, v in pre.items()}
        out: dict[str, list[str]] = {}
        g = self.graph
        for name in self.param_shapes:
            if name in self.matmul_params:
                continue
            node = f"param:{name}"
            why = "other (unused in the forward)"
            frontier = list(g.successors(node)) if node in g else []
            while frontier:
                n = frontier.pop(0)
                d = g.nodes[n]
                if d.get("phase") != "forward":
                    continue
                if opsets.same_tensor(d):
                    frontier.extend(g.successors(n))
                    continue
                op = d.get("op", "")
                lookup = any(k in op for k in ("embedding", "aten.index", "index_select", "gather"))
                why = ("embedding lookups" if lookup else
                       "biases" if d.get("family") == "model" else "norms and elementwise scales")
                break
            out.setdefault(why, []).append(name)
        if self.tied:
            out["tied (counted once)"] = [f"{a} = {', '.join(b)}" for a, b in self.tied.items()]
        return out

    def _param_sources(self, node) -> set[str]:
        """Folded names of the parameters feeding op ``node`` directly or through views/casts."""
        g = self.graph
        out, stack, seen = set(), list(g.predecessors(node)), set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            d = g.nodes[n]
            if d.get("kind") == "param":
                out.add(str(n).partition(":")[2])
            elif opsets.same_tensor(d):
                stack.extend(g.predecessors(n))
        return out

    @functools.cached_property
    def embedding_params(self) -> dict[str, str]:
        """Parameters Kaplan et al. (2020, "Scaling Laws for Neural Language Models", section 2.1)
        leave out of N, by folded name -> why, derived from the traced forward graph:

        - ``"lookup"``: read by an embedding lookup (``embedding``, ``index_select``, ``index``,
          ``gather``, through views and dtype casts): token, position and token-type tables;
        - ``"position slice"``: a table of fixed size sliced to the sequence length (``slice`` or
          ``narrow`` whose output has S where the parameter has none: ``x + pos[:S]``);
        - ``"output projection"``: an operand (weight or bias) of a forward matmul-class op whose
          output has the vocabulary V in its last dimension — the final projection to the
          vocabulary (the "de-embedding"); when it is tied to the token table it is that table,
          counted once.

        Models without V (``mlp``) have no output projection; models without a lookup have none.
        A stack of E experts' parameters gathered per routed slot (transformers' ``grouped_mm``
        experts read their biases as ``bias[expert_ids]``, an ``index``) is no lookup table
        (:func:`symcost.graph.totals.is_routed`).
        """
        from symcost.graph.totals import is_routed

        g = self.graph
        out: dict[str, str] = {}
        lookups = ("aten.embedding", "aten.index_select", "aten.index", "aten.gather", "aten._embedding_bag")
        V = SYMS["V"]
        for n, d in g.nodes(data=True):
            if d.get("kind") != "op" or d.get("phase") != "forward":
                continue
            packet = d["op"].rsplit(".", 1)[0]
            if packet in lookups:
                for name in self._param_sources(n):
                    if not is_routed(self, name):  # (an expert bias gathered per routed slot is no table)
                        out.setdefault(name, "lookup")
            elif packet in ("aten.slice", "aten.narrow") and d["out_shapes"]:
                cut = {str(x) for e in d["out_shapes"][0] if isinstance(e, sympy.Basic) for x in e.free_symbols}
                for name in self._param_sources(n):
                    own = {str(x) for e in self.param_shapes[name][0] if isinstance(e, sympy.Basic)
                           for x in e.free_symbols}
                    if "S" in cut and "S" not in own:
                        out.setdefault(name, "position slice")
            elif d.get("family") == "model" and d["out_shapes"] and d["out_shapes"][0]:
                last = d["out_shapes"][0][-1]
                if isinstance(last, sympy.Basic) and V in last.free_symbols:
                    for name in self._param_sources(n):
                        out.setdefault(name, "output projection")
        return {k: out[k] for k in self.param_shapes if k in out}

    @functools.cached_property
    def params_embedding(self) -> sympy.Expr:
        """Embedding parameters (see :attr:`embedding_params`), tied ones once, a polynomial."""
        return self._param_total(set(self.embedding_params))

    @functools.cached_property
    def params_nonembedding(self) -> sympy.Expr:
        """Kaplan et al.'s N: every parameter (tied once) but the embedding ones — the blocks'
        weights, biases and norms and the final norm (Kaplan's 12·n_layer·d_model² leaves biases
        and norms out as small; this count keeps them, exactly)."""
        return sympy.expand(self.params - self.params_embedding)

    def causal_attention_cost(self, op: "SymOp") -> rules.Cost | None:
        """The causal count of one attention matmul, or None when it does not apply.

        An attention op (``op.attention``, or a fused attention kernel) multiplies q queries
        against k keys: its model FLOPs are ``a·q·k`` (q·k score pairs, as FlopCounterMode
        counts). Under a causal mask whose last query sees every key (the mask of a KV cache:
        query i of the step is token T + i and sees keys 0..T + i; Dao, "FlashAttention-2", 2023,
        sec. 3.1, aligns it the same way) query i meets k - q + 1 + i keys, so

            pairs = q·(k - q) + q·(q + 1)/2 = q·k - q·(q - 1)/2,

        for every product over the score matrix (Q·Kᵀ, P·V and their gradients; the recomputed
        scores of a fused backward): a 4-query, 10-key block has 34 of its 40 pairs. A training
        step or a prefill has q = k = S (S·(S+1)/2 pairs); an inference step with a cache of T
        tokens has q = S new queries and k = T + S keys (a decode step: q = 1, every pair is
        computed). q and k are read off the op's own formula, never typed per model: without T,
        FLOPs ``a·S²``; with T, FLOPs ``c·(T + q)`` with c = a·q the coefficient of T. Hardware
        FLOPs (``flops_hw``) are scaled by the same factor, and all-FLOPs drop by what hardware
        FLOPs drop; bytes stay (the unfused lower bound moves the full score
        matrix). Ops whose FLOPs are not of that form (S pinned in a training step, cross-attention
        with other key lengths) keep their count.
        """
        fused = op.family == "model" and "attention" in op.name
        if not (op.attention or fused):
            return None
        S, T = SYMS["S"], SYMS["T"]
        f = sympy.expand(op.cost.flops)
        if not isinstance(f, sympy.Basic):
            return None
        q = sympy.Integer(self.pinned["S"]) if "S" in self.pinned else S
        if T in f.free_symbols:
            c = sympy.expand(f.coeff(T, 1))  # a·q
            if c == 0 or sympy.expand(f - c * (T + q)) != 0:
                return None
            a = sympy.cancel(c / q)
        else:
            if "S" in self.pinned or S not in f.free_symbols:
                return None
            poly = sympy.Poly(f, S)
            if poly.monoms() != [(2,)]:
                return None
            a = poly.coeffs()[0]
        causal = sympy.expand(f - a * q * (q - 1) / 2)
        if causal == f:
            return None
        hw = sympy.expand(sympy.cancel(op.cost.flops_hw * causal / f))  # the same pairs, a fraction causal/f
        return rules.Cost(causal, sympy.expand(op.cost.flops_all - op.cost.flops_hw + hw), op.cost.bytes,
                          op.cost.transcendentals, hw)

    def with_attention_flops(self, count: str = "full") -> "Analysis":
        """This analysis with the attention matmuls counted ``"full"`` (S_q·S_k score pairs, as
        FlopCounterMode; the default) or ``"causal"`` (S·(S+1)/2 pairs, see
        :meth:`causal_attention_cost`). Only those ops change; ``attention_count`` says which.

        Raises:
            SymcostError: ``count`` is neither "full" nor "causal".
        """
        import dataclasses

        if count not in ("full", "causal"):
            raise SymcostError(f"unknown attention FLOP count {count!r}; accepted: full, causal")
        if count == self.attention_count:
            return self
        base = getattr(self, "_full", self)
        if count == "full":
            return base
        ops, graph = [], base.graph.copy()
        for op in base.ops:
            c = base.causal_attention_cost(op)
            if c is not None:
                op = dataclasses.replace(op, cost=c)
                if op.index in graph:
                    graph.nodes[op.index].update(flops=c.flops, flops_hw=c.flops_hw, flops_all=c.flops_all, intensity=(
                        sympy.cancel(c.flops_all / c.bytes) if c.bytes != 0 else 0))
            ops.append(op)
        new = dataclasses.replace(base, ops=ops, graph=graph)
        new.pinned = dict(base.pinned)
        new.timings = dict(base.timings)
        new.attention_count = count
        new._full = base
        if base.__dict__.get("_stored_fusion") is not None:  # fused bytes do not change with the count
            new.__dict__["_stored_fusion"] = base.__dict__["_stored_fusion"]
        return new

    def train_simplified_str(self) -> str:
        """``"6*B*S*(P) + remainder"`` as text, 6·N·P first (sympy would reorder the terms); an
        encoder-decoder's ``"6*B*S_enc*(P_enc) + 6*B*S*(P_dec) + remainder"`` (:meth:`token_groups`).

        Parses with :func:`symcost.parse_formula` (or ``sympy.sympify`` with those locals) to
        ``flops("train")``.
        """
        _, rem, _ = self.train_simplified()
        tp, cp = self.tp_share(), self.cp_share()
        heads = []
        for names, P in self.token_groups():
            n = "*".join(names)
            head = f"6*{n}*({P})" if n else f"6*({P})"
            if tp != 1:
                head += f"/{tp}"
            if cp != 1:
                head += f"/{cp}"
            heads.append(head)
        head = " + ".join(heads)
        if rem == 0:
            return head
        text = str(rem)
        # (sympy prints a leading minus on the first term only: "-36*x + 2*y" is head - 36*x + 2*y)
        return f"{head} - {text[1:]}" if text.startswith("-") else f"{head} + {text}"

    def tp_share(self):
        """The tensor-parallel size a rank's matmul work is divided by: ``TP`` (the symbol, or its
        pinned value) for a ``--tp`` trace, else 1 (Shoeybi et al. 2019, §3: each rank runs 1/t
        of every split matmul), on the 2-D mesh (``--dp`` with ``--tp``) too."""
        if not ((getattr(self, "parallel", None) or "").startswith("tp") or getattr(self, "tensor_parallel", None)):
            return sympy.Integer(1)
        return sympy.Integer(self.pinned["TP"]) if "TP" in self.pinned else SYMS["TP"]

    def cp_share(self):
        """The context-parallel size a rank's tokens are divided by: ``CP`` (the symbol, or its
        pinned value) for a ``--cp`` trace, else 1. A context-parallel rank's step holds S/CP of
        each sequence's tokens (:mod:`symcost.frontends.context_parallel`), so its N of 6·N·P is
        B·S/CP, as ``time --cp`` counts (:func:`symcost.passes.roofline.tokens_compute`)."""
        from symcost.frontends.layout import layout_of

        if not layout_of(self).cp:
            return sympy.Integer(1)
        return sympy.Integer(self.pinned["CP"]) if "CP" in self.pinned else SYMS["CP"]

    def n_symbols(self) -> tuple[str, ...]:
        """The sizes whose product is the N of 6·N·P (per rank: over :meth:`cp_share`): ``("B",
        "S")``, or ``("B",)`` for a model without a sequence (S neither pinned nor in its training
        FLOPs: a conv net on images, whose N counts the B samples of the step), so that the form
        and its remainder hold no symbol the totals lack."""
        if "S" not in self.pinned and SYMS["S"] not in sympy.sympify(self.flops("train")).free_symbols:
            return ("B",)
        return ("B", "S")

    def token_groups(self) -> list[tuple[tuple[str, ...], sympy.Expr]]:
        """The N·P pairs of the 6·N·P form: ``[(names of N's factors, P)]``.

        One pair, ``(n_symbols(), params_active_matmul)``, for a model whose matmul weights all
        see the same tokens. An encoder-decoder (a symbol ``S_enc``, one device or ``--dp``) has
        two: its encoder's weights process the B·S_enc source tokens, its decoder's and the
        head the B·S target tokens, the convention of Raffel et al. 2020 (T5, §3.2.2: an
        encoder-decoder of L + L layers costs about a decoder-only model of L layers, "the
        encoder is only applied to the input sequence and the decoder is only applied to the
        output sequence"); Kaplan et al.'s 6·N·D counts one stack on every token. The pairs come
        from the graph: half the forward FLOPs of the matmuls with a weight operand
        (:attr:`Analysis.attention` false), 2·Σ tokens·weight elements, split by monomial:
        ``P_enc`` is its coefficient of B·S_enc (the encoder's weights and the cross-attention's
        key/value projections, which read the encoder's output; a weight that reads 2·S_enc
        positions per sequence, Whisper's first convolution, counts twice), ``P_dec`` that of B·S.
        The remainder (:meth:`train_simplified`) is then the attention matmuls' FLOPs, where
        6·B·S·P put the encoder's weights on the decoder's tokens (negative terms), less an input
        gradient no one needs (Whisper's first convolution on the mel features:
        −12·B·D·H·N_mel·S_enc). Under
        ``--tp``/``--cp``, or where B, S or S_enc is pinned, the single pair."""
        one = [(self.n_symbols(), self.params_active_matmul)]
        names = {s.name: s for s in sympy.sympify(self.flops("train")).free_symbols}
        if ("S_enc" not in names or "B" not in names or "S" not in names or self.tp_share() != 1
                or self.cp_share() != 1 or self.params_active_matmul != self.params_matmul):
            return one
        B, S, Se = names["B"], names["S"], names["S_enc"]
        fwd = sympy.expand(sympy.Add(*[op.repeat * op.cost.flops for op in self.ops
                                       if op.phase == "forward" and op.family == "model" and not op.attention]) / 2)
        poly = sympy.Poly(fwd, B, S, Se)
        enc = sympy.expand(sympy.Add(*[c for m, c in poly.terms() if m == (1, 0, 1)]))
        dec = sympy.expand(sympy.Add(*[c for m, c in poly.terms() if m == (1, 1, 0)]))
        if enc == 0 or dec == 0:
            return one
        return [(("B", "S_enc"), enc), (("B", "S"), dec)]

    def six_np_pairs(self) -> list[tuple[tuple[sympy.Expr, ...], sympy.Expr]]:
        """The N·P pairs of the 6·N·P form as formulas: ``[(N's factors, P)]``, each factor the
        symbol (B, S, S_enc, ...) or its pinned value; P as :meth:`token_groups` (one pair, P =
        ``params_active_matmul`` on N = B·S, for a model whose matmul weights all see the same
        tokens; an encoder-decoder's ``(B, S_enc)`` on P_enc and ``(B, S)`` on P_dec). The one
        split :meth:`train_simplified` (the report's form) and
        :func:`symcost.passes.roofline.tokens_compute` (``time``, ``mfu``, ``roofline``) use: 6·N·P
        of one step is Σ 6·ΠN·P over the pairs (per rank: / TP / CP)."""
        syms = {s.name: s for s in sympy.sympify(self.flops("train")).free_symbols}
        return [(tuple(sympy.Integer(self.pinned[n]) if n in self.pinned else syms.get(n, SYMS.get(n)) for n in names), Pk)
                for names, Pk in self.token_groups()]

    def train_simplified(self) -> tuple[sympy.Expr, sympy.Expr, sympy.Expr]:
        """``(P, remainder, unevaluated 6*B*S*P + remainder)`` with remainder exact.

        P is ``params_active_matmul``: for a mixture of experts the parameters one token uses
        (R of E experts), else ``params_matmul``. One rank of tensor parallelism (``--tp``) runs
        1/TP of the split matmuls: its form is 6·B·S·P/TP + remainder (:meth:`tp_share`), P the
        whole model's. One rank of context parallelism (``--cp``) runs B·S/CP tokens: its form is
        6·B·S·P/CP + remainder (:meth:`cp_share`). A model without a sequence has N = B
        (:meth:`n_symbols`): 6·B·P + remainder. An encoder-decoder's form is
        6·B·S_enc·P_enc + 6·B·S·P_dec + remainder (:meth:`token_groups`: each stack's weights on
        the tokens it processes); ``P`` stays all the matmul weights, ``params_active_matmul``."""
        P = self.params_active_matmul
        tp, cp = self.tp_share(), self.cp_share()
        total = sympy.sympify(self.flops("train"))
        heads, six = [], sympy.Integer(0)
        for N, Pk in self.six_np_pairs():
            six += 6 * sympy.Mul(*N) * Pk / (tp * cp)
            factors = [f for f in (sympy.Integer(6), *N, sympy.factor_terms(Pk), 1 / tp, 1 / cp) if f != 1]
            heads.append(sympy.Mul(*factors, evaluate=False))
        rem = sympy.expand(total - six)
        form = sympy.Add(*heads, sympy.factor_terms(rem), evaluate=False)
        return P, rem, form
