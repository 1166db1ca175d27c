"""``max-batch --solve IMG`` (issue 30 item 6): the largest image side of a vision model under a
memory cap, among the sides the model accepts and its formulas hold for (a "multiple" limit, or
the residue class of the request where strides floor the side).

Oracles: the traced peak evaluated at the answer and at the next admissible side (the answer fits,
the next does not, no admissible side in between), and torch.profiler's peak of the real CPU step
(tests/memory_oracle.py ``step_peak``, at the ends of aten ops: the CPU convolutions' scratch inside
an op, 30-50% above at these sizes, is no tensor symcost models) at sides around the answer: under
a cap halfway between the measured peaks of two neighbouring admissible sides, the answer is the
smaller one. The model is
docs/user-guide.md's factory example ``cnn.py`` (a stem, residual 3x3 blocks, max-pool 2 and a
stride-2 convolution: its feature maps floor the side), tiny sizes.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import random
import re
from pathlib import Path

import pytest

import symcost
from conftest import run_cli
from memory_oracle import step_peak
from symcost.errors import SymcostError
from symcost.passes import memory

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = re.compile(r"^<!-- factory example: cnn.py -->\s*\n```python[^\n]*\n(.*?)^```", re.M | re.S)
#: the other sizes, tiny (B images of C channels, L blocks, NCLS classes)
SIZES = {"B": 2, "C": 4, "L": 2, "NCLS": 5}


@pytest.fixture(scope="module")
def cnn(tmp_path_factory) -> Path:
    """The guide's CNN factory written to a file."""
    path = tmp_path_factory.mktemp("cnn") / "cnn.py"
    path.write_text(EXAMPLE.search((ROOT / "docs" / "user-guide.md").read_text()).group(1))
    return path


