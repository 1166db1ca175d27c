"""The model specification: what symcost needs to build and run one training step of a model.

Torch-free on import (the types below are annotations only), so the CLI and the trace cache can
read a specification's data without importing torch. ``symcost.frontends.models`` resolves names to specs;
``symcost.frontends.hf`` builds the specs of Hugging Face models.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import operator

from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

#: Canonical symbols and their meaning (shared/conventions.md).
#: where a mesh size goes instead of --set / sizes (a model's symbols never include them)
MESH_HINT = {"DP": "; data parallelism is --dp N", "TP": "; tensor parallelism is --tp N",
             "PP": "; pipeline stages are --pp N", "EP": "; expert parallelism is --ep N",
             "CP": "; context parallelism is --cp N"}

SYMBOL_MEANINGS: dict[str, str] = {
    "B": "micro-batch size (sequences per device per step)",
    "S": "sequence length (tokens per sequence; in an inference step, the new tokens per sequence)",
    "H": "attention heads (query heads)",
    "D": "per-head dimension (d_model = H*D where M is no symbol)",
    "L": "number of transformer layers (blocks)",
    "V": "vocabulary size",
    "F": "feed-forward hidden width",
    "K": "key/value heads (grouped-query attention)",
    "M": "model width d_model (hidden_size), where the config sets it apart from H*D",
    "E": "routed experts of a mixture-of-experts layer",
    "R": "experts each token is routed to (top-k)",
    "T": "tokens already in the KV cache before an inference step (cache length)",
    "DP": "data-parallel size (ranks the batch, and with --shard the model states, are split over)",
    "TP": "tensor-parallel size (ranks each block's heads and hidden units, and with --sp its tokens, are split over)",
    "EP": "expert-parallel size (ranks the routed experts are split over; tokens reach them by all-to-all)",
    "CP": "context-parallel size (ranks each sequence is split over; attention runs as ring attention)",
}
SYMBOL_ORDER = tuple(SYMBOL_MEANINGS)
#: Sizes of the step's inputs rather than of the model (never a config symbol): B, S and, for a
#: step that reads a KV cache, its length T.
INPUT_SYMBOLS = ("B", "S", "T")

#: The steps a :class:`ModelSpec` can run (``ModelSpec.step``): one training step (forward, loss,
#: backward), or one forward-only inference step through the model's own KV cache: ``prefill``
#: (S tokens per sequence into an empty cache) or ``decode`` (S new tokens per sequence, 1 unless
#: set, onto a cache already holding T tokens; S > 1 is a chunk of a chunked prefill).
STEPS = ("train", "prefill", "decode")
#: KV-cache classes an inference step can run with (``transformers``' ``DynamicCache``, grown by
#: concatenation, and ``StaticCache``, preallocated for T + S tokens and written in place).
KV_CACHES = ("dynamic", "static")

Inputs = tuple  # (args tuple, kwargs dict)


#: the operators a constraint's expression may use (``+ - * / // % **``, unary minus)
_EXPR_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


@functools.lru_cache(maxsize=None)
def _expression(text: str) -> tuple[Callable[[Mapping[str, int]], Fraction | None], tuple[str, ...]]:
    """``(evaluate, names)`` of an integer expression over symbol names (``"H*D"``, ``"2*M"``,
    ``"(H*D)/2"``): ``evaluate(values)`` is its exact value (a Fraction: ``/`` is exact division),
    None where a name has no value; ``names`` the symbol names it reads, in order.

    Raises:
        ValueError: anything but integers, names and ``+ - * / // % **`` (no calls, no attributes:
            the text is data, read back from the trace cache, never run as code)."""
    tree = ast.parse(text.strip(), mode="eval").body
    names: list[str] = []

    def compile_(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            v = Fraction(node.value)
            return lambda env: v
        if isinstance(node, ast.Name):
            names.append(node.id)
            return lambda env: env.get(node.id)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            f = compile_(node.operand)
            return lambda env: None if (x := f(env)) is None else -x
        if isinstance(node, ast.BinOp) and type(node.op) in _EXPR_OPS:
            op, f, g = _EXPR_OPS[type(node.op)], compile_(node.left), compile_(node.right)

            def binop(env):
                x, y = f(env), g(env)
                if x is None or y is None:
                    return None
                if op in (operator.truediv, operator.floordiv, operator.mod) and y == 0:
                    return None
                return op(x, y)
            return binop
        raise ValueError(f"{ast.unparse(node)!r} is not an integer, a symbol name or + - * / // % ** of them")

    f = compile_(tree)

    def evaluate(values: Mapping[str, int]) -> Fraction | None:
        env = {n: Fraction(values[n]) for n in names if values.get(n) is not None}
        return None if len(env) < len(set(names)) else f(env)

    return evaluate, tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class Constraint:
    """A limit on symbol values that PyTorch itself imposes (data, so a cached spec keeps it).

    Kinds (``a``, ``b`` are symbol names or integer expressions over them, ``n`` an integer):

    - ``("divides", a, b)``: a divides b (key/value heads divide the query heads);
    - ``("multiple", a, n)``: a is a multiple of n (an even rotary dimension; an expression:
      ``("multiple", "H*D", 2)``, Mamba-2's ``hidden_size * expand == num_heads * head_dim``);
    - ``("max", a, n)``: a <= n (a learned position table of n rows);
    - ``("min", a, n)``: a >= n (a per-head dimension that holds a fixed rotary dimension n).

    An expression (``"H*D"``, ``"2*M"``, ``"H*D/2"``) is Python/sympy syntax over the spec's
    symbol names, integers and ``+ - * / // % **`` (``/`` exact: ``"H*D/2"`` is a multiple of 3
    only where H·D/2 is a whole multiple of 3); it is data (a string), so the trace cache keeps the
    spec and checks a request's sizes with it (``Analysis.bind``) without building the model, and
    the probe plan draws only points that meet it (:meth:`ModelSpec.probe_ok`). Where it leaves
    few values near the request, ``moduli`` keeps its symbols in the request's residue classes
    (``hf:mamba2``'s H and D mod ``expand``).

    ``why`` is the one-line reason shown to the user, with a hint to what is accepted.

    Raises:
        SymcostError: an unknown kind, or an expression that is not one (on construction).
    """

    kind: str
    a: str
    b: str | int
    why: str

    def __post_init__(self):
        from symcost.errors import SymcostError

        if self.kind not in ("divides", "multiple", "max", "min"):
            raise SymcostError(f"unknown constraint kind {self.kind!r}; accepted: divides, multiple, max, min")
        for side in (self.a, self.b):
            if isinstance(side, str):
                try:
                    _expression(side)
                except (SyntaxError, ValueError) as e:
                    raise SymcostError(f"constraint {self.kind} {self.a!r} {self.b!r}: {side!r} is not an integer "
                                       f"expression over symbol names ({e})") from None

    @property
    def symbols(self) -> tuple[str, ...]:
        """The symbol names the constraint reads (``("H", "D")`` for ``("multiple", "H*D", 2)``)."""
        return tuple(dict.fromkeys(n for side in (self.a, self.b) if isinstance(side, str)
                                   for n in _expression(side)[1]))

    def violated(self, values: Mapping[str, int]) -> str | None:
        """The reason if ``values`` break this constraint, else None (missing symbols pass)."""
        x = _expression(self.a)[0](values)
        y = _expression(self.b)[0](values) if isinstance(self.b, str) else self.b
        if x is None or y is None:
            return None
        whole = lambda q: q.denominator == 1  # noqa: E731 (x, y are Fractions: "/" is exact)
        bad = {
            "divides": lambda: x == 0 or not whole(Fraction(y) / x),
            "multiple": lambda: y == 0 or not whole(Fraction(x) / y),
            "max": lambda: x > y,
            "min": lambda: x < y,
        }[self.kind]()
        if not bad:
            return None
        got = ", ".join(f"{n}={values[n]}" for n in self.symbols)
        return f"{self.why} (got {got})"


def check_constraints(constraints, values: Mapping[str, int]) -> str | None:
    """The first violated :class:`Constraint`'s reason, or None; also rejects non-positive values."""
    for k, v in values.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            return f"{k} must be a positive integer (got {v!r})"
    for c in constraints:
        why = c.violated(values)
        if why:
            return why
    return None


def ordered(symbols) -> tuple[str, ...]:
    """``symbols`` in canonical order (:data:`SYMBOL_ORDER`), then a model's own sizes (any other
    name: ``C``, ``IMG``, ``L_enc``) in the order given. Torch-free."""
    symbols = tuple(dict.fromkeys(symbols))
    return tuple(s for s in SYMBOL_ORDER if s in symbols) + tuple(s for s in symbols if s not in SYMBOL_MEANINGS)


def request_facts(values: Mapping[str, int], symbols) -> dict:
    """The facts of a request that choose its regime (shared/conventions.md, "Regimes").

    ``ones``: symbols set to 1 (always their own regime: PyTorch turns copies into views there);
    ``equal``: pairs of config symbols (not B, S, L) with equal values (K = H is multi-head
    attention, its own ops). The tracer decides, by probing, which equal pairs really are a regime
    (tied) and which are a coincidence; the trace cache matches a request to a traced regime by
    these facts. Torch-free.
    """
    # (canonical symbols in their order, a model's own sizes by name: a pair's orientation must not
    # depend on the order a list of symbols came in, or a cached entry's facts would not match)
    rank = {s: i for i, s in enumerate(SYMBOL_ORDER)}
    syms = sorted((s for s in dict.fromkeys(symbols) if values.get(s) is not None),
                  key=lambda s: (rank.get(s, len(rank)), s))
    ones = sorted(s for s in syms if s != "L" and values[s] == 1)
    cfg = [s for s in syms if s not in INPUT_SYMBOLS and s not in ("L", "DP") and values[s] != 1]
    equal = sorted((a, b) for i, a in enumerate(cfg) for b in cfg[i + 1:] if values[a] == values[b])
    return {"ones": ones, "equal": [list(p) for p in equal]}


@contextlib.contextmanager
def model_stdout():
    """Run model code with its prints sent to stderr: symcost's stdout is its own output (the
    ``--json`` object, the report), and a model that prints while it is built or run (nanoGPT
    prints its parameter count in ``__init__``) would otherwise corrupt it. Torch-free.

    Wraps whatever Python writes to ``sys.stdout`` (``print``); C code writing to file
    descriptor 1 directly is not redirected."""
    import sys

    with contextlib.redirect_stdout(sys.stderr):
        yield


@contextlib.contextmanager
def _skip_init():
    """``torch.nn.init``'s in-place initialisers (``normal_``, ``kaiming_uniform_``, ...) made to
    return their tensor untouched, then restored."""
    import torch

    init = torch.nn.init
    names = [n for n in dir(init) if n.endswith("_") and not n.startswith("_") and callable(getattr(init, n))]
    saved = {n: getattr(init, n) for n in names}
    try:
        for n in names:
            setattr(init, n, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for n, f in saved.items():
            setattr(init, n, f)


@dataclass
class ModelSpec:
    """How to build and run one training step of a model for given symbol values.

    Attributes:
        name: the name the user typed (``cs336-lm``, ``hf:llama``, ``file.py:factory``).
        symbols: config symbols the model binds: the conventions' (``H``, ``D``, ``L``, ``V``,
            ``F``, ``K``, ``M``, ...: :data:`SYMBOL_MEANINGS`) and the model's own sizes under any
            other name (``C``, ``IMG``, ``N_state``, ``L_enc``: a letter, then letters, digits or
            ``_``; not N nor a mesh size), which ``--set``, the JSON and the formulas then use.
        defaults: default value of every config symbol (and of B, S) used when the user sets none.
        pin: symbol -> why, for a size the model's formulas cannot follow as polynomials the fit
            finds (a ViT's image side: its (IMG/P)^2 + 1 tokens enter the attention scores'
            storage to the 4th power): pinned at the requested value from the start, so the fit
            of every other symbol goes on (else the failing signatures pin all they depend on).
        meanings: symbol -> what it counts, for the report and the JSON (``{"IMG": "image side
            (pixels)"}``); an own size without one is "a size of the model". May also restate a
            canonical symbol's meaning for this model (an image model's S).
        build: ``build(values) -> "nn.Module"`` for a mapping symbol -> int. Called under
            ``torch.device("meta")``; it must not read weights from anywhere.
        make_inputs: ``make_inputs(values, device) -> (args, kwargs)`` for one micro-batch of
            ``values["B"]`` sequences of ``values["S"]`` tokens.
        loss: ``loss(output, (args, kwargs)) -> scalar Tensor`` whose ``backward()`` is the
            training step's backward.
        check: ``check(values) -> str | None``: why these values are invalid (e.g. "K must
            divide H"), or None. Leave it out to check ``constraints`` (prefer constraints:
            they are data, so a cached trace can check sizes without building the model).
        constraints: the :class:`Constraint` list that PyTorch imposes on the values.
        tied: symbols that always equal another in this model (follower -> leader), so probes
            keep them equal and formulas use the leader. ``symcost.trace`` adds the ties of a
            request's regime (K = H where that changes the ops) to the spec it returns.
        follows: symbol -> symbol whose value it takes when the user does not set it (a config
            that leaves ``num_key_value_heads`` unset means K = H: ``--set H=16`` then asks for
            K = 16); unlike ``tied`` it can be set on its own.
        moduli: symbol -> m where the model's sizes are polynomial in that symbol only within a
            residue class mod m (a partial rotary dimension ``int(D*f)``): probes then keep the
            request's residue, and the formulas hold for values in that class.
        pads: symbol -> m where the model pads that size up to whole chunks of m, a config
            constant (Mamba-2's chunked scan: c·⌈S/c⌉ positions in ⌈S/c⌉ chunks). A request below
            one chunk is the regime 2 <= S < m (one padded chunk of constant length m: the sizes
            are polynomials in S there, probed at any value in it); a request of m is one whole
            chunk (no padding), pinned; a larger one is S's residue class mod m from its first
            value of two chunks on (as ``moduli``). ``Analysis.bounds`` records the range.
        layers: dotted path of the ``nn.ModuleList`` holding the L repeated blocks (``None``
            lets the tracer find it).
        extra: free-form facts for the report (e.g. the config class).
        probe_check: ``probe_check(values) -> str | None``: an extra condition on the *probe*
            sizes only (never on a request), where a model's traced sizes are exact polynomials
            only at some points: an MoE layer under a routing model needs an integer number of
            token slots per expert, c·B·S·R/E (symcost.frontends.moe). Formulas fitted there answer any
            size.
        record_context: ``record_context() -> context manager`` entered while the step is recorded
            on fake tensors, where a library decides differently on fake tensors than on real ones
            (``hf:`` models: :func:`symcost.frontends.hf.unpacked_masks`). Code, not data: a spec
            read back from the trace cache has none (it records nothing).
        lead_blocks: n >= 2 where the first n of the L blocks are of another kind than the rest, n
            a config constant (DeepSeek-V3's ``first_k_dense_replace = 3`` dense blocks before the
            MoE blocks): probes are recorded with L = n + 2 (n + 3 for the checks), block 0 stands
            for the n leading blocks and block n for the L - n others. A request with L <= n is
            all leading blocks, a regime of its own: the trace pins L there. 0: no such blocks (a
            single special first block, n = 1, is found by the tracer on its own).
        step: which step :func:`symcost.tracing.record.record` runs, one of :data:`STEPS`
            (``"train"`` unless made by :meth:`for_step`).
        kv_cache: the KV-cache class of an inference step, one of :data:`KV_CACHES`.
        infer: ``infer(model, values, device, step, kv_cache) -> (args, kwargs, kv_layers)`` for a
            model with a KV cache (``hf:`` models: :func:`symcost.frontends.hf.infer`): creates the
            model's own cache, fills it with ``values["T"]`` tokens per sequence for a decode step
            (that forward is not the step), and returns the step's call ``model(*args,
            **kwargs)`` (``values["S"]`` new tokens per sequence through the cache) and
            ``kv_layers()``, the tensors the cache holds per layer (called after the step). None:
            the model has no KV cache (training steps only).
    """

    name: str
    symbols: tuple[str, ...]
    defaults: dict[str, int]
    build: Callable[[Mapping[str, int]], "nn.Module"]
    make_inputs: Callable[[Mapping[str, int], "torch.device"], Inputs]
    loss: Callable[[Any, Inputs], "torch.Tensor"]
    check: Callable[[Mapping[str, int]], str | None] | None = None
    constraints: tuple[Constraint, ...] = ()
    tied: dict[str, str] = field(default_factory=dict)
    moduli: dict[str, int] = field(default_factory=dict)
    pads: dict[str, int] = field(default_factory=dict)
    follows: dict[str, str] = field(default_factory=dict)
    layers: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    probe_check: Callable[[Mapping[str, int]], str | None] | None = None
    record_context: Callable[[], Any] | None = None
    lead_blocks: int = 0
    step: str = "train"
    kv_cache: str = "dynamic"
    infer: Callable[..., tuple] | None = None
    meanings: dict[str, str] = field(default_factory=dict)
    pin: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        if self.check is None:
            self.check = lambda values: check_constraints(self.constraints, values)

    def values(self, sizes: Mapping[str, int], inputs: bool = True) -> dict[str, int]:
        """The requested values: the defaults (without B and S unless ``inputs``), ``sizes`` on
        top, then followers not in ``sizes`` and tied symbols take their leader's value."""
        out = {k: v for k, v in self.defaults.items() if inputs or k not in INPUT_SYMBOLS}
        out.update(sizes)
        for a, b in self.follows.items():
            if a not in sizes and b in out:
                out[a] = out[b]
        for a, b in self.tied.items():
            if b in out:
                out[a] = out[b]
        return out

    def build_meta(self, values: Mapping[str, int]):
        """The model built at ``values`` on the meta device, with ``torch.nn.init``'s
        initialisers skipped: on meta tensors they write nothing, and they were 95% of a build
        (megatron-gpt: 70 ms → 2.4 ms), which a probe search does about a thousand times
        (transformers' ``no_init_weights`` skips them the same way).

        Raises:
            whatever ``build`` raises."""
        import torch

        with torch.device("meta"), _skip_init(), model_stdout():
            return self.build(values)

    def probe_ok(self, values: Mapping[str, int]) -> str | None:
        """Why ``values`` cannot be a probe: ``check``, then ``probe_check``; None if they can."""
        return self.check(values) or (self.probe_check(values) if self.probe_check else None)

    @property
    def input_symbols(self) -> tuple[str, ...]:
        """The input sizes of this spec's step: B, S, and T for a decode step."""
        return ("B", "S", "T") if self.step == "decode" else ("B", "S")

    @property
    def all_symbols(self) -> tuple[str, ...]:
        """B, S (T for a decode step) and the config symbols, in canonical order (the model's own
        sizes after), without tied ones."""
        return tuple(s for s in ordered(self.input_symbols + tuple(self.symbols)) if s not in self.tied)

    @property
    def own_symbols(self) -> tuple[str, ...]:
        """The model's own sizes: its symbols outside the conventions' alphabet, in order."""
        return tuple(s for s in self.symbols if s not in SYMBOL_MEANINGS)

    def meaning(self, symbol: str) -> str:
        """What ``symbol`` counts in this model: :attr:`meanings` (or ``extra["meanings"]``), else
        the conventions' meaning, else "a size of the model"."""
        own = {**dict(self.extra.get("meanings") or {}), **self.meanings}
        return str(own.get(symbol) or SYMBOL_MEANINGS.get(symbol) or f"a size of {self.name} (declared by the model)")

    def for_step(self, step: str, kv_cache: str = "dynamic") -> "ModelSpec":
        """This model's spec for ``step`` (:data:`STEPS`) with the KV-cache class ``kv_cache``
        (:data:`KV_CACHES`; inference steps only).

        A ``decode`` spec has the input symbol T (tokens in the cache before the step) with the
        default ``S - 1`` of the training default (a cache one token short of the default
        context) and S = 1 new token per sequence by default.

        Raises:
            SymcostError: an unknown step or cache class, or an inference step of a model without
                a KV cache (``infer`` is None: the built-in models).
        """
        import dataclasses

        from symcost.errors import SymcostError

        if step not in STEPS:
            raise SymcostError(f"unknown step {step!r}; accepted: {', '.join(STEPS)}")
        if kv_cache not in KV_CACHES:
            raise SymcostError(f"unknown KV cache {kv_cache!r}; accepted: {', '.join(KV_CACHES)}")
        if step == self.step and kv_cache == self.kv_cache:
            return self
        if step != "train" and self.infer is None:
            raise SymcostError(f"{self.name} has no KV cache (its forward takes no past keys and values), so "
                               f"it has no {step} step; inference steps need an hf: model or config.json")
        defaults = {k: v for k, v in self.defaults.items() if k != "T"}
        if step == "decode":
            defaults["T"] = max(1, defaults.get("S", 2048) - 1)
            defaults["S"] = 1
        return dataclasses.replace(self, step=step, kv_cache=kv_cache, defaults=defaults)




#: Built-in model names -> their module under ``symcost.frontends.builtin`` (``symcost.frontends.models.resolve``
#: imports it); here, torch-free, so a name can be checked before torch is imported.
BUILTINS: dict[str, str] = {
    "cs336-lm": "cs336_lm",
    "gpt2": "gpt2",
    "mlp": "mlp",
    "megatron-gpt": "megatron_gpt",
    "moe": "moe",
}

#: What a model name may be, as the error line lists it.
ACCEPTED_MODELS = ("hf:MODEL_TYPE (e.g. hf:llama), hf:ORG/NAME (local Hugging Face cache), tv:NAME (torchvision), "
                   "timm:NAME, diffusers:CLASS (e.g. diffusers:UNet2DModel), path/to/config.json (transformers' or "
                   "diffusers') or path/to/file.py:factory")


def check_model_name(model: str) -> None:
    """Reject a model name that no loader accepts, without importing torch or transformers (the
    CLI calls it before anything heavy, so a typo answers at once).

    Accepted here: a built-in name (:data:`BUILTINS`), anything ``tv:``/``timm:`` (the package
    checks the name: :mod:`symcost.frontends.zoo`), anything ``hf:`` (the model type is checked
    against ``transformers``' config mapping by :func:`symcost.frontends.hf.spec`, which needs transformers
    and so torch), ``path/to/config.json`` and ``path/to/file.py:factory`` whose file exists.

    Raises:
        SymcostError: an unknown name (the message lists what is accepted) or a missing file.
    """
    import os

    from symcost.errors import SymcostError

    model = str(model)
    if model in BUILTINS or model.startswith(("hf:", "tv:", "timm:", "diffusers:")):
        return
    if model.endswith(".json"):  # (the order of symcost.frontends.models.resolve)
        if not os.path.isfile(model):
            raise SymcostError(f"config file {model!r} not found")
        return
    if ".py:" in model:
        path = model.rpartition(":")[0]
        if not os.path.isfile(path):
            raise SymcostError(f"model file {path!r} not found; expected path/to/file.py:factory")
        return
    raise SymcostError(f"unknown model {model!r}; accepted: {', '.join(BUILTINS)}, {ACCEPTED_MODELS}")
