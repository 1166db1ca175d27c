"""Names of the traced model's modules: which of the L repeated blocks a module path lies in, its
folded name (``layers.{i}``), and the class behind each name. Shared by the tracer, the memory pass
and the report (torch-free on import).
"""
from __future__ import annotations

import re


def _layer_of(module: str, container: str | None) -> int | None:
    """Index of the block a module path lies in (``container`` "" is the root), else None."""
    if container is None:
        return None
    prefix = container + "." if container else ""
    if module.startswith(prefix):
        head = module[len(prefix):].split(".", 1)[0]
        if head.isdigit():
            return int(head)
    return None


def outside_its_block(name: str, stack: list[str], entered: set[str]) -> str:
    """The module name an op is recorded under when the module ``name`` is called in the forward.

    A submodule of a numbered block (``blocks.0.norm1.emb``) called after that block's own call
    has ended, from outside it (diffusers' DiT recomputes its conditioning with
    ``self.transformer_blocks[0].norm1.emb(...)`` after the loop over its blocks), is work of the
    caller, not of block 0: it is named ``blocks[0].norm1.emb``, which lies in no block, so the
    blocks' ops and memory events stay in block order (the fold over L; else "the memory events
    of the blocks interleave"). A block called now is added to ``entered``. Names are kept where
    a block of the same container is running (a module shared by the blocks, Zamba's shared
    attention) and for submodules of a block never called as a module (its ``forward`` called
    directly)."""
    parts = name.split(".")
    if parts[-1].isdigit():
        entered.add(name)
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            block = ".".join(parts[:i + 1])
            if block in entered and block not in stack:
                container = ".".join(parts[:i]) + "."
                running = any(s.startswith(container) and s[len(container):].split(".", 1)[0].isdigit()
                              for s in stack)
                return name if running else ".".join(parts[:i]) + f"[{part}]." + ".".join(parts[i + 1:])
    return name


