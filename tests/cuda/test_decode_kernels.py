"""The device implementations of the recipe model's decode ops (custom_ops/cuda/npu_lightning_indexer.py,
npu_quant_lightning_indexer.py, npu_sparse_flash_attention.py, scatter_nd_update.py) equal their CPU twins
bit for bit, on CPU tensors under Triton's interpreter.

* Random steps (hypothesis, ``_decode_cases.Case``): batch rows, query tokens per row, block sizes, paged and
  identity tables, every length from empty to the whole table, ``K`` below and above the window, head dims
  that are not powers of two, every layout pair and sparse mode the references take, bf16 / fp16 / fp32,
  values with many exact ties and values with NaN, +-inf and -0.0.
* The reference's data checks: flagged in the guard word with the reference's own message, nothing read or
  written out of range; its signature checks: the same exception before anything runs, once per signature.
* No host synchronisation and a fixed number of launches per call (counted as in test_install_launches.py).
* The model: ``tiny`` and ``tiny-w8a8`` (with the recipe's in-place cache writes), unmodified and offload
  (compiled), with these implementations as the ops' kernels: logits bit-identical to the references' run.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

import _decode_cases as DC
from offload_passes import _compat
from offload_passes.custom_ops.cuda import _common

indexer_op = torch.ops.offload_ref.npu_lightning_indexer.default
quant_op = torch.ops.offload_ref.npu_quant_lightning_indexer.default
sfa_op = torch.ops.offload_ref.npu_sparse_flash_attention.default
scatter_op = torch.ops.offload_ref.npu_scatter_nd_update_.default

CASES = settings(max_examples=120, deadline=None)
LAYOUTS = [("TND", "PA_BSND"), ("BSND", "BSND"), ("TND", "BSND"), ("BSND", "PA_BSND")]


@pytest.fixture(scope="module", autouse=True)
def kernels(triton_interpreted):
    from offload_passes.custom_ops.cuda import (npu_lightning_indexer, npu_quant_lightning_indexer,
                                                npu_sparse_flash_attention, scatter_nd_update)
    _common.raise_device_errors()  # nothing left over from another module
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield dict(indexer=npu_lightning_indexer, quant=npu_quant_lightning_indexer, sfa=npu_sparse_flash_attention,
               scatter=scatter_nd_update)
    torch.set_num_threads(n)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (``-0.0`` is not ``0.0``), NaN where the other has NaN: which NaN an operation
    produces (sign, payload) IEEE leaves to the hardware."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        w = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        nan = a.isnan()
        return torch.equal(nan, b.isnan()) and torch.equal(a.masked_fill(nan, 0).contiguous().view(w),
                                                           b.masked_fill(nan, 0).contiguous().view(w))
    return torch.equal(a, b)


def no_device_error() -> None:
    _common.raise_device_errors()  # raises if a kernel flagged a data check


@st.composite
def steps(draw, min_heads=1):
    B, S = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    bs, maxblk = draw(st.sampled_from([1, 4, 16])), draw(st.integers(1, 5))
    W = bs * maxblk
    kv = draw(st.lists(st.integers(0, W), min_size=B, max_size=B))
    lq, lk = draw(st.sampled_from(LAYOUTS))
    c = DC.Case(draw(st.integers(0, 2 ** 16)), B, S, bs, maxblk, kv, paged=draw(st.booleans()),
                values=draw(st.sampled_from(["normal", "ties", "special"])))
    return dict(case=c, layout=dict(layout_query=lq, layout_key=lk, mode=draw(st.sampled_from([0, 3]))),
                H=draw(st.integers(min_heads, 4)), D=draw(st.sampled_from([1, 3, 8, 24, 32])),
                K=draw(st.integers(1, W + 8)))


def _bsnd_key_without_lengths(kw: dict, draw_flag: bool) -> dict:
    if draw_flag and kw.get("layout_key") == "BSND":
        kw = dict(kw)
        kw.pop("actual_seq_lengths_key")  # BSND key without lengths: the whole S_kv is visible
    return kw


# --------------------------------------------------------------------------------------------
# the indexers
# --------------------------------------------------------------------------------------------

@CASES
@given(step=steps(), dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), drop=st.booleans())
def test_indexer_equals_reference(kernels, step, dtype, drop):
    c, lay = step["case"], step["layout"]
    args, kw = c.indexer(step["H"], step["D"], step["K"], dtype, **lay)
    kw = _bsnd_key_without_lengths(kw, drop)
    note(f"{lay} H={step['H']} D={step['D']} K={step['K']} kv={c.kv_len.tolist()} {c.values}")
    want = indexer_op(*args, **kw)
    got = kernels["indexer"].run(*args, **kw)
    no_device_error()
    assert same_bits(got[0], want[0]) and got[1].numel() == 0


@CASES
@given(step=steps(), drop=st.booleans())
def test_quant_indexer_equals_reference(kernels, step, drop):
    c, lay = step["case"], step["layout"]
    args, kw = c.quant_indexer(step["H"], step["D"], step["K"], **lay)
    kw = _bsnd_key_without_lengths(kw, drop)
    note(f"{lay} H={step['H']} D={step['D']} K={step['K']} kv={c.kv_len.tolist()} {c.values}")
    want = quant_op(*args, **kw)
    got = kernels["quant"].run(*args, **kw)
    no_device_error()
    assert same_bits(got, want)


def test_indexer_ties_and_special_scores_by_hand(kernels):
    """One token, one head, D = 1: scores w * relu(q * k) with equal scores, NaN, -0.0 / 0.0, +-inf: the
    reference's order (NaN first, then descending, equal scores by ascending id; -0.0 equals 0.0)."""
    keys = torch.tensor([1.0, 3.0, -5.0, 3.0, float("nan"), -0.0, float("inf"), 0.0, 2.0, float("nan")])
    key = keys.view(1, 10, 1, 1).to(torch.bfloat16)
    q = torch.ones(1, 1, 1, 1, dtype=torch.bfloat16)
    w = torch.ones(1, 1, 1, dtype=torch.bfloat16)
    kw = dict(layout_query="BSND", layout_key="BSND", sparse_count=12, sparse_mode=0)
    want = indexer_op(q, key, w, **kw)[0]
    got = kernels["indexer"].run(q, key, w, **kw)[0]
    assert want.flatten().tolist() == [4, 9, 6, 1, 3, 8, 0, 2, 5, 7, -1, -1]
    assert same_bits(got, want)
    w = -w  # scores -relu(k): -inf, many -0.0 / 0.0 ties; NaN still first
    assert same_bits(kernels["indexer"].run(q, key, w, **kw)[0], indexer_op(q, key, w, **kw)[0])


