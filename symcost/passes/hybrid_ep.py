"""DeepEP's and HybridEP's token dispatch over an expert-parallel group: what each token costs on
each link tier, where Megatron-LM's flex dispatcher runs them (``--moe-token-dispatcher-type flex
--moe-flex-dispatcher-backend deepep|hybridep``, or the older ``--moe-enable-deepep``).

Megatron's ``alltoall`` dispatcher (and the traced rank, docs/moe.md) permutes a layer's N tokens
into N·R rows, one per (token, expert) pair, and sends each row to the rank that holds its expert:
R·(n-1)/n rows per token leave the rank, a copy per destination expert. DeepEP's normal kernels
(deepseek-ai/DeepEP README, "normal kernels ... asymmetric-domain bandwidth forwarding"; its
``get_dispatch_layout``: ``is_token_in_rank`` [tokens, ranks], ``num_tokens_per_rdma_rank``) and
HybridEP (its hierarchical branch that Megatron-LM's ``fused_a2a.py`` drives; the same two-level
route) send a token **once per destination node** over RDMA, to the rank with the sender's local
index there, which forwards it over NVLink **once per destination rank** of that node (its own
rank excluded); the combine runs the same route backwards, reducing inside the node first. So per
token and exchange:

- network rows = the distinct remote nodes among its top-R experts' ranks;
- NVLink rows = on every node the token reaches (its own included), the distinct ranks that hold
  one of its experts, other than the forwarding rank.

Over uniform routing (R distinct experts of E drawn without replacement, E/n per rank, n/G ranks
per node on G nodes) a node is missed with probability C(E-E/G, R)/C(E, R) and a rank with
C(E-E/n, R)/C(E, R), so the expected rows per token are (G-1)·(1 - C(E-E/G,R)/C(E,R)) and
(n-G)·(1 - C(E-E/n,R)/C(E,R)): by symmetry every rank forwards as many rows as its own tokens
cause. Qwen3-30B-A3B on EP 16 over 2 nodes of 8 (E 128, R 8): 0.997 network rows and 5.77 NVLink
rows per token, where the plain all-to-all sends 4 and 3.5 (its 7.5 = 8 · 15/16).

Symbols and units: rows are tokens of one MoE layer (each M elements); ``shares`` are fractions of
the bytes the traced plain all-to-all sends (R·(n-1)/n rows per token).
"""
from __future__ import annotations

from math import comb
from typing import Any, Iterable, Mapping, Sequence

from symcost.errors import SymcostError

#: the flex dispatcher's backends that route through nodes as above
BACKENDS = ("deepep", "hybridep")


def backend_of(flags: Mapping[str, Any] | None) -> str | None:
    """The flex dispatcher's backend a Megatron-LM run's flags select (``deepep`` or ``hybridep``),
    or None: the plain ``alltoall``/``allgather`` dispatcher (Megatron's default, and symcost's
    unless the flags say otherwise). ``flags``: :func:`symcost.passes.megatron_iteration.parse_args`'."""
    if not flags:
        return None
    if flags.get("moe_enable_deepep"):
        return "deepep"
    if flags.get("moe_token_dispatcher_type") != "flex":
        return None
    backend = flags.get("moe_flex_dispatcher_backend") or "deepep"  # (Megatron's default backend)
    if backend not in BACKENDS:
        raise SymcostError(f"--moe-flex-dispatcher-backend {backend!r} is not one Megatron-LM has; "
                           f"accepted: {', '.join(BACKENDS)}")
    return backend


