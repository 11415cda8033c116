"""offload_ref::npu_lightning_indexer — CPU reference of torch_npu's decode lightning indexer (spec/ops.md §6.1).

Same schema as ``torch.ops.npu.npu_lightning_indexer`` but in the ``offload_ref`` namespace, so it never
clashes with torch_npu. Semantics (per query token ``t`` of batch ``b``, ``i`` = position of ``t`` among
the ``Sq`` query tokens of ``b``)::

    n     = L[b] - Sq + i + 1   (sparse_mode 3, right-down causal)   |   L[b]   (sparse_mode 0)
    score_j = sum_h weights[t, h] * relu(query[t, h] . key_j)          for j < n   (fp32 accumulate)
    out[t, 0, :min(K, n)] = ids of the largest scores (score desc, ties: smaller id first); rest = -1

Supported layouts: query ``TND`` (``[T, N, D]``, ``actual_seq_lengths_query`` cumulative, required) or
``BSND`` (``[B, S, N, D]``); key ``PA_BSND`` (``[blocks, block_size, 1, D]`` + ``block_table`` +
``actual_seq_lengths_key``, required) or ``BSND`` (``[B, S_kv, 1, D]``). ``return_value=True`` and any
other layout / sparse mode raise. ``pre_tokens``/``next_tokens`` are accepted and ignored (the decode
path uses sparse_mode 3, where the NPU ignores them too).

This module also holds the tiny registration helpers shared with ``npu_sparse_flash_attention.py``
(one ``offload_ref`` FRAGMENT library; define/impl only if missing, so a re-import never redefines).
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

log = logging.getLogger("offload_passes.custom_ops.npu_lightning_indexer")

REF_NAMESPACE = "offload_ref"
SCHEMA = (
    "npu_lightning_indexer(Tensor query, Tensor key, Tensor weights, *, "
    "Tensor? actual_seq_lengths_query=None, Tensor? actual_seq_lengths_key=None, "
    "Tensor? block_table=None, str layout_query=\"BSND\", str layout_key=\"BSND\", "
    "int sparse_count=2048, int sparse_mode=3, int pre_tokens=9223372036854775807, "
    "int next_tokens=9223372036854775807, bool return_value=False) -> (Tensor, Tensor)"
)
OP = "npu_lightning_indexer"

#: torch_npu's documented upper limit of ``sparse_count``.
MAX_SPARSE_COUNT = 2048
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# --------------------------------------------------------------------------------------------
# offload_ref registration helpers (shared with npu_sparse_flash_attention.py)
# --------------------------------------------------------------------------------------------

REF_LIB = torch.library.Library(REF_NAMESPACE, "FRAGMENT")


def ref_qualname(name: str) -> str:
    return f"{REF_NAMESPACE}::{name}"


def ref_define(schema: str) -> bool:
    """Define ``offload_ref::<schema>`` unless already known to the dispatcher."""
    name = schema.split("(", 1)[0].strip()
    try:
        torch._C._dispatch_find_schema_or_throw(ref_qualname(name), "")
        return False
    except RuntimeError:
        REF_LIB.define(schema)
        return True


def ref_impl(name: str, dispatch_key: str, fn: Callable) -> bool:
    if torch._C._dispatch_has_kernel_for_dispatch_key(ref_qualname(name), dispatch_key):
        return False
    REF_LIB.impl(name, fn, dispatch_key)
    return True


def ref_register_fake(name: str, fn: Callable) -> bool:
    if torch._C._dispatch_has_kernel_for_dispatch_key(ref_qualname(name), "Meta"):
        return False
    try:
        from torch._library.simple_registry import singleton

        if singleton.find(ref_qualname(name)).fake_impl.kernel is not None:
            return False
    except Exception:  # pragma: no cover - private API drift
        pass
    torch.library.register_fake(ref_qualname(name), fn, lib=REF_LIB)
    return True


def ref_check(cond: bool, op: str, msg: str) -> None:
    """Raise ``RuntimeError("offload_ref::<op>: <msg>")`` unless ``cond``."""
    if not cond:
        raise RuntimeError(f"{ref_qualname(op)}: {msg}")


def query_token_map(
    cu_q: torch.Tensor, T: int, op: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From cumulative query lengths ``[B]`` return ``(batch_of_t, i_of_t, sq_of_t)`` for ``t < T``.

    Data-dependent checks (CPU kernels only): non-decreasing, starting at >= 0, last == T.
    """
    cu = cu_q.to(torch.int64)
    B = cu.numel()
    ref_check(bool((cu[0] >= 0).item()), op, "actual_seq_lengths_query must start at >= 0")
    if B > 1:
        ref_check(
            bool((cu[1:] >= cu[:-1]).all().item()),
            op,
            f"actual_seq_lengths_query must be cumulative (non-decreasing), got {cu.tolist()}",
        )
    ref_check(
        int(cu[-1].item()) == T,
        op,
        f"actual_seq_lengths_query[-1] must equal the query token count T={T}, got {int(cu[-1])}",
    )
    starts = torch.cat([cu.new_zeros(1), cu[:-1]])
    t = torch.arange(T, dtype=torch.int64)
    b_of_t = torch.searchsorted(cu, t, right=True)
    i_of_t = t - starts[b_of_t]
    sq_of_t = (cu - starts)[b_of_t]
    return b_of_t, i_of_t, sq_of_t


