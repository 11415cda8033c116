"""Reading a dump directory (docs/ARCHITECTURE.md §5) for ``offload-inspect``.

``report.json`` holds ``{"format": "offload_passes.report", "version": 1, "graphs": [GraphReport...]}``;
each graph has a folder ``<graph_id>/`` with one ``NN_<pass>.py`` per pass (``gm.print_readable()``).
This module validates the report, parses the readable graphs into ``node name -> source line`` and
builds the per-layer views and tables the CLI prints. It raises :class:`DumpError` (a RuntimeError)
with a message that names the offending path or key.
"""
from __future__ import annotations

import json
import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("offload_passes.tools.inspect_dump")

FORMAT = "offload_passes.report"
SUPPORTED_VERSIONS = (1,)
#: The stage whose node names ``layer_nodes.before`` / ``layer_nodes.after`` use (ARCHITECTURE §5).
PREFERRED_STAGE = {"before": "dynamo", "after": "rewrite"}


class DumpError(RuntimeError):
    """The dump directory is missing, foreign or malformed."""


# A node line: name, optional "annotation", "=", expression (indentation checked separately).
_NODE_RE = re.compile(r'^([A-Za-z_]\w*)(?:\s*:\s*"[^"]*")?\s*=\s*(.+)$')
# FX appends "; a = b = None" to free dead values: noise for a reader.
_CLEANUP_RE = re.compile(r';\s+(?:[A-Za-z_]\w*\s*=\s*)+None\s*$')
# The op a node calls: torch.ops.<ns>.<op>.<overload>(  or  torch.<fn>(  or  operator.getitem / x[0].
_OP_RE = re.compile(r'torch\.ops\.(\w+)\.(\w+)(?:\.\w+)?\(|(torch(?:\.\w+)+)\(')


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def parse_readable(text: str) -> dict[str, str]:
    """Graph code -> {node name: its line without the cleanup suffix}, in graph order.

    Reads the first ``def forward`` and nothing else: ``gm.print_readable()`` text (forward inside
    ``class GraphModule``, nested submodule classes after it) and bare ``graph.python_code()`` text
    (the AOT stages) both work.
    """
    nodes: dict[str, str] = {}
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("def forward(")), None)
    if start is None:
        return nodes
    body = _indent(lines[start]) + 4
    for line in lines[start + 1:]:
        if not line.strip():
            continue
        ind = _indent(line)
        if ind < body:
            break                      # end of forward (a nested class or the next def)
        if ind > body:
            continue                   # continuation or deeper block
        m = _NODE_RE.match(line.strip())
        if m and not line.lstrip().startswith(("return", "#")):
            nodes[m.group(1)] = _CLEANUP_RE.sub("", line).strip()
    return nodes


def op_of(line: str) -> str | None:
    """The called op of a node line: ``custom.dsa_serve``, ``torch.where`` ... or None (getitem, views)."""
    rhs = line.split("=", 1)[1] if "=" in line else line
    m = _OP_RE.search(rhs)
    if not m:
        return None
    if m.group(1):
        return f"{m.group(1)}.{m.group(2)}"
    return m.group(3)


@dataclass
class PassFile:
    name: str
    path: Path
    nodes: dict[str, str] | None = None      # None: file missing

    @property
    def exists(self) -> bool:
        return self.nodes is not None


