"""``offload-inspect DUMP_DIR``: read the dumps and JSON report the offload backend writes.

Usage::

    offload-inspect DIR                      # summary: groups, per-layer ops, state, refusals, timings
    offload-inspect DIR --layer 3            # layer 3 before/after, side by side (--diff: unified diff)
    offload-inspect DIR --svg g.svg          # group structure + plan -> serve -> install flow (graphviz)
    offload-inspect DIR --png g.png | --dot g.dot
    offload-inspect DIR --json [--layer 3]   # everything above as one JSON object
    python -m offload_passes.tools.inspect_dump DIR ...

The dump format is docs/ARCHITECTURE.md §5. Exit status: 0 ok, 2 bad input (missing or foreign
directory, unknown layer / graph, rendering impossible).
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Any, Sequence

from offload_passes._cli import ArgumentParser, UsageError, int_arg, run_cli, writable_file
from offload_passes.passes.producers import TOPK_PRODUCERS

from .inspect_dump_report import Dump, DumpError, GraphDump, layer_ranges, load_dump, summarize

MiB = 1 << 20


def _fmt_bytes(n: int) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    if n >= MiB:
        return f"{n / MiB:.2f} MiB"
    if n >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n} B"


def _table(rows: list[list[Any]], header: list[str]) -> list[str]:
    cells = [[str(c) for c in header]] + [[("-" if c is None else str(c)) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(header))]
    out = ["  " + "  ".join(c.ljust(w[i]) for i, c in enumerate(cells[0])).rstrip()]
    out.append("  " + "  ".join("-" * w[i] for i in range(len(header))))
    out += ["  " + "  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in cells[1:]]
    return out


# Short names keep a 78-row table readable; the legend under the table spells them out.
# Top-k producers (indexer / qindexer ...) come from the passes' one producer table.
_SHORT = {**{p.name: p.short for p in TOPK_PRODUCERS}, "npu_gather_selection_kv_cache": "gather",
          "npu_sparse_flash_attention": "sfa", "dsa_plan": "plan", "dsa_serve": "serve", "dsa_install": "install"}
_ORDER = [p.short for p in TOPK_PRODUCERS] + ["plan", "gather", "serve", "sfa", "install"]


def _short_ops(c: dict[str, int]) -> str:
    """Registered ops (torch.ops.<ns>.*) of one layer, short names in pipeline order; other calls counted."""
    names: dict[str, int] = {}
    other = 0
    for k, v in c.items():
        ns, _, op = k.partition(".")
        if ns in ("torch", "aten", "prims", "_operator"):
            other += v
            continue
        base = op[: -len("_functional")] if op.endswith("_functional") else op
        short = _SHORT.get(base, op) + ("_f" if op.endswith("_functional") else "")
        names[short] = names.get(short, 0) + v
    def rank(s: str) -> tuple[int, str]:
        b = s.removesuffix("_f")
        return (_ORDER.index(b) if b in _ORDER else len(_ORDER), s)

    keys = sorted(names, key=rank)
    parts = [k + (f"x{names[k]}" if names[k] > 1 else "") for k in keys]
    if other:
        parts.append(f"+{other} other")
    return " ".join(parts) or "-"


def render_summary(s: dict[str, Any]) -> str:
    L: list[str] = []
    if s["rewritten"]:
        status = "rewritten"
    elif not s["groups"] and not s["refusals"] and not s["layers"]:
        status = "not rewritten (no DSA sites: passed through)"
    else:
        status = "NOT rewritten"
    L.append(f"graph {s['graph_id']}: {status}, mode {s['mode']}, {len(s['groups'])} groups, {len(s['layers'])} layers")
    if s["options"]:
        L.append("  options: " + ", ".join(f"{k}={v}" for k, v in sorted(s["options"].items())))
    L.append("")
    if not s["groups"]:
        L.append("groups: none")
    else:
        L.append("groups")
    L += [] if not s["groups"] else _table([[g.get("group_id"), g.get("owner_layer"), layer_ranges([int(x) for x in g["layers"]]),
                  len(g["layers"]), g.get("topk_node"), g.get("K"), g.get("S"), g.get("B"), g.get("pool_size"),
                  g.get("num_sets"), g.get("id_range")] for g in s["groups"]],
                ["group", "owner", "layers", "n", "topk node", "K", "S", "B", "pool", "sets", "id_range"])
    L.append("")
    L.append("layers (nodes and DSA ops, before -> after)" if s["layers"] else "layers: none")
    L += [] if not s["layers"] else _table([[x["layer"], x["group_id"], x["role"], f"{x['nodes_before']} -> {x['nodes_after']}",
                  _short_ops(x["ops_before"]), _short_ops(x["ops_after"])] for x in s["layers"]],
                ["layer", "group", "role", "nodes", "ops before", "ops after"])
    if s["layers"]:
        producers = "/".join(p.short for p in TOPK_PRODUCERS) + " = " + " / ".join(p.name for p in TOPK_PRODUCERS)
        L.append(f"  ({producers}; gather/sfa = npu_gather_selection_kv_cache / "
                 "npu_sparse_flash_attention; plan/serve/install = dsa_*; _f = functional twin)")
    if s["ops"]:
        L.append("")
        L.append("ops (whole graph, before -> after)")
        L += _table([[o["op"], o["before"], o["after"], f"{o['after'] - o['before']:+d}"] for o in s["ops"]],
                    ["op", "before", "after", "delta"])
    L.append("")
    L.append(f"state: {len(s['state'])} tensors, {_fmt_bytes(s['state_total_bytes'])} ({s['state_total_bytes']:,} B)")
    if s["state_by_kind"]:
        L += _table([[a["kind"], "[" + ", ".join(map(str, a["shape"])) + "]", a["dtype"], a["count"],
                      _fmt_bytes(a["bytes"] // max(a["count"], 1)), _fmt_bytes(a["bytes"])] for a in s["state_by_kind"]],
                    ["kind", "shape", "dtype", "count", "bytes each", "bytes total"])
    L.append("")
    if s["refusals"]:
        L.append(f"refusals ({len(s['refusals'])})")
        L += _table([[r.get("layer"), r.get("reason"), r.get("detail")] for r in s["refusals"]],
                    ["layer", "reason", "detail"])
    else:
        L.append("refusals: none")
    L.append("")
    t = s["timings"]
    if t:
        total = t.get("total_s")
        L.append("pass timings")
        L += _table([[k, f"{float(v) * 1e3:.1f} ms", (f"{100 * float(v) / total:.0f} %" if total else "")]
                     for k, v in t.items()], ["pass", "time", "share"])
        L.append("")
    L.append("dumps: " + (", ".join(Path(p["file"]).name for p in s["passes"]) or "(no NN_<stage>.py files)"))
    return "\n".join(L)


#: ``--width``: two columns of at least 30 characters around " | "; above MAX_WIDTH every line of the
#: view is padded to a size no terminal shows (10**9 would build gigabytes of spaces).
MIN_WIDTH, MAX_WIDTH = 2 * 30 + 3, 4096


def render_layer(view: dict[str, Any], style: str, width: int | None = None) -> str:
    b, a = view["before"], view["after"]
    head = [f"graph {view['graph_id']} layer {view['layer']}: before = {b['file']} ({len(b['lines'])} nodes), "
            f"after = {a['file']} ({len(a['lines'])} nodes)"]
    if view.get("derived"):
        head.append("  note: report.json lists no nodes for this layer (graph not rewritten); showing the "
                    "layer's top-k producer, gather and attention found in the graph by site order")
    for side in ("before", "after"):
        if view.get("derived"):
            continue
        if view[side]["missing"]:
            head.append(f"  note: {side} nodes not found in the dump: {', '.join(view[side]['missing'])}")
        elif not view[side]["nodes"]:
            why = "" if view.get("rewritten", True) else " (the graph was not rewritten)"
            head.append(f"  note: report.json lists no {side} nodes for this layer{why}")
    if style == "unified":
        if b["lines"] == a["lines"]:
            return "\n".join(head + ["(unchanged)"] + [" " + ln for ln in b["lines"]])
        diff = difflib.unified_diff(b["lines"], a["lines"], fromfile=f"{b['file']} (layer {view['layer']})",
                                    tofile=f"{a['file']} (layer {view['layer']})", lineterm="", n=3)
        return "\n".join(head + list(diff))
    w = width or shutil.get_terminal_size((200, 40)).columns
    col = max(30, (w - 3) // 2)

    def wrap(s: str) -> list[str]:
        # wrap, never cut: the arguments (buffers, metadata_update, ...) are the point of the view
        return textwrap.wrap(s, col, subsequent_indent="    ", break_on_hyphens=False) or [""]

    out = head + [f"{('before: ' + str(b['file'])).ljust(col)} | after: {a['file']}", "-" * col + "-+-" + "-" * col]
    # align rows by node name (a node kept by the rewrite sits on one row, "|" when its call changed)
    sm = difflib.SequenceMatcher(a=b["ordered"], b=a["ordered"], autojunk=False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        left, right = b["lines"][i1:i2], a["lines"][j1:j2]
        mark = {"equal": " ", "replace": "|", "delete": "<", "insert": ">"}[tag]
        for k in range(max(len(left), len(right))):
            lw = wrap(left[k]) if k < len(left) else [""]
            rw = wrap(right[k]) if k < len(right) else [""]
            if tag == "equal":
                m = " " if left[k] == right[k] else "|"
            else:
                m = mark if (k < len(left) and k < len(right)) or tag != "replace" else ("<" if k < len(left) else ">")
            for r in range(max(len(lw), len(rw))):
                lt = lw[r] if r < len(lw) else ""
                rt = rw[r] if r < len(rw) else ""
                out.append(f"{lt.ljust(col)} {m if r == 0 else ' '} {rt}".rstrip())
    return "\n".join(out)


def _pick_graph_for_layer(dump: Dump, graph_id: str | None, layer: int) -> GraphDump:
    if graph_id is not None:
        g = dump.graph(graph_id)
    else:
        have = [g for g in dump.graphs if layer in g.layers()]
        g = have[0] if have else dump.graph(None)
    layers = g.layers()
    if layer not in layers:
        rng = layer_ranges(layers) if layers else "none"
        raise DumpError(f"--layer {layer}: graph {g.graph_id} has no such layer (layers: {rng})")
    return g


def _parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="offload-inspect",
                                 description="Inspect an offload_passes dump directory (report.json + per-pass graphs).")
    ap.add_argument("dump_dir", metavar="DUMP_DIR")
    ap.add_argument("--graph", default=None, help="graph id (default: every graph in the summary; the largest for --layer/pictures)")
    ap.add_argument("--layer", type=int_arg("--layer", 0), default=None, help="show layer N's subgraph before and after")
    ap.add_argument("--diff", action="store_true", help="with --layer: unified diff instead of side by side")
    ap.add_argument("--width", type=int_arg("--width"), default=None,
                    help=f"with --layer: total width of the side-by-side view, in [{MIN_WIDTH}, {MAX_WIDTH}] "
                         "(default: the terminal's)")
    ap.add_argument("--svg", type=Path, default=None, help="write the group picture as SVG (needs graphviz 'dot')")
    ap.add_argument("--png", type=Path, default=None, help="write the group picture as PNG (needs graphviz 'dot')")
    ap.add_argument("--dot", type=Path, default=None, help="write the group picture's DOT source")
    ap.add_argument("--json", action="store_true", help="print everything as one JSON object")
    return ap


def run(args: argparse.Namespace) -> str:
    dump = load_dump(args.dump_dir)
    if not dump.graphs:
        raise DumpError(f"{dump.path / 'report.json'}: the report lists no graphs")
    graphs = [dump.graph(args.graph)] if args.graph else dump.graphs
    view = None
    if args.layer is not None:
        g = _pick_graph_for_layer(dump, args.graph, args.layer)
        view = g.layer_view(args.layer)
    pictures = [(p, f) for p, f in ((args.svg, "svg"), (args.png, "png"), (args.dot, "dot")) if p is not None]
    if pictures:
        from .inspect_dump_graphviz import build_dot, render
        pg = dump.graph(args.graph)
        if not pg.groups:
            raise DumpError(f"graph {pg.graph_id}: no groups to draw (nothing detected)")
        dot = build_dot(pg)
        for path, fmt in pictures:
            render(dot, path, fmt)
    if args.json:
        doc = {"dump_dir": str(dump.path), "format": "offload_passes.report", "version": dump.version,
               "graphs": [summarize(g) for g in graphs]}
        if view is not None:
            doc["layer_view"] = view
        if pictures:
            doc["pictures"] = {fmt: str(p) for p, fmt in pictures}
        return json.dumps(doc, indent=2, default=str)
    parts: list[str] = []
    if view is not None:
        parts.append(render_layer(view, "unified" if args.diff else "side", args.width))
    elif not pictures:
        parts += [render_summary(summarize(g)) for g in graphs]
    for p, fmt in pictures:
        parts.append(f"wrote {fmt}: {p}")
    return "\n\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return run_cli("offload-inspect", lambda: _main(args))


def _main(args: argparse.Namespace) -> int:
    if args.width is not None and not MIN_WIDTH <= args.width <= MAX_WIDTH:
        raise UsageError(f"--width must be in [{MIN_WIDTH}, {MAX_WIDTH}] (two columns of at least 30 characters), "
                         f"got {args.width}")
    for path, flag in ((args.svg, "--svg"), (args.png, "--png"), (args.dot, "--dot")):
        if path is not None:
            writable_file(path, flag)  # before any work: a bad path is a one-line error, exit 2
    try:
        text = run(args)
    except DumpError as e:
        raise UsageError(str(e)) from None
    try:
        print(text)
    except BrokenPipeError:  # `offload-inspect DIR | head`: the reader left, not an error
        sys.stderr = open(os.devnull, "w")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
