"""offload-inspect on dumps written by the backend (TinyDSA), by the fake writer (78 layers) and on bad input."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from offload_passes.tools import inspect_dump
from offload_passes.tools.inspect_dump_report import DumpError, load_dump, op_of, parse_readable

HAVE_DOT = shutil.which("dot") is not None


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = inspect_dump.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def rows(text: str, header_first_col: str) -> list[list[str]]:
    """Rows (split on 2+ spaces) of the table whose header starts with ``header_first_col``."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip().startswith(header_first_col + " "))
    out = []
    for ln in lines[start + 2:]:
        if not ln.startswith("  ") or not ln.strip() or ln.strip().startswith("("):
            break
        out.append(re.split(r"\s{2,}", ln.strip()))
    return out


# -- summary on a real backend dump -------------------------------------------------------------

def test_summary_groups_layers_ops_state(real_dump, capsys):
    d, doc = real_dump
    g = doc["graphs"][0]
    rc, out, err = run(capsys, d)
    assert rc == 0, err
    assert f"graph {g['graph_id']}: rewritten, mode eager, 3 groups, 7 layers" in out
    assert [r[:4] for r in rows(out, "group")] == [["0", "0", "0-3", "4"], ["1", "4", "4-5", "2"], ["2", "6", "6", "1"]]
    layer_rows = {int(r[0]): r for r in rows(out, "layer")}
    assert sorted(layer_rows) == list(range(7))
    assert [layer_rows[x][2] for x in range(7)] == ["owner", "shared", "shared", "last", "owner", "last", "owner"]
    # nodes before -> after are the lengths of the report's per-layer node lists
    for x in range(7):
        nb, na = len(g["layer_nodes"]["before"][str(x)]), len(g["layer_nodes"]["after"][str(x)])
        assert layer_rows[x][3] == f"{nb} -> {na}"
    assert layer_rows[0][4].startswith("indexer gather sfa") and layer_rows[0][5].startswith("plan serve sfa")
    assert layer_rows[1][4] == "gather sfa" and layer_rows[1][5].startswith("serve sfa install")
    # the last layer of a group runs its own install and the owner's metadata install
    assert "installx2" in layer_rows[3][5] and "installx2" in layer_rows[5][5]
    ops = {r[0]: r[1:] for r in rows(out, "op")}
    assert ops["dsa_plan"] == ["0", "3", "+3"]
    assert ops["dsa_serve"] == ["0", "7", "+7"]
    assert ops["dsa_install"] == ["0", "7", "+7"]
    assert ops["npu_gather_selection_kv_cache"] == ["7", "0", "-7"]
    total = sum(s["bytes"] for s in g["state"])
    assert f"state: {len(g['state'])} tensors" in out and f"({total:,} B)" in out
    assert "refusals: none" in out
    assert "dumps: 00_dynamo.py, 01_rewrite.py, 02_functional.py, 03_reinplace.py" in out


def test_state_bytes_match_the_layout(real_dump, capsys):
    """Pools [B, PS, D] bf16 per layer, [B, PS], [B, IR], [B, PS/16] int32 per group (B=2, PS=256)."""
    d, _ = real_dump
    rc, out, _ = run(capsys, d, "--json")
    assert rc == 0
    s = json.loads(out)["graphs"][0]
    by = {(a["kind"], tuple(a["shape"])): a for a in s["state_by_kind"]}
    assert by[("pool", (2, 256, 32))]["count"] == 7 and by[("pool", (2, 256, 32))]["bytes"] == 7 * 2 * 256 * 32 * 2
    assert by[("pool", (2, 256, 16))]["bytes"] == 7 * 2 * 256 * 16 * 2
    assert by[("group", (2, 131072))]["count"] == 3 and by[("group", (2, 131072))]["bytes"] == 3 * 2 * 131072 * 4
    assert by[("group", (2, 16))]["bytes"] == 3 * 2 * 16 * 4


def test_layer_side_by_side_uses_graph_node_names(real_dump, capsys):
    d, doc = real_dump
    g = doc["graphs"][0]
    rc, out, err = run(capsys, d, "--layer", 3, "--width", 400)
    assert rc == 0, err
    assert out.splitlines()[0].startswith(f"graph {g['graph_id']} layer 3: before = dynamo")
    assert "after = rewrite" in out.splitlines()[0]
    col = (400 - 3) // 2                       # two columns of equal width around " | "
    body = [ln.ljust(2 * col + 3) for ln in out.splitlines()[3:]]
    assert all(len(ln) == 2 * col + 3 for ln in body)
    left = [ln[:col].strip() for ln in body]
    marks = [ln[col + 1:col + 2] for ln in body]
    right = [ln[col + 3:].strip() for ln in body]
    assert set(marks) <= {" ", "|", "<", ">"} and "|" in marks
    for name in g["layer_nodes"]["before"]["3"]:
        assert any(t.startswith(name + " ") or t.startswith(name + ":") for t in left), name
    for name in g["layer_nodes"]["after"]["3"]:
        assert any(t.startswith(name + " ") or t.startswith(name + ":") for t in right), name
    # long lines wrap (continuation rows indented), nothing is cut
    assert "…" not in out
    joined = " ".join(right)
    assert "dsa_serve" in joined and "metadata_update = 0" in joined and "metadata_update = 1" in joined
    assert "npu_gather_selection_kv_cache" in " ".join(left)


