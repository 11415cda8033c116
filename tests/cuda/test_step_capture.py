"""One CUDA graph per decode step, on both paths: ``torch.compile(model, backend=make_offload_backend(exe_mode=
"cuda"), mode="reduce-overhead")`` (``offload_passes/lowering/cuda.py``: the lowering's own capture,
``lowering/cuda_graphs.py``), with ``torch.cuda.CUDAGraph`` replaced by the dispatch-level TEST DOUBLE of
``_capture_double.py`` (no GPU here).

* Fake CUDA (``_fake_cuda.py``): the recipe model (``tiny``; ``tiny-w8a8`` with the recipe's in-place cache
  writes) and a Hugging Face model with host KV (``hf-tiny`` on ``HostStaticCache``), every replacement
  policy: the decode step is one Dynamo graph, captured once after one eager warm-up, and every later step
  is one replay of it; what the capture holds (plan, serve, the installs inside their side-stream scopes, the
  joins, the host-cache writes, the guards, the model's indexer and sparse attention), and no host
  synchronisation (the double fails the capture on one, as a GPU does: shown by a step that has one).
* CPU tensors in the cuda mode (the kernels' CPU twins; the double's replays compute): the captured steps
  equal the unmodified model bit for bit over decode steps, a re-fill of a row and more steps, with a paged
  block table too; ``generate()`` with host KV gives the same tokens and scores as the op-by-op compile.

What only a GPU can show: a real capture (the side stream's events inside it, Triton launches with pinned
host pointers, ``torch.topk`` without a synchronisation) and its time against eager
(``benchmarks/gpu_check.py``, section ``graphs``).
"""
from __future__ import annotations

import pytest
import torch

import _capture_double as D
import _fake_cuda as F
from offload_passes import make_offload_backend, models
from offload_passes.lowering.cuda_graphs import CaptureRefused, GraphReplay, InputSpec

POLICIES = ["fifo", "second_chance"]
INSTALL = {"fifo": "custom::dsa_install", "second_chance": "offload_ref::dsa_install_sc"}
REDUCE = dict(mode="reduce-overhead")


@pytest.fixture(scope="module")
def double():
    with pytest.MonkeyPatch.context() as mp:
        yield D.install(mp)


@pytest.fixture(autouse=True, scope="module")
def _dynamo_beside_the_session_flow():
    """No torch._dynamo.reset() here: the session's fake-CUDA flow (``conftest.flow``) stays alive."""
    with torch._dynamo.config.patch(recompile_limit=64):
        yield


def _the_replay(be) -> GraphReplay:
    replays = list(be.lowering.replays.values())
    assert len(replays) == 1, list(be.lowering.replays)
    return replays[0]


def _count(ops, name):
    return sum(1 for o in ops if o == name)


def _scoped(ops):
    """Per side-stream scope of the captured order: the ops between its ``scope_enter`` and ``scope_exit``."""
    out, cur = [], None
    for o in ops:
        if o == "offload_cuda::scope_enter":
            cur = []
        elif o == "offload_cuda::scope_exit":
            out.append(cur)
            cur = None
        elif cur is not None:
            cur.append(o)
    return out


def _check_capture(ops, install, layers, groups, writes, write_op, scopes):
    assert _count(ops, "custom::dsa_plan") == groups
    assert _count(ops, "custom::dsa_serve") == layers
    assert _count(ops, install) == layers  # one md=0 install per layer, the group's md=1 one beside its last
    assert _count(ops, write_op) == writes  # the new rows into the host caches, device stores
    assert _count(ops, "offload_cuda::guard") > 0
    inside = _scoped(ops)
    assert len(inside) == scopes == _count(ops, "offload_cuda::stream_join")
    assert sum(_count(s, install) for s in inside) == layers  # every install on the side stream
    assert all(set(s) <= {install, "offload_cuda::record_stream"} for s in inside), inside
    assert ops.index("offload_cuda::stream_join") > ops.index("offload_cuda::scope_exit")


# ------------------------------------------------------------------------------------ fake CUDA: structure

