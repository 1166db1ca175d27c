"""Stage 5, passes: analyses over the op graph that return plain data (no printing).

``memory`` (static memory by precision policy, activations, peak, largest batch, accumulation),
``checkpoint`` and ``checkpoint_ops`` (activation checkpointing: the sqrt-L law, the exact optimum),
``moe`` (expert slots and the MoE facts), ``roofline`` (per-op bound on a device, step time, MFU).
Imports frontends, tracing, graph and hardware.
"""