def token_rows(experts_of_token: Iterable[int], experts: int, ranks: int, per_node: int, source: int = 0
               ) -> tuple[int, int]:
    """``(network, nvlink)`` rows one token of rank ``source`` costs in one dispatch, by the route
    above (DeepEP's ``is_token_in_rank`` and its per-RDMA-rank counts).

    Args:
        experts_of_token: the token's top-R expert indices (0 <= e < experts).
        experts: E; ``ranks``: n (E divisible by n); ``per_node``: ranks per node (divides n).
        source: the sending rank (its node's rows do not cross the network).
    """
    per_rank = experts // ranks
    dest = {int(e) // per_rank for e in experts_of_token}
    local = source % per_node
    nodes = {r // per_node for r in dest}
    network = len(nodes - {source // per_node})
    nvlink = sum(1 for r in dest if r % per_node != local)  # (each node's forwarder: the sender's local index)
    return network, nvlink


def expected_rows(experts: int, topk: int, ranks: int, per_node: int) -> dict[str, float]:
    """Expected rows per token of one dispatch over uniform routing (formulas in the module's
    docstring), and the plain all-to-all's for comparison.

    Returns:
        ``{"network", "nvlink", "plain", "plain_network", "plain_nvlink"}`` in rows (tokens) per token.

    Raises:
        SymcostError: E not divisible by the ranks, ranks not whole nodes, top-k above E.
    """
    E, R, n = int(experts), int(topk), int(ranks)
    if n < 1 or E % n or R < 1 or R > E:
        raise SymcostError(f"HybridEP's routing needs E ({E}) divisible by EP ({n}) and 1 <= top-k ({R}) <= E")
    l = min(int(per_node), n)
    if n % l:
        raise SymcostError(f"EP {n} is not whole nodes of {l} ranks")
    G = n // l
    total = comb(E, R)
    node_hit = 1 - comb(E - E // G, R) / total
    rank_hit = 1 - comb(E - E // n, R) / total
    plain = R * (n - 1) / n
    return {"network": (G - 1) * node_hit, "nvlink": (n - G) * rank_hit, "plain": plain,
            "plain_network": R * (n - l) / n, "plain_nvlink": R * (l - 1) / n}


def tiers(experts: int, topk: int, ranks: int, per_node: int, link: tuple[str, float],
          network: tuple[str, float]) -> list[dict[str, Any]]:
    """The link tiers of the flex dispatcher's exchanges as :func:`symcost.passes.parallel.all_to_all_tiers`
    gives them for a plain all-to-all: ``[{"link", "bandwidth", "share", "rows"}, ...]``, each
    ``share`` the tier's rows over the plain all-to-all's R·(n-1)/n (the fraction of the traced
    bytes that tier carries), NVLink first, the network only where the group spans nodes.
    The exchange takes the slower tier: max over tiers of share · bytes / bandwidth."""
    rows = expected_rows(experts, topk, ranks, per_node)
    out = [{"link": link[0], "bandwidth": link[1], "rows": rows["nvlink"], "share": rows["nvlink"] / rows["plain"]}]
    if rows["network"]:
        if not network[1]:
            raise SymcostError("the EP group spans nodes and the device lists no network_bandwidth")
        out.append({"link": network[0], "bandwidth": network[1], "rows": rows["network"],
                    "share": rows["network"] / rows["plain"]})
    return out


def routing_rows(topk_idx: Sequence[Sequence[int]], experts: int, ranks: int, per_node: int, source: int = 0
                 ) -> dict[str, float]:
    """Mean rows per token of a given routing (``topk_idx``: [tokens, R] expert indices, e.g. a
    traced router's), by :func:`token_rows`: ``{"network", "nvlink", "tokens"}``."""
    net = nvl = 0
    for row in topk_idx:
        a, b = token_rows(row, experts, ranks, per_node, source)
        net, nvl = net + a, nvl + b
    t = len(topk_idx)
    return {"network": net / t if t else 0.0, "nvlink": nvl / t if t else 0.0, "tokens": t}


def dispatcher_of(megatron_args: str | Mapping[str, Any] | None) -> str | None:
    """:func:`backend_of` of a Megatron-LM command line (or :func:`~symcost.passes.megatron_iteration.parse_args`'
    dict); None where no flags are given."""
    if megatron_args is None:
        return None
    from symcost.passes import megatron_iteration as mi

    flags = mi.parse_args(megatron_args) if not isinstance(megatron_args, Mapping) else {**mi.DEFAULTS, **megatron_args}
    return backend_of(flags)
