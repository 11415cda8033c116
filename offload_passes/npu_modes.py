"""NPU execution modes of the offload backend: ``ge_graph`` (TorchAir GE) and ``npugraph_ex`` (ACL graph).

Both run in the one backend core (``offload_passes.backend.OffloadBackend``: rewrite, state binding and
the stale-state rule, dumps, reports) with :class:`NpuLowering` as their lowering, which hands the
rewritten Dynamo graph to torch_npu's own backend, so all of TorchAir's handling
(stream/event rewriting, decompositions, AOT with input mutations, reinplace, converters, static /
frozen inputs) is kept:

* ``ge_graph``   -> ``torchair.get_npu_backend(compiler_config)``; our GE converters and the DSA ref-copy
  elimination are registered first (:mod:`offload_passes.converters`);
* ``npugraph_ex`` -> ``npugraph_ex.get_npu_backend(compiler_config)`` with ``mode="npugraph_ex"``, our
  reinplace pairs registered and ``split_install_chains`` chained into ``post_grad_custom_post_pass``.

Side stream (docs/ops.md §5), the schedule the reference runs: each layer's installs (md=0 for a shared
layer; on the group's last layer also the owner's md=1 install, after it on the same stream) may start
as soon as that layer's ``dsa_serve`` has finished, so they overlap the layer's SFA and MoE:

* npugraph_ex: right after the serve, ``record_tagged_stream_`` of every intermediate the installs read
  (the plan's install records), ``tagged_event_record(ready)`` on the main stream, then
  ``scope_enter(_user_stream_label)``, ``tagged_event_wait(ready)``, the installs,
  ``tagged_event_record(done)``, ``scope_exit``. The main stream waits on ``done`` before the first later
  main-stream node that touches what the installs write or writes what they read (in the decode graph:
  none, so before the graph output; the next step's plan and serves are the next call) — the join the
  recipe lacks;
* ge_graph: ``air.record()`` right after the serve (a control edge from the serve), then
  ``air.scope_enter`` with the stream label, ``air.wait([record])``, the installs, ``air.scope_exit``.
  GE finishes every stream of a graph before the run returns, and the install refs feed the graph
  outputs, so the join is the end of the run.

Per-step bookkeeping (the pool statistics and the ledger update) is main-stream work the reference does
not do: off by default in these modes, ``npu_bookkeeping=True`` keeps it. In ge_graph the model's
KV-cache writes become ``ScatterNdUpdate`` on the cache inputs (:mod:`offload_passes.passes.cache_writes`),
which GE runs in place.

Nothing here imports torch_npu / TorchAir at import time; CPU users never need them.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, List, Mapping, Optional, Sequence

import torch
from torch import fx

from . import _compat
from .custom_ops import spec_for
from .modes import NPU_EXE_MODES, check_exe_mode
from .options import OffloadOptions
from .state import OffloadState

log = logging.getLogger("offload_passes.npu_modes")

#: Stream label of the install side stream (``_user_stream_label``).
SIDE_STREAM_LABEL = "dsa_offload_install"

__all__ = ["NpuLowering", "lower_ge_graph", "lower_npugraph_ex", "recipe_compiler_config",
           "acl_install_hook", "ge_install_hook", "AclInstallHook", "GeInstallHook", "strip_bookkeeping", "ge_config",
           "npugraph_ex_config", "SIDE_STREAM_LABEL"]


# ----------------------------------------------------------------------------------------- helpers


def _is_graph_input(n: Any) -> bool:
    return isinstance(n, fx.Node) and n.op in ("placeholder", "get_attr")


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

_INSTALL, _SERVE = spec_for("dsa_install"), spec_for("dsa_serve")
#: Install arguments (positional, schema order) the install writes (pools and group metadata) / only
#: reads (records, selection buffers and table): from the op's schema.
_INSTALL_WRITES = _INSTALL.mutated_positions
_INSTALL_READS = tuple(_INSTALL.arg_names.index(a) for a in (
    "install_records", "selection_kv_cache", "selection_k_rope", "selection_kv_block_table"))
_INSTALL_SELECTION = _INSTALL.arg_names.index("selection_kv_cache")
_SERVE_SELECTION = _SERVE.arg_names.index("selection_kv_cache")


def _base(n: Any) -> Any:
    from .passes import _fx

    return _fx.strip_views(n)


def _serve_of(install: fx.Node) -> Optional[fx.Node]:
    """The serve that filled the selection buffer this install reads (its layer's serve)."""
    sel = _base(install.args[_INSTALL_SELECTION])
    # a paged group (passes/frontend_recipe.py) keeps the model's gather after the serve: it writes the
    # rest of the selection buffer, so the installs start after it
    for u in sel.users:
        if "npu_gather_selection_kv_cache" in str(u.target) and any(_base(a) is sel for a in u.args[:2]):
            return u
    for u in sel.users:
        if "dsa_serve" in str(u.target) and len(u.args) > _SERVE_SELECTION and _base(u.args[_SERVE_SELECTION]) is sel:
            return u
    return None


def _last_serve(installs: list) -> fx.Node:
    """The serve the installs may start after: that of ``installs[0]``'s layer (the layer the hook is
    called for; the owner's md=1 install that may follow belongs to an earlier serve)."""
    serve = _serve_of(installs[0])
    if serve is None:
        raise RuntimeError(f"no dsa_serve found for the installs {[i.name for i in installs]}")
    return serve


def _written_bases(n: fx.Node) -> set:
    """Graph tensors ``n`` writes in place (through views): mutable schema args, ``x.op_()`` methods."""
    out = set()
    if n.op == "call_method" and str(n.target).endswith("_") and n.args:
        out.add(_base(n.args[0]))
    elif n.op == "call_function":
        t = n.target
        if "record_tagged_stream" in str(t):
            return out  # declared (a!) but only registers the tensor with a stream
        if isinstance(t, _compat.OpOverloadPacket):
            t = getattr(t, t.overloads()[0])
        if isinstance(t, _compat.OpOverload):
            for i, a in enumerate(t._schema.arguments):
                if a.alias_info is not None and a.alias_info.is_write:
                    v = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
                    if isinstance(v, fx.Node):
                        out.add(_base(v))
        elif getattr(t, "__name__", "").endswith("_") and n.args:  # e.g. torch.Tensor.index_put_
            out.add(_base(n.args[0]))
    return out


def _read_bases(n: fx.Node) -> set:
    return {_base(a) for a in n.all_input_nodes}


#: MC2's MoE dispatch / combine (any namespace): collectives too.
MC2_OPS = ("npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2")
#: What npugraph_ex decomposes ``_c10d_functional.all_to_all_single`` into (its HCOM all-to-all op).
NPUGRAPH_EX_COLLECTIVES = {("npu_define", "all_to_all_single_npu"): "all_to_all_single"}


def namespace_and_op(n: fx.Node) -> tuple:
    """``(namespace, op)`` of a call to a torch op (overload or packet), else ``("", "")``."""
    t = n.target
    if isinstance(t, _compat.OpOverload):
        qual = t.name()
    elif isinstance(t, _compat.OpOverloadPacket):
        qual = t._qualified_op_name
    else:
        return "", ""
    ns, _, op = qual.partition("::")
    return ns, op.split(".")[0]


def is_collective(n: fx.Node) -> bool:
    """A ``_c10d_functional`` collective (``wait_tensor`` excluded) or an MC2 dispatch / combine.

    Every rank must issue its collectives in the same order, so no side-stream scope may contain one
    and every join is placed before the first collective after its scope (multi-rank decode graphs).
    """
    if n.op != "call_function":
        return False
    ns, op = namespace_and_op(n)
    return (ns == "_c10d_functional" and op != "wait_tensor") or op in MC2_OPS or (ns, op) in NPUGRAPH_EX_COLLECTIVES


def _join_points(graph: fx.Graph, pending: List[tuple]) -> dict:
    """For each ``(installs, scope_exit, tag)``: the node before which the main stream must wait for the
    installs — the first later main-stream node that reads or writes what they write (pools, metadata)
    or writes what they read (records, selection buffers), or is a collective (:func:`is_collective`:
    the side stream never runs across one), else the graph output (the next step's plan and serves are
    the next call). One walk over the graph."""
    hazards = []  # (exit node, writes, reads, tag)
    for installs, ex, tag in pending:
        writes = {_base(i.args[k]) for i in installs for k in _INSTALL_WRITES if k < len(i.args)}
        reads = {_base(i.args[k]) for i in installs for k in _INSTALL_READS if k < len(i.args)}
        hazards.append((ex, writes, reads, tag))
    exits = {h[0]: h for h in hazards}
    out: dict = {}
    open_: List[tuple] = []
    all_w: set = set()
    all_r: set = set()
    depth = 0
    for n in graph.nodes:
        name = str(n.target)
        if n in exits:
            open_.append(exits[n])
            all_w |= exits[n][1]
            all_r |= exits[n][2]
        if n.op == "output":
            for h in open_:
                out[h[3]] = n
            break
        if name.endswith("scope_enter.default"):
            depth += 1
        elif name.endswith("scope_exit.default"):
            depth -= 1
        elif depth == 0 and open_ and is_collective(n):
            for h in open_:
                out[h[3]] = n
            open_, all_w, all_r = [], set(), set()
        elif depth == 0 and open_ and n.op in ("call_function", "call_method"):
            w, r = _written_bases(n), _read_bases(n)
            if (w & (all_w | all_r)) or (r & all_w):
                hit = [h for h in open_ if (w & (h[1] | h[2])) or (r & h[1])]
                for h in hit:
                    out[h[3]] = n
                open_ = [h for h in open_ if h not in hit]
                all_w = set().union(*(h[1] for h in open_))
                all_r = set().union(*(h[2] for h in open_))
    return out


class AclInstallHook:
    """npugraph_ex side-stream hook (see module doc); call :meth:`finish` once the rewrite is done."""

    def __init__(self, graph_id: str, label: str = SIDE_STREAM_LABEL):
        tagged = _compat.npugraph_ex_tagged_event()  # registers tagged_event_* / record_tagged_stream
        import npugraph_ex.scope  # noqa: F401  (registers npugraph_ex.scope_enter / scope_exit)

        self._tagged = tagged
        self.graph_id = graph_id
        self.label = label
        self.pending: List[tuple] = []  # (installs, scope_exit node, done tag)

    def _tag(self, name: str) -> str:
        if name not in self._tagged._GLOBAL_TAG_TO_EVENT.keys():
            self._tagged._npu_create_tagged_event(name)
        return name

    def __call__(self, graph: fx.Graph, installs: list, layer: int) -> None:
        ops = _compat.npugraph_ex_ops()  # torch.ops.npugraph_ex (npu 2.13) or torch.ops.air (2.8)
        ready = self._tag(f"dsa_offload_{self.graph_id}_l{layer}_ready")
        done = self._tag(f"dsa_offload_{self.graph_id}_l{layer}_done")
        serve = _last_serve(installs)
        seen: List[fx.Node] = []
        for inst in installs:
            for a in inst.args:
                if isinstance(a, fx.Node) and not _is_graph_input(a) and a not in seen:
                    seen.append(a)
        # the whole block goes right after the serve: the side stream starts when serve is done and
        # runs beside the layer's SFA and MoE on the main stream
        anchor = serve
        for inst in installs:  # program order kept: md=0 installs of this layer, then the owner's md=1
            anchor.append(inst)
            anchor = inst
        first, last = installs[0], installs[-1]
        with graph.inserting_before(first):
            for t in seen:  # main-stream allocations read on the side stream (the plan's records)
                graph.call_function(ops.record_tagged_stream_.default, (t, self.label))
            graph.call_function(ops.tagged_event_record.default, (ready,))
            graph.call_function(ops.scope_enter.default, (["_user_stream_label"], [self.label]))
            graph.call_function(ops.tagged_event_wait.default, (ready,))
        with graph.inserting_after(last):
            ex = graph.call_function(ops.scope_exit.default, ())
        with graph.inserting_before(ex):
            graph.call_function(ops.tagged_event_record.default, (done,))
        self.pending.append((installs, ex, done))

    def finish(self, graph: fx.Graph) -> List[str]:
        """Place each layer's join (main stream waits on ``done``). Returns the node names joined before."""
        ops = _compat.npugraph_ex_ops()  # torch.ops.npugraph_ex (npu 2.13) or torch.ops.air (2.8)
        points = _join_points(graph, self.pending)
        where = []
        for _, _, done in self.pending:
            point = points[done]
            with graph.inserting_before(point):
                graph.call_function(ops.tagged_event_wait.default, (done,))
            where.append(point.name)
        self.pending.clear()
        return where


def acl_install_hook(graph_id: str, label: str = SIDE_STREAM_LABEL) -> AclInstallHook:
    return AclInstallHook(graph_id, label)


class GeInstallHook:
    """GE side-stream hook (see module doc): ``air.record()`` right after the layer's serve (a control
    edge from its last GE op), the installs moved right after it inside ``air.scope_enter`` with
    ``air.wait([record])`` first. GE completes every stream of a graph before a run returns, and the
    install ref outputs feed the graph outputs, so the join is the end of the run — unless a collective
    follows (multi-rank graphs): then an ``air.record()`` closes the scope and ``air.wait`` on it right
    before the first later collective gives that collective a control edge from the last install, so
    the side stream never runs across a collective."""

    def __init__(self, label: str = SIDE_STREAM_LABEL, priority: int = 0):
        import torchair  # noqa: F401  (registers air.scope_enter / scope_exit / record / wait)

        self.label = label
        self.priority = priority
        self.pending: List[tuple] = []  # (scope_exit node, done record node)

    def __call__(self, graph: fx.Graph, installs: list, layer: int) -> None:
        air = torch.ops.air
        serve = _last_serve(installs)
        anchor = serve
        for inst in installs:
            anchor.append(inst)
            anchor = inst
        first, last = installs[0], installs[-1]
        with graph.inserting_after(serve):
            rec = graph.call_function(air.record.default, ())
        with graph.inserting_before(first):
            graph.call_function(air.scope_enter.default, (
                ["_user_stream_label", "_user_stream_priority", "_enable_inner_parallel"],
                [self.label, str(self.priority), "True"]))
            graph.call_function(air.wait.default, ([rec],))
        with graph.inserting_after(last):
            ex = graph.call_function(air.scope_exit.default, ())
        with graph.inserting_before(ex):  # on the side stream: its last op is the last install
            done = graph.call_function(air.record.default, ())
        self.pending.append((ex, done))

    def finish(self, graph: fx.Graph) -> List[str]:
        """A main-stream ``air.wait`` before the first collective after each scope (none: the end of the
        run joins). Returns the node names joined before; unused done records are removed."""
        air = torch.ops.air
        exits = {ex: done for ex, done in self.pending}
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
        return where


def ge_install_hook(label: str = SIDE_STREAM_LABEL, priority: int = 0) -> GeInstallHook:
    return GeInstallHook(label, priority)


# ------------------------------------------------------------------------------------- bookkeeping


def strip_bookkeeping(gm: fx.GraphModule, stats_attrs: Sequence[str]) -> int:
    """Remove the in-graph per-step statistics (``copy_`` into the ``stats`` buffers and what only feeds
    it). Returns the number of nodes removed. Only pure ATen nodes are removed with it."""
    graph = gm.graph
    attrs = set(stats_attrs)
    roots = [n for n in graph.nodes if "copy_" in str(n.target) and n.args
             and isinstance(n.args[0], fx.Node) and n.args[0].op == "get_attr" and n.args[0].target in attrs]
    gone: set = set()
    todo: List[fx.Node] = []
    for r in roots:
        todo += r.all_input_nodes
        graph.erase_node(r)
        gone.add(r)
    while todo:
        n = todo.pop()
        if n in gone or n.users or n.op != "call_function":
            continue
        t = n.target
        if not isinstance(t, _compat.OpOverload) or t._schema.is_mutable or t.namespace != "aten":
            continue
        todo += n.all_input_nodes
        graph.erase_node(n)
        gone.add(n)
    for n in [n for n in graph.nodes if n.op == "get_attr" and n.target in attrs and not n.users]:
        graph.erase_node(n)
    graph.lint()
    gm.recompile()
    return len(gone)


# ------------------------------------------------------------------------------------------ lowering


def ge_config(compiler_config: Any = None) -> Any:
    """A ``torchair.CompilerConfig`` with the KV-cache write rewrite chained into ``post_grad_custom_pre_pass``.

    TorchAir has no GE converter for ``aten.index_put`` / ``index_copy`` (the model's cache writes), and an
    out-of-place form would write a full-cache-sized result every step;
    :func:`offload_passes.passes.cache_writes.cache_writes_to_scatter_nd` turns each write into a
    ``ScatterNdUpdate`` on the cache input, which TorchAir's ref-copy pass then runs in place.
    """
    import torchair

    from .passes.cache_writes import cache_writes_to_scatter_nd

    def cache_write(gm, example_inputs, config):
        cache_writes_to_scatter_nd(gm)

    cfg = compiler_config if compiler_config is not None else torchair.CompilerConfig()
    _chain_once(cfg, "post_grad_custom_pre_pass", "_offload_passes_cache_write", cache_write)
    return cfg


def lower_ge_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], compiler_config: Any = None,
                   custom_decompositions: Optional[Mapping] = None, **kwargs: Any) -> Callable:
    """Compile with TorchAir's GE backend (converters, ref-copy elimination and in-place cache writes)."""
    import torchair

    from . import converters

    converters.register_ge()
    cfg = ge_config(compiler_config)
    return torchair.get_npu_backend(compiler_config=cfg, custom_decompositions=dict(custom_decompositions or {}))(
        gm, example_inputs, **kwargs)


