"""Options and helpers every ``symcost`` command shares: --set/--config parsing, the common
options, and tracing the model a command names.

Imports nothing heavy at module level (the CLI's --help must stay fast); torch comes in with the
trace.
"""
from __future__ import annotations

import re

import click

from symcost.errors import SymcostError
from symcost.frontends.layout import SYMBOL_FLAG
from symcost.frontends.spec import MESH_HINT, SYMBOL_MEANINGS

_MULTI = ("--set", "--config")
_PAIR = re.compile(r"^[A-Za-z_][\w.]*=")


def expand_multi(argv: list[str]) -> list[str]:
    """Let ``--set B=8 S=1024`` mean ``--set B=8 --set S=1024`` (same for --config).

    The token right after ``--set`` is always its value (so ``--set B`` reaches parse_sizes and
    gets its error); later tokens belong to it while they look like ``KEY=VALUE``.
    """
    out: list[str] = []
    current, first = None, False
    for i, tok in enumerate(argv):
        if tok in _MULTI:
            nxt, after = argv[i + 1: i + 2], argv[i + 2: i + 3]
            if nxt and "=" not in nxt[0] and not nxt[0].startswith("-") and after and "=" not in after[0] \
                    and (after[0].replace("_", "").isdigit() if tok == "--set" else not after[0].startswith("-")):
                what = "SYMBOL=INTEGER" if tok == "--set" else "KEY=VALUE"
                raise SymcostError(f"{tok} takes {what}: write {tok} {nxt[0]}={after[0]}, not {tok} {nxt[0]} {after[0]}")
            current, first = tok, True
            continue
        if current and (first or _PAIR.match(tok)):
            out += [current, tok]
            first = False
            continue
        current = None
        out.append(tok)
    if current and first:
        out.append(current)  # "--set" with nothing after: click says it needs a value
    return out