def test_layer_unified_diff(real_dump, capsys):
    d, doc = real_dump
    g = doc["graphs"][0]
    rc, out, _ = run(capsys, d, "--layer", 0, "--diff")
    assert rc == 0
    lines = out.splitlines()
    assert "--- dynamo (layer 0)" in lines and "+++ rewrite (layer 0)" in lines
    minus = [ln[1:] for ln in lines if ln.startswith("-") and not ln.startswith("---")]
    plus = [ln[1:] for ln in lines if ln.startswith("+") and not ln.startswith("+++")]
    gather = g["sites"][0]["gather_node"]
    assert any(m.startswith(gather) and "npu_gather_selection_kv_cache" in m for m in minus)
    serve = g["sites"][0]["serve_node"]
    assert any(p.startswith(serve) and "custom.dsa_serve" in p for p in plus)
    assert any("custom.dsa_plan" in p for p in plus)
    assert not any("dsa_" in m for m in minus)        # nothing of ours existed before


def test_json_has_everything(real_dump, capsys):
    d, doc = real_dump
    g = doc["graphs"][0]
    rc, out, _ = run(capsys, d, "--json", "--layer", 5)
    assert rc == 0
    j = json.loads(out)
    assert j["format"] == "offload_passes.report" and j["version"] == 1
    s = j["graphs"][0]
    assert s["groups"] == g["groups"] and s["refusals"] == [] and s["timings"] == g["timings"]
    assert [x["layer"] for x in s["layers"]] == list(range(7))
    assert {o["op"]: (o["before"], o["after"]) for o in s["ops"]}["dsa_plan"] == (0, 3)
    assert s["state_total_bytes"] == sum(x["bytes"] for x in g["state"])
    v = j["layer_view"]
    assert v["layer"] == 5 and v["before"]["file"] == "dynamo" and v["after"]["file"] == "rewrite"
    assert len(v["before"]["lines"]) == len(g["layer_nodes"]["before"]["5"])
    assert len(v["after"]["lines"]) == len(g["layer_nodes"]["after"]["5"])
    assert v["before"]["missing"] == [] and v["after"]["missing"] == []


@pytest.mark.skipif(not HAVE_DOT, reason="graphviz 'dot' binary not installed")
def test_pictures_of_real_dump(real_dump, tmp_path, capsys):
    d, doc = real_dump
    svg, png, dot = tmp_path / "g.svg", tmp_path / "g.png", tmp_path / "g.dot"
    rc, out, err = run(capsys, d, "--svg", svg, "--png", png, "--dot", dot)
    assert rc == 0, err
    text = svg.read_text()
    assert len(re.findall(r"<title>cluster_g\d+</title>", text)) == 3
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    src = dot.read_text()
    assert "plan_0 -> L0" in src and "plan_0 -> L3" in src and "plan_2 -> L6" in src
    # chain: metadata_update=0 installs of shared layers in order, then the owner's md=1 install
    assert "I1 -> I2" in src and "I2 -> I3" in src and "I3 -> I0" in src and "I5 -> I4" in src


# -- the 78-layer picture (fake writer: the backend on a 78-layer model is too slow for a unit test) --

@pytest.mark.skipif(not HAVE_DOT, reason="graphviz 'dot' binary not installed")
def test_picture_78_layers_21_groups_in_rows(fake78, tmp_path, capsys):
    svg = tmp_path / "g78.svg"
    rc, _, err = run(capsys, fake78, "--svg", svg)
    assert rc == 0, err
    text = svg.read_text()
    assert len(re.findall(r"<title>cluster_g\d+</title>", text)) == 21
    assert len(re.findall(r"<title>L\d+</title>", text)) == 78
    assert len(re.findall(r"<title>I\d+</title>", text)) == 78
    assert len(re.findall(r">I\d+\*</text>", text)) == 21          # one metadata_update=1 install per group
    # legible: plans sit in rows of at most 6 groups (4 rows for 21 groups), nodes keep a 9pt font
    ys = {}
    for m in re.finditer(r'<title>(plan_\d+)</title>.*?<text[^>]*y="([-\d.]+)"', text, re.S):
        ys[m.group(1)] = round(float(m.group(2)))
    assert len(ys) == 21
    row_sizes = sorted(list(ys.values()).count(y) for y in set(ys.values()))
    assert row_sizes == [3, 6, 6, 6]
    assert 'font-size="9.00"' in text
    width = float(re.search(r'<svg width="([\d.]+)pt"', text).group(1))
    assert width < 1600          # about a screen wide, not 78 nodes in one line


