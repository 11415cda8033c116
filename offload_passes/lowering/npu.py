"""The NPU lowering (``ge_graph``: TorchAir GE; ``npugraph_ex``: ACL graph): the rewritten graph handed to
torch_npu's own backend, so TorchAir's handling (streams, decompositions, AOT, reinplace, converters, static
inputs) is kept; our converters and reinplace pairs are registered first (:mod:`offload_passes.converters`).

Installs run on a side stream (:class:`AclInstallHook`, :class:`GeInstallHook`; the shared schedule is
``lowering/side_stream.py``): each layer's installs start once its ``dsa_serve`` is done, beside its SFA
and MoE. The per-step bookkeeping (pool statistics, ledger update) is off unless ``npu_bookkeeping``. In
ge_graph the model's KV-cache writes become ``ScatterNdUpdate`` on the cache inputs
(``passes/cache_writes.py``). Nothing here imports torch_npu / TorchAir at import time.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, List, Mapping, Optional, Sequence

import torch
from torch import fx

from .. import _compat
from ..modes import NPU_EXE_MODES, check_exe_mode
from ..passes.bookkeeping import strip_bookkeeping
from ..passes.manager import CompileContext, Pass, StepPass
from . import LowerContext
from .side_stream import SIDE_STREAM_LABEL, SideStreamHook, is_collective, side_stream_joins

log = logging.getLogger("offload_passes.lowering.npu")

#: Stream label of the install side stream (``_user_stream_label``).

__all__ = ["NpuLowering", "lower_ge_graph", "lower_npugraph_ex", "recipe_compiler_config",
           "acl_install_hook", "ge_install_hook", "AclInstallHook", "GeInstallHook", "ge_config",
           "npugraph_ex_config", "SIDE_STREAM_LABEL"]


# ----------------------------------------------------------------------------------------- helpers


def _chain(first: Optional[Callable], second: Callable) -> Callable:
    if first is None:
        return second

    def chained(gm, example_inputs, config):
        first(gm, example_inputs, config)
        second(gm, example_inputs, config)

    return chained


def _chain_once(cfg: Any, option: str, flag: str, fn: Callable) -> None:
    """Run ``fn`` after the pass already in ``cfg.<option>``; once (a reused config is chained once)."""
    previous = getattr(getattr(cfg, option), "value", None)
    if not getattr(previous, flag, False):
        chained = _chain(previous, fn)
        setattr(chained, flag, True)
        setattr(cfg, option, chained)


# ------------------------------------------------------------------------------------ install hooks


class AclInstallHook(SideStreamHook):
    """npugraph_ex side-stream hook (see module doc; the shape is ``side_stream.SideStreamHook``): the
    scope's ready / done are tagged events named by the graph and the layer."""

    def __init__(self, graph_id: str, label: str = SIDE_STREAM_LABEL):
        super().__init__()
        tagged = _compat.npugraph_ex_tagged_event()  # registers tagged_event_* / record_tagged_stream
        import npugraph_ex.scope  # noqa: F401  (registers npugraph_ex.scope_enter / scope_exit)

        self._tagged = tagged
        self.graph_id = graph_id
        self.label = label

    def _event(self, layer: int, what: str) -> str:
        name = f"dsa_offload_{self.graph_id}_l{layer}_{what}"
        if name not in self._tagged._GLOBAL_TAG_TO_EVENT.keys():
            self._tagged._npu_create_tagged_event(name)
        return name

    def tag(self, layer: int) -> int:
        self._event(layer, "ready")
        self._event(layer, "done")
        return layer

    def open(self, graph: fx.Graph, tag: int, reads: List[fx.Node]) -> None:
        ops = _compat.npugraph_ex_ops()  # torch.ops.npugraph_ex (npu 2.13) or torch.ops.air (2.8)
        ready = self._event(tag, "ready")
        for t in reads:  # main-stream allocations read on the side stream (the plan's records)
            graph.call_function(ops.record_tagged_stream_.default, (t, self.label))
        graph.call_function(ops.tagged_event_record.default, (ready,))
        graph.call_function(ops.scope_enter.default, (["_user_stream_label"], [self.label]))
        graph.call_function(ops.tagged_event_wait.default, (ready,))

    def close(self, graph: fx.Graph, tag: int) -> fx.Node:
        ops = _compat.npugraph_ex_ops()
        graph.call_function(ops.tagged_event_record.default, (self._event(tag, "done"),))
        return graph.call_function(ops.scope_exit.default, ())

    def join(self, graph: fx.Graph, tag: int) -> None:
        graph.call_function(_compat.npugraph_ex_ops().tagged_event_wait.default, (self._event(tag, "done"),))


