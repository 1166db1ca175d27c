"""Tensor and sequence parallelism of a :class:`ModelSpec`: the model wrapped with PyTorch's own
``torch.distributed.tensor.parallel.parallelize_module`` on a fake process group, one rank
recorded (docs/parallel.md, "Tensor and sequence parallelism").

A tensor-parallel spec is the model's own spec with one more symbol, ``TP`` (the tensor-parallel
group size), and a layout (:class:`symcost.frontends.layout.Layout`) with a ``tp`` dimension. The
recorder (:mod:`symcost.tracing.record`) builds it on the meta device, calls :func:`apply` (through
:meth:`Layout.parallelize`) on the ``tp`` dimension of the layout's fake ``DeviceMesh`` and records
the step; the ops inside DTensor's dispatch (the local matmuls on 1/TP of a weight, the collectives
of a redistribution) are what the recording holds.

The plan (:func:`plan`) is the Megatron-LM one (Shoeybi et al. 2019, Sec. 3), written with the
styles of ``torch.distributed.tensor.parallel`` the way torchtitan's ``apply_tp`` writes it:

* in every block, the projections that read the block's normalised input (q, k, v or a fused
  qkv; the MLP's up and gate) are ``ColwiseParallel`` (weight rows split: each rank computes
  1/TP of the heads and of the hidden units); the projections that write back to the residual
  stream (attention out, MLP down) are ``RowwiseParallel`` (weight columns split, the partial
  sums all-reduced);
* with ``sp`` (sequence parallelism, Korthikanti et al. 2022, Sec. 4.2.2) the norms are
  ``SequenceParallel`` (each rank normalises S/TP tokens), the attention and MLP modules'
  inputs are gathered by ``PrepareModuleInput(Shard(1) -> Replicate())`` (an all-gather; its
  backward a reduce-scatter) and the row-parallel outputs are reduce-scattered to ``Shard(1)``.
  The gathered input stays a DTensor into the projections (torchtitan's default
  ``use_local_output=False``): with a local tensor there, each column-parallel projection's
  input gradient would be all-reduced (``from_local(Replicate)``'s backward) and then split,
  twice the bytes of the reduce-scatter;
* the token embedding (``num_embeddings`` = V) is ``RowwiseParallel`` (vocabulary split;
  output all-reduced, or reduce-scattered over the sequence with ``sp``); a learned position
  embedding stays replicated and, with ``sp``, its output is split over the sequence (a slice
  forward; an all-gather of its gradient backward: Megatron-LM's scatter to the sequence-parallel
  region);
* the output head (a Linear with V outputs) is ``ColwiseParallel`` with sharded logits, and the
  loss runs under ``loss_parallel()`` (cross-entropy over vocabulary-sharded logits);
* a per-head table inside a block (T5's relative position bias, ``nn.Embedding(buckets, H)``) is
  ``ColwiseParallel``: split over its columns, each rank looks up its own heads' bias (Megatron-LM
  keeps it whole and scatters the bias over the heads: the same values);
* with ``sp`` on several stacks (an encoder-decoder), each stack's stream is split over its own
  sequence (S, S_enc); a column-parallel projection sitting in the block itself (BART's ``fc1``)
  gathers its own input, and a cross-attention's ``key_value_states`` (the encoder's output) is
  gathered with the hidden states;
* attention modules that own a column-parallel projection get their head counts divided by TP
  (attributes ``num_heads``, ``n_head``, ...), as torchtitan did before its attention read the
  local head count from the projection's output (``view(..., -1, head_dim)``).

A ``transformers`` model whose config has a ``base_model_tp_plan`` uses that plan instead (its
style names ``colwise``, ``rowwise``, ``colwise_rep``, ``rowwise_rep``, ``sequence_parallel``
mapped onto the same PyTorch styles), prefixed with the base model's attribute.

Torch is imported only inside the functions that need it.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
import math
import re
import warnings
import weakref
from typing import Mapping

from symcost.errors import SymcostError
from symcost.frontends.spec import Constraint, check_constraints
from symcost.frontends.tensor_parallel_stacks import (_check_stacks_planned, _scatter_first_block,
                                                      _stacks_entering_whole, refuse_flattened_sequence)
from symcost.frontends.tensor_parallel_hf import (  # noqa: F401  (re-exported)
    _GRAD_ALL_REDUCE, _TRANSFORMERS, _apply_transformers, _fqn_match, _grad_all_reduce, _transformers_model,
    hf_plan, model_tp_plan)

#: last name of a Linear that reads the block's normalised input (column-parallel)
COLWISE = re.compile(r"(q|k|v|qkv|wq|wk|wv|wqkv|query|key|value|query_key_value|c_attn|in_proj|"
                     r"q_proj|k_proj|v_proj|qkv_proj|up_proj|gate_proj|gate_up_proj|w1|w3|c_fc|fc1|"
                     r"fc_in|dense_h_to_4h|up|gate|wi|wi_0|wi_1)$")
#: last name of a Linear that writes back to the residual stream (row-parallel)
ROWWISE = re.compile(r"(o|wo|o_proj|out_proj|output_proj|dense|c_proj|w2|down_proj|fc2|fc_out|"
                     r"dense_4h_to_h|down)$")
#: head-count attributes divided by TP on a module that owns a column-parallel projection
HEAD_ATTRS = ("num_heads", "n_heads", "n_head", "num_attention_heads", "num_key_value_heads",
              "n_kv_heads", "num_kv_heads", "n_kv_head")

def tensor_parallel(spec, sp: bool = False):
    """The tensor-parallel dimension's part of a layout's spec (:meth:`symcost.frontends.layout.Layout.spec`
    calls it; a traced spec is the layout's): ``spec`` trained tensor-parallel over ``TP`` ranks
    (sequence-parallel too with ``sp``), with the symbol ``TP`` and the probe rules below.

    Probes must have ``TP`` divide every dimension the plan shards (heads, the sharded
    projections' features, V for a vocabulary-parallel embedding or head; S with ``sp``): the
    per-rank sizes are polynomial in TP only there (``probe_check``). Probes draw TP from 2, 4
    and 8 and keep those sizes multiples of 8 (``moduli``) where the request's are, so TP can
    vary alone. The formulas say ``/TP``.

    With a data-parallel dimension too, the layout is the 2-D mesh (DP, TP): the recorder applies
    this plan over the ``tp`` sub-mesh, then the data-parallel engine over the ``dp_shard`` or
    ``dp_replicate`` one (torchtitan's order, :meth:`Layout.parallelize`).
    """
    if "TP" in spec.symbols:
        return spec
    inner_probe = spec.probe_check

    def probe_check(values: Mapping[str, int]):
        why = inner_probe(values) if inner_probe else None
        if why or "TP" not in values:
            return why
        return _indivisible(spec, values, sp)

    defaults = dict(spec.defaults, TP=spec.defaults.get("TP", 8))
    moduli = dict(spec.moduli)
    seqs = _sequences(spec) if sp else ()
    for s in ("H", "K", "V", "F", "M", "E") + seqs:
        if s in spec.symbols or s == "S":
            moduli[s] = math.lcm(moduli.get(s, 1), 8)
    # what PyTorch itself refuses, in one line before any recording: SequenceParallel shards the
    # sequence dimension evenly, and S % TP != 0 fails inside the first norm's DTensor (an
    # 'Attempting to broadcast a dimension' error and the fake-tensor log's traceback); an
    # encoder-decoder's encoder stream is split too (S_enc). Declarative constraints, so the
    # trace cache keeps such a spec as data.
    added = tuple(Constraint(
        "multiple", q, "TP", f"--sp splits the sequence over the TP ranks: {q} must be a multiple of TP "
        f"(accepted: {q} a multiple of TP, or a TP that divides {q})") for q in seqs)
    constraints = tuple(spec.constraints) + added
    declarative = getattr(spec.check, "__qualname__", "").split(".<locals>")[0] == "ModelSpec.__post_init__"
    check = None if declarative else spec.check
    if check is not None and sp:
        inner_check = check

        def check(values: Mapping[str, int]):
            return inner_check(values) or check_constraints(added, values)

    return dataclasses.replace(spec, symbols=tuple(spec.symbols) + ("TP",), defaults=defaults,
                               probe_check=probe_check, moduli=moduli, check=check,
                               constraints=constraints)


def _sequences(spec) -> tuple[str, ...]:
    """The sequence lengths sequence parallelism splits: ``S``, and an encoder-decoder's encoder
    length ``S_enc`` where the spec has that symbol (each stack's residual stream is split over
    its own sequence)."""
    return ("S",) + (("S_enc",) if "S_enc" in spec.all_symbols else ())


def splits(spec, values: Mapping[str, int], sp: bool = False, sizes=(2, 4, 8)) -> list[int]:
    """The tensor-parallel sizes of ``sizes`` (the probes' pool) whose plan splits ``spec``'s
    model at ``values`` (every sharded dimension a multiple, at least two heads per rank where
    the request has that): what a probe can draw for TP there."""
    return [t for t in sizes if _indivisible(spec, {**values, "TP": t}, sp) is None]


def rejects(check, values: Mapping[str, int], precision: str = "") -> str | None:
    """Why the tensor-parallel plan cannot split the model at ``values["TP"]``, as ``report --tp``
    decides it: ``check`` (a tensor-parallel spec's ``probe_check``) with the vocabulary let
    through where TP does not divide V (:func:`uneven_vocab`: PyTorch runs it, ⌈V/TP⌉ rows on the
    recorded rank, the trace pins V and TP), except under ``megatron-*`` precision (Megatron-LM
    needs TP to divide its padded vocabulary: that TP is rejected). None where it splits. Used by
    ``plan`` (its TP sizes, and the TP it traces at)."""
    tp, v = values.get("TP"), values.get("V")
    if not tp or not v or v % tp == 0 or precision.startswith("megatron"):
        return check(values)
    token = UNEVEN_V.set(v)
    try:
        return check(values)
    finally:
        UNEVEN_V.reset(token)


#: spec.build -> its memo (symcost.frontends.memo.memo_per_model): sizes -> sharded dims
_SHARDED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


#: the requested vocabulary V while a trace runs with V and TP pinned because TP does not divide V
#: (:func:`uneven_vocab`, set by ``graph.build.trace``): the plan's dimensions of that size are
#: let through the probe check uneven (the same ⌈V/TP⌉ rows at every probe), the others still split evenly
UNEVEN_V: "contextvars.ContextVar[int | None]" = contextvars.ContextVar("symcost_uneven_v", default=None)


def uneven_vocab(spec, values: Mapping[str, int], precision: str = "") -> dict[str, str]:
    """The symbols to pin, with why, where ``TP`` does not divide the requested vocabulary ``V``
    and the plan shards a dimension of V rows (the token embedding's ``Shard(0)``, the head's
    output features); ``{}`` elsewhere.

    PyTorch runs it: DTensor's ``Shard(0)`` chunks V rows as ``torch.chunk`` does (rank r holds
    ⌈V/TP⌉ rows on the first ranks, fewer on the last; the recorded rank 0 the ⌈V/TP⌉), and its
    collectives over the uneven shards pad to the largest. ⌈V/TP⌉ is no polynomial in V or TP:
    both are pinned at the request, the other symbols stay free (their dimensions still split
    evenly at every probe, :func:`_indivisible`).

    Raises:
        SymcostError: under ``megatron-*`` precision: Megatron-LM's vocabulary-parallel embedding
            asserts that TP divides its rows (``VocabParallelEmbedding``: ``divide``), and its
            run pads the tokenizer's vocabulary to a multiple of ``--make-vocab-size-divisible-by``
            (128) × TP (``_vocab_size_with_padding``, megatron/training/tokenizer/tokenizer.py);
            symcost's V is those padded rows, so the line names the padded size to ask for.
    """
    tp, v = values.get("TP"), values.get("V")
    if not tp or not v or v % tp == 0:
        return {}
    sharded = _sharded_dims(spec, values)
    if isinstance(sharded, str) or not any(v in dims for dims, _ in sharded.values()):
        return {}
    if precision.startswith("megatron"):
        pad = -(-v // (128 * tp)) * 128 * tp
        raise SymcostError(
            f"V = {v} is not a multiple of TP = {tp}: Megatron-LM pads the vocabulary to a multiple of "
            f"--make-vocab-size-divisible-by (128) × TP = {128 * tp} (_vocab_size_with_padding), {pad} rows: "
            f"ask for --set V={pad} (nearest multiples of TP: {v // tp * tp}, {-(-v // tp) * tp})")
    rows = -(-v // tp)
    why = (f"V = {v} is not a multiple of TP = {tp}: the rank's vocabulary shard is ⌈V/TP⌉ = {rows} rows "
           f"(DTensor's Shard(0) chunks, as torch.chunk; the last ranks hold fewer)")
    return {"V": why, "TP": f"V = {v} is not a multiple of TP = {tp}: ⌈V/TP⌉ rows are no polynomial in TP"}


def _indivisible(spec, values: Mapping[str, int], sp: bool) -> str | None:
    """Why ``TP`` does not divide a dimension the plan shards (the model built on the meta
    device), or None. A dimension of the pinned uneven vocabulary (:data:`UNEVEN_V`) is let
    through."""
    tp = values["TP"]
    uneven = UNEVEN_V.get()
    for q in _sequences(spec) if sp else ():
        if values.get(q, tp) % tp or values.get(q, 2 * tp) < 2 * tp:
            return (f"{q}={values[q]} is no multiple of TP={tp} of at least 2·TP (sequence parallelism "
                    f"splits {q}; one token per rank is a regime of its own)")
    for h in ("H", "K"):  # the attention head counts (conventions), wherever the model keeps them
        if h in values and h in spec.all_symbols and values[h] % tp:
            return f"{h}={values[h]} heads do not split over TP={tp}"
    sharded = _sharded_dims(spec, values)
    if isinstance(sharded, str):
        return f"the model does not build at these sizes ({sharded})"
    for name, (dims, heads) in sharded.items():
        bad = [d for d in dims if d % tp and d != uneven] + [d for d in heads if d % tp] or [
            d for d in heads if d < 2 * tp]
        if bad:
            return (f"{name}: {bad[0]} is no multiple of TP={tp}" if bad[0] % tp else
                    f"{name}: {bad[0]} heads leave one per rank (a regime of its own)")
    return None


def _sharded_dims(spec, values: Mapping[str, int]) -> dict:
    """:func:`sharded_dims` of ``spec`` built on the meta device at ``values`` (TP aside),
    memoised per model (:func:`symcost.frontends.memo.memo_per_model`): a probe search asks
    this for a hundred or more candidate sizes (each build :meth:`ModelSpec.build_meta`); the
    first line of the error where the model does not build there (a str)."""
    from symcost.frontends.memo import memo_per_model, meta_model

    values = {k: v for k, v in values.items() if k not in ("TP", "DP")}
    if "L" in values:
        # the blocks after the leading ones repeat the same shapes: two of them decide (a model
        # of the request's 80 blocks took 0.34 s to build on the meta device, for every probe)
        values["L"] = min(values["L"], int(getattr(spec, "lead_blocks", 0) or 0) + 2)

    def build(v):
        try:
            return tuple(sharded_dims(meta_model(spec, v), spec.layers).items())
        except Exception as e:  # noqa: BLE001 - sizes the model cannot run at: no probe
            # (a pipeline stage's build runs the model on fake tensors to find its boundary,
            # frontends.pipeline.probe_spec: DeepSeek's MLA at K != H fails in its attention)
            return (str(e).strip().splitlines() or [type(e).__name__])[0]

    got = memo_per_model(_SHARDED.setdefault(spec.build, {}), values, build)
    return got if isinstance(got, str) else dict(got)


def sharded_dims(model, layers: str | None) -> dict[str, tuple[list[int], list[int]]]:
    """``{module name: ([sizes the plan splits over TP], [head counts split over TP])}`` for
    the Megatron plan of ``model`` (:func:`plan`): out_features of column-parallel Linears (and
    of the head), in_features of row-parallel ones, the vocabulary of the row-parallel token
    embedding; the head counts (:data:`HEAD_ATTRS`) of modules that own a column-parallel
    projection; the heads of a per-head table (its ``embedding_dim``, :func:`_per_head`)."""
    from torch import nn

    roles, _ = _roles(model, layers)
    out: dict[str, tuple[list[int], list[int]]] = {}
    for name, role in roles.items():
        m = model.get_submodule(name)
        if role in ("colwise", "head"):
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            heads = [getattr(parent, a) for a in HEAD_ATTRS if isinstance(getattr(parent, a, None), int)
                     and not isinstance(getattr(parent, a), bool)] if role == "colwise" else []
            out[name] = ([_features(m)[0]], heads)
        elif role in ("rowwise", "embedding"):
            out[name] = ([m.num_embeddings if isinstance(m, nn.Embedding) else _features(m)[1]], [])
        elif role == "head_bias":
            out[name] = ([m.embedding_dim], [])
    return out


def _linear_like(m) -> bool:
    """``nn.Linear``, or a leaf module of its own class named ``*Linear*`` with a 2-D
    ``weight [out, in]`` (cs336-lm's bias-free Linear)."""
    from torch import nn

    if isinstance(m, nn.Linear):
        return True
    w = getattr(m, "weight", None)
    return ("Linear" in type(m).__name__ and isinstance(w, nn.Parameter) and w.dim() == 2
            and not list(m.children()))


def _features(m) -> tuple[int, int]:
    """``(out_features, in_features)`` of a Linear-like module (:func:`_linear_like`)."""
    return (m.out_features, m.in_features) if hasattr(m, "out_features") else tuple(m.weight.shape)


def block_names(model, layers) -> list[str]:
    """The module names of the blocks of ``layers``: one container's children (``""``: the
    root's), or, for a list of containers, every stack's (an encoder's and a decoder's blocks);
    ``[]`` for None."""
    if layers is None:
        return []
    return [f"{c}.{n}" if c else n for c in ([layers] if isinstance(layers, str) else layers)
            for n, _ in model.get_submodule(c).named_children()]


def _roles(model, layers) -> tuple[dict[str, str], dict[str, str]]:
    """Module roles of the Megatron plan: ``({name: colwise|rowwise|head|embedding|norm|pos|head_bias},
    {name: where the sequence is gathered with sp: 'in', a module owning column-parallel
    projections (the attention, the MLP), or 'linear', a column-parallel projection that sits in
    the block itself})``; ``layers``: the block container, or a list of them (several stacks:
    :func:`block_names`)."""
    from torch import nn

    roles: dict[str, str] = {}
    parents: dict[str, str] = {}
    blocks = block_names(model, layers)
    block_set = set(blocks)
    for b in blocks:
        for name, m in model.get_submodule(b).named_modules():
            full = f"{b}.{name}" if name else b
            last = name.rpartition(".")[2]
            if _linear_like(m) and COLWISE.match(last):
                roles[full] = "colwise"
                # with sp the sequence is gathered where the projection's input enters: at the
                # module that owns it (the attention, the MLP), or at the projection itself where
                # it sits in the block (BART's fc1: the block's input is the residual stream)
                if full.rpartition(".")[0] in block_set:
                    parents[full] = "linear"
                else:
                    parents[full.rpartition(".")[0]] = "in"
            elif _linear_like(m) and ROWWISE.match(last):
                roles[full] = "rowwise"
            elif "norm" in type(m).__name__.lower() and name and not any(
                    _linear_like(c) for c in m.modules()):
                roles[full] = "norm"
        for name, m in model.get_submodule(b).named_modules():
            full = f"{b}.{name}" if name else b
            if isinstance(m, nn.Embedding) and name and _per_head(model, full, m, parents):
                roles[full] = "head_bias"
    # outside the blocks: the token embedding (the one whose size is the output head's V, else
    # the first), other embeddings (positions), the final norm, the output head
    def outside(n):
        return n and not any(n == b or n.startswith(b + ".") for b in blocks)

    # (an embedding of its own class, a [V, h] table indexed directly, stays replicated: "pos")
    def table(m):
        w = getattr(m, "weight", None)
        return isinstance(m, nn.Embedding) or ("Embedding" in type(m).__name__ and isinstance(w, nn.Parameter)
                                               and w.dim() == 2 and not list(m.children()))

    embeddings = [(n, m) for n, m in model.named_modules() if outside(n) and table(m)]
    linears = [(n, m) for n, m in model.named_modules() if outside(n) and _linear_like(m)]
    sizes = {m.weight.shape[0] for _, m in embeddings}
    head = next(((n, m) for n, m in reversed(linears) if _features(m)[0] in sizes), None)
    if head is None and linears and not embeddings and any(type(m).__name__ == "Absent" for m in model.modules()):
        # the last stage of a pipeline (symcost.frontends.pipeline.make_stage): its embedding
        # lives on the first stage, so the head is the last linear after the blocks (torchtitan's
        # plan for the stage that owns `output`)
        head = linears[-1]
    vocab = _features(head[1])[0] if head else (embeddings[0][1].weight.shape[0] if embeddings else None)
    token = next((n for n, m in embeddings if m.weight.shape[0] == vocab and isinstance(m, nn.Embedding)), None)
    # (a table tied to the token embedding is split as it is: BART's encoder and decoder
    # embed_tokens, each a module of its own on the shared weight)
    token_weight = model.get_submodule(token).weight if token is not None else None
    for n, m in model.named_modules():
        if not outside(n):
            continue
        if table(m):
            roles[n] = "embedding" if n == token or (token_weight is not None and m.weight is token_weight) else "pos"
        elif head is not None and n == head[0]:
            roles[n] = "head"
        elif "norm" in type(m).__name__.lower() and not any(_linear_like(c) for c in m.modules()):
            roles[n] = "norm"
    return roles, parents


def _per_head(model, name: str, m, parents: Mapping[str, str]) -> bool:
    """Whether the ``nn.Embedding`` ``m`` at ``name`` inside a block is a per-head table of an
    attention the plan splits over heads: its parent owns a column-parallel projection
    (``parents``) and its ``embedding_dim`` is one of the parent's head counts
    (:data:`HEAD_ATTRS`). T5's relative position bias, ``relative_attention_bias =
    nn.Embedding(num_buckets, n_heads)``, whose lookup ``[S_q, S_k, H]`` is permuted to
    ``[1, H, S_q, S_k]`` and added to the scores: each rank needs its heads' columns."""
    parent = name.rpartition(".")[0]
    if parent not in parents:
        return False
    owner = model.get_submodule(parent)
    heads = {getattr(owner, a) for a in HEAD_ATTRS if isinstance(getattr(owner, a, None), int)
             and not isinstance(getattr(owner, a), bool)}
    return m.embedding_dim in heads


def plan(model, layers: str | None, sp: bool, keep: bool = False) -> tuple[dict, bool]:
    """The Megatron plan of ``model`` (module docstring): ``({module name: ParallelStyle},
    loss_parallel)``; ``loss_parallel`` is True when the output head is column-parallel with
    sharded logits (the loss must then run under ``loss_parallel()``). ``keep`` (with ``sp``):
    the residual stream stays a DTensor sharded over the sequence (the embedding's and the
    row-parallel projections' ``use_local_output=False``) and the attention and MLP inputs are
    all-gathered by :func:`_gather_inputs` instead of ``PrepareModuleInput``: a transformers
    model reads the sequence length from its hidden states (positions, the causal mask), which
    a local shard would cut to S/TP (:func:`sequence_parallel_plan`). ``layers``: the block
    container, or a list of them (several stacks; on a transformers model the head then gathers
    its logits, ``loss_parallel`` False)."""
    from torch import nn
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    Col, Row = _any_linear_styles()
    roles, parents = _roles(model, layers)
    # several stacks of a transformers model (an encoder-decoder: BART adds its final_logits_bias
    # to the logits in its own forward): the head's logits gathered whole, as transformers' own
    # plans' ``colwise_gather_output`` head does, and the loss sees them unsharded
    gather = not isinstance(layers, str) and layers is not None and _transformers_model(model)
    out: dict = {}
    seq = Shard(1)
    has_head = False

    def col(name, **kw):
        return (ColwiseParallel if isinstance(model.get_submodule(name), nn.Linear) else Col)(**kw)

    for name, role in roles.items():
        if role == "colwise":
            out[name] = col(name)
        elif role == "rowwise":
            out[name] = (RowwiseParallel if isinstance(model.get_submodule(name), nn.Linear) else Row)(
                output_layouts=seq if sp else Replicate(), use_local_output=not keep)
        elif role == "norm" and sp:
            out[name] = SequenceParallel()
        elif role == "head_bias":
            # a per-head table (T5's relative position bias, [num_buckets, H]): split over its
            # columns, the heads, as ColwiseParallel splits an nn.Embedding (weight Shard(1));
            # the lookup of the replicated bucket indices gives this rank's H/TP heads, a local
            # tensor, with no collective either way
            out[name] = ColwiseParallel()
        elif role == "embedding":
            out[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq if sp else Replicate(),
                                        use_local_output=not keep)
        elif role == "head" and gather:
            out[name] = col(name, input_layouts=seq if sp else Replicate(), output_layouts=Replicate())
        elif role == "head":
            out[name] = col(name, input_layouts=seq if sp else Replicate(), output_layouts=Shard(-1),
                            use_local_output=False)
            has_head = True
    for name, kind in parents.items():
        if sp and kind == "linear":  # (its input arrives sharded over the sequence: all-gathered here)
            out[name] = col(name, input_layouts=seq)
    if sp and not keep:
        for parent, kind in parents.items():
            if kind == "linear":
                continue
            n = _positional(model.get_submodule(parent))
            out[parent] = PrepareModuleInput(input_layouts=(seq,) + (None,) * (n - 1),
                                             desired_input_layouts=(Replicate(),) + (None,) * (n - 1))
    return out, has_head


def _any_linear_styles():
    """``ColwiseParallel`` and ``RowwiseParallel`` for a Linear-like module of its own class
    (:func:`_linear_like`, ``weight [out, in]``, ``y = x·Wᵀ``): PyTorch's styles accept
    ``nn.Linear`` and ``nn.Embedding`` only; these partition the weight as they do an
    ``nn.Linear``'s (rows for column-parallel, columns for row-parallel) and prepare inputs and
    outputs the same way."""
    from functools import partial

    from torch.distributed.tensor import Shard, distribute_module
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    class Col(ColwiseParallel):
        def _apply(self, module, device_mesh):
            return distribute_module(
                module, device_mesh, self._partition_linear_fn,
                partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))

    class Row(RowwiseParallel):
        def _apply(self, module, device_mesh):
            self.desired_input_layouts = (Shard(-1),)
            return distribute_module(
                module, device_mesh, self._partition_linear_fn,
                partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))

    return Col, Row


def _positional(module) -> int:
    """Positional parameters of ``module.forward`` (at least 1)."""
    try:
        ps = [p for p in inspect.signature(module.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return 1
    return max(1, len(ps))


def sequence_parallel_plan(model, layers: str | None, styles: dict) -> tuple[dict, bool]:
    """``styles`` (transformers' plan as PyTorch styles, :func:`hf_plan`) with sequence
    parallelism, as torchtitan applies it to a transformers model (torchtitan/experiments/
    transformers_modeling_backend/parallelize.py, ``apply_non_moe_tp``; transformers' plans have
    no sequence-parallel entries): the vocabulary-parallel embedding reduce-scatters its output
    over the sequence (``RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))``);
    each block's norms and the final norm are ``SequenceParallel``; the attention's and MLP's
    inputs are all-gathered over the sequence before their column-parallel projections
    (:func:`_gather_inputs`, torchtitan's ``PrepareModuleInput``: by keyword or position); the
    row-parallel projections reduce-scatter their output (``output_layouts=Shard(1)``); the head
    is column-parallel on the all-gathered sequence with vocabulary-sharded logits and the loss
    under ``loss_parallel`` (torchtitan's default ``enable_loss_parallel``). The residual stream
    stays a DTensor sharded over the sequence (``use_local_output=False``): transformers' model
    reads the sequence length from it (positions, the causal mask), which a local shard would
    cut to S/TP. Returns ``(styles, loss_parallel)``.

    Raises:
        SymcostError: a plan entry sequence parallelism does not cover (transformers' own style
            objects: MLA, packed or MoE styles).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    roles, parents = _roles(model, layers)
    out: dict = {}
    for p, s in styles.items():
        names = [n for n, _ in model.named_modules() if _fqn_match(p, n)]
        role = next((roles.get(n) for n in names if roles.get(n)), None)
        if isinstance(s, tuple) and s[0] == _TRANSFORMERS:
            raise SymcostError(f"--sp on a transformers model: its plan's {s[1]!r} style ({p}) has no sequence-"
                               "parallel form here (torchtitan's plan covers q/k/v, o, gate/up/down, the norms, "
                               "the embedding and the head); use --tp alone")
        if role == "embedding":
            out[p] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
        elif role == "head":
            out[p] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
        elif isinstance(s, RowwiseParallel):
            out[p] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
        elif isinstance(s, ColwiseParallel) and any(parents.get(n) == "linear" for n in names):
            # a column-parallel projection in the block itself gathers its own input (:func:`_roles`)
            out[p] = ColwiseParallel(input_layouts=Shard(1), output_layouts=s.output_layouts,
                                     use_local_output=s.use_local_output)
        else:
            out[p] = s
    block_prefixes = tuple(f"{b}." for b in block_names(model, layers))
    for n, role in roles.items():
        # the norms on the residual stream: a block's own (input_layernorm, post_attention_layernorm,
        # ...) and the final one; a norm inside the attention (Qwen3's q_norm) keeps its rule
        own_norm = any(n.startswith(b) and "." not in n[len(b):] for b in block_prefixes)
        if role == "norm" and (own_norm or not any(n.startswith(b) for b in block_prefixes)):
            out[n] = SequenceParallel()
    return out, any(r == "head" for r in roles.values())


def _gather_inputs(model, layers: str | None, mesh) -> None:
    """With sequence parallelism on a transformers model (:func:`sequence_parallel_plan`): each
    module that owns a column-parallel projection (the attention, the MLP) gets its inputs that
    are sharded over the sequence all-gathered before its forward, whether they come by position
    or by keyword (``hidden_states``; a cross-attention's ``key_value_states``) (torchtitan's
    ``PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())`` and its
    ``input_kwarg_layouts`` form)."""
    from torch.distributed.tensor import DTensor, Replicate

    def gather(x):
        if isinstance(x, DTensor) and any(getattr(pl, "dim", None) == 1 for pl in x.placements):
            return x.redistribute(placements=[Replicate()])
        return x

    def hook(module, args, kwargs):
        # every input sharded over the sequence: the hidden states, and a cross-attention's
        # key_value_states (the encoder's output, of S_enc tokens), which its k and v projections
        # read whole (Megatron-LM's column-parallel linear_kv gathers it the same way)
        return tuple(gather(a) for a in args), {k: gather(x) for k, x in kwargs.items()}

    _, parents = _roles(model, layers)
    for parent, kind in parents.items():
        if kind == "in":  # ('linear': the projection's own style gathers, :func:`plan`)
            model.get_submodule(parent).register_forward_pre_hook(hook, with_kwargs=True)


@contextlib.contextmanager
def _nothing():
    yield


def apply(model, layers: str | None, mesh, sp: bool, fp8: str | None = None, skip: list[str] | None = None):
    """Parallelise ``model`` in place over ``mesh`` (:func:`plan`, or the config's
    ``base_model_tp_plan``; head counts divided by the mesh size; under FP8 training's tensorwise
    recipe, ``fp8``, torchao's float8 styles for its ``Float8Linear`` modules:
    :func:`symcost.frontends.fp8.float8_tp_styles`; ``skip``: module names whose submodules the plan
    leaves alone, the MoE layers under ``--ep --tp``, :mod:`symcost.frontends.expert_parallel_tp`).
    Returns the context the loss and its backward
    run in: ``loss_parallel()`` where the head's logits are vocabulary-sharded, else a no-op.

    Raises:
        SymcostError: the plan shards nothing, or PyTorch refuses it (its message, one line).
    """
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

    tp = mesh.size()
    got = hf_plan(model, sp)
    # a transformers model under sequence parallelism keeps its residual stream a DTensor
    # (:func:`plan`'s ``keep``, :func:`sequence_parallel_plan`)
    keep = sp and _transformers_model(model)
    if got is None:
        styles, lp = plan(model, layers, sp, keep)
        colwise = [n for n, s in styles.items() if isinstance(s, ColwiseParallel) and n.count(".")]
    else:
        styles, lp = got if not sp else sequence_parallel_plan(model, layers, got[0])
        # a module a pipeline stage deleted (frontends.pipeline's Absent: no parameters) takes no
        # style, as torchtitan's NoParallel for the stage's nn.Identity modules
        # (transformers_modeling_backend/parallelize.py, apply_non_moe_tp)
        deleted = {n for n, m in model.named_modules() if type(m).__name__ == "Absent"}
        styles = {p: s for p, s in styles.items()
                  if not deleted or not any(_fqn_match(p, n) for n in deleted)}
        grad_all_reduce = [p for p, s in styles.items() if s is _GRAD_ALL_REDUCE]
        own = {p: s[1] for p, s in styles.items() if isinstance(s, tuple) and s[0] == _TRANSFORMERS}
        styles = {p: s for p, s in styles.items() if s is not _GRAD_ALL_REDUCE and p not in own}
        colwise = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)
                   and any(_fqn_match(p, n) for p, s in styles.items() if isinstance(s, ColwiseParallel))]
    if skip:
        def inside(n):
            return any(n == k or n.startswith(k + ".") for k in skip)

        styles = {p: st for p, st in styles.items()
                  if not any(inside(n) for n, _ in model.named_modules() if n == p or _fqn_match(p, n))}
        colwise = [n for n in colwise if not inside(n)]
    if not styles:
        raise SymcostError("--tp: no projection of the model matches the Megatron plan (column- and "
                           "row-parallel Linears by name); nothing would be split")
    containers = [layers] if isinstance(layers, str) else list(layers or ())
    if got is None and containers and not any(n.startswith(c + ".") for n in styles for c in containers):
        # (the embedding and head alone split: every block replicated on every rank, which a
        # report would present as tensor parallelism; GPT-2's Conv1D with its fused c_attn)
        kinds = sorted({type(m).__name__ for c in containers for n, m in model.get_submodule(c).named_modules()
                        if getattr(m, "weight", None) is not None and getattr(m.weight, "dim", lambda: 0)() == 2})
        raise SymcostError(f"--tp: no projection inside the blocks ({', '.join(containers)}) matches the Megatron plan "
                           f"(column- and row-parallel nn.Linear by name; the blocks hold {', '.join(kinds)}), and "
                           "the config has no base_model_tp_plan: every block would stay whole on every rank")
    if got is None and len(containers) > 1:
        _check_stacks_planned(model, containers, styles, _linear_like)
    whole = _stacks_entering_whole(_roles(model, layers)[0], containers) if sp and len(containers) > 1 else []
    # heads per rank: the attention module's head counts / TP (torchtitan's adjustment)
    done = set()
    for n in colwise:
        parent = model.get_submodule(n.rpartition(".")[0]) if "." in n else model
        if id(parent) in done:
            continue
        done.add(id(parent))
        for a in HEAD_ATTRS:
            v = getattr(parent, a, None)
            if isinstance(v, int) and not isinstance(v, bool):
                if v % tp:
                    ok = ", ".join(str(t) for t in range(2, v + 1) if v % t == 0)
                    raise SymcostError(f"--tp {tp}: {n.rpartition('.')[0]}.{a} = {v} heads do not split "
                                       f"over {tp} ranks (accepted: a TP that divides {v}: {ok})")
                setattr(parent, a, v // tp)
    if sp:
        _split_positions(model, layers, mesh, keep, skip=[c.rpartition(".")[0] for c in whole])
        for c in whole:
            _scatter_first_block(model, c, mesh, keep)
        if keep:
            _gather_inputs(model, layers, mesh)
    if fp8 == "tensorwise":
        from symcost.frontends.fp8 import float8_tp_styles

        styles = float8_tp_styles(model, styles)
    tied: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(p), []).append(n)
    try:
        with warnings.catch_warnings():
            # a rule of transformers' plan for a module this config leaves out (DeepSeek's q_proj
            # with a q_lora_rank, a dense model's shared_experts): transformers skips it too
            warnings.filterwarnings("ignore", message=r".*skipping this plan entry", category=UserWarning)
            warnings.filterwarnings("ignore", message=r"Parallelize plan key .* could not be resolved",
                                    category=UserWarning)  # (torch 2.13's wording of the same)
            parallelize_module(model, mesh, styles)
    except Exception as e:  # noqa: BLE001
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SymcostError(f"parallelize_module failed for --tp {tp}: {msg}") from e
    _retie(model, [names for names in tied.values() if len(names) > 1])
    if got is not None and grad_all_reduce:
        _grad_all_reduce(model, grad_all_reduce, mesh)
    if got is not None and own:
        _apply_transformers(model, own, mesh)
    if keep:  # (a block that flattens its stream with the batch, OPT's: one line)
        refuse_flattened_sequence(model, styles, block_names(model, layers))
    return loss_parallel if lp else _nothing


def _retie(model, groups: list[list[str]]) -> None:
    """Tie again the parameters ``parallelize_module`` untied (each module's parameter is
    distributed on its own: GPT-2's head and token embedding), where their shards agree (the
    vocabulary-parallel embedding and the column-parallel head both split the [V, h] table by
    rows).

    Raises:
        SymcostError: tied parameters that the plan splits differently.
    """
    for names in groups:
        first = model.get_parameter(names[0])
        for n in names[1:]:
            other = model.get_parameter(n)
            if other is first:
                continue
            if getattr(other, "placements", None) != getattr(first, "placements", None) or other.shape != first.shape:
                raise SymcostError(f"--tp: tied parameters {names[0]} and {n} are split differently by the plan")
            parent, _, attr = n.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, first)


def _split_positions(model, layers, mesh, keep: bool = False, skip: list[str] | None = None) -> None:
    """With sequence parallelism: a replicated position embedding's output ``[..., S, h]`` split
    over the sequence (:func:`_scatter_sequence`), so it adds to the sequence-sharded token
    embedding (``keep``: as a DTensor sharded over the sequence, :func:`plan`); not in the stacks
    ``skip`` (module prefixes), whose stream enters whole (:func:`_stacks_entering_whole`)."""
    roles, _ = _roles(model, layers)

    def split(module, inputs, output):
        local = _scatter_sequence(output, mesh)
        if not keep:
            return local
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(local, mesh, [Shard(local.dim() - 2)], run_check=False)

    for name, role in roles.items():
        if role == "pos" and not any(name.startswith(k + ".") for k in skip or ()):
            model.get_submodule(name).register_forward_hook(split)


def _scatter_sequence(x, mesh):
    """This rank's ``1/TP`` of ``x`` along dim -2 (the sequence), Megatron-LM's
    ``scatter_to_sequence_parallel_region``: a slice forward, an all-gather of the gradient
    backward (``DTensor.redistribute(Replicate -> Shard)`` does the same, but through a split
    into TP tensors: ops whose number depends on TP)."""
    import torch
    import torch.distributed._functional_collectives as funcol

    class Scatter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            n, r = mesh.size(), mesh.get_local_rank()
            c = t.shape[-2] // n
            return t.narrow(t.dim() - 2, r * c, c)

        @staticmethod
        def backward(ctx, g):
            out = funcol.all_gather_single(g.contiguous(), g.dim() - 2, (mesh, 0))
            return out.wait() if hasattr(out, "wait") else out

    return Scatter.apply(x)
