"""Mixture-of-experts layers: routing as an explicit assumption, and a static-shaped expert dispatch.

A mixture-of-experts (MoE) layer sends each of the N = B·S tokens to R of its E experts (top-k
routing; the router's choice depends on the token values). Real implementations loop over the
experts that were hit (``nonzero``/``where``: data-dependent shapes, which cannot be traced
without data) or run a grouped matmul over tokens sorted by expert. symcost instead traces every
MoE layer under a stated **routing model** that fixes how many token slots each expert gets:

* ``balanced`` (the default): every expert receives exactly N·R/E token slots (the ideal a
  load-balancing loss aims at);
* ``capacity`` with a capacity factor c > 0: every expert's buffer holds C = c·N·R/E slots. With
  c >= 1 that is the load of the busiest expert (worst case for memory and time); with c < 1
  the balanced N·R/E slots of each expert are capped at C and the rest dropped (they skip the
  experts; the residual carries the token on), as GShard and Switch Transformer drop tokens
  beyond the capacity. This is the expert capacity of GShard (Lepikhin et al. 2020, Sec. 2.2)
  and Switch Transformer (Fedus et al. 2021, Sec. 2.2: "expert capacity = tokens per batch /
  number of experts × capacity factor"; its Table 1 trains at factors 1.0 to 2.0 and evaluates
  0.5 and 0.75 too), the padded dispatch of Megatron-Core's ``--moe-pad-expert-input-to-capacity``:
  all E buffers are padded to C, so the experts' FLOPs, activations and (under expert
  parallelism) all-to-all bytes scale with c.

* ``skew`` with a factor X (1 <= X <= EP, under ``--ep`` only): the traced expert-parallel rank is
  the most loaded one: from every rank its E/EP experts receive X times their balanced slots
  (X·N·R/EP rows from each rank instead of N·R/EP), the other ranks' tokens being routed
  unevenly; its expert FLOPs and activations scale by X, and so do the dispatch's received and
  the combine's sent all-to-all bytes (the critical path of each exchange is X times the
  balanced one). The rank's own tokens are dispatched as balanced (:func:`symcost.frontends.
  expert_parallel.builtin_forward`).

The dispatch (:func:`dispatch` / :func:`combine`) is plain PyTorch with static shapes, whatever
the router chose: each routed slot gets its position inside its expert's buffer from a cumulative
sum over the one-hot expert mask (GShard's ``cumsum`` positions), slots beyond the capacity are
dropped into a spare row, the tokens are gathered (``index_select``) and scattered
(``index_add``) into an ``[E, C, M]`` buffer, the experts run as batched matmuls (``bmm``) over
it, and the outputs are gathered back, weighted by the router's probabilities and summed per token
(``index_add``). So the traced sizes are polynomials: C = c·B·S·R/E (E takes exponent -1).

Hugging Face models: :func:`experts_forward` is registered as the ``"symcost"`` experts
implementation of ``transformers``' ``@use_experts_implementation`` hook
(transformers/integrations/moe.py), and :func:`hf_binding` binds E, R and the expert FFN width F
from an MoE config. Under ``balanced`` routing it runs the model's own default experts code,
transformers' ``grouped_mm`` (static shapes ``[N·R, ·]`` whatever the router picks: the routing
only fills the grouped GEMMs' offsets; issue 31), under ``capacity=c`` the padded dispatch above.
Built-in models call :func:`dispatch`/:func:`combine` directly (``symcost/frontends/builtin/moe.py``).

What the traced graph says about the experts (active parameters, slots per expert) is the
MoE pass, :mod:`symcost.passes.moe`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Mapping

from symcost.errors import SymcostError

#: Attribute set on every experts module: the :class:`Routing` it dispatches under.
ROUTING_ATTR = "symcost_routing"
#: Attribute set on a transformers experts module that runs another framework's MoE code instead of
#: transformers' (:func:`symcost.frontends.megatron_moe.mark`): ``(forward, expert-parallel forward)``
CODE_ATTR = "symcost_moe_code"
#: Name of the experts implementation registered with transformers' ExpertsInterface.
HF_IMPLEMENTATION = "symcost"
#: Residue modulus kept by the probes of the widths a grouped GEMM's rows have (F and the hidden
#: width: M where it is a symbol, else D of H·D): PyTorch's ``_grouped_mm`` kernels pad every output
#: row to 16 bytes and take only 16-byte operand rows (symcost.tracing.grouped_mm), so the bytes
#: are polynomials within a residue class mod 16/itemsize (4 in fp32, 8 in bf16/fp16)
GROUPED_ROW_MODULUS = 8


def row_widths(has_m: bool) -> tuple[str, ...]:
    """The symbols whose residues mod :data:`GROUPED_ROW_MODULUS` the probes keep: F and the
    hidden width's own symbol (M, else D: with D ≡ 0 mod 8, H·D is too)."""
    return ("F", "M") if has_m else ("F", "D")


