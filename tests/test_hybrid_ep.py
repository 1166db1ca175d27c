"""DeepEP's / HybridEP's dispatch priced per link tier (symcost/passes/hybrid_ep.py; issue 29, BR1).

Oracle: a transcription of DeepEP's dispatch layout (deepseek-ai/DeepEP ``Buffer.get_dispatch_layout``:
``is_token_in_rank`` [tokens, ranks], ``num_tokens_per_rank``, ``num_tokens_per_rdma_rank``; the
internode kernels send a token to each destination RDMA rank once, to the sender's local index
there, whose NVLink forwarders hand it to each destination rank of the node) in torch on random
routings, counted token by token, and Megatron's alltoall dispatcher's rows (one per (token,
expert) pair whose expert lives on another rank); the expectation by enumerating every top-R set.
"""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from symcost.errors import SymcostError
from symcost.passes import hybrid_ep as he
from symcost.passes.megatron_iteration import parse_args


def _layout(topk_idx: torch.Tensor, experts: int, ranks: int, per_node: int):
    """DeepEP's get_dispatch_layout, in torch: (is_token_in_rank [T, n] bool, num_tokens_per_rank [n],
    num_tokens_per_rdma_rank [G])."""
    per_rank = experts // ranks
    in_rank = torch.zeros(topk_idx.shape[0], ranks, dtype=torch.bool)
    in_rank.scatter_(1, topk_idx // per_rank, True)
    in_node = in_rank.view(-1, ranks // per_node, per_node).any(dim=2)
    return in_rank, in_rank.sum(0), in_node.sum(0)


def _deepep_rows(topk_idx, experts, ranks, per_node, source):
    """Network and NVLink rows a rank's tokens cost: each remote node's RDMA count, and on every
    node each destination rank's count except the forwarder (the sender's local index)."""
    in_rank, per_rank_count, per_rdma = _layout(topk_idx, experts, ranks, per_node)
    node, local = divmod(source, per_node)
    network = int(per_rdma.sum() - per_rdma[node])
    forwarders = [b * per_node + local for b in range(ranks // per_node)]
    nvlink = int(per_rank_count.sum() - per_rank_count[forwarders].sum())
    plain = int(((topk_idx // (experts // ranks)) != source).sum())  # (Megatron's alltoall: a row per pair)
    return network, nvlink, plain


def _routing(rng: random.Random, tokens: int, experts: int, topk: int) -> torch.Tensor:
    return torch.tensor([rng.sample(range(experts), topk) for _ in range(tokens)])


def test_rows_equal_deepeps_layout_on_random_routings():
    """Random sizes and routings: the rows :func:`token_rows` counts per token equal DeepEP's layout's."""
    rng = random.Random(2906)
    for _ in range(12):
        n = rng.choice((2, 4, 8, 16))
        per_node = rng.choice([d for d in (1, 2, 4, 8) if n % d == 0])
        E = n * rng.randint(1, 6)
        R = rng.randint(1, min(E, 8))
        T = rng.randint(1, 40)
        src = rng.randrange(n)
        idx = _routing(rng, T, E, R)
        net, nvl, _ = _deepep_rows(idx, E, n, per_node, src)
        got = he.routing_rows(idx.tolist(), E, n, per_node, src)
        assert (got["network"] * T, got["nvlink"] * T) == pytest.approx((net, nvl)), (n, per_node, E, R)


def test_expectation_equals_every_routing_enumerated():
    """Small E: the expected rows over uniform routing equal the mean over every top-R set (each
    counted by DeepEP's layout), and the plain all-to-all's R·(n-1)/n equals Megatron's rows."""
    rng = random.Random(2907)
    cases = [(8, 2, 4, 2), (8, 3, 4, 2)] + [(rng.choice((8, 12)), rng.randint(1, 4), 4, rng.choice((1, 2, 4)))
                                            for _ in range(2)]
    for E, R, n, per_node in cases:
        idx = torch.tensor(list(itertools.combinations(range(E), R)))
        src = rng.randrange(n)
        net, nvl, plain = _deepep_rows(idx, E, n, per_node, src)
        want = he.expected_rows(E, R, n, per_node)
        T = idx.shape[0]
        assert want["network"] == pytest.approx(net / T, rel=1e-12, abs=1e-12), (E, R, n, per_node)
        assert want["nvlink"] == pytest.approx(nvl / T, rel=1e-12, abs=1e-12), (E, R, n, per_node)
        assert want["plain"] == pytest.approx(plain / T, rel=1e-12), (E, R, n, per_node)


def test_br1_sizes_against_sampled_routings():
    """Qwen3-30B-A3B's routing on EP 16 over 2 nodes of 8 (E 128, top-8): the expectation equals
    the mean of 4,000 random routings within 3 standard errors; a token crosses the network about
    once (HybridEP) where the plain all-to-all sends 4 copies."""
    rng = random.Random(2908)
    E, R, n, l = 128, 8, 16, 8
    idx = _routing(rng, 4000, E, R)
    net, nvl, plain = _deepep_rows(idx, E, n, l, 0)
    want = he.expected_rows(E, R, n, l)
    per = [he.token_rows(row, E, n, l, 0) for row in idx.tolist()]
    for k, col in (("network", 0), ("nvlink", 1)):
        xs = torch.tensor([p[col] for p in per], dtype=torch.float64)
        assert abs(xs.mean().item() - want[k]) <= 3 * xs.std().item() / 4000 ** 0.5 + 1e-9, k
    assert net / 4000 == pytest.approx(want["network"], abs=0.01) and want["plain_network"] == 4.0
    t = he.tiers(E, R, n, l, ("nvlink", 450e9), ("ib", 50e9))
    assert [x["link"] for x in t] == ["nvlink", "ib"]
    assert t[1]["share"] == pytest.approx(want["network"] / 7.5)
    assert t[0]["share"] == pytest.approx(want["nvlink"] / 7.5)
    assert plain / 4000 == pytest.approx(7.5, rel=0.02)


def test_flags_select_the_dispatcher_never_by_default():
    """Megatron-LM's flags: flex with a backend (deepep by default), --moe-enable-deepep; nothing
    else turns it on; a backend Megatron does not have is refused in one line."""
    assert he.backend_of(parse_args("--clip-grad 1.0 --log-interval 10")) is None
    flex = "--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep"
    assert he.backend_of(parse_args(flex.replace("flex ", "alltoall "))) is None
    assert he.backend_of(parse_args(flex)) == "hybridep"
    assert he.backend_of(parse_args("--moe-token-dispatcher-type=flex")) == "deepep"
    assert he.backend_of(parse_args("--moe-enable-deepep")) == "deepep"
    assert he.dispatcher_of(None) is None
    with pytest.raises(SymcostError, match="not one Megatron-LM has"):
        he.backend_of(parse_args("--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend nccl"))
    with pytest.raises(SymcostError, match="takes a value"):
        parse_args("--moe-token-dispatcher-type")
    with pytest.raises(SymcostError, match="divisible"):
        he.expected_rows(10, 2, 4, 2)
