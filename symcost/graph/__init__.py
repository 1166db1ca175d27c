"""Stage 3, the op graph: the one data structure every pass reads.

``build`` (``trace``: recordings -> :class:`~symcost.graph.analysis.Analysis`), ``analysis`` (the
class: fields, evaluation, export), ``ops`` (:class:`~symcost.graph.ops.SymOp`), ``rules`` (the
cost rule of every aten op: FLOPs, bytes, transcendentals; where to add an op), ``opsets`` (op
families), ``fusion`` (fused bytes per op, from the probe recordings), ``totals``,
``conventions`` and ``serialize`` (the pieces of Analysis), ``cache`` (analyses kept on disk as
JSON). Imports frontends and tracing only.
"""
