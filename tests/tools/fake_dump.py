"""A small stand-alone writer of dump directories in the docs/ARCHITECTURE.md §5 format.

It builds the "before" (Dynamo, gather path) and "after" (plan/serve/install) FX graphs by hand for a
given IndexShare pattern, writes their ``print_readable()`` text and a matching ``report.json``.
The inspect tests use it for shapes the real backend does not produce on a small CPU model in test
time (78 layers / 21 groups) and for malformed dumps; the main tests use dumps written by the backend.
"""
from __future__ import annotations

import json
import operator
from pathlib import Path

import torch
import torch.fx as fx

import offload_passes  # noqa: F401  (registers the ops the graphs reference)

ref = torch.ops.offload_ref
custom = torch.ops.custom


def glm52_pattern(n: int = 78, freq: int = 4, offset: int = 3) -> str:
    return "".join("F" if max(i - offset + 1, 0) % freq == 0 else "S" for i in range(n))


def groups_of(pattern: str) -> list[list[int]]:
    out: list[list[int]] = []
    for i, c in enumerate(pattern):
        if c == "F":
            out.append([i])
        else:
            out[-1].append(i)
    return out


class _G:
    """fx.Graph with explicit node names and per-layer bookkeeping."""

    def __init__(self) -> None:
        self.g = fx.Graph()
        self.layer: int | None = None
        self.by_layer: dict[int, list[str]] = {}
        self.ops: dict[str, int] = {}

    def _note(self, n: fx.Node, op: str | None) -> fx.Node:
        if self.layer is not None:
            self.by_layer.setdefault(self.layer, []).append(n.name)
        if op:
            self.ops[op] = self.ops.get(op, 0) + 1
        return n

    def ph(self, name: str) -> fx.Node:
        return self.g.placeholder(name)

    def call(self, name: str, target, args, kwargs=None, op: str | None = None) -> fx.Node:
        n = self.g.call_function(target, tuple(args), kwargs or {})
        n.name = name
        return self._note(n, op)

    def item(self, name: str, src: fx.Node, i: int) -> fx.Node:
        n = self.g.call_function(operator.getitem, (src, i))
        n.name = name
        return self._note(n, None)

    def method(self, name: str, src: fx.Node, meth: str, *args) -> fx.Node:
        n = self.g.call_method(meth, (src,) + args)
        n.name = name
        return self._note(n, None)

    def text(self, out: fx.Node) -> str:
        self.g.output((out,))
        return fx.GraphModule(torch.nn.Module(), self.g).print_readable(print_output=False)


def _indexer(G, l: int, h, cu, L, bt, B: int, S: int, K: int):
    """Layer ``l``'s lightning indexer and the ``[B, S, 1, K]`` view the gathers consume."""
    kidx = G.ph(f"l_self_buffers_kidx_{l}_")
    li = G.call(f"npu_lightning_indexer_{l}", ref.npu_lightning_indexer.default, (h, kidx, h),
                {"actual_seq_lengths_query": cu, "actual_seq_lengths_key": L, "block_table": bt,
                 "layout_query": "TND", "layout_key": "PA_BSND", "sparse_count": K, "sparse_mode": 3},
                op="offload_ref.npu_lightning_indexer")
    topk = G.item(f"topk_{l}", li, 0)
    return G.method(f"topk4_{l}", topk, "view", B, S, 1, K)


def _before(pattern: str, B: int, S: int, K: int) -> _G:
    G = _G()
    h, L, cu, bt = G.ph("l_h_"), G.ph("l_len_"), G.ph("l_cu_q_"), G.ph("l_self_buffers_block_table_")
    topk4 = None
    for l, kind in enumerate(pattern):
        bufs = {k: G.ph(f"l_self_buffers_{k}_{l}_") for k in
                ("sel_kv", "sel_rope", "sel_table", "sel_status", "full_kv", "full_rope")}
        G.layer = l
        if kind == "F":
            topk4 = _indexer(G, l, h, cu, L, bt, B, S, K)
        act = G.call(f"npu_gather_selection_kv_cache_{l}", custom.npu_gather_selection_kv_cache.default,
                     (bufs["sel_rope"], bufs["sel_kv"], bufs["sel_table"], bufs["sel_status"], topk4,
                      bufs["full_rope"], bufs["full_kv"], bt, L, cu), {"selection_topk_block_size": 1},
                     op="custom.npu_gather_selection_kv_cache")
        ar = G.call(f"arange_{l}", torch.arange, (K,), {"dtype": torch.int32}, op="torch.arange")
        idx = G.call(f"where_{l}", torch.where, (ar, ar, -1), op="torch.where")
        sfa = G.call(f"npu_sparse_flash_attention_{l}", ref.npu_sparse_flash_attention.default,
                     (h, bufs["sel_kv"], bufs["sel_kv"], idx, 0.1),
                     {"block_table": bufs["sel_table"], "actual_seq_lengths_kv": act, "sparse_block_size": 1,
                      "layout_query": "TND", "layout_kv": "PA_BSND", "sparse_mode": 3, "attention_mode": 2},
                     op="offload_ref.npu_sparse_flash_attention")
        h = G.item(f"attn_out_{l}", sfa, 0)
        G.layer = None
    G.out = h
    return G


