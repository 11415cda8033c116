"""``benchmarks/gpu_capacity.py``, the ``capacity`` section of the GPU benchmark: its byte arithmetic gives exact
values (the largest batches that fit one HBM budget, dense and offloaded), and, on the device (``dev``: the GPU
with ``OFFLOAD_PASSES_GPU=1``, else CPU tensors under Triton's interpreter), its offloaded attention stack
computes what the dense one does, bit for bit, with pool hits once warm: the two tokens/s it reports time the
same work."""
from __future__ import annotations

import pytest

import gpu_capacity as GC
from _device import same


def test_stack_bytes_and_the_largest_batches():
    """GLM-5's per-layer shapes, 8 layers in 2 IndexShare groups, at 64K + 20 tokens: the bytes per row by the
    formula written out here, and the batches that fit 24 GiB of HBM and 64 GiB of pinned host memory."""
    geo, T = GC.GLM5_STACK, 65536 + 20
    assert (geo.layers, geo.group, geo.groups, geo.row) == (8, 4, 2, 1152)
    b = GC.stack_bytes(geo, T)
    transient = 2 * (T * (32 * 2 + 12) + 2048 * (1152 + 64 * 8 + 16) + 2 * 8 * 64 * 512 * 2)
    idx = 2 * T * 128 * 2
    assert b["transient"] == transient
    assert b["dense"] == 8 * T * 1152 + idx + transient
    assert b["offload"] == 8 * (8192 + 2048) * 1152 + 2 * (8192 * 4 + T * 4 + 512 * 4) + idx + transient
    assert b["host"] == 8 * T * 1152
    hbm, host = 24 * 2 ** 30, 64 * 2 ** 30
    cap = GC.capacity_batches(geo, T, hbm, host)
    assert cap["dense"] == hbm // b["dense"] == 39
    assert cap["offload_by_hbm"] == hbm // b["offload"] == 174 and cap["offload_by_host"] == host // b["host"] == 113
    assert cap["offload"] == 113 and cap["binds"] == "host"
    # with host memory to spare the device binds, and the offload still holds 4x the rows at 128K
    big = GC.capacity_batches(geo, 131072 + 20, hbm, 1024 * 2 ** 30)
    assert big["binds"] == "hbm" and big["offload"] == big["offload_by_hbm"] > 4 * big["dense"]
    assert GC.capacity_batches(geo, T, 2 ** 20, host)["dense"] == 0
    with pytest.raises(ValueError, match="layers must be a positive multiple of group=4, got 0"):
        GC.StackGeo(layers=0)


def test_capacity_rows_state_the_arithmetic():
    rows, cap = GC._capacity_rows(GC.GLM5_STACK, 131072, 24 * 2 ** 30, 64 * 2 ** 30, GC._room(4))
    assert [(r["check"], r["value"]) for r in rows] == [
        ("largest batch, dense @ 131072", 19), ("largest batch, offloaded @ 131072", 56),
        ("rows offloaded / dense @ 131072", 56 / 19)]
    assert cap["binds"] == "host" and "host binds" in rows[1]["note"]


@pytest.mark.device
def test_offloaded_stack_equals_dense(dev):
    """Four steps of both variants at B = 2: on a GPU the benchmark's stack (GLM-5 widths, 8 layers) at 8192 tokens
    with pinned host caches; under the interpreter the same stack at interpreter widths and 512 tokens."""
    geo, ctx = (GC.GLM5_STACK, 8192) if dev.type == "cuda" else (GC.DRY_STACK, 512)
    steps = 4
    dense = GC.AttentionStack(geo, 2, ctx, steps, dev, offload=False)
    off = GC.AttentionStack(geo, 2, ctx, steps, dev, offload=True)
    for s in range(steps):
        a, b = dense.step(), off.step()
        assert same(a, b), f"step {s}: max |diff| {float((a.float() - b.float()).abs().max()):.3g}"
    assert off.hit_rate(), f"no pool hit in {steps} steps (plan kinds {off.kinds.tolist()})"
