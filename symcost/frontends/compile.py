"""A compiled step (``--compile``): every block under ``torch.compile`` as torchtitan compiles it,
recorded as the compiled code runs it (docs/memory.md, "A compiled step").

torchtitan's ``apply_compile`` (torchtitan/models/llama3/infra/parallelize.py) compiles each
transformer block on its own, ``torch.compile(block, fullgraph=True)``, after tensor parallelism
and activation checkpointing and before FSDP2, whose hooks stay outside the compiled code. Under
``torch.compile`` a block's forward and backward are no longer the eager ops: Dynamo captures the
block's forward as one FX graph, AOTAutograd traces the joint forward-backward graph with
inductor's decompositions (``torch._inductor.compile_fx.select_decomp_table``), runs inductor's
joint-graph passes and splits it with the min-cut rematerialisation partitioner
(``torch._functorch.partitioners.min_cut_rematerialization_partition``, Chen et al.'s "min-cut"
formulation in AOTAutograd, https://dev-discuss.pytorch.org/t/min-cut-optimal-recomputation-i-e-
activation-checkpointing-with-aotautograd/467): the forward graph's extra outputs are the tensors
saved for the backward (``CompiledFunction`` keeps them with ``ctx.save_for_backward``, so
``saved_tensors_hooks`` see them), and cheap element-wise ops whose inputs are saved instead are
recomputed in the backward graph. Inductor then fuses each graph's element-wise chains into
kernels; what is saved is decided before that, by the partition.

:func:`compile_blocks` does exactly that, with one change: the partitioned forward and backward
graphs are run op by op (their aten ops, as ``torch.compile(backend="aot_eager_decomp_partition")``
runs them) instead of being lowered to inductor's kernels, inside the dispatch modes that were
active around the block (the recorder), so the recording holds the compiled step's ops (the
decomposed forward, the backward with its recomputation) and the tensors it saves. The partition
is inductor's own: the partitioner function inductor passes to AOTAutograd
(``torch._inductor.compile_fx.partition_fn``: joint-graph passes, then the min-cut partition with
``compiler="inductor"``). The bytes the fused kernels move are :mod:`symcost.graph.fusion`'s.

Torch is imported only inside the functions that need it.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import threading

#: the dispatch modes taken off the stack around a compiled call, innermost last (per thread)
_SUSPENDED = threading.local()


def _suspended() -> list:
    if not hasattr(_SUSPENDED, "modes"):
        _SUSPENDED.modes = []
    return _SUSPENDED.modes


@contextlib.contextmanager
def _user_modes_suspended():
    """Dynamo refuses to compile under a user ``TorchDispatchMode`` (the recorder: "non-infra torch
    dispatch mode present"): take those modes off the stack around the compiled call and keep
    them, so that the compiled graphs can run inside them again (:func:`_graph_runner`).
    Infrastructure modes (``FakeTensorMode`` of a fake recording) stay."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

    stack = _get_current_dispatch_mode_stack()
    popped = []
    while stack and not stack[-1].is_infra_mode():
        popped.append(_pop_mode())
        stack = _get_current_dispatch_mode_stack()
    _suspended().append(list(reversed(popped)))
    kept = []  # the forward graph's outputs, alive until the compiled call returns (_graph_runner)
    _kept().append(kept)
    try:
        yield popped
    finally:
        _suspended().pop()
        _kept().pop()
        for m in reversed(popped):
            _push_mode(m)
        del kept


def _kept() -> list:
    if not hasattr(_SUSPENDED, "kept"):
        _SUSPENDED.kept = []
    return _SUSPENDED.kept


def hold(modes, tensors) -> None:
    """Tell each suspended mode that follows storages by the tensor objects it saw (symcost's
    recorder: ``hold``) that ``tensors``, made outside it, reference their storages: AOTAutograd's
    runtime hands the caller (and ``ctx.save_for_backward``) other tensor objects than the ones
    the forward graph made inside the mode, and those die when the compiled call returns."""
    import torch
    from torch.utils._pytree import tree_flatten

    for m in modes:
        if hasattr(m, "hold"):
            for t in tree_flatten(tensors)[0]:
                if isinstance(t, torch.Tensor):
                    m.hold(t)


#: reductions inductor fuses with the element-wise ops that feed them (a pointwise producer read
#: only by fusible consumers is computed inside their kernel: no buffer of its own)
_REDUCTIONS = ("sum", "mean", "amax", "amin", "max", "min", "prod", "var", "var_mean", "any", "all", "argmax", "argmin")


def _in_registers(gm) -> set:
    """The nodes of a partitioned graph ``gm`` whose outputs a fused kernel keeps in registers:
    element-wise ops (``torch.Tag.pointwise``, ``full``, and inductor's random prims, lowered as
    ``Pointwise`` in torch/_inductor/lowering.py) that are no output of the graph and
    whose every use (through views, which move nothing) is another element-wise op or a reduction.
    Inductor inlines such a producer into the kernels of its consumers (its ``Pointwise`` IR nodes
    are realised only where a consumer needs a buffer: a matmul, an extern kernel, a graph output);
    the rule leaves out inductor's limits on inlining (``realize_reads_threshold`` and
    ``realize_opcount_threshold`` in torch/_inductor/config.py), so it errs towards fewer buffers.
    """
    import torch

    def kind(n):
        t = n.target
        if n.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
            return None
        if t.is_view:
            return "view"
        if torch.Tag.pointwise in t.tags or t.overloadpacket.__name__ in ("full", "scalar_tensor") or (
                t.namespace == "prims" and t.overloadpacket.__name__ in ("inductor_random", "inductor_lookup_seed")):
            return "pointwise"
        if t.overloadpacket.__name__ in _REDUCTIONS and t.namespace == "aten":
            return "reduction"
        return None

    outputs = set()
    for n in gm.graph.nodes:
        if n.op == "output":
            stack = list(n.args)
            while stack:
                a = stack.pop()
                if isinstance(a, torch.fx.Node):
                    outputs.add(a)
                elif isinstance(a, (list, tuple)):
                    stack.extend(a)

    def fusible_uses(n) -> bool:
        for u in n.users:
            k = kind(u)
            if u in outputs or k is None:
                return False
            if k == "view" and not fusible_uses(u):
                return False
        return True

    return {n for n in gm.graph.nodes if kind(n) == "pointwise" and n not in outputs and fusible_uses(n)}


def _graph_runner(gm, example_inputs):
    """An AOTAutograd compiler (``fw_compiler``/``bw_compiler``) that runs the partitioned graph
    ``gm`` op by op (``torch.fx.Interpreter.boxed_run``: the boxed calling convention of
    ``torch._dynamo.backends.debugging.boxed_nop``, each value freed at its last use), inside the
    user dispatch modes :func:`_user_modes_suspended` took off around the compiled call (the
    forward graph; the backward graph, called by the autograd engine, runs where the modes are
    active already). The outputs a fused kernel keeps in registers (:func:`_in_registers`) are
    dropped from the memory schedule of a mode that has ``drop`` (symcost's recorder)."""
    import torch
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    recomputed = _RECOMPUTED.get(_names(gm), set())
    in_registers = {n for n in _in_registers(gm) if n.name not in recomputed}  # (read again by the backward: realized)

    class Runner(torch.fx.Interpreter):
        """The graph op by op; the storage of an output a fused kernel keeps in registers
        (:func:`_in_registers`) is dropped from the schedule of each mode that follows one
        (symcost's recorder: ``drop``)."""

        def __init__(self, modes):
            super().__init__(gm)
            self.modes = [m for m in modes if hasattr(m, "drop")]

        def call_function(self, target, args, kwargs):
            # AOTAutograd's functionalised RNG around a checkpointed region's random ops (dropout
            # under --ac): the CPU kernels of torch/_prims/rng_prims.py, the generator's state as a
            # storage the recorder sees (it is made by torch.get_rng_state(), outside any op)
            from torch._prims import rng_prims

            if target is rng_prims.run_and_save_rng_state:
                from symcost.frontends.checkpointing import rng_state_bytes

                state = torch.empty(rng_state_bytes(), dtype=torch.uint8)
                return state, args[0](*args[1:], **kwargs)
            if target is rng_prims.run_with_rng_state:
                from symcost.frontends.checkpointing import rng_state_bytes

                current = torch.empty(rng_state_bytes(), dtype=torch.uint8)  # noqa: F841 - held while it runs
                return args[1](*args[2:], **kwargs)
            return super().call_function(target, args, kwargs)

        def run_node(self, n):
            if n.name in recomputed:  # (activation checkpointing's forward op, run again: checkpointing.recomputing)
                from symcost.frontends import checkpointing

                checkpointing._RECOMPUTING[0] += 1
                try:
                    out = super().run_node(n)
                finally:
                    checkpointing._RECOMPUTING[0] -= 1
            else:
                out = super().run_node(n)
            if n in in_registers and isinstance(out, torch.Tensor):
                for m in self.modes:
                    m.drop(out)
            return out

    def run(args):
        modes = _suspended()[-1] if _suspended() else []
        stack_modes = _get_current_dispatch_mode_stack()
        active = {id(m) for m in stack_modes}
        with contextlib.ExitStack() as stack:
            for m in modes:
                if id(m) not in active:
                    stack.enter_context(m)
            # (boxed: the interpreter clears ``args``, so a saved tensor dies at its last use)
            out = Runner(list(modes) + [m for m in stack_modes if id(m) not in {id(x) for x in modes}]).boxed_run(args)
        if _kept() and any(id(m) not in active for m in modes):  # (a forward graph run by the compiled call)
            _kept()[-1].extend(out)
        return out

    run._boxed_call = True
    return run


#: a partitioned backward graph (:func:`_names`: AOTAutograd hands its compiler a copy) -> names of
#: its nodes that run a forward op again (``--ac``)
_RECOMPUTED: dict[tuple, set[str]] = {}


def _names(gm) -> tuple:
    """The names and targets of ``gm``'s calls, in order: a partitioned graph and its copies alike."""
    return tuple((n.name, str(n.target)) for n in gm.graph.nodes if n.op == "call_function")

#: the min-cut partitions decided in each trace: key (``ModelSpec.extra["compile_cuts"]``) ->
#: {joint graph's structure: positions of the joint graph's nodes saved for the backward}
_CUTS: dict[str, dict[tuple, list[int]]] = {}


def new_cuts_key() -> str:
    """A fresh key of :data:`_CUTS`: one trace's partitions (:func:`compile_spec`)."""
    import uuid

    return uuid.uuid4().hex


def _cuda_fused_attention():
    """A context under which the scaled-dot-product-attention calls that inductor's attention
    patterns put in place of an explicit ``matmul -> softmax -> dropout -> matmul``
    (``torch/_inductor/fx_passes/fuse_attention.py``: its replacements call the module's
    ``_scaled_dot_product_attention``, traced into the joint graph when a pattern matches) are
    traced as a CUDA device runs them: with the dropout inside the fused kernel, i.e. with
    ``dropout_p = 0`` on this CPU, which then runs its fused kernel
    (``_scaled_dot_product_flash_attention_for_cpu``, kept whole by inductor) in the inputs'
    dtype and keeps what CUDA's flash/efficient kernel keeps (query, key, value, output,
    log-sum-exp; ``symcost.tracing.device_kernels``). Without it the CPU's choice is traced:
    ``_fused_sdp_choice`` answers MATH for dropout on the CPU, whose composite upcasts 16-bit
    inputs to fp32 and keeps the ``[B, H, S, S]`` probabilities and mask (what inductor really
    compiles on a CPU)."""
    import torch._inductor.fx_passes.fuse_attention as fa

    sdpa = fa._scaled_dot_product_attention

    def fused(*args, **kwargs):
        if len(args) > 4:
            args = (*args[:4], 0.0, *args[5:])
        elif "dropout_p" in kwargs:
            kwargs = {**kwargs, "dropout_p": 0.0}
        return sdpa(*args, **kwargs)

    @contextlib.contextmanager
    def patched():
        fa._scaled_dot_product_attention = fused
        try:
            yield
        finally:
            fa._scaled_dot_product_attention = sdpa

    return patched()


def _partition(cuts: dict | None, torch_device: str | None = None, ac: bool = False):
    """Inductor's partition function (``torch._inductor.compile_fx.partition_fn``: its joint-graph
    passes, then ``min_cut_rematerialization_partition(compiler="inductor")``), where the saved
    set the min cut chooses (``choose_saved_values_set``) is decided once per joint graph
    structure in ``cuts``: the first compile of a structure (the trace records the requested
    sizes first) keeps the nodes the min cut saved, and a later compile of the same structure
    (a probe of the fit, at other sizes) saves the same nodes. The min cut weighs tensors by
    their bytes, so at a probe's tiny sizes it may cut elsewhere (seen: a softmax's output saved
    at S = 12, recomputed from its input at S = 16); the formulas are those of the partition
    the compiled step makes at the requested sizes. ``cuts`` None: every compile decides.
    ``torch_device`` ``"cuda"``: inductor's attention patterns (joint-graph passes) replace an
    explicit attention with the fused kernel a CUDA device runs (:func:`_cuda_fused_attention`).
    ``ac``: the blocks are checkpointed (``--ac``): the forward ops the backward graph runs again
    (the partitioner's recomputation of the checkpointed region) are noted in :data:`_RECOMPUTED`,
    so the recorder counts their FLOPs as hardware FLOPs only, as in an eager checkpointed step."""
    from torch._inductor.compile_fx import partition_fn

    def partition(joint_module, joint_inputs, **kwargs):
        import torch._functorch.partitioners as P

        orig = P.choose_saved_values_set

        def choose(joint_graph, node_info, *args, **kw):
            nodes = list(joint_graph.nodes)
            key = tuple((n.op, str(n.target)) for n in nodes)
            if cuts is not None and key in cuts:
                return [nodes[i] for i in cuts[key]]
            saved = orig(joint_graph, node_info, *args, **kw)
            if cuts is not None:
                index = {n: i for i, n in enumerate(nodes)}
                cuts[key] = [index[n] for n in saved]
            return saved

        P.choose_saved_values_set = choose
        try:
            with _cuda_fused_attention() if torch_device == "cuda" else contextlib.nullcontext():
                fw, bw = partition_fn(joint_module, joint_inputs, **kwargs)
        finally:
            P.choose_saved_values_set = orig
        if ac:  # the forward ops the backward graph runs again (same joint-graph node, same name)
            ran = {n.name for n in fw.graph.nodes if n.op == "call_function"}
            from torch._prims import rng_prims

            # (a random op's replay, run_with_rng_state, is the forward's run_and_save_rng_state again)
            _RECOMPUTED[_names(bw)] = {n.name for n in bw.graph.nodes if n.op == "call_function"
                                       and (n.name in ran or n.target is rng_prims.run_with_rng_state)}
        return fw, bw

    return partition


def backend(gm, example_inputs, cuts: dict | None = None, torch_device: str | None = None, ac: bool = False):
    """The ``torch.compile`` backend of a recorded compiled step: AOTAutograd with inductor's
    decompositions and inductor's partition function (joint-graph passes, then
    ``min_cut_rematerialization_partition(compiler="inductor")``; the cut kept per structure in
    ``cuts``, :func:`_partition`; ``torch_device``: the target device whose fused attention the
    patterns choose), the partitioned graphs run op by op (:func:`_graph_runner`).
    ``gm``: Dynamo's FX graph of one block's forward."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import select_decomp_table
    from torch._inductor.virtualized import V

    # (inductor's joint-graph passes read the fake mode through ``V``, as ``compile_fx`` sets it)
    with V.set_fake_mode(detect_fake_mode(example_inputs)):
        return aot_autograd(fw_compiler=_graph_runner, bw_compiler=_graph_runner,
                            decompositions=select_decomp_table(),
                            partition_fn=_partition(cuts, torch_device, ac))(gm, example_inputs)


def _compiles() -> int:
    """Graphs Dynamo has compiled in this process (``counters["stats"]["unique_graphs"]``)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _checkpointed(fn, mode: str):
    """``fn`` under activation checkpointing as torchtitan's ``apply_ac`` wraps a block before
    ``apply_compile`` compiles it (``torch.utils.checkpoint.checkpoint``, non-reentrant, no RNG
    state preserved; torchtitan's op-level selective policy for ``mode="selective"``): Dynamo
    captures the checkpoint as its higher-order op, AOTAutograd tags the region's nodes for
    recomputation and the partitioner runs them again in the backward graph."""
    from torch.utils.checkpoint import checkpoint

    from symcost.frontends.checkpointing import op_sac_context, without_cache

    extra = {"context_fn": op_sac_context} if mode == "selective" else {}

    def run(*args, **kwargs):
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False, **extra, **without_cache(kwargs))

    return functools.update_wrapper(run, fn)


