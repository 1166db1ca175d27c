"""The process group a collective's arguments name, as PyTorch resolves it: shared by the rank
scripts that count each group's collective bytes on real gloo ranks (ep_rank.py, cp_rank.py,
tp_rank.py, pp_ep_rank.py)."""
from __future__ import annotations


def process_group(args):
    """The ``ProcessGroup`` of a collective from its arguments: a group name (the
    ``_c10d_functional`` ops take one, resolved by ``_resolve_process_group``) or a boxed
    ``ProcessGroup`` (the ``c10d`` ops'), the first that resolves.

    Raises:
        AssertionError: no argument names a process group.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    for a in args:
        if isinstance(a, str):
            try:
                return _resolve_process_group(a)
            except (RuntimeError, ValueError, KeyError):
                continue
        if isinstance(a, torch.ScriptObject) and a._type().qualified_name().endswith(".ProcessGroup"):
            return dist.ProcessGroup.unbox(a)
    raise AssertionError("a collective without a process group")