def acl_install_hook(graph_id: str, label: str = SIDE_STREAM_LABEL) -> AclInstallHook:
    return AclInstallHook(graph_id, label)


class GeInstallHook(SideStreamHook):
    """GE side-stream hook (see module doc; the shape is ``side_stream.SideStreamHook``): ``air.record()``
    right after the layer's serve (a control edge from its last GE op), the installs moved right after it
    inside ``air.scope_enter`` with ``air.wait([record])`` first. GE completes every stream of a graph
    before a run returns, and the install ref outputs feed the graph outputs, so the join is the end of
    the run — unless a collective follows (multi-rank graphs): then an ``air.record()`` closes the scope
    and ``air.wait`` on it right before the first later collective gives that collective a control edge
    from the last install, so the side stream never runs across a collective (:meth:`finish`)."""

    def __init__(self, label: str = SIDE_STREAM_LABEL, priority: int = 0):
        super().__init__()
        import torchair  # noqa: F401  (registers air.scope_enter / scope_exit / record / wait)

        self.label = label
        self.priority = priority
        self.done: dict[int, fx.Node] = {}  # layer -> the record closing its scope

    def tag(self, layer: int) -> int:
        return layer

    def open(self, graph: fx.Graph, tag: int, reads: List[fx.Node]) -> None:
        air = torch.ops.air
        rec = graph.call_function(air.record.default, ())  # right after the serve: the installs follow it
        graph.call_function(air.scope_enter.default, (
            ["_user_stream_label", "_user_stream_priority", "_enable_inner_parallel"],
            [self.label, str(self.priority), "True"]))
        graph.call_function(air.wait.default, ([rec],))

    def close(self, graph: fx.Graph, tag: int) -> fx.Node:
        air = torch.ops.air
        self.done[tag] = graph.call_function(air.record.default, ())  # on the side stream: after the last install
        return graph.call_function(air.scope_exit.default, ())

    def finish(self, graph: fx.Graph) -> List[str]:
        """A main-stream ``air.wait`` before the first collective after each scope (none: the end of the
        run joins). Returns the node names joined before; unused done records are removed."""
        air = torch.ops.air
        exits = {ex: self.done[tag] for _, ex, tag in self.pending}
        open_: List[fx.Node] = []
        where: List[str] = []
        depth = 0
        for n in list(graph.nodes):
            if n in exits:
                open_.append(exits[n])
            name = str(n.target)
            if name.endswith("scope_enter.default"):
                depth += 1
            elif name.endswith("scope_exit.default"):
                depth -= 1
            elif depth == 0 and open_ and is_collective(n):
                with graph.inserting_before(n):
                    graph.call_function(air.wait.default, (list(open_),))
                where.append(n.name)
                open_ = []
        for done in open_:  # no collective after it: GE's end of run is the join
            graph.erase_node(done)
        self.pending.clear()
        self.done.clear()
        return where


def ge_install_hook(label: str = SIDE_STREAM_LABEL, priority: int = 0) -> GeInstallHook:
    return GeInstallHook(label, priority)


# ------------------------------------------------------------------------------------------ lowering


def ge_config(compiler_config: Any = None) -> Any:
    """A ``torchair.CompilerConfig`` with the KV-cache write rewrite chained into ``post_grad_custom_pre_pass``.

    TorchAir has no GE converter for ``aten.index_put`` / ``index_copy`` (the model's cache writes), and an
    out-of-place form would write a full-cache-sized result every step;
    :func:`offload_passes.passes.cache_writes.cache_writes_to_scatter_nd` turns each write into a
    ``ScatterNdUpdate`` on the cache input, which TorchAir's ref-copy pass then runs in place.
    """
    import torchair

    from ..passes.cache_writes import cache_writes_to_scatter_nd

    def cache_write(gm, example_inputs, config):
        cache_writes_to_scatter_nd(gm)

    cfg = compiler_config if compiler_config is not None else torchair.CompilerConfig()
    _chain_once(cfg, "post_grad_custom_pre_pass", "_offload_passes_cache_write", cache_write)
    return cfg


