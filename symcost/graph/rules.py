"""Per-op cost rules: FLOPs (model and all), bytes moved, on symbolic (or concrete) shapes.

Each rule is a small pure function of the op's input and output shapes (tuples of sympy
expressions or ints) and returns numbers of the same kind, so a rule gives a closed form when
handed symbolic shapes and a count when handed concrete ones.

Model FLOPs reuse ``torch.utils.flop_counter.flop_registry`` (mm, addmm, bmm, baddbmm, the
convolutions and their backward, the fused attention kernels): the same formulas as
``FlopCounterMode``, by construction. Rules are added where that registry has none: the CPU
flash-attention kernel ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward,
counted with the registry's own ``sdpa_flop_count`` / ``sdpa_backward_flop_count``, and the
oneDNN recurrent layer ``aten.mkldnn_rnn_layer`` (``nn.LSTM`` on CPU) and its backward, and the
grouped GEMM ``aten._grouped_mm`` (the sum of its groups' matmuls, :func:`grouped_mm_flops`). Rules
replace the registry's where it counts wrong (docs/conventions.md, "Divergences"): the raw
``_flash_attention_*`` / ``_efficient_attention_*`` kernels (registered ``get_raw=True``, they
expect tensors, and read the kernels' [B, S, H, D] layout as [B, H, S, D]) and the weight
gradient of a grouped ``convolution_backward`` (the registry ignores ``groups``).

All-op FLOPs add the per-element counts below (one FLOP = one add or multiply, see
docs/conventions.md):

============================================  ===========================================
op family                                     FLOPs
============================================  ===========================================
pointwise (Tag.pointwise; __or__, __and__,    1 per output element
floor_divide)
reduction (``torch.Tag.reduction``)           1 per input element
bias of ``addmm``/``baddbmm``/convolution     1 per output element (see :func:`bias_adds`)
``_softmax`` / ``_log_softmax`` / ``_safe_``  5 per element (max, subtract, exp, sum, divide/log)
``_softmax_backward_data`` / log-softmax bwd  4 per element
``native_layer_norm``                         7 per element (mean 1, centre 1, square 1,
                                              variance 1, normalise 1, affine 2)
``native_layer_norm_backward``                14 per element (twice the forward)
``native_dropout``                            2 per element (compare, scale)
``nll_loss_forward`` / backward               1 per target element
``embedding_dense_backward``                  1 per gradient element (scatter-add)
``histc``                                     1 per input element (one bin increment)
pooling, nearest resampling, ``mse_loss``     see :mod:`symcost.graph.rules_special`
``_grouped_mm`` (grouped GEMM)                its GEMMs, see :func:`grouped_mm_flops`
``mkldnn_rnn_layer`` (+ its gate matmuls)     per hidden element and step: 2·G (+ 2·G biases)
                                              + state update (LSTM 5); backward twice that
data movement (copy, cat, index, embedding)   0
views (``view``, ``t``, ``expand``, ...)       0 FLOPs and 0 bytes
============================================  ===========================================

Bytes: inputs read plus outputs written, each once (the unfused lower bound); the destination of
``copy_``/``fill_``/``zero_`` is written, not read; views and allocations without writes move 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import sympy
import torch
from torch.utils.flop_counter import flop_registry

from symcost.graph.opsets import PASS_THROUGH, ROW_NORMALISING, numel  # noqa: F401  (re-exported: torch-free facts)
from symcost.graph.attention_flops import sdpa_backward_count, sdpa_count, sdpa_recompute_count  # noqa: F401  (API)
from symcost.graph.rules_special import SPECIAL_RULES, UNREAD_INPUTS  # noqa: F401  (fusion reads UNREAD_INPUTS)

aten = torch.ops.aten

Shape = tuple  # of sympy.Expr or int


@dataclass
class OpView:
    """What a rule sees of one op: name, overload, shapes, dtypes and the argument tree.

    ``args``/``kwargs`` hold the op's arguments with every tensor replaced by its shape tuple
    (the form ``flop_registry`` functions accept) and every integer by its (symbolic) value.
    """

    op: Any
    name: str
    in_shapes: Sequence[Shape]
    in_dtypes: Sequence[torch.dtype]
    out_shapes: Sequence[Shape]
    out_dtypes: Sequence[torch.dtype]
    args: tuple
    kwargs: dict


@dataclass
class Cost:
    """FLOPs (model and all), bytes and transcendental function evaluations of one op execution."""

    flops: Any = 0  # model FLOPs (matmul class): FlopCounterMode's formulas, kernel-independent
    flops_all: Any = 0  # the op's executed work: hardware matmul FLOPs + elementwise/reduction/norm
    bytes: Any = 0  # bytes read + written
    #: transcendental function evaluations by function class (``exp``, ``log``, ``erf``,
    #: ``tanh``, ``sin``, ``sqrt``; see :data:`TRANSCENDENTAL_OUT`), e.g. ``{"exp": B*H*S**2}``
    transcendentals: dict = field(default_factory=dict)
    #: hardware matmul FLOPs (HFU): what the kernel really multiplies, FlopCounterMode's count op
    #: for op; ``flops`` plus work a kernel repeats (a fused attention backward recomputes the
    #: scores Q·Kᵀ). None: equal to ``flops``.
    flops_hw: Any = None

    def __post_init__(self):
        if self.flops_hw is None:
            self.flops_hw = self.flops

    @property
    def transcendental_total(self):
        """All transcendental evaluations of the op (XLA's ``transcendentals`` count)."""
        return sum(self.transcendentals.values())


def nbytes(shape: Shape, dtype: torch.dtype):
    """numel x element size, in bytes (conventions: fp32 4, bf16/fp16 2, fp8 1)."""
    return numel(shape) * dtype.itemsize


# torch-free, kept in symcost.graph.opsets (a cached analysis' passes use them without torch)
from symcost.graph.opsets import GEMM_PACKED_OPERAND, packed_operand  # noqa: E402,F401


def _traffic(v: OpView, skip_first_input: bool = False):
    ins = list(zip(v.in_shapes, v.in_dtypes))[1 if skip_first_input else 0:]
    return sum(nbytes(s, d) for s, d in ins) + sum(nbytes(s, d) for s, d in zip(v.out_shapes, v.out_dtypes))


# ----------------------------------------------------------------------------------------------
# the registry: packet name -> rule; families by tag below
RULES: dict[str, Callable[[OpView], Cost]] = {}


def rule(*names: str):
    """Register a rule for the given op packets (``"aten.mm"``) or overloads (``"aten.mm.default"``)."""

    def deco(fn):
        for n in names:
            RULES[n] = fn
        return fn

    return deco


def _model_flops(v: OpView):
    fn = flop_registry[v.op.overloadpacket]
    out = v.out_shapes[0] if len(v.out_shapes) == 1 else tuple(v.out_shapes)
    return fn(*v.args, out_val=out, **v.kwargs)


def _arg(v: OpView, name: str, default=None):
    """The argument called ``name`` in the op's schema (positional or keyword), else ``default``."""
    for i, a in enumerate(v.op._schema.arguments):
        if a.name == name:
            if i < len(v.args):
                return v.args[i]
            return v.kwargs.get(name, default)
    return default


def bias_adds(v: OpView):
    """All-FLOPs of the bias of a matmul-class op, which model FLOPs leave out (FlopCounterMode).

    ``addmm``/``baddbmm`` compute ``beta·self + alpha·(a @ b)``: one add per output element when
    ``beta`` ≠ 0, one more multiply per element for ``alpha`` ≠ 1 and for ``beta`` ∉ {0, 1} — what
    the same math written as ``a @ b`` then ``+ self`` costs under the pointwise rule (1 FLOP per
    output element per op), so ``nn.Linear`` and ``x @ W.T + b`` get the same all-FLOPs.
    Convolutions with a ``bias``: one add per output element. Other ops: 0.
    """
    packet = str(v.op.overloadpacket)
    out = numel(v.out_shapes[0]) if v.out_shapes else 0
    if packet in ("aten.addmm", "aten.baddbmm"):
        beta, alpha = _arg(v, "beta", 1), _arg(v, "alpha", 1)
        n = (beta != 0) + (alpha != 1) + (beta not in (0, 1))
        return n * out
    if "conv" in packet and "backward" not in packet and _arg(v, "bias") is not None:
        return out
    return 0


def _registry_rule(v: OpView) -> Cost:
    f = _model_flops(v)
    return Cost(f, f + bias_adds(v), _traffic(v))


@rule("aten.convolution_backward")
def _conv_backward(v: OpView) -> Cost:
    """The registry's ``conv_backward_flop``, with the weight gradient of a grouped convolution
    divided by ``groups`` (the true work), and the op's outputs put back in their positions.

    The op returns ``(grad_input, grad_weight, grad_bias)`` with ``None`` where ``output_mask`` is
    False (e.g. no grad_input for a first layer fed the data batch); the recording keeps tensors
    only, but the registry formula reads ``out_shape[1]`` as grad_weight's shape.

    Divergence from FlopCounterMode (torch/utils/flop_counter.py ``conv_backward_flop``): its
    grad_weight term, ``conv_flop_count(t(x), t(grad_out), t(grad_weight))``, pairs every input
    channel with every output channel, ignoring ``groups``; each output channel of a grouped
    convolution only meets its group's ``C_in/groups`` input channels, so the true count is that
    term divided by ``groups`` — what FlopCounterMode itself counts when the convolution is split
    into ``groups`` separate ones. grad_input (a transposed convolution with the grouped weight) is
    right in the registry and kept. All-FLOPs add grad_bias, a sum over every element of
    ``grad_out`` (1 per element, as the reduction rule counts ``nn.Linear``'s bias gradient).
    """
    mask = v.args[10] if len(v.args) > 10 else v.kwargs["output_mask"]
    groups = _arg(v, "groups", 1)
    shapes = iter(v.out_shapes)
    out = tuple(next(shapes) if m else None for m in mask)
    fn = flop_registry[v.op.overloadpacket]
    args = list(v.args[:10])
    kwargs = {k: x for k, x in v.kwargs.items() if k != "output_mask"}

    def part(k):
        if not mask[k]:
            return 0
        only = [j == k for j in range(3)]
        return fn(*args, only, out_val=out, **kwargs)

    grad_weight = part(1)
    if groups != 1:
        grad_weight = grad_weight // groups if isinstance(grad_weight, int) and isinstance(groups, int) \
            else sympy.expand(grad_weight / groups)
    f = part(0) + grad_weight
    grad_bias = numel(v.args[0]) if mask[2] else 0
    return Cost(f, f + grad_bias, _traffic(v))


def sdpa_backward_cost(v: OpView, hw, q, k, n=1) -> Cost:
    """A fused attention backward: model FLOPs = the four gradient matmuls (dP, dV, dQ, dK: the
    same for every kernel, eager attention included); ``flops_hw`` = FlopCounterMode's five
    terms (with the recomputed scores), which all-FLOPs count too (the kernel's real work).
    ``hw`` is one sequence's count; ``n`` sequences (varlen raw kernels) multiply both."""
    model = n * (hw - sdpa_recompute_count(q, k))
    hw = n * hw
    if isinstance(model, sympy.Basic):
        model = sympy.expand(model)
    return Cost(model, hw, _traffic(v), flops_hw=hw)


for _name in ("aten._scaled_dot_product_flash_attention_backward",
              "aten._scaled_dot_product_efficient_attention_backward",
              "aten._scaled_dot_product_cudnn_attention_backward"):
    RULES[_name] = lambda v: sdpa_backward_cost(v, _model_flops(v), v.in_shapes[1], v.in_shapes[2])


@rule("aten._scaled_dot_product_flash_attention_for_cpu")
def _sdpa_cpu(v: OpView) -> Cost:
    """CPU flash attention (missing from FlopCounterMode): 4*B*H*S_q*S_k*D, as sdpa_flop_count."""
    q, k, val = v.in_shapes[:3]
    f = sdpa_count(q, k, val)
    return Cost(f, f, _traffic(v))


@rule("aten._scaled_dot_product_flash_attention_for_cpu_backward")
def _sdpa_cpu_bwd(v: OpView) -> Cost:
    """Its backward: 4 matmuls = 8*B*H*S_q*S_k*D model FLOPs; with the recomputed scores
    10*B*H*S_q*S_k*D hardware FLOPs, as sdpa_backward_flop_count (:func:`sdpa_backward_cost`)."""
    grad_out, q, k, val = v.in_shapes[:4]
    return sdpa_backward_cost(v, sdpa_backward_count(grad_out, q, k, val), q, k)


def _bshd(shape):
    """(batch, seq, heads, dim) -> (batch, heads, seq, dim): the layout ``sdpa_flop_count`` reads."""
    b, s, h, d = shape
    return (b, h, s, d)


def _raw_attention_shapes(v: OpView, names: tuple[str, str, str], cu: str, max_q: str, max_k: str,
                          grad: str | None = None):
    """``(count, q, k, v, grad_out)`` in BHSD for the raw kernels, whose tensors are BSHD.

    ``_flash_attention_*`` take ``(batch, seq, heads, dim)`` and ``_efficient_attention_*`` BMHK
    (the same order). With cumulative sequence offsets (``cu``, nested/varlen inputs of ``total``
    tokens) there are ``len(offsets) - 1`` sequences; their lengths are data, so each is counted at
    the maximum length — the worst case FlopCounterMode also takes on fake tensors.
    """
    q, k, val = (_arg(v, n) for n in names)
    go = _arg(v, grad) if grad else None
    offsets = _arg(v, cu)
    if offsets is None:
        return 1, _bshd(q), _bshd(k), _bshd(val), go and _bshd(go)
    n = offsets[0] - 1
    mq, mk = _arg(v, max_q), _arg(v, max_k)
    h_q, d_q = q[-2:]
    h_k, d_k = k[-2:]
    h_v, d_v = val[-2:]
    qs, ks, vs = (1, h_q, mq, d_q), (1, h_k, mk, d_k), (1, h_v, mk, d_v)
    return n, qs, ks, vs, go and (1, h_q, mq, d_v)


@rule("aten._flash_attention_forward")
def _flash_fwd(v: OpView) -> Cost:
    """Raw flash attention forward (BSHD): ``sdpa_flop_count`` on BHSD, 4·B·H·S_q·S_k·D.

    FlopCounterMode's registry entry hands the BSHD shapes to ``sdpa_flop_count`` as if they were
    BHSD, i.e. swaps S and H (4·B·S·H²·D); symcost counts the layout the kernel takes.
    """
    n, q, k, val, _ = _raw_attention_shapes(v, ("query", "key", "value"), "cum_seq_q", "max_q", "max_k")
    f = n * sdpa_count(q, k, val)
    return Cost(f, f, _traffic(v))


@rule("aten._efficient_attention_forward")
def _efficient_fwd(v: OpView) -> Cost:
    """Raw memory-efficient attention forward (BMHK = BSHD): 4·B·H·S_q·S_k·D, as above."""
    n, q, k, val, _ = _raw_attention_shapes(v, ("query", "key", "value"), "cu_seqlens_q", "max_seqlen_q",
                                            "max_seqlen_k")
    f = n * sdpa_count(q, k, val)
    return Cost(f, f, _traffic(v))


@rule("aten._flash_attention_backward")
def _flash_bwd(v: OpView) -> Cost:
    """Raw flash attention backward (BSHD): ``sdpa_backward_flop_count``, 10·B·H·S_q·S_k·D."""
    n, q, k, val, go = _raw_attention_shapes(v, ("query", "key", "value"), "cum_seq_q", "max_q", "max_k",
                                             "grad_out")
    return sdpa_backward_cost(v, sdpa_backward_count(go, q, k, val), q, k, n)


@rule("aten._efficient_attention_backward")
def _efficient_bwd(v: OpView) -> Cost:
    """Raw memory-efficient attention backward (BMHK): 10·B·H·S_q·S_k·D."""
    n, q, k, val, go = _raw_attention_shapes(v, ("query", "key", "value"), "cu_seqlens_q", "max_seqlen_q",
                                             "max_seqlen_k", "grad_out_")
    return sdpa_backward_cost(v, sdpa_backward_count(go, q, k, val), q, k, n)


#: pointwise FLOPs per hidden element and time step of a fused recurrent layer, after the gate
#: matmuls, by ``mode`` (cuDNN/oneDNN numbering: 0 RNN-ReLU, 1 RNN-tanh, 2 LSTM, 3 GRU)
RNN_STATE_UPDATE = {0: 0, 1: 0, 2: 5, 3: 4}


def _rnn_layer_flops(v: OpView, w_ih: str, w_hh: str):
    """``(model FLOPs, pointwise FLOPs)`` of one forward pass of a fused recurrent layer.

    Gate matmuls (Elman 1990 / Hochreiter & Schmidhuber 1997; PyTorch's ``nn.LSTM`` docs): at each
    of the S steps, for each of the B sequences, ``W_ih·x_t`` and ``W_hh·h_{t-1}`` with weights
    [G·Hd, I] and [G·Hd, Hd] (G gates: 4 LSTM, 3 GRU, 1 RNN): 2·S·B·G·Hd·(I + Hd) FLOPs.
    Pointwise, per hidden element and step: G adds (the two products), 2·G bias adds when the
    layer has biases, G gate activations, then the state update (LSTM 5: c = f·c + i·g is 3,
    h = o·tanh(c) 2; GRU 4; RNN 0).
    """
    x, wi, wh = _arg(v, "input"), _arg(v, w_ih), _arg(v, w_hh)
    gh, i_size = wi
    hd = _arg(v, "hidden_size")
    rows = numel(x[:-1])  # S·B, whatever the batch_first layout
    model = 2 * rows * gh * (i_size + wh[1])
    per_hidden = RNN_STATE_UPDATE.get(_arg(v, "mode"), 0)
    gates = gh // hd if isinstance(gh, int) and isinstance(hd, int) else sympy.cancel(gh / hd)
    point = rows * hd * (2 * gates + 2 * gates * bool(_arg(v, "has_biases")) + per_hidden)
    return model, point


def grouped_mm_flops(a, b, out):
    """Model FLOPs of ``aten._grouped_mm(a, b, offs)``, shapes ``a``, ``b``, ``out``.

    The groups split one dimension of the product among the experts (``offs``, int32 ``[G]``: the
    cumulative sizes). Each group is an ordinary matmul (conventions: (m×k)·(k×n) is 2·m·k·n),
    and the group sizes sum to the split dimension whatever ``offs`` holds, so the sum over the
    groups needs only the shapes:

    * 2-D ``[M_total, K]`` × 3-D ``[G, K, N]`` -> ``[M_total, N]`` (the experts' forward, rows
      split): Σ_g 2·m_g·K·N = 2·M_total·K·N;
    * 3-D ``[G, M, K]`` × 2-D ``[K, N_total]`` -> ``[M, N_total]``: 2·M·K·N_total;
    * 2-D ``[M, K_total]`` × 2-D ``[K_total, N]`` -> ``[G, M, N]`` (a weight gradient, the
      contraction split): Σ_g 2·M·k_g·N = 2·M·K_total·N (not 2·G·M·K_total·N: each product
      contracts only its own group);
    * 3-D × 3-D ``[G, M, K]·[G, K, N]``: a batched product, 2·G·M·K·N (bmm's formula).

    These are the sums of the ``mm`` FLOPs that transformers' ``eager`` experts loop runs (and
    ``FlopCounterMode`` counts) for the same slots; ``torch.utils.flop_counter`` has no formula
    for ``_grouped_mm`` (torch 2.13), so ``FlopCounterMode`` counts 0 for it. A routing that
    leaves slots past ``offs[-1]`` (expert-parallel sentinels) would run fewer; symcost's
    routing models route every slot.
    """
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[1]
    return 2 * numel(out) * a[-1]


@rule("aten._grouped_mm")
def _grouped_mm(v: OpView) -> Cost:
    """Grouped GEMM (transformers' ``grouped_mm`` experts): :func:`grouped_mm_flops`; a bias (the
    op's ``bias``, unused by transformers) one add per output element in all-FLOPs; bytes of the
    operands, ``offs`` and the output, each once."""
    f = grouped_mm_flops(v.in_shapes[0], v.in_shapes[1], v.out_shapes[0])
    bias = numel(v.out_shapes[0]) if _arg(v, "bias") is not None else 0
    return Cost(f, f + bias, _traffic(v))


@rule("aten.mkldnn_rnn_layer")
def _mkldnn_rnn(v: OpView) -> Cost:
    """One layer and direction of ``nn.LSTM`` on the CPU (oneDNN), which FlopCounterMode counts as
    0: 2·S·B·G·Hd·(I + Hd) model FLOPs (``nn.LSTM(10, 20)`` on (5, 3, 10): 72,000), plus the
    pointwise gate work in all-FLOPs (see :func:`_rnn_layer_flops`)."""
    model, point = _rnn_layer_flops(v, "weight0", "weight1")
    return Cost(model, model + point, _traffic(v))


@rule("aten.mkldnn_rnn_layer_backward")
def _mkldnn_rnn_bwd(v: OpView) -> Cost:
    """Its backward: the oneDNN backward primitive computes every gradient (input, h0/c0, both
    weights, bias) whatever ``requires_grad`` says, so the gate matmuls run twice over — the data
    gradients ``dgates·W`` and the weight gradients ``dgatesᵀ·[x, h]``: 2 × forward =
    4·S·B·G·Hd·(I + Hd). All-FLOPs add twice the forward's pointwise count (the convention of
    the normalisation backward rules)."""
    model, point = _rnn_layer_flops(v, "weight1", "weight2")
    return Cost(2 * model, 2 * (model + point), _traffic(v))


VIEW_OPS = {
    "aten.view", "aten._unsafe_view", "aten.t", "aten.transpose", "aten.permute", "aten.expand",
    "aten.unsqueeze", "aten.squeeze", "aten.slice", "aten.select", "aten.split",
    "aten.split_with_sizes", "aten.unbind", "aten.detach", "aten.alias", "aten.as_strided",
    "aten._reshape_alias", "aten.reshape", "aten.diagonal", "aten.narrow", "aten.unfold",
    "aten.view_as_real", "aten.view_as_complex", "aten.chunk", "aten.lift_fresh",
    "aten.movedim", "aten.swapaxes", "aten._unsafe_view", "aten.flatten", "aten.unflatten",
    # views without autograd's view tracking: the gate split of the CPU GRU / LSTM(proj_size) step
    "aten.unsafe_split", "aten.unsafe_split_with_sizes", "aten.unsafe_chunk",
    # in-place metadata changes (no data moved): batch_first recurrent layers transpose_ theirs
    "aten.transpose_", "aten.t_", "aten.squeeze_", "aten.unsqueeze_", "aten.swapaxes_", "aten.swapdims_",
    "aten.as_strided_", "aten.detach_",
}
ALLOC_OPS = {"aten.empty", "aten.empty_like", "aten.new_empty", "aten.new_empty_strided", "aten.empty_strided"}
MOVE_OPS = {
    "aten.copy_", "aten.clone", "aten._to_copy", "aten.cat", "aten.stack", "aten.index_select",
    "aten.gather", "aten.scatter", "aten.scatter_add", "aten.index", "aten.index_put",
    "aten.index_put_", "aten.embedding", "aten.zeros", "aten.zeros_like", "aten.ones", "aten.ones_like",
    "aten.full", "aten.full_like", "aten.new_zeros", "aten.new_ones", "aten.new_full", "aten.fill_",
    "aten.zero_", "aten.arange", "aten.constant_pad_nd", "aten.repeat", "aten.contiguous",
    "aten.masked_fill", "aten.masked_fill_", "aten.tril", "aten.triu", "aten.tril_", "aten.triu_",
    "aten.where", "aten.roll", "aten.flip", "aten.randint", "aten.rand", "aten.randn", "aten.bernoulli_",
    "aten.slice_backward", "aten.select_backward", "aten.index_add", "aten.index_add_", "aten.scalar_tensor",
    "aten.lift_fresh_copy", "aten.expand_copy", "aten.scatter_reduce", "aten.sort", "aten.topk",
    "aten.cumsum", "aten.new_tensor", "aten._local_scalar_dense", "aten.unsqueeze_copy",
}
MOVE_OPS |= {"aten.index_copy", "aten.index_copy_"}
#: random tensors shaped like their input (a VAE's reparameterisation: ``torch.randn_like(mu)``):
#: the output written; the input gives the shape and dtype only and is not read
LIKE_RANDOM_OPS = {"aten.randn_like", "aten.rand_like", "aten.randint_like"}
MOVE_OPS |= LIKE_RANDOM_OPS | {"aten.triu_indices", "aten.tril_indices"}
MOVE_OPS |= {"aten.scatter_"}  # (its bytes: opsets.PARTIAL_WRITES)
#: inductor's random prims (torch/_inductor/inductor_prims.py) that its decompositions put in place
#: of dropout's random mask under --compile: the seeds buffer, one seed looked up, the random tensor
#: written (inductor lowers the last two as Pointwise: symcost.frontends.compile keeps them in registers)
MOVE_OPS |= {"prims.inductor_seeds", "prims.inductor_lookup_seed", "prims.inductor_random"}
#: the functional forms of in-place writes into a view (AOTAutograd's functionalisation under
#: --compile): the base read, the source read, the whole output written
MOVE_OPS |= {"aten.slice_scatter", "aten.select_scatter", "aten.diagonal_scatter", "aten.as_strided_scatter"}
MOVE_OPS |= {
    # FSDP2's copies around its collectives (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py):
    # the shards into the all-gather buffer, the gathered buffer out to the parameters, the
    # gradients into the reduce-scatter buffer
    "fsdp.all_gather_copy_in", "fsdp.split_with_sizes_copy", "fsdp.chunk_cat",
}
#: FSDP2's CPU offload copies between host and device (symcost.frontends.offload): data movement
#: whose device side is the copy's bytes once (an H2D copy writes them into device memory, a D2H
#: copy reads them), the host link's bytes are symcost.passes.offload.transfer_bytes'
TRANSFER_OPS = {"symcost.h2d", "symcost.d2h",
                # activation offload's (symcost.frontends.offload.save_on_host)
                "symcost.save_h2d", "symcost.save_d2h"}
#: Collectives: packet -> (kind, where the collective's size is: ("in"|"out", position), or
#: ("in", "all") for the sum of every tensor input). The size is nccl-tests' ``size`` (the
#: gathered tensor of an all-gather, the reduced input of a reduce-scatter, the tensor of an
#: all-reduce); :func:`comm_volume` turns it into bytes per rank.
COMM_OPS: dict[str, tuple[str, tuple]] = {
    "c10d._allgather_base_": ("all_gather", ("in", 0)),  # (output, input, group, ...)
    "c10d.allgather_into_tensor_coalesced_": ("all_gather", ("in", 0)),
    "_c10d_functional.all_gather_into_tensor": ("all_gather", ("out", 0)),  # (input, group_size, group)
    "c10d._reduce_scatter_base_": ("reduce_scatter", ("in", 1)),  # (output, input, group, op, ...)
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", ("in", 0)),
    "c10d.allreduce_": ("all_reduce", ("in", "all")),  # ([tensors], group, op, ...)
    "_c10d_functional.all_reduce": ("all_reduce", ("in", 0)),
    "c10d.broadcast_": ("broadcast", ("in", "all")),
    # expert parallelism's token dispatch and combine (symcost.frontends.expert_parallel): the
    # size is the input the rank splits over the group (equal splits: the routing model's)
    "_c10d_functional.all_to_all_single": ("all_to_all", ("in", 0)),  # (input, out_splits, in_splits, group)
    "c10d.alltoall_base_": ("all_to_all", ("in", 1)),  # (output, input, group, out_splits, in_splits, ...)
    "_c10d_functional.wait_tensor": ("wait", None),
    # point-to-point (pipeline stages, symcost.frontends.pipeline): (tensors, group, peer, tag)
    "c10d.send": ("send", ("in", "all")),
    "c10d.recv_": ("recv", ("in", "all")),
}
#: bytes each rank sends (and receives) per byte of a collective's size on n ranks, ring
#: algorithm (nccl-tests doc/PERFORMANCE.md, "bus bandwidth": all-gather and reduce-scatter
#: (n-1)/n, all-reduce 2(n-1)/n; a pipelined broadcast moves the size once)
RING_FACTOR = {
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: 1,
    # all-to-all with equal splits: a rank keeps 1/n of its input and sends the rest, receiving as
    # much (nccl-tests doc/PERFORMANCE.md: alltoall bus bandwidth = algbw·(n-1)/n)
    "all_to_all": lambda n: (n - 1) / n,
    "wait": lambda n: 0,
    "send": lambda n: 1,  # point-to-point: the tensor once, whatever the group
    "recv": lambda n: 1,
}


def comm_volume(v: OpView, n) -> tuple[str, Any, Any]:
    """``(kind, size, per_rank)`` of a collective (:data:`COMM_OPS`) on a group of ``n`` ranks.

    ``size`` is the collective's size in bytes as nccl-tests defines it (the all-gathered
    output, the reduce-scatter input, the all-reduced tensor); ``per_rank`` the bytes each rank
    sends, equal to those it receives, under the ring algorithm: ``size·(n-1)/n`` for
    all-gather and reduce-scatter, ``2·size·(n-1)/n`` for all-reduce (nccl-tests'
    doc/PERFORMANCE.md, bus bandwidth). ``n`` may be a symbol (``DP``).

    Raises:
        KeyError: ``v`` is no collective.
    """
    kind, where = COMM_OPS[str(v.op.overloadpacket)]
    if where is None:
        return kind, 0, 0
    side, pos = where
    shapes, dtypes = (v.in_shapes, v.in_dtypes) if side == "in" else (v.out_shapes, v.out_dtypes)
    if pos == "all":
        size = sum(nbytes(sh, d) for sh, d in zip(shapes, dtypes))
    else:
        size = nbytes(shapes[pos], dtypes[pos])
    if kind == "all_to_all" and _keeps_nothing(v):
        # a permutation (``permute_tensor``: ring attention's pass of the keys and values to the
        # next rank, symcost.frontends.context_parallel): the whole input goes to one other rank
        return kind, size, size
    return kind, size, sympy.nsimplify(RING_FACTOR[kind](sympy.sympify(n))) * size


def _keeps_nothing(v: OpView) -> bool:
    """Whether an ``all_to_all_single`` (functional: ``(input, output_split_sizes,
    input_split_sizes, group)``) sends the traced rank's (rank 0's) whole input to other ranks:
    its input split sizes are given and the rank's own is 0, as in ``permute_tensor``."""
    splits = v.args[2] if str(v.op.overloadpacket) == "_c10d_functional.all_to_all_single" and len(v.args) > 2 else None
    return isinstance(splits, (list, tuple)) and len(splits) > 1 and sympy.sympify(splits[0]) == 0


#: Ops through which a parameter stays "the same weight" (dtype casts by autocast, copies).
OVERWRITE_OPS = {"aten.copy_", "aten.fill_", "aten.zero_"}
# torch-free, kept in symcost.graph.opsets (fusion reads them for a cached analysis)
from symcost.graph.opsets import PARTIAL_WRITES, partial_write_bytes  # noqa: E402,F401


PER_ELEMENT_OUT = {  # FLOPs per element of the first output
    "aten._softmax": 5, "aten._log_softmax": 5, "aten._safe_softmax": 5, "aten._softmax_backward_data": 4,
    "aten._log_softmax_backward_data": 4, "aten.native_dropout": 2,
}
PER_ELEMENT_IN = {  # FLOPs per element of the first input
    "aten.native_layer_norm": 7, "aten.native_layer_norm_backward": 14,
    "aten.native_group_norm": 7, "aten.native_group_norm_backward": 14,
    "aten.native_batch_norm": 7, "aten.native_batch_norm_backward": 14,
    "aten._native_batch_norm_legit": 7, "aten._native_batch_norm_legit_no_training": 7,
    "aten._fused_rms_norm": 4, "aten._fused_rms_norm_backward": 8,
    "aten.embedding_dense_backward": 1,
    "aten.histc": 1,  # one bin increment per input element (transformers' tokens per expert)
}

#: Transcendental function evaluations per output element, by function class. A roofline device
#: may give one rate for them all (a GPU's special-function units) or a rate per class (a CPU,
#: where ``symcost calibrate`` measures each: an erf or a tanh costs several exps there). The
#: count is the operator's mathematics, as XLA's ``HloCostAnalysis`` counts ``transcendentals``
#: (xla/service/hlo_cost_analysis.cc: exp, expm1, log, log1p, logistic, erf, tanh, sin, cos,
#: tan, atan2, sqrt, rsqrt, cbrt, pow): ``sigmoid``/``silu`` are one exp, the exact GELU one erf
#: (its backward an erf and an exp: Φ(x) + x·φ(x)), the softmax one exp per element.
TRANSCENDENTAL_OUT: dict[str, dict[str, int]] = {
    **{f"aten.{n}": {"exp": 1} for n in (
        "exp", "exp2", "expm1", "sigmoid", "silu", "silu_backward", "elu", "celu", "selu",
        "_softmax", "_safe_softmax", "_log_softmax", "_log_softmax_backward_data", "softplus_backward")},
    **{f"aten.{n}": {"log": 1} for n in ("log", "log2", "log10", "log1p", "logit", "xlogy")},
    **{f"aten.{n}": {"erf": 1} for n in ("erf", "erfc", "erfinv")},
    **{f"aten.{n}": {"tanh": 1} for n in ("tanh",)},
    **{f"aten.{n}": {"sin": 1} for n in (
        "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "asinh", "acosh", "atanh")},
    **{f"aten.{n}": {"sqrt": 1} for n in ("sqrt", "rsqrt")},
    "aten.softplus": {"exp": 1, "log": 1}, "aten.logaddexp": {"exp": 1, "log": 1},
    "aten.mish": {"exp": 1, "log": 1, "tanh": 1},
}
#: ops with one reciprocal square root per normalised group: the position of their rstd output
RSTD_OUTPUT = {"aten.native_layer_norm": 2, "aten._fused_rms_norm": 1, "aten.native_group_norm": 2,
               "aten.native_batch_norm": 2, "aten._native_batch_norm_legit": 2}
#: exps of the fused attention kernels: one per attention score, forward and backward (which
#: recomputes P = exp(S - logsumexp); Dao et al. 2022, FlashAttention, Alg. 1 and 4)
ATTENTION_KERNELS = {  # packet -> whether its tensors are the raw kernels' BSHD (else BHSD)
    **{f"aten._scaled_dot_product_{k}": False for k in (
        "flash_attention_for_cpu", "flash_attention_for_cpu_backward", "flash_attention",
        "flash_attention_backward", "efficient_attention", "efficient_attention_backward",
        "cudnn_attention", "cudnn_attention_backward")},
    **{f"aten._{k}": True for k in ("flash_attention_forward", "flash_attention_backward",
                                     "efficient_attention_forward", "efficient_attention_backward")},
}
#: per hidden element and time step of a fused recurrent layer (mode as RNN_STATE_UPDATE): LSTM
#: three sigmoid gates, a tanh gate and tanh(c); GRU two sigmoids and a tanh; RNN-tanh one tanh
RNN_TRANSCENDENTALS = {0: {}, 1: {"tanh": 1}, 2: {"exp": 3, "tanh": 2}, 3: {"exp": 2, "tanh": 1}}


def transcendentals(v: OpView) -> dict:
    """Transcendental function evaluations of one op, ``{class: count}`` (symbolic or concrete).

    Per output element from :data:`TRANSCENDENTAL_OUT`; GELU by its ``approximate`` argument
    (``"none"``: erf, backward erf + exp; ``"tanh"``: tanh); ``pow`` by its exponent (an integer
    exponent is multiplies, 0.5 / -0.5 a (reciprocal) square root, any other an exp and a log);
    ``_log_softmax`` adds one log per row; normalisations one rsqrt per group (their rstd
    output); fused attention kernels one exp per score, B·H·S_q·S_k (nested inputs counted at the
    maximum length, as their FLOPs); the oneDNN LSTM layer its gate activations. An in-place
    variant (``sigmoid_``, ``tanh_``, ``exp_``) counts as its function. Other ops: none.
    """
    packet = str(v.op.overloadpacket)
    out = numel(v.out_shapes[0]) if v.out_shapes else 0
    if packet in ("aten.gelu", "aten.gelu_backward"):
        if _arg(v, "approximate", "none") == "tanh":
            return {"tanh": out}
        return {"erf": out} if packet == "aten.gelu" else {"erf": out, "exp": out}
    if packet == "aten.pow":
        e = _arg(v, "exponent")
        if isinstance(e, sympy.Basic) and e.is_number:
            e = float(e)
        if isinstance(e, (int, float)) and not isinstance(e, bool):
            if float(e).is_integer():
                return {}
            if abs(e) == 0.5:
                return {"sqrt": out}
        return {"exp": out, "log": out}
    per = TRANSCENDENTAL_OUT.get(packet)
    if per is None and packet.endswith("_") and not packet.endswith("__"):
        # in-place variant (``sigmoid_``, ``tanh_``: the gates of the CPU GRU / LSTM(proj) step)
        per = TRANSCENDENTAL_OUT.get(packet[:-1])
    if per:
        res = {k: n * out for k, n in per.items()}
        if packet == "aten._log_softmax" and v.out_shapes and v.out_shapes[0]:
            dim = _arg(v, "dim", -1)
            shape = v.out_shapes[0]
            size = shape[dim]
            res["log"] = out // size if isinstance(out, int) and isinstance(size, int) else sympy.cancel(out / size)
        return res
    if packet == "aten.binary_cross_entropy_with_logits":  # an exp and a log1p per input element
        n = numel(v.in_shapes[0])
        return {"exp": n, "log": n}
    if packet in RSTD_OUTPUT:
        i = RSTD_OUTPUT[packet]
        return {"sqrt": numel(v.out_shapes[i])} if len(v.out_shapes) > i else {}
    if packet in ATTENTION_KERNELS:
        if ATTENTION_KERNELS[packet]:
            n, q, k, _, _ = _raw_attention_shapes(
                v, ("query", "key", "value"), *(("cum_seq_q", "max_q", "max_k") if "flash" in packet
                                                else ("cu_seqlens_q", "max_seqlen_q", "max_seqlen_k")))
        else:
            n, q, k = 1, _arg(v, "query"), _arg(v, "key")
        b, h, s_q, _ = q
        return {"exp": n * b * h * s_q * k[2]}
    if packet == "aten.mkldnn_rnn_layer":
        rows = numel(_arg(v, "input")[:-1])
        return {fn: c * rows * _arg(v, "hidden_size") for fn, c in RNN_TRANSCENDENTALS.get(_arg(v, "mode"), {}).items()}
    return {}


def bias_positions(op) -> tuple[int, ...]:
    """Tensor-input positions of a matmul-class op that hold a bias, not a matmul operand."""
    packet = str(op.overloadpacket)
    if packet in ("aten.addmm", "aten.baddbmm", "aten.addbmm"):
        return (0,)
    if "convolution" in packet and "backward" not in packet:
        return (2,)
    if packet == "aten.mkldnn_rnn_layer":
        return (3, 4)
    if packet == "aten._grouped_mm":
        return (3,)
    return ()


#: aten's operator dunders that carry no tags of their own (torch 2.13: ``a | b`` and ``a & b`` on
#: tensors dispatch ``aten.__or__``/``__and__``, aliases of the pointwise ``bitwise_or``/``_and``;
#: ``__xor__`` and the shifts are tagged pointwise already)
DUNDER_POINTWISE = {"aten.__or__", "aten.__and__"}
#: pointwise ops that carry no pointwise tag (torch 2.13): ``floor_divide`` (``//`` on tensors,
#: transformers' ``perm // num_top_k`` slot-to-token map), 1 FLOP per output element
UNTAGGED_POINTWISE = DUNDER_POINTWISE | {"aten.floor_divide"}
#: activation gradients without the pointwise tag (torch 2.13), elementwise all the same: one
#: grad_input element per grad_output element (``silu_backward``, ``gelu_backward`` carry the tag)
UNTAGGED_POINTWISE |= {f"aten.{n}_backward" for n in (
    "softplus", "elu", "hardswish", "hardsigmoid", "hardtanh", "leaky_relu", "mish", "log_sigmoid")}
UNTAGGED_POINTWISE |= {"aten.log_sigmoid_forward"}
#: ``F.logsigmoid`` where it reaches the recorder whole (below autograd, inside DTensor's dispatch:
#: ring attention's merge of its blocks' log-sum-exps, symcost.frontends.context_parallel):
#: log(1 + exp(-|x|)) per element
UNTAGGED_POINTWISE |= {"aten.log_sigmoid"}
TRANSCENDENTAL_OUT["aten.log_sigmoid"] = {"exp": 1, "log": 1}


def classify(op) -> str:
    """The family of an aten overload: model|view|alloc|move|pointwise|reduction|special|comm|unsupported.

    ``comm``: a collective (:data:`COMM_OPS`); it costs no FLOPs and no memory traffic here, its
    bytes over the links are :func:`comm_volume`'s."""
    packet = str(op.overloadpacket)
    if packet in COMM_OPS:
        return "comm"
    if str(op) in RULES or packet in RULES or op.overloadpacket in flop_registry:
        return "model"
    if packet in VIEW_OPS or getattr(op, "is_view", False):
        return "view"
    if packet in ALLOC_OPS:
        return "alloc"
    if packet in SPECIAL_RULES or packet in PER_ELEMENT_OUT or packet in PER_ELEMENT_IN or packet in (
        "aten.nll_loss_forward", "aten.nll_loss_backward", "aten.nll_loss2d_forward", "aten.nll_loss2d_backward"
    ):
        return "special"
    if packet in MOVE_OPS or packet in TRANSFER_OPS:
        return "move"
    tags = getattr(op, "tags", ())
    if torch.Tag.pointwise in tags or packet in UNTAGGED_POINTWISE:
        return "pointwise"
    if torch.Tag.reduction in tags:
        return "reduction"
    return "unsupported"


def cost(v: OpView, family: str | None = None) -> Cost:
    """The :class:`Cost` of one op: :func:`flop_cost` with :func:`transcendentals`.

    Args:
        v: the op's shapes (symbolic or concrete) and arguments.
        family: ``classify(v.op)``, if already known.
    """
    family = family or classify(v.op)
    c = flop_cost(v, family)
    if family not in ("view", "alloc", "unsupported", "comm"):
        c.transcendentals = {k: expand_flops(n) for k, n in transcendentals(v).items() if n != 0}
    return c


def flop_cost(v: OpView, family: str | None = None) -> Cost:
    """The :class:`Cost` of one op.

    Args:
        v: the op's shapes (symbolic or concrete) and arguments.
        family: ``classify(v.op)``, if already known.

    Returns:
        Cost with model FLOPs, all FLOPs and bytes; an unsupported op costs 0 and the caller
        lists it (it is never silently dropped).
    """
    family = family or classify(v.op)
    packet = str(v.op.overloadpacket)
    if family == "model":
        fn = RULES.get(str(v.op)) or RULES.get(packet) or _registry_rule
        return fn(v)
    if family in ("view", "alloc", "comm"):
        return Cost()
    if packet == "fsdp.all_gather_copy_in":  # reads the shards, writes them into the buffer
        return Cost(0, 0, 2 * sum(nbytes(sh, d) for sh, d in zip(v.in_shapes[:-1], v.in_dtypes[:-1])))
    if family == "unsupported":
        return Cost()
    if packet in SPECIAL_RULES:  # pooling, nearest resampling, mse_loss (symcost.graph.rules_special)
        flops_all, moved = SPECIAL_RULES[packet](v)
        return Cost(0, flops_all, moved)
    if packet in TRANSFER_OPS:
        return Cost(0, 0, nbytes(v.out_shapes[0], v.out_dtypes[0]))
    if packet in PARTIAL_WRITES:
        return Cost(0, 0, sum(partial_write_bytes(v)))
    traffic = _traffic(v, skip_first_input=packet in OVERWRITE_OPS or packet in LIKE_RANDOM_OPS)
    if family == "move":
        return Cost(0, 0, traffic)
    if family == "pointwise":
        return Cost(0, numel(v.out_shapes[0]) if v.out_shapes else 0, traffic)
    if family == "reduction":
        return Cost(0, numel(v.in_shapes[0]), traffic)
    # special
    if packet in PER_ELEMENT_OUT:
        return Cost(0, PER_ELEMENT_OUT[packet] * numel(v.out_shapes[0]), traffic)
    if packet in PER_ELEMENT_IN:
        return Cost(0, PER_ELEMENT_IN[packet] * numel(v.in_shapes[0]), traffic)
    if packet.startswith("aten.nll_loss"):
        target = v.in_shapes[2] if packet.endswith("backward") else v.in_shapes[1]
        return Cost(0, numel(target), traffic)
    raise AssertionError(f"no cost for family {family} of {packet}")


def expand_flops(x):
    """Expand a sympy result (identity on ints)."""
    return sympy.expand(x) if isinstance(x, sympy.Basic) else x