@dataclass
class GraphDump:
    graph_id: str
    report: dict[str, Any]
    dir: Path
    passes: list[PassFile] = field(default_factory=list)

    # -- report accessors (validated in load_dump) ---------------------------------------------
    @property
    def rewritten(self) -> bool:
        return bool(self.report["rewritten"])

    @property
    def groups(self) -> list[dict[str, Any]]:
        return self.report.get("groups") or []

    @property
    def sites(self) -> list[dict[str, Any]]:
        return self.report.get("sites") or []

    def layer_nodes(self, side: str) -> dict[int, list[str]]:
        raw = (self.report.get("layer_nodes") or {}).get(side) or {}
        return {int(k): list(v) for k, v in raw.items()}

    def layers(self) -> list[int]:
        found = set(self.layer_nodes("before")) | set(self.layer_nodes("after"))
        found |= {int(s["layer"]) for s in self.sites}
        for g in self.groups:
            found |= {int(x) for x in g.get("layers", [])}
        return sorted(found)

    def group_of_layer(self) -> dict[int, dict[str, Any]]:
        return {int(x): g for g in self.groups for x in g.get("layers", [])}

    # -- pass files --------------------------------------------------------------------------
    def best_pass(self, names: list[str], side: str) -> PassFile | None:
        """The stage file ``names`` come from: "before" = the Dynamo graph, "after" = the rewrite.

        Node names are only unique within one stage (AOT may reuse a name for another node), so the
        stage the report's names refer to wins whenever it defines as many of them as any other
        file; otherwise the file defining most of them (ties: earliest / latest).
        """
        cands = [p for p in self.passes if p.exists]
        if not cands or not names:
            return None
        score = {id(p): sum(n in p.nodes for n in names) for p in cands}
        top = max(score.values())
        if top == 0:
            return None
        preferred = PREFERRED_STAGE[side]
        for p in cands:
            if p.name == preferred and score[id(p)] == top:
                return p
        order = cands if side == "before" else list(reversed(cands))
        return next(p for p in order if score[id(p)] == top)

    def derived_nodes(self, layer: int) -> list[str]:
        """Nodes of ``layer`` found without the report: the layer-th gather and attention call of the
        first graph file (layers are DSA sites in data-flow order), plus the group's top-k producer
        when the layer owns a group. Used when the report lists no nodes (graphs left unmodified)."""
        pf = next((p for p in self.passes if p.exists), None)
        if pf is None:
            return []
        gathers = [n for n, ln in pf.nodes.items() if (op_of(ln) or "").endswith(".npu_gather_selection_kv_cache")]
        sfas = [n for n, ln in pf.nodes.items() if (op_of(ln) or "").endswith(".npu_sparse_flash_attention")]
        names = []
        grp = self.group_of_layer().get(layer)
        if grp is not None and int(grp["owner_layer"]) == layer and grp.get("topk_node") in pf.nodes:
            names.append(grp["topk_node"])
        names += [seq[layer] for seq in (gathers, sfas) if layer < len(seq)]
        return names

    def layer_view(self, layer: int) -> dict[str, Any]:
        """Lines of one layer's subgraph before and after, taken from the matching pass files."""
        view: dict[str, Any] = {"graph_id": self.graph_id, "layer": layer, "rewritten": self.rewritten,
                                "derived": False}
        for side in ("before", "after"):
            names = self.layer_nodes(side).get(layer, [])
            if not names and not self.rewritten:
                names = self.derived_nodes(layer)
                view["derived"] = view["derived"] or bool(names)
            pf = self.best_pass(names, side)
            ordered: list[str] = []
            missing: list[str] = []
            if pf is not None:
                wanted = set(names)
                ordered = [n for n in pf.nodes if n in wanted]          # graph order, not report order
                missing = [n for n in names if n not in pf.nodes]
            else:
                missing = list(names)
            view[side] = {"file": None if pf is None else pf.name, "nodes": names, "ordered": ordered,
                          "lines": [pf.nodes[n] for n in ordered] if pf is not None else [], "missing": missing}
        return view

    def layer_ops(self, layer: int, side: str) -> Counter:
        names = self.layer_nodes(side).get(layer, [])
        pf = self.best_pass(names, side)
        c: Counter = Counter()
        if pf is None:
            return c
        for n in names:
            if n in pf.nodes:
                op = op_of(pf.nodes[n])
                if op is not None:
                    c[op] += 1
        return c


