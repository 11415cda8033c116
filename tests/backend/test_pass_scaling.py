"""Pass cost grows linearly with the graph: structural operation counts, never wall time.

The same IndexShare unit (``FFSS``: a singleton group and an FSS group) is compiled twice, 2 and 4
units long (8 / 16 layers). While a pass runs we count the nodes yielded by every ``Graph.nodes``
walk, ``Node.prev`` / ``Node.next`` steps, ``lint`` / ``recompile`` / ``python_code`` calls and every
Python function call (cProfile's call count, exact). A pass that rescans the graph per site
(``list(graph.nodes).index(n)``, a per-site users walk over the whole graph ...) makes these counts
grow with the square of the layer count, ~x4 for x2 layers; a linear pass stays at ~x2.
"""
from __future__ import annotations

import cProfile
import gc
import pstats
from collections import Counter
from typing import Any, Callable

import pytest
import torch
from torch import fx
from torch.fx._lazy_graph_module import _LazyGraphModule

import dsa_synth as synth
import offload_passes.backend as backend_mod
from offload_passes.backend import make_offload_backend

PS = 64
UNIT = "FFSS"
SIZES = (2, 4)  # units: 8 and 16 layers
PASSES = ("detect", "group", "plan_pass", "rewrite", "reinplace")  # names in offload_passes.backend


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
            mp.setattr(backend_mod, name, self._wrap(name, getattr(backend_mod, name)))

    def _count_call(self, mp: pytest.MonkeyPatch, cls: type, attr: str, key: str) -> None:
        orig = cls.__dict__[attr]
        counter = self

        def w(*a, **k):
            counter.hit(key)
            return orig(*a, **k)
        mp.setattr(cls, attr, w)

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
            orig_reinplace = backend_mod.reinplace

            def reinplace(graph, _orig=orig_reinplace):
                graphs["aot"] = len(graph.nodes)
                return _orig(graph)
            mp.setattr(backend_mod, "reinplace", reinplace)
            orig_detect = backend_mod.detect

            def detect(gm, _orig=orig_detect):
                graphs["dynamo"] = len(gm.graph.nodes)
                return _orig(gm)
            mp.setattr(backend_mod, "detect", detect)
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


def test_graph_walks_are_linear(scaling):
    small, big = scaling[SIZES[0]], scaling[SIZES[1]]
    for p in PASSES:
        key = "aot" if p == "reinplace" else "dynamo"
        n_small, n_big = small["nodes"][key], big["nodes"][key]
        v_small, v_big = small["counts"][p]["node_visits"], big["counts"][p]["node_visits"]
        # a bounded number of whole-graph walks per pass (no walk per site) ...
        assert v_big <= 6 * n_big, f"{p}: {v_big} node visits on a {n_big}-node graph"
        # ... so visits grow like the graph (x~2 here), never like its square (x~4)
        assert v_big <= 1.15 * v_small * n_big / n_small, (p, v_small, v_big, n_small, n_big)
        assert big["counts"][p]["prev_next"] <= 4, f"{p}: walks the graph through Node.prev/next"


def test_python_work_is_linear(scaling):
    small, big = scaling[SIZES[0]], scaling[SIZES[1]]
    grow = SIZES[1] / SIZES[0]
    for p in PASSES:
        c_small, c_big = small["counts"][p]["calls"], big["counts"][p]["calls"]
        assert c_small > 0
        # every per-site walk (users, views, ancestors) makes Python calls: quadratic work shows here
        assert c_big <= 1.15 * grow * c_small, (p, c_small, c_big)


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
