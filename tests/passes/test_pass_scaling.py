"""Pass cost grows linearly with the graph: structural operation counts, never wall time.

The same IndexShare unit (``FFSS``: a singleton group and an FSS group) is compiled twice, 2 and 4
units long (8 / 16 layers). While a pass runs we count the nodes yielded by every ``Graph.nodes``
walk, ``Node.prev`` / ``Node.next`` steps, ``lint`` / ``recompile`` / ``python_code`` calls and every
Python function call (cProfile's call count, exact). A pass that rescans the graph per site
(``list(graph.nodes).index(n)``, a per-site users walk over the whole graph ...) makes these counts
grow with the square of the layer count, ~x4 for x2 layers; a linear pass stays at ~x2.

The converter-side passes of the NPU lowerings are measured the same way on the graphs those lowerings
hand them for the same unit (its KV writes in the GLM model's flat form, which ge_graph lowers): the
npugraph_ex post-grad FX passes (``inplace_masked_input_updates``, ``cache_writes_in_place``,
``split_install_chains``, ``clone_input_copy_sources``), ge_graph's ``cache_writes_to_scatter_nd`` and ``drop_dsa_copies`` on the GE
graph (node visits = ops yielded by ``graph.op`` walks). The graphs come from TorchAir's / npugraph_ex's
real pipelines (the test copies of tests/converters, CANN-linked modules replaced by TEST DOUBLES).
"""
from __future__ import annotations

import copy
import cProfile
import gc
import pstats
from pathlib import Path
from collections import Counter
from typing import Any, Callable

import pytest
import torch
from torch import fx
from torch.fx._lazy_graph_module import _LazyGraphModule

import dsa_synth as synth
from backend_helpers import load_file
import offload_passes.backend as backend_mod
from offload_passes.backend import make_offload_backend
from offload_passes.custom_ops import spec_for

PS = 64
UNIT = "FFSS"
SIZES = (2, 4)  # units: 8 and 16 layers
PASSES = ("detect", "group", "plan_pass", "rewrite", "reinplace")
import offload_passes.lowering.cpu as lowering_mod  # noqa: E402
import offload_passes.passes.frontends.recipe as recipe_mod  # noqa: E402
import offload_passes.pipeline as pipeline_mod  # noqa: E402

#: pass -> (module whose global the pipeline calls it through, attribute)
PASS_SITES = {"detect": (recipe_mod, "detect"), "group": (pipeline_mod, "group"),
              "plan_pass": (recipe_mod, "check_preconditions"),
              "rewrite": (pipeline_mod, "rewrite"), "reinplace": (lowering_mod, "reinplace")}


class _Walks:
    """``graph.nodes`` replacement that counts the nodes it yields while a pass is active."""

    def __init__(self, inner: Any, counter: "PassCounter"):
        self.inner, self.counter = inner, counter

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self):
        for n in self.inner:
            self.counter.hit("node_visits")
            yield n

    def __reversed__(self):
        for n in reversed(self.inner):
            self.counter.hit("node_visits")
            yield n