def paged_rows(
    block_table: torch.Tensor,
    b_of_pos: torch.Tensor,
    pos: torch.Tensor,
    needed: torch.Tensor,
    block_size: int,
    num_blocks: int,
    op: str,
) -> torch.Tensor:
    """Flat row ids ``block_table[b, pos // bs] * bs + pos % bs`` (PA_BSND addressing).

    ``needed`` marks the positions that are really read; their block ids must be in range (error
    otherwise). Positions not needed are clamped to row 0 and must be masked by the caller.
    """
    maxblk = block_table.size(1)
    col = torch.div(pos, block_size, rounding_mode="floor")
    beyond = needed & (col >= maxblk)
    if bool(beyond.any().item()):
        ref_check(
            False,
            op,
            f"a position that must be read lies beyond block_table's {maxblk} blocks (block_size "
            f"{block_size}): position {int(pos[beyond].max())} needs block column {int(col[beyond].max())}",
        )
    blk = block_table.to(torch.int64)[b_of_pos, col.clamp(0, maxblk - 1)]
    ref_check(
        not bool((needed & ((blk < 0) | (blk >= num_blocks))).any().item()),
        op,
        f"block_table holds a block id outside [0, {num_blocks}) for a position that must be read",
    )
    rows = blk * block_size + torch.remainder(pos, block_size)
    return torch.where(needed, rows, torch.zeros_like(rows))


# --------------------------------------------------------------------------------------------
# validation (shapes, dtypes, attributes only: shared by the fake and the CPU kernel)
# --------------------------------------------------------------------------------------------