def test_indexer_glm_head_dims_one_step(kernels):
    """GLM-5's indexer heads (32 of 128) over a 1024-token paged table, K = 512, both indexers (the full
    K = 2048 over 4096 tokens compiles in test_cuda_compile.py; here the interpreter would take minutes)."""
    c = DC.Case(11, B=2, S=1, bs=128, maxblk=8, kv_len=[1021, 700])
    args, kw = c.indexer(32, 128, 512)
    assert same_bits(kernels["indexer"].run(*args, **kw)[0], indexer_op(*args, **kw)[0])
    args, kw = c.quant_indexer(32, 128, 512)
    assert same_bits(kernels["quant"].run(*args, **kw), quant_op(*args, **kw))
    no_device_error()


# --------------------------------------------------------------------------------------------
# sparse flash attention
# --------------------------------------------------------------------------------------------

@CASES
@given(step=steps(), offload=st.booleans(), rope=st.sampled_from([None, 2, 16]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       value=st.sampled_from(["key", "none", "other"]), mode=st.sampled_from([0, 3]))
def test_sfa_equals_reference(kernels, step, offload, rope, dtype, value, mode):
    c = step["case"]
    K = step["K"] if not offload else c.bs * max(1, step["K"] // c.bs)
    args, kw = c.sfa(step["H"], 8 * step["D"], rope, K, offload=offload, dtype=dtype, value=value)
    kw["sparse_mode"] = mode
    note(f"offload={offload} H={step['H']} D={8 * step['D']} rope={rope} K={K} {value} kv={c.kv_len.tolist()}")
    want = sfa_op(*args, **kw)
    got = kernels["sfa"].run(*args, **kw)
    no_device_error()
    assert same_bits(got[0], want[0])
    assert [tuple(g.shape) for g in got[1:]] == [(0,), (0,)] and got[1].dtype == torch.float32


def test_sfa_bsnd_layout(kernels):
    """BSND query and kv (no table): one block per batch row, with and without kv lengths."""
    g = torch.Generator().manual_seed(3)
    B, S, N, D, Skv, K = 2, 2, 3, 16, 12, 6
    q = torch.randn(B, S, N, D, generator=g).bfloat16()
    kv = torch.randn(B, Skv, 1, D, generator=g).bfloat16()
    idx = torch.randint(-1, Skv + 2, (B, S, 1, K), generator=g, dtype=torch.int32)
    for lengths in (None, torch.tensor([5, 12], dtype=torch.int32)):
        kw = dict(actual_seq_lengths_kv=lengths, layout_query="BSND", layout_kv="BSND", attention_mode=2)
        assert same_bits(kernels["sfa"].run(q, kv, kv, idx, 0.25, **kw)[0], sfa_op(q, kv, kv, idx, 0.25, **kw)[0])
    no_device_error()


def test_sfa_tokens_without_a_valid_position_are_zero(kernels):
    c = DC.Case(4, B=2, S=1, bs=4, maxblk=2, kv_len=[0, 5])
    args, kw = c.sfa(2, 16, 4, 8)
    args = (args[0], args[1], args[2], torch.full_like(args[3], -1), args[4])
    got = kernels["sfa"].run(*args, **kw)[0]
    assert same_bits(got, sfa_op(*args, **kw)[0]) and not got.any()


def test_sfa_glm_head_dims_one_step(kernels):
    """GLM-5's attention head dims (512 + 64) with one block of 16 heads and K = 256, over the paged cache
    and, with offload, over the selection buffer (64 heads and K = 2048 compile in test_cuda_compile.py)."""
    c = DC.Case(12, B=1, S=2, bs=128, maxblk=4, kv_len=[500])
    for offload in (False, True):
        args, kw = c.sfa(16, 512, 64, 256, offload=offload)
        assert same_bits(kernels["sfa"].run(*args, **kw)[0], sfa_op(*args, **kw)[0])
    no_device_error()


# --------------------------------------------------------------------------------------------
# the indexer-cache write
# --------------------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(k=st.integers(1, 3), dtype=st.sampled_from([torch.int8, torch.float16, torch.bfloat16, torch.float32]),
       n=st.integers(0, 12), seed=st.integers(0, 999))
def test_scatter_equals_cpu_kernel(kernels, k, dtype, n, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (7, 5, 1, 6)[: k + 1] if k < 3 else (7, 5, 3, 6)
    self = torch.randn(shape, generator=g).to(dtype) if dtype != torch.int8 else \
        torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
    flat = torch.randperm(int(torch.tensor(shape[:k]).prod()), generator=g)[:n]  # distinct rows, as the model
    idx = torch.stack(torch.unravel_index(flat, shape[:k]), -1) if n else torch.zeros(0, k, dtype=torch.long)
    upd = torch.randn((idx.size(0), *shape[k:]), generator=g).to(dtype) if dtype != torch.int8 else \
        torch.randint(-128, 128, (idx.size(0), *shape[k:]), generator=g, dtype=torch.int8)
    a, b = self.clone(), self.clone()
    scatter_op(a, idx, upd)
    kernels["scatter"].run(b, idx.to(torch.int32), upd)
    no_device_error()
    assert same_bits(a, b)


def test_scatter_out_of_range_row_is_flagged_and_not_written(kernels):
    cache = torch.zeros(4, 3, 1, 2, dtype=torch.bfloat16)
    idx = torch.tensor([[1, 2], [4, 0], [0, -1], [3, 1]])
    upd = torch.ones(4, 1, 2, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"indices\[:, 0\] must be in \[0, 4\)"):
        scatter_op(cache.clone(), idx, upd)  # the CPU kernel: raises, nothing written
    kernels["scatter"].run(cache, idx, upd)
    assert cache[1, 2].eq(1).all() and cache[3, 1].eq(1).all() and int(cache.ne(0).sum()) == 4
    with pytest.raises(RuntimeError) as e:
        _common.raise_device_errors()
    # the largest code wins: dim 1's message was registered after dim 0's
    assert "offload_ref::npu_scatter_nd_update_: indices[:, 1] must be in [0, 3)" in str(e.value)
    assert "checked on the device, reported on the host" in str(e.value)


def test_scatter_more_index_dims_than_the_kernel_takes(kernels):
    cache = torch.zeros(2, 2, 2, 2, 2, 3)
    idx = torch.zeros(1, 5, dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"offload_ref::npu_scatter_nd_update_: indices' last dim k must be <= 4 "
                                           r"for the CUDA kernel, got 5"):
        kernels["scatter"].run(cache, idx, torch.ones(1, 3))
    scatter_op(cache, idx, torch.ones(1, 3))  # the CPU kernel takes any k
    assert cache[0, 0, 0, 0, 0].eq(1).all()


# --------------------------------------------------------------------------------------------
# data checks on the device, signature checks on the host (once)
# --------------------------------------------------------------------------------------------

def _indexer_case():
    c = DC.Case(21, B=2, S=2, bs=4, maxblk=3, kv_len=[7, 12])
    return c.indexer(2, 8, 6)


def _sfa_case():
    c = DC.Case(22, B=2, S=2, bs=4, maxblk=3, kv_len=[7, 12])
    return c.sfa(2, 16, 4, 6)


def _bad_table(kw):
    kw["block_table"] = kw["block_table"].clone()
    kw["block_table"][1, 0] = 99
    return kw


def _cut_table(kw):
    kw["block_table"] = kw["block_table"][:, :2].contiguous()  # 8 positions, row 1 sees 12
    return kw


def _set(name, value):
    def change(kw):
        kw[name] = torch.tensor(value, dtype=torch.int32)
        return kw
    return change


DATA_ERRORS = [  # (op, change, the reference's message: what the device flags)
    ("indexer", _bad_table, "block_table holds a block id outside [0, 9) for a position that must be read"),
    ("indexer", _cut_table, "a position that must be read lies beyond block_table's 2 blocks (block_size 4)"),
    ("indexer", _set("actual_seq_lengths_key", [-1, 12]), "actual_seq_lengths_key must be >= 0"),
    # query lengths whose wrong token map still keeps every window inside the table: one check fails (when
    # several fail, the guard word holds one of their messages)
    ("indexer", _set("actual_seq_lengths_query", [5, 4]), "actual_seq_lengths_query must be cumulative (non-decreasing)"),
    ("indexer", _set("actual_seq_lengths_query", [2, 5]), "actual_seq_lengths_query[-1] must equal the query token count T=4"),
    ("indexer", _set("actual_seq_lengths_query", [-1, 4]), "actual_seq_lengths_query must start at >= 0"),
    ("sfa", _bad_table, "block_table holds a block id outside [0, 9) for a position that must be read"),
    ("sfa", _cut_table, "a position that must be read lies beyond block_table's 2 blocks (block_size 4)"),
    ("sfa", _set("actual_seq_lengths_query", [2, 5]), "actual_seq_lengths_query[-1] must equal the query token count T=4"),
]


@pytest.mark.parametrize("op,change,msg", DATA_ERRORS, ids=[f"{o}-{m[:40]}" for o, _, m in DATA_ERRORS])
def test_data_check_flags_the_references_message(kernels, op, change, msg):
    args, kw = _indexer_case() if op == "indexer" else _sfa_case()
    if op == "sfa":  # positions in every block column, so that the bad block and the cut column are read
        args = args[:3] + (torch.arange(0, 12, 2, dtype=torch.int32).expand(4, 1, 6).contiguous(),) + args[4:]
    kw = change(dict(kw))
    ref, dev = (indexer_op, kernels["indexer"]) if op == "indexer" else (sfa_op, kernels["sfa"])
    qual = f"offload_ref::npu_{'lightning_indexer' if op == 'indexer' else 'sparse_flash_attention'}"
    with pytest.raises(RuntimeError) as e:
        ref(*args, **kw)
    assert str(e.value).startswith(f"{qual}: {msg}")  # the CPU reference raises it (with the values)
    out = dev.run(*args, **kw)  # the device: no exception, nothing read out of range, the output's shape
    assert tuple(out[0].shape) == ((4, 1, 6) if op == "indexer" else tuple(args[0].shape))
    with pytest.raises(RuntimeError) as e:
        _common.raise_device_errors()
    assert f"device-side check failed: {qual}: {msg} (on cpu;" in str(e.value)
    no_device_error()  # cleared once reported


SIGNATURE_ERRORS = [
    ("indexer", lambda a, kw: ((a[0].float(),) + a[1:], kw), "key dtype torch.bfloat16 must equal query dtype"),
    ("indexer", lambda a, kw: (a, dict(kw, sparse_count=4096)), "sparse_count must be in (0, 2048]"),
    ("indexer", lambda a, kw: (a, dict(kw, layout_key="ND")), "layout_key must be 'PA_BSND' or 'BSND'"),
    ("sfa", lambda a, kw: (a, dict(kw, attention_mode=0)), "attention_mode must be 2"),
    ("sfa", lambda a, kw: (a[:3] + (a[3].long(),) + a[4:], kw), "sparse_indices must be int32"),
]


@pytest.mark.parametrize("op,change,msg", SIGNATURE_ERRORS, ids=[m[:30] for _, _, m in SIGNATURE_ERRORS])
def test_signature_errors_are_the_references(kernels, op, change, msg):
    args, kw = change(*(_indexer_case() if op == "indexer" else _sfa_case()))
    ref, dev = (indexer_op, kernels["indexer"]) if op == "indexer" else (sfa_op, kernels["sfa"])
    with pytest.raises(RuntimeError) as want:
        ref(*args, **kw)
    with pytest.raises(RuntimeError) as got:
        dev.run(*args, **kw)
    assert str(got.value) == str(want.value) and msg in str(got.value)


def test_validation_runs_once_per_signature(kernels, monkeypatch):
    from offload_passes.custom_ops import npu_lightning_indexer as M
    calls = []
    real = M.validate_npu_lightning_indexer
    monkeypatch.setattr(M, "validate_npu_lightning_indexer", lambda *a: calls.append(1) or real(*a))
    c = DC.Case(23, B=1, S=1, bs=4, maxblk=2, kv_len=[5])
    args, kw = c.indexer(2, 8, 3)
    kw["sparse_count"] = 5  # a signature no other test used
    for _ in range(3):
        kernels["indexer"].run(*args, **kw)
    assert len(calls) == 1


# --------------------------------------------------------------------------------------------
# no host synchronisation, launches per call
# --------------------------------------------------------------------------------------------

def test_no_host_sync_and_launches_per_call(kernels):
    """What the device implementations run around their kernels: no op that reads a device value on the host
    (the capture refusals of offload_passes/lowering/cuda_graphs.py), and a fixed, small number of launches."""
    from test_install_launches import counted_launches

    from offload_passes.lowering.cuda_graphs import SYNC_OPS
    sync = {str(op._schema.name).split("::")[1] for op in SYNC_OPS}
    c = DC.Case(24, B=2, S=2, bs=4, maxblk=3, kv_len=[7, 12])
    inputs = {"indexer": c.indexer(2, 8, 6), "sfa": c.sfa(2, 16, 4, 6)}
    runs = {name: (lambda name=name: kernels[name].run(*inputs[name][0], **inputs[name][1])) for name in inputs}
    want = {"indexer": {"triton:_indexer_score_kernel": 1, "aten:topk": 1, "triton:_indexer_finish_kernel": 1},
            "sfa": {"triton:_sfa_score_kernel": 1, "triton:_sfa_stats_kernel": 1, "triton:_sfa_out_kernel": 1,
                    "aten:_to_copy": 1}}
    for name, module in (("indexer", kernels["indexer"]), ("sfa", kernels["sfa"])):
        runs[name]()  # validated once: the counted call is the steady state
        with counted_launches(module) as counts:
            runs[name]()
        assert not sync & {k.split(":")[1] for k in counts}, counts
        assert {k: v for k, v in counts.items() if k not in ("aten:clone", "aten:new_empty")} == want[name], counts
    no_device_error()


# --------------------------------------------------------------------------------------------
# the model, with these implementations as the ops' kernels
# --------------------------------------------------------------------------------------------

@contextlib.contextmanager
def device_implementations_as_cpu_kernels(kernels):
    """TEST ARRANGEMENT: the device implementations registered as the CPU kernels of the four ops (the
    interpreter runs them on CPU tensors), so that the unmodified model and the compiled offload step call
    them where they call the references; the references' kernels come back afterwards."""
    import warnings
    from collections import Counter
    calls: Counter = Counter()

    def counted(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return run

    lib = torch.library.Library("offload_ref", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        for op, key in (("npu_lightning_indexer", "indexer"), ("npu_quant_lightning_indexer", "quant"),
                        ("npu_sparse_flash_attention", "sfa"), ("npu_scatter_nd_update_", "scatter")):
            _compat.library_impl_override(lib, op, counted(key, kernels[key].run), "CPU")
    try:
        yield calls
    finally:
        lib._destroy()


def _run_model(preset: str, offload: bool, steps: int, **overrides) -> list:
    """Prefill logits, then each decode step's: the unmodified model eagerly, or compiled with the offload."""
    from offload_passes import make_offload_backend, models
    torch._dynamo.reset()
    built = models.build(preset, enable_offload=True, decode_steps=steps, **overrides)
    be = make_offload_backend(pool_size=64) if offload else None
    res = built.driver.run(steps=steps, step_fn=torch.compile(built.model, backend=be) if offload else None)
    assert not offload or be.reports[-1]["rewritten"]
    return [res.prefill_logits] + res.logits


@pytest.mark.parametrize("preset,overrides", [("tiny", {}), ("tiny-w8a8", {"cache_write": "inplace"})],
                         ids=["tiny", "tiny-w8a8-inplace"])
@pytest.mark.parametrize("offload", [False, True], ids=["unmodified", "offload"])
def test_model_steps_equal_the_references(kernels, preset, overrides, offload):
    """3 decode steps of 8 layers (2 indexer layers, IndexShare FSSSFSSS): 6 indexer and 24 attention calls;
    in-place cache writes: each indexer layer writes its key and scale caches in the prefill and every step."""
    want = _run_model(preset, offload, 3, **overrides)
    with device_implementations_as_cpu_kernels(kernels) as calls:
        got = _run_model(preset, offload, 3, **overrides)
    no_device_error()
    int8 = preset == "tiny-w8a8"
    assert dict(calls) == {("quant" if int8 else "indexer"): 6, "sfa": 24, **({"scatter": 2 * 2 * 4} if int8 else {})}
    assert len(got) == len(want) == 4
    assert all(same_bits(g, w) for g, w in zip(got, want))
    # the references' kernels are back: a bad block id raises at once again
    args, kw = _indexer_case()
    with pytest.raises(RuntimeError, match="block_table holds a block id outside"):
        indexer_op(*args, **_bad_table(dict(kw)))