def parse_sizes(pairs: tuple[str, ...]) -> dict[str, int]:
    """``("B=8", "S=1024")`` -> ``{"B": 8, "S": 1024}``; values are positive integers.

    Raises:
        SymcostError: malformed pair, unknown symbol, non-integer or non-positive value, a
            symbol set twice to different values.
    """
    sizes: dict[str, int] = {}
    for pair in pairs:
        key, eq, val = pair.partition("=")
        key = key.strip()
        if not eq:
            raise SymcostError(f"--set takes SYMBOL=INTEGER, got {pair!r}")
        if key not in SYMBOL_MEANINGS and (not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", key) or key.upper() in MESH_HINT):
            # (a model's own sizes, C or IMG, are any other names: checked against the model's symbols)
            raise SymcostError(f"unknown symbol {key!r} in --set; accepted: {', '.join(SYMBOL_MEANINGS)} "
                               f"or the model's own sizes{MESH_HINT.get(key.upper(), '')}")
        raw = val.strip()
        val = raw.replace("_", "")
        if not re.fullmatch(r"[+-]?\d+", val):
            raise SymcostError(f"{key} must be a positive integer, got {raw!r}")
        n = int(val)
        if n <= 0:
            raise SymcostError(f"{key} must be a positive integer, got {n}")
        if key in sizes and sizes[key] != n:
            raise SymcostError(f"{key} is set twice in --set ({key}={sizes[key]}, {key}={n}); give each symbol once")
        sizes[key] = n
    return sizes


def parse_config(pairs: tuple[str, ...]) -> dict[str, str]:
    """``("rope_theta=10000",)`` -> ``{"rope_theta": "10000"}`` (values parsed by the hf loader)."""
    out = {}
    for pair in pairs:
        key, eq, val = pair.partition("=")
        if not eq or not key.strip():
            raise SymcostError(f"--config takes KEY=VALUE, got {pair!r}")
        out[key.strip()] = val.strip()
    return out


def _store_attention_flops(ctx, param, value):
    ctx.meta["symcost.attention_flops"] = value
    return value


def _no_cache(ctx, param, value):
    if value:
        ctx.meta["symcost.no_cache"] = True
    return value


def _keep_routing(ctx, param, value):
    if value is not None:
        ctx.meta["symcost.routing"] = value
    return value


def _keep_task(ctx, param, value):
    if value is not None:
        ctx.meta["symcost.task"] = value
    return value


def model_task() -> str | None:
    """The running command's ``--task`` (None: the model's default head,
    :func:`symcost.frontends.hf_tasks.task_of`)."""
    ctx = click.get_current_context(silent=True)
    return ctx.meta.get("symcost.task") if ctx is not None else None


def resolve_model(model, cfg, attention):
    """:func:`symcost.frontends.models.resolve` of ``model`` with the running command's ``--task``.

    Raises:
        SymcostError: as resolve (a task the family has no head for: one line naming its heads)."""
    from symcost.frontends.models import resolve

    return resolve(model, cfg, attention, task=model_task())


def common(f):
    # --attention-flops and --no-cache reach trace_model through the click context (no command
    # signature changes): every command that traces a model honours them
    f = click.option("--attention-flops", type=click.Choice(["full", "causal"]), default="full",
                     show_default=True, expose_value=False, callback=_store_attention_flops,
                     help="count attention matmuls over all S_q*S_k score pairs (full, as "
                          "FlopCounterMode) or over the S*(S+1)/2 of a causal mask (causal)")(f)
    f = click.option("--no-cache", is_flag=True, expose_value=False, callback=_no_cache,
                     help="trace afresh: neither read nor write the trace cache (see symcost.graph.cache)")(f)
    f = click.option("--debug", is_flag=True, help="show tracebacks")(f)
    f = click.option("--routing", default=None, expose_value=False, callback=_keep_routing, metavar="MODEL",
                     help="mixture-of-experts routing model: balanced (default), capacity=C, C > 0 (below 1: slots beyond C·N·R/E per expert dropped), or skew=X with --ep (the most loaded rank: X times the balanced slots)")(f)
    f = click.option("--precision", default="bf16-mixed", show_default=True,
                     help="bf16-mixed (autocast over fp32 weights), fp16-mixed, fp32, bf16-true, fp16-true, "
                          "bf16-true-fp32-state (12P), bf16-true-fp32-master; frameworks' own: megatron-bf16, "
                          "megatron-fp16, megatron-fp32, megatron-bf16-moments (--dp N --shard zero1: Megatron's "
                          "distributed optimizer), deepspeed-bf16, deepspeed-fp16 (--shard zero1/2/3: the ZeRO "
                          "stages); see docs/memory.md")(f)
    f = click.option("--attention", type=click.Choice(["eager", "sdpa"]), default=None,
                     help="hf: models only: attention implementation [default: sdpa, as transformers]")(f)
    f = click.option("--task", default=None, expose_value=False, callback=_keep_task, metavar="TASK",
                     help="hf: models and config.json only: the head trained where the family has several: "
                          "seq2seq, masked-lm, causal-lm, image-classification, ... (symcost.frontends.hf_tasks."
                          "TASKS; an unknown one is refused with the list) [default: the first the family has]")(f)
    f = click.option("--config", "config", multiple=True, metavar="KEY=VALUE",
                     help="hf: config override (repeatable: --config a=1 b=2)")(f)
    f = click.option("--set", "sets", multiple=True, metavar="SYM=INT",
                     help="symbol value, e.g. --set B=8 S=1024")(f)
    return f


def _keep_parallel(key):
    def store(ctx, param, value):
        if value is not None:
            ctx.meta[key] = value
        return value
    return store


def overlap_of(meta, an=None, precision: str | None = None, shard: str | None = None,
               fsdp_mp=None) -> str:
    """``--overlap`` as given (``meta["symcost.overlap"]``), else the data-parallel engine's own
    default: ``none`` under Megatron-LM's engine (a ``megatron-*`` policy with ``--shard ddp`` or
    ``zero1`` and no ``--fsdp-mp``: :func:`symcost.passes.megatron_buckets.is_megatron_engine` of
    ``an``, or of ``precision``/``shard``/``fsdp_mp`` where no analysis is at hand, a pipeline's),
    since Megatron's ``--overlap-grad-reduce`` and ``--overlap-param-gather`` are
    ``store_true`` with ``default=False`` (megatron/training/arguments.py at d98e8a6): its
    gradients are reduced after the backward; ``backward`` otherwise (PyTorch's DDP reduces its
    buckets under the backward, FSDP2 its reduce-scatters)."""
    given = meta.get("symcost.overlap")
    if given:
        return given
    if an is not None:
        from symcost.passes.megatron_buckets import is_megatron_engine

        return "none" if is_megatron_engine(an) else "backward"
    from symcost.frontends.megatron import is_megatron

    return "none" if is_megatron(precision) and shard in ("ddp", "zero1") and not fsdp_mp else "backward"


def _megatron_args(ctx, param, value):
    """``--megatron-args``: kept for the step model, and one warning line (stderr) naming the
    flags it does not read (:func:`symcost.passes.megatron_iteration.ignored_warning`)."""
    if value is not None:
        from symcost.passes.megatron_iteration import ignored_warning

        line = ignored_warning(value)
        if line:
            click.echo(f"symcost: {line}", err=True)
    return _keep_parallel("symcost.megatron_args")(ctx, param, value)


def device_alias(f):
    """``--device NAME`` as another spelling of ``--gpu NAME`` (``report``: the other commands
    name the catalogue device ``--device``); both at once must agree."""
    return click.option("--device", "gpu_device", default=None, expose_value=False, metavar="NAME",
                        callback=_keep_parallel("symcost.gpu_alias"), help="the same as --gpu")(f)


#: strategies of --shard (symcost.frontends.parallel.SHARDS; listed here so --help imports no torch)
SHARD_CHOICES = ("ddp", "fsdp", "zero1", "zero2", "zero3")
#: recipes of --fp8 (symcost.frontends.fp8.RECIPES, torchao's Float8LinearRecipeName)
FP8_CHOICES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def fp8_option(f):
    """``--fp8 RECIPE``: FP8 training, one more step of the layout (:func:`layout_request`;
    :mod:`symcost.frontends.fp8`); :func:`parallel_options` includes it."""
    return click.option("--fp8", type=click.Choice(FP8_CHOICES), default=None, expose_value=False,
                        callback=_keep_parallel("symcost.fp8"),
                        help="FP8 training as torchao's float8 recipe of that name runs it (needs torchao: "
                             "pip install 'symcost[fp8]'): the blocks' linears whose features are multiples of 16 "
                             "become Float8Linear (torchtitan's converter, before --tp/--ac/--dp), their matmuls "
                             "torch._scaled_mm at the device's fp8 peak")(f)


def compile_option(f):
    """``--compile``: every block under ``torch.compile`` (torchtitan's apply_compile), one more
    step of the layout (:func:`layout_request`; :mod:`symcost.frontends.compile`);
    :func:`parallel_options` includes it."""
    return click.option("--compile", "compile_blocks", is_flag=True, default=None, expose_value=False,
                        callback=_keep_parallel("symcost.compile"),
                        help="a compiled step: each block under torch.compile(fullgraph=True) as torchtitan compiles "
                             "it (after --tp/--ac, before --dp's engine): the tensors AOTAutograd's min-cut "
                             "partitioner saves, its recomputation in the backward, fused bytes for time "
                             "(docs/memory.md)")(f)


def parallel_options(f):
    """``--dp N`` and ``--shard``: one rank of data-parallel training (docs/parallel.md). They
    reach :func:`trace_model` through the click context."""
    f = click.option("--shard", type=click.Choice(SHARD_CHOICES), default=None, expose_value=False,
                     callback=_keep_parallel("symcost.shard"),
                     help="data-parallel strategy with --dp: ddp (default), fsdp = zero3 (FSDP2 "
                          "reshard_after_forward=True), zero2 (reshard_after_forward=False; DeepSpeed "
                          "ZeRO-2 model states), zero1 (DDP trace; ZeRO-1 model states, what Megatron-LM's "
                          "--use-distributed-optimizer shards)")(f)
    f = click.option("--overlap", type=click.Choice(["none", "backward", "full"]), default=None,
                     expose_value=False, callback=_keep_parallel("symcost.overlap"),
                     help="with --dp and --gpu: communication hidden under compute (docs/parallel.md) [default: "
                          "the engine's: backward (PyTorch's DDP and FSDP2); none under --precision megatron-* "
                          "with --shard ddp|zero1 (Megatron-LM's --overlap-grad-reduce is off by default)]")(f)
    f = click.option("--devices-per-node", type=click.IntRange(min=1), default=None, expose_value=False,
                     callback=_keep_parallel("symcost.devices_per_node"),
                     help="with --dp and --gpu: devices on the scale-up link [default: the catalogue's]")(f)
    f = click.option("--nodes", type=click.IntRange(min=1), default=None, expose_value=False,
                     callback=_keep_parallel("symcost.nodes"),
                     help="with --dp and --gpu: nodes the DP ranks span [default: as few as hold them]")(f)
    f = click.option("--megatron-args", default=None, expose_value=False, metavar="FLAGS",
                     callback=_megatron_args,
                     help="with --precision megatron-*, --dp and --gpu: the Megatron-LM run's flags that change its "
                          "per-iteration work (--clip-grad, --log-params-norm, --log-num-zeros-in-grad, "
                          "--log-interval, --no-check-for-nan-in-loss-and-grad, --no-gradient-accumulation-fusion, "
                          "--loss-scale; others ignored, named in a warning) "
                          "[default: Megatron-LM's defaults] (docs/performance-model.md)")(f)
    f = click.option("--gpu", default=None, expose_value=False, callback=_keep_parallel("symcost.gpu"),
                     metavar="NAME", help="with --dp: step time per rank on this catalogue device "
                                          "(roofline compute + exposed communication over its interconnect)")(f)
    f = click.option("--dp-replicate", type=click.IntRange(min=1), default=None, expose_value=False,
                     callback=_keep_parallel("symcost.dp_replicate"), metavar="R",
                     help="with --dp N --shard fsdp|zero3|zero2: HSDP, FSDP2 over the 2-D mesh (dp_replicate R, "
                          "dp_shard N/R): states sharded over N/R ranks, gradients all-reduced over R "
                          "(torchtitan's data_parallel_replicate_degree; R is pinned in the formulas)")(f)
    f = click.option("--offload", is_flag=True, default=None, expose_value=False,
                     callback=_keep_parallel("symcost.offload"),
                     help="with --dp N --shard fsdp|zero3: FSDP2's CPUOffloadPolicy (torchtitan's "
                          "training.enable_cpu_offload): parameters, gradients and optimizer state on the host; "
                          "the peak is the device's; host bytes and host<->device copies reported")(f)
    f = click.option("--offload-activations", is_flag=True, default=None, expose_value=False,
                     callback=_keep_parallel("symcost.offload_activations"),
                     help="every tensor autograd saves kept in pinned host memory between forward and backward "
                          "(torch.autograd.graph.save_on_cpu(pin_memory=True) around the forward), under any "
                          "layout: the peak is the device's; host bytes, copies and their time over the host "
                          "link (with --gpu) reported")(f)
    f = click.option("--fsdp-mp", default=None, expose_value=False, callback=_keep_parallel("symcost.fsdp_mp"),
                     metavar="PARAM[,REDUCE]",
                     help="with --dp: FSDP2's MixedPrecisionPolicy(param_dtype=PARAM, reduce_dtype=REDUCE) on every "
                          "unit, dtypes bf16, fp16, fp32 (REDUCE fp32 unless given): all-gathers move PARAM bytes, "
                          "gradient reductions REDUCE bytes; e.g. --precision fp32 --fsdp-mp bf16 as torchtitan")(f)
    f = click.option("--sp", is_flag=True, default=None, expose_value=False, callback=_keep_parallel("symcost.sp"),
                     help="with --tp: sequence parallelism (SequenceParallel norms, all-gather/reduce-scatter)")(f)
    f = click.option("--tp", type=click.IntRange(min=2), default=None, expose_value=False,
                     callback=_keep_parallel("symcost.tp"), metavar="N",
                     help="tensor-parallel size: trace one rank of N with the Megatron plan (symbol TP; "
                          "with --dp: one rank of the 2-D mesh)")(f)
    f = click.option("--ac", type=click.Choice(["none", "full", "selective"]), default=None, expose_value=False,
                     callback=_keep_parallel("symcost.ac"),
                     help="activation checkpointing of every block, under any layout, as torchtitan applies it "
                          "(after --tp, before --dp's engine): full = each block recomputed; selective = "
                          "torchtitan's op-level policy (matmul outputs kept but every second, attention and "
                          "reduce-scatter outputs kept)")(f)
    f = click.option("--fp8-all-gather", is_flag=True, default=None, expose_value=False,
                     callback=_keep_parallel("symcost.fp8_all_gather"),
                     help="with --fp8 tensorwise and --dp N --shard fsdp|zero3|zero2: FSDP2 all-gathers the "
                          "weights in fp8 (torchao's enable_fsdp_float8_all_gather; torchtitan's default: off)")(f)
    f = fp8_option(f)
    f = compile_option(f)
    f = click.option("--ep", type=click.IntRange(min=2), default=None, expose_value=False,
                     callback=_keep_parallel("symcost.ep"), metavar="N",
                     help="expert-parallel size of a mixture-of-experts model: trace one rank of N, its E/N experts, "
                          "tokens dispatched and combined by all-to-all (symbol EP; docs/parallel.md §14)")(f)
    f = click.option("--etp", type=click.IntRange(min=1), default=None, expose_value=False,
                     callback=_keep_parallel("symcost.etp"), metavar="M",
                     help="with --ep N --tp M: expert-tensor-parallel degree, 1 (default: each EP rank's experts "
                          "whole, the EP group over the TP ranks) or M (torchtitan's etp = tp, ExpertTensorParallel: "
                          "N·M ranks, each expert's hidden width split over the M TP ranks, every TP rank "
                          "dispatching all its tokens; docs/parallel.md §14.10)")(f)
    f = click.option("--cp-rotate", type=click.Choice(["allgather", "alltoall"]), default=None, expose_value=False,
                     callback=_keep_parallel("symcost.cp_rotate"),
                     help="with --cp: how keys and values go round the ring in the forward (PyTorch's "
                          "set_rotate_method) [default: allgather, PyTorch's and torchtitan's]")(f)
    f = click.option("--cp", type=click.IntRange(min=2), default=None, expose_value=False,
                     callback=_keep_parallel("symcost.cp"), metavar="N",
                     help="context-parallel size: trace one rank of N, its S/N tokens, attention as PyTorch's "
                          "ring attention (symbol CP; SDPA attention only; docs/parallel.md §15)")(f)
    f = click.option("--dp", type=click.IntRange(min=1), default=None, expose_value=False,
                     callback=_keep_parallel("symcost.dp"), metavar="N",
                     help="data-parallel size: trace one rank of N (the formulas gain the symbol DP)")(f)
    return f


def layout_request(ctx, pipeline: bool = False) -> tuple:
    """The run's layout from the command line: ``(Layout, {"DP": n, "TP": n, "PP": n})``
    (:class:`symcost.frontends.layout.Layout` from ``--dp/--shard/--fsdp-mp``, ``--tp/--sp`` and,
    where ``pipeline``, ``--pp/--schedule/--microbatches/--virtual-stages``; the sizes of the
    dimensions given). All checks are made here, in one line each, before any trace.

    Raises:
        SymcostError: an option of a dimension without its size (``--shard`` without ``--dp``,
            ``--sp`` without ``--tp``, ``--schedule`` without ``--pp``, ...), dimensions a
            command does not model yet, two devices named, an unknown device.
    """
    from symcost.frontends.layout import Layout, Pipeline

    meta = ctx.find_root().meta if ctx is not None else {}
    alias = meta.get("symcost.gpu_alias")  # report's --device, another spelling of --gpu
    if alias is not None:
        if meta.get("symcost.gpu") not in (None, alias):
            raise SymcostError(f"--device {alias} and --gpu {meta['symcost.gpu']} name two devices: give one")
        meta["symcost.gpu"] = alias
    dp, shard, tp, pp = (meta.get(f"symcost.{k}") for k in ("dp", "shard", "tp", "pp"))
    command = ctx.command.name if ctx is not None and ctx.command is not None else None
    if command not in (None, "report", "max-batch") and not (command == "time" and meta.get("symcost.gpu")):
        # (serve --tp: one rank of the inference steps; serve has no --sp; time --tp --gpu prices the step)
        for key, flag in ((("symcost.tp", "--tp"),) if command != "serve" else ()) + (("symcost.sp", "--sp"),):
            if meta.get(key) and command == "time":
                raise SymcostError(f"time {flag} needs --gpu NAME: the step of a tensor-parallel rank is priced per "
                                   "process group over the device's links (docs/performance-model.md)")
            if meta.get(key):
                raise SymcostError(f"{flag} is answered by `symcost report` and `max-batch` only for now: {command} "
                                   "with tensor parallelism (its step time, run time) is not modelled yet "
                                   "(docs/parallel.md §11)")
    if meta.get("symcost.gpu"):  # an unknown device: say so before the trace
        from symcost.hardware.devices import get_device

        get_device(meta["symcost.gpu"])
    if shard is not None and dp is None:
        raise SymcostError(f"--shard {shard} needs --dp N (the data-parallel size)")
    if pp is None:
        for key, flag in (("symcost.pp_schedule", "--schedule"), ("symcost.pp_microbatches", "--microbatches"),
                          ("symcost.pp_virtual", "--virtual-stages"), ("symcost.pp_split", "--pp-split")):
            if meta.get(key) is not None:
                raise SymcostError(f"{flag} needs --pp N (the pipeline-parallel size)")
    if dp is None and not (pp is not None and pipeline):  # (the pipeline prices its own step)
        # (report and time price a --tp, --ep or --cp rank's step per process group without --dp)
        ranked = any(meta.get(f"symcost.{k}") is not None for k in ("tp", "ep", "cp")) and command in (
            None, "report", "time")
        for key, flag in (("symcost.gpu", "--gpu" if alias is None else "--device"), ("symcost.nodes", "--nodes"),
                          ("symcost.devices_per_node", "--devices-per-node"), ("symcost.fsdp_mp", "--fsdp-mp")):
            if meta.get(key) is not None and not (ranked and key != "symcost.fsdp_mp"):
                raise SymcostError(f"{flag} needs --dp N (the data-parallel size)" + (
                    "" if key == "symcost.fsdp_mp" else ", or --tp, --ep or --cp N on report and time"))
    replicate = meta.get("symcost.dp_replicate")
    if replicate is not None:
        if dp is None:
            raise SymcostError("--dp-replicate R needs --dp N (the whole data-parallel size: R × shard)")
        if shard not in ("fsdp", "zero3", "zero2"):
            raise SymcostError(f"--dp-replicate {replicate} (HSDP) replicates FSDP2's shards: give --shard fsdp, "
                               f"zero3 or zero2 (not {shard or 'ddp, the default'})")
        if dp % replicate:
            raise SymcostError(f"--dp {dp} is no multiple of --dp-replicate {replicate} (HSDP: DP = replicate × "
                               "shard)")
    mp = meta.get("symcost.fsdp_mp")
    if mp is not None:
        from symcost.frontends.parallel import parse_fsdp_mp

        mp = parse_fsdp_mp(mp)  # bad text: one line before tracing
    pipe = None
    if pp is not None and pipeline:
        schedule = meta.get("symcost.pp_schedule") or "1f1b"
        from symcost.frontends.pipeline import parse_split

        pipe = Pipeline(schedule, meta.get("symcost.pp_microbatches") or pp,
                        meta.get("symcost.pp_virtual") or (2 if schedule == "interleaved-1f1b" else 1),
                        parse_split(meta.get("symcost.pp_split")))
    ac = meta.get("symcost.ac")
    etp = meta.get("symcost.etp")
    if etp is not None and (meta.get("symcost.ep") is None or tp is None):
        raise SymcostError(f"--etp {etp} is the expert-tensor-parallel degree of --ep N --tp M: give both")
    if etp is not None and etp not in (1, tp):
        raise SymcostError(f"--etp {etp} with --tp {tp}: the expert-tensor-parallel degree is 1 or the "
                           f"tensor-parallel one, as torchtitan (accepted: --etp 1 or --etp {tp})")
    layout = Layout(shard=(shard or "ddp") if dp is not None else None, fsdp_mp=mp, tp=tp is not None,
                    sp=bool(meta.get("symcost.sp")), pipeline=pipe, ac=None if ac in (None, "none") else ac,
                    replicate=replicate, offload=bool(meta.get("symcost.offload")), fp8=meta.get("symcost.fp8"),
                    fp8_all_gather=bool(meta.get("symcost.fp8_all_gather")),
                    compile=bool(meta.get("symcost.compile")), ep=meta.get("symcost.ep") is not None,
                    offload_activations=bool(meta.get("symcost.offload_activations")),
                    etp=etp is not None and etp > 1)
    sizes = {k: v for k, v in (("DP", dp), ("TP", tp), ("PP", pp if pipe else None), ("EP", meta.get("symcost.ep")))
             if v is not None}
    if meta.get("symcost.cp_rotate") is not None and meta.get("symcost.cp") is None:
        raise SymcostError("--cp-rotate needs --cp N (the context-parallel size)")
    if meta.get("symcost.cp") is not None and pp is not None and (meta.get("symcost.gpu") or alias):
        raise SymcostError("--gpu with --cp and --pp: the pipeline's priced step does not add the ring's exposed "
                           "exchange nor place the CP ranks in the mesh's links yet; report --cp N --pp P answers "
                           "each rank's FLOPs, collective bytes per group, p2p bytes, bubble and peak "
                           "(docs/parallel.md §15)")
    if meta.get("symcost.cp") is not None:  # (context parallelism: symcost.frontends.context_parallel)
        import dataclasses

        layout = dataclasses.replace(layout, cp=True, cp_rotate=meta.get("symcost.cp_rotate") or "allgather")
        sizes["CP"] = meta["symcost.cp"]
    return layout, sizes


def parallel_request(ctx) -> tuple[int | None, str | None]:
    """``(dp, shard)`` of :func:`layout_request` (``(None, None)`` without ``--dp``).

    Raises:
        SymcostError: as :func:`layout_request`.
    """
    layout, sizes = layout_request(ctx)
    return sizes.get("DP"), layout.shard


def report_cap(ctx, memory: str) -> tuple[int, str]:
    """``(bytes, where from)``: the memory cap a ``report`` under ``--dp``/``--tp``/``--pp`` checks
    each rank's peak against: ``--memory`` where given, else the memory of the ``--gpu``/``--device``
    where one is named and the catalogue has it, else ``--memory``'s default (the one-device
    report's cap)."""
    from symcost.units import parse_memory

    root = ctx.find_root()
    if ctx.get_parameter_source("memory") not in (click.core.ParameterSource.DEFAULT, None):
        return parse_memory(memory), "--memory"
    gpu = root.meta.get("symcost.gpu") or root.meta.get("symcost.gpu_alias")
    if gpu:
        from symcost.hardware.devices import get_device

        dev = get_device(gpu)
        if dev.memory:
            return int(dev.memory), f"{dev.key}'s memory; --memory sets another"
    return parse_memory(memory), "--memory's default"


def layout_words(ctx, layout, values=None) -> str:
    """``Layout.describe`` for a report's layout line, saying where ``--shard`` was left at its
    default (``dp_replicate 8 (ddp, --shard's default)``)."""
    words = layout.describe(values)
    if layout.shard == "ddp" and ctx.find_root().meta.get("symcost.shard") is None:
        words = words.replace("(ddp)", "(ddp, --shard's default)", 1)
    return words


def optimizer_option(f):
    """``--optimizer`` and ``--torch-device`` (the memory pass's optimizer step)."""
    f = click.option("--torch-device", "device", default="cuda", show_default=True,
                        help="cuda, cpu, xpu, mtia: the device type the step runs on (decides the optimizer "
                             "implementation torch.optim runs by default, hence the memory peak)")(f)
    return click.option("--optimizer", default="adamw", show_default=True,
                        help="adamw, adam, sgd (momentum), sgd-nomomentum, adafactor")(f)


def memory_options(f):
    """``--memory`` (the cap of the largest-batch line) and ``--optimizer``."""
    f = optimizer_option(f)
    return click.option("--memory", "memory", default="80GiB", show_default=True,
                        help="memory cap per device for the largest-batch line: a number with KiB/MiB/GiB/TiB "
                             "(binary), KB/MB/GB/TB (decimal) or B; a bare number is bytes and must be at "
                             "least 1 MiB (80 alone is refused: write 80GiB)")(f)


def early_checks(model, sets, config, attention, precision) -> None:
    """The checks that need neither sympy nor torch (a command runs them first, so argument
    errors answer at once): the model name (:func:`symcost.frontends.spec.check_model_name`: built-in
    names, the ``hf:`` prefix, existing files), sizes, precision, config syntax, --attention for
    a model that is not ``hf:``, --task likewise.

    Raises:
        SymcostError: the first problem found.
    """
    from symcost.frontends.precision import check_precision
    from symcost.frontends.spec import check_model_name

    check_model_name(model)
    parse_sizes(sets)
    check_precision(precision)
    parse_config(config)
    if attention is not None and not str(model).startswith("hf:") and not str(model).endswith(".json"):
        raise SymcostError(
            f"--attention applies to hf: models only; {model} runs its own attention code (leave --attention out)")
    task = model_task()
    if task is not None and not str(model).startswith("hf:") and not str(model).endswith(".json"):
        raise SymcostError(f"--task applies to hf: models and config.json files only; {model} trains with its own "
                           "loss (leave --task out)")


def trace_model(model, sets, config, attention, precision="bf16-mixed", quiet=False, needs_model=False,
                step=None, kv_cache="dynamic", extra_sizes=None):
    """Trace ``model`` for a command: check every option first (one line, before seconds of
    tracing), then read the analysis from the trace cache (:mod:`symcost.graph.cache`; no torch
    imported) when an entry matches the request, else trace, showing progress on stderr when it
    is a terminal (not when ``quiet``, e.g. with ``--json``). ``--no-cache`` traces afresh, and so
    does ``needs_model=True``: a pass that builds or re-traces the model needs the live trace,
    which a cached analysis (data only) does not carry. (Activation checkpointing does not: its
    every-layer trace has its own cache entry, :func:`every_layer_trace`.)

    Returns:
        ``(Analysis, sizes)`` with ``sizes`` the ``--set`` values.

    Raises:
        SymcostError: bad sizes, precision, config or attention; ``--set`` and ``--config``
            giving one symbol two values; a model that cannot be traced.
    """
    early_checks(model, sets, config, attention, precision)  # before importing torch
    ctx = click.get_current_context(silent=True)
    quiet = quiet or bool(ctx and ctx.params.get("as_json"))  # --json: no progress line either
    sizes = {**parse_sizes(sets), **dict(extra_sizes or {})}
    if step == "decode":
        sizes.setdefault("S", 1)  # one new token per sequence (as symcost.trace reads a decode request)
    cfg = parse_config(config)
    from symcost.graph.cache import cached_trace

    use_cache = not needs_model and not (ctx is not None and ctx.find_root().meta.get("symcost.no_cache"))
    routing = ctx.meta.get("symcost.routing") if ctx is not None else None
    layout, mesh_sizes = layout_request(ctx)
    options = {"routing": routing} if routing is not None else {}
    if model_task() is not None:  # (another head is another model: its own cache entries)
        options["task"] = model_task()
    for k, v in mesh_sizes.items():
        if k in sizes and sizes[k] != v:
            raise SymcostError(f"{SYMBOL_FLAG[k]} {v} and --set {k}={sizes[k]} disagree; give one")
    if layout:
        if step is not None and (layout.shard is not None or layout.ac is not None or layout.sp or layout.fp8):
            # (an inference step takes tensor parallelism alone: serve --tp)
            raise SymcostError(f"--dp/--sp/--ac/--fp8 trace a training step, not an inference step ({step})")
        # one rank of the layout's mesh: kept in the trace cache under the layout's options (a DDP
        # and an FSDP trace, a TP and a TP + SP trace never share an entry); every mesh size is
        # served by one entry, within the residue classes of the split sizes and their per-rank
        # regime (graph/cache.py)
        sizes = {**sizes, **mesh_sizes}
        if layout.ep_fsdp and not layout.ep_replicate and layout.experts_shard is None:  # (the experts' FSDP2 placement: part of the key)
            layout = _experts_shard(layout, model, cfg, attention, sizes)
        options.update(layout.cache_options())
    if step is not None:
        options.update(step=step, kv_cache=kv_cache)
    torch_device = torch_device_of(ctx)
    if torch_device != "cuda":  # (its dropout and attention kernels: symcost.tracing.device_kernels)
        options["torch_device"] = torch_device
    from symcost.commands._loss import loss_of

    loss = loss_of(ctx)
    if loss is not None:  # (--loss: symcost.frontends.megatron.for_run)
        options["loss"] = loss
    an = cached_trace(model, cfg, attention, precision, sizes,
                      lambda: _trace_fresh(model, cfg, attention, precision, sizes, quiet, routing, step, kv_cache,
                                           layout=layout, torch_device=torch_device, loss=loss),
                      use_cache, options=options or None)
    _check_set_vs_config(model, an.spec, sizes, cfg, attention)  # (again for a cached analysis)
    an = an.with_attention_flops(ctx.meta.get("symcost.attention_flops", "full") if ctx else "full")
    an.bind(**sizes)  # validate before rendering
    return an, sizes


def _experts_shard(layout, model, cfg, attention, sizes):
    """``layout`` (``--ep`` under FSDP2) with the experts' FSDP2 placement of the request
    (:func:`symcost.frontends.expert_parallel.experts_shard_dim`: torchtitan's Shard(1) where
    DP·EP > E), E from ``--set`` or the model's own config."""
    import dataclasses

    from symcost.frontends.expert_parallel import experts_shard_dim

    e = sizes.get("E")
    if e is None:
        spec = resolve_model(model, cfg, attention)
        e = spec.values({k: v for k, v in sizes.items() if k in spec.symbols}, inputs=False).get("E")
    if e is None:
        return layout  # (no routed experts: the trace says so in one line)
    return dataclasses.replace(layout, experts_shard=experts_shard_dim({**sizes, "E": e}))


def every_layer_trace(an, model, config, attention, precision, sizes, quiet=False):
    """Give the checkpointing pass ``an``'s every-layer trace (the step with every block
    checkpointed, :func:`symcost.passes.checkpoint.every_layer`): read from the trace cache when
    an entry matches (the model's key with the option ``checkpoint=every-layer``), else traced
    (from ``an``'s live spec, or the model resolved again when ``an`` came from the cache) and
    kept there. ``--no-cache`` traces afresh.

    Raises:
        SymcostError: the model cannot be traced.
    """
    from symcost.graph.cache import cached_trace
    from symcost.passes import checkpoint as ck

    ctx = click.get_current_context(silent=True)
    quiet = quiet or bool(ctx and ctx.params.get("as_json"))
    use_cache = not (ctx is not None and ctx.find_root().meta.get("symcost.no_cache"))
    routing = ctx.meta.get("symcost.routing") if ctx is not None else None
    cfg = parse_config(config)

    def live_spec():
        spec = resolve_model(model, cfg, attention)
        if routing is not None:
            from symcost.frontends.moe import with_routing

            spec = with_routing(spec, routing)
        return spec

    def fresh():
        with progress(f"tracing {model} with every block checkpointed", quiet):
            # read from the cache, ``an`` cannot build the model: it is resolved again
            spec = an.spec if an.recordings else live_spec()
            from symcost.graph.build import trace

            return trace(ck.uniform_spec(spec, an.layer_container or "", 1), sizes=sizes, precision=precision)

    options = {"checkpoint": "every-layer"}
    if model_task() is not None:
        options["task"] = model_task()
    if routing is not None:
        options["routing"] = routing
    sub = cached_trace(model, cfg, attention, precision, sizes, fresh, use_cache, options=options)
    ck.use_every_layer(an, sub)
    if not an.recordings:  # another regime's every-layer trace (a solver at B = 1) builds the model again
        ck.use_model(an, live_spec)
    return sub


def torch_device_of(ctx) -> str:
    """The device type a command's step runs on: its ``--torch-device`` (``cuda`` by default),
    ``cuda`` for a command without the option."""
    dev = ctx.params.get("device") if ctx is not None else None
    return dev if dev in ("cuda", "cpu", "xpu", "mtia") else "cuda"


def _trace_fresh(model, cfg, attention, precision, sizes, quiet, routing=None, step=None, kv_cache="dynamic",
                 layout=None, torch_device="cuda", loss=None):
    """Resolve and trace ``model`` (the cache's miss path), with the progress line; ``layout``:
    one rank of the parallel layout (:meth:`symcost.frontends.layout.Layout.spec`)."""
    with progress(f"resolving {model}", quiet) as status:
        spec = resolve_model(model, cfg, attention)
        if step is not None:
            spec = spec.for_step(step, kv_cache)
        if layout:
            spec = layout.spec(spec)
        from symcost.frontends.megatron import for_run

        spec = for_run(spec, precision, torch_device, loss)  # (--loss, --torch-device, megatron-*)
        if routing is not None:  # MoE layers traced under this routing model (symcost.frontends.moe)
            from symcost.frontends.moe import with_routing

            spec = with_routing(spec, routing)
        # reject sizes the model cannot take before the (seconds-long) trace
        unknown = [k for k in sizes if k not in spec.all_symbols and k not in spec.tied]
        if unknown:
            raise SymcostError(f"unknown symbol {unknown[0]!r} for {spec.name}; accepted: {', '.join(spec.all_symbols)}"
                          f"{MESH_HINT.get(unknown[0], '')}")
        _check_set_vs_config(model, spec, sizes, cfg, attention)
        tied = [k for k in sizes if k in spec.tied and sizes[k] != sizes.get(spec.tied[k], spec.defaults.get(spec.tied[k]))]
        if tied:
            raise SymcostError(f"{tied[0]} is tied to {spec.tied[tied[0]]} in {spec.name}; it cannot be set on its own")
        values = spec.values(sizes)
        msg = spec.check(values)  # the constraints PyTorch imposes (K divides H, ...): before tracing
        if msg:
            raise SymcostError(f"{spec.name}: {msg}")
        status(f"tracing {spec.name} (a {spec.step if spec.step != 'train' else 'training'} step at several "
               "probe sizes)")
        from symcost.graph.build import trace

        try:
            return trace(spec, sizes=sizes, precision=precision, torch_device=torch_device)  # the regime of these sizes
        except SymcostError as e:
            raise _with_probe_hint(e, spec) from e


#: small sizes like the tracer's probes, to say why none could be found
_SMALL = {"B": 2, "S": 8, "H": 4, "D": 8, "L": 2, "V": 64, "F": 32, "K": 2, "M": 32, "E": 4, "R": 2}


def _with_probe_hint(e: SymcostError, spec) -> SymcostError:
    """When the tracer found no probe sizes, say which of the model's own constraints small
    sizes break (e.g. a config value that forces a large D), with the check's hint."""
    if not str(e).startswith("could not find probe sizes"):
        return e
    small = {s: _SMALL.get(s, 4) for s in spec.all_symbols}
    small.update({a: small.get(b) for a, b in spec.tied.items()})
    why = spec.check(small)
    return SymcostError(f"{e}: the tracer probes small sizes (e.g. {', '.join(f'{k}={v}' for k, v in small.items())}), "
                        f"where {why}" if why else str(e))


#: the ``transformers`` config keys that set each symbol of an ``hf:`` model (symcost.frontends.hf binds
#: them the same way); a config's own aliases (gpt2's ``n_layer``) come from its attribute_map
_CONFIG_KEYS = {
    "H": ("num_attention_heads",), "D": ("head_dim",), "L": ("num_hidden_layers",), "V": ("vocab_size",),
    "F": ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size"), "K": ("num_key_value_heads",),
    "M": ("hidden_size",),
}


def _check_set_vs_config(model, spec, sizes, cfg, attention) -> None:
    """``--set L=4`` with ``--config num_hidden_layers=8`` names one quantity twice: an error
    when the two values differ (so that neither is silently ignored). Where d_model = H·D,
    ``--config hidden_size`` must equal H·D of the ``--set`` values.

    Raises:
        SymcostError: the first such pair.
    """
    if not cfg or not sizes or not str(model).startswith("hf:"):
        return
    amap = {}
    try:
        from transformers import CONFIG_MAPPING

        amap = dict(getattr(CONFIG_MAPPING[spec.extra.get("model_type")], "attribute_map", {}) or {})
    except Exception:  # noqa: BLE001 - no alias table: the standard names still work
        pass

    def given(key):
        for k in (key, amap.get(key)):
            if k and k in cfg:
                try:
                    return k, int(str(cfg[k]).replace("_", ""))
                except ValueError:
                    return None
        return None

    values = {**spec.defaults, **sizes}
    values.update({a: values.get(b) for a, b in spec.tied.items()})
    for sym, keys in _CONFIG_KEYS.items():
        for key in keys:
            got = given(key)
            if got is None:
                continue
            ckey, cval = got
            if sym == "M" and "M" not in spec.all_symbols:  # d_model = H·D here
                if ("H" in sizes or "D" in sizes) and values.get("H") and values.get("D") \
                        and values["H"] * values["D"] != cval:
                    raise SymcostError(
                        f"--config {ckey}={cval} conflicts with --set H·D = {values['H']}·{values['D']} = "
                        f"{values['H'] * values['D']} (d_model = H·D for {spec.name}); give the width once")
            elif sym in sizes and sizes[sym] != cval:
                raise SymcostError(
                    f"--set {sym}={sizes[sym]} conflicts with --config {ckey}={cval} (both set {sym}); "
                    f"give {sym} once")


class progress:
    """A rich status line on stderr while tracing, when stderr is a terminal and not ``quiet``
    (silent otherwise). ``with progress("text") as status: status("next step")``."""

    def __init__(self, text: str, quiet: bool = False):
        import sys

        self.text, self._status = text, None
        self.live = not quiet and sys.stderr.isatty()

    def __enter__(self):
        if self.live:
            from rich.console import Console

            self._status = Console(stderr=True).status(self.text)
            self._status.__enter__()
        return self.update

    def update(self, text: str) -> None:
        if self._status is not None:
            self._status.update(text)

    def __exit__(self, *exc):
        if self._status is not None:
            self._status.__exit__(*exc)
        return False
