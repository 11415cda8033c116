"""Shared test helpers: run baseline vs compiled, pool invariants (docs/ops.md §8.4-8.5), graph checks."""
from __future__ import annotations

import importlib.util
import operator
import types
from pathlib import Path

import torch
from torch import fx

import dsa_synth as synth
from offload_passes.backend import make_offload_backend


def load_file(name: str, path: Path) -> types.ModuleType:
    """Import the Python file ``path`` as module ``name`` (scripts and other folders' helpers)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def full_row(buf: torch.Tensor, B: int, F: int | None = None) -> torch.Tensor:
    """Identity paged cache [blocks, BS, D] viewed as [B, F, D]; a 1-D empty rope (the no-rope mode) as
    [B, F, 0] (``F`` given: a zero-element tensor has no length of its own)."""
    if buf.numel() == 0 and F is not None:
        return buf.view(B, F, 0)
    return buf.view(B, -1, buf.size(-1))


def check_pool_state(state, B: int, full_of) -> int:
    """Assert docs/ops.md §8.4 (metadata consistency) and §8.5 (pool content); return resident entries.

    ``full_of(layer)`` gives that layer's full caches as ``(kv [B, F, Dkv], rope [B, F, Dr])``.
    """
    resident = 0
    for g in state.groups:
        pid, i2s, lru = g.pool_ids, g.id_to_slot, g.lru_counter
        PS = pid.size(1)
        NS = PS // 16
        assert int(lru.min()) >= 0 and int(lru.max()) <= 15
        fulls = {l: full_of(l) for l in g.layers}
        for b in range(B):
            ids = pid[b]
            slots = torch.nonzero(ids >= 0).flatten()
            xs = ids[slots].long()
            assert xs.unique().numel() == xs.numel(), "an id is resident twice"
            assert torch.equal(i2s[b, xs].long(), slots), "pool_ids -> id_to_slot not inverse"
            back = torch.nonzero(i2s[b] >= 0).flatten()
            assert torch.equal(pid[b, i2s[b, back].long()].long(), back), "id_to_slot -> pool_ids not inverse"
            assert torch.equal(slots // 16, xs & (NS - 1)), "slot not in the id's set"
            for l in g.layers:
                kv, rope = state.pools[l]
                fk, fr = fulls[l]
                assert torch.equal(kv[b, slots], fk[b, xs]), f"pool kv of layer {l} differs from full cache"
                assert torch.equal(rope[b, slots], fr[b, xs]), f"pool rope of layer {l} differs from full cache"
            resident += xs.numel()
    return resident


def check_pool_invariants(state, model: synth.SynthDSA) -> int:
    """``check_pool_state`` on the synthetic model's caches."""
    B = model.cfg.B
    def full_of(layer: int):
        kv = full_row(getattr(model, f"full_kv_{layer}"), B)
        return kv, full_row(getattr(model, f"full_rope_{layer}"), B, kv.size(1))

    return check_pool_state(state, B, full_of)


