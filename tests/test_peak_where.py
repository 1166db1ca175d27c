"""Where the memory peak is said to be reached, for a step not folded into blocks (one schedule
unit): the label names the phase the op ran in (``forward: ...``/``backward: ...``), not ``step:``,
which read as the optimizer step (its own label: ``optimizer step (...)``). Oracle: the phase in
which PyTorch runs each op of the real step (an op dispatched while autograd runs a graph task is
the backward's), under ``TorchDispatchMode``."""
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import symcost
from symcost import ModelSpec
from symcost.passes.memory import memory_model


class _Net(nn.Module):  # (two different layers: no block to fold)
    def __init__(self, D, F):
        super().__init__()
        self.up, self.down = nn.Linear(D, F), nn.Linear(F, 3)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


SPEC = ModelSpec(name="two-linear", symbols=("D", "F"), defaults={"B": 2, "S": 3, "D": 8, "F": 16},
                 build=lambda v: _Net(v["D"], v["F"]),
                 make_inputs=lambda v, device: ((torch.randn(v["B"], v["S"], v["D"], device=device),), {}),
                 loss=lambda y, inputs: y.float().pow(2).mean())


def _phases(values) -> dict[str, set[str]]:
    """phase -> the aten ops (``name.overload``) the real step runs in it."""
    out = {"forward": set(), "backward": set()}

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            out[phase].add(str(func).removeprefix("aten."))
            return func(*args, **(kwargs or {}))

    model = SPEC.build(values)
    args, kwargs = SPEC.make_inputs(values, "cpu")
    with Seen():
        SPEC.loss(model(*args, **kwargs), (args, kwargs)).backward()
    return out


def test_unfolded_peak_says_the_phase():
    v = {"B": 2, "S": 3, "D": 8, "F": 16}
    an = symcost.trace(SPEC, sizes=v, precision="fp32", torch_device="cpu")
    mm = memory_model(an, "fp32", "adamw", impl="for-loop", device="cpu")
    assert [u.label for u in mm.schedule.units] == ["step"]  # (the case: one unit)
    real = _phases(v)
    labels = [w for _, _, w in mm.peak_terms()] + [mm.peak_parts(**v)["where"]]
    for w in labels:
        if w.startswith("optimizer step"):
            continue
        phase, _, rest = w.partition(": ")
        assert phase in real and rest.rsplit(" ", 1)[-1] in real[phase], (w, real)
