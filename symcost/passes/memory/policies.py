"""Precision policies and optimizers: the bytes per element of each static part of training
memory (conventions.md, "Memory of a training step"), and how ``torch.optim`` runs its step.
"""
from __future__ import annotations

from dataclasses import dataclass

from symcost.errors import SymcostError

@dataclass(frozen=True)
class Policy:
    """Bytes per element of each static component under a precision policy.

    Attributes:
        name: the policy (= the ``--precision`` the model is traced with).
        param: bytes per parameter of the weights the forward reads.
        grad: bytes per gradient element.
        state: bytes per element of optimizer state (moments, momentum, factored variance).
        master: bytes per parameter of master weights (0: no master copy).
        note: one line on what the policy is.
    """

    name: str
    param: int
    grad: int
    state: int
    master: int
    note: str


#: The precision policies (conventions.md "Memory of a training step"; names and what is traced in
#: :mod:`symcost.frontends.precision`). Activations always come from the trace at the same precision: the
#: model cast to bf16/fp16 for ``*-true`` and ``bf16-true-fp32-*``, the fp32 model under
#: ``torch.autocast`` for ``*-mixed`` (whose bf16/fp16 weight copies are activations, not static).
POLICIES: dict[str, Policy] = {
    "fp32": Policy("fp32", 4, 4, 4, 0, "fp32 weights, gradients and optimizer state"),
    "bf16-mixed": Policy("bf16-mixed", 4, 4, 4, 0,
                         "autocast over fp32 weights (Lightning/Accelerate bf16-mixed): fp32 weights, "
                         "gradients and optimizer state"),
    "fp16-mixed": Policy("fp16-mixed", 4, 4, 4, 0,
                         "autocast over fp32 weights (Lightning 16-mixed): fp32 weights, gradients and "
                         "optimizer state"),
    "bf16-true": Policy("bf16-true", 2, 2, 2, 0, "every tensor bf16: weights, gradients and optimizer state"),
    "fp16-true": Policy("fp16-true", 2, 2, 2, 0, "every tensor fp16: weights, gradients and optimizer state"),
    "bf16-true-fp32-state": Policy("bf16-true-fp32-state", 2, 2, 4, 0,
                                   "bf16 weights and gradients, fp32 optimizer state, no master copy "
                                   "(the conventions' 12P)"),
    "bf16-true-fp32-master": Policy("bf16-true-fp32-master", 2, 2, 4, 4,
                                    "bf16 weights and gradients, fp32 master weights and optimizer state "
                                    "(Megatron-LM / DeepSpeed bf16; 16P)"),
}


@dataclass(frozen=True)
class Optimizer:
    """The state an optimizer keeps per parameter tensor (as torch.optim 2.x does).

    Attributes:
        name: ``adamw``, ``adam``, ``sgd``, ``sgd-nomomentum`` or ``adafactor``.
        full: state tensors of the parameter's full shape (Adam: exp_avg, exp_avg_sq; SGD with
            momentum: momentum_buffer).
        factored: Adafactor's factored second moment: for a tensor of >= 2 dims, ``row_var``
            (last dim reduced to 1) plus ``col_var`` (second-to-last dim reduced to 1); for a
            vector, one full ``variance``.
        step: a 0-d fp32 ``step`` tensor per parameter tensor (4 bytes; torch's Adam, AdamW and
            Adafactor keep it on the CPU unless ``capturable``/``fused``).
        torch: the class it models.
    """

    name: str
    full: int
    factored: bool
    step: bool
    torch: str


OPTIMIZERS: dict[str, Optimizer] = {
    "adamw": Optimizer("adamw", 2, False, True, "torch.optim.AdamW"),
    "adam": Optimizer("adam", 2, False, True, "torch.optim.Adam"),
    "sgd": Optimizer("sgd", 1, False, False, "torch.optim.SGD(momentum>0)"),
    "sgd-nomomentum": Optimizer("sgd-nomomentum", 0, False, False, "torch.optim.SGD(momentum=0)"),
    "adafactor": Optimizer("adafactor", 0, True, True, "torch.optim.Adafactor"),
}

#: How the optimizer step runs: ``foreach`` (one list op per update, temporaries for all tensors
#: at once), ``for-loop`` (one tensor at a time), ``fused`` (no temporaries), or ``default``:
#: what ``torch.optim`` picks itself when ``foreach`` is left None, which depends on the device
#: (:func:`default_impl`).
IMPLS = ("default", "foreach", "for-loop", "fused")
#: Devices the step may run on, for ``impl="default"``.
DEVICES = ("cuda", "cpu", "xpu", "mtia")
#: torch/utils/_foreach_utils.py ``_get_foreach_kernels_supported_devices()`` (torch 2.x): the
#: device types whose tensors ``torch.optim`` steps with foreach kernels by default.
FOREACH_DEVICES = ("cuda", "xpu", "mtia")
STEP_BYTES = 4  # torch.tensor(0.0, dtype=_get_scalar_dtype()): fp32, 0-d


def default_impl(device: str = "cuda") -> str:
    """The optimizer implementation ``torch.optim`` runs when ``foreach`` is left None.

    torch/optim/optimizer.py ``_default_to_fused_or_foreach``: foreach when every parameter lies
    on a device with foreach kernels (CUDA, XPU, MTIA), else the per-tensor for-loop (the CPU);
    fused only when asked for. So the same ``AdamW(params)`` keeps a state-sized temporary of
    every tensor at once on a GPU and two temporaries of one tensor at a time on the CPU.

    Raises:
        SymcostError: unknown device.
    """
    if device not in DEVICES:
        raise SymcostError(f"unknown device {device!r}; accepted: {', '.join(DEVICES)}")
    return "foreach" if device in FOREACH_DEVICES else "for-loop"


def resolve_impl(impl: str, device: str = "cuda") -> str:
    """``impl`` itself, or for ``"default"`` what ``torch.optim`` picks on ``device``.

    Raises:
        SymcostError: unknown implementation or device.
    """
    if impl not in IMPLS:
        raise SymcostError(f"unknown optimizer implementation {impl!r}; accepted: {', '.join(IMPLS)}")
    return default_impl(device) if impl == "default" else impl


def policy(name: str) -> Policy:
    """The :class:`Policy` called ``name``.

    Raises:
        SymcostError: unknown or renamed policy (the message names the new one).
    """
    from symcost.frontends.precision import check_precision

    return POLICIES[check_precision(name)]


def optimizer(name: str) -> Optimizer:
    """The :class:`Optimizer` called ``name`` (case-insensitive).

    Raises:
        SymcostError: unknown optimizer.
    """
    try:
        return OPTIMIZERS[str(name).lower()]
    except KeyError:
        raise SymcostError(f"unknown optimizer {name!r}; accepted: {', '.join(OPTIMIZERS)}") from None
