"""Built-in models of symcost (``symcost.frontends.builtin``), plain PyTorch, one module per model.

Each module has ``spec() -> symcost.frontends.models.ModelSpec``; ``symcost.frontends.models.BUILTINS`` maps the
user-facing names (``cs336-lm``, ``gpt2``, ``mlp``, ``megatron-gpt``) to these modules.
"""