def compile_blocks(model, layers: str, cuts_key: str | None = None, torch_device: str | None = None,
                   ac: str | None = None) -> None:
    """Compile every block of ``model`` (the children of the ``layers`` container) in place, as
    torchtitan's ``apply_compile`` does (``torch.compile(block, fullgraph=True)``, after tensor
    parallelism and activation checkpointing, before FSDP2), with :func:`backend` and static
    shapes (each probe of a fit is its own compile; Dynamo's caches are reset first, so the
    recompile limit of one process never turns a later probe's block back to eager). The block's
    ``forward`` is replaced (its module hooks, FSDP2's all-gathers, stay outside the compiled
    code, as on torchtitan's compiled module) and the module names stay the model's.
    ``torch_device`` (``--torch-device``): ``"cuda"`` compiles the attention inductor's patterns
    fuse as a CUDA device runs it (:func:`_cuda_fused_attention`); else this CPU's choice.
    ``ac`` (``--ac``: ``"full"`` or ``"selective"``): each block's forward checkpointed first
    (:func:`_checkpointed`), then compiled with the checkpoint inside, as torchtitan applies AC
    before compile; the backward graph's recomputed forward ops count as hardware FLOPs only.

    Raises (at the first call of a block):
        SymcostError: Dynamo cannot capture the block's forward in one graph (its reason, one
            line): torchtitan's ``fullgraph=True`` would fail the same way.
    """
    import torch

    from symcost.errors import SymcostError

    torch._dynamo.reset()
    cuts = _CUTS.setdefault(cuts_key, {}) if cuts_key is not None else None
    shared: dict = {}  # the class's forward -> its compiled function, shared by the blocks of a class
    chosen = functools.partial(backend, cuts=cuts, torch_device=torch_device, ac=ac is not None)
    for name, block in model.get_submodule(layers).named_children():
        inner = block.forward
        fn = getattr(inner, "__func__", None)
        if fn is None or getattr(inner, "__self__", None) is not block:  # (a forward set on the instance)
            fn = inner
            compiled = torch.compile(fn if ac is None else _checkpointed(fn, ac), backend=chosen, fullgraph=True,
                                     dynamic=False)
            call = compiled
        else:
            # the unbound forward compiled once, the block an argument: Dynamo treats the
            # blocks' parameters as inputs (inline_inbuilt_nn_modules), so the L blocks of one
            # class share one graph (a bound forward per block would recompile per block)
            if fn not in shared:
                shared[fn] = torch.compile(fn if ac is None else _checkpointed(fn, ac), backend=chosen,
                                           fullgraph=True, dynamic=False)
            call = functools.partial(shared[fn], block)

        def forward(*args, _compiled=call, _name=name, **kwargs):
            with _user_modes_suspended() as modes:
                try:
                    before = _compiles()
                    out = _compiled(*args, **kwargs)
                    hold(modes, out)
                    if _compiles() != before:
                        # the compile's own objects hold the block's example inputs in reference
                        # cycles (position ids passed to the block, unused by its graph): collected
                        # now, as a steady-state step (compiled at the first step) holds them not at
                        # all, instead of whenever the collector runs later in the step
                        gc.collect()
                    return out
                except SymcostError:
                    raise
                except torch._dynamo.exc.Unsupported as e:
                    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    raise SymcostError(f"--compile: torch.compile(fullgraph=True) cannot capture block {_name} in "
                                       f"one graph: {reason}") from e

        block.forward = functools.update_wrapper(forward, inner)