def module_paths(model) -> dict[int, tuple[str, ...]]:
    """Every path of every module of ``model`` (``named_modules(remove_duplicate=False)``), by the
    module's ``id``, in registration order. A module registered under several paths (torchtune's
    Llama hands one ``Llama3ScaledRoPE`` instance to every block: ``layers.0.attn.pos_embeddings``,
    ``layers.1.attn.pos_embeddings``, ...) has several; ``named_modules`` keeps only the first."""
    out: dict[int, tuple[str, ...]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        out[id(m)] = out.get(id(m), ()) + (name,)
    return out


def called_as(paths: tuple[str, ...], caller: str) -> str | None:
    """The path a module registered under several ``paths`` is called by from the module path
    ``caller`` (the innermost module running): the path that is a child of ``caller``, else the one
    in the same block (the longest common dotted prefix with ``caller``, past a block index); None
    where no path is closer to the caller than the first. So a submodule shared by all blocks is,
    at each call, a submodule of the block that calls it: its ops are that block's, and the blocks
    run the same ops (the fold over L, :func:`symcost.graph.align._layer_roles`)."""
    for p in paths:
        if p.rpartition(".")[0] == caller:
            return p
    cparts = caller.split(".") if caller else []

    def common(p):
        n = 0
        for a, b in zip(p.split("."), cparts):
            if a != b:
                break
            n += 1
        return n

    best = max(paths, key=common)
    return best if common(best) > common(paths[0]) else None


def shared_name(names: list[str]) -> str:
    """The name of a tensor (a buffer) registered under ``names`` in several blocks of one
    container (a rotary cache of a module shared by the blocks): its first name with the first
    block index that differs between the names written ``container[i]`` (``layers[0].attn.
    pos_embeddings.cache``), a name in no block (:func:`_layer_of` is None, as for
    :func:`outside_its_block`), so that it is counted once, not once per block folded over L.
    A name that lies in one block only is returned as is."""
    first = names[0].split(".")
    for i, part in enumerate(first[:-1]):
        if part.isdigit() and any(n.split(".")[:i] == first[:i] and n.split(".")[i] != part
                                  for n in names[1:] if len(n.split(".")) > i):
            return ".".join(first[:i]) + f"[{part}]." + ".".join(first[i + 1:])
    return names[0]


def shared_by_blocks(names: list[str]) -> bool:
    """Whether a parameter registered under ``names`` (``named_parameters(remove_duplicate=False)``)
    is one module's, handed to blocks: several names, one of them inside a block (a dotted part
    that is a block index: ``blocks.0.pos.table.weight`` beside ``pos.table.weight``, the owner
    registering the shared module itself first). Its gradient's accumulation (autograd's sum of
    each block's gradient, then ``AccumulateGrad``) is then no block's (``recorder._label_graph``'s
    ``unlabelled``): else the first block whose graph reaches it would run one more op than the
    others and L would be pinned. A parameter tied outside any block (input and output
    embeddings) is not."""
    return len(names) > 1 and any(part.isdigit() for n in names for part in n.split(".")[:-1])


def _rename_block(path: str, container: str | None, label: str) -> str:
    if container is None:
        return path
    prefix = re.escape(container + ".") if container else ""
    return re.sub(rf"^{prefix}\d+", (container + "." if container else "") + label, path)


def _fold_name(module: str, container: str | None) -> str:
    return _rename_block(module, container, "{i}")


def module_group(module: str, container: str | None, stacks=None) -> str:
    """Row key of the per-module table: one level below each block, top-level parts as is
    (``stacks``: container -> symbol where several stacks fold, ``Analysis.stacks``: one level
    below each block of each stack)."""
    if not module:
        return "(loss / top level)"
    parts = module.split(".")
    for c in sorted(stacks or (), key=len, reverse=True):
        cparts = c.split(".") if c else []
        if parts[:len(cparts)] == cparts and len(parts) > len(cparts):
            return ".".join(parts[: len(cparts) + 2])
    if container is not None:
        cparts = container.split(".") if container else []
        n = len(cparts)
        if parts[:n] == cparts and len(parts) > n:
            return ".".join(parts[: n + 2])
        return ".".join(parts[: max(n, 1)])
    return ".".join(parts[:1])


def module_classes(an) -> dict[str, str]:
    """Class name of every module of the traced model, by its name in the report (blocks of the
    layer container as ``{i}``): the model is built again on the meta device at the first probe's
    sizes (no memory, milliseconds for small probes). Empty if that fails. An analysis read back
    from the trace cache carries them (it cannot build the model)."""
    stored = an.__dict__.get("_stored_module_classes")
    if stored is not None:
        return dict(stored)
    try:
        values = dict(an.recordings[0].values) if an.recordings else dict(an.spec.defaults)
        model = an.spec.build_meta(values)
        c = an.layer_container
        pre = f"{c}." if c else ""
        out = {}
        for name, mod in model.named_modules():
            out.setdefault(name, type(mod).__name__)
            if c is not None and name.startswith(pre) and name[len(pre):].split(".")[0].isdigit():
                rest = name[len(pre):].split(".", 1)
                out.setdefault(pre + "{i}" + (f".{rest[1]}" if len(rest) > 1 else ""), type(mod).__name__)
        return out
    except Exception:  # noqa: BLE001 - names are a nicety; the numbers do not depend on them
        return {}


def _containers(model) -> dict[str, int]:
    """Dotted path -> length of every block container: ``nn.ModuleList``, ``nn.Sequential``, and
    ``nn.ModuleDict`` keyed by the positions "0".."n-1" (torchtitan's ``self.layers[str(layer_id)]``,
    iterated with ``.values()``), whose blocks are named ``layers.0``, ``layers.1``, ... as a list's
    (:func:`symcost.tracing.record.find_layer_container`, :mod:`symcost.tracing.stacks`)."""
    from torch import nn

    return {
        name: len(m) for name, m in model.named_modules()
        if isinstance(m, (nn.ModuleList, nn.Sequential))
        or (isinstance(m, nn.ModuleDict) and list(m.keys()) == [str(i) for i in range(len(m))])
    }