#: transformers' experts implementation a ``balanced`` trace runs (its default, where
#: ``torch._grouped_mm`` exists: modeling_utils ``get_correct_experts_implementation``)
MODEL_CODE = "grouped_mm"


@dataclass(frozen=True)
class Routing:
    """A routing model: how many token slots each of the E experts receives.

    ``kind`` is ``"balanced"`` (factor 1: every expert gets N·R/E slots) or ``"capacity"``
    (every expert's buffer holds ``factor``·N·R/E slots, the busiest expert's load).
    """

    kind: str = "balanced"
    factor: Fraction = Fraction(1)

    @property
    def skew(self) -> Fraction:
        """X of ``skew=X``: the traced EP rank's load over the balanced one (1 for the others)."""
        return self.factor if self.kind == "skew" else Fraction(1)

    def capacity(self, n_tokens: int, top_k: int, n_experts: int) -> int:
        """Slots per expert C = factor·N·R/E for N tokens, R experts per token, E experts.

        Exact when factor·N·R/E is an integer (symcost's probes always are); otherwise rounded
        up, as implementations do (Switch Transformer rounds the capacity to an integer), so no
        routed slot is dropped under the balanced assignment. Unitless (token slots).
        """
        c = (self.factor if self.kind == "capacity" else 1) * Fraction(n_tokens * top_k, n_experts)
        return math.ceil(c)

    def exact(self, values: Mapping[str, int]) -> bool:
        """Whether factor·B·S·R/E is an integer at these symbol values (missing ones pass); under
        ``skew`` B·S·R/E too (the rank's own slots per expert)."""
        try:
            c = self.factor * values["B"] * values["S"] * values["R"] / values["E"]
            own = Fraction(values["B"] * values["S"] * values["R"], values["E"])
        except KeyError:
            return True
        return c.denominator == 1 and (self.kind != "skew" or own.denominator == 1)

    @property
    def name(self) -> str:
        """``balanced``, ``capacity=<factor>`` or ``skew=<X>`` (what ``--routing`` accepts)."""
        return "balanced" if self.kind == "balanced" else f"{self.kind}={_fmt(self.factor)}"

    def describe(self) -> str:
        """One line for the report: the assumption and what it implies."""
        if self.kind == "balanced":
            return "balanced: every expert receives exactly N·R/E token slots (N = B·S tokens)"
        if self.kind == "skew":
            return (f"skew X={_fmt(self.factor)}: the traced expert-parallel rank is the most loaded, its experts "
                    "receive X times the balanced slots from every rank (expert FLOPs, activations, the dispatch's "
                    "received and the combine's sent all-to-all bytes scale with X)")
        if self.factor < 1:
            return (f"capacity c={_fmt(self.factor)}: every expert's buffer holds c·N·R/E token slots; of the "
                    "N·R/E balanced slots of each expert those beyond it are dropped (they skip the experts: "
                    "expert FLOPs, activations and all-to-all bytes scale with c)")
        return (f"capacity c={_fmt(self.factor)}: every expert's buffer holds c·N·R/E token slots, the "
                "busiest expert's load (padded dispatch: expert FLOPs and activations scale with c)")

    def as_json(self) -> dict[str, Any]:
        """``{"model": "balanced"|"capacity"|"skew", "capacity_factor": float, "description": str}``,
        and ``skew`` (X) under ``skew`` (its capacity factor is 1: the rank's own slots balanced)."""
        out = {"model": self.kind, "capacity_factor": float(self.factor) if self.kind == "capacity" else 1.0,
               "description": self.describe()}
        if self.kind == "skew":
            out["skew"] = float(self.factor)
        return out


BALANCED = Routing()