def npugraph_ex_config(compiler_config: Any = None) -> Any:
    """A ``npugraph_ex.CompilerConfig`` in ``npugraph_ex`` mode with our ``post_grad_custom_post_pass`` chained:
    masked metadata updates and KV-cache writes made in place on their inputs, install chains split."""
    import npugraph_ex

    from .passes.cache_writes import cache_writes_in_place
    from .passes.npu_install_chains import clone_input_copy_sources, inplace_masked_input_updates, split_install_chains

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
    The state stays buffers of the graph (``shared_state = False``): one private state per graph.
    """

    shared_state = False

    def __init__(self, mode: str, compiler_config: Any = None, npu_options: Optional[Mapping[str, Any]] = None,
                 side_stream: bool = True):
        check_exe_mode(mode, NPU_EXE_MODES, where=" for the NPU lowering")
        self.mode = mode
        self.compiler_config = compiler_config
        self.npu_options = dict(npu_options or {})
        self.side_stream = side_stream

    def prepare(self, options: OffloadOptions, graph_id: str, install_hook: Any = None) -> tuple:
        """Register the mode's converters; the rewrite's options and side-stream install hook."""
        from . import converters

        if self.mode == "ge_graph":
            converters.register_ge()
        else:
            converters.register_npugraph_ex()
        hook = None
        if self.side_stream:
            hook = ge_install_hook() if self.mode == "ge_graph" else acl_install_hook(graph_id)
        opts = options if options.npu_bookkeeping else options.replace(update_ledger=False)
        return opts, hook

    def after_rewrite(self, gm: fx.GraphModule, state: Optional[OffloadState], report: dict,
                      options: OffloadOptions, install_hook: Any) -> None:
        """Place the side stream's joins; strip the bookkeeping unless ``npu_bookkeeping``."""
        keep = options.npu_bookkeeping
        report.side_stream = bool(install_hook) and state is not None
        report.bookkeeping = bool(keep) and state is not None
        if state is None:
            return
        if install_hook is not None:
            report.joins_before = install_hook.finish(gm.graph)
            gm.recompile()
        if not keep:
            stats = [v for k, v in (report.buffers or {}).items() if k.startswith("stats_g")]
            report.bookkeeping_nodes_removed = strip_bookkeeping(gm, stats)

    def lower(self, gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: Any) -> Callable:
        """TorchAir's GE backend (with its GE graph dump into ``<dump_dir>/<graph_id>`` when dumping) or
        npugraph_ex. ``ctx``: the core's ``LowerContext`` (graph_id, dump_dir, kwargs)."""
        if self.mode == "ge_graph":
            cfg = self.compiler_config
            if ctx.dump_dir is not None:
                cfg = _with_ge_dump(cfg, Path(ctx.dump_dir) / ctx.graph_id)
            return lower_ge_graph(gm, example_inputs, cfg, **ctx.kwargs)
        return lower_npugraph_ex(gm, example_inputs, self.compiler_config, self.npu_options, **ctx.kwargs)
