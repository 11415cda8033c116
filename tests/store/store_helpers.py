"""Chunks and fingerprints the KV store tests build."""
from __future__ import annotations

import torch

from offload_passes.store import Fingerprint

CACHES = {"kv": ((1, 8), torch.bfloat16), "rope": ((1, 4), torch.bfloat16), "idx": ((1, 4), torch.int8)}


def make_fp(**extra) -> Fingerprint:
    caches = extra.pop("caches", CACHES)
    return Fingerprint.of({"arch": "test", "dtype": "bfloat16", "weights": "w0", "world": 1, **extra,
                           "caches": caches})


def make_chunk(fp: Fingerprint, n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dt) in fp.caches.items():
        if dt.is_floating_point:
            out[name] = torch.randn((n, *shape), generator=g).to(dt)
        else:
            out[name] = torch.randint(-128, 127, (n, *shape), generator=g, dtype=torch.int64).to(dt)
    return out


def chunks_for(fp: Fingerprint, ids: list, chunk_tokens: int, seed: int = 0) -> list:
    return [make_chunk(fp, min(chunk_tokens, len(ids) - s), seed * 100003 + s) for s in range(0, len(ids), chunk_tokens)]


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))