class PassCounter:
    """Operation counts per pass (only while one of the wrapped passes runs)."""

    def __init__(self) -> None:
        self.current: str | None = None
        self.counts: dict[str, Counter] = {}
        self.gc_enabled_in_pass: list[bool] = []

    def hit(self, what: str, n: int = 1) -> None:
        if self.current is not None:
            self.counts.setdefault(self.current, Counter())[what] += n

    def install(self, mp: pytest.MonkeyPatch) -> None:
        nodes = fx.Graph.nodes.fget
        counter = self
        mp.setattr(fx.Graph, "nodes", property(
            lambda g: _Walks(nodes(g), counter) if counter.current is not None else nodes(g)))
        for name in ("prev", "next"):
            get = getattr(fx.Node, name).fget

            def step(node, _get=get):
                counter.hit("prev_next")
                return _get(node)
            mp.setattr(fx.Node, name, property(step))
        self._count_call(mp, fx.Graph, "lint", "lint")
        self._count_call(mp, fx.Graph, "python_code", "python_code")
        for cls in (fx.GraphModule, _LazyGraphModule):
            raw = cls.__dict__["recompile"]
            if isinstance(raw, classmethod):
                f = raw.__func__

                def cw(c, *a, _f=f, **k):
                    counter.hit("recompile")
                    return _f(c, *a, **k)
                mp.setattr(cls, "recompile", classmethod(cw))
            else:
                self._count_call(mp, cls, "recompile", "recompile")
        for name in PASSES:
            mod, attr = PASS_SITES[name]
            mp.setattr(mod, attr, self._wrap(name, getattr(mod, attr)))

    def _count_call(self, mp: pytest.MonkeyPatch, cls: type, attr: str, key: str) -> None:
        orig = cls.__dict__[attr]
        counter = self

        def w(*a, **k):
            counter.hit(key)
            return orig(*a, **k)
        mp.setattr(cls, attr, w)

    def measure(self, name: str, fn: Callable, *args: Any) -> Any:
        """Run ``fn(*args)`` as pass ``name`` (counted like the wrapped backend passes)."""
        return self._wrap(name, fn)(*args)

    def _wrap(self, name: str, fn: Callable) -> Callable:
        def run(*a, **k):
            self.gc_enabled_in_pass.append(gc.isenabled())
            prof = cProfile.Profile()
            self.current = name
            prof.enable()
            try:
                return fn(*a, **k)
            finally:
                prof.disable()
                self.current = None
                self.hit_for(name, "calls", pstats.Stats(prof).total_calls)
        return run

    def hit_for(self, name: str, what: str, n: int) -> None:
        self.counts.setdefault(name, Counter())[what] += n


@pytest.fixture(scope="module")
def scaling():
    out = {}
    gc_before = gc.isenabled()
    for units in SIZES:
        torch._dynamo.reset()
        cfg = synth.SynthConfig(pattern=UNIT * units, S=1, router=False)
        base, m = synth.make_pair(cfg, [300, 280])
        be = make_offload_backend(pool_size=PS)
        counter = PassCounter()
        graphs: dict[str, int] = {}
        with pytest.MonkeyPatch.context() as mp:
            counter.install(mp)
            orig_reinplace = lowering_mod.reinplace

            def reinplace(graph, _orig=orig_reinplace):
                graphs["aot"] = len(graph.nodes)
                return _orig(graph)
            mp.setattr(lowering_mod, "reinplace", reinplace)
            orig_detect = recipe_mod.detect

            def detect(gm, _orig=orig_detect):
                graphs["dynamo"] = len(gm.graph.nodes)
                return _orig(gm)
            mp.setattr(recipe_mod, "detect", detect)
            with torch.no_grad():
                L = torch.tensor([301, 281])
                h1, a1 = torch.compile(m, backend=be)(*m.inputs(L, 0))
                h0, a0 = base(*base.inputs(L, 0))
        out[units] = {"counts": counter.counts, "gc": counter.gc_enabled_in_pass, "nodes": graphs,
                      "report": be.reports[-1], "max_a": float((a0 - a1).abs().max()), "layers": len(cfg.pattern)}
    out["gc_after"] = gc.isenabled() == gc_before
    return out


def test_both_sizes_rewritten(scaling):
    for units in SIZES:
        r = scaling[units]
        rep = r["report"]
        assert rep["rewritten"] and rep["reinplace"]["kept_functional"] == []
        assert [len(g["layers"]) for g in rep["groups"]] == [1, 3] * units
        assert len(rep["sites"]) == r["layers"] and r["max_a"] == 0
        assert set(r["counts"]) == set(PASSES)


