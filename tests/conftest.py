"""Shared fixtures: traces are slow (seconds), so each (model, options) is traced once per session."""
from __future__ import annotations

import atexit
import functools
import gc
import os
import random
import shutil
import tempfile
import time

import pytest

import symcost

# The CLI caches traces on disk (symcost.graph.cache): the tests use a fresh folder of their own
# (one per process: pytest-xdist's workers do not share one).
os.environ["SYMCOST_CACHE_DIR"] = tempfile.mkdtemp(prefix="symcost-test-cache-")
atexit.register(shutil.rmtree, os.environ["SYMCOST_CACHE_DIR"], ignore_errors=True)  # (not left in /tmp)
# The graph library (graphs/, symcost.graph.library) would answer many requests without tracing:
# off for the tests, which check what the tracer gives (tests/test_graph_library.py turns it on).
os.environ["SYMCOST_GRAPHS_DIR"] = ""
if os.environ.get("PYTEST_XDIST_WORKER"):  # two workers on two cores: one intra-op thread each
    import torch

    torch.set_num_threads(1)
    # execnet starts the workers with COLUMNS=80 LINES=24, which a plain run does not have: text
    # output would be cut at 80 columns instead of the pipe width (symcost.render.report.console)
    os.environ.pop("COLUMNS", None)
    os.environ.pop("LINES", None)


def _trace(model: str, precision: str = "fp32", attention: str = "eager", config: tuple = (),
           sizes: tuple = ()):
    # eager by default for hf: models (FlopCounterMode cannot see CPU sdpa); other models take none.
    # One key per trace however it is asked for (positional or not, the default precision spelt
    # out or not, sizes in any order): the variants were traced again, cs336-lm in fp32 5 times.
    attention = attention if str(model).startswith("hf:") else None
    return _trace_once(model, precision, attention, tuple(sorted(dict(config).items())),
                       tuple(sorted(dict(sizes).items())))


@functools.lru_cache(maxsize=24)  # (bounded: a worker runs hundreds of files; each analysis keeps its recordings)
def _trace_once(model, precision: str, attention, config: tuple, sizes: tuple):
    # Always a fresh trace (use_cache=False): the tests' oracles need the probe recordings, and the
    # CLI tests fill the session's cache folder with entries of the same models.
    t0 = time.perf_counter()
    # (the CPU's kernels: the oracles these traces are checked against run on real CPU tensors)
    an = symcost.trace(model, dict(config), attention, sizes=dict(sizes), precision=precision, use_cache=False,
                       torch_device="cpu")
    if os.environ.get("SYMCOST_TRACE_LOG"):  # PREFIX: each worker appends "seconds, trace" to PREFIX + its name
        with open(os.environ["SYMCOST_TRACE_LOG"] + os.environ.get("PYTEST_XDIST_WORKER", "main"), "a") as f:
            f.write(f"{time.perf_counter() - t0:.1f}\t{model}\t{precision}\t{attention}\t{config}\t{sizes}\n")
    return an


@pytest.fixture(scope="module", autouse=True)
def _free_module_caches(request):
    """After each test file, clear the functools caches at its module level (traced ranks, analyses
    with their probe recordings): they live as long as the worker does, and a worker of the
    two-process run (each runs about half the files) grew past 11 GB with them, killed by the
    kernel's OOM killer on a 24 GiB machine (2026-12-06 run). (Collected after the teardown:
    ``pytest_runtest_teardown`` below.)"""
    yield
    import symcost._memo

    symcost._memo.clear_all()  # (symcost's own memos of traces: pipeline stages, checkpointed steps, plan)
    for value in list(vars(request.module).values()):
        clear = getattr(value, "cache_clear", None)
        if callable(clear) and hasattr(value, "cache_info"):
            clear()
    # torch's and sympy's process-wide caches: fake tensors' dispatch cache (one entry per op
    # signature at every probe size), compiled frames (tests/test_compile.py), sympy's memos
    import sys

    from torch._subclasses.fake_tensor import FakeTensorMode

    FakeTensorMode.cache.clear()
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()
    import sympy.core.cache

    sympy.core.cache.clear_cache()


@pytest.fixture(scope="session")
def traced():
    """``traced(model, precision="fp32", attention="eager", config=(), sizes=())`` -> Analysis (cached)."""
    return _trace


def random_sizes(an, rng: random.Random, n: int = 5, big: bool = False) -> list[dict[str, int]]:
    """``n`` random size tuples for the symbols of ``an``, valid for its model, never the fit's.

    Values are small (real CPU tensors are built at them) and differ from every probe point.
    """
    probes = {tuple(sorted(p.items())) for p in an.plan.points}
    out = []
    while len(out) < n:
        v = {
            "B": rng.randint(1, 4), "S": rng.randint(3, 24), "H": rng.choice((2, 4, 6, 8, 12, 16)),
            "D": rng.choice((4, 6, 8, 12, 16)), "L": rng.randint(1, 4), "V": rng.randint(17, 130),
            "F": rng.randint(8, 70),
        }
        v["K"] = rng.choice([k for k in (1, 2, 3, 4, 6, 8) if v["H"] % k == 0 and k < v["H"]])
        v = {s: v[s] for s in an.symbols}
        if tuple(sorted(v.items())) in probes or an.spec.check({**v, **{a: v[b] for a, b in an.spec.tied.items()}}):
            continue
        if any(s in v and v[s] % m != r for s, (m, r) in an.residues.items()):
            continue  # outside the residue class the trace holds in (partial rotary D): another regime
        out.append(v)
    return out


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """Run ``symcost ARGS`` in-process: (exit code, stdout, stderr), the output captured."""
    from symcost.cli import main as cli_main

    code = 0
    try:
        cli_main(list(args))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """An empty trace cache of the test's own (``SYMCOST_CACHE_DIR``)."""
    monkeypatch.setenv("SYMCOST_CACHE_DIR", str(tmp_path))
    return tmp_path


