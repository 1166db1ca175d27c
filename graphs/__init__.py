"""Built-in models of symcost (``symcost.graphs``), plain PyTorch, one module per model.

Each module has ``spec() -> symcost.models.ModelSpec``; ``symcost.models.BUILTINS`` maps the
user-facing names (``cs336-lm``, ``gpt2``, ``mlp``, ``megatron-gpt``) to these modules.
"""
