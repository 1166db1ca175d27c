"""The layout of a training run: one ``DeviceMesh`` with named dimensions, and the order in which
PyTorch's parallelisms are applied to the model over it (docs/parallel.md, "The layout").

A :class:`Layout` is the one concept every parallel trace goes through. It names the mesh
dimensions the run has, in torchtitan's order (``ParallelDims.build_mesh``:
``pp, dp_replicate, dp_shard, cp, tp``, outermost first, so the TP groups are consecutive ranks
inside a node), and what each dimension does:

=================  ======  ================================================================
mesh dimension     symbol  what runs over it (one rank traced on a fake process group)
=================  ======  ================================================================
``pp``             PP      pipeline stages (:mod:`symcost.frontends.pipeline`: the stage
                           modules of the block list, PyTorch's schedules)
``dp_replicate``   DP      data parallelism with replicated parameters: ``--shard ddp`` and
                           ``zero1`` (``replicate``, PyTorch's DDP on the FSDP2 engine)
``dp_shard``       DP      data parallelism with sharded states: ``--shard fsdp``, ``zero2``,
                           ``zero3`` (``fully_shard``, FSDP2)
``dp_replicate`` ×  DP      HSDP: ``--dp N --dp-replicate R`` with a sharding strategy:
``dp_shard``               ``fully_shard`` over the 2-D mesh ``(R, N/R)``: states sharded over the
                           N/R ranks of ``dp_shard``, replicated over the R of ``dp_replicate``
``tp``             TP      tensor parallelism, with ``sp`` sequence parallelism too
                           (:mod:`symcost.frontends.tensor_parallel`: ``parallelize_module``)
``ep``             EP      expert parallelism: routed experts sharded, tokens dispatched and
                           combined by all-to-all (:mod:`symcost.frontends.expert_parallel`;
                           alone, under FSDP2 over dp_shard × ep, inside pipeline stages)
=================  ======  ================================================================

The sizes of the dimensions are not part of the layout: they are the symbols (DP, TP, PP) of
the formulas, and a request's values (``--dp 8`` is ``DP = 8``) bind them like any other size.
One size is part of the layout: HSDP's replicate degree ``R`` (``replicate``). DP is the whole
data-parallel size, replicate × shard (shared/conventions.md), and R is pinned at the request's
value (the formulas hold for that R and any DP it divides; the shard degree is DP/R): the
collectives of the ``dp_shard`` group run over DP/R ranks, those of ``dp_replicate`` (the
gradient all-reduce of FSDP2's HSDP) over R (:meth:`Layout.group_size`).

Besides the mesh, a layout holds the step techniques that are applied with it: activation
checkpointing (``ac``; torchtitan's ``activation_checkpoint.mode``) and FP8 training (``fp8``,
torchao's float8 recipes, :mod:`symcost.frontends.fp8`), so that each composes with every dimension.

The model is parallelised in torchtitan's order (``parallelize_llama``): its linears converted to
torchao's ``Float8Linear`` first (torchtitan's model converters run before it), then tensor and
sequence parallelism, then activation checkpointing of every block, then the data-parallel engine
per block and at the root (:meth:`Layout.parallelize`); a pipeline splits the model into stages
before any of these (``pipeline_llm``), and each stage module is then parallelised over the
other dimensions (:attr:`Layout.inner`): one traced rank of the composed mesh per stage kind.

Torch is imported only inside the functions that need it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from symcost.errors import SymcostError

#: torchtitan's order of the mesh dimensions (``ParallelDims.build_mesh``), outermost first
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

#: the symbol of each mesh dimension's size (shared/conventions.md: DP is replicate × shard)
DIM_SYMBOL = {"pp": "PP", "dp_replicate": "DP", "dp_shard": "DP", "cp": "CP", "tp": "TP", "ep": "EP"}

#: the flag that sets each symbol on the command line
SYMBOL_FLAG = {"DP": "--dp", "TP": "--tp", "PP": "--pp", "EP": "--ep"}
SYMBOL_FLAG["CP"] = "--cp"

@dataclasses.dataclass(frozen=True)
class Pipeline:
    """The pipeline dimension's schedule: ``schedule`` a name of
    :data:`symcost.frontends.pipeline.SCHEDULES`, ``microbatches`` per step (None: PP),
    ``virtual`` stages per rank, ``split`` the blocks of each stage
    (:func:`symcost.frontends.pipeline.parse_split`: None is the even split)."""

    schedule: str = "1f1b"
    microbatches: int | None = None
    virtual: int = 1
    split: str | tuple | None = None


@dataclasses.dataclass(frozen=True)
class Layout:
    """The parallel layout of one training step: which mesh dimensions it has and what runs
    over each (module docstring). The empty layout is one device.

    Attributes:
        shard: the data-parallel dimension's strategy (a key of
            :data:`symcost.frontends.parallel.SHARDS`: ``ddp``, ``zero1``, ``zero2``, ``zero3``,
            ``fsdp``), or None without data parallelism.
        fsdp_mp: with ``shard``, FSDP2's ``MixedPrecisionPolicy`` as ``(param, reduce)`` dtype
            names (:data:`symcost.frontends.parallel.MP_DTYPES`), or None.
        tp: tensor parallelism over a ``tp`` dimension (the Megatron plan, or the config's).
        sp: with ``tp``, sequence parallelism.
        pipeline: a ``pp`` dimension's schedule, or None.
        ac: activation checkpointing, a key of :data:`symcost.frontends.checkpointing.AC_MODES`
            (``"full"``, ``"selective"``: torchtitan's modes), or None.
        replicate: HSDP's ``dp_replicate`` degree R (torchtitan's
            ``data_parallel_replicate_degree``) with a sharding ``shard`` (``fsdp``, ``zero3``,
            ``zero2``), or None: the data-parallel dimension is then one group.
        offload: with ``shard`` ``fsdp`` or ``zero3``, FSDP2's CPU offload (torchtitan's
            ``training.enable_cpu_offload``: ``fully_shard(..., offload_policy=CPUOffloadPolicy())``;
            :mod:`symcost.frontends.offload`): sharded parameters, their gradients and the
            optimizer state on the host, the optimizer step on the host.
        fp8: FP8 training, a recipe of :data:`symcost.frontends.fp8.RECIPES` (``"tensorwise"``,
            ``"rowwise"``, ``"rowwise_with_gw_hp"``: torchao's ``Float8LinearRecipeName``), or None.
        fp8_all_gather: with ``fp8`` tensorwise and an FSDP2 ``shard``, torchao's
            ``enable_fsdp_float8_all_gather`` (torchtitan's ``enable_fsdp_float8_all_gather``,
            default off): weight shards cast to fp8 before FSDP2's all-gather.
        compile: every block under ``torch.compile`` (torchtitan's ``compile.enable``:
            ``apply_compile`` after TP and AC, before FSDP2; :mod:`symcost.frontends.compile`).
        cp: context parallelism over a ``cp`` dimension (:mod:`symcost.frontends.context_parallel`:
            the sequence split over CP ranks, attention as PyTorch's ring attention).
        cp_rotate: with ``cp``, how the keys and values go round the ring in the forward
            (``set_rotate_method``: ``"allgather"``, PyTorch's and torchtitan's default, or ``"alltoall"``).
        offload_activations: every tensor autograd saves in the forward lives on the host until the
            backward unpacks it, as under ``torch.autograd.graph.save_on_cpu(pin_memory=True)``
            around the forward (``--offload-activations``; :mod:`symcost.frontends.offload`,
            docs/memory.md "Activation offload").
        ep: expert parallelism over an ``ep`` dimension (:mod:`symcost.frontends.expert_parallel`),
            alone or under FSDP2 (``shard`` ``fsdp``, ``zero3``, ``zero2``: :attr:`ep_fsdp`).
        experts_shard: with ``ep`` under FSDP2, the dimension of the experts' local weights
            ``[E/EP, ...]`` FSDP2 shards over DP (0 or 1; torchtitan's rule at the request's sizes,
            :func:`symcost.frontends.expert_parallel.experts_shard_dim`; None: chosen when traced).
        etp: with ``ep`` and ``tp``, expert-tensor parallelism of degree TP (torchtitan's
            ``expert_tensor_parallel_degree`` = ``tensor_parallel_degree``, ``ExpertTensorParallel``;
            docs/parallel.md §14.10): EP·TP ranks, the experts over the 2-D ``(ep, tp)`` mesh, each
            rank's E/EP experts split over TP; False: degree 1 (the EP group over the TP ranks, §14.8).
    """

    shard: str | None = None
    fsdp_mp: tuple[str, str] | None = None
    tp: bool = False
    sp: bool = False
    pipeline: Pipeline | None = None
    ac: str | None = None
    replicate: int | None = None
    offload: bool = False
    fp8: str | None = None
    fp8_all_gather: bool = False
    cp: bool = False
    cp_rotate: str = "allgather"
    compile: bool = False
    ep: bool = False
    offload_activations: bool = False
    experts_shard: int | None = None
    etp: bool = False

    def __post_init__(self):
        from symcost.frontends.layout_rules import check_layout

        check_layout(self)  # (the one-line refusals of what is not modelled; option types normalised)

    # --- what the layout is -------------------------------------------------------------------
    @property
    def dims(self) -> tuple[str, ...]:
        """The mesh dimensions present, in torchtitan's order (:data:`MESH_DIMS`)."""
        from symcost.frontends.parallel import SHARDS

        present = set()
        if self.pipeline is not None:
            present.add("pp")
        if self.shard is not None:
            present.add("dp_shard" if SHARDS[self.shard][0] == "fully_shard" else "dp_replicate")
        if self.hsdp:
            present.add("dp_replicate")
        if self.cp:
            present.add("cp")
        if self.tp:
            present.add("tp")
        if self.ep:  # (the innermost: an EP group is EP consecutive ranks, torchtitan's dp_shard_in_ep)
            present.add("ep")
        return tuple(d for d in MESH_DIMS + ("ep",) if d in present)

    @property
    def symbols(self) -> tuple[str, ...]:
        """The mesh symbols of the formulas (``DP``, ``TP``, ``PP``, ``EP``), in mesh order."""
        return tuple(dict.fromkeys(DIM_SYMBOL[d] for d in self.dims))

    @property
    def traced_dims(self) -> tuple[str, ...]:
        """The dimensions one recorded rank runs on a fake process group (``pp`` is traced as
        stage modules, :mod:`symcost.frontends.pipeline`)."""
        return tuple(d for d in self.dims if d != "pp")

    @property
    def hsdp(self) -> bool:
        """Whether the data-parallel dimension is HSDP's two (``dp_replicate`` × ``dp_shard``)."""
        return self.replicate is not None

    def dim_size(self, dim: str, size_of):
        """The size of mesh dimension ``dim`` (a name of :data:`MESH_DIMS`) where ``size_of(symbol)``
        gives each symbol's size (an int or a sympy symbol): the symbol's, except under HSDP, where
        ``dp_replicate`` is R and ``dp_shard`` DP/R."""
        label = "DP_replicate" if (self.hsdp and dim == "dp_replicate") else DIM_SYMBOL[dim]
        return group_size(label, size_of, self.replicate)

    @property
    def group_labels(self) -> tuple[str, ...]:
        """The labels of the traced process groups collectives are counted by (``comm_bytes(...,
        group=label)``): the mesh symbols, and under HSDP ``"DP_replicate"`` after ``"DP"``."""
        out = []
        for s in self.symbols:
            out.append(s)
            if s == "DP" and self.hsdp:
                out.append("DP_replicate")
        if self.ep_fsdp:
            out.append("DP_expert")
        return tuple(out)

    @property
    def ep_fsdp(self) -> bool:
        """Whether expert parallelism runs under FSDP2 (``--ep N --dp M --shard fsdp|zero3|zero2``,
        docs/parallel.md §14.6): the dense parameters sharded over the flattened ``dp_shard × ep``
        group (label ``"DP"``, DP·EP ranks: torchtitan's ``dp_shard``, from which it borrows the EP
        ranks), each rank's E/EP experts over ``dp_shard`` (label ``"DP_expert"``, DP ranks: the
        ranks holding the same experts, torchtitan's ``efsdp``, formerly ``dp_shard_mod_ep``). With
        ``tp`` (§14.9) the dense group is ``dp_shard × ep_rest``, DP·EP/TP ranks, each holding the
        TP-local shards of its TP rank."""
        return self.ep and self.shard is not None

    @property
    def ep_replicate(self) -> bool:
        """Whether expert parallelism runs under a replicating data-parallel engine (``--ep N --dp M
        --shard ddp|zero1``, docs/parallel.md §14.11): Megatron-LM's DDP (its distributed optimizer
        for ``zero1``) or PyTorch's ``replicate``, the dense gradients reduced over the DP·EP ranks
        (label ``"DP"``: Megatron's data-parallel group), the experts' over the DP ranks holding the
        same E/EP experts (``"DP_expert"``: Megatron's expert-data-parallel group). Every
        :attr:`ep_fsdp` property holds for it too (the groups, their sizes, the mesh)."""
        if not self.ep_fsdp:
            return False
        from symcost.frontends.parallel import SHARDS

        return SHARDS[self.shard][0] == "replicate"

    @property
    def dp_dim(self) -> str | None:
        """The data-parallel mesh dimension of a one-group layout (``dp_shard`` for FSDP2,
        ``dp_replicate`` for DDP/ZeRO-1), or None without data parallelism."""
        return next((d for d in self.dims if d.startswith("dp")), None)

    def group_size(self, label: str, size_of):
        """The ranks of the process group a collective labelled ``label`` runs over (``"DP"``,
        ``"TP"``, ``"PP"``, and under HSDP ``"DP_replicate"``: :meth:`group_labels`), with
        ``size_of`` as :meth:`dim_size`. Under HSDP ``"DP"`` is the ``dp_shard`` group (DP/R); under
        FSDP with ``cp`` the flattened ``dp_shard × cp`` group (DP·CP)."""
        return group_size(label, size_of, self.replicate, cp=self.cp and self.shard is not None, ep=self.ep_fsdp,
                          tp=self.ep_fsdp and self.tp)

    @property
    def ep_tp(self) -> bool:
        """Whether expert parallelism borrows the tensor-parallel ranks (``--ep N --tp M``,
        docs/parallel.md §14.8): EP ranks per stage, TP groups of TP consecutive ones inside them."""
        return self.ep and self.tp

    def mesh_shape(self, size_of) -> tuple[tuple[str, ...], tuple]:
        """``(names, sizes)`` of the fake ``DeviceMesh`` one rank of this layout is recorded on (its
        traced dimensions, ``pp`` aside), ``size_of`` as :meth:`dim_size`: the traced dimensions
        and their sizes, except with :attr:`ep_tp`, where the EP ranks are the mesh ``(ep_rest, tp)`` =
        (EP/TP, TP) and the ``ep`` group its flattening (torchtitan: ``ep`` innermost in its sparse
        mesh, over the ``dp_shard · tp`` ranks of its dense one); under FSDP2 too the mesh is
        ``(dp_shard, ep_rest, tp)`` = (DP, EP/TP, TP), DP·EP ranks (docs/parallel.md §14.9:
        torchtitan's ``dp_shard_mod_ep × dp_shard_in_ep × tp`` with etp = 1)."""
        if self.etp:  # (expert-tensor parallelism: EP·TP ranks, the (ep, tp) mesh, §14.10)
            return ("ep", "tp"), (size_of("EP"), size_of("TP"))
        if self.ep_tp:
            ep, tp = size_of("EP"), size_of("TP")
            rest = ep // tp if isinstance(ep, int) else ep / tp
            if self.shard is not None:
                return (self.dp_dim, "ep_rest", "tp"), (size_of("DP"), rest, tp)
            return ("ep_rest", "tp"), (rest, tp)
        dims = self.traced_dims
        return dims, tuple(int(self.dim_size(d, size_of)) for d in dims)

    def engine_meshes(self, mesh) -> tuple[dict, dict]:
        """``({symbol: DeviceMesh}, {process group name: label})`` of a ``DeviceMesh`` with this
        layout's dimension names (and maybe ``pp``): the meshes :meth:`parallelize` applies each
        engine over (under HSDP, ``DP`` is the 2-D ``(dp_replicate, dp_shard)`` mesh FSDP2 takes),
        and each 1-D group's label: its symbol, and under HSDP ``"DP"`` for ``dp_shard``,
        ``"DP_replicate"`` for ``dp_replicate``."""
        sub, labels = {}, {}
        if self.etp:
            # the TP groups, the EP groups across them (ranks of one TP coordinate), and the 2-D
            # mesh the experts are sharded over (torchtitan's ep × etp, etp = tp; §14.10)
            for d, label in (("tp", "TP"), ("ep", "EP")):
                labels[mesh[d].get_group().group_name] = label
                sub[label] = mesh[d]
            sub["EP_TP"] = mesh["ep", "tp"]
            return sub, labels
        if self.ep_tp:
            # the TP groups, and the EP group over the ranks that hold them (docs/parallel.md §14.8)
            labels[mesh["tp"].get_group().group_name] = "TP"
            sub["TP"] = mesh["tp"]
            flat = mesh["ep_rest", "tp"]._flatten("ep")
            labels[flat.get_group().group_name] = "EP"
            sub["EP"] = flat
            if self.ep_fsdp:
                # under FSDP2 (docs/parallel.md §14.9): the experts over dp_shard (the DP ranks that hold
                # the same E/EP experts, torchtitan's dp_shard_mod_ep / efsdp), the dense parameters over
                # dp_shard × ep_rest flattened (DP·EP/TP ranks: torchtitan's dp_shard, its 2-D mesh with tp)
                dp = self.dp_dim
                labels[mesh[dp].get_group().group_name] = "DP_expert"
                sub["DP_expert"] = mesh[dp]
                dense = mesh[dp, "ep_rest"]._flatten(dp + "_ep")
                labels[dense.get_group().group_name] = "DP"
                sub["DP"] = dense
            return sub, labels
        dims = [d for d in self.traced_dims]
        for d in dims:
            label = "DP_replicate" if (self.hsdp and d == "dp_replicate") else DIM_SYMBOL[d]
            labels[mesh[d].get_group().group_name] = label
            if not (self.hsdp and d.startswith("dp")):
                sub[DIM_SYMBOL[d]] = mesh[d]
        if self.hsdp:
            sub["DP"] = mesh["dp_replicate", "dp_shard"]
        if self.cp and self.shard is not None:
            # FSDP2 over the flattened dp_shard × cp mesh (torchtitan's "dp_shard_cp"): the
            # parameters sharded, the gradients reduced over DP·CP ranks; its group is "DP"'s
            flat = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
            sub["DP"] = flat
            labels[flat.get_group().group_name] = "DP"
        if self.ep_fsdp:
            # torchtitan's two FSDP meshes under EP: the dense parameters over dp_shard × ep
            # flattened (DP·EP ranks, "DP"), the experts over dp_shard (the DP ranks that hold the
            # same E/EP experts, "DP_expert"); the ep dimension the all-to-alls' ("EP")
            # (under DDP / Megatron's distributed optimizer, §14.11, the same two groups over dp_replicate:
            # Megatron's data-parallel group and its expert-data-parallel group)
            dp = self.dp_dim
            labels[mesh[dp].get_group().group_name] = "DP_expert"
            sub["DP_expert"] = mesh[dp]
            flat = mesh[dp, "ep"]._flatten(dp + "_ep")
            sub["DP"] = flat
            labels[flat.get_group().group_name] = "DP"
        return sub, labels

    def __bool__(self) -> bool:
        """False for one device without any step technique (the plain step)."""
        return bool(self.dims) or self.ac is not None or self.fp8 is not None or self.compile or self.offload_activations

    @property
    def tensor_parallel(self) -> str | None:
        """``"tp"``, ``"tp+sp"`` or None: the label of the tensor-parallel dimension."""
        return None if not self.tp else ("tp+sp" if self.sp else "tp")

    @property
    def label(self) -> str | None:
        """The recording's ``parallel`` label: the data-parallel strategy, else the
        tensor-parallel one (:attr:`tensor_parallel`), else ``"ep"`` for expert parallelism
        alone, else None."""
        if self.shard is not None:
            return self.shard
        return self.tensor_parallel or ("ep" if self.ep else None)

    def _pp_words(self) -> str:
        """``1f1b``, ``1f1b, split torchtitan:1,1``, ``1f1b, split 8,9,8,7``."""
        from symcost.frontends.pipeline import split_words

        sp = self.pipeline.split
        return self.pipeline.schedule + (f", split {split_words(sp)}" if sp is not None else "")

    def describe(self, values: Mapping[str, int] | None = None) -> str:
        """``"dp_shard 8 (fsdp) × tp 8 (sp)"``: the mesh in words, sizes where ``values`` has them."""
        parts = []
        for d in self.dims:
            n = (values or {}).get(DIM_SYMBOL[d], DIM_SYMBOL[d])
            if self.hsdp and d.startswith("dp"):
                dp = (values or {}).get("DP")
                n = self.replicate if d == "dp_replicate" else (dp // self.replicate if dp else f"DP/{self.replicate}")
            what = {"dp_replicate": self.shard if not self.hsdp else None, "dp_shard": self.shard,
                    "tp": "sp" if self.sp else None,
                    "cp": f"ring attention, {self.cp_rotate}" if self.cp else None,
                    "pp": self._pp_words() if self.pipeline else None,
                    "ep": ("experts over the TP groups' ranks; dense parameters' FSDP over dp_shard × EP/TP"
                           if self.ep_fsdp and self.ep_tp else
                           "experts; dense gradients over dp_replicate × ep, experts' over dp_replicate"
                           if self.ep_replicate else
                           "experts; dense parameters' FSDP over dp_shard × ep" if self.ep_fsdp else
                           "experts split over tp too (etp = tp)" if self.etp else
                           "experts, over the TP groups' ranks" if self.ep_tp else None)}.get(d)
            parts.append(f"{d} {n}" + (f" ({what})" if what else ""))
        mesh = " × ".join(parts) or "one device"
        return (mesh + (", CPU offload" if self.offload else "")
                + (f", activation checkpointing {self.ac}" if self.ac else "")
                + (f", fp8 {self.fp8}" + (" (fp8 all-gather)" if self.fp8_all_gather else "") if self.fp8 else "")
                + (", compiled blocks" if self.compile else "")
                + (", activations offloaded to the host" if self.offload_activations else ""))

    @property
    def inner(self) -> "Layout | None":
        """The layout within one pipeline stage: this one without its ``pp`` dimension (the data
        and tensor parallelism and the step techniques each stage module gets after the split,
        :mod:`symcost.passes.pipeline`), or None where that is one plain device."""
        inner = dataclasses.replace(self, pipeline=None)
        return inner if inner else None

    # --- serialisation: the spec's ``extra["layout"]`` and the trace cache's options ------------
    def to_dict(self) -> dict:
        """JSON-able form (:meth:`from_dict` reads it)."""
        out: dict[str, Any] = {}
        if self.shard is not None:
            out["shard"] = self.shard
        if self.fsdp_mp is not None:
            out["fsdp_mp"] = list(self.fsdp_mp)
        if self.tp:
            out.update(tp=True, sp=bool(self.sp))
        if self.pipeline is not None:
            out["pipeline"] = {k: list(v) if isinstance(v, tuple) else v
                               for k, v in dataclasses.asdict(self.pipeline).items() if k != "split" or v is not None}
        if self.ac is not None:
            out["ac"] = self.ac
        if self.replicate is not None:
            out["replicate"] = self.replicate
        if self.offload:
            out["offload"] = True
        if self.fp8 is not None:
            out["fp8"] = self.fp8
            if self.fp8_all_gather:
                out["fp8_all_gather"] = True
        if self.compile:
            out["compile"] = True
        if self.ep:
            out["ep"] = True
        if self.experts_shard is not None:
            out["experts_shard"] = self.experts_shard
        if self.etp:
            out["etp"] = True
        if self.offload_activations:
            out["offload_activations"] = True
        if self.cp:
            out.update(cp=True, cp_rotate=self.cp_rotate)
        return out

    @classmethod
    def from_dict(cls, d: Mapping | None) -> "Layout":
        """The layout of :meth:`to_dict`'s output (None or ``{}``: one device)."""
        d = dict(d or {})
        pipe = d.get("pipeline")
        return cls(shard=d.get("shard"), fsdp_mp=tuple(d["fsdp_mp"]) if d.get("fsdp_mp") else None,
                   tp=bool(d.get("tp")), sp=bool(d.get("sp")), pipeline=Pipeline(**{k: tuple(v) if isinstance(v, list) else v
                                                      for k, v in pipe.items()}) if pipe else None,
                   ac=d.get("ac"), replicate=d.get("replicate"), offload=bool(d.get("offload")),
                   fp8=d.get("fp8"), fp8_all_gather=bool(d.get("fp8_all_gather")), compile=bool(d.get("compile")),
                   ep=bool(d.get("ep")), offload_activations=bool(d.get("offload_activations")),
                   experts_shard=d.get("experts_shard"), etp=bool(d.get("etp")),
                   cp=bool(d.get("cp")), cp_rotate=d.get("cp_rotate", "allgather"))

    def cache_options(self) -> dict:
        """The trace cache's options of a trace of this layout: a DDP and an FSDP trace, a TP and
        a TP + SP trace never share an entry; every size of the mesh shares one."""
        out: dict[str, Any] = {}
        if self.shard is not None:
            out["shard"] = self.shard
        if self.fsdp_mp is not None:
            out["fsdp_mp"] = ",".join(self.fsdp_mp)
        if self.tp:
            out.update(tp=True, sp=bool(self.sp))
        if self.ac is not None:
            out["ac"] = self.ac
        if self.replicate is not None:
            out["replicate"] = self.replicate
        if self.offload:
            out["offload"] = True
        if self.fp8 is not None:  # (the recipe and the all-gather change the ops and their dtypes)
            out["fp8"] = self.fp8 + (",all_gather" if self.fp8_all_gather else "")
        if self.compile:  # (the compiled step's ops and saved tensors are the partitioned graphs')
            out["compile"] = True
        if self.ep:
            out["ep"] = True
        if self.experts_shard is not None:  # (FSDP2's Shard(0) and Shard(1) of the experts run other copies)
            out["experts_shard"] = self.experts_shard
        if self.etp:  # (the experts split over TP: other shapes, no token split)
            out["etp"] = True
        if self.offload_activations:  # (the saved tensors' copies are ops of the step)
            out["offload_activations"] = True
        if self.cp:
            out["cp"] = self.cp_rotate
        return out

    # --- the model under the layout -------------------------------------------------------------
    def spec(self, spec):
        """The :class:`~symcost.frontends.spec.ModelSpec` of ``spec`` trained under this layout:
        each traced dimension's symbol added with the probe checks that keep the per-rank sizes
        polynomial in it (:func:`symcost.frontends.parallel.data_parallel`,
        :func:`symcost.frontends.tensor_parallel.tensor_parallel`), and ``extra["layout"]``.

        An inference step (``decode``, ``prefill``: ``serve --tp``) takes tensor parallelism
        alone: one rank of the plan runs the step through the model's own cache, which then holds
        the rank's key/value heads (K/TP per layer). The request must split both head counts over
        TP (:func:`check_heads`).

        Raises:
            SymcostError: an inference step under data or pipeline parallelism, sequence
                parallelism or activation checkpointing (they train); activation checkpointing
                of a model without a block list.
        """
        if (self.shard is not None or self.pipeline is not None or self.ac or self.sp
                or self.fp8 or self.compile or self.offload_activations) and spec.step != "train":
            raise SymcostError(f"--dp/--pp/--sp/--ac/--fp8/--compile/--offload-activations trace a training step, "
                               "not an inference step "
                               f"({spec.step}); an inference step takes --tp alone")
        if self.compile:
            from symcost.frontends.compile import compile_spec

            spec = compile_spec(self, spec)
        if self.ac and "L" not in spec.symbols and spec.layers is None and not any(
                s not in ("B", "S", "T") for s in spec.own_symbols):  # (own sizes may count stacks: L_enc, L_dec)
            raise SymcostError(f"--ac {self.ac} checkpoints each block of the model's block list; {spec.name} has none "
                               "(no symbol L)")
        if not self:
            return spec
        if self.fp8 is not None:
            from symcost.frontends.fp8 import fp8_spec

            spec = fp8_spec(spec)
        if self.shard is not None:
            from symcost.frontends.parallel import data_parallel

            sizes = None
            if self.tp:  # (on the 2-D mesh FSDP2 shards the TP-local rows of the TP sizes the plan splits)
                from symcost.frontends.tensor_parallel import splits

                base, sp = spec, self.sp

                def sizes(values):
                    return splits(base, values, sp)
            indivisible = None
            if self.ep and not self.ep_replicate:  # (the dense parameters over DP·EP ranks, the experts over DP: §14.6)
                import functools

                from symcost.frontends.expert_parallel import fsdp_indivisible

                indivisible = functools.partial(fsdp_indivisible, dim=self.experts_shard or 0)
            spec = data_parallel(spec, self.shard, self.fsdp_mp, sizes, self.replicate, indivisible)
        if self.ep:
            from symcost.frontends.expert_parallel import expert_parallel

            spec = expert_parallel(spec, etp=self.etp)
        if self.tp:
            from symcost.frontends.tensor_parallel import tensor_parallel

            spec = tensor_parallel(spec, self.sp)
            if spec.step != "train":
                inner = spec.check

                def check(values, inner=inner, spec=spec):
                    return (inner(values) if inner else None) or check_heads(spec, values)

                spec = dataclasses.replace(spec, check=check)
        if self.cp:
            from symcost.frontends.context_parallel import context_parallel

            spec = context_parallel(spec)
        mine = layout_of(spec)
        if mine and mine != self:
            raise SymcostError(f"{spec.name} is already laid out as {mine.describe()}; give one layout")
        return dataclasses.replace(spec, extra={**spec.extra, "layout": self.to_dict()})

    def fake_mesh(self, values: Mapping[str, int], labels: dict | None = None) -> dict:
        """``{symbol: DeviceMesh}`` of one rank (rank 0) of this layout's traced dimensions on
        PyTorch's fake process group of ``prod(sizes)`` ranks: ``init_device_mesh`` with the
        dimensions named as torchtitan names them, and each symbol's sub-mesh
        (:meth:`engine_meshes`; under HSDP ``DP`` is the 2-D ``(dp_replicate, dp_shard)`` one).
        ``labels``, where given, receives each 1-D group's label (:meth:`engine_meshes`). Call it
        outside ``FakeTensorMode`` (the mesh reads a real tensor).

        Raises:
            SymcostError: a traced dimension whose symbol ``values`` lacks; under HSDP, a DP that
                R does not divide.
        """
        from torch.distributed.device_mesh import init_device_mesh

        from symcost.frontends.parallel import fake_world

        dims = self.traced_dims
        missing = [DIM_SYMBOL[d] for d in dims if DIM_SYMBOL[d] not in values]
        if missing:
            raise SymcostError(f"the layout {self.describe()} needs the size {missing[0]}")
        if self.hsdp and int(values["DP"]) % self.replicate:
            raise SymcostError(f"--dp {values['DP']} is no multiple of --dp-replicate {self.replicate} "
                               "(HSDP: DP = replicate × shard)")
        if self.cp and self.shard is not None and int(values["DP"]) == 1:
            # (the flattened dp_shard × cp group is then the cp group itself: one group, two roles)
            raise SymcostError("--dp 1 with --cp: FSDP2 over the CP ranks alone (torchtitan's layout for CP without "
                               "data parallelism) is not modelled yet; give --dp 2 or more, or --cp alone")
        dims, shape = self.mesh_shape(lambda s: int(values[s]))
        if self.ep_tp or (self.ep_fsdp and int(values["DP"]) == 1):
            # (a fake world of twice the mesh: the EP group, the mesh flattened, is then a process
            # group of its own, not the world's, and never the TP group's, even where EP = TP:
            # PyTorch reuses the world's group for a mesh dimension over all its ranks, and the
            # collectives are told apart by their group's name. So too under FSDP2 at DP = 1,
            # torchtitan's single-node EP (docs/parallel.md §14.6): the dense FSDP2 group,
            # dp_shard × ep flattened, then has the ranks of the ep group, and both were the
            # world's group, the all-to-alls and the dense all-gathers one label)
            import torch
            from torch.distributed.device_mesh import DeviceMesh

            fake_world(2 * math.prod(shape))
            mesh = DeviceMesh("cpu", torch.arange(math.prod(shape)).reshape(shape), mesh_dim_names=dims)
        else:
            fake_world(math.prod(shape))
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
        sub, names = self.engine_meshes(mesh)
        if labels is not None:
            labels.update(names)
        return sub

    def parallelize(self, model, layers: str | None, mesh: Mapping[str, Any], dp_engine: str | None = None,
                    compile_cuts: str | None = None, torch_device: str | None = None, ac_stacks=()):
        """Parallelise ``model`` in place over ``mesh`` (:meth:`fake_mesh`) in torchtitan's order:
        FP8 training's ``Float8Linear`` swap (:func:`symcost.frontends.fp8.convert`, torchtitan's
        model converter), then the tensor-parallel plan over ``TP`` (:func:`symcost.frontends.tensor_parallel.apply`),
        then activation checkpointing of every block (:func:`symcost.frontends.checkpointing.
        checkpoint_blocks`), then the data-parallel engine over ``DP``, per block of ``layers``
        and at the root
        (:func:`symcost.frontends.parallel.wrap`: ``fully_shard`` of a TP-sharded parameter
        shards its local rows again; ``dp_engine``: the data-parallel engine where the run names
        one, ``"megatron-ddp"``: :func:`symcost.frontends.parallel.wrap`, and with ``TP`` Megatron-LM's
        vocabulary-parallel embedding, :func:`symcost.frontends.megatron.vocab_parallel_embedding`; ``compile_cuts``: the
        trace's key of the compiled blocks' partitions, :func:`symcost.frontends.compile.compile_blocks`,
        which run after activation checkpointing and before the data-parallel engine; ``torch_device``: the
        target device whose fused attention inductor's patterns choose, ``--torch-device``; ``ac_stacks``: where
        ``layers`` is None, the containers of the model's several block stacks, each of whose blocks
        activation checkpointing wraps and the data-parallel engine makes a unit of its own, as
        torchtitan's ``apply_fsdp`` does each block,
        :func:`symcost.tracing.stacks.checkpointed_stacks`). Returns the context the
        loss and its backward run in
        (``loss_parallel()`` where the logits are vocabulary-sharded, else a no-op).

        Raises:
            SymcostError: PyTorch refuses the plan or the wrapping (its message, one line).
        """
        import contextlib

        loss_context = contextlib.nullcontext
        if self.fp8 is not None:
            from symcost.frontends.fp8 import convert

            convert(model, self.fp8, self.fp8_all_gather, layers)
        if self.tp:
            from symcost.frontends.tensor_parallel import apply

            skip = None
            if self.ep:  # (the MoE layers: laid over TP by apply_moe_ep_tp below, docs/parallel.md §14.8)
                from symcost.frontends.expert_parallel import experts_modules
                from symcost.frontends.expert_parallel_tp import skipped

                skip = skipped(model, experts_modules(model))
            loss_context = apply(model, layers if layers is not None else (list(ac_stacks) or None), mesh["TP"],
                                 self.sp, self.fp8, skip=skip)
            if dp_engine == "megatron-ddp":  # (Megatron-LM's VocabParallelEmbedding: the rank's rows only)
                from symcost.frontends.megatron import vocab_parallel_embedding

                vocab_parallel_embedding(model)
        if self.ep:  # (torchtitan's apply_moe_ep_tp: after the dense TP plan, before AC and FSDP)
            from symcost.frontends.expert_parallel import apply as apply_ep

            apply_ep(model, mesh["EP"], mesh["TP"] if self.tp else None, mesh.get("EP_TP") if self.etp else None)
        if self.ac is not None and not self.compile:  # (under --compile the compiled block checkpoints)
            from symcost.frontends.checkpointing import checkpoint_blocks

            if layers is None and not ac_stacks:
                raise SymcostError(f"--ac {self.ac}: the model has no block list to checkpoint")
            checkpoint_blocks(model, layers if layers is not None else list(ac_stacks), self.ac)
        if self.compile:
            from symcost.frontends.compile import compile_blocks

            if layers is None:
                raise SymcostError("--compile: the model has no block list to compile")
            compile_blocks(model, layers, compile_cuts, torch_device, ac=self.ac)
        if self.shard is not None:
            import warnings

            from symcost.frontends.parallel import wrap

            inner = experts_mesh = None
            if self.ep_replicate:  # (the experts' gradients over the expert-data-parallel group: §14.11)
                from symcost.frontends.expert_parallel import replicate_experts

                experts_mesh = mesh["DP_expert"]

                def inner(reshard, kw):
                    replicate_experts(model, mesh["DP_expert"], kw)
            elif self.ep_fsdp:  # (torchtitan's apply_fsdp: the experts their own units over dp_shard first)
                from symcost.frontends.expert_parallel import shard_experts

                def inner(reshard, kw):
                    shard_experts(model, mesh["DP_expert"], reshard, kw, self.experts_shard or 0)
            wrap(model, layers if layers is not None else (list(ac_stacks) or None), self.shard, mesh["DP"],
                 self.fsdp_mp, offload=self.offload, engine=dp_engine, inner=inner, experts_mesh=experts_mesh)
            # FSDP2 warns when the root returns a view (a language model's logits slice); the
            # recorded step does no in-place op on it, and the user did not write this wrapping
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor",
                                    category=UserWarning)
        return loss_context


def group_size(label: str, size_of, replicate: int | None = None, cp: bool = False, ep: bool = False,
               tp: bool = False):
    """The ranks of the process group a collective labelled ``label`` runs over (a mesh symbol,
    or HSDP's ``"DP_replicate"``, or EP under FSDP2's ``"DP_expert"``), where ``size_of(symbol)``
    gives a symbol's size (an int or a sympy symbol) and ``replicate`` is HSDP's R (None without
    HSDP): the symbol's size, except under HSDP, where ``"DP"`` is the ``dp_shard`` group (DP/R)
    and ``"DP_replicate"`` has R; with ``cp`` (FSDP2 over ``dp_shard × cp``, torchtitan's
    ``dp_shard_cp``), where ``"DP"`` has DP·CP ranks; and with ``ep`` (expert parallelism under
    FSDP2, :attr:`Layout.ep_fsdp`), where ``"DP"`` (the dense parameters' group, dp_shard × ep)
    has DP·EP ranks and ``"DP_expert"`` (the experts', dp_shard) DP; with ``ep`` and ``tp`` (the
    EP group over the TP ranks under FSDP2, docs/parallel.md §14.9) ``"DP"`` (dp_shard × ep_rest)
    has DP·EP/TP ranks."""
    if cp and label == "DP":
        return size_of("DP") * size_of("CP")
    if ep and tp and label == "DP":
        n, t = size_of("DP") * size_of("EP"), size_of("TP")
        return n // t if isinstance(n, int) and isinstance(t, int) else n / t
    if ep and label == "DP":
        return size_of("DP") * size_of("EP")
    if label == "DP_expert":
        return size_of("DP")
    if replicate and label == "DP_replicate":
        return replicate
    if replicate and label == "DP":
        n = size_of("DP")
        return n // replicate if isinstance(n, int) else n / replicate
    return size_of(label)


def check_heads(spec, values: Mapping[str, int]) -> str | None:
    """Why ``values["TP"]`` ranks cannot run one inference step of ``spec`` under the
    tensor-parallel plan, or None: TP must divide the query heads H and the key/value heads K
    (K = H without grouped-query attention). The plan's column-parallel k and v projections
    (``ColwiseParallel``, transformers' ``base_model_tp_plan`` "colwise") split K·D output
    features over TP; where TP does not divide K a rank gets part of a head, and the attention's
    ``view(B, S, -1, D)`` fails (PyTorch: "shape ... is invalid"). Serving engines replicate the
    key/value heads there (vLLM: each rank holds one whole head when TP > K); that layout is not
    PyTorch's plan and is not modelled."""
    tp = values.get("TP")
    if not tp:
        return None
    H = values.get("H")
    K = values.get("K", H)  # (spec.values gives tied followers their leader's value)
    for name, n, what in (("H", H, "query heads"), ("K", K, "key/value heads")):
        if n is not None and n % tp:
            extra = (" (TP > K: the plan's column-parallel k/v projections would give each rank part of a head; "
                     "replicating the key/value heads, as vLLM does, is not modelled)" if name == "K" and tp > n else
                     " (the plan's column-parallel projections would give a rank part of a head)")
            return f"--tp {tp} does not divide the {n} {what} ({name}={n}){extra}"
    return None


def layout_of(spec_or_analysis) -> Layout:
    """The :class:`Layout` a spec (``extra["layout"]``) or an analysis (its spec's) was traced
    under; the empty layout (one device) where none."""
    spec = getattr(spec_or_analysis, "spec", spec_or_analysis)
    extra = getattr(spec, "extra", None) or {}
    return Layout.from_dict(extra.get("layout"))
