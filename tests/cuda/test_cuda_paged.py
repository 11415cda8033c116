"""Paged groups in ``exe_mode="cuda"``, and the host's own writes into pinned host caches ordered after the kernels.

* A non-identity block table (a permutation of every block, what a cache manager hands out) on the ``tiny``
  recipe model: compiled in the cuda mode on CPU tensors (the Triton kernels' CPU twins, the stream ops as
  no-ops) it is exact against the unmodified model with the same table over decode steps, a re-fill of a row
  and more steps; both groups are paged (serve places the hits, the model's gather is kept and reads the rest
  through the table), the installs sit in their side-stream scopes. On fake CUDA tensors (``_fake_cuda.py``,
  the flow of ``test_fake_cuda_flow.py`` with that table) the paged groups are detected from the table's
  values, and every buffer stays where the CUDA placement put it.
* ``Driver.reset_row`` zeroes the row's full caches from the host. With pinned host caches the model waits for
  the device first (``offload_passes.cuda.before_host_write``; kernels launched earlier may still read the
  rows: ``dsa_serve``'s misses, or write them: the cache-write kernel): checked on fake CUDA as the order of
  operations (the wait, then the host writes, then the re-fill's writes as cache-write ops of device rows), and
  the wait itself against a TEST DOUBLE of ``torch.cuda`` (no driver here).
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from offload_passes import cuda, make_offload_backend, models

aten = torch.ops.aten
CUDA0, CPU = torch.device("cuda", 0), torch.device("cpu")
STEPS = 3


def _permuted_table(model, seed: int = 0) -> torch.Tensor:
    bt = model.block_table
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(bt.numel(), generator=g).to(torch.int32).view(bt.shape)


def _calls(graph, name: str) -> list:
    return [n for n in graph.nodes if n.op == "call_function" and name in str(n.target)]


@pytest.fixture(autouse=True, scope="module")
def _dynamo_beside_the_session_flow():
    """No torch._dynamo.reset() here: it would drop the graphs of the session's fake-CUDA flow
    (``conftest.flow``) other modules read; every new model compiles beside them instead."""
    with torch._dynamo.config.patch(recompile_limit=64):
        yield


@pytest.fixture(scope="module")
def cpu_run():
    base = models.build("tiny", enable_offload=True, decode_steps=STEPS + 1)
    comp = models.build("tiny", enable_offload=True, decode_steps=STEPS + 1)
    table = _permuted_table(base.model)
    for b in (base, comp):
        b.model.block_table.copy_(table)
    be = make_offload_backend(exe_mode="cuda", pool_size=64)
    step = torch.compile(comp.model, backend=be)
    out = {}
    for name, b, fn in (("base", base, None), ("comp", comp, step)):
        b.driver.prefill()
        logits = [b.driver.step(fn).logits for _ in range(STEPS)]
        refill = b.driver.reset_row(1, prompt_len=40)
        logits.append(b.driver.step(fn).logits)
        out[name] = (logits, refill)
    yield dict(out=out, be=be, table=table)


def test_paged_table_exact_in_cuda_mode(cpu_run):
    (l0, r0), (l1, r1) = cpu_run["out"]["base"], cpu_run["out"]["comp"]
    assert not torch.equal(cpu_run["table"].view(-1), torch.arange(cpu_run["table"].numel(), dtype=torch.int32))
    assert torch.equal(r0, r1)
    assert all(torch.equal(a, b) for a, b in zip(l0, l1)), [float((a - b).abs().max()) for a, b in zip(l0, l1)]
    be = cpu_run["be"]
    rep = be.reports[-1]
    assert rep["rewritten"] and rep["refusals"] == [] and [g["paged"] for g in rep["groups"]] == [True, True]
    assert be.state.totals()["hits"] > 0


def test_paged_graph_keeps_the_gather_and_scopes_the_installs(cpu_run):
    from offload_passes.lowering.cuda import STREAM_OPS

    g = cpu_run["be"].final_graph()
    assert len(_calls(g, "custom.dsa_serve")) == 8 and len(_calls(g, "custom.npu_gather_selection_kv_cache")) == 8
    nodes = list(g.nodes)
    enters = [i for i, n in enumerate(nodes) if n.target is STREAM_OPS["scope_enter"]]
    exits = [i for i, n in enumerate(nodes) if n.target is STREAM_OPS["scope_exit"]]
    installs = [i for i, n in enumerate(nodes) if n.op == "call_function" and "dsa_install" in str(n.target)]
    # the cuda mode's default policy: second chance (offload_passes/modes.py)
    assert {str(nodes[i].target) for i in installs} == {"offload_ref.dsa_install_sc.default"}
    # per group of 4: the 3 shared layers' md=0 installs, the owner's md=1 one in the last layer's scope
    assert len(enters) == len(exits) == 6 and len(installs) == 8
    assert all(any(a < i < b for a, b in zip(enters, exits)) for i in installs)


@contextlib.contextmanager
def _order_of_host_writes(events: list, monkeypatch):
    """Records, in order: the model's wait for the device, every write into a full cache on the host, and
    every cache-write op (its rows' device)."""
    def wait(dev):
        events.append(("wait", str(torch.device(dev))))

    class Writes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.offload_ref.npu_mla_prolog_cache_write_.default:
                events.append(("cache_write", str(args[0].device), str(args[3].device)))
            elif func._schema.is_mutable and args and isinstance(args[0], torch.Tensor) \
                    and args[0].device == CPU and args[0].dim() == 4:
                events.append(("host " + func._schema.name.split("::")[-1], str(args[0].device)))
            return func(*args, **kwargs)

    monkeypatch.setattr(cuda, "before_host_write", wait)
    with Writes():
        yield


@pytest.fixture(scope="module")
def fake_paged():
    from test_fake_cuda_flow import run_flow

    table = _permuted_table(models.build("tiny", enable_offload=True, decode_steps=3).model, seed=1)
    events: list = []
    mp = pytest.MonkeyPatch()
    try:
        gen = run_flow(table=table, record=lambda m, d: _order_of_host_writes(events, mp), reset=False)
        out = next(gen)
    finally:
        mp.undo()  # only the flow's re-fill ran with the recorder
    yield dict(out, events=events, table=table)
    next(gen, None)


def test_paged_groups_on_fake_cuda(fake_paged):
    be, m = fake_paged["be"], fake_paged["model"]
    rep = be.reports[-1]
    assert rep["rewritten"] and rep["refusals"] == [] and [g["paged"] for g in rep["groups"]] == [True, True]
    for name, b in m.named_buffers():
        leaf = name.rsplit(".", 1)[-1]
        assert b.device == (CPU if leaf in cuda.RECIPE_FULL and "indexer" not in name else CUDA0), name
    assert {k: t.device for k, t in be.state.tensors().items() if t.device != CUDA0} == {}
    g = be.final_graph()
    gathers = _calls(g, "custom.npu_gather_selection_kv_cache")
    assert len(gathers) == 8
    for n in gathers:  # the kept gather reads the host caches through the device block table
        vals = [a.meta.get("val") for a in n.args]
        assert (vals[5].device, vals[6].device, vals[7].device) == (CPU, CPU, CUDA0)
    assert all(s.logits.device == CUDA0 for s in fake_paged["steps"])


def test_reset_row_waits_for_the_device_before_the_host_writes(fake_paged):
    """The re-fill of row 1: one wait for cuda:0, then the host zeroes the row's full caches (2 per layer),
    then the prefill writes its rows as cache-write ops of device rows into the host caches; no host write
    before the wait."""
    ev = fake_paged["events"]
    assert ev[0] == ("wait", "cuda:0") and sum(e[0] == "wait" for e in ev) == 1
    host = [e for e in ev if e[0].startswith("host ")]
    writes = [e for e in ev if e[0] == "cache_write"]
    assert len(host) == 16 and {e[0] for e in host} == {"host zero_"}
    assert writes == [("cache_write", "cpu", "cuda:0")] * 8
    assert max(ev.index(e) for e in host) < min(i for i, e in enumerate(ev) if e[0] == "cache_write")


def test_before_host_write_synchronises_the_device(monkeypatch):
    """TEST DOUBLE of torch.cuda (no driver here): a CUDA device that is initialised is synchronised; a CPU
    device, or CUDA before its first use, is not."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev=None: calls.append(str(dev)))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    cuda.before_host_write("cuda:0")
    assert calls == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    cuda.before_host_write("cpu")
    cuda.before_host_write(torch.device("cuda", 1))
    assert calls == ["cuda:1"]
