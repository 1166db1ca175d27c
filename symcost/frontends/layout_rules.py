"""Which combinations of a :class:`symcost.frontends.layout.Layout`'s dimensions and options are
modelled: the one-line refusals of the rest, and the normalisation of the options' types.

Called by ``Layout.__post_init__`` (a layout that exists is one symcost models). Each refusal
says what was asked, why it is not modelled, and what is accepted (docs/parallel.md's sections).
"""
from __future__ import annotations

from symcost.errors import SymcostError


def check_layout(lay) -> None:
    """Refuse a layout whose combination is not modelled, and normalise its option fields
    (booleans, tuples, the replicate degree as int) in place on the frozen dataclass.

    Raises:
        SymcostError: one line naming the options, why, and what is accepted.
    """
    from symcost.frontends.parallel import check_shard

    if lay.shard is not None:
        check_shard(lay.shard)
    if lay.fsdp_mp is not None:
        if lay.shard is None:
            raise SymcostError("--fsdp-mp (fsdp_mp) is a policy of data-parallel training: give shard (--dp N)")
        object.__setattr__(lay, "fsdp_mp", tuple(lay.fsdp_mp))
    from symcost.frontends.checkpointing import AC_MODES

    if lay.ac is not None and lay.ac not in AC_MODES:
        raise SymcostError(f"unknown --ac {lay.ac!r}; accepted: none, {', '.join(AC_MODES)}")
    if lay.sp and not lay.tp:
        raise SymcostError("--sp needs --tp N (the tensor-parallel size)")
    if lay.replicate is not None:
        from symcost.frontends.parallel import SHARDS

        if lay.shard is None:
            raise SymcostError("--dp-replicate R (HSDP) needs --dp N (the whole data-parallel size, R × shard)")
        if int(lay.replicate) < 1:
            raise SymcostError(f"--dp-replicate {lay.replicate}: the replicate degree is a whole number >= 1")
        if SHARDS[lay.shard][0] != "fully_shard":
            raise SymcostError(f"--dp-replicate {lay.replicate} with --shard {lay.shard}: HSDP replicates "
                               "FSDP2's shards; give --shard fsdp, zero3 or zero2 (DDP replicates everything "
                               "already: --dp N alone)")
        object.__setattr__(lay, "replicate", int(lay.replicate))
    if lay.offload and lay.shard not in ("fsdp", "zero3"):
        raise SymcostError("--offload is FSDP2's CPUOffloadPolicy: give --dp N --shard fsdp or zero3"
                           + (f" (not {lay.shard})" if lay.shard else ""))
    object.__setattr__(lay, "offload", bool(lay.offload))
    if lay.fp8_all_gather and lay.fp8 is None:
        raise SymcostError("--fp8-all-gather needs --fp8 tensorwise (the recipe whose weights FSDP2 all-gathers "
                           "in fp8)")
    if lay.fp8 is not None:
        from symcost.frontends.fp8 import check_recipe

        check_recipe(lay.fp8, lay.fp8_all_gather, lay.shard)
    object.__setattr__(lay, "fp8_all_gather", bool(lay.fp8_all_gather))
    object.__setattr__(lay, "compile", bool(lay.compile))
    object.__setattr__(lay, "ep", bool(lay.ep))
    object.__setattr__(lay, "offload_activations", bool(lay.offload_activations))
    if lay.ep and (lay.fp8 is not None or lay.cp or lay.compile):
        raise SymcostError("--ep with --cp/--fp8/--compile: expert parallelism is modelled alone, with --tp, under "
                           "FSDP2 (--dp N --shard fsdp|zero3|zero2) and in pipeline stages (--pp N) for now "
                           "(docs/parallel.md §14); give --ep N without them")
    if lay.ep and lay.tp and lay.sp:
        raise SymcostError("--ep with --tp and --sp: expert parallelism over tensor-parallel ranks is modelled "
                           "without sequence parallelism for now (--ep N --tp M [--dp D --shard fsdp|zero3|zero2] "
                           "[--pp P]; docs/parallel.md §14.8-14.9)")
    object.__setattr__(lay, "etp", bool(lay.etp))
    if lay.etp and not (lay.ep and lay.tp):
        raise SymcostError("--etp M (expert-tensor parallelism) splits the experts of --ep N over the ranks of "
                           "--tp M: give --ep N --tp M --etp M")
    if lay.etp and (lay.sp or lay.shard is not None):
        raise SymcostError("--etp with " + ("--sp" if lay.sp else "--dp") + ": expert-tensor parallelism is "
                           "modelled without sequence and data parallelism for now (--ep N --tp M --etp M "
                           "[--pp P]; docs/parallel.md §14.10)")
    if lay.experts_shard is not None and (not lay.ep_fsdp or lay.ep_replicate or lay.experts_shard not in (0, 1)):
        raise SymcostError("experts_shard (0 or 1) is the experts' FSDP2 placement under --ep with --dp "
                           "--shard fsdp|zero3|zero2")
    if lay.ep and lay.shard is not None:
        if lay.replicate is not None or lay.offload:
            raise SymcostError(f"--ep with --shard {lay.shard}"
                               + (" --dp-replicate" if lay.replicate is not None else "")
                               + (" --offload" if lay.offload else "")
                               + ": expert parallelism composes with FSDP2 over dp_shard × ep, as torchtitan "
                               "(--dp N --shard fsdp|zero3|zero2; docs/parallel.md §14.6), and with DDP and "
                               "Megatron's distributed optimizer (--shard ddp|zero1, §14.11); HSDP and CPU "
                               "offload with EP are not modelled yet")
        if lay.ep_replicate and (lay.pipeline is not None or lay.tp):
            raise SymcostError(f"--ep with {'--pp' if lay.pipeline is not None else '--tp'} and --shard "
                               f"{lay.shard}: expert parallelism under DDP / Megatron's distributed optimizer is "
                               "modelled without pipeline and tensor parallelism for now (--ep N --dp M --shard "
                               "ddp|zero1; docs/parallel.md §14.11); under FSDP2 (--shard fsdp|zero3|zero2) "
                               "with them (§14.7, §14.9)")
    if lay.compile:
        others = [flag for flag, on in (("--tp", lay.tp), ("--pp", lay.pipeline is not None),
                                        ("--cp", lay.cp),
                                        ("--fp8", lay.fp8 is not None), ("--offload", lay.offload),
                                        ("--offload-activations", lay.offload_activations)) if on]
        if others:  # (the pipeline's stage traces never reach frontends.compile's own check)
            raise SymcostError(f"--compile with {' '.join(others)} is not modelled yet: a compiled step is "
                               "modelled on one device and with --dp N --shard ddp|fsdp|zero1|zero2|zero3, "
                               "--ac full|selective (docs/memory.md)")

    object.__setattr__(lay, "cp", bool(lay.cp))
    if lay.cp:
        from symcost.frontends.context_parallel import check_rotate

        check_rotate(lay.cp_rotate)
        from symcost.frontends.parallel import SHARDS

        if lay.replicate is not None or (lay.shard is not None and SHARDS[lay.shard][0] != "fully_shard"):
            raise SymcostError("--cp with --dp-replicate or --shard ddp/zero1: context parallelism is "
                               "modelled alone or under FSDP2 (--dp N --shard fsdp|zero3|zero2: fully_shard over "
                               "dp_shard × cp, as torchtitan), with --tp M and in pipeline stages (--pp N) too, "
                               "for now (docs/parallel.md §15)")
