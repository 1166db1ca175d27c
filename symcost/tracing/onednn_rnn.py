"""The bytes of oneDNN's RNN workspace, which an LSTM on the CPU saves for backward.

``nn.LSTM`` on CPU tensors runs ``aten.mkldnn_rnn_layer`` (one call per layer and direction),
which returns oneDNN's training workspace as a uint8 tensor that autograd saves. PyTorch's meta
kernel (``torch/_meta_registrations.py``) returns an empty workspace, so a step recorded on fake
tensors saw 0 bytes where a real step saves the gates and states of every time step: an LSTM's
activations were 84% short. The recorder (:mod:`symcost.tracing.recorder`) gives the fake
workspace the size :func:`workspace_bytes` computes.

Source: oneDNN ``src/cpu/rnn/rnn_utils.hpp`` (``init_conf``: the leading dimensions;
``set_workspace_sizes``: each region's size) and ``src/cpu/rnn/rnn_utils.cpp`` (``get_good_ld``,
``set_offsets``: the regions page-aligned one after another). Checked against the real kernel's
workspace at random sizes on the oneDNN that PyTorch 2.13 bundles (v3.12;
tests/test_foreign_models.py): the workspace holds seven regions, each rounded up to a 4096-byte
page, for one layer and one direction (n_layer = n_dir = 1), ``T`` time steps of ``mb``
sequences, input width ``slc`` and hidden width ``dhc``:

* gates: T·mb·ld(4·dhc) · 4 bytes (fp32 gates);
* the cell's hidden output: T·mb·ld(dhc) · s;
* the layer states and the iteration states: 2·(T + 1)·mb·ld(max(slc, dhc)) · s each;
* the cell states: 2·(T + 1)·mb·dhc · 4;
* the diff states: 2·(T + 1)·mb·ld(max(slc, dhc)) · 4;
* the diff cell states: 2·(T + 1)·mb·dhc · 4;

where ``s`` is the states' element size and ``ld(n)`` rounds n up to 64 bytes' worth of elements,
adding 64 bytes more where the result is a multiple of 256 elements (oneDNN's
``get_good_ld``: 64-byte aligned rows that avoid 4K aliasing). These are no polynomial in the
sizes (the pages and the rounding), so a trace whose probes are real fits them only within a
regime (see docs/memory.md). In bf16 the regions hold other element sizes (:data:`REGION_BYTES`,
measured on the real kernel).
"""
from __future__ import annotations

PAGE = 4096


def good_ld(n: int, size: int) -> int:
    """oneDNN's ``get_good_ld(n, size)``: n rounded up to a multiple of 64 / size elements, plus
    64 / size more where that is a multiple of 256."""
    step = 64 // size
    ld = -(-n // step) * step
    return ld + step if ld % 256 == 0 else ld


def _page(n: int) -> int:
    return -(-n // PAGE) * PAGE


#: bytes per element of the seven regions (gates, hidden output, layer states, iteration states,
#: cell states, diff states, diff cell states) by the input's dtype: fp32 everywhere; for bf16
#: (``torch.autocast("cpu", dtype=torch.bfloat16)``, the default bf16-mixed policy) as the real
#: kernel's workspace measures at random sizes (tests/test_foreign_models.py)
REGION_BYTES = {"float32": (4, 4, 4, 4, 4, 4, 4), "bfloat16": (2, 2, 4, 4, 2, 2, 4)}


def workspace_bytes(steps: int, batch: int, input_size: int, hidden: int, state_size: int = 4,
                    dtype: str = "float32") -> int:
    """Bytes of the training workspace ``aten.mkldnn_rnn_layer`` returns for one LSTM layer in
    one direction: ``steps`` time steps (T) of ``batch`` sequences (mb), input width
    ``input_size`` (slc), hidden width ``hidden`` (dhc), states of ``state_size`` bytes per
    element (4: fp32). See the module docstring for the regions and their source.

    Raises:
        ValueError: a size below 1.
    """
    if min(steps, batch, input_size, hidden, state_size) < 1:
        raise ValueError("LSTM workspace sizes must be positive")
    t, mb, slc, dhc = steps, batch, input_size, hidden
    g, h, sl, si, c, d, dc = REGION_BYTES[dtype] if dtype != "float32" else (4, state_size, state_size, state_size, 4, 4, 4)
    states = 2 * (t + 1) * mb
    regions = (
        t * mb * good_ld(4 * dhc, g) * g,  # gates
        t * mb * good_ld(dhc, h) * h,  # hidden output of each cell
        states * good_ld(max(slc, dhc), sl) * sl,  # layer states
        states * good_ld(max(slc, dhc), si) * si,  # iteration states
        states * dhc * c,  # cell states
        states * good_ld(max(slc, dhc), d) * d,  # diff states
        states * dhc * dc,  # diff cell states
    )
    return sum(_page(r) for r in regions)


def lstm_workspace(args, kwargs) -> int | None:
    """The workspace bytes of an ``aten.mkldnn_rnn_layer.default`` call from its arguments
    (``input, w0, w1, w2, w3, hx, cx, reverse, batch_sizes, mode, hidden_size, num_layers,
    has_biases, bidirectional, batch_first, train``), or None where it keeps no workspace
    (inference, ``train=False``), is no LSTM (mode 2, oneDNN's vanilla LSTM) or its input
    is neither fp32 nor bf16 (the precisions checked against the real kernel)."""
    import torch

    names = ("input", "w0", "w1", "w2", "w3", "hx", "cx", "reverse", "batch_sizes", "mode", "hidden_size",
             "num_layers", "has_biases", "bidirectional", "batch_first", "train")
    a = dict(zip(names, args))
    a.update(kwargs or {})
    x = a["input"]
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(x.dtype)
    if not a.get("train") or a.get("mode") != 2 or dtype is None:
        return None
    # (time-major whatever ``batch_first`` says: PyTorch's mkldnn_rnn transposes a batch-first
    # input before each layer and passes the flag on)
    return workspace_bytes(int(x.shape[0]), int(x.shape[1]), int(x.shape[-1]), int(a["hidden_size"]), dtype=dtype)
