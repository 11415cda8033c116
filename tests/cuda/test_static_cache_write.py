"""The HF host-KV write kernel (``custom_ops/cuda/static_cache_write.py``, the CUDA kernel of
``offload_ref::static_cache_write_``) under Triton's interpreter, against the CPU kernel (``index_copy_``).

On a GPU it stores through the pinned cache's address; here every tensor is a CPU tensor (the interpreter runs
the same program on host pointers). Checked: bit-equal to the CPU kernel over hypothesis cases (bf16, fp16,
fp32 and their NaN payloads, several heads, any distinct positions in any order), the CPU kernel's errors for
bad shapes and dtypes before anything is written, an out-of-range position: nothing written, the error word
set and raised on the host by ``raise_device_errors`` (no device-side assert), then cleared; and the kernel is
what the op dispatches to on CUDA (registered from the spec).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

op = torch.ops.offload_ref.static_cache_write_.default
_RAW = {2: torch.int16, 4: torch.int32}


@pytest.fixture(scope="module")
def kern(triton_interpreted):
    from offload_passes.custom_ops.cuda import _common, static_cache_write

    return static_cache_write, _common


def _bits(t):
    return t.view(_RAW[t.element_size()])


def _case(B, H, T, Dk, Dv, positions, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    S = len(positions)
    keys, values = torch.randn(B, H, T, Dk, generator=g).to(dtype), torch.randn(B, H, T, Dv, generator=g).to(dtype)
    ks, vs = torch.randn(B, H, S, Dk, generator=g).to(dtype), torch.randn(B, H, S, Dv, generator=g).to(dtype)
    ks.view(-1)[::7] = float("nan")  # payloads move bit for bit
    return keys, values, torch.tensor(positions, dtype=torch.int64), ks, vs


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 3), H=st.integers(1, 3), T=st.integers(1, 24), Dk=st.integers(1, 40), Dv=st.integers(1, 9),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), seed=st.integers(0, 99),
       data=st.data())
def test_equals_the_cpu_kernel(kern, B, H, T, Dk, Dv, dtype, seed, data):
    k, _ = kern
    positions = data.draw(st.lists(st.integers(0, T - 1), min_size=0, max_size=T, unique=True))
    a = _case(B, H, T, Dk, Dv, positions, dtype, seed)
    b = [t.clone() for t in a]
    op(*a)        # the CPU kernel (index_copy_)
    k.run(*b)     # the Triton kernel (interpreter)
    assert torch.equal(_bits(a[0]), _bits(b[0])) and torch.equal(_bits(a[1]), _bits(b[1]))


def test_int32_positions_and_the_hf_decode_shape(kern):
    """One decode token of a [B, 1, T, 512] latent / [B, 1, T, 64] rope cache, int32 positions."""
    k, _ = kern
    a = _case(2, 1, 40, 512, 64, [37], torch.bfloat16, 3)
    b = [t.clone() for t in a]
    b[2] = b[2].to(torch.int32)
    op(*a)
    k.run(*b)
    assert torch.equal(_bits(a[0]), _bits(b[0])) and torch.equal(_bits(a[1]), _bits(b[1]))
    assert torch.equal(_bits(b[0][:, :, 37]), _bits(a[3][:, :, 0]))


def test_bad_shapes_same_error_before_any_write(kern):
    k, _ = kern
    keys, values, pos, ks, vs = _case(2, 1, 8, 6, 4, [1, 2], torch.bfloat16, 0)
    before = keys.clone()
    with pytest.raises(RuntimeError, match=r"offload_ref::static_cache_write_: key_states must be \[B, H, S, D\] = "
                                           r"\(2, 1, 2, 6\) \(S = len\(cache_position\)\), got \(2, 1, 2, 5\)"):
        k.run(keys, values, pos, ks[..., :5], vs)
    with pytest.raises(RuntimeError, match="value_states dtype torch.float16 != values dtype torch.bfloat16"):
        k.run(keys, values, pos, ks, vs.half())
    assert torch.equal(_bits(keys), _bits(before))


def test_out_of_range_position_sets_the_error_word_and_raises_on_the_host(kern):
    k, common = kern
    common.raise_device_errors()  # nothing pending from earlier tests
    keys, values, pos, ks, vs = _case(2, 1, 8, 6, 4, [3, 8, -1, 5], torch.bfloat16, 1)
    before = keys.clone(), values.clone()
    k.run(keys, values, pos, ks, vs)  # no exception in the launch: a device cannot raise
    assert torch.equal(_bits(keys[:, :, [3, 5]]), _bits(ks[:, :, [0, 3]]))
    assert torch.equal(_bits(values[:, :, [3, 5]]), _bits(vs[:, :, [0, 3]]))
    untouched = [t for t in range(8) if t not in (3, 5)]
    assert torch.equal(_bits(keys[:, :, untouched]), _bits(before[0][:, :, untouched]))
    assert torch.equal(_bits(values[:, :, untouched]), _bits(before[1][:, :, untouched]))
    with pytest.raises(RuntimeError, match=r"device-side check failed: offload_ref::static_cache_write_ on cpu: "
                                           r"cache_position had values outside \[0, T\)"):
        common.raise_device_errors()
    common.raise_device_errors()  # cleared: a second call is quiet


def test_registered_as_the_ops_cuda_kernel_from_its_spec(kern):
    from offload_passes.custom_ops import spec_for

    spec = spec_for("offload_ref::static_cache_write_")
    assert spec.cuda_kernel == "static_cache_write" and spec.role == "cache_write"
    assert spec.mutated == ("keys", "values") and spec.mutated_positions == (0, 1)
    from offload_passes.lowering.cuda_graphs import HOST_OPERANDS
    from offload_passes.passes.host_cache_writes import host_write_ops

    assert HOST_OPERANDS[op] == (0, 1) and op in host_write_ops()


@pytest.mark.device
def test_device_rows_into_a_pinned_cache_equal_index_copy(dev):
    """The HF cache's decode write at GLM-5 widths: 17 device rows at distinct positions of ``[3, 1, 300, 512]`` /
    ``[3, 1, 300, 64]`` caches, pinned on a GPU (the stores go through the pinned address), against the CPU kernel
    (``index_copy_``) on host copies of the same data."""
    from _device import assert_pinned_write_equals_cpu
    from _harness import gen, randn
    from offload_passes.custom_ops.cuda import static_cache_write

    g = gen(dev, 2)
    cache = [randn(s, dev, g) for s in ((3, 1, 300, 512), (3, 1, 300, 64))]
    idx = torch.randperm(300, generator=g, device=dev)[:17]
    new = [randn(s, dev, g) for s in ((3, 1, 17, 512), (3, 1, 17, 64))]
    assert_pinned_write_equals_cpu(static_cache_write.run, op, cache, idx, new, dev)
