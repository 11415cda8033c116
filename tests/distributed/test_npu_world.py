"""The W = 2 decode graph (``tiny``, rank 0 and rank 1 of a 2-rank world on torch's fake process group)
through the NPU lowerings, with the real TorchAir / npugraph_ex Python (tests/npu_doubles.py).

* ``ge_graph``: TorchAir's own converters lower the ``_c10d_functional`` collectives to HCOM ops, in the
  graph's collective order, on the main stream; every side-stream scope that a collective follows
  is joined (control edge from its last install) into that collective; the GE graphs of both ranks
  have the same HCOM sequence.
* ``npugraph_ex``: in npugraph_ex's final FX graph no side-stream scope contains a collective and every
  join (main-stream wait on ``done``) comes before the first collective after its scope; the collective
  sequence is that of the Dynamo graph, on both ranks.
"""
from __future__ import annotations

import pytest
import torch

from offload_passes import _compat, models
from offload_passes.backend import NpuOffloadBackend
from offload_passes.apps.world import collective_kinds, collective_sequence
from offload_passes.lowering.side_stream import SIDE_STREAM_LABEL, is_collective

PS = 64
#: TorchAir's GE type of each functional collective in the tiny W = 2 decode graph.
HCOM = {"all_gather_into_tensor": "HcomAllGather", "reduce_scatter_tensor": "HcomReduceScatter",
        "all_to_all_single": "HcomAllToAllV"}


class _Capture:
    """Wraps the NPU backend: the Dynamo graph's collectives, then the graph the rewrite left."""

    def __init__(self, be):
        self.be, self.before, self.gm = be, None, None

    def __call__(self, gm, example_inputs, **kw):
        self.before, self.gm = collective_sequence(gm), gm
        return self.be(gm, example_inputs, **kw)


def _tiny_w2():
    layout = models.ParallelLayout.current()
    return models.build("tiny", enable_offload=True, shared_indexer_offload=True, parallel=layout)


# ------------------------------------------------------------------------------------------ GE


def _ge(rank, fake_world, tmp_path):
    from google.protobuf import text_format
    from torchair._ge_concrete_graph.ge_ir_pb2 import GraphDef

    fake_world(rank)
    torch._dynamo.reset()
    b = _tiny_w2()
    be = NpuOffloadBackend(exe_mode="ge_graph", pool_size=PS, dump_dir=str(tmp_path / f"r{rank}"))
    cap = _Capture(be)
    step = torch.compile(b.model, backend=cap, fullgraph=True)
    with pytest.raises(RuntimeError, match="GE graphs cannot be compiled without CANN"):
        b.driver.step(step)
    rep = be.reports[-1]
    assert rep["rewritten"], rep["refusals"]
    (txt,) = (tmp_path / f"r{rank}").rglob("dynamo_optimized_*.txt")
    return text_format.Parse(txt.read_text(), GraphDef()), cap, rep