def validate_npu_lightning_indexer(
    query: torch.Tensor,
    key: torch.Tensor,
    weights: torch.Tensor,
    actual_seq_lengths_query: Optional[torch.Tensor],
    actual_seq_lengths_key: Optional[torch.Tensor],
    block_table: Optional[torch.Tensor],
    layout_query: str,
    layout_key: str,
    sparse_count: int,
    sparse_mode: int,
    return_value: bool,
) -> dict:
    """Check every supported-case limit; return ``{B, S, T, N, D}`` (S = None for ragged TND)."""
    op = OP
    ref_check(layout_query in ("TND", "BSND"), op, f"layout_query must be 'TND' or 'BSND', got {layout_query!r}")
    ref_check(
        layout_key in ("PA_BSND", "BSND"), op, f"layout_key must be 'PA_BSND' or 'BSND', got {layout_key!r}"
    )
    ref_check(sparse_mode in (0, 3), op, f"sparse_mode must be 0 or 3, got {sparse_mode}")
    ref_check(not return_value, op, "return_value=True is not supported by the CPU reference (must be False)")
    ref_check(
        0 < sparse_count <= MAX_SPARSE_COUNT,
        op,
        f"sparse_count must be in (0, {MAX_SPARSE_COUNT}], got {sparse_count}",
    )
    for name, t in (("query", query), ("key", key), ("weights", weights)):
        ref_check(t.dtype in FLOAT_DTYPES, op, f"{name} must be float16/bfloat16/float32, got {t.dtype}")
    ref_check(key.dtype == query.dtype, op, f"key dtype {key.dtype} must equal query dtype {query.dtype}")

    if layout_query == "TND":
        ref_check(query.dim() == 3, op, f"query must be 3-D [T, N, D] for layout_query 'TND', got {query.dim()}-D")
        T, N, D = query.shape
        ref_check(
            actual_seq_lengths_query is not None,
            op,
            "actual_seq_lengths_query (cumulative, [B]) is required for layout_query 'TND'",
        )
        ref_check(
            weights.dim() == 2 and tuple(weights.shape) == (T, N),
            op,
            f"weights must be [T={T}, N={N}] for layout_query 'TND', got {tuple(weights.shape)}",
        )
        B = actual_seq_lengths_query.size(0) if actual_seq_lengths_query.dim() == 1 else -1
        S = None
    else:
        ref_check(
            query.dim() == 4, op, f"query must be 4-D [B, S, N, D] for layout_query 'BSND', got {query.dim()}-D"
        )
        B, S, N, D = query.shape
        T = B * S
        ref_check(
            weights.dim() == 3 and tuple(weights.shape) == (B, S, N),
            op,
            f"weights must be [B={B}, S={S}, N={N}] for layout_query 'BSND', got {tuple(weights.shape)}",
        )
    if actual_seq_lengths_query is not None:
        ref_check(
            actual_seq_lengths_query.dim() == 1 and actual_seq_lengths_query.size(0) == B and B > 0,
            op,
            f"actual_seq_lengths_query must be 1-D of length B={B} (> 0), got {tuple(actual_seq_lengths_query.shape)}",
        )
        ref_check(
            actual_seq_lengths_query.dtype in (torch.int32, torch.int64),
            op,
            f"actual_seq_lengths_query must be int32/int64, got {actual_seq_lengths_query.dtype}",
        )

    ref_check(key.dim() == 4, op, f"key must be 4-D ({layout_key}), got {key.dim()}-D")
    ref_check(key.size(2) == 1, op, f"key dim 2 (key heads N2) must be 1, got {key.size(2)}")
    ref_check(key.size(3) == D, op, f"key head dim {key.size(3)} must equal query head dim D={D}")
    if layout_key == "PA_BSND":
        ref_check(block_table is not None, op, "block_table is required for layout_key 'PA_BSND'")
        ref_check(
            actual_seq_lengths_key is not None, op, "actual_seq_lengths_key is required for layout_key 'PA_BSND'"
        )
        ref_check(
            block_table.dim() == 2 and block_table.size(0) == B,
            op,
            f"block_table must be [B={B}, max_blocks], got {tuple(block_table.shape)}",
        )
        ref_check(
            block_table.dtype in (torch.int32, torch.int64),
            op,
            f"block_table must be int32/int64, got {block_table.dtype}",
        )
    else:
        ref_check(key.size(0) == B, op, f"key dim 0 must equal batch B={B} for layout_key 'BSND', got {key.size(0)}")
        ref_check(block_table is None, op, "block_table must be None for layout_key 'BSND'")
    if actual_seq_lengths_key is not None:
        ref_check(
            actual_seq_lengths_key.dim() == 1 and actual_seq_lengths_key.size(0) == B,
            op,
            f"actual_seq_lengths_key must be 1-D of length B={B}, got {tuple(actual_seq_lengths_key.shape)}",
        )
        ref_check(
            actual_seq_lengths_key.dtype in (torch.int32, torch.int64),
            op,
            f"actual_seq_lengths_key must be int32/int64, got {actual_seq_lengths_key.dtype}",
        )
    return {"B": B, "S": S, "T": T, "N": N, "D": D}


def _out_shape(info: dict, layout_query: str, K: int) -> tuple:
    if layout_query == "TND":
        return (info["T"], 1, K)
    return (info["B"], info["S"], 1, K)


def _fake(
    query, key, weights, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None, block_table=None,
    layout_query="BSND", layout_key="BSND", sparse_count=2048, sparse_mode=3,
    pre_tokens=9223372036854775807, next_tokens=9223372036854775807, return_value=False,
):
    info = validate_npu_lightning_indexer(
        query, key, weights, actual_seq_lengths_query, actual_seq_lengths_key, block_table,
        layout_query, layout_key, sparse_count, sparse_mode, return_value,
    )
    out = query.new_empty(_out_shape(info, layout_query, sparse_count), dtype=torch.int32)
    return out, query.new_empty((0,))