def _after(pattern: str, B: int, S: int, K: int, PS: int):
    G = _G()
    h, L, cu, bt = G.ph("l_h_"), G.ph("l_len_"), G.ph("l_cu_q_"), G.ph("l_self_buffers_block_table_")
    groups = groups_of(pattern)
    gid_of = {l: gi for gi, grp in enumerate(groups) for l in grp}
    sites = []
    meta = {}
    plan = rec = act = topk4 = None
    for l, kind in enumerate(pattern):
        g = gid_of[l]
        grp = groups[g]
        bufs = {k: G.ph(f"l_self_buffers_{k}_{l}_") for k in
                ("sel_kv", "sel_rope", "sel_table", "full_kv", "full_rope")}
        pool_kv, pool_rope = G.ph(f"offload_pool_kv_{l}"), G.ph(f"offload_pool_rope_{l}")
        if kind == "F":
            meta = {k: G.ph(f"offload_{k}_g{g}") for k in ("pool_ids", "id_to_slot", "lru_counter")}
        G.layer = l
        if kind == "F":
            topk4 = _indexer(G, l, h, cu, L, bt, B, S, K)
            p = G.call(f"dsa_plan_g{g}", custom.dsa_plan.default,
                       (topk4, L, meta["pool_ids"], meta["id_to_slot"], meta["lru_counter"]),
                       {"raw_seq": S, "group_id": g, "owner_layer": l}, op="custom.dsa_plan")
            plan, rec, act = G.item(f"plan_g{g}", p, 0), G.item(f"records_g{g}", p, 1), G.item(f"act_g{g}", p, 2)
        serve = G.call(f"dsa_serve_{l}", custom.dsa_serve.default,
                       (plan, bufs["full_kv"], bufs["full_rope"], pool_kv, pool_rope, bufs["sel_kv"], bufs["sel_rope"]),
                       {"raw_seq": S, "topk": K, "selection_block_size": 16}, op="custom.dsa_serve")
        ar = G.call(f"arange_{l}", torch.arange, (K,), {"dtype": torch.int32}, op="torch.arange")
        idx = G.call(f"where_{l}", torch.where, (ar, ar, -1), op="torch.where")
        sfa = G.call(f"npu_sparse_flash_attention_{l}", ref.npu_sparse_flash_attention.default,
                     (h, bufs["sel_kv"], bufs["sel_kv"], idx, 0.1),
                     {"block_table": bufs["sel_table"], "actual_seq_lengths_kv": act, "sparse_block_size": 1,
                      "layout_query": "TND", "layout_kv": "PA_BSND", "sparse_mode": 3, "attention_mode": 2},
                     op="offload_ref.npu_sparse_flash_attention")
        h = G.item(f"attn_out_{l}", sfa, 0)
        installs = []
        if l != grp[0]:
            installs.append(G.call(f"dsa_install_{l}", custom.dsa_install.default,
                                   (rec, bufs["sel_kv"], bufs["sel_rope"], bufs["sel_table"], pool_kv, pool_rope,
                                    meta["pool_ids"], meta["id_to_slot"], meta["lru_counter"]),
                                   {"raw_seq": S, "topk": K, "selection_block_size": 16, "metadata_update": 0},
                                   op="custom.dsa_install").name)
        if kind == "F":
            owner_bufs = (bufs["sel_kv"], bufs["sel_rope"], bufs["sel_table"], pool_kv, pool_rope)
        if l == grp[-1]:
            o = grp[0]
            installs.append(G.call(f"dsa_install_owner_g{g}", custom.dsa_install.default,
                                   (rec, *owner_bufs, meta["pool_ids"], meta["id_to_slot"], meta["lru_counter"]),
                                   {"raw_seq": S, "topk": K, "selection_block_size": 16, "metadata_update": 1},
                                   op="custom.dsa_install").name)
        G.layer = None
        # like the backend: the owner's md=1 install runs in layer Z's subgraph, its site is the owner's
        own = [n for n in installs if not n.startswith("dsa_install_owner")]
        sites.append({"layer": l, "group_id": g, "gather_node": f"npu_gather_selection_kv_cache_{l}",
                      "sfa_node": sfa.name, "serve_node": serve.name, "install_nodes": own})
        if l == grp[-1]:
            sites[grp[0]]["install_nodes"].append(f"dsa_install_owner_g{g}")
    G.out = h
    return G, groups, sites