def _module(path: Path):
    spec = importlib.util.spec_from_file_location("guide_cnn", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _boundary(an, side_at, period: int, seed: str):
    """The solver's answer under a cap halfway between the real peaks of two neighbouring
    admissible sides ``x`` and ``x + period`` (x drawn from ``side_at``'s list), checked against
    the traced peak and against those measurements."""
    mm = memory.memory_model(an, "fp32", "adamw", "foreach", "cpu")
    x = random.Random(seed).choice(side_at)
    lo = step_peak(an.spec, {**SIZES, "IMG": x}, "fp32", "adamw", foreach=True)["peak_ops"]
    hi = step_peak(an.spec, {**SIZES, "IMG": x + period}, "fp32", "adamw", foreach=True)["peak_ops"]
    assert lo < hi
    cap = (lo + hi) // 2
    sol = mm.solve(cap, "IMG", **SIZES)
    assert sol.checked and (sol.value, sol.next_value, sol.modulus) == (x, x + period, period), (sol, lo, cap, hi)
    # the traced peak: the answer fits, the next admissible side does not, and nothing between is admissible
    assert mm.peak(**SIZES, IMG=x) == sol.memory_at <= cap < mm.peak(**SIZES, IMG=x + period) == sol.memory_next
    m, r = an.residues.get("IMG", (1, 0))
    assert not any(an.spec.check({**an.spec.defaults, **SIZES, "IMG": y}) is None and y % m == r
                   for y in range(x + 1, x + period))
    return mm, sol


def test_largest_side_multiple_of_4_equals_real_peak(cnn):
    """The CNN's limit "IMG a multiple of 4": the largest multiple of 4 whose peak fits, the real
    step's peaks bracketing the cap; a cap below the smallest side fits none (least side 4)."""
    # (at the factory's default side, 64: the CLI below solving for IMG traces the same request, from the cache)
    an = symcost.trace(f"{cnn}:spec", sizes={**SIZES, "IMG": 64}, precision="fp32", torch_device="cpu")
    assert "IMG" in an.symbols and not an.pinned
    mm, sol = _boundary(an, list(range(12, 41, 4)), 4, "img:multiple")
    none = mm.solve(mm.peak(**SIZES, IMG=4) - 1, "IMG", **SIZES)
    assert (none.value, none.next_value, none.checked) == (0, 4, True)


def test_largest_side_in_the_residue_class_equals_real_peak(cnn):
    """The same CNN without its limit, declared polynomial in IMG only mod 4 (``moduli``: every side
    runs, the pool and the stride floor it): traced at IMG = 18, the answer is the largest side
    ≡ 2 (mod 4) whose peak fits, checked against the next side of that class and the real peaks."""
    spec = dataclasses.replace(_module(cnn).spec(), constraints=(), check=None, moduli={"IMG": 4})
    an = symcost.trace(spec, sizes={**SIZES, "IMG": 18}, precision="fp32", torch_device="cpu")
    assert an.residues == {"IMG": [4, 2]} and not an.pinned
    _boundary(an, list(range(14, 43, 4)), 4, "img:residue")


def test_solve_image_side_cli_and_one_line_errors(cnn, capsys):
    """The CLI's --solve IMG: JSON names the class and the next admissible side; a symbol the model
    lacks, a mesh size, a pinned side and --checkpoint with IMG are one line each (exit 2)."""
    code, out, err = run_cli(capsys, "max-batch", f"{cnn}:spec", "--solve", "IMG", "--set", "B=2", "C=4", "L=2",
                             "NCLS=5", "--precision", "fp32", "--torch-device", "cpu", "--memory", "4MiB", "--json")
    assert code == 0, err
    import json

    js = json.loads(out)
    assert js["solve"] == "IMG" and js["max_IMG"] % 4 == 0 and js["next_admissible"] == js["max_IMG"] + 4
    assert js["residue_class"] == {"modulus": 4, "residue": 0} and js["check"]
    assert js["memory_at_max"] <= 4 * 2**20 < js["memory_at_next"]
    for args, want in ((("--solve", "DP"), "--solve takes B, S or a size of the model"),
                       (("--solve", "XYZ"), "cannot solve for 'XYZ': not a symbol"),
                       (("--solve", "IMG", "--checkpoint", "sqrt"), "--checkpoint with --solve IMG is not modelled")):
        code, _, err = run_cli(capsys, "max-batch", f"{cnn}:spec", *args, "--set", "B=2", "C=4", "L=2", "NCLS=5",
                               "--precision", "fp32", "--torch-device", "cpu")
        assert code == 2 and want in err and len(err.strip().splitlines()) == 1, err
    # a side the trace pinned has no formula to solve
    an = symcost.trace(dataclasses.replace(_module(cnn).spec(), pin={"IMG": "pinned for the test"}),
                       sizes={**SIZES, "IMG": 8}, precision="fp32", torch_device="cpu")
    with pytest.raises(SymcostError, match=r"cannot solve for IMG: this trace pinned it at 8 \(pinned for the test\)"):
        memory.memory_model(an, "fp32", "adamw", "foreach", "cpu").solve("1GiB", "IMG", **SIZES)


@pytest.mark.heavy
def test_pinned_side_solved_by_tracing_sides_equals_real_peak(cnn, capsys):
    """A side the trace pins (the guide's CNN with ``pin={"IMG": ...}``, as ViT's image side is
    pinned) has no formula: max-batch --solve IMG traces the admissible sides (multiples of 4) by
    doubling and bisection; under a cap halfway between torch.profiler's peaks of the real step at
    two neighbouring sides the answer is the smaller one, M from the traces at it and the next."""
    factory = cnn.parent / "pinned_cnn.py"
    factory.write_text("import dataclasses, sys\nsys.path.insert(0, %r)\nfrom cnn import spec as _spec\n\n\n"
                       "def spec():\n    return dataclasses.replace(_spec(), pin={'IMG': 'pinned for the test'})\n"
                       % str(cnn.parent))
    x = random.Random("img:pinned").choice((20, 24, 28))
    spec = _module(cnn).spec()
    lo, hi = (step_peak(spec, {**SIZES, "IMG": s}, "fp32", "adamw", foreach=False)["peak_ops"] for s in (x, x + 4))
    cap = (lo + hi) // 2
    code, out, err = run_cli(capsys, "max-batch", f"{factory}:spec", "--solve", "IMG", "--set", "B=2", "C=4", "L=2",
                             "NCLS=5", "--precision", "fp32", "--torch-device", "cpu", "--memory", f"{cap}B", "--json")
    assert code == 0, err
    import json

    js = json.loads(out)
    assert (js["max_IMG"], js["next_admissible"], js["check"]) == (x, x + 4, True), (js, lo, cap, hi)
    assert js["memory_at_max"] == lo and js["memory_at_next"] == hi  # (the traces' peaks: the profiler's)
