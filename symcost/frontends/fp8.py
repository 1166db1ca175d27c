"""FP8 training as torchao's float8 recipes run it (``--fp8 tensorwise|rowwise``; docs/parallel.md
§0.3, docs/memory.md "FP8 training").

The model's ``nn.Linear`` modules are swapped for torchao's ``Float8Linear``
(``torchao.float8.convert_to_float8_training`` with ``Float8LinearConfig.from_recipe_name``), as
torchtitan's float8 model converter does before any parallelism is applied
(torchtitan/components/quantization/float8.py ``Float8LinearConverter.convert``; the converters run
when the model is built, before ``parallelize_llama``'s TP, AC and FSDP2). Each converted linear
then casts its input, its weight and, in the backward, the output gradient to float8 with
dynamic amax scales (tensorwise: one fp32 scale per tensor; rowwise: one per row, rounded to a
power of 2) and multiplies with ``torch._scaled_mm``; what autograd saves for the backward is the
high-precision input (torchao's ``matmul_with_hp_or_float8_args`` saves ``input_hp`` and recasts
it). Under FSDP2, ``--fp8-all-gather`` (torchao's ``enable_fsdp_float8_all_gather``, tensorwise
only: torchtitan refuses it with a named recipe) casts each weight shard to float8 before the
all-gather, which then moves 1 byte per element, and all-reduces the weights' amax over the
data-parallel group.

Which linears are converted: torchtitan's ``module_filter_fn`` (a linear whose in or out features
are not multiples of 16 is skipped: the fp8 tensor cores need it) with the output head filtered
(torchtitan's float8 configs give ``filter_fqns = ["output"]``): symcost converts the linears inside
the model's blocks (the block list, symbol L) and leaves every linear outside them, the head
among them, in the training precision (:func:`fp8_filter`).

torchao is an optional dependency (``pip install 'symcost[fp8]'``); torch is imported only inside
the functions.
"""
from __future__ import annotations

from symcost.errors import SymcostError

#: the recipes of ``--fp8`` (torchao's ``Float8LinearRecipeName`` values) -> one line on each
RECIPES = {
    "tensorwise": "one fp32 scale per tensor (input, weight, output gradient), fast accumulation in the "
                  "forward matmul; the recipe whose FSDP all-gather may run in fp8",
    "rowwise": "one scale per row of each operand, rounded to a power of 2; the output gradient cast to "
               "e4m3 (torchao's Float8LinearRecipeName.ROWWISE)",
    "rowwise_with_gw_hp": "rowwise, with the weight gradient's matmul kept in high precision "
                          "(torchao's ROWWISE_WITH_GW_HP)",
}

#: the fp8 tensor cores' alignment (torchtitan's module_filter_fn): both feature counts multiples of it
ALIGN = 16


def check_recipe(recipe: str, all_gather: bool = False, shard: str | None = None) -> str:
    """``recipe`` if it is one of :data:`RECIPES` and ``all_gather`` is possible with it.

    Raises:
        SymcostError: an unknown recipe; ``all_gather`` (torchao's
            ``enable_fsdp_float8_all_gather``) with a recipe other than ``tensorwise`` (torchtitan
            asserts the same) or without FSDP2 (``shard`` not fsdp, zero3 or zero2).
    """
    if recipe not in RECIPES:
        raise SymcostError(f"unknown --fp8 recipe {recipe!r}; accepted: {', '.join(RECIPES)} (torchao's "
                           "Float8LinearRecipeName)")
    if all_gather and recipe != "tensorwise":
        raise SymcostError(f"--fp8-all-gather is torchao's enable_fsdp_float8_all_gather, for the tensorwise recipe "
                           f"only (torchtitan refuses it with a named recipe); --fp8 {recipe} all-gathers in the "
                           "parameter dtype")
    if all_gather and shard not in ("fsdp", "zero3", "zero2"):
        raise SymcostError("--fp8-all-gather casts FSDP2's weight shards to fp8 before the all-gather: give --dp N "
                           "--shard fsdp, zero3 or zero2" + (f" (not {shard})" if shard else ""))
    return recipe


#: the sizes linear feature counts are made of (d_model = H·D or M, F, the key/value width K·D,
#: expert widths): probes keep the request's residue of D, F and M mod :data:`ALIGN`
ALIGNED_SYMBOLS = ("D", "F", "M")


def fp8_spec(spec):
    """The spec of ``spec`` trained with FP8: which linears torchao converts depends on their
    features being multiples of :data:`ALIGN` (:func:`fp8_filter`), so the fit's probes keep the
    request's residue mod 16 of D, F and M (``moduli``), and the formulas hold for sizes in that
    class (with D a multiple of 16, every H·D and K·D is one). Where D is not, H·D's alignment
    may change with H from probe to probe, and a size no polynomial fits is pinned (the
    conventions' regimes)."""
    import dataclasses
    import math

    moduli = dict(spec.moduli)
    for s in ALIGNED_SYMBOLS:
        if s in spec.symbols:
            moduli[s] = math.lcm(moduli.get(s, 1), ALIGN)
    return dataclasses.replace(spec, moduli=moduli)


def torchao():
    """The ``torchao.float8`` module.

    Raises:
        SymcostError: torchao is not installed (one line: how to install it).
    """
    try:
        import torchao.float8 as f8
    except ImportError as e:
        raise SymcostError("--fp8 runs torchao's float8 training, which is not installed: "
                           "pip install 'symcost[fp8]' (or pip install torchao)") from e
    return f8