def _fmt(f: Fraction) -> str:
    return str(f.numerator) if f.denominator == 1 else f"{float(f):g}"


def parse_routing(text: str | Routing | None) -> Routing:
    """Parse ``--routing``: ``balanced`` (default), ``capacity=C`` or ``capacity:C`` (C > 0,
    e.g. 1.25 or 5/4; below 1 the slots beyond C·N·R/E per expert are dropped); plain
    ``capacity`` means c = 1.25 (Switch Transformer's training value).

    Raises:
        SymcostError: anything else, or a factor that is not a positive finite number.
    """
    if text is None:
        return BALANCED
    if isinstance(text, Routing):
        return text
    s = str(text).strip().lower()
    if s in ("", "balanced"):
        return BALANCED
    kind, sep, val = s.replace(":", "=").partition("=")
    if kind.strip() == "skew":
        try:
            x = Fraction(val.strip()).limit_denominator(1000) if sep else None
        except (ValueError, ZeroDivisionError):
            x = None
        if x is None or x < 1:
            raise SymcostError(f"skew must be a number >= 1 (the most loaded EP rank's load over the balanced one, "
                               f"e.g. skew=1.5), got {val.strip() or 'nothing'!r}")
        return BALANCED if x == 1 else Routing("skew", x)
    if kind.strip() != "capacity":
        raise SymcostError(f"unknown routing model {text!r}; accepted: balanced, capacity=C (C > 0, e.g. capacity=1.25), "
                           "skew=X (X >= 1, with --ep)")
    if not sep:
        val = "1.25"
    try:
        factor = Fraction(val.strip()).limit_denominator(1000)
    except (ValueError, ZeroDivisionError):
        raise SymcostError(f"capacity factor must be a positive number (e.g. capacity=1.25), got {val.strip()!r}") \
            from None
    if factor <= 0:
        raise SymcostError(f"capacity factor must be a positive number (got {_fmt(factor)}; e.g. capacity=1.25, "
                           "or capacity=0.5: each expert's slots capped at half its balanced share, the rest dropped)")
    return Routing("balanced", Fraction(1)) if factor == 1 else Routing("capacity", factor)


def probe_check(values: Mapping[str, int], routing: Routing = BALANCED, static: bool = True) -> str | None:
    """Why ``values`` are no probe for an MoE trace under ``routing``, else None.

    The static dispatch (``static``: :func:`dispatch`, every ``capacity`` trace and the built-in
    ``moe``) needs an integer number of slots per expert, c·B·S·R/E, at a probe, so that every
    traced size is an exact polynomial; formulas fitted there are then evaluated at any size (a
    fractional N·R/E is the balanced average). transformers' grouped experts code
    (:func:`experts_forward` under ``balanced``) has the shapes ``[N·R, ·]`` at any routing, so
    it needs no such thing (``static=False``). Always: R <= E.
    """
    if values.get("R") is not None and values.get("E") is not None and values["R"] > values["E"]:
        return f"R must not exceed E (got R={values['R']}, E={values['E']})"
    if routing.kind == "skew" and values.get("EP") is not None and routing.factor > values["EP"]:
        return f"skew {_fmt(routing.factor)} exceeds EP={values['EP']} (a rank receives at most every slot)"
    if static and not routing.exact(values):
        return "c·B·S·R/E slots per expert must be an integer at a probe"
    return None


def model_code_probe_check(values: Mapping[str, int]) -> str | None:
    """:func:`probe_check` of a transformers MoE model traced with its own grouped experts code
    (balanced routing): only R <= E."""
    return probe_check(values, BALANCED, static=False)


def check(values: Mapping[str, int]) -> str | None:
    """What PyTorch imposes on E and R: top-k of E experts needs 1 <= R <= E."""
    r, e = values.get("R"), values.get("E")
    if r is not None and e is not None and r > e:
        return f"R (experts per token) must not exceed E (experts): got R={r}, E={e}"
    return None


# -- the static-shaped dispatch ---------------------------------------------------------------------