def test_ge_lowers_collectives_to_hcom_and_joins_before_them(torchair, fake_world, tmp_path):
    seqs = []
    for rank in (0, 1):
        proto, cap, rep = _ge(rank, fake_world, tmp_path)
        ops = list(proto.op)
        by_name = {op.name: op for op in ops}
        hcom = [op for op in ops if op.type.startswith("Hcom")]
        # TorchAir's converters lowered every collective of the Dynamo graph, in order
        assert cap.before and [HCOM[c[0]] for c in cap.before] == [op.type for op in hcom]
        assert collective_sequence(cap.gm) == cap.before  # the rewrite kept the sequence
        assert {op.attr["group"].s.decode() for op in hcom} != {""}
        for op in hcom:
            assert "_user_stream_label" not in op.attr, op.name  # collectives stay on the main stream
        installs = [op for op in ops if op.type == "DsaInstall"]
        assert installs and all(i.attr["_user_stream_label"].s.decode() == SIDE_STREAM_LABEL for i in installs)
        pos = {op.name: i for i, op in enumerate(ops)}

        def ancestors(op, seen):
            for t in op.input:
                p = t.rsplit(":", 1)[0]
                if p in by_name and p not in seen:
                    seen.add(p)
                    ancestors(by_name[p], seen)
            return seen

        # every install precedes (is an ancestor of) the first collective after it: none runs across one
        for inst in installs:
            later = [h for h in hcom if pos[h.name] > pos[inst.name]]
            if later:
                assert inst.name in ancestors(later[0], set()), (inst.name, later[0].name)
        seqs.append([(op.type, op.attr["group"].s) for op in hcom])
        assert rep["groups"] and [g["layers"] for g in rep["groups"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert seqs[0] == seqs[1]


# ------------------------------------------------------------------------------------------ npugraph_ex


def _ngx(rank, fake_world, npugraph_ex_pkg, stub):
    from npu_capture import captured_npugraph_ex_graph  # tests/npu_capture.py

    with captured_npugraph_ex_graph() as captured:
        with stub.installed():
            fake_world(rank)
            torch._dynamo.reset()
            b = _tiny_w2()
            cfg = npugraph_ex_pkg.CompilerConfig()
            _compat.set_npugraph_ex_option(cfg, "pattern_fusion_pass", False)
            be = NpuOffloadBackend(exe_mode="npugraph_ex", pool_size=PS, compiler_config=cfg)
            cap = _Capture(be)
            step = torch.compile(b.model, backend=cap, fullgraph=True)
            with pytest.raises(RuntimeError, match=stub.CAPTURE_UNAVAILABLE):
                b.driver.step(step)
    assert be.reports[-1]["rewritten"], be.reports[-1]["refusals"]
    return captured["gm"].graph, cap, be.reports[-1]


def test_ngx_no_scope_or_join_crosses_a_collective(npugraph_ex_pkg, torch_npu_double, reinplace_registered,
                                                   fake_world):
    seqs = []
    for rank in (0, 1):
        graph, cap, rep = _ngx(rank, fake_world, npugraph_ex_pkg, torch_npu_double)
        nodes = list(graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        coll = [n for n in nodes if is_collective(n)]
        assert cap.before and collective_sequence(cap.gm) == cap.before  # the rewrite kept the sequence
        # the lowering too (npugraph_ex's own all-to-all op replaces the functional one, same order / shapes)
        assert collective_kinds(graph) == collective_kinds(cap.gm) and len(coll) == len(cap.before)
        assert any(n.target is torch.ops.npu_define.all_to_all_single_npu.default for n in coll)
        enters = [n for n in nodes if str(n.target).endswith("scope_enter.default") and n.args[1] == [SIDE_STREAM_LABEL]]
        assert len(enters) == sum(max(len(g["layers"]) - 1, 1) for g in rep["groups"])
        for enter in enters:
            exit_ = next(n for n in nodes[pos[enter]:] if str(n.target).endswith("scope_exit.default"))
            assert not [n for n in nodes[pos[enter]:pos[exit_]] if is_collective(n)]
            (rec_done,) = [n for n in nodes[pos[enter]:pos[exit_]] if str(n.target).endswith("tagged_event_record.default")
                           and str(n.args[0]).startswith("dsa_offload_") and str(n.args[0]).endswith("_done")]
            done = rec_done.args[0]
            (join,) = [n for n in nodes if str(n.target).endswith("tagged_event_wait.default") and n.args[0] == done]
            ready = done.replace("_done", "_ready")
            (rec_ready,) = [n for n in nodes if str(n.target).endswith("tagged_event_record.default")
                            and n.args[0] == ready]
            # nothing between the fork (ready) and the join is a collective
            assert not [n.name for n in nodes[pos[rec_ready]:pos[join]] if is_collective(n)], done
            after = [c for c in coll if pos[c] > pos[exit_]]
            if after:
                assert pos[join] < pos[after[0]]
        seqs.append(collective_kinds(graph))
    assert seqs[0] == seqs[1] and len(seqs[0]) > 0