#: the files that take longest, run first so that pytest-xdist's `--dist loadfile` queue ends with
#: short files on both workers instead of one worker still in a long file while the other idles
#: (longest-first). From `--durations=0` of a full run (2026-12-04: 1731 s of test time, 886 s
#: wall on 2 workers), the files grown since put first by the slowest tests of the clean runs of
#: 2026-12-05 (their summed durations, seconds: test_pipeline_mesh 150, test_compile 93-146,
#: test_ep_tp 72-111, test_context_parallel 58-95, test_plan_traced 67-73, test_probe_plan 41,
#: test_vision_families, test_ssm_inference, test_etp, test_explore, test_fp8,
#: test_context_parallel_pp, test_offload_pipeline, test_expert_parallel 20-50 each; then those of
#: 10-30 s, test_parallel_stacks (one trace of about 30 CPU-s) to test_roofline; after it the heavy
#: files the twelfth session added, test_tensor_parallel_stacks (40-60 s) to test_megatron_buckets,
#: which ran last while unlisted)
LONGEST_FIRST = ("test_pipeline_mesh.py", "test_tensor_parallel.py", "test_compile.py", "test_pipeline_parallel.py",
                 "test_ep_tp.py", "test_context_parallel.py", "test_plan_traced.py", "test_dp_tp_mesh.py",
                 "test_serve.py", "test_moe_real_configs.py", "test_real_configs.py", "test_real_probes.py",
                 "test_probe_plan.py", "test_inference.py", "test_regimes.py", "test_checkpoint.py", "test_moe.py",
                 "test_memory.py", "test_parallel.py", "test_vision_families.py", "test_ssm_inference.py",
                 "test_expert_parallel.py", "test_etp.py", "test_explore.py", "test_fp8.py",
                 "test_context_parallel_pp.py", "test_offload_pipeline.py", "test_parallel_stacks.py",
                 "test_pipeline_stacks.py", "test_tensor_parallel_stacks.py", "test_checkpoint_plan_stacks.py", "test_plan_megatron.py",
                 "test_hf_ssm.py", "test_megatron_moe.py", "test_frozen_params.py", "test_megatron_buckets.py",
                 "test_moe_experts_code.py", "test_plan_routing.py", "test_megatron_run.py", "test_offload.py",
                 "test_routing_skew.py", "test_roofline.py", "test_moe_6np.py", "test_recompute.py",
                 "test_flops_exact.py", "test_plan.py", "test_parallel_memory.py", "test_serve_kv.py", "test_cli.py",
                 "test_memory_peak.py", "test_solve_pinned.py", "test_cache.py")


def pytest_configure(config):
    """Keep :data:`LONGEST_FIRST`'s order under ``--dist loadfile``: pytest-xdist (3.x,
    ``--loadscope-reorder``, on by default) queues the files by their number of tests, most
    first, which put the long files of few tests (test_pipeline_mesh.py: 5 tests, about 150 s;
    test_offload_pipeline.py: 2 tests, 30 s) late in the queue, where one of them becomes the
    run's tail (xdist/scheduler/loadscope.py ``schedule``). The same as ``--no-loadscope-reorder``."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    """Order the tests by :data:`LONGEST_FIRST` (stable: each file's own order is kept)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the test's fixtures are torn down: collect its cyclic garbage, then freeze what is
    left (``gc.freeze``); where the next test is in another file (or none is left), unfreeze first.

    A worker keeps every trace its tests made (``_trace`` caches them: hundreds of thousands of
    objects each), and each full collection scans all of them: the oracles' ``gc.collect()``
    (tests/memory_oracle.py) and the collector's own full passes grew to seconds each, and a
    worker's tests ran up to 4x slower late in the run than alone (tests/test_memory.py then
    tests/test_memory_ux.py in one process: 757 s, with this hook 473 s). Frozen objects are
    never scanned again, and so never freed where they sit in reference cycles (FX graphs,
    analyses): the module caches :func:`_free_module_caches` drops at a file's end, and the
    analyses ``_trace_once`` evicts, are collected only once unfrozen, which is done at a file's
    end once the worker has grown by :data:`FULL_COLLECT_GROWTH` since the last time (the 866eb5d
    run still grew by 0.4 GB a file to 8.4 GB a worker at 44 %, the
    8850db3 run's worker OOM-killed at 11.8 GB, because this hook had frozen them; it also ran
    before the fixtures' own teardown, freezing what they were about to drop)."""
    yield
    end_of_file = nextitem is None or nextitem.path != item.path
    full = end_of_file and (nextitem is None or _rss_bytes() - _FULL_COLLECT["rss"] > FULL_COLLECT_GROWTH)
    if full:
        gc.unfreeze()
    gc.collect()
    if full:
        try:  # (glibc: give the freed heap back to the system, so a worker's RSS is what it holds)
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
        _FULL_COLLECT["rss"] = _rss_bytes()
    gc.freeze()


#: a file's end unfreezes and collects everything only once the worker's resident memory has
#: grown this much since the last such collection: a full collection scans every live object
#: (the session's cached traces with their recordings: millions), 4 to 10 s at each of a worker's
#: some 65 file ends (2026-12-06 run: its own teardowns logged); frozen garbage waits at most
#: this much memory for it
FULL_COLLECT_GROWTH = 1 << 30
_FULL_COLLECT = {"rss": 0}


def _rss_bytes() -> int:
    """This process's resident memory (bytes; 0 where /proc is absent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