def dispatch(x, top_k_index, n_experts: int, capacity: int):
    """Scatter the routed token slots into per-expert buffers of fixed size.

    Args:
        x: token states ``[N, M]``.
        top_k_index: the router's choice ``[N, R]`` (int64 expert ids in ``[0, E)``).
        n_experts: E.
        capacity: C slots per expert (see :meth:`Routing.capacity`).

    Returns:
        ``(buffer [E, C, M], dest [N*R], token [N*R])``: ``dest`` is each slot's row in the
        flattened buffer (``E*C`` for a slot beyond its expert's capacity: dropped), ``token``
        the token of each slot (slots are token-major: slot ``n*R + k`` is token n's k-th
        choice). Positions inside an expert follow GShard (Lepikhin et al. 2020, Sec. 2.2):
        the cumulative count of earlier slots routed to the same expert.
    """
    import torch

    n, r = top_k_index.shape
    e, c = n_experts, capacity
    flat = top_k_index.reshape(-1)
    onehot = flat.unsqueeze(1) == torch.arange(e, device=flat.device)  # [N*R, E]
    position = (onehot.cumsum(0) * onehot).sum(1) - 1  # slot's index inside its expert
    dest = torch.where(position < c, flat * c + position, e * c)  # overflow -> spare row E*C
    token = torch.arange(n, device=flat.device).unsqueeze(1).expand(n, r).reshape(-1)
    slots = x.index_select(0, token)  # gather: each token once per choice, [N*R, M]
    buffer = x.new_zeros(e * c + 1, x.shape[-1]).index_add(0, dest, slots)  # scatter (rows distinct but the spare)
    return buffer[: e * c].view(e, c, x.shape[-1]), dest, token


def combine(out, dest, token, top_k_weights, n_tokens: int):
    """Gather expert outputs back to token order, weight them and sum per token.

    Args:
        out: expert outputs ``[E, C, M]``.
        dest, token: from :func:`dispatch`.
        top_k_weights: the router's weights ``[N, R]``.
        n_tokens: N.

    Returns:
        ``[N, M]``: sum over a token's R slots of weight × expert output (a dropped slot adds 0).
    """
    import torch.nn.functional as F

    e, c, m = out.shape
    rows = F.pad(out.reshape(e * c, m), (0, 0, 0, 1))  # spare zero row for dropped slots
    y = rows.index_select(0, dest) * top_k_weights.reshape(-1, 1).to(out.dtype)
    return y.new_zeros(n_tokens, m).index_add(0, token, y)


def expert_linear(buffer, weight, bias=None, transposed: bool = False):
    """Per-expert linear map as one batched matmul: ``[E, C, in] -> [E, C, out]``.

    ``weight`` is ``[E, out, in]`` (``transposed``: ``[E, in, out]``); ``bias`` ``[E, out]``.
    FLOPs 2·E·C·in·out (torch/utils/flop_counter.py, bmm).
    """
    import torch

    y = torch.bmm(buffer, weight if transposed else weight.transpose(1, 2))
    if bias is not None:
        y = y + bias.unsqueeze(1).to(y.dtype)
    return y


def routing_of(module) -> Routing:
    """The routing model an experts module dispatches under (balanced unless set)."""
    return getattr(module, ROUTING_ATTR, BALANCED)


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers experts implementation ``"symcost"``: the model's own experts code under
    ``balanced`` routing, the static padded dispatch under ``capacity=c``.

    Same signature and weights as transformers' ``batched_mm``/``grouped_mm`` implementations
    (transformers/integrations/moe.py): ``hidden_states [N, M]``, ``top_k_index [N, R]``,
    ``top_k_weights [N, R]`` -> ``[N, M]``.

    * ``balanced`` (the default): transformers' default implementation, ``grouped_mm``
      (``grouped_mm_experts_forward``, :data:`MODEL_CODE`), as it is: the N·R slots sorted by
      expert (``sort``), gathered (``[N·R, M]``), counted per expert (``histc``, ``cumsum``: the
      offsets), two or three grouped GEMMs ``torch._grouped_mm`` (``[N·R, in] × [E, in, out]``,
      rows split by the offsets), the gate, the routing weights, the inverse permutation and the
      sum over a token's R slots. Its shapes do not depend on which experts the router picks;
      the routing only fills the offsets, so any dropless routing (the balanced one included)
      costs the same and keeps the same tensors. Recorded by :mod:`symcost.tracing.grouped_mm`.
      Under ``--precision megatron-*`` Megatron-Core's alltoall dispatcher and grouped experts
      instead (:data:`CODE_ATTR`: :func:`symcost.frontends.megatron_moe.forward`).
    * ``capacity=c``: every expert's buffer padded to C = c·N·R/E slots (:func:`dispatch`,
      :func:`expert_linear`, :func:`combine`), honouring ``has_gate``, ``has_bias``,
      ``is_transposed`` and ``has_post_expert_norm`` of ``@use_experts_implementation``.
    """
    routing = routing_of(self)
    if routing.kind == "balanced":
        code = getattr(self, CODE_ATTR, None)
        if code is not None:  # (--precision megatron-*: Megatron-Core's MoE code, frontends.megatron_moe)
            return code[0](self, hidden_states, top_k_index, top_k_weights)
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    n = hidden_states.shape[0]
    e = self.num_experts
    c = routing_of(self).capacity(n, top_k_index.shape[-1], e)
    buf, dest, token = dispatch(hidden_states, top_k_index, e, c)
    if self.has_gate:
        w, b = self.gate_up_proj, getattr(self, "gate_up_proj_bias", None) if self.has_bias else None
    else:
        w, b = self.up_proj, getattr(self, "up_proj_bias", None) if self.has_bias else None
    h = expert_linear(buf, w, b, self.is_transposed)
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    b = getattr(self, "down_proj_bias", None) if self.has_bias else None
    out = expert_linear(h, self.down_proj, b, self.is_transposed)
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    return combine(out, dest, token, top_k_weights, n).to(hidden_states.dtype)


def register_hf() -> None:
    """Register :func:`experts_forward` as transformers' experts implementation ``"symcost"``."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if HF_IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(HF_IMPLEMENTATION, experts_forward)


