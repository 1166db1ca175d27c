"""Precision names: what each ``--precision`` traces and what it means (torch-free).

The names follow PyTorch Lightning's ``precision=`` and Accelerate's ``mixed_precision=``:
``bf16-mixed`` / ``fp16-mixed`` are ``torch.autocast`` over fp32 weights (fp32 parameters, fp32
gradients, fp32 optimizer state; autocast's low-precision weight copies are activations), and
``bf16-true`` / ``fp16-true`` put every tensor in the low precision. Two policies keep the
weights in bf16 but the optimizer state (and a master copy) in fp32; their names say so. The
``megatron-*`` and ``deepspeed-*`` policies are those frameworks' own, named after them
(docs/memory.md, "Policies of training frameworks"). The bytes per element of each policy are
:data:`symcost.passes.memory.POLICIES`.

Each entry: ``(weight dtype of the trace, autocast dtype or None, one line on what it is)``;
dtypes are names (``"float32"``) so this module does not import torch.
"""
from __future__ import annotations

from symcost.errors import SymcostError

#: name -> (parameter dtype the model is traced in, autocast dtype or None, description)
PRECISIONS: dict[str, tuple[str, str | None, str]] = {
    "fp32": ("float32", None, "fp32 weights, gradients and optimizer state"),
    "bf16-mixed": ("float32", "bfloat16",
                   "torch.autocast(bf16) over fp32 weights, as Lightning/Accelerate 'bf16-mixed': fp32 "
                   "weights, gradients and optimizer state; autocast's bf16 weight copies are activations"),
    "fp16-mixed": ("float32", "float16",
                   "torch.autocast(fp16) over fp32 weights, as Lightning '16-mixed': fp32 weights, "
                   "gradients and optimizer state (GradScaler's scale is a few bytes)"),
    "bf16-true": ("bfloat16", None, "every tensor in bf16: weights, gradients and optimizer state"),
    "fp16-true": ("float16", None, "every tensor in fp16: weights, gradients and optimizer state"),
    "bf16-true-fp32-state": ("bfloat16", None,
                             "bf16 weights and gradients, fp32 optimizer state, no master copy "
                             "(the 12P of the conventions with Adam)"),
    "bf16-true-fp32-master": ("bfloat16", None,
                              "bf16 weights and gradients, fp32 master weights and optimizer state "
                              "(the ZeRO paper's mixed-precision Adam; 16P with Adam)"),
    # training frameworks' policies, named after them (their bytes: symcost.passes.memory.POLICIES)
    "megatron-bf16": ("bfloat16", None,
                      "Megatron-LM --bf16: bf16 weights, a persistent fp32 main-gradient buffer, fp32 main "
                      "weights and Adam moments (--dp N --shard zero1: --use-distributed-optimizer)"),
    "megatron-fp16": ("float16", None,
                      "Megatron-LM --fp16: fp16 weights and main-gradient buffer, fp32 main weights and Adam "
                      "moments, an fp32 gradient copy at the step (--shard zero1: the distributed optimizer)"),
    "megatron-fp32": ("float32", None,
                      "Megatron-LM in fp32: fp32 weights, main-gradient buffer and Adam moments "
                      "(--shard zero1: the distributed optimizer)"),
    "megatron-bf16-moments": ("bfloat16", None,
                              "Megatron-LM --bf16 with --use-precision-aware-optimizer --exp-avg-dtype bf16 "
                              "--exp-avg-sq-dtype bf16 (its distributed optimizer only: --shard zero1)"),
    "deepspeed-fp16": ("float16", None,
                       "DeepSpeed fp16 with ZeRO (--shard zero1/zero2/zero3): fp16 weights and gradients, fp32 "
                       "master weights and Adam moments (2 + 2 + 12)"),
    "deepspeed-bf16": ("bfloat16", None,
                       "DeepSpeed bf16 with ZeRO (--shard zero1/zero2/zero3): bf16 weights and gradients, fp32 "
                       "master weights and Adam moments (2 + 2 + 12)"),
}

#: One short phrase per precision, for the report's first lines.
SUMMARY: dict[str, str] = {
    "fp32": "fp32 everywhere",
    "bf16-mixed": "torch.autocast(bf16) over fp32 weights (Lightning/Accelerate bf16-mixed)",
    "fp16-mixed": "torch.autocast(fp16) over fp32 weights (Lightning 16-mixed)",
    "bf16-true": "every tensor bf16",
    "fp16-true": "every tensor fp16",
    "bf16-true-fp32-state": "bf16 weights and grads, fp32 optimizer state (12P)",
    "bf16-true-fp32-master": "bf16 weights and grads, fp32 master weights and state",
    "megatron-bf16": "Megatron-LM bf16: fp32 main-grad buffer, fp32 main weights and moments",
    "megatron-fp16": "Megatron-LM fp16: fp32 main weights and moments, fp32 grad copy at the step",
    "megatron-fp32": "Megatron-LM fp32: fp32 weights, main-grad buffer and moments",
    "megatron-bf16-moments": "Megatron-LM bf16, precision-aware optimizer with bf16 moments (--shard zero1)",
    "deepspeed-fp16": "DeepSpeed ZeRO fp16: 2 + 2 + 12 (fp32 grad partition at the step)",
    "deepspeed-bf16": "DeepSpeed ZeRO bf16: 2 + 2 + 12 (fp32 grad partition at the step)",
}

#: The default ``--precision``: what autocast training really allocates.
DEFAULT = "bf16-mixed"

#: Names symcost used to accept, and what to write instead.
RENAMED: dict[str, str] = {
    "bf16": "bf16-true (every tensor bf16) or bf16-mixed (autocast over fp32 weights, what "
            "Lightning and Accelerate call 'bf16')",
    "fp16": "fp16-true (every tensor fp16) or fp16-mixed (autocast over fp32 weights)",
    "16-mixed": "fp16-mixed", "32-true": "fp32", "32": "fp32", "16-true": "fp16-true",
    "bf16-mixed-master": "bf16-true-fp32-master (bf16 weights, fp32 master weights and state)",
}


def check_precision(name: str) -> str:
    """``name`` if it is a precision of :data:`PRECISIONS`.

    Raises:
        SymcostError: an unknown or renamed name (the message says what to write instead).
    """
    if name in PRECISIONS:
        return name
    if name in RENAMED:
        raise SymcostError(f"precision {name!r} is ambiguous or renamed: use {RENAMED[name]}")
    raise SymcostError(f"unknown precision {name!r}; accepted: {', '.join(PRECISIONS)}")


def precision_context(precision: str):
    """``(parameter dtype, autocast context factory)`` of a precision (:data:`PRECISIONS`), as
    every recording of a step runs it (torch is imported here, not by this module).

    ``*-true`` and ``bf16-true-fp32-*``: the model cast to bf16 / fp16 (``model.to(dtype)``);
    ``*-mixed``: the fp32 model run under ``torch.autocast("cpu", dtype=bf16 or fp16)`` (what
    autocast saves, its low-precision copies of the weights included, is what the recording sees);
    ``fp32``: the fp32 model.

    Raises:
        SymcostError: an unknown or renamed precision.
    """
    import contextlib

    import torch

    weights, cast, _ = PRECISIONS[check_precision(precision)]
    dtype = getattr(torch, weights)
    if cast is None:
        return dtype, contextlib.nullcontext
    return dtype, lambda: torch.autocast("cpu", dtype=getattr(torch, cast))