def assert_walks_linear(small: dict, big: dict, passes: tuple, graph_key: Callable[[str], str]) -> None:
    """Node visits of each pass at the two sizes (``graph_key(pass)``: which graph's size it is held to)."""
    for p in passes:
        n_small, n_big = small["nodes"][graph_key(p)], big["nodes"][graph_key(p)]
        v_small, v_big = small["counts"][p]["node_visits"], big["counts"][p]["node_visits"]
        # a bounded number of whole-graph walks per pass (no walk per site); the rewrite's walks (hoist,
        # lint) cover the graph it grew (plan, serves, installs, guards, invalidation), hence 7 not 6 ...
        assert v_big <= 7 * n_big, f"{p}: {v_big} node visits on a {n_big}-node graph"
        # ... so visits grow like the graph (x~2 here), never like its square (x~4)
        assert v_big <= 1.15 * v_small * n_big / n_small, (p, v_small, v_big, n_small, n_big)
        assert big["counts"][p]["prev_next"] <= 4, f"{p}: walks the graph through Node.prev/next"


def assert_calls_linear(small: dict, big: dict, passes: tuple) -> None:
    grow = SIZES[1] / SIZES[0]
    for p in passes:
        c_small, c_big = small["counts"][p]["calls"], big["counts"][p]["calls"]
        assert c_small > 0
        # every per-site walk (users, views, ancestors) makes Python calls: quadratic work shows here
        assert c_big <= 1.15 * grow * c_small, (p, c_small, c_big)


def test_graph_walks_are_linear(scaling):
    assert_walks_linear(scaling[SIZES[0]], scaling[SIZES[1]], PASSES,
                        lambda p: "aot" if p == "reinplace" else "dynamo")


def test_python_work_is_linear(scaling):
    assert_calls_linear(scaling[SIZES[0]], scaling[SIZES[1]], PASSES)


def test_codegen_and_lint_once(scaling):
    for units in SIZES:
        c = scaling[units]["counts"]
        assert c["rewrite"]["recompile"] == 1 and c["rewrite"]["lint"] <= 1
        assert c["reinplace"]["recompile"] == 0 and c["reinplace"]["lint"] <= 1
        for p in ("detect", "group", "plan_pass"):
            assert c[p]["recompile"] == 0 and c[p]["lint"] == 0
        assert all(c[p]["python_code"] == 0 for p in PASSES)  # codegen is lazy, paid once by the compiler


def test_gc_paused_in_passes_and_restored(scaling):
    for units in SIZES:
        assert scaling[units]["gc"] and not any(scaling[units]["gc"])
    assert scaling["gc_after"]


# ------------------------------------------------------------------ converter passes (NPU lowerings)

NPUGRAPH_EX_PASSES = ("inplace_masked_input_updates", "cache_writes_in_place", "split_install_chains",
                      "clone_input_copy_sources")
GE_FX_PASSES = ("cache_writes_to_scatter_nd",)
GE_GRAPH_PASSES = ("drop_dsa_copies",)
CONVERTER_PASSES = NPUGRAPH_EX_PASSES + GE_FX_PASSES + GE_GRAPH_PASSES


class _GeOps:
    """A GE graph's ``op`` field that counts the ops its walks yield."""

    def __init__(self, inner: Any, counter: PassCounter):
        self.inner, self.counter = inner, counter

    def __iter__(self):
        for o in self.inner:
            self.counter.hit("node_visits")
            yield o

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> Any:
        return self.inner[i]

    def __delitem__(self, i: int) -> None:
        del self.inner[i]

    def remove(self, op: Any) -> None:
        self.counter.hit("node_visits", len(self.inner))  # a search over the field
        self.inner.remove(op)


class _GeGraphView:
    def __init__(self, proto: Any, counter: PassCounter):
        self.op = _GeOps(proto.op, counter)


def _npu_toolchain():
    """TorchAir and npugraph_ex test copies with the CANN test doubles, our converters registered (the
    helpers of tests/npu_doubles.py)."""
    import npu_doubles as cf
    site = cf.torchair_site_or_skip()
    cf.torchair_env.activate(site)
    cf._install_torchair_standins()
    stub = cf._load_standin("torch_npu_stub")
    with stub.installed(), cf._keep_signal_handlers():
        import npugraph_ex
        import npugraph_ex._acl_concrete_graph.graph_pass  # noqa: F401
        import npugraph_ex._acl_concrete_graph.static_kernel  # noqa: F401
        import npugraph_ex.ops._tagged_event  # noqa: F401
        import npugraph_ex.scope  # noqa: F401
    from offload_passes import converters

    converters.register_all()
    return npugraph_ex, stub


