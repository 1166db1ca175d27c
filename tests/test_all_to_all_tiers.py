"""An all-to-all over a group that spans nodes, priced per link tier (passes.parallel.all_to_all_tiers,
docs/performance-model.md "Collectives"): each peer's 1/n of the buffer over the link between the
two ranks, as NCCL's grouped ncclSend/ncclRecv per peer moves it (PyTorch's all_to_all_single,
torch/csrc/cuda/nccl.cpp all2all_single_equal_split)."""
import random
from fractions import Fraction

import numpy as np
import pytest

from symcost.passes.parallel import all_to_all_tiers

LINK, NET = ("nvlink", 450e9), ("ib", 50e9)


def _shares_by_enumeration(n: int, stride: int, per_node: int, rest: int):
    """The oracle: the mesh (rest, ep, stride) of rest·n·stride consecutive ranks placed per_node to a
    node (torchtitan's/Megatron's rank order, innermost last); for every rank of every EP group, the
    fraction of its sent bytes (n-1 peers, one share each) that stays on its node."""
    ranks = np.arange(rest * n * stride).reshape(rest, n, stride)
    seen = set()
    for r in range(rest):
        for t in range(stride):
            group = ranks[r, :, t]
            for me in group:
                on = sum(1 for p in group if p != me and p // per_node == me // per_node)
                seen.add(Fraction(on, n - 1))
    return seen


def test_tiers_equal_the_peers_placement():
    """At random group sizes, strides and node sizes: the on-node share equals the enumerated peers'
    share at every rank (one value: every rank sees the same placement), the shares sum to 1; a group
    inside one node, or not placed whole nodes at a time, is left to the caller (None)."""
    rng = random.Random(2911)
    checked = 0
    for _ in range(300):
        per_node = rng.choice([2, 4, 8, 16])
        stride = rng.choice([1, 1, 2, 4])
        n = rng.choice([2, 3, 4, 8, 16, 32, 64])
        tiers = all_to_all_tiers(n, stride, per_node, LINK, NET)
        span = n * stride
        if span <= per_node and per_node % span == 0:
            assert tiers is None
            continue
        if span % per_node or per_node % stride:
            assert tiers is None
            continue
        seen = _shares_by_enumeration(n, stride, per_node, rest=rng.choice([1, 2]))
        if per_node // stride == 1:  # (one rank of the group per node: every peer over the network)
            assert tiers is None and seen == {0}
            continue
        assert len(seen) == 1 and tiers[0]["share"] == pytest.approx(float(seen.pop()))
        assert sum(t["share"] for t in tiers) == pytest.approx(1.0)
        assert tiers[0]["peers"] + tiers[1]["peers"] == n - 1
        checked += 1
    assert checked > 20


def test_ep16_on_two_nodes_of_8():
    """BR1's EP 16 on 2 DGX H100 nodes: 7 of 15 peers over NVLink, 8 over InfiniBand; the all-to-all
    takes the slower tier, 8/15 of the bytes at the NIC's 50 GB/s (not all of them)."""
    tiers = all_to_all_tiers(16, 1, 8, LINK, NET)
    assert [t["peers"] for t in tiers] == [7, 8]
    nbytes = 1e9
    assert max(nbytes * t["share"] / t["bandwidth"] for t in tiers) == pytest.approx(nbytes * 8 / 15 / 50e9)
