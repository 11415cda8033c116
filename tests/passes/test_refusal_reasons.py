"""Every refusal reason the passes can give is triggered here by a real graph: a variant of the synthetic
DSA model (a model option, or a backend option), compiled through Dynamo exactly as a user would.

For each: the graph is compiled unmodified (identical results, == 0), exactly one warning names the
reason and its detail, the report lists it, and ``strict=True`` raises ``OffloadRefused`` with it.
``test_every_reason_in_the_code_is_exercised`` keeps this table complete: a reason code added to the
passes without a test here fails it.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from torch import fx

import dsa_synth as synth
from backend_helpers import run_pair
from offload_passes.backend import OffloadRefused, make_offload_backend, rewrite_for_offload
from offload_passes.options import OffloadOptions

PS = 256
ROOT = Path(__file__).resolve().parents[2]

# reason -> (SynthConfig changes, backend options, a fragment the warning's detail must contain)
VARIANTS: dict[str, tuple[dict, dict, str]] = {
    "disabled": ({}, {"enable_offload": False}, "enable_offload / shared_indexer_offload is off"),
    "unknown_topk_producer": (dict(topk_source="torch_topk"), {}, "not a lightning indexer"),
    "site_not_verified": (dict(sfa_indices_from_gather=False), {},
                          "sparse_indices are not derived from the gather's result"),
    "topk_alignment": (dict(K=96), {}, "top-k width K=96 must be a multiple of 64"),
    "gather_block_size": (dict(K=32, BS=16, gather_block_size=2), {}, "selection_topk_block_size=2 (only 1"),
    "raw_seq": (dict(S=5), {}, "raw_seq S=5 must be in [1, 4]"),
    "next_n": (dict(S=2), {"next_n": 0}, "graph has raw_seq S=2, config next_n=0"),
    "pa_block_size": ({}, {"pa_block_size": 32}, "graph block size 16 != config pa_block_size 32"),
    "dims": (dict(Dkv=576), {}, "Dkv=576 must be in (0, 512]"),
    "selection_layout": (dict(sel_extra_blocks=2), {}, "must hold exactly B*S*K"),
    "selection_not_input": (dict(sel_views=True), {}, "is not a graph input"),
    "group_inconsistent": (dict(shared_own_lengths=True), {}, "sites use different cache lengths"),
    "pool_size": (dict(BS=32, pattern="F"), {"pool_size": 16}, "pool_size=16 must be a multiple of the selection block size 32"),
    "quantised_kv": (dict(kv_dtype=torch.int8), {}, "full_kv_cache dtype torch.int8: only unquantised"),
}


def _cfg(changes: dict) -> synth.SynthConfig:
    base = dict(pattern="FS", S=1, router=False)
    base.update(changes)
    return synth.SynthConfig(**base)


def _capture(cfg: synth.SynthConfig):
    """The Dynamo graph and example inputs of a synthetic variant, as the backend receives them."""
    got = {}

    def grab(gm, ex):
        got["gm"], got["ex"] = gm, list(ex)
        return gm.forward

    _, m = synth.make_pair(cfg, [300, 280])
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(m, backend=grab)(*m.inputs(torch.tensor([300, 280]) + cfg.S, 0))
    return got["gm"], got["ex"]


def _assert_refused(reason: str, detail: str, gm: fx.GraphModule, ex: list, opts: dict, caplog) -> None:
    code = gm.code
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="offload_passes"):
        gm2, state, rep = rewrite_for_offload(gm, ex, OffloadOptions(pool_size=opts.pop("pool_size", PS), **opts))
    assert state is None and rep["rewritten"] is False and gm2.code == code
    assert reason in {r["reason"] for r in rep["refusals"]}
    assert any(detail in r["detail"] for r in rep["refusals"] if r["reason"] == reason), rep["refusals"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and reason in warnings[0] and detail in warnings[0], warnings


@pytest.mark.parametrize("reason", sorted(VARIANTS))
def test_refusal_reason(reason, caplog):
    changes, opts, detail = VARIANTS[reason]
    cfg = _cfg(changes)
    caplog.clear()
    be = make_offload_backend(**{"pool_size": PS, **opts})
    with caplog.at_level(logging.WARNING, logger="offload_passes"):
        res = run_pair(cfg, 2, be)
    rep = be.reports[-1]
    assert rep["rewritten"] is False
    reasons = {r["reason"] for r in rep["refusals"]}
    assert reason in reasons
    assert any(detail in r["detail"] for r in rep["refusals"] if r["reason"] == reason), rep["refusals"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "not applied" in r.getMessage()]
    assert len(warnings) == 1 and reason in warnings[0], warnings
    # the unmodified graph ran: identical results, gathers still there
    assert res["max_h"] == 0.0 and res["max_a"] == 0.0
    assert rep["ops"]["after"]["npu_gather_selection_kv_cache"] == len(cfg.pattern)
    # strict: the same graph raises instead
    _, m = synth.make_pair(cfg, [300, 280])
    c = torch.compile(m, backend=make_offload_backend(**{"pool_size": PS, **opts, "strict": True}))
    with pytest.raises(Exception, match=reason) as ei, torch.no_grad():
        c(*m.inputs(torch.tensor([300, 280]) + cfg.S, 0))
    chain = [ei.value, ei.value.__cause__, ei.value.__context__]
    assert any(isinstance(e, OffloadRefused) for e in chain) or "OffloadRefused" in str(ei.value)


def test_no_example_values_is_refused(caplog):
    """``rewrite_for_offload`` is public and takes any ``fx.GraphModule``: one from a tool that records no
    example values (hand-built, ``fx.symbolic_trace``, or a copy without meta) cannot have its shapes
    checked, so nothing is rewritten. Modelled by the Dynamo graph of a valid variant without its meta."""
    gm, ex = _capture(_cfg({}))
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            n.meta.pop("example_value", None)
            n.meta.pop("val", None)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="offload_passes"):
        gm2, state, rep = rewrite_for_offload(gm, ex, OffloadOptions(pool_size=PS))
    assert state is None and rep["rewritten"] is False
    assert {r["reason"] for r in rep["refusals"]} == {"no_example_values"}
    assert all("tensor shapes unknown" in r["detail"] for r in rep["refusals"])
    with pytest.raises(OffloadRefused, match="no_example_values"):
        rewrite_for_offload(gm, ex, OffloadOptions(pool_size=PS, strict=True))


# Variants our own fake kernels already reject while Dynamo traces, but CANN's Meta kernels (output shapes
# only) let through on an Ascend machine: there the precondition is the only check before the rewrite
# replaces the gather (whose NPU kernel would have validated at run time). Checked with CANN's library
# stand-in (TEST DOUBLE, tests/testdoubles) owning the custom:: schemas, in a child process.
CANN_META_VARIANTS: dict[str, tuple[dict, str]] = {
    "topk_layout": (dict(S=2, topk_view="B1SK"), "is not [B, S, 1, K] / [B*S, 1, K] with B=2"),
    "kv_dtype": (dict(dtype=torch.float16, full_dtype=torch.bfloat16), "selection and full caches differ in dtype"),
    "lengths": (dict(lengths_dtype=torch.int64), "torch.int64 must be int32 [B=2]"),
    "paged_layout": (dict(table_dtype=torch.int64), "full_kv_block_table dtype torch.int64 must be int32"),
}

_CANN_CHILD = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import offload_passes
from offload_passes.custom_ops import cann_library_status
from offload_passes.backend import OffloadRefused, rewrite_for_offload
from offload_passes.options import OffloadOptions
import dsa_synth as synth
assert cann_library_status().loaded, cann_library_status().as_dict()
out = {}
for reason, changes in json.loads(sys.argv[2]).items():
    changes = {k: (getattr(torch, v[6:]) if isinstance(v, str) and v.startswith("torch.") else v)
               for k, v in changes.items()}
    cfg = synth.SynthConfig(**{"pattern": "FS", "S": 1, "router": False, **changes})
    got = {}
    def grab(gm, ex):
        got["gm"], got["ex"] = gm, list(ex)
        return gm.forward
    _, m = synth.make_pair(cfg, [300, 280])
    torch._dynamo.reset()
    try:  # the capture is all we need; running it may fail in our validating CPU kernels
        with torch.no_grad():
            torch.compile(m, backend=grab)(*m.inputs(torch.tensor([300, 280]) + cfg.S, 0))
    except Exception:
        pass
    gm, ex = got["gm"], got["ex"]
    code = gm.code
    gm2, state, rep = rewrite_for_offload(gm, ex, OffloadOptions(pool_size=256))
    try:
        rewrite_for_offload(gm, ex, OffloadOptions(pool_size=256, strict=True))
        strict = None
    except OffloadRefused as e:
        strict = str(e)
    out[reason] = {"rewritten": rep["rewritten"], "state": state is not None, "unchanged": gm2.code == code,
                   "refusals": rep["refusals"], "strict": strict}
print(json.dumps(out))
"""