def test_fake_78_summary(fake78, capsys):
    rc, out, _ = run(capsys, fake78)
    assert rc == 0
    assert "21 groups, 78 layers" in out
    grows = rows(out, "group")
    assert [r[2] for r in grows[:4]] == ["0", "1", "2-5", "6-9"] and grows[-1][2] == "74-77"


# -- refusals -----------------------------------------------------------------------------------

def test_refused_graph(refused_dump, capsys):
    d, doc = refused_dump
    rc, out, _ = run(capsys, d)
    assert rc == 0
    assert "NOT rewritten" in out
    refs = rows(out, "layer  reason")
    assert refs and all(r[1] == "topk_alignment" and "multiple of 64" in r[2] for r in refs)
    assert sorted(int(r[0]) for r in refs) == [0, 1, 2, 3]
    ops = {r[0]: r[1:] for r in rows(out, "op")}
    assert ops["npu_gather_selection_kv_cache"] == ["4", "4", "+0"] and ops["dsa_plan"] == ["0", "0", "+0"]


def test_refused_graph_layer_view_falls_back_to_site_order(refused_dump, capsys):
    d, doc = refused_dump
    g = doc["graphs"][0]
    assert g["layer_nodes"]["before"] == {}            # the backend lists nodes only for rewritten graphs
    rc, out, _ = run(capsys, d, "--layer", 3, "--diff")
    assert rc == 0
    assert "report.json lists no nodes for this layer (graph not rewritten)" in out and "(unchanged)" in out
    body = [ln.strip() for ln in out.splitlines() if ln.startswith(" ") and not ln.startswith("  note")]
    # layer 3 owns group 1: its indexer, then the 4th gather and the 4th attention call of the graph
    assert body[0].startswith(g["groups"][1]["topk_node"]) and "npu_lightning_indexer" in body[0]
    assert "npu_gather_selection_kv_cache" in body[1] and "l_self_buffers_sel_kv_3_" in body[1]
    assert "npu_sparse_flash_attention" in body[2] and len(body) == 3


# -- bad input ----------------------------------------------------------------------------------

def test_missing_directory(tmp_path, capsys):
    rc, out, err = run(capsys, tmp_path / "nope")
    assert rc == 2 and out == ""
    assert "DUMP_DIR" in err and "does not exist" in err


def test_not_a_directory(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    rc, _, err = run(capsys, f)
    assert rc == 2 and "is not a directory" in err


def test_foreign_directory_without_report(tmp_path, capsys):
    (tmp_path / "something.txt").write_text("hello")
    rc, _, err = run(capsys, tmp_path)
    assert rc == 2 and "not an offload_passes dump: no report.json" in err


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    (json.dumps({"format": "other.tool", "version": 1, "graphs": []}), "format is 'other.tool', expected 'offload_passes.report'"),
    (json.dumps([1, 2]), "format is 'list'"),
    (json.dumps({"format": "offload_passes.report", "version": 2, "graphs": []}), "report version 2 is not supported"),
    (json.dumps({"format": "offload_passes.report", "version": 1, "graphs": {}}), "'graphs' must be a list"),
    (json.dumps({"format": "offload_passes.report", "version": 1, "graphs": [{"rewritten": True}]}), "graphs[0]: missing key 'graph_id'"),
    (json.dumps({"format": "offload_passes.report", "version": 1, "graphs": [{"graph_id": "../x", "rewritten": True}]}), "graph_id must be a plain folder name"),
    (json.dumps({"format": "offload_passes.report", "version": 1, "graphs": [{"graph_id": "g", "rewritten": True, "groups": {}}]}), "'groups' must be a list"),
    (json.dumps({"format": "offload_passes.report", "version": 1, "graphs": [{"graph_id": "g", "rewritten": True, "groups": [{"layers": [0]}]}]}), "groups[0] needs 'owner_layer'"),
    (json.dumps({"format": "offload_passes.report", "version": 1, "graphs": [{"graph_id": "g", "rewritten": True, "layer_nodes": {"before": {"x": []}}}]}), "key 'x' is not a layer index"),
    (json.dumps({"format": "offload_passes.report", "version": 1, "graphs": []}), "the report lists no graphs"),
])
def test_malformed_report(tmp_path, capsys, content, message):
    (tmp_path / "report.json").write_text(content)
    rc, _, err = run(capsys, tmp_path)
    assert rc == 2
    assert message in err