def lower_ge_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], compiler_config: Any = None,
                   custom_decompositions: Optional[Mapping] = None, **kwargs: Any) -> Callable:
    """Compile with TorchAir's GE backend (converters, ref-copy elimination and in-place cache writes)."""
    import torchair

    from .. import converters

    converters.register_ge()
    _compat.torchair_ready_after_npugraph_ex()
    cfg = ge_config(compiler_config)
    return torchair.get_npu_backend(compiler_config=cfg, custom_decompositions=dict(custom_decompositions or {}))(
        gm, example_inputs, **kwargs)


def npugraph_ex_config(compiler_config: Any = None) -> Any:
    """A ``npugraph_ex.CompilerConfig`` in ``npugraph_ex`` mode with our ``post_grad_custom_post_pass`` chained:
    masked metadata updates and KV-cache writes made in place on their inputs, install chains split."""
    import npugraph_ex

    from ..passes.cache_writes import cache_writes_in_place
    from ..passes.npu_install_chains import clone_input_copy_sources, inplace_masked_input_updates, split_install_chains

    cfg = compiler_config if compiler_config is not None else npugraph_ex.CompilerConfig()
    cfg.mode = "npugraph_ex"

    def split(gm, example_inputs, config):
        inplace_masked_input_updates(gm)  # the new-request invalidation, so installs read inputs
        cache_writes_in_place(gm)  # the model's KV-cache writes: no full-cache copy per step
        split_install_chains(gm)
        clone_input_copy_sources(gm)  # npugraph_ex 2.8's reinplace cannot take a graph input as a copy_ source

    _chain_once(cfg, "post_grad_custom_post_pass", "_offload_passes_split", split)
    return cfg


def lower_npugraph_ex(gm: fx.GraphModule, example_inputs: Sequence[Any], compiler_config: Any = None,
                      npu_options: Optional[Mapping[str, Any]] = None, **kwargs: Any) -> Callable:
    """Compile with npugraph_ex (reinplace pairs registered, install chains split before reinplace).

    ``npu_options`` are npugraph_ex options (``torch.compile(..., options=...)`` names); a user
    ``post_grad_custom_post_pass`` among them runs before ours. ``clone_input`` defaults to False: the
    offload state is mutated in place every step (the recipe does the same).
    """
    import npugraph_ex

    from .. import converters

    converters.register_npugraph_ex()
    opts = dict(npu_options or {})
    user_post = opts.pop("post_grad_custom_post_pass", None)
    cfg = compiler_config if compiler_config is not None else npugraph_ex.CompilerConfig()
    if user_post is not None:
        cfg.post_grad_custom_post_pass = user_post
    cfg = npugraph_ex_config(cfg)
    opts.setdefault("clone_input", False)
    return npugraph_ex.get_npu_backend(compiler_config=cfg)(gm, example_inputs, options=opts, **kwargs)


# ------------------------------------------------------------------------------------------- backend
def _strip_bookkeeping(ctx: CompileContext) -> Optional[int]:
    """Unless ``npu_bookkeeping``: the pool statistics out of the rewritten graph (``passes/bookkeeping.py``)."""
    keep = ctx.options.npu_bookkeeping
    ctx.report.bookkeeping = bool(keep) and ctx.state is not None
    if ctx.state is None or keep:
        return None
    stats = [v for k, v in (ctx.report.buffers or {}).items() if k.startswith("stats_g")]
    ctx.report.bookkeeping_nodes_removed = strip_bookkeeping(ctx.gm, stats)
    return ctx.report.bookkeeping_nodes_removed



