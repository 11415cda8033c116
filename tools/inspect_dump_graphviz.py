"""The group-structure picture of ``offload-inspect --svg/--png/--dot`` (graphviz DOT).

One cluster per IndexShare group, clusters laid out in rows; inside a cluster three rows: the
group's ``dsa_plan``, one small node per layer (``dsa_serve`` + attention), and the deferred
``dsa_install`` chain (metadata_update=0 installs of the shared layers in layer order, then the
owner's metadata_update=1 install last). Edges: plan -> serve fan-out, serve -> that layer's
install, install -> install chain. Node tooltips (SVG) carry the graph's node names.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import graphviz

from .inspect_dump_report import DumpError, GraphDump, layer_ranges

GROUPS_PER_ROW = 6
_PLAN, _SERVE, _INSTALL, _META, _REFUSED, _OFF = "#f6c85f", "#9dc3e6", "#c5e0b4", "#f4a582", "#d9d9d9", "#eeeeee"


def _tip(*names: object) -> str:
    return " ".join(str(n) for n in names if n) or "-"


def build_dot(g: GraphDump, groups_per_row: int = GROUPS_PER_ROW) -> graphviz.Digraph:
    groups = sorted(g.groups, key=lambda x: min(int(v) for v in x["layers"]) if x["layers"] else 0)
    site_of = {int(s["layer"]): s for s in g.sites}
    refused_layers = {int(r["layer"]) for r in (g.report.get("refusals") or []) if r.get("layer") is not None}
    n_layers = len(g.layers())
    title = (f"{g.graph_id}: {len(groups)} groups, {n_layers} layers, "
             + ("rewritten" if g.rewritten else "NOT rewritten") + f" (mode {g.report.get('mode')})")
    if not g.rewritten:
        reasons = sorted({str(r.get("reason")) for r in (g.report.get("refusals") or [])})
        if reasons:
            title += "\nrefused: " + "; ".join(reasons)
    dot = graphviz.Digraph(g.graph_id)
    dot.attr(rankdir="TB", newrank="true", nodesep="0.06", ranksep="0.22", fontname="Helvetica",
             fontsize="14", label=title + "\nplan gN: dsa_plan (1 per group) -> LN: dsa_serve + attention (1 per layer)"
             "\n-> IN: dsa_install, metadata_update=0, in order -> IN*: the owner's metadata_update=1 install",
             labelloc="t", compound="true")
    dot.attr("node", shape="box", style="rounded,filled", fontname="Helvetica", fontsize="9",
             height="0.22", width="0.3", margin="0.03,0.01")
    dot.attr("edge", arrowsize="0.4", penwidth="0.7")
    plans: list[str] = []
    tails: list[str] = []
    for gi, grp in enumerate(groups):
        gid = grp.get("group_id", gi)
        owner = int(grp["owner_layer"])
        layers = sorted(int(v) for v in grp["layers"])
        rewritten = g.rewritten
        p = f"plan_{gid}"
        with dot.subgraph(name=f"cluster_g{gid}") as c:
            c.attr(label=f"g{gid}: L{layer_ranges(layers)}", fontsize="10", style="rounded",
                   color="#888888", margin="4")
            # ordering=out: the serve fan-out keeps layer order left to right
            c.node(p, f"plan g{gid}", fillcolor=_PLAN if rewritten else _OFF, ordering="out",
                   tooltip=_tip("topk:", grp.get("topk_node"), "K", grp.get("K"), "S", grp.get("S")))
            for x in layers:
                s = site_of.get(x, {})
                color = _REFUSED if x in refused_layers else (_SERVE if rewritten else _OFF)
                c.node(f"L{x}", f"L{x}", fillcolor=color, width="0.28",
                       tooltip=_tip(s.get("serve_node") or s.get("gather_node"), s.get("sfa_node")))
                c.edge(p, f"L{x}")
            chain = [x for x in layers if x != owner] + [owner]
            inst = []
            for x in chain:
                md = 1 if x == owner else 0
                name = f"I{x}"
                s = site_of.get(x, {})
                label = f"I{x}" + ("*" if md else "")
                fill = (_META if md else _INSTALL) if rewritten else _OFF
                c.node(name, label, fillcolor=fill, width="0.28",
                       tooltip=_tip(f"metadata_update={md}", *(s.get("install_nodes") or [])))
                inst.append(name)
                # the owner's md=1 install reads the owner's selection buffer, after the whole chain
                if md and len(layers) > 1:
                    # reads the owner's selection buffer (dashed, no layout pull), runs after the last layer
                    c.edge(f"L{x}", name, style="dashed", constraint="false")
                    c.edge(f"L{layers[-1]}", name, style="invis")
                else:
                    c.edge(f"L{x}", name)
            with c.subgraph() as r:
                r.attr(rank="same")
                for n in inst:
                    r.node(n)
            # flat edges inside one rank keep their left-to-right order: owner's md=1 install ends the chain
            for a, b in zip(inst, inst[1:]):
                c.edge(a, b, color="#2e7d32")
        plans.append(p)
        tails.append(inst[-1])
    # rows: plans of one row share a rank and keep their order; the next row hangs below
    for r0 in range(0, len(plans), groups_per_row):
        row = plans[r0:r0 + groups_per_row]
        with dot.subgraph() as r:
            r.attr(rank="same")
            for n in row:
                r.node(n)
        for a, b in zip(row, row[1:]):
            dot.edge(a, b, style="invis")
    # each group hangs below the one a row above it, so the columns line up
    for i in range(groups_per_row, len(plans)):
        dot.edge(tails[i - groups_per_row], plans[i], style="invis")
    return dot


def have_dot() -> bool:
    return shutil.which("dot") is not None


def render(dot: graphviz.Digraph, out: Path, fmt: str) -> None:
    """Write ``out`` as ``fmt`` (svg/png/dot). svg/png need the ``dot`` binary."""
    if fmt == "dot":
        out.write_text(dot.source)
        return
    try:
        data = dot.pipe(format=fmt)
    except graphviz.ExecutableNotFound:
        raise DumpError(f"--{fmt} {out}: rendering needs the graphviz 'dot' program, which is not on PATH "
                        "(install it: apt-get install graphviz); or write the DOT source with --dot FILE "
                        "and render it elsewhere") from None
    out.write_bytes(data)


__all__ = ["build_dot", "render", "have_dot", "GROUPS_PER_ROW"]