@pytest.fixture(scope="module", params=[(p, pol) for p in ("tiny", "tiny-w8a8") for pol in POLICIES],
                ids=lambda x: f"{x[0]}-{x[1]}")
def recipe_capture(request, double):
    from test_fake_cuda_flow import run_flow

    preset, policy = request.param
    extra = dict(cache_write="inplace") if preset == "tiny-w8a8" else {}
    n0 = len(double.made)
    gen = run_flow(preset, reset=False, steps=4, compile_kw=REDUCE, backend_kw=dict(replacement_policy=policy),
                   **extra)
    flow = next(gen)
    yield dict(flow, preset=preset, policy=policy, graphs=double.made[n0:])
    gen.close()


def test_recipe_decode_step_is_one_captured_graph(recipe_capture):
    """4 steps, a re-fill (eager prefill of row 1), one more step: the step's one graph runs eagerly once,
    is captured on the second call and replayed on the 3 later ones; the outputs are on the device."""
    f = recipe_capture
    r = _the_replay(f["be"])
    assert (r.calls, r.eager_calls, len(r.captures), r.replays) == (5, 1, 1, 3)
    assert len(f["graphs"]) == 1 and f["graphs"][0].replays == 4  # the capture's own replay + 3
    assert all(s.logits.device.type == "cuda" for s in f["steps"])
    kinds = {s.kind for s in r.specs}
    assert kinds == {"fixed", "copy"}  # the token ids / positions copied; weights, caches, state fixed
    rep = f["be"].reports[-1]
    assert rep["rewritten"] and rep["refusals"] == []


def test_recipe_capture_holds_the_whole_step(recipe_capture):
    f = recipe_capture
    ops = f["graphs"][0].ops
    _check_capture(ops, INSTALL[f["policy"]], layers=8, groups=2, writes=8,
                   write_op="offload_ref::npu_mla_prolog_cache_write_", scopes=6)
    indexer = "offload_ref::npu_quant_lightning_indexer" if f["preset"] == "tiny-w8a8" \
        else "offload_ref::npu_lightning_indexer"
    assert _count(ops, indexer) == 2 and _count(ops, "offload_ref::npu_sparse_flash_attention") == 8
    assert _count(ops, "offload_ref::npu_scatter_nd_update_") == (4 if f["preset"] == "tiny-w8a8" else 0)
    other = INSTALL["fifo" if f["policy"] == "second_chance" else "second_chance"]
    assert other not in ops


def test_paged_recipe_step_with_host_kv_is_one_captured_graph(double):
    """A permuted block table (both groups paged): the model's kept gather reads the host caches through the
    pinned address (``HOST_OPERANDS``) and checks the table on the device, so the paged step captures too."""
    from test_cuda_paged import _permuted_table
    from test_fake_cuda_flow import run_flow

    n0 = len(double.made)
    table = _permuted_table(models.build("tiny", enable_offload=True, decode_steps=5).model)
    gen = run_flow("tiny", table=table, reset=False, steps=4, compile_kw=REDUCE)
    f = next(gen)
    try:
        assert [g["paged"] for g in f["be"].reports[-1]["groups"]] == [True, True]
        r = _the_replay(f["be"])
        assert (r.calls, len(r.captures), r.replays) == (5, 1, 3) and len(double.made) == n0 + 1
        ops = double.made[n0].ops
        _check_capture(ops, INSTALL["second_chance"], layers=8, groups=2, writes=8,
                       write_op="offload_ref::npu_mla_prolog_cache_write_", scopes=6)
        assert _count(ops, "custom::npu_gather_selection_kv_cache") == 8
    finally:
        gen.close()


@pytest.fixture(scope="module", params=POLICIES)
def hf_capture(request, double):
    from test_fake_cuda_hf import _flow

    n0 = len(double.made)
    r = _flow("bfloat16", compile_kw=REDUCE, backend_kw=dict(replacement_policy=request.param), steps=5)
    return dict(r, policy=request.param, graphs=double.made[n0:])