def _capture_npu_graphs(units: int, npugraph_ex: Any, stub: Any, mode: str) -> dict:
    """The graphs the lowering of ``mode`` hands our passes, copied before the first of them runs."""
    from google.protobuf import message as pb

    from offload_passes import _compat
    from offload_passes.converters import ge_ref_patch
    from offload_passes.passes import cache_writes, npu_install_chains

    cfg = synth.SynthConfig(pattern=UNIT * units, S=1, router=False, flat_cache_writes=True)
    _, m = synth.make_pair(cfg, [300, 280])
    got: dict = {}

    def keep(key: str, fn: Callable) -> Callable:
        def spy(graph):
            if isinstance(getattr(graph, "_proto", graph), pb.Message):
                proto = type(graph._proto)()
                proto.CopyFrom(graph._proto)
                got[key] = proto
            else:
                got[key] = copy.deepcopy(graph)
            return fn(graph)
        return spy

    torch._dynamo.reset()
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        L = torch.tensor([301, 281])
        if mode == "ge_graph":
            mp.setattr(cache_writes, "cache_writes_to_scatter_nd",
                       keep("ge_fx", cache_writes.cache_writes_to_scatter_nd))
            mp.setattr(ge_ref_patch, "drop_dsa_copies", keep("ge", ge_ref_patch.drop_dsa_copies))
            be = make_offload_backend(exe_mode="ge_graph", pool_size=PS)
            with pytest.raises(RuntimeError, match="GE graphs cannot be compiled without CANN"):
                torch.compile(m, backend=be)(*m.inputs(L, 0))
        else:
            mp.setattr(npu_install_chains, "inplace_masked_input_updates",
                       keep("ngx_fx", npu_install_chains.inplace_masked_input_updates))
            ncfg = npugraph_ex.CompilerConfig()
            _compat.set_npugraph_ex_option(ncfg, "pattern_fusion_pass", False)  # traces torch.ops.npu kernels
            be = make_offload_backend(exe_mode="npugraph_ex", pool_size=PS, compiler_config=ncfg)
            with stub.installed(), pytest.raises(RuntimeError, match=stub.CAPTURE_UNAVAILABLE):
                torch.compile(m, backend=be)(*m.inputs(L, 0))
    assert be.reports[-1]["rewritten"], be.reports[-1]["refusals"]
    got["layers"] = len(cfg.pattern)
    return got


def _measure_converter_passes(graphs: dict) -> dict:
    """Each pass on (a copy of) the graph its lowering gave it, in the lowering's order."""
    from offload_passes.converters import ge_ref_patch
    from offload_passes.passes import cache_writes, npu_install_chains

    counter = PassCounter()
    out: dict = {"nodes": {}, "results": {}}
    with pytest.MonkeyPatch.context() as mp:
        counter.install(mp)
        gm = copy.deepcopy(graphs["ngx_fx"])
        out["nodes"]["ngx_fx"] = len(gm.graph.nodes)
        for name in NPUGRAPH_EX_PASSES:
            out["results"][name] = counter.measure(name, getattr(npu_install_chains if name != "cache_writes_in_place"
                                                                  else cache_writes, name), gm)
        out["ngx_after"] = gm
        gm = copy.deepcopy(graphs["ge_fx"])
        out["nodes"]["ge_fx"] = len(gm.graph.nodes)
        out["results"]["cache_writes_to_scatter_nd"] = counter.measure(
            "cache_writes_to_scatter_nd", cache_writes.cache_writes_to_scatter_nd, gm)
        proto = type(graphs["ge"])()
        proto.CopyFrom(graphs["ge"])
        out["nodes"]["ge"] = len(proto.op)
        out["ge_before"] = graphs["ge"]
        out["results"]["drop_dsa_copies"] = counter.measure("drop_dsa_copies", ge_ref_patch.drop_dsa_copies,
                                                            _GeGraphView(proto, counter))
        out["ge_after"] = proto
    out["counts"] = counter.counts
    out["layers"] = graphs["layers"]
    return out