@dataclass
class Dump:
    path: Path
    version: int
    graphs: list[GraphDump]

    def graph(self, graph_id: str | None) -> GraphDump:
        if graph_id is None:
            # the graph with the most DSA sites is the interesting one
            return max(self.graphs, key=lambda g: (len(g.layers()), g.rewritten))
        for g in self.graphs:
            if g.graph_id == graph_id:
                return g
        raise DumpError(f"--graph {graph_id!r}: not in {self.path / 'report.json'} "
                        f"(graphs: {', '.join(g.graph_id for g in self.graphs)})")


_LIST_KEYS = ("groups", "sites", "state", "refusals", "passes")
_DICT_KEYS = ("options", "layer_nodes", "ops", "timings")


def _check_graph(i: int, g: Any, report_path: Path) -> None:
    where = f"{report_path}: graphs[{i}]"
    if not isinstance(g, dict):
        raise DumpError(f"{where}: expected an object, got {type(g).__name__}")
    for k in ("graph_id", "rewritten"):
        if k not in g:
            raise DumpError(f"{where}: missing key {k!r}")
    if not isinstance(g["graph_id"], str) or not re.fullmatch(r"[\w.-]+", g["graph_id"]):
        raise DumpError(f"{where}: graph_id must be a plain folder name, got {g['graph_id']!r}")
    for k in _LIST_KEYS:
        if k in g and g[k] is not None and not isinstance(g[k], list):
            raise DumpError(f"{where} ({g['graph_id']}): {k!r} must be a list, got {type(g[k]).__name__}")
    for k in _DICT_KEYS:
        if k in g and g[k] is not None and not isinstance(g[k], dict):
            raise DumpError(f"{where} ({g['graph_id']}): {k!r} must be an object, got {type(g[k]).__name__}")
    for j, grp in enumerate(g.get("groups") or []):
        if not isinstance(grp, dict) or not isinstance(grp.get("layers"), list) or "owner_layer" not in grp:
            raise DumpError(f"{where} ({g['graph_id']}): groups[{j}] needs 'owner_layer' and a 'layers' list")
    for side in ("before", "after"):
        ln = (g.get("layer_nodes") or {}).get(side) or {}
        if not isinstance(ln, dict):
            raise DumpError(f"{where} ({g['graph_id']}): layer_nodes.{side} must map layer -> [node names]")
        for k, v in ln.items():
            try:
                int(k)
            except ValueError:
                raise DumpError(f"{where} ({g['graph_id']}): layer_nodes.{side} key {k!r} is not a layer index") from None
            if not isinstance(v, list):
                raise DumpError(f"{where} ({g['graph_id']}): layer_nodes.{side}[{k}] must be a list of node names")


def _pass_files(dump_dir: Path, gdir: Path, g: dict[str, Any]) -> list[PassFile]:
    """The graph's ``NN_<stage>.py`` files in stage order.

    ``passes`` entries of the report are used when they name files inside the dump; the backend may
    also list its pass *modules* there (``passes/group.py``), which are not dump files.
    """
    found: dict[Path, str] = {}
    for p in sorted(gdir.glob("[0-9][0-9]_*.py")):
        found[p.resolve()] = p.stem.split("_", 1)[1]
    for p in g.get("passes") or []:
        rel = str(p.get("file", "")) if isinstance(p, dict) else str(p)
        for cand in (gdir / rel, dump_dir / rel):
            if rel and cand.is_file() and cand.resolve() not in found and cand.suffix == ".py" \
                    and re.match(r"\d\d_", cand.name):
                found[cand.resolve()] = str(p.get("name") if isinstance(p, dict) else cand.stem)
    out = [PassFile(name=name, path=path, nodes=parse_readable(path.read_text()))
           for path, name in sorted(found.items(), key=lambda kv: kv[0].name)]
    if not out:
        log.warning("%s: no per-pass graph files (NN_<stage>.py)", gdir)
    return out


