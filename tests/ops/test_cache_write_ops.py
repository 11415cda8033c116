"""The in-place cache-write test doubles (``offload_ref::npu_mla_prolog_cache_write_``,
``offload_ref::npu_scatter_nd_update_``, custom_ops/cache_write.py): semantics against a literal
loop, opcheck, and bad input rejected before anything is written."""
from __future__ import annotations

import pytest
import torch

import offload_passes.custom_ops  # noqa: F401

ref = torch.ops.offload_ref


def test_prolog_cache_write_matches_a_loop():
    g = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(6, 4, 1, 8, generator=g).bfloat16()
    kr_cache = torch.randn(6, 4, 1, 2, generator=g).bfloat16()
    idx = torch.tensor([0, 23, 5, 9], dtype=torch.int64)
    kv, kr = torch.randn(4, 8, generator=g).bfloat16(), torch.randn(4, 2, generator=g).bfloat16()
    want_kv, want_kr = kv_cache.clone(), kr_cache.clone()
    for t, slot in enumerate(idx.tolist()):
        want_kv[slot // 4, slot % 4, 0] = kv[t]
        want_kr[slot // 4, slot % 4, 0] = kr[t]
    assert ref.npu_mla_prolog_cache_write_(kv_cache, kr_cache, idx.int(), kv, kr) is None
    assert torch.equal(kv_cache, want_kv) and torch.equal(kr_cache, want_kr)


def test_scatter_nd_update_matches_a_loop():
    g = torch.Generator().manual_seed(1)
    cache = torch.randint(-128, 127, (5, 4, 1, 6), generator=g, dtype=torch.int8)
    nd = torch.tensor([[0, 3], [4, 0], [2, 2]], dtype=torch.int32)
    upd = torch.randint(-128, 127, (3, 1, 6), generator=g, dtype=torch.int8)
    want = cache.clone()
    for r, (b, o) in enumerate(nd.tolist()):
        want[b, o] = upd[r]
    ref.npu_scatter_nd_update_(cache, nd, upd)
    assert torch.equal(cache, want)
    scales = torch.zeros(5, 4, 1, dtype=torch.float16)  # k = rank - 1: the dequant-scale cache
    ref.npu_scatter_nd_update_(scales, nd, torch.tensor([[1.5], [2.5], [3.5]], dtype=torch.float16))
    assert scales[0, 3, 0] == 1.5 and scales[4, 0, 0] == 2.5 and scales[2, 2, 0] == 3.5 and scales.sum() == 7.5


def test_opcheck():
    kv_cache, kr_cache = torch.zeros(3, 4, 1, 8), torch.zeros(3, 4, 1, 2)
    torch.library.opcheck(ref.npu_mla_prolog_cache_write_.default,
                          (kv_cache, kr_cache, torch.tensor([1, 7]), torch.randn(2, 8), torch.randn(2, 2)))
    torch.library.opcheck(ref.npu_scatter_nd_update_.default,
                          (torch.zeros(3, 4, 5), torch.tensor([[0, 1], [2, 3]]), torch.randn(2, 5)))


@pytest.mark.parametrize("case, msg", [
    (dict(idx=torch.tensor([0, 12])), r"cache_index must be in \[0, 12\), got values in \[0, 12\]"),
    (dict(idx=torch.tensor([-1, 0])), r"cache_index must be in \[0, 12\), got values in \[-1, 0\]"),
    (dict(idx=torch.tensor([0.0, 1.0])), "cache_index must be a 1-D int32/int64 tensor"),
    (dict(kv=torch.zeros(2, 7)), r"kv must be \[T, 8\] \(D of kv_cache\), got \(2, 7\)"),
    (dict(kr=torch.zeros(2, 2, dtype=torch.float16)), "kr dtype torch.float16 != kr_cache dtype torch.float32"),
    (dict(idx=torch.tensor([0, 1, 2])), "cache_index, kv and kr must have the same T, got 3, 2, 2"),
])
def test_prolog_cache_write_rejects_bad_input_without_writing(case, msg):
    kv_cache, kr_cache = torch.zeros(3, 4, 1, 8), torch.zeros(3, 4, 1, 2)
    args = dict(idx=torch.tensor([0, 1]), kv=torch.ones(2, 8), kr=torch.ones(2, 2)) | case
    with pytest.raises(RuntimeError, match="offload_ref::npu_mla_prolog_cache_write_: " + msg):
        ref.npu_mla_prolog_cache_write_(kv_cache, kr_cache, args["idx"], args["kv"], args["kr"])
    assert not kv_cache.any() and not kr_cache.any()


@pytest.mark.parametrize("case, msg", [
    (dict(nd=torch.tensor([[0, 4]])), r"indices\[:, 1\] must be in \[0, 4\), got values in \[4, 4\]"),
    (dict(nd=torch.tensor([[3, 0]])), r"indices\[:, 0\] must be in \[0, 3\), got values in \[3, 3\]"),
    (dict(nd=torch.tensor([0, 1])), "indices must be a 2-D int32/int64 tensor"),
    (dict(nd=torch.zeros(1, 4, dtype=torch.int64)), r"indices' last dim k must be in \[1, self.dim\(\)=3\], got 4"),
    (dict(upd=torch.ones(1, 6)), r"updates must be \[N, \*self.shape\[k:\]\] = \(1, 5\), got \(1, 6\)"),
    (dict(upd=torch.ones(1, 5, dtype=torch.float64)), "updates dtype torch.float64 != self dtype torch.float32"),
])
def test_scatter_nd_update_rejects_bad_input_without_writing(case, msg):
    cache = torch.zeros(3, 4, 5)
    args = dict(nd=torch.tensor([[0, 1]]), upd=torch.ones(1, 5)) | case
    with pytest.raises(RuntimeError, match="offload_ref::npu_scatter_nd_update_: " + msg):
        ref.npu_scatter_nd_update_(cache, args["nd"], args["upd"])
    assert not cache.any()
