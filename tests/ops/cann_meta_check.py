"""Run in a child process by ``test_cann_coexistence.py``: our fake kernels vs the Meta kernels of the CPU
stand-in of CANN's library (TEST DOUBLE, ``tests/testdoubles/cann_custom_ops.cpp``) over random valid shapes.

``python tests/ops/cann_meta_check.py LIB N SEED`` loads LIB first (CANN's order), imports offload_passes
(so our fakes are *not* registered: CANN has Meta kernels) and, for N random geometries per op, calls

* the op on ``meta`` tensors: the dispatcher runs the stand-in's C++ Meta kernel;
* our fake function (``_library.registered_fakes()[op]``) on the same ``meta`` tensors;

and compares every output's shape and dtype (and, for ``dsa_plan``, ``install_records``' byte size
against docs/ops.md §2.2 computed here independently). Prints one JSON line with the case counts.
"""
from __future__ import annotations

import json
import random
import sys

import torch


def _align(v: int, a: int) -> int:
    return -(-v // a) * a


def spec_records_alloc(B: int, S: int, K: int) -> int:
    """docs/ops.md §2.2, written out again here (independent of custom_ops/_records.py)."""
    stride = _align(-(-K // 8) * 16, 4096)
    mt = B * S * 8
    return _align(mt * stride, 4096) + _align(mt * 32, 4096) + 4095


def m(shape, dtype=torch.int32):
    return torch.empty(shape, dtype=dtype, device="meta")


def plan_case(rng: random.Random):
    B, S = rng.randint(1, 8), rng.randint(1, 4)
    K = 64 * rng.randint(1, 32)
    PS = 16 * 2 ** rng.randint(0, 10)
    IR = rng.randint(1, 4096)
    four_d = S > 1 or rng.random() < 0.5
    topk = m([B, S, 1, K] if four_d else [B, 1, K])
    args = (topk, m([B]), m([B, PS]), m([B, IR]), m([B, PS // 16]))
    return args, dict(raw_seq=S), (B, S, K)


def serve_case(rng: random.Random, functional: bool):
    B, S = rng.randint(1, 4), rng.randint(1, 4)
    sbs = 2 ** rng.randint(4, 7)
    K = sbs * rng.randint(1, 2048 // sbs)
    F, PS = rng.randint(1, 300), rng.randint(1, 16384)
    D, Dr = rng.randint(1, 512), rng.randint(1, 128)
    dt = rng.choice([torch.float16, torch.bfloat16])
    rows = B * S * K
    nb = -(-rows // sbs)
    args = (m([rows, 2]), m([B, F, D], dt), m([B, F, Dr], dt), m([B, PS, D], dt), m([B, PS, Dr], dt),
            m([nb, sbs, D], dt), m([nb, sbs, Dr], dt))
    return args, dict(raw_seq=S, topk=K, selection_block_size=sbs, compact_layout=1)


def install_case(rng: random.Random):
    B, S = rng.randint(1, 4), rng.randint(1, 4)
    sbs = 2 ** rng.randint(4, 7)
    K = sbs * rng.randint(1, 2048 // sbs)
    PS = 16 * 2 ** rng.randint(0, 10)
    IR = rng.randint(1, 4096)
    D, Dr = rng.randint(1, 512), rng.randint(1, 128)
    dt = rng.choice([torch.float16, torch.bfloat16])
    rows = B * S * K
    nb = -(-rows // sbs) + rng.randint(0, 2)
    args = (m([spec_records_alloc(B, S, K)], torch.int8), m([nb, sbs, D], dt), m([nb, sbs, Dr], dt),
            m([B * S, K // sbs]), m([B, PS, D], dt), m([B, PS, Dr], dt), m([B, PS]), m([B, IR]),
            m([B, PS // 16]))
    return args, dict(raw_seq=S, topk=K, selection_block_size=sbs, metadata_update=rng.randint(0, 1))


def gather_case(rng: random.Random):
    B, S = rng.randint(1, 4), rng.randint(1, 7)
    small = rng.random() < 0.3
    K = rng.randint(1, 32) if small else rng.randint(33, 2048)
    bsz = rng.choice([1, 2, 4]) if small else 1
    SBS = bsz * rng.randint(1, 8)
    FBS = bsz * rng.randint(1, 8)
    D = rng.randint(1, 656)
    no_rope = rng.random() < 0.2
    dt = torch.int8 if no_rope else rng.choice([torch.float16, torch.bfloat16])
    Dr = rng.randint(1, 64)
    rows = B * S + rng.randint(0, 3)
    maxblk = -(-K * bsz // SBS) + rng.randint(0, 2)
    nblocks = B * S * maxblk + rng.randint(0, 3)
    fblocks, fmax = rng.randint(1, 64), rng.randint(1, 16)
    bsnd = rng.random() < 0.5
    lead = [B, S, 1] if bsnd else [B * S, 1]
    args = (
        m([0], dt) if no_rope else m([nblocks, SBS, Dr], dt),
        m([nblocks, SBS, D], dt),
        m([rows, maxblk]),
        m(lead + [K + 1]),
        m(lead + [K]),
        m([0], dt) if no_rope else m([fblocks, FBS, Dr], dt),
        m([fblocks, FBS, D], dt),
        m([B, fmax]),
        m([B]),
        m([B]),
    )
    return args, dict(selection_topk_block_size=bsz)


def main() -> None:
    lib, n, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.ops.load_library(lib)  # CANN first: its TORCH_LIBRARY owns the schemas and Meta kernels
    import offload_passes  # noqa: F401
    from offload_passes.custom_ops import _library as Lib
    from offload_passes.custom_ops import cann_library_status

    status = cann_library_status()
    assert all(s.meta_kernel and not s.our_fake for s in status.ops.values()), status.as_dict()
    fakes = Lib.registered_fakes()
    rng = random.Random(seed)
    counts: dict[str, int] = {}

    def compare(name, args, kwargs):
        theirs = getattr(torch.ops.custom, name)(*args, **kwargs)  # stand-in's C++ Meta kernel
        ours = fakes[name](*args, **kwargs)
        theirs = theirs if isinstance(theirs, tuple) else (theirs,)
        ours = ours if isinstance(ours, tuple) else (ours,)
        assert len(theirs) == len(ours), (name, len(theirs), len(ours))
        for i, (t, o) in enumerate(zip(theirs, ours)):
            if t is None or o is None:
                assert t is None and o is None, (name, i, t, o)
                continue
            assert (tuple(t.shape), t.dtype) == (tuple(o.shape), o.dtype), (
                name, i, tuple(t.shape), t.dtype, tuple(o.shape), o.dtype, [tuple(a.shape) for a in args], kwargs)
        counts[name] = counts.get(name, 0) + 1
        return theirs, ours

    for _ in range(n):
        args, kw, (B, S, K) = plan_case(rng)
        theirs, ours = compare("dsa_plan", args, kw)
        assert theirs[1].numel() == ours[1].numel() == spec_records_alloc(B, S, K), (B, S, K)
        for functional in (False, True):
            args, kw = serve_case(rng, functional)
            compare("dsa_serve_functional" if functional else "dsa_serve", args, kw)
            args, kw = install_case(rng)
            compare("dsa_install_functional" if functional else "dsa_install", args, kw)
            args, kw = gather_case(rng)
            compare("npu_gather_selection_kv_cache_functional" if functional else "npu_gather_selection_kv_cache",
                    args, kw)
    # the spec's worked example (§2.2)
    assert spec_records_alloc(4, 4, 2048) == 532479
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