def compile_spec(layout, spec):
    """``spec`` with a key of its own for the partitions of its trace (``extra["compile_cuts"]``,
    :func:`_partition`), after :func:`check_compile`."""
    import dataclasses

    check_compile(layout, spec)
    return dataclasses.replace(spec, extra={**spec.extra, "compile_cuts": new_cuts_key()})


def check_compile(layout, spec) -> None:
    """Refuse, in one line, what a compiled step is not modelled with yet (docs/memory.md, "A
    compiled step"): a model without a block list (torchtitan compiles blocks), and the layouts
    and techniques whose composition with ``torch.compile`` is not checked against PyTorch yet.

    Raises:
        SymcostError: the combination, and what does compose.
    """
    from symcost.errors import SymcostError

    if "L" not in spec.symbols and spec.layers is None:
        raise SymcostError(f"--compile compiles each block of the model's block list (torchtitan's apply_compile); "
                           f"{spec.name} has none (no symbol L)")
    others = [flag for flag, on in (("--tp", layout.tp), ("--pp", layout.pipeline is not None),
                                    ("--fp8", layout.fp8 is not None),
                                    ("--offload", layout.offload)) if on]
    if others:
        raise SymcostError(f"--compile with {' '.join(others)} is not modelled yet: a compiled step is modelled on one "
                           "device and with --dp N --shard ddp|fsdp|zero1|zero2|zero3, --ac full|selective (docs/memory.md)")
