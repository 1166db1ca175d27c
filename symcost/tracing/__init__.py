"""Stage 2, tracing: one training step recorded at probe sizes, and sizes fitted as polynomials.

``record`` (the step under FakeTensorMode and a TorchDispatchMode: ops, saved tensors, storage
events), ``fit`` (probe planning and polynomial fitting in the canonical symbols), ``regime``
(what makes a regime), ``modules`` (module names folded over the L blocks), ``poly`` (exact
polynomials as data), ``schedule`` (the storage schedule, fitted and folded over L). Imports only
frontends.
"""
