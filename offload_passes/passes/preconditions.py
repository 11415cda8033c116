"""The precondition checks every front-end shares: a group's limits, geometry and refusals.

Each front-end's ``check_preconditions`` (``passes/frontends/recipe.py`` for the recipe form,
``passes/frontends/hf/frontend.py::check_hf_preconditions`` for the Hugging Face form) checks its own
sites and builds each group's :class:`GroupGeometry` with the rules written once here (:class:`Checker`,
:func:`check_topk_width`, :func:`check_raw_seq`, :func:`check_pool_size`, :func:`group_geometry`, the
ops' limits). Anything unmet becomes a ``Refusal`` (reason code + detail naming the argument and the
limit); the pipeline decides from them what the graph becomes (``outcome.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import fx

from ..custom_ops import spec_for
from ..custom_ops._pool import id_range_for, pool_size_problem
from ..modes import MODES
from ..options import OffloadOptions
from . import _fx
from .group import Group, GroupReport
from .refusal import Refusal

# A group's limits are those of the ops the rewrite emits (their OpSpecs; one definition each).
_PLAN, _INSTALL = spec_for("dsa_plan"), spec_for("dsa_install")
MAX_TOPK = _PLAN.limit("MAX_TOPK")
MAX_RAW_SEQ = _PLAN.limit("MAX_RAW_SEQ")
TOPK_ALIGN = _PLAN.limit("TOPK_ALIGN")
MAX_DKV = _INSTALL.limit("MAX_DKV")
MIN_DR = _INSTALL.limit("MIN_DR")  # 0: the no-rope mode
MAX_DR = _INSTALL.limit("MAX_DR")
MIN_SBS = _INSTALL.limit("MIN_SELECTION_BLOCK_SIZE")
MAX_SBS = _INSTALL.limit("MAX_SELECTION_BLOCK_SIZE")


@dataclass
class SiteGeometry:
    layer: int
    full_kv: fx.Node
    full_rope: fx.Node
    # the model's selection buffers and gather ledger (None where the model has none: the rewrite then
    # serves into scratch buffers of the graph, ``rewrite.selection_buffers``)
    sel_kv: Optional[fx.Node]
    sel_rope: Optional[fx.Node]
    sel_table: Optional[fx.Node]
    status: Optional[fx.Node]
    F: int  # tokens per batch row of the full cache (maxblk * FBS)
    Dkv: int
    Dr: int
    dtype: torch.dtype
    # the full block table and its block size; ``paged``: it was not the identity layout on the example
    # inputs (or the cache is not ``B*maxblk`` blocks), so serve reads only the pool and the model's own
    # gather reads every other row through the table
    block_table: Optional[fx.Node] = None
    FBS: int = 0
    paged: bool = False
    #: a cache grown by concatenation this step (a ``DynamicCache``): ``full_kv`` / ``full_rope`` are the
    #: ``cat`` nodes, ``past`` the graph inputs (kv, rope) they extend; the pools are found by those inputs
    #: and follow the ``cat`` outputs after the step (``state.StateBinder.after_call``)
    past: Optional[tuple[fx.Node, fx.Node]] = None


@dataclass
class GroupGeometry:
    group_id: int
    owner_layer: int
    last_layer: int
    layers: list[int]
    B: int
    S: int
    K: int
    BS: int  # selection block size
    pool_size: int
    num_sets: int
    id_range: int
    lengths: fx.Node  # each row's cache length [B] int32 (the recipe's full_kv_actual_seq), or see below
    topk: fx.Node
    topk_node: str
    geometry: dict[int, SiteGeometry] = field(repr=False)
    #: layer -> the earlier layer of the group whose full caches it reads (cross-layer KV sharing,
    #: transformers' ``kv_source_layers``): it shares that layer's pool, is served and installed once
    pool_source: dict[int, int] = field(default_factory=dict)
    #: the width of the model's top-k when it is not ``K`` (None: it is): the plan's ids are that top-k
    #: with its negative ids moved to the end and -1 up to ``K``, the next multiple of the ops' alignment
    #: (``rewrite.py::_plan_topk``; exact: the plan serves no row for -1, attention masks it)
    ids_width: Optional[int] = None
    #: ``lengths`` holds this step's cache positions ``[S]``, the same for every row (HF's ``StaticCache``):
    #: the rewrite plans with ``max(positions) + 1`` per row
    lengths_are_positions: bool = False
    #: ``lengths`` is the owner's cache grown by concatenation this step (a ``DynamicCache``), ``[B, 1, T, C]``:
    #: every row's length is its size ``T`` (symbolic); the full caches are this step's ``cat`` nodes
    lengths_are_cache_size: bool = False

    @property
    def paged(self) -> bool:
        """Served through the block table (any site's table not the identity layout)."""
        return any(g.paged for g in self.geometry.values())

    def to_dict(self) -> dict:
        return {"group_id": self.group_id, "owner_layer": self.owner_layer, "layers": list(self.layers),
                "topk_node": self.topk_node, "K": self.K, "S": self.S, "B": self.B, "BS": self.BS,
                "pool_size": self.pool_size, "num_sets": self.num_sets, "id_range": self.id_range,
                "paged": self.paged, **({"pool_source": dict(self.pool_source)} if self.pool_source else {}),
                **({"ids_width": self.ids_width if isinstance(self.ids_width, int) else str(self.ids_width)}
                   if self.ids_width is not None else {}),
                **({"cache": "grown"} if self.lengths_are_cache_size else {})}


@dataclass
class PreconditionReport:
    """A front-end's precondition step: the geometry of every group whose checks pass, every unmet limit."""

    groups: list[GroupGeometry]  # the groups that pass their checks (whether they are offloaded: ``outcome.py``)
    refusals: list[Refusal]  # each names a layer of the group it refuses
    #: the refusals are the design, not a failure: the detail ``GraphReport.dense`` shows (the Hugging Face
    #: form: a prefill of more query tokens than the offload serves); None: they are refusals
    by_design: Optional[str] = None

    def by_group(self, groups: GroupReport) -> dict[int, tuple[Refusal, ...]]:
        """Each group's refusals (empty: it passes). A refusal naming no layer of a group refuses every group."""
        out: dict[int, tuple[Refusal, ...]] = {}
        for g in groups.groups:
            layers = set(g.layers)
            out[g.group_id] = tuple(r for r in self.refusals if r.layer in layers or not _names_a_site(r, groups))
        return out


def _names_a_site(r: Refusal, groups: GroupReport) -> bool:
    return any(r.layer in g.layers for g in groups.groups)


class Checker:
    """``chk(cond, reason, detail)``: records a :class:`Refusal` at ``layer`` when ``cond`` is false;
    returns ``cond``. ``layer`` may be given per call (a group's check naming one of its sites)."""

    def __init__(self, layer: Optional[int], refusals: Optional[list[Refusal]] = None):
        self.layer = layer
        self.refusals: list[Refusal] = [] if refusals is None else refusals

    def __call__(self, cond: bool, reason: str, detail: str, layer: Optional[int] = None) -> bool:
        if not cond:
            self.refusals.append(Refusal(reason, detail, self.layer if layer is None else layer))
        return cond


def check_topk_width(chk: Checker, K: int, bounded_by_producer: bool) -> None:
    """The top-k width the plan takes: a multiple of ``TOPK_ALIGN``, at most ``MAX_TOPK``.
    ``bounded_by_producer``: the top-k producer's own schema already limits K to ``MAX_TOPK`` (every
    lightning indexer the recipe detection accepts limits sparse_count to INDEXER_MAX_SPARSE_COUNT =
    MAX_TOPK, as does the gather), so only the alignment is checked."""
    if bounded_by_producer:
        chk(K % TOPK_ALIGN == 0, "topk_alignment", f"top-k width K={K} must be a multiple of {TOPK_ALIGN}")
    else:
        chk(K % TOPK_ALIGN == 0 and 0 < K <= MAX_TOPK, "topk_alignment",
            f"top-k width K={K} must be a multiple of {TOPK_ALIGN} and <= {MAX_TOPK}")


def check_rope_width(chk: Checker, Dr: int, opts: OffloadOptions, layer: Optional[int] = None) -> None:
    """The rope width serve / install take: ``MIN_DR <= Dr <= MAX_DR``; ``Dr = 0`` (the no-rope mode)
    only off the NPU, whose CANN tilings reject a zero rope width."""
    chk(MIN_DR <= Dr <= MAX_DR, "dims", f"Dr={Dr} must be in [{MIN_DR}, {MAX_DR}]", layer)
    if Dr == 0:
        chk(MODES[opts.exe_mode].platform != "npu", "no_rope_npu",
            f"Dr=0 (a layer without a rope part) in exe_mode {opts.exe_mode!r}: CANN's dsa_serve / dsa_install "
            "tilings reject a zero rope width (docs/ops.md §3.3); the CPU and CUDA modes serve it", layer)


def padded_topk_width(K: int) -> int:
    """The plan's width for a model top-k of ``K`` ids: the next multiple of ``TOPK_ALIGN``."""
    return -(-K // TOPK_ALIGN) * TOPK_ALIGN


def check_raw_seq(chk: Checker, S: int, opts: OffloadOptions) -> None:
    """Query tokens per step: ``1 <= S <= MAX_RAW_SEQ``, and ``S == next_n + 1`` when ``next_n`` is set."""
    chk(1 <= S <= MAX_RAW_SEQ, "raw_seq", f"raw_seq S={S} must be in [1, {MAX_RAW_SEQ}]")
    if opts.next_n is not None:
        chk(S == opts.next_n + 1, "next_n", f"graph has raw_seq S={S}, config next_n={opts.next_n}")


def check_pool_size(chk: Checker, pool_size: int, selection_block_size: int) -> None:
    """The pool geometry rule (``custom_ops/_pool.py::pool_size_problem``) for this group's block size."""
    problem = pool_size_problem(pool_size, selection_block_size)
    chk(problem is None, "pool_size", f"pool_size={pool_size} {problem[0]}" if problem else "")


def group_geometry(g: Group, B: int, S: int, K: int, SBS: int, F: int, lengths: fx.Node,
                   geometry: dict[int, SiteGeometry], opts: OffloadOptions) -> GroupGeometry:
    """A group's geometry: pool size and sets from the options, the id range from the longest cache ``F``."""
    PS = opts.resolved_pool_size
    return GroupGeometry(g.group_id, g.owner.layer, g.last.layer, g.layers, B, S, K, SBS, PS, PS // 16,
                         id_range_for(F, opts.id_range), lengths, g.owner.topk, g.producer.name, geometry,
                         pool_sources(g.layers, geometry))


def pool_sources(layers: list[int], geometry: dict[int, SiteGeometry]) -> dict[int, int]:
    """Layer -> the first layer of the group that reads the same full caches (kv and rope, views
    stripped), for every layer that is not that first one: it shares its pool (cross-layer
    KV sharing). Unpaged groups only: a paged site's own gather reads its ledger and selection buffers."""
    first: dict[tuple, int] = {}
    out: dict[int, int] = {}
    for l in layers:
        geo = geometry[l]
        if geo.paged:
            return {}
        key = (_fx.strip_views(geo.full_kv), _fx.strip_views(geo.full_rope))
        if key in first:
            out[l] = first[key]
        else:
            first[key] = l
    return out
