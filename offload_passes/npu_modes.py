"""NPU execution modes of the offload backend: ``ge_graph`` (TorchAir GE) and ``npugraph_ex`` (ACL graph).

Both share the backend's pre-AOT rewrite core (:func:`offload_passes.backend.rewrite_for_offload`) and
then hand the rewritten Dynamo graph to torch_npu's own backend, so all of TorchAir's handling
(stream/event rewriting, decompositions, AOT with input mutations, reinplace, converters, static /
frozen inputs) is kept:

* ``ge_graph``   -> ``torchair.get_npu_backend(compiler_config)``; our GE converters and the DSA ref-copy
  elimination are registered first (:mod:`offload_passes.converters`);
* ``npugraph_ex`` -> ``npugraph_ex.get_npu_backend(compiler_config)`` with ``mode="npugraph_ex"``, our
  reinplace pairs registered and ``split_install_chains`` chained into ``post_grad_custom_post_pass``.

Side stream (spec/ops.md §5). Each layer's installs (the rewrite places them right after the layer's
attention, Z's own install before the owner's ``metadata_update=1`` install) are moved to one side
stream per graph, in program order on that stream (so rule 1 holds by stream order):

* npugraph_ex: ``record_tagged_stream_`` of every intermediate the installs read (the plan's install
  records), ``tagged_event_record(ready)`` on the main stream after the layer's SFA, then
  ``scope_enter(_user_stream_label)``, ``tagged_event_wait(ready)``, the installs,
  ``tagged_event_record(done)``, ``scope_exit``; before the graph output the main stream waits on every
  ``done`` event — the join the recipe lacks, so the next step's plan and serves (next graph call) see
  finished installs (rules 2 and 3);
* ge_graph: ``air.scope_enter`` with the stream label, ``air.wait([SFA output])`` (a control edge: the
  installs start after the layer's attention), the installs, ``air.scope_exit``. GE finishes every
  stream of a graph before the run returns, and the install refs feed the graph outputs, so the join
  is the end of the run.

Nothing here imports torch_npu / TorchAir at import time; CPU users never need them.
"""
from __future__ import annotations

import logging
import operator
import weakref
from pathlib import Path
from typing import Any, Callable, List, Mapping, Optional, Sequence

import torch
from torch import fx

from .options import OffloadOptions
from .state import OffloadState

log = logging.getLogger("offload_passes.npu_modes")

NPU_MODES = ("ge_graph", "npugraph_ex")
#: Stream label of the install side stream (``_user_stream_label``).
SIDE_STREAM_LABEL = "dsa_offload_install"

__all__ = ["NpuOffloadBackend", "make_npu_backend", "lower_ge_graph", "lower_npugraph_ex", "recipe_compiler_config",
           "acl_install_hook", "ge_install_hook", "NPU_MODES", "SIDE_STREAM_LABEL"]


# ----------------------------------------------------------------------------------------- helpers


def _is_graph_input(n: Any) -> bool:
    return isinstance(n, fx.Node) and n.op in ("placeholder", "get_attr")


def _attention_before(first_install: fx.Node) -> Optional[fx.Node]:
    """The layer's SFA call the rewrite placed the installs after (None if not found)."""
    n = first_install.prev
    while n.op != "root":
        name = str(n.target)
        if "sparse_flash_attention" in name:
            return n
        if "dsa_serve" in name or "dsa_install" in name:
            return None
        n = n.prev
    return None


def _output_node(graph: fx.Graph) -> fx.Node:
    for n in reversed(graph.nodes):
        if n.op == "output":
            return n
    raise RuntimeError("graph has no output node")


def _chain(first: Optional[Callable], second: Callable) -> Callable:
    if first is None:
        return second

    def chained(gm, example_inputs, config):
        first(gm, example_inputs, config)
        second(gm, example_inputs, config)

    return chained


# ------------------------------------------------------------------------------------ install hooks


def acl_install_hook(graph_id: str, label: str = SIDE_STREAM_LABEL) -> Callable[[fx.Graph, list, int], None]:
    """npugraph_ex side-stream hook (see module doc). Creates this graph's tagged events."""
    import npugraph_ex.ops._tagged_event as tagged  # registers npugraph_ex.tagged_event_* / record_tagged_stream
    import npugraph_ex.scope  # noqa: F401  (registers npugraph_ex.scope_enter / scope_exit)

    ops = torch.ops.npugraph_ex

    def tag(name: str) -> str:
        if name not in tagged._GLOBAL_TAG_TO_EVENT.keys():
            tagged._npu_create_tagged_event(name)
        return name

    def hook(graph: fx.Graph, installs: list, layer: int) -> None:
        ready = tag(f"dsa_offload_{graph_id}_l{layer}_ready")
        done = tag(f"dsa_offload_{graph_id}_l{layer}_done")
        first, last = installs[0], installs[-1]
        seen: List[fx.Node] = []
        for inst in installs:
            for a in inst.args:
                if isinstance(a, fx.Node) and not _is_graph_input(a) and a not in seen:
                    seen.append(a)
        with graph.inserting_before(first):
            for t in seen:  # main-stream allocations read on the side stream (the plan's records)
                graph.call_function(ops.record_tagged_stream_.default, (t, label))
            graph.call_function(ops.tagged_event_record.default, (ready,))
            graph.call_function(ops.scope_enter.default, (["_user_stream_label"], [label]))
            graph.call_function(ops.tagged_event_wait.default, (ready,))
        with graph.inserting_after(last):
            ex = graph.call_function(ops.scope_exit.default, ())
        with graph.inserting_before(ex):
            graph.call_function(ops.tagged_event_record.default, (done,))
        with graph.inserting_before(_output_node(graph)):
            graph.call_function(ops.tagged_event_wait.default, (done,))

    return hook


