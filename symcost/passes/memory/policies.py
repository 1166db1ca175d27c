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
        grad_buffer: the gradients live in one persistent buffer allocated with the model and
            zeroed, not freed, between steps (Megatron-LM's DDP ``main_grad`` buffer, which the
            backward accumulates into): static memory all step. False: the backward allocates
            them and ``zero_grad(set_to_none=True)`` frees them (``torch.optim``).
        grad_copy: bytes per element of an fp32 copy of the gradients that the optimizer makes
            at its step, sharded as the optimizer state and gone after it (Megatron-LM's fp16
            ``main_param.grad = main_grad.float()``, DeepSpeed ZeRO's ``.to(fp32)`` of the
            gradient partition); 0: the step reads the gradients as they are.
        sharded_optimizer_only: the framework runs it only with the optimizer state sharded over
            the data-parallel ranks (Megatron-LM's precision-aware optimizer needs its
            distributed optimizer): ``--dp N --shard ddp`` is refused (:func:`check_layout`).
        source: where the bytes come from (the framework's source or docs, the paper).
    """

    name: str
    param: int
    grad: int
    state: int
    master: int
    note: str
    grad_buffer: bool = False
    grad_copy: int = 0
    sharded_optimizer_only: bool = False
    source: str = ""


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
                                    "(as DeepSpeed's bf16 ZeRO optimizer keeps them; 16P)"),
    # Training frameworks' own policies, named after them (docs/memory.md, "Policies of training
    # frameworks"). Megatron-LM (megatron/core/optimizer/; docs/user-guide/features/
    # dist_optimizer.md, its table of bytes per parameter): the model in its dtype, a persistent
    # main-gradient buffer (fp32 with --bf16, which sets accumulate_allreduce_grads_in_fp32; the
    # model's dtype with --fp16 and fp32), fp32 main weights and Adam moments, which
    # --use-distributed-optimizer (= --shard zero1) shards over DP with the fp16 step's fp32
    # gradient copy; gradients and weights stay whole.
    "megatron-bf16": Policy("megatron-bf16", 2, 4, 4, 4,
                            "Megatron-LM --bf16: bf16 weights, fp32 main-gradient buffer, fp32 main weights and "
                            "Adam moments (18P; --use-distributed-optimizer = --shard zero1: 6 + 12/DP)",
                            grad_buffer=True,
                            source="Megatron-LM docs/user-guide/features/dist_optimizer.md (bf16 parameters, fp32 "
                                   "gradients: 18, 6 + 12/d); megatron/training/arguments.py (--bf16 sets "
                                   "accumulate_allreduce_grads_in_fp32)"),
    "megatron-fp16": Policy("megatron-fp16", 2, 2, 4, 4,
                            "Megatron-LM --fp16: fp16 weights and main-gradient buffer, fp32 main weights and Adam "
                            "moments, an fp32 copy of the gradients at the step (20P; distributed optimizer: "
                            "4 + 16/DP)",
                            grad_buffer=True, grad_copy=4,
                            source="Megatron-LM docs/user-guide/features/dist_optimizer.md (fp16 parameters, fp16 "
                                   "gradients: 20, 4 + 16/d); megatron/core/optimizer/distrib_optimizer.py "
                                   "_copy_model_grads_to_main_grads (shard_main_param.grad = shard_model_grad.float())"),
    "megatron-fp32": Policy("megatron-fp32", 4, 4, 4, 0,
                            "Megatron-LM in fp32: fp32 weights and main-gradient buffer, fp32 Adam moments, no main "
                            "copy (16P; distributed optimizer: 8 + 8/DP)",
                            grad_buffer=True,
                            source="Megatron-LM docs/user-guide/features/dist_optimizer.md (fp32 parameters, fp32 "
                                   "gradients: 16, 8 + 8/d)"),
    "megatron-bf16-moments": Policy("megatron-bf16-moments", 2, 4, 2, 2,
                                    "Megatron-LM --bf16 --use-precision-aware-optimizer --exp-avg-dtype bf16 "
                                    "--exp-avg-sq-dtype bf16 (distributed optimizer only): fp32 main-gradient buffer, "
                                    "bf16 moments, fp32 main weights kept as the 16 bits bf16 weights lack "
                                    "(store_param_remainders): 6 + 6/DP",
                                    grad_buffer=True, sharded_optimizer_only=True,
                                    source="Megatron-LM megatron/core/optimizer/optimizer_config.py (exp_avg_dtype, "
                                           "exp_avg_sq_dtype; store_param_remainders=True), distrib_optimizer.py "
                                           "(master_param as int16 remainders with bf16), optimizer/__init__.py "
                                           "(the precision-aware optimizer only with the distributed optimizer)"),
    # DeepSpeed's ZeRO (Rajbhandari et al. 2020, section 5.1 and Table 1: mixed-precision Adam,
    # 2 + 2 + K with K = 12; ZeRO-1/2/3 = --shard zero1/zero2/zero3); its optimizers convert the
    # gradient partition to fp32 at the step (deepspeed/runtime/zero/stage_1_and_2.py step(),
    # stage3.py), which the paper's K leaves out and DeepSpeed's estimators count (their 18).
    "deepspeed-fp16": Policy("deepspeed-fp16", 2, 2, 4, 4,
                             "DeepSpeed fp16 with ZeRO (--shard zero1/zero2/zero3): fp16 weights and gradients, fp32 "
                             "master weights and Adam moments (the ZeRO paper's 2 + 2 + 12), an fp32 copy of the "
                             "gradient partition at the step",
                             grad_copy=4,
                             source="Rajbhandari et al. 2020, ZeRO, section 5.1 and Table 1 (K = 12); DeepSpeed "
                                    "deepspeed/runtime/zero/stage_1_and_2.py step() (.to(fp32) of the partition)"),
    "deepspeed-bf16": Policy("deepspeed-bf16", 2, 2, 4, 4,
                             "DeepSpeed bf16 with ZeRO (--shard zero1/zero2/zero3): bf16 weights and gradients "
                             "(data_types.grad_accum_dtype left at the model's), fp32 master weights and Adam "
                             "moments, an fp32 copy of the gradient partition at the step",
                             grad_copy=4,
                             source="Rajbhandari et al. 2020, ZeRO, section 5.1 and Table 1 (K = 12); DeepSpeed "
                                    "deepspeed/runtime/engine.py _do_optimizer_sanity_check (bf16 under ZeRO: the "
                                    "ZeRO optimizer)"),
}


def check_layout(name: str, dp, shard: str | None) -> None:
    """Refuse a policy that its framework does not run under the data-parallel strategy asked
    for, in one line, before any trace: ``megatron-bf16-moments`` with ``--dp N --shard ddp``
    (N > 1), as Megatron-LM refuses ``--use-precision-aware-optimizer`` without
    ``--use-distributed-optimizer``. ``dp``: the data-parallel size (an int, the symbol DP, or
    None on one device).

    Raises:
        SymcostError: such a combination.
    """
    pol = POLICIES.get(name)
    if pol is not None and pol.sharded_optimizer_only and dp not in (None, 1) and (shard or "ddp") == "ddp":
        raise SymcostError(f"--precision {name} runs only with the optimizer state sharded over the data-parallel "
                           "ranks (Megatron-LM refuses --use-precision-aware-optimizer without "
                           "--use-distributed-optimizer): add --shard zero1, Megatron's distributed optimizer")


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
#: at once), ``for-loop`` (one tensor at a time), ``fused`` (no temporaries: torch's
#: ``fused=True``, and the frameworks' multi-tensor fused Adam), or ``default``: the engine's
#: under a framework's policy, else what ``torch.optim`` picks itself when ``foreach`` is left
#: None, which depends on the device (:func:`default_impl`).
IMPLS = ("default", "foreach", "for-loop", "fused")
#: Devices the step may run on, for ``impl="default"``.
DEVICES = ("cuda", "cpu", "xpu", "mtia")
#: torch/utils/_foreach_utils.py ``_get_foreach_kernels_supported_devices()`` (torch 2.x): the
#: device types whose tensors ``torch.optim`` steps with foreach kernels by default.
FOREACH_DEVICES = ("cuda", "xpu", "mtia")
STEP_BYTES = 4  # torch.tensor(0.0, dtype=_get_scalar_dtype()): fp32, 0-d


#: The training frameworks whose engine steps Adam/AdamW with its own fused kernel on a CUDA
#: device, by the prefix of their policies' names, with the source. Megatron-LM
#: (megatron/core/optimizer/__init__.py, NVIDIA/Megatron-LM d98e8a6): ``Adam`` is Transformer
#: Engine's ``FusedAdam``, else Apex's, and only where neither imports ``torch.optim.AdamW``;
#: both step each parameter group with ``multi_tensor_applier(multi_tensor_adam, ...)`` over
#: chunks of the group's tensors (transformer_engine/pytorch/optimizers/fused_adam.py ``step``),
#: no whole-group temporaries. DeepSpeed (deepspeed/runtime/engine.py
#: ``_configure_basic_optimizer``): an ``Adam``/``AdamW`` config runs ``deepspeed.ops.adam.FusedAdam``
#: (the same multi-tensor kernel, adapted from Apex; deepspeed/ops/adam/fused_adam.py) unless
#: ``torch_adam`` is set (then torch.optim's, foreach on CUDA) or the optimizer is offloaded to the
#: CPU (``DeepSpeedCPUAdam``: the step leaves the device).
ENGINE_FUSED_ADAM = {
    "megatron-": "Megatron-LM megatron/core/optimizer/__init__.py (Transformer Engine's or Apex's FusedAdam)",
    "deepspeed-": "DeepSpeed deepspeed/runtime/engine.py _configure_basic_optimizer (deepspeed.ops.adam.FusedAdam)",
}
#: optimizers the engines above run fused (Megatron-LM's ``--optimizer adam``, decoupled weight
#: decay by default; DeepSpeed's ``Adam``/``AdamW``)
ENGINE_FUSED_OPTIMIZERS = ("adam", "adamw")


def engine_impl(precision: str | None, optimizer: str = "adamw", device: str = "cuda") -> str | None:
    """The optimizer implementation the training framework that ``precision`` names runs, or
    None where the policy is torch.optim's (then :func:`default_impl` decides).

    ``"fused"`` for Adam/AdamW under the ``megatron-*`` and ``deepspeed-*`` policies on a CUDA
    device (:data:`ENGINE_FUSED_ADAM`: Transformer Engine's, Apex's or DeepSpeed's
    ``FusedAdam``, GPU-only kernels); None on any other device, where Megatron-LM falls back to
    ``torch.optim.AdamW`` (no Transformer Engine or Apex build), and for other optimizers.
    """
    name = str(precision or "")
    if device != "cuda" or str(optimizer).lower() not in ENGINE_FUSED_OPTIMIZERS:
        return None
    return "fused" if any(name.startswith(k) for k in ENGINE_FUSED_ADAM) else None


def default_impl(device: str = "cuda", precision: str | None = None, optimizer: str = "adamw") -> str:
    """The optimizer implementation that runs when none is asked for.

    Under a training framework's policy, its engine's (:func:`engine_impl`: fused Adam under
    ``megatron-*`` and ``deepspeed-*`` on CUDA). Otherwise what ``torch.optim`` runs when
    ``foreach`` is left None: torch/optim/optimizer.py ``_default_to_fused_or_foreach``: foreach
    when every parameter lies on a device with foreach kernels (CUDA, XPU, MTIA), else the
    per-tensor for-loop (the CPU); fused only when asked for. So the same ``AdamW(params)`` keeps a
    state-sized temporary of every tensor at once on a GPU and two temporaries of one tensor at a
    time on the CPU.

    Raises:
        SymcostError: unknown device.
    """
    if device not in DEVICES:
        raise SymcostError(f"unknown device {device!r}; accepted: {', '.join(DEVICES)}")
    return engine_impl(precision, optimizer, device) or ("foreach" if device in FOREACH_DEVICES else "for-loop")


def resolve_impl(impl: str, device: str = "cuda", precision: str | None = None, optimizer: str = "adamw") -> str:
    """``impl`` itself, or for ``"default"`` :func:`default_impl` (the engine's under a framework's
    policy, else what ``torch.optim`` picks on ``device``).

    Raises:
        SymcostError: unknown implementation or device.
    """
    if impl not in IMPLS:
        raise SymcostError(f"unknown optimizer implementation {impl!r}; accepted: {', '.join(IMPLS)}")
    return default_impl(device, precision, optimizer) if impl == "default" else impl


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
