"""Stage 1, frontends: what the user hands symcost, as a :class:`~symcost.frontends.spec.ModelSpec`.

``spec`` (the spec, its symbols and size constraints; torch-free), ``precision`` (the precision
names), ``models`` (resolving a name: built-in, ``hf:``, ``config.json``, ``file.py:factory``),
``hf`` (transformers architectures on the meta device, symbols bound to config fields), ``moe``
(the routing model and static-shaped expert dispatch MoE layers are traced with), ``builtin``
(the built-in models). Imports nothing from later stages.
"""
