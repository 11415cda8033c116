"""The host-KV write kernel (``custom_ops/cuda/cache_write.py``, the CUDA kernel of
``offload_ref::npu_mla_prolog_cache_write_``) under Triton's interpreter, against the CPU kernel.

On a GPU it stores through the pinned cache's address; here every tensor is a CPU tensor (the interpreter
runs the same program on host pointers). Checked: bit-equal to the CPU kernel over hypothesis cases (bf16 /
fp16, duplicates: the last row wins as in ``index_copy_``, any order), the CPU kernel's errors for bad
shapes and dtypes before anything is written, and an out-of-range row: nothing written, the error word set
and raised on the host by ``raise_device_errors`` (no device-side assert), then cleared.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

op = torch.ops.offload_ref.npu_mla_prolog_cache_write_.default


@pytest.fixture(scope="module")
def kern(triton_interpreted):
    from offload_passes.custom_ops.cuda import _common, cache_write

    return cache_write, _common


def _case(blocks, bs, dkv, dr, rows, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    kvc = torch.randn(blocks, bs, 1, dkv, generator=g).to(dtype)
    krc = torch.randn(blocks, bs, 1, dr, generator=g).to(dtype)
    idx = torch.tensor(rows, dtype=torch.int64)
    kv = torch.randn(len(rows), dkv, generator=g).to(dtype)
    kr = torch.randn(len(rows), dr, generator=g).to(dtype)
    return kvc, krc, idx, kv, kr


def _bits(t):
    return t.view(torch.int16)


@settings(max_examples=40, deadline=None)
@given(blocks=st.integers(1, 4), bs=st.sampled_from([1, 4, 16]), dkv=st.integers(1, 40), dr=st.integers(1, 9),
       n=st.integers(0, 40), dtype=st.sampled_from([torch.bfloat16, torch.float16]), seed=st.integers(0, 99),
       data=st.data())
def test_equals_the_cpu_kernel(kern, blocks, bs, dkv, dr, n, dtype, seed, data):
    k, _ = kern
    R = blocks * bs
    rows = data.draw(st.lists(st.integers(0, R - 1), min_size=n, max_size=n))
    if len(set(rows)) != len(rows):  # index_copy_ leaves duplicate order unspecified: keep the rows distinct
        rows = list(dict.fromkeys(rows))
    a = _case(blocks, bs, dkv, dr, rows, dtype, seed)
    b = [t.clone() for t in a]
    op(*a)                                   # the CPU kernel
    k.run(*b)                                # the Triton kernel (interpreter)
    assert torch.equal(_bits(a[0]), _bits(b[0])) and torch.equal(_bits(a[1]), _bits(b[1]))


def test_bad_shapes_same_error_before_any_write(kern):
    k, _ = kern
    kvc, krc, idx, kv, kr = _case(2, 4, 8, 4, [0, 1], torch.bfloat16, 0)
    before = kvc.clone()
    with pytest.raises(RuntimeError, match=r"kv must be \[T, 8\] \(D of kv_cache\), got \(2, 7\)"):
        k.run(kvc, krc, idx, kv[:, :7], kr)
    with pytest.raises(RuntimeError, match="kv dtype torch.float16 != kv_cache dtype torch.bfloat16"):
        k.run(kvc, krc, idx, kv.half(), kr)
    assert torch.equal(_bits(kvc), _bits(before))


def test_out_of_range_row_sets_the_error_word_and_raises_on_the_host(kern):
    k, common = kern
    common.raise_device_errors()  # nothing pending from earlier tests
    kvc, krc, idx, kv, kr = _case(2, 4, 8, 4, [3, 8, -1, 5], torch.bfloat16, 1)
    before = kvc.clone()
    k.run(kvc, krc, idx, kv, kr)  # no exception in the launch: a device cannot raise
    flat = kvc.view(8, 8)
    assert torch.equal(_bits(flat[3]), _bits(kv[0])) and torch.equal(_bits(flat[5]), _bits(kv[3]))
    untouched = [r for r in range(8) if r not in (3, 5)]
    assert torch.equal(_bits(flat[untouched]), _bits(before.view(8, 8)[untouched]))
    with pytest.raises(RuntimeError, match=r"device-side check failed: offload_ref::npu_mla_prolog_cache_write_ on "
                                           r"cpu: cache_index had values outside \[0, rows\)"):
        common.raise_device_errors()
    common.raise_device_errors()  # cleared: a second call is quiet


def test_a_host_cache_must_be_pinned_when_the_rows_are_on_the_device(kern):
    k, common = kern
    with pytest.raises(RuntimeError, match="kv_cache is a host tensor that is not pinned and contiguous"):
        common.host_operand(torch.zeros(2, 3), "offload_ref::npu_mla_prolog_cache_write_", "kv_cache")


@pytest.mark.device
def test_device_rows_into_a_pinned_cache_equal_the_cpu_kernel(dev):
    """The recipe's decode write at GLM-5 widths: 40 device rows at distinct positions of ``[8, 16, 1, 512]`` /
    ``[8, 16, 1, 64]`` caches, pinned on a GPU (the stores go through the pinned address), against the CPU kernel
    on host copies of the same data."""
    from _device import assert_pinned_write_equals_cpu
    from _harness import gen, randn
    from offload_passes.custom_ops.cuda import cache_write

    g = gen(dev, 1)
    cache = [randn(s, dev, g) for s in ((8, 16, 1, 512), (8, 16, 1, 64))]
    idx = torch.randperm(128, generator=g, device=dev)[:40]
    new = [randn(s, dev, g) for s in ((40, 512), (40, 64))]
    assert_pinned_write_equals_cpu(cache_write.run, op, cache, idx, new, dev)