def test_reasons_only_cann_meta_graphs_can_reach():
    import json
    import os
    import subprocess
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "testdoubles"))
    import cann_standin

    lib = cann_standin.build()
    spec = {r: {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in ch.items()}
            for r, (ch, _) in CANN_META_VARIANTS.items()}
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", OFFLOAD_PASSES_CANN_OPS_LIB=str(lib))
    res = subprocess.run([sys.executable, "-c", _CANN_CHILD, str(Path(__file__).parent), json.dumps(spec)],
                         env=env, cwd=ROOT / "tests", capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-6000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for reason, (_, detail) in CANN_META_VARIANTS.items():
        r = out[reason]
        assert not r["rewritten"] and not r["state"] and r["unchanged"], (reason, r)
        assert any(f["reason"] == reason and detail in f["detail"] for f in r["refusals"]), (reason, r)
        assert r["strict"] is not None and reason in r["strict"], (reason, r)


# Reasons of other front-ends, triggered by their own tests (reason -> "file::test" that asserts it).
TESTED_ELSEWHERE: dict[str, str] = {
    "float8_indexer_cache": "tests/passes/test_detect_producers.py::test_float8_indexer_cache_is_a_named_refusal",
    "hf_site_not_verified": "tests/hf/test_sparse_semantics.py::",
    "dynamic_cache": "tests/hf/test_dynamic_cache.py::test_the_graph_bound_modes_refuse_a_grown_cache_by_name",
    "id_range": "tests/hf/test_dynamic_cache.py::test_a_cache_past_the_id_range_is_refused_by_name",
    "dense_cheaper": "tests/hf/test_sparse_semantics.py::test_graph_where_dense_is_cheaper_is_left_as_is",
    "cache_layout": "tests/hf/test_sparse_semantics.py::test_offload_refusal_keeps_the_sparse_rewrite",
    "hf_compressed_kv": "tests/hf/test_zoo.py::test_outcome_in_fp32_the_sparse_rewrite_is_exact_or_the_model_runs_unmodified",
    "indexer_split": "tests/hf/test_zoo.py::test_outcome_in_fp32_the_sparse_rewrite_is_exact_or_the_model_runs_unmodified",
    "block_topk": "tests/hf/test_zoo.py::test_outcome_in_fp32_the_sparse_rewrite_is_exact_or_the_model_runs_unmodified",
    "attention_topk": "tests/hf/test_zoo.py::test_outcome_in_fp32_the_sparse_rewrite_is_exact_or_the_model_runs_unmodified",
    "no_rope_npu": "tests/passes/test_rewrite_eager.py::test_no_rope_model_keeps_the_gather_in_the_npu_modes",
}


def test_reasons_tested_elsewhere_are_asserted_there():
    for reason, where in TESTED_ELSEWHERE.items():
        path, _, test = where.partition("::")
        text = (ROOT / path).read_text()
        assert f'"{reason}"' in text, f"{path} does not assert the reason {reason!r}"
        if test:
            assert f"def {test}(" in text, f"{path} has no test {test}"


def _reasons_in_code() -> set[str]:
    """Reason codes as written in the passes: ``Refusal("<code>", <detail>)`` and the precondition checker's
    ``chk(<cond>, "<code>", <detail>)``: a snake_case literal followed by the (f-)string detail."""
    found: set[str] = set()
    call = re.compile(r'\b(?:Refusal|chk)\((.*?)"([a-z][a-z0-9_]*)",\s*f?"(?![a-z][a-z0-9_]*",)', re.S)
    for p in (ROOT / "offload_passes").rglob("*.py"):
        found |= {m.group(2) for m in call.finditer(p.read_text())}
    return found


def test_every_reason_in_the_code_is_exercised():
    in_code = _reasons_in_code()
    exercised = set(VARIANTS) | {"no_example_values"} | set(CANN_META_VARIANTS) | set(TESTED_ELSEWHERE)
    assert in_code, "no reason codes found: the grep no longer matches the code"
    assert in_code == exercised, (f"untested reasons: {sorted(in_code - exercised)}; "
                                  f"tested but gone from the code: {sorted(exercised - in_code)}")