def test_unknown_layer_and_graph(real_dump, capsys):
    d, doc = real_dump
    rc, _, err = run(capsys, d, "--layer", 99)
    assert rc == 2 and "--layer 99" in err and "(layers: 0-6)" in err
    rc, _, err = run(capsys, d, "--graph", "graph_999")
    assert rc == 2 and "--graph 'graph_999'" in err and doc["graphs"][0]["graph_id"] in err


def test_missing_nodes_are_reported(tmp_path, capsys):
    from fake_dump import write_fake_dump

    d = write_fake_dump(tmp_path / "d", "FS")
    rp = d / "report.json"
    doc = json.loads(rp.read_text())
    doc["graphs"][0]["layer_nodes"]["after"]["1"].append("no_such_node")
    rp.write_text(json.dumps(doc))
    rc, out, _ = run(capsys, d, "--layer", 1, "--diff")
    assert rc == 0 and "note: after nodes not found in the dump: no_such_node" in out


def test_without_dot_binary_asks_for_dot(real_dump, tmp_path, capsys, monkeypatch):
    d, _ = real_dump
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    rc, _, err = run(capsys, d, "--svg", tmp_path / "g.svg")
    assert rc == 2
    assert "needs the graphviz 'dot' program" in err and "--dot FILE" in err
    rc, out, err = run(capsys, d, "--dot", tmp_path / "g.dot")
    assert rc == 0, err
    assert (tmp_path / "g.dot").read_text().startswith("digraph")


# -- entry points and parsing -------------------------------------------------------------------

def test_python_m_and_console_script(real_dump):
    d, _ = real_dump
    r = subprocess.run([sys.executable, "-m", "offload_passes.tools.inspect_dump", str(d), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["graphs"][0]["rewritten"] is True
    r = subprocess.run([sys.executable, "-m", "offload_passes.tools.inspect_dump", str(d / "nope")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "does not exist" in r.stderr
    eps = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert eps["offload-inspect"] == "offload_passes.tools.inspect_dump:main"


def test_parse_readable_both_code_styles():
    readable = '''class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[4]", y):
        # File: model.py:3 in forward, code: a = x + y
        add: "f32[4]" = torch.ops.aten.add.Tensor(x, y);  x = None
        mul = add * 2;  add = y = None
        return (mul,)

    class submod_0(torch.nn.Module):
        def forward(self, z):
            inner = torch.ops.aten.neg.default(z)
            return inner
'''
    assert parse_readable(readable) == {"add": 'add: "f32[4]" = torch.ops.aten.add.Tensor(x, y)', "mul": "mul = add * 2"}
    bare = '''

def forward(self, arg0_1):
    dsa_serve_default = torch.ops.custom.dsa_serve.default(arg0_1, topk = 64);  arg0_1 = None
    return ()
'''
    assert parse_readable(bare) == {"dsa_serve_default": "dsa_serve_default = torch.ops.custom.dsa_serve.default(arg0_1, topk = 64)"}
    assert op_of("a = torch.ops.custom.dsa_plan.default(x)") == "custom.dsa_plan"
    assert op_of('a: "i32[4]" = torch.ops.custom.npu_gather_selection_kv_cache(x)') == "custom.npu_gather_selection_kv_cache"
    assert op_of("a = torch.where(x, y, z)") == "torch.where"
    assert op_of("a = b[0]") is None


def test_load_dump_api(real_dump):
    d, doc = real_dump
    dump = load_dump(d)
    g = dump.graph(None)
    assert g.graph_id == doc["graphs"][0]["graph_id"] and g.rewritten
    assert [p.name for p in g.passes] == ["dynamo", "rewrite", "functional", "reinplace"]
    with pytest.raises(DumpError, match="does not exist"):
        load_dump(Path(d) / "missing")


def test_passthrough_graph_without_dsa(tmp_path, capsys):
    doc = {"format": "offload_passes.report", "version": 1,
           "graphs": [{"graph_id": "graph_009", "rewritten": False, "mode": "eager"}]}
    (tmp_path / "report.json").write_text(json.dumps(doc))
    rc, out, _ = run(capsys, tmp_path)
    assert rc == 0
    assert "graph graph_009: not rewritten (no DSA sites: passed through)" in out
    assert "groups: none" in out and "layers: none" in out and "dumps: (no NN_<stage>.py files)" in out
    rc, _, err = run(capsys, tmp_path, "--dot", tmp_path / "x.dot")
    assert rc == 2 and "graph graph_009: no groups to draw" in err