def recipe_compiler_config(mode: str) -> Any:
    """The compiler settings cann-recipes' GLM-5.2 runner uses for ``mode`` (docs/platform.md §1).

    ge_graph: ``frozen_parameter``, ``tiling_schedule_optimize``, ``topology_sorting_strategy="StableRDFS"``;
    npugraph_ex: ``frozen_parameter`` (``clone_input=False`` is applied by :func:`lower_npugraph_ex`).
    """
    if mode == "ge_graph":
        import torchair

        cfg = torchair.CompilerConfig()
        cfg.experimental_config.frozen_parameter = True
        cfg.experimental_config.tiling_schedule_optimize = True
        cfg.experimental_config.topology_sorting_strategy = "StableRDFS"
        return cfg
    if mode == "npugraph_ex":
        import npugraph_ex

        cfg = npugraph_ex.CompilerConfig()
        _compat.set_npugraph_ex_option(cfg, "frozen_parameter", True)  # flat (npu 2.13) or nested (2.8)
        return cfg
    raise ValueError(f"mode must be one of {NPU_EXE_MODES}, got {mode!r}")


def _with_ge_dump(cfg: Any, folder: Path) -> Any:
    """TorchAir's own GE graph dump (GraphDef text, written when the graph is first run) into ``folder``."""
    import torchair

    cfg = cfg if cfg is not None else torchair.CompilerConfig()
    if cfg.debug.graph_dump.type.value is None:  # never override a dump the user asked for
        folder.mkdir(parents=True, exist_ok=True)
        cfg.debug.graph_dump.type = "txt"  # protobuf text of the GraphDef
        cfg.debug.graph_dump.path = str(folder)
    return cfg


class NpuLowering:
    """The NPU part of the offload backend (``modes.MODES`` names it for ``ge_graph`` / ``npugraph_ex``): the
    core rewrites, binds the state, dumps and reports; this adds the side-stream install hook, drops the
    per-step bookkeeping unless ``npu_bookkeeping``, and compiles with TorchAir / npugraph_ex.

    ``compiler_config``: a ``torchair.CompilerConfig`` (ge_graph) or ``npugraph_ex.CompilerConfig``;
    ``npu_options``: npugraph_ex options; ``side_stream``: move installs to a side stream (default).
    The state stays buffers of the graph (``state_from_caches = False``): one private state per graph.
    """

    state_from_caches = False

    def __init__(self, mode: str, compiler_config: Any = None, npu_options: Optional[Mapping[str, Any]] = None,
                 side_stream: bool = True):
        check_exe_mode(mode, NPU_EXE_MODES, where=" for the NPU lowering")
        self.mode = mode
        self.compiler_config = compiler_config
        self.npu_options = dict(npu_options or {})
        self.side_stream = side_stream

    def configure(self, ctx: CompileContext) -> None:
        """Register the mode's converters; the side-stream install hook; no ledger update unless
        ``npu_bookkeeping`` (the reference keeps none)."""
        from .. import converters

        if self.mode == "ge_graph":
            converters.register_ge()
        else:
            converters.register_npugraph_ex()
        if self.side_stream:
            ctx.install_hook = ge_install_hook() if self.mode == "ge_graph" else acl_install_hook(ctx.graph_id)
        if not ctx.options.npu_bookkeeping:
            ctx.use_options(ctx.options.replace(update_ledger=False))

    def passes(self, ctx: CompileContext) -> list[Pass]:
        """The side stream's joins, then the per-step bookkeeping out of the timed graph."""
        return [StepPass("side_stream_joins", side_stream_joins), StepPass("strip_bookkeeping", _strip_bookkeeping)]

    def lower(self, gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: LowerContext) -> Callable:
        """TorchAir's GE backend (with its GE graph dump into ``<dump_dir>/<graph_id>`` when dumping) or
        npugraph_ex. ``ctx``: the core's ``LowerContext`` (graph_id, dump_dir, kwargs); torch.compile's mode has
        no effect (the compiler configs are the NPU settings)."""
        ctx.ignore_compile_mode()
        if self.mode == "ge_graph":
            cfg = self.compiler_config
            if ctx.dump_dir is not None:
                cfg = _with_ge_dump(cfg, Path(ctx.dump_dir) / ctx.graph_id)
            return lower_ge_graph(gm, example_inputs, cfg, **ctx.kwargs)
        return lower_npugraph_ex(gm, example_inputs, self.compiler_config, self.npu_options, **ctx.kwargs)
