"""Stage 7, rendering: what the passes return, as text (rich tables), JSON and plots.

``report`` (the report, units, the JSON contract), ``memory`` (the memory section), ``roofline``
(the roofline tables), ``plots`` (matplotlib). Computes no cost.
"""