def check_ledger_layer(status: torch.Tensor, sel_kv: torch.Tensor, full_kv: torch.Tensor, S: int, K: int,
                       lengths: torch.Tensor, where: str = "") -> None:
    """One layer's gather ledger still describes its selection buffer after the rewrite (serve + in-graph
    ledger write): row r holds ``n = status[r, K]`` valid ids, -1 after them, each = its full-cache row.
    ``status [B, S, 1, K+1]``, ``sel_kv`` viewable as ``[B*S, K, D]``, ``full_kv`` as ``[B, F, D]``."""
    B = full_kv.size(0)
    st = status.reshape(B * S, K + 1)
    sel = sel_kv.reshape(B * S, K, -1)
    for r in range(B * S):
        n = int(st[r, K])
        ids = st[r, :n].long()
        assert n > 0 and bool((ids >= 0).all()) and bool((st[r, n:K] == -1).all()), f"{where} row {r}"
        assert torch.equal(sel[r, :n], full_kv[r // S, ids]), f"{where} row {r}: selection != full cache rows"
        assert int(ids.max()) < int(lengths[r // S])


def check_ledger(model: synth.SynthDSA, lengths: torch.Tensor) -> None:
    """``check_ledger_layer`` on every layer of the synthetic model."""
    cfg = model.cfg
    for l in range(len(cfg.pattern)):
        check_ledger_layer(getattr(model, f"sel_status_{l}"), getattr(model, f"sel_kv_{l}"),
                           full_row(getattr(model, f"full_kv_{l}"), cfg.B), cfg.S, cfg.K, lengths, f"layer {l}")


def run_pair(cfg: synth.SynthConfig, steps: int, backend=None, prefill=(300, 280), check_every: int = 1,
             compiled=None, pair=None, start_step: int = 0, lengths=None, reference=None):
    """Run the unmodified and the compiled model side by side; returns a dict of results.

    ``reference(base)`` (optional) wraps the unmodified model, e.g. ``torch.compile(base, backend="inductor")``
    so that a rewritten Inductor graph is compared with the unmodified graph under the same compiler.
    """
    base, m = pair if pair is not None else synth.make_pair(cfg, list(prefill))
    ref_fn = reference(base) if reference is not None else base
    backend = backend if backend is not None else make_offload_backend(pool_size=64)
    c = compiled if compiled is not None else torch.compile(m, backend=backend)
    L = torch.tensor(list(prefill)) if lengths is None else lengths
    max_h = max_a = 0.0
    resident = 0
    with torch.no_grad():
        for s in range(start_step, start_step + steps):
            L = L + cfg.S
            h0, a0 = ref_fn(*base.inputs(L, s))
            h1, a1 = c(*m.inputs(L, s))
            max_h = max(max_h, (h0 - h1).abs().max().item())
            max_a = max(max_a, (a0 - a1).abs().max().item())
            if backend.state is not None and (s - start_step) % check_every == 0:
                resident = check_pool_invariants(backend.state, m)
    # keep the state alive: the backend only holds weak references (the compiled graph owns it)
    # the final graph is kept only while its compiled graph lives (torch._dynamo.reset() frees it): take it now
    return {"base": base, "model": m, "compiled": c, "backend": backend, "max_h": max_h, "max_a": max_a,
            "lengths": L, "resident": resident, "state": backend.state, "final_graph": backend.final_graph()}


def ops_of(graph: fx.Graph, name: str) -> list[fx.Node]:
    out = []
    for n in graph.nodes:
        t = n.target
        if n.op == "call_function" and isinstance(t, torch._ops.OpOverload) and t._schema.name.split("::")[-1] == name:
            out.append(n)
    return out


def shape_of(n) -> tuple:
    v = n.meta.get("val", n.meta.get("example_value")) if isinstance(n, fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def big_shapes(cfg: synth.SynthConfig, pool_size: int) -> set:
    """Shapes of full caches, selection buffers and pools of the synthetic model."""
    blocks = cfg.B * cfg.maxblk
    nb = cfg.B * cfg.S * cfg.K // cfg.BS
    out = set()
    for d in (cfg.Dkv, cfg.Dr):
        out |= {(blocks, cfg.BS, d), (nb, cfg.BS, d), (cfg.B, pool_size, d), (cfg.B, cfg.maxblk * cfg.BS, d)}
    return out


def assert_final_graph(graph: fx.Graph, cfg: synth.SynthConfig | None, pool_size: int, groups: list[list[int]],
                       big: set | None = None):
    """Structural checks on the post-reinplace graph (``big``: buffer shapes that must never be copied;
    default: those of the synthetic model ``cfg``)."""
    names = [str(n.target) for n in graph.nodes if n.op == "call_function"]
    assert not [t for t in names if "_functional" in t], "functional twins left after reinplace"
    assert not ops_of(graph, "npu_gather_selection_kv_cache")
    plans, serves, installs = ops_of(graph, "dsa_plan"), ops_of(graph, "dsa_serve"), ops_of(graph, "dsa_install")
    sfas = ops_of(graph, "npu_sparse_flash_attention")
    n_layers = sum(len(g) for g in groups)
    assert len(plans) == len(groups) and len(serves) == n_layers and len(installs) == n_layers
    assert len(sfas) == n_layers
    big = big if big is not None else big_shapes(cfg, pool_size)
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        t = n.target
        if t is torch.ops.aten.copy_.default:
            assert shape_of(n.args[0]) not in big, f"{n.name} copies a cache/pool/selection buffer"
        if t in (torch.ops.aten.clone.default, torch.ops.aten.copy.default, torch.ops.aten.index_put.default,
                 torch.ops.aten.index_copy.default):
            assert shape_of(n) not in big, f"{n.name} ({t}) materialises a cache/pool/selection buffer"
    # ordering (program order == execution order on CPU)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for gi, layers in enumerate(groups):
        pl = plans[gi]
        g_serves = [serves[l] for l in layers]
        assert all(order[pl] < order[s] for s in g_serves), "plan after a serve of its group"
        # installs of this group read this plan's own records (getitem(plan, 1), never a copy)
        mine = [i for i in installs if i.args[0].target is operator.getitem and i.args[0].args[0] is pl]
        assert len(mine) == len(layers), "installs do not read their group's records"
        md1 = [i for i in mine if i.kwargs.get("metadata_update", 1) == 1]
        md0 = [i for i in mine if i.kwargs.get("metadata_update", 1) == 0]
        assert len(md1) == 1 and len(md0) == len(layers) - 1
        last_sfa = sfas[layers[-1]]
        assert all(order[i] < order[md1[0]] for i in md0), "metadata install before a metadata_update=0 install"
        assert order[md1[0]] > order[last_sfa], "metadata install before the last layer's attention"
        for l, s in zip(layers, g_serves):
            assert order[s] < order[sfas[l]]
        for i in md0:
            sel = i.args[1]
            l = next(l for l in layers if serves[l].args[5] is sel)
            assert order[i] > order[sfas[l]], "install before its layer's attention"