@pytest.fixture(scope="module")
def converter_scaling():
    npugraph_ex, stub = _npu_toolchain()
    graphs = {units: {} for units in SIZES}
    for mode in ("ge_graph", "npugraph_ex"):  # all GE compiles first: TorchAir and npugraph_ex patch ATen alike
        for units in SIZES:
            graphs[units].update(_capture_npu_graphs(units, npugraph_ex, stub, mode))
    return {units: _measure_converter_passes(graphs[units]) for units in SIZES}


def _graph_key(p: str) -> str:
    return "ngx_fx" if p in NPUGRAPH_EX_PASSES else "ge_fx" if p in GE_FX_PASSES else "ge"


def test_converter_passes_rewrite_every_site_at_both_sizes(converter_scaling):
    install = torch.ops.custom.dsa_install_functional.default
    meta = [spec_for("dsa_install").arg_names.index(m) for m in ("pool_ids", "id_to_slot", "lru_counter")]
    for units in SIZES:
        r = converter_scaling[units]
        n_layers, res = r["layers"], r["results"]
        # the new-request invalidation of each group's three metadata tensors (two groups per FFSS unit)
        assert res["inplace_masked_input_updates"] == 3 * 2 * units
        # FFSS: every shared layer's metadata_update=0 install starts a chain, split once
        assert res["split_install_chains"] == 2 * units
        # each group's seen_len.copy_(L), L being a graph input here (npugraph_ex 2.8 cannot take that)
        assert res["clone_input_copy_sources"] == 2 * units
        assert not [n for n in r["ngx_after"].graph.nodes if n.target is torch.ops.aten.copy_.default
                    and n.args[1].op in ("placeholder", "get_attr")]
        # every layer's two full-cache writes, plus the indexer key cache of each owner layer
        assert len(res["cache_writes_in_place"].in_place) == 2 * n_layers + 2 * units and not \
            res["cache_writes_in_place"].left
        assert len(res["cache_writes_to_scatter_nd"].in_place) == 2 * n_layers + 2 * units
        # TorchAir's own pass leaves the installs' five copies; ours removes all of them
        moves = [o for o in r["ge_before"].op if o.type == "TensorMove"]
        assert res["drop_dsa_copies"] == len(moves) == 5 * n_layers
        assert not [o for o in r["ge_after"].op if o.type == "TensorMove"]
        # after the split every install reads the group metadata from the graph inputs themselves
        installs = [n for n in r["ngx_after"].graph.nodes if n.target is install]
        assert len(installs) == n_layers
        for n in installs:
            assert all(n.args[i].op == "placeholder" for i in meta), n.format_node()
        assert set(r["counts"]) == set(CONVERTER_PASSES)


def test_converter_graph_walks_are_linear(converter_scaling):
    assert_walks_linear(converter_scaling[SIZES[0]], converter_scaling[SIZES[1]], CONVERTER_PASSES, _graph_key)


def test_converter_python_work_is_linear(converter_scaling):
    assert_calls_linear(converter_scaling[SIZES[0]], converter_scaling[SIZES[1]], CONVERTER_PASSES)


def test_converter_fx_passes_lint_and_recompile_once(converter_scaling):
    for units in SIZES:
        c = converter_scaling[units]["counts"]
        for p in NPUGRAPH_EX_PASSES + GE_FX_PASSES:  # each rewrote something (checked above)
            assert c[p]["recompile"] == 1 and c[p]["lint"] == 1, (p, c[p])
        assert c["drop_dsa_copies"]["recompile"] == 0 and c["drop_dsa_copies"]["lint"] == 0