def load_dump(path: str | Path) -> Dump:
    """Validate and read a dump directory; raises :class:`DumpError` naming what is wrong."""
    d = Path(path)
    if not d.exists():
        raise DumpError(f"DUMP_DIR {str(d)!r} does not exist")
    if not d.is_dir():
        raise DumpError(f"DUMP_DIR {str(d)!r} is not a directory")
    rp = d / "report.json"
    if not rp.is_file():
        raise DumpError(f"DUMP_DIR {str(d)!r} is not an offload_passes dump: no report.json "
                        "(written by the backend's dump_dir option)")
    try:
        doc = json.loads(rp.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DumpError(f"{rp}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise DumpError(f"{rp}: not an offload_passes report: format is {got!r}, expected {FORMAT!r}")
    version = doc.get("version")
    if version not in SUPPORTED_VERSIONS:
        raise DumpError(f"{rp}: report version {version!r} is not supported (this tool reads versions "
                        f"{', '.join(map(str, SUPPORTED_VERSIONS))})")
    graphs = doc.get("graphs")
    if not isinstance(graphs, list):
        raise DumpError(f"{rp}: 'graphs' must be a list, got {type(graphs).__name__}")
    out = []
    for i, g in enumerate(graphs):
        _check_graph(i, g, rp)
        gdir = d / g["graph_id"]
        out.append(GraphDump(graph_id=g["graph_id"], report=g, dir=gdir, passes=_pass_files(d, gdir, g)))
    return Dump(path=d, version=int(version), graphs=out)


# -- tables -----------------------------------------------------------------------------------

def layer_ranges(layers: list[int]) -> str:
    """[0, 2, 3, 4, 5, 7] -> "0, 2-5, 7"."""
    out: list[str] = []
    xs = sorted(layers)
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ", ".join(out)


def summarize(g: GraphDump) -> dict[str, Any]:
    """Everything the summary table shows, as plain data (also the --json payload)."""
    gol = g.group_of_layer()
    site_of = {int(s["layer"]): s for s in g.sites}
    before, after = g.layer_nodes("before"), g.layer_nodes("after")
    layers = []
    for x in g.layers():
        grp = gol.get(x)
        role = None
        if grp is not None:
            lay = [int(v) for v in grp["layers"]]
            role = "owner" if x == int(grp["owner_layer"]) else ("last" if x == max(lay) else "shared")
        layers.append({
            "layer": x, "group_id": None if grp is None else grp.get("group_id"), "role": role,
            "nodes_before": len(before.get(x, [])), "nodes_after": len(after.get(x, [])),
            "ops_before": dict(g.layer_ops(x, "before")), "ops_after": dict(g.layer_ops(x, "after")),
            "site": site_of.get(x),
        })
    ops = g.report.get("ops") or {}
    op_names = sorted(set(ops.get("before") or {}) | set(ops.get("after") or {}))
    op_rows = [{"op": o, "before": int((ops.get("before") or {}).get(o, 0)),
                "after": int((ops.get("after") or {}).get(o, 0))} for o in op_names]
    state = g.report.get("state") or []
    agg: dict[tuple, dict[str, Any]] = {}
    for s in state:
        key = (s.get("kind"), tuple(s.get("shape") or ()), s.get("dtype"))
        a = agg.setdefault(key, {"kind": key[0], "shape": list(key[1]), "dtype": key[2], "count": 0, "bytes": 0})
        a["count"] += 1
        a["bytes"] += int(s.get("bytes", 0))
    return {
        "graph_id": g.graph_id, "rewritten": g.rewritten, "mode": g.report.get("mode"),
        "options": g.report.get("options") or {},
        "groups": g.groups, "layers": layers, "ops": op_rows,
        "state": state, "state_by_kind": sorted(agg.values(), key=lambda a: (str(a["kind"]), -a["bytes"])),
        "state_total_bytes": sum(int(s.get("bytes", 0)) for s in state),
        "refusals": g.report.get("refusals") or [], "timings": g.report.get("timings") or {},
        "passes": [{"name": p.name, "file": str(p.path), "exists": p.exists} for p in g.passes],
    }