def set_routing(model, routing: Routing):
    """Set ``routing`` on every MoE experts module of ``model`` (those with ``num_experts``
    stacked experts dispatched by this module); returns ``model``.

    Raises:
        SymcostError: the model has no MoE layer symcost dispatches.
    """
    found = False
    for m in model.modules():
        if hasattr(m, ROUTING_ATTR) or _is_hf_experts(m):
            object.__setattr__(m, ROUTING_ATTR, routing)
            found = True
    if not found:
        raise SymcostError("the model has no mixture-of-experts layer; --routing applies to MoE models only")
    return model


def _is_hf_experts(m) -> bool:
    return hasattr(m, "num_experts") and hasattr(m, "has_gate") and hasattr(m, "down_proj")


def with_routing(spec, routing: str | Routing | None):
    """A copy of an MoE :class:`~symcost.frontends.spec.ModelSpec` traced under ``routing``.

    Raises:
        SymcostError: bad routing text, or a model without the symbols E and R (no MoE layer).
    """
    import dataclasses

    r = parse_routing(routing)
    if "E" not in spec.symbols or "R" not in spec.symbols:
        raise SymcostError(f"--routing applies to mixture-of-experts models; {spec.name} has no routed experts")
    base = spec.build

    def build(values):
        return set_routing(base(values), r)

    extra = dict(spec.extra, routing=r.name, routing_description=r.describe())
    # the model's own grouped experts code (hf specs under balanced routing) has no C to keep whole
    hf = bool(spec.extra.get("hf_experts"))
    static = r.kind != "balanced" or not hf
    if hf:
        extra["experts_code"] = experts_code(r)
    return dataclasses.replace(spec, build=build, probe_check=lambda v: probe_check(v, r, static), extra=extra)


def experts_code(routing: Routing) -> str:
    """What a transformers MoE model's experts run in a trace under ``routing`` (JSON/report)."""
    if routing.kind == "balanced":
        return f"transformers' {MODEL_CODE} (grouped_mm_experts_forward, transformers/integrations/moe.py)"
    if routing.kind == "skew":  # (under --ep only: symcost.frontends.expert_parallel.hf_forward)
        return (f"transformers' {MODEL_CODE} on the most loaded expert-parallel rank (symcost.frontends."
                "expert_parallel.hf_forward: X times the balanced rows per local expert)")
    return "symcost's padded dispatch (symcost.frontends.moe.dispatch: [E, C, M] buffers, bmm)"


def routing_of_spec(spec) -> Routing | None:
    """The routing model a spec traces its MoE layers under, or None for a dense model."""
    name = spec.extra.get("routing") if spec is not None else None
    return parse_routing(name) if name else None


# -- Hugging Face configs ------------------------------------------------------------------------