def test_hf_decode_step_with_host_kv_is_one_captured_graph(hf_capture):
    f = hf_capture
    r = _the_replay(f["be"])
    assert (r.calls, r.eager_calls, len(r.captures), r.replays) == (5, 1, 1, 3)
    assert len(f["graphs"]) == 1 and f["graphs"][0].replays == 4
    ops = f["graphs"][0].ops
    # 2 layers in one IndexShare group: one scope (the shared layer's md=0 install and the owner's md=1 one)
    _check_capture(ops, INSTALL[f["policy"]], layers=2, groups=1, writes=2,
                   write_op="offload_ref::static_cache_write_", scopes=1)
    assert f["moved"] == []  # no host-to-device copy in the (replayed) step


def test_a_host_sync_in_the_step_fails_the_capture(double):
    """The double fails a capture that reads a device value on the host or copies it there (a GPU capture
    fails with cudaErrorStreamCaptureUnsupported), and GraphReplay refuses it naming the op: the
    structure checks above can fail."""
    mode = F.new_mode()
    with mode:
        w = torch.ones(4, device="cuda")

    def step(x, w):
        y = x * w
        if y.sum().item() > 100:  # a host read of a device value
            y = y + 1
        return (y,)

    def to_host(x, w):
        return ((x * w).cpu(),)

    for fn, op in ((step, r"aten._local_scalar_dense.default reads a device value on the host"),
                   (to_host, r"aten._to_copy.default copies a device tensor to the host")):
        r = GraphReplay(fn, [InputSpec("x", "copy"), InputSpec("w", "fixed")], graph_factory=double)
        with mode:
            x = torch.ones(4, device="cuda")
            try:
                r(x, w)  # the eager warm-up: a host read is legal outside a capture
            except Exception:  # fake tensors have no value to read: the warm-up itself cannot run it
                pass
            with pytest.raises(CaptureRefused, match=r"captured step: the capture failed: TEST DOUBLE capture: "
                                                     + op):
                r(x, w)
        assert r.captures == {}


def test_an_unguarded_model_step_is_refused_at_compile_and_at_capture(double, monkeypatch):
    """The tiny recipe step with its guards left as ``aten._assert_async`` (a device-side assert: host-visible,
    fatal to the context): refused at compile time by ``capture_problems``, naming the nodes; with that check
    switched off too, the capture itself fails on the first of them."""
    from test_fake_cuda_flow import run_flow

    from offload_passes.lowering import cuda as lcuda

    monkeypatch.setattr(lcuda, "device_safe_guards", lambda gm: [])
    with pytest.raises(Exception, match=r"mode='reduce-overhead': graph \S+ cannot be captured in one CUDA graph "
                                        r"\(\d+ problems\): \S+: aten._assert_async.msg: device-side assert"):
        next(run_flow("tiny", reset=False, compile_kw=REDUCE))
    monkeypatch.setattr(lcuda, "capture_problems", lambda g: [])
    with pytest.raises(Exception, match=r"the capture failed: TEST DOUBLE capture: aten._assert_async.msg reads a "
                                        r"device value on the host"):
        next(run_flow("tiny", reset=False, compile_kw=REDUCE))


# ------------------------------------------------------------------------------------ CPU tensors: values

def _recipe_run(preset, fn, table=None, **over):
    b = models.build(preset, enable_offload=True, decode_steps=7, **over)
    if table is not None:
        b.model.block_table.copy_(table)
    b.driver.prefill()
    step = fn(b.model) if fn is not None else None
    logits = [b.driver.step(step).logits.clone() for _ in range(4)]
    refill = b.driver.reset_row(1, prompt_len=40)
    logits += [b.driver.step(step).logits.clone() for _ in range(2)]
    return logits, refill


@pytest.mark.parametrize("preset, policy, paged", [("tiny", "fifo", False), ("tiny", "second_chance", True),
                                                   ("tiny-w8a8", "second_chance", False)])