def fp8_config(recipe: str, all_gather: bool = False):
    """torchao's ``Float8LinearConfig`` of ``recipe`` (:data:`RECIPES`): the recipe's own
    (``from_recipe_name``), with ``enable_fsdp_float8_all_gather=all_gather`` for tensorwise (the
    tensorwise recipe is torchao's default config, which torchtitan builds as
    ``Float8LinearConfig(enable_fsdp_float8_all_gather=...)``).

    Raises:
        SymcostError: as :func:`check_recipe`, or torchao missing (:func:`torchao`).
    """
    check_recipe(recipe, all_gather, "fsdp" if all_gather else None)
    f8 = torchao()
    if recipe == "tensorwise":
        return f8.Float8LinearConfig(enable_fsdp_float8_all_gather=bool(all_gather))
    return f8.Float8LinearConfig.from_recipe_name(recipe)


def fp8_filter(layers: str | None):
    """torchtitan's module filter for a model whose blocks are ``layers`` (a dotted path of the
    block list, or None): ``filter(module, fqn) -> bool`` is True for an ``nn.Linear`` whose
    ``in_features`` and ``out_features`` are multiples of :data:`ALIGN` and that sits inside the
    blocks (``fqn`` under ``layers``); without a block list, every aligned linear but the last one
    registered (the output head)."""
    def keep(module, fqn: str) -> bool:
        if module.in_features % ALIGN or module.out_features % ALIGN:
            return False
        if layers:
            return fqn.startswith(layers + ".")
        return fqn != keep.head

    keep.head = None
    return keep


def convert(model, recipe: str, all_gather: bool = False, layers: str | None = None) -> int:
    """Swap ``model``'s linears for torchao's ``Float8Linear`` in place
    (``convert_to_float8_training(model, config=fp8_config(recipe, all_gather),
    module_filter_fn=fp8_filter(layers))``), on the meta device or any other. Returns how many
    linears were converted.

    Raises:
        SymcostError: torchao missing; a bad recipe (:func:`check_recipe`); no linear to convert
            (a model without aligned linears in its blocks: ``--fp8`` would change nothing).
    """
    from torch import nn

    f8 = torchao()
    config = fp8_config(recipe, all_gather)
    keep = fp8_filter(layers)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    keep.head = linears[-1] if linears else None
    f8.convert_to_float8_training(model, config=config, module_filter_fn=keep)
    from torchao.float8.float8_linear import Float8Linear

    n = sum(isinstance(m, Float8Linear) for m in model.modules())
    for m in model.modules():
        if isinstance(m, Float8Linear):
            m.forward = _autocast_forward(m)
    if not n and not linears:
        raise SymcostError(f"--fp8 {recipe}: torchao converts torch.nn.Linear modules and the model has none (its "
                           "linear layers are its own modules), so nothing would run in fp8")
    if not n:
        raise SymcostError(f"--fp8 {recipe}: no nn.Linear of the model's blocks has in and out features that are "
                           f"multiples of {ALIGN} (torchtitan's filter), so none would run in fp8")
    return n


def float8_tp_styles(model, styles: dict) -> dict:
    """The tensor-parallel plan ``styles`` ({module name: ParallelStyle}) as torchtitan applies it
    under the tensorwise recipe (``enable_float8_tensorwise_tp``; torchtitan/models/llama3/infra/
    parallelize.py ``apply_tp``): a ``ColwiseParallel`` / ``RowwiseParallel`` of a ``Float8Linear``
    becomes torchao's ``Float8ColwiseParallel`` / ``Float8RowwiseParallel`` with the same layouts
    (the input cast to fp8 where the style redistributes it, so the linear gets, and saves, an fp8
    input). Other styles are kept. torchtitan also swaps the attention's and the MLP's
    ``PrepareModuleInput`` for torchao's ``PrepareFloat8ModuleInput`` (the sequence-parallel
    all-gather in fp8); that style hands the whole module an fp8 tensor, which only a module that
    feeds its input straight into its linears takes (megatron-gpt's attention permutes it:
    torchao's float8 tensor refuses), so symcost keeps the plain one: under ``--sp`` the
    all-gather moves the activations in their precision. The rowwise recipes keep the plain plan
    (torchtitan: "for rowwise recipes, we use regular TP").
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    modules = dict(model.named_modules())
    out = {}
    for name, style in styles.items():
        m = modules.get(name)
        if isinstance(m, Float8Linear) and type(style) in (ColwiseParallel, RowwiseParallel):
            cls = Float8ColwiseParallel if type(style) is ColwiseParallel else Float8RowwiseParallel
            style = cls(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                        use_local_output=style.use_local_output)
        out[name] = style
    return out


def _autocast_forward(module):
    """``module.forward`` (a ``Float8Linear``) that first casts its input to the autocast dtype
    where CPU autocast is on, as torchao's forward does under CUDA autocast (its check,
    ``torch.is_autocast_enabled()``, reads CUDA's: float8_linear.py ``Float8Linear.forward``); the
    recorded step runs CPU autocast where the trained one runs CUDA's (``--precision
    bf16-mixed``), so the fp8 casts read the bf16 input as they would on the GPU."""
    import torch

    inner = module.forward

    def forward(input):
        if torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled():
            input = input.to(torch.get_autocast_dtype("cpu"))
        return inner(input)

    return forward


def fp8_tensor_types() -> tuple:
    """torchao's float8 tensor subclasses a recording looks through (the recorder's dispatch mode
    answers ``NotImplemented`` for them, so the subclass runs its ops on plain tensors, which the
    mode records: the casts, ``aten._scaled_mm`` on the fp8 data and its scales), as it does for
    DTensor; () without torchao."""
    try:
        from torchao.float8.float8_training_tensor import Float8TrainingTensor
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    except ImportError:
        return ()
    return Float8TrainingTensor, WeightWithDynamicFloat8CastTensor