#: MoE model types checked (transformers 5.24, torch 2.13) to trace and to match FlopCounterMode of
#: transformers' own experts code: tests/test_moe.py (eager and sdpa attention, the experts loop
#: at random sizes) and tests/test_moe_real_configs.py (deepseek_v2, deepseek_v3, gpt_oss: their
#: published configs, eager attention, the ``batched_mm`` experts at full width).
VERIFIED_HF = ("mixtral", "qwen2_moe", "olmoe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss")
#: Config attributes naming the routed experts E, first present (not None) wins.
E_ATTRS = ("num_local_experts", "num_experts", "n_routed_experts")
#: Config attributes naming the experts per token R.
R_ATTRS = ("num_experts_per_tok", "moe_topk", "top_k")
#: Config attributes naming the routed experts' FFN width (F), first present wins.
F_ATTRS = ("moe_intermediate_size", "expert_intermediate_size", "intermediate_size")


@dataclass(frozen=True)
class HFBinding:
    """How E, R and F bind to an MoE config (attribute names as the config stores them)."""

    e_attr: str
    r_attr: str
    f_attr: str
    E: int
    R: int
    F: int
    #: limits the router puts on E (:class:`~symcost.frontends.spec.Constraint` s): grouped
    #: routing (DeepSeek's ``n_group``) views the E scores as ``[n_group, E / n_group]``
    constraints: tuple = ()
    #: (symbol, modulus) pairs whose probes keep the request's residue (E a multiple of ``n_group``)
    moduli: tuple = ()

    def config_kwargs(self, values: Mapping[str, int], field_name) -> dict[str, int]:
        """Constructor kwargs setting E, R, F to ``values`` (``field_name`` maps to fields)."""
        return {field_name(self.e_attr): int(values["E"]), field_name(self.r_attr): int(values["R"]),
                field_name(self.f_attr): int(values["F"])}


def hf_binding(cfg) -> HFBinding | None:
    """E, R, F of a transformers MoE config, or None when it has no routed experts (E < 2).

    E: ``num_local_experts`` / ``num_experts`` / ``n_routed_experts``; R: ``num_experts_per_tok``;
    F: the routed experts' width ``moe_intermediate_size`` where the config has one (qwen2_moe,
    qwen3_moe: their ``intermediate_size`` is the width of dense layers, unused when every layer
    is sparse), else ``intermediate_size`` (mixtral, olmoe). A shared expert's width
    (``shared_expert_intermediate_size``, ``n_shared_experts`` times F for DeepSeek) stays at its
    config value or follows F as the config builds it.

    Grouped routing (DeepSeek-V2's ``group_limited_greedy``, V3's ``noaux_tc``, with ``n_group``
    > 1) views the E router scores as ``[n_group, E / n_group]``: E must be a multiple of
    ``n_group`` (PyTorch's ``view`` rejects anything else), and V3's router takes the top 2
    scores of each group (``topk(2)`` over E / n_group experts), so E >= 2·n_group. Both become
    constraints, and probes of E keep E a multiple of ``n_group`` (a modulus).
    """
    def first(attrs):
        for a in attrs:
            v = getattr(cfg, a, None)
            if isinstance(v, int) and not isinstance(v, bool):
                return a, v
        return None, None

    e_attr, e = first(E_ATTRS)
    r_attr, r = first(R_ATTRS)
    f_attr, f = first(F_ATTRS)
    if e_attr is None or r_attr is None or f_attr is None or e < 2:
        return None
    register_hf()
    from symcost.frontends.spec import Constraint

    constraints, moduli = [], []
    groups = getattr(cfg, "n_group", None)
    method = getattr(cfg, "topk_method", "noaux_tc")
    if isinstance(groups, int) and not isinstance(groups, bool) and groups > 1 \
            and method in ("noaux_tc", "group_limited_greedy"):
        constraints.append(Constraint(
            "multiple", "E", groups, f"E must be a multiple of n_group={groups}: the router views the "
            "expert scores as [n_group, E/n_group]"))
        moduli.append(("E", groups))
        if method == "noaux_tc":  # the sum of the top 2 scores of each group ranks the groups
            constraints.append(Constraint(
                "min", "E", 2 * groups, f"E must be at least 2·n_group={2 * groups}: the router takes the "
                "top 2 experts of each group"))
    return HFBinding(e_attr, r_attr, f_attr, e, r, f, tuple(constraints), tuple(moduli))