def reference_npu_lightning_indexer(
    query: torch.Tensor,
    key: torch.Tensor,
    weights: torch.Tensor,
    *,
    actual_seq_lengths_query: Optional[torch.Tensor] = None,
    actual_seq_lengths_key: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    layout_query: str = "BSND",
    layout_key: str = "BSND",
    sparse_count: int = 2048,
    sparse_mode: int = 3,
    pre_tokens: int = 9223372036854775807,
    next_tokens: int = 9223372036854775807,
    return_value: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference (vectorised over tokens and heads; fp32 accumulation)."""
    info = validate_npu_lightning_indexer(
        query, key, weights, actual_seq_lengths_query, actual_seq_lengths_key, block_table,
        layout_query, layout_key, sparse_count, sparse_mode, return_value,
    )
    B, T, D = info["B"], info["T"], info["D"]
    K = sparse_count
    if layout_query == "TND":
        q = query
        w = weights
        b_of_t, i_of_t, sq_of_t = query_token_map(actual_seq_lengths_query, T, OP)
    else:
        S = info["S"]
        if actual_seq_lengths_query is not None:
            ref_check(
                bool((actual_seq_lengths_query.to(torch.int64) == S).all().item()),
                OP,
                f"layout_query 'BSND' supports only actual_seq_lengths_query == S={S} for every batch",
            )
        q = query.reshape(T, info["N"], D)
        w = weights.reshape(T, info["N"])
        t = torch.arange(T, dtype=torch.int64)
        b_of_t = torch.div(t, S, rounding_mode="floor")
        i_of_t = t - b_of_t * S
        sq_of_t = torch.full((T,), S, dtype=torch.int64)

    if layout_key == "PA_BSND":
        num_blocks, bs = key.size(0), key.size(1)
        table = block_table
        kv_len = actual_seq_lengths_key.to(torch.int64)
    else:
        num_blocks, bs = key.size(0), key.size(1)
        table = torch.arange(B, dtype=torch.int64).view(B, 1)
        kv_len = (
            actual_seq_lengths_key.to(torch.int64)
            if actual_seq_lengths_key is not None
            else torch.full((B,), bs, dtype=torch.int64)
        )
    ref_check(bool((kv_len >= 0).all().item()), OP, "actual_seq_lengths_key must be >= 0")

    if sparse_mode == 3:
        n = kv_len[b_of_t] - sq_of_t + i_of_t + 1
    else:
        n = kv_len[b_of_t]
    n = n.clamp(min=0)  # n <= 0: no visible key, the row is all -1
    nmax = int(n.max().item()) if T > 0 else 0
    out = torch.full((T, K), -1, dtype=torch.int32)
    if nmax > 0:
        pos = torch.arange(nmax, dtype=torch.int64)
        needed = pos.unsqueeze(0) < n.unsqueeze(1)  # [T, nmax]
        rows = paged_rows(
            table, b_of_t.unsqueeze(1).expand(T, nmax), pos.unsqueeze(0).expand(T, nmax), needed, bs, num_blocks, OP
        )
        keys = key.reshape(num_blocks * bs, D)[rows]  # [T, nmax, D]
        # score[t, j] = sum_h w[t, h] * relu(q[t, h] . k[t, j])   (fp32 accumulate)
        dots = torch.bmm(q.float(), keys.float().transpose(1, 2))  # [T, N, nmax]
        score = torch.bmm(w.float().unsqueeze(1), torch.relu(dots)).squeeze(1)  # [T, nmax]
        score = score.masked_fill(~needed, float("-inf"))
        # Stable descending sort: equal scores keep ascending id order (deterministic tie-break).
        order = torch.sort(score, dim=-1, descending=True, stable=True).indices
        c = min(K, nmax)
        top = order[:, :c].to(torch.int32)
        keep = torch.arange(c).unsqueeze(0) < n.clamp(max=K).unsqueeze(1)
        out[:, :c] = torch.where(keep, top, torch.full_like(top, -1))
    out = out.view(_out_shape(info, layout_query, K))
    return out, query.new_empty((0,))


def _cpu(query, key, weights, **kwargs):
    return reference_npu_lightning_indexer(query, key, weights, **kwargs)


ref_define(SCHEMA)
ref_register_fake(OP, _fake)
ref_impl(OP, "CPU", _cpu)