def test_captured_recipe_steps_equal_the_unmodified_model(double, preset, policy, paged):
    over = dict(cache_write="inplace") if preset == "tiny-w8a8" else {}
    table = None
    if paged:
        from test_cuda_paged import _permuted_table

        table = _permuted_table(models.build(preset, enable_offload=True, decode_steps=7, **over).model)
    be = make_offload_backend(exe_mode="cuda", pool_size=64, replacement_policy=policy)
    base = _recipe_run(preset, None, table, **over)
    comp = _recipe_run(preset, lambda m: torch.compile(m, backend=be, **REDUCE), table, **over)
    assert torch.equal(base[1], comp[1])
    diffs = [float((a.float() - b.float()).abs().max()) for a, b in zip(base[0], comp[0])]
    assert all(torch.equal(a, b) for a, b in zip(base[0], comp[0])), diffs
    r = _the_replay(be)
    assert (r.calls, len(r.captures), r.replays) == (6, 1, 4)  # every step after the capture is a replay
    assert be.state.totals()["hits"] > 0
    if paged:
        assert [g["paged"] for g in be.reports[-1]["groups"]] == [True, True]


NEW = 6


@pytest.mark.parametrize("policy", POLICIES)
def test_captured_hf_generate_with_host_kv_equals_the_op_by_op_compile(double, policy):
    """``generate()`` with ``HostStaticCache`` and ``model.forward`` compiled with mode="reduce-overhead": the
    prefill graph runs eagerly (its one call is its warm-up), the decode graph is captured on its second call
    and replayed after; tokens and every step's scores equal those of the same backend without capture, and
    the greedy tokens those of the unmodified model."""
    from offload_passes.hf_cache import HostStaticCache
    from offload_passes.models import hf

    B, L = 2, 72
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(2, 256, (B, L), generator=g)
    mask = torch.ones_like(ids)
    outs, bes = [], []
    for kw in ({}, REDUCE, None):
        m = hf.build("hf-tiny", dtype="bfloat16", num_hidden_layers=2, index_topk_pattern="FS").model
        m.generation_config.eos_token_id = None
        if kw is not None:
            be = make_offload_backend(exe_mode="cuda", pool_size=1024, replacement_policy=policy)
            m.forward = torch.compile(m.forward, backend=be, **kw)
            bes.append(be)
        cache = HostStaticCache(m.config, max_cache_len=L + NEW, batch_size=B, device="cpu", dtype=torch.bfloat16)
        outs.append(m.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                               past_key_values=cache, output_scores=True, return_dict_in_generate=True,
                               pad_token_id=0))
        if kw == REDUCE:  # a second generate() on a new cache: its state moved, the step is captured again
            again = HostStaticCache(m.config, max_cache_len=L + NEW, batch_size=B, device="cpu",
                                    dtype=torch.bfloat16)
            second = m.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                past_key_values=again, output_scores=True, return_dict_in_generate=True,
                                pad_token_id=0)
    eager, captured, unmodified = outs
    assert torch.equal(second.sequences, captured.sequences)
    assert all(torch.equal(a, b) for a, b in zip(second.scores, captured.scores))
    assert torch.equal(eager.sequences, captured.sequences)
    assert all(torch.equal(a, b) for a, b in zip(eager.scores, captured.scores))
    assert torch.equal(captured.sequences, unmodified.sequences)
    be = bes[1]
    # (calls, captures held, replays, captures dropped, eager calls) per lowered graph. The prefill graph: one call
    # per generate(), its second call (the same signature) is a capture. The decode graph: NEW - 1 calls per
    # generate(); the first warms up, the second captures, the rest replay; on the new cache the first call finds
    # the state moved (the old capture dropped, an eager call), the next captures again, the rest replay.
    assert [(r.calls, len(r.captures), r.replays, r.recaptures, r.eager_calls) for r in be.lowering.replays.values()] \
        == [(2, 1, 0, 0, 1), (2 * (NEW - 1), 1, 2 * (NEW - 3), 1, 2)]
    assert be.state.totals()["hits"] > 0 and be.lowering.replays != {} and bes[0].lowering.replays == {}
