"""What the lightning indexer's fixed summation order costs on the CPU, measured in one run.

``offload_ref::npu_lightning_indexer`` sums each dot product pairwise and the heads in order
(``custom_ops/_attention_common.py`` ``pairwise_sum`` / ``fold_heads``, docs/ops.md §6.1), so that its
device twin (``custom_ops/cuda/npu_lightning_indexer.py``) computes the same bits. This script times the
reference against the same computation with the sums left to BLAS (``bmm``: what the reference did before
the order was fixed), and counts how many of the BLAS top-k rows differ from the fixed-order ones::

    python benchmarks/bench_indexer_order.py [--repeat 5]

Geometries: ``tiny`` (2 tokens, 4 heads of 32, a 512-token table, K = 64) and a GLM-5 indexer layer at
B = 4 (32 heads of 128, a 4096-token table, K = 2048). Prints one line per geometry: ms per call of each,
their ratio, rows whose top-k differs.
"""
from __future__ import annotations

import argparse
import time

import torch

import offload_passes  # noqa: F401  (registers the ops)
from offload_passes.custom_ops._attention_common import indexer_topk

op = torch.ops.offload_ref.npu_lightning_indexer.default


def case(T: int, H: int, D: int, blocks: int, bs: int, K: int, g: torch.Generator) -> tuple:
    q = torch.randn(T, H, D, generator=g).bfloat16()
    key = torch.randn(T * blocks, bs, 1, D, generator=g).bfloat16()
    w = torch.randn(T, H, generator=g).bfloat16()
    table = torch.randperm(T * blocks, generator=g).view(T, blocks).int()
    kw = dict(actual_seq_lengths_query=torch.arange(1, T + 1, dtype=torch.int32),
              actual_seq_lengths_key=torch.full((T,), blocks * bs - 1, dtype=torch.int32), block_table=table,
              layout_query="TND", layout_key="PA_BSND", sparse_count=K, sparse_mode=3)
    return (q, key, w), kw


def blas_order(q, key, w, block_table, actual_seq_lengths_key, sparse_count, **_) -> torch.Tensor:
    """The same scores with both sums in one ``bmm`` each (one token per batch row, as ``case`` builds)."""
    T, H, D = q.shape
    bs = key.size(1)
    n = actual_seq_lengths_key.long()
    pos = torch.arange(block_table.size(1) * bs)
    rows = block_table.long()[:, pos // bs] * bs + pos % bs
    keys = key.reshape(-1, D)[rows].float()
    dots = torch.bmm(q.float(), keys.transpose(1, 2))
    score = torch.bmm(w.float().unsqueeze(1), torch.relu(dots)).squeeze(1)
    needed = pos.unsqueeze(0) < n.unsqueeze(1)
    return indexer_topk(score, n, needed, sparse_count)


def best_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, shape in (("tiny", (2, 4, 32, 32, 16, 64)), ("glm5 B=4", (4, 32, 128, 32, 128, 2048))):
        args, kw = case(*shape, g)
        fixed = best_ms(lambda: op(*args, **kw), a.repeat)
        blas = best_ms(lambda: blas_order(*args, **kw), a.repeat)
        differ = int((op(*args, **kw)[0].view(shape[0], -1) != blas_order(*args, **kw)).any(1).sum())
        print(f"{name:10s} fixed order {fixed:9.2f} ms   BLAS order {blas:9.2f} ms   ratio {fixed / blas:6.2f}   "
              f"top-k rows differing {differ}/{shape[0]}")


if __name__ == "__main__":
    main()