def ge_install_hook(label: str = SIDE_STREAM_LABEL, priority: int = 0) -> Callable[[fx.Graph, list, int], None]:
    """GE side-stream hook (see module doc)."""
    import torchair  # noqa: F401  (registers air.scope_enter / scope_exit / wait)

    air = torch.ops.air

    def hook(graph: fx.Graph, installs: list, layer: int) -> None:
        first, last = installs[0], installs[-1]
        sfa = _attention_before(first)
        with graph.inserting_before(first):
            graph.call_function(air.scope_enter.default, (
                ["_user_stream_label", "_user_stream_priority", "_enable_inner_parallel"],
                [label, str(priority), "True"]))
            if sfa is not None:
                out = graph.call_function(operator.getitem, (sfa, 0))
                graph.call_function(air.wait.default, ([out],))
            else:
                log.debug("layer %d: no attention node found before its installs; no wait edge", layer)
        with graph.inserting_after(last):
            graph.call_function(air.scope_exit.default, ())

    return hook


# ------------------------------------------------------------------------------------------ lowering


def _index_copy_as_scatter(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``index_copy`` expressed with ``scatter`` (TorchAir has a GE converter for the latter only)."""
    dim = dim % max(source.dim(), 1)
    shape = [1] * source.dim()
    shape[dim] = -1
    return torch.scatter(self, dim, index.view(shape).expand_as(source), source)


def _index_put_as_scatter(self: torch.Tensor, indices: Sequence[Optional[torch.Tensor]], values: torch.Tensor,
                          accumulate: bool = False) -> torch.Tensor:
    """``index_put`` with one integer index on dim 0 (a KV-cache row write) expressed with ``scatter``."""
    if accumulate or len(indices) != 1 or indices[0] is None or indices[0].dim() != 1 \
            or indices[0].dtype in (torch.bool, torch.uint8):
        raise NotImplementedError(
            "ge_graph mode: TorchAir has no GE converter for aten.index_put; offload_passes maps only the "
            "cache-write form self[idx] = values (one 1-D integer index, accumulate=False) onto scatter")
    index = indices[0]
    rows = [index.shape[0], *self.shape[1:]]
    src = values.expand(rows)
    shape = [-1] + [1] * (self.dim() - 1)
    return torch.scatter(self, 0, index.view(shape).expand(rows), src)


#: Decompositions added in ge_graph mode for aten ops TorchAir cannot convert (its converter raises
#: NotImplementedError): the KV-cache writes of a model (``index_copy_`` / ``index_put_``).
GE_DECOMPOSITIONS = {torch.ops.aten.index_copy.default: _index_copy_as_scatter,
                     torch.ops.aten.index_put.default: _index_put_as_scatter}


def lower_ge_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], compiler_config: Any = None,
                   custom_decompositions: Optional[Mapping] = None, **kwargs: Any) -> Callable:
    """Compile with TorchAir's GE backend (converters and ref-copy elimination registered first).

    ``custom_decompositions`` are added to :data:`GE_DECOMPOSITIONS` (and win over them).
    """
    import torchair

    from . import converters

    converters.register_ge()
    cfg = compiler_config if compiler_config is not None else torchair.CompilerConfig()
    decomps = {**GE_DECOMPOSITIONS, **dict(custom_decompositions or {})}
    return torchair.get_npu_backend(compiler_config=cfg, custom_decompositions=decomps)(gm, example_inputs, **kwargs)


def npugraph_ex_config(compiler_config: Any = None) -> Any:
    """A ``npugraph_ex.CompilerConfig`` in ``npugraph_ex`` mode with the install-chain split chained."""
    import npugraph_ex

    from .converters.fx_passes import split_install_chains

    cfg = compiler_config if compiler_config is not None else npugraph_ex.CompilerConfig()
    cfg.mode = "npugraph_ex"
    previous = getattr(cfg.post_grad_custom_post_pass, "value", None)
    if not getattr(previous, "_offload_passes_split", False):
        def split(gm, example_inputs, config):
            split_install_chains(gm)

        chained = _chain(previous, split)
        chained._offload_passes_split = True
        cfg.post_grad_custom_post_pass = chained
    return cfg


def lower_npugraph_ex(gm: fx.GraphModule, example_inputs: Sequence[Any], compiler_config: Any = None,
                      npu_options: Optional[Mapping[str, Any]] = None, **kwargs: Any) -> Callable:
    """Compile with npugraph_ex (reinplace pairs registered, install chains split before reinplace).

    ``npu_options`` are npugraph_ex options (``torch.compile(..., options=...)`` names); a user
    ``post_grad_custom_post_pass`` among them runs before ours. ``clone_input`` defaults to False: the
    offload state is mutated in place every step (the recipe does the same).
    """
    import npugraph_ex

    from . import converters

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


def recipe_compiler_config(mode: str) -> Any:
    """The compiler settings cann-recipes' GLM-5.2 runner uses for ``mode`` (spec/torchair.md §1).

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
        cfg.frozen_parameter = True
        return cfg
    raise ValueError(f"mode must be one of {NPU_MODES}, got {mode!r}")


def _with_ge_dump(cfg: Any, folder: Path) -> Any:
    """TorchAir's own GE graph dump (GraphDef text, written when the graph is first run) into ``folder``."""
    import torchair

    cfg = cfg if cfg is not None else torchair.CompilerConfig()
    if cfg.debug.graph_dump.type.value is None:  # never override a dump the user asked for
        folder.mkdir(parents=True, exist_ok=True)
        cfg.debug.graph_dump.type = "txt"  # protobuf text of the GraphDef
        cfg.debug.graph_dump.path = str(folder)
    return cfg


class NpuOffloadBackend:
    """``torch.compile(model, backend=NpuOffloadBackend(exe_mode="ge_graph", pool_size=8192))``.

    ``compiler_config``: a ``torchair.CompilerConfig`` (ge_graph) or ``npugraph_ex.CompilerConfig``;
    ``npu_options``: npugraph_ex options; ``side_stream``: move installs to a side stream (default).
    Exposes ``reports``, ``states``, ``state`` and ``reset_state(rows=None)`` like the CPU backend
    (not ``reset``: ``torch._dynamo.reset()`` calls ``backend.reset()``). With
    ``dump_dir`` the Dynamo and rewritten graphs and ``report.json`` are written as on CPU, plus (ge_graph)
    TorchAir's GE graph dump ``<dump_dir>/<graph_id>/dynamo_optimized_*.txt``.
    """

    def __init__(self, options: OffloadOptions | Mapping | str | Path | None = None, *,
                 compiler_config: Any = None, npu_options: Optional[Mapping[str, Any]] = None,
                 side_stream: bool = True, **kw: Any):
        self.options = OffloadOptions.from_any(options, **kw)
        if self.options.exe_mode not in NPU_MODES:
            raise ValueError(f"exe_mode must be one of {NPU_MODES} for the NPU backend, got "
                             f"{self.options.exe_mode!r}")
        self.compiler_config = compiler_config
        self.npu_options = dict(npu_options or {})
        self.side_stream = side_stream
        self.reports: list = []
        # weak: the compiled artifact owns its state; a dropped graph must not keep its pools alive
        self._states: "weakref.WeakValueDictionary[int, OffloadState]" = weakref.WeakValueDictionary()
        self._next = 0

    @property
    def states(self) -> List[OffloadState]:
        return [self._states[k] for k in sorted(self._states.keys())]

    @property
    def state(self) -> Optional[OffloadState]:
        live = self.states
        return live[-1] if live else None

    def reset_state(self, rows: Optional[Sequence[int]] = None) -> None:
        for st in self.states:
            st.reset(rows)

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
        from . import converters
        from .backend import _new_graph_id, rewrite_for_offload

        from .dump import Dumper

        mode = self.options.exe_mode
        if mode == "ge_graph":
            converters.register_ge()
        else:
            converters.register_npugraph_ex()
        graph_id = _new_graph_id()
        dump_dir = self.options.resolved_dump_dir
        dumper = Dumper(dump_dir) if dump_dir else None
        if dumper:
            dumper.graph(graph_id, "dynamo", gm)
        hook = None
        if self.side_stream:
            hook = ge_install_hook() if mode == "ge_graph" else acl_install_hook(graph_id)
        gm, state, report = rewrite_for_offload(gm, example_inputs, self.options, install_hook=hook,
                                                graph_id=graph_id)
        report["mode"] = mode
        report["side_stream"] = bool(hook) and state is not None
        self.reports.append(report)
        if state is not None:
            self._states[self._next] = state
            self._next += 1
        if dumper:
            if state is not None:
                dumper.graph(graph_id, "rewrite", gm)
            dumper.report(report)
        if mode == "ge_graph":
            cfg = self.compiler_config
            if dumper:
                cfg = _with_ge_dump(cfg, Path(dump_dir) / graph_id)
            compiled = lower_ge_graph(gm, example_inputs, cfg, **kwargs)
        else:
            compiled = lower_npugraph_ex(gm, example_inputs, self.compiler_config, self.npu_options, **kwargs)
        if state is None:
            return compiled

        def run(*args: Any) -> Any:
            return compiled(*args)

        run.offload_state = state  # the compiled artifact owns its state (the backend holds it weakly)
        return run


def make_npu_backend(config: OffloadOptions | Mapping | str | Path | None = None, **kw: Any) -> NpuOffloadBackend:
    """The NPU-mode backend from options / recipe yaml (``exe_mode`` must be ge_graph or npugraph_ex)."""
    return NpuOffloadBackend(config, **kw)