def write_fake_dump(d: Path, pattern: str = "FSSS", B: int = 2, S: int = 2, K: int = 64, PS: int = 256,
                    graph_id: str = "graph_000", rewritten: bool = True, refusals: list | None = None,
                    mode: str = "eager") -> Path:
    """Write a complete dump directory; returns ``d``."""
    d = Path(d)
    gdir = d / graph_id
    gdir.mkdir(parents=True, exist_ok=True)
    before = _before(pattern, B, S, K)
    (gdir / "00_dynamo.py").write_text(before.text(before.out))
    passes = [{"name": "dynamo", "file": "00_dynamo.py"}]
    report = {"graph_id": graph_id, "rewritten": rewritten, "mode": mode,
              "options": {"pool_size": PS, "exe_mode": mode}, "refusals": refusals or [],
              "timings": {"detect_s": 0.004, "group_s": 0.001, "plan_s": 0.0005, "rewrite_s": 0.01,
                          "aot_s": 0.2, "reinplace_s": 0.003, "lower_s": 0.05, "total_s": 0.2685}}
    groups = groups_of(pattern)
    Dkv, Dr, NS = 32, 16, PS // 16
    IR = 131072
    if rewritten:
        after, groups, sites = _after(pattern, B, S, K, PS)
        (gdir / "01_rewrite.py").write_text(after.text(after.out))
        passes.append({"name": "rewrite", "file": "01_rewrite.py"})
        state = []
        for l in range(len(pattern)):
            for nm, D in (("pool_kv", Dkv), ("pool_rope", Dr)):
                state.append({"name": f"offload_{nm}_{l}", "shape": [B, PS, D], "dtype": "bfloat16",
                              "bytes": B * PS * D * 2, "kind": "pool", "layer": l})
        for g in range(len(groups)):
            for nm, shp in (("pool_ids", [B, PS]), ("id_to_slot", [B, IR]), ("lru_counter", [B, NS])):
                state.append({"name": f"offload_{nm}_g{g}", "shape": shp, "dtype": "int32",
                              "bytes": 4 * shp[0] * shp[1], "kind": "group", "group_id": g})
        state.append({"name": "offload_stats", "shape": [len(groups), 4], "dtype": "int64",
                      "bytes": len(groups) * 32, "kind": "stats"})
        report.update({
            "groups": [{"group_id": gi, "owner_layer": grp[0], "layers": grp, "topk_node": f"topk4_{grp[0]}",
                        "K": K, "S": S, "B": B, "pool_size": PS, "num_sets": NS, "id_range": IR}
                       for gi, grp in enumerate(groups)],
            "sites": sites,
            "layer_nodes": {"before": {str(k): v for k, v in before.by_layer.items()},
                            "after": {str(k): v for k, v in after.by_layer.items()}},
            "ops": {"before": before.ops, "after": after.ops},
            "state": state,
        })
    else:
        report.update({"groups": [], "sites": [], "state": [],
                       "layer_nodes": {"before": {str(k): v for k, v in before.by_layer.items()}, "after": {}},
                       "ops": {"before": before.ops, "after": before.ops}})
    report["passes"] = passes
    doc = {"format": "offload_passes.report", "version": 1, "graphs": [report]}
    (d / "report.json").write_text(json.dumps(doc, indent=1))
    return d
