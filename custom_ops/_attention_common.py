"""Pieces shared by the ``offload_ref::`` decode-path references (``npu_lightning_indexer.py``,
``npu_sparse_flash_attention.py``), docs/ops.md §6.

* registration in the ``offload_ref`` namespace (one FRAGMENT library; define/impl/fake only if
  missing, so a re-import never redefines);
* the key/value side both ops read the same way: layout ``PA_BSND`` (block table + lengths) or
  ``BSND``, its shape checks and its addressing;
* the query-token map (``TND`` cumulative lengths or ``BSND``);
* the two lightning indexers' common checks and reference body (visible-key window, key gather,
  top-k); they differ only in how a (token, key) score is computed.

Each op module keeps its own schema, validation order, fake, reference and CPU wiring; the kv-side
messages name the op's own arguments (``layout_key``/``actual_seq_lengths_key`` for the indexer,
``layout_kv``/``actual_seq_lengths_kv`` for sparse flash attention).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from offload_passes import _compat

from .opspec import SHARED_LIMITS

REF_NAMESPACE = "offload_ref"
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)

# --------------------------------------------------------------------------------------------
# offload_ref registration helpers
# --------------------------------------------------------------------------------------------

REF_LIB = torch.library.Library(REF_NAMESPACE, "FRAGMENT")


def ref_qualname(name: str) -> str:
    return f"{REF_NAMESPACE}::{name}"


def ref_define(schema: str) -> bool:
    """Define ``offload_ref::<schema>`` unless already known to the dispatcher."""
    name = schema.split("(", 1)[0].strip()
    if _compat.dispatcher_has_schema(ref_qualname(name)):
        return False
    REF_LIB.define(schema)
    return True


def ref_impl(name: str, dispatch_key: str, fn: Callable) -> bool:
    if _compat.dispatcher_has_kernel(ref_qualname(name), dispatch_key):
        return False
    REF_LIB.impl(name, fn, dispatch_key)
    return True


def ref_register_fake(name: str, fn: Callable) -> bool:
    if _compat.dispatcher_has_kernel(ref_qualname(name), "Meta") or _compat.has_python_fake_kernel(ref_qualname(name)):
        return False
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
# shared validation and addressing
# --------------------------------------------------------------------------------------------


def check_layouts(op: str, layout_query: str, kv_layout: str, sparse_mode: int, *, layout_arg: str) -> None:
    """The first checks of every decode-path reference: both layout strings and ``sparse_mode``.

    ``layout_arg`` is the op's name of the kv layout (``layout_key`` / ``layout_kv``).
    """
    ref_check(layout_query in ("TND", "BSND"), op, f"layout_query must be 'TND' or 'BSND', got {layout_query!r}")
    ref_check(
        kv_layout in ("PA_BSND", "BSND"), op, f"{layout_arg} must be 'PA_BSND' or 'BSND', got {kv_layout!r}"
    )
    ref_check(sparse_mode in (0, 3), op, f"sparse_mode must be 0 or 3, got {sparse_mode}")


def check_query_shape(
    op: str, query: torch.Tensor, layout_query: str, actual_seq_lengths_query: Optional[torch.Tensor]
) -> tuple[Optional[int], Optional[int], int, int, int]:
    """Rank of ``query`` for its (validated) layout; ``TND`` also needs cumulative query lengths.

    Returns ``(B, S, T, N, D)``; ``B`` and ``S`` are None for ``TND`` (each op takes ``B`` from the
    lengths its own way).
    """
    if layout_query == "TND":
        ref_check(query.dim() == 3, op, f"query must be 3-D [T, N, D] for layout_query 'TND', got {query.dim()}-D")
        T, N, D = query.shape
        ref_check(
            actual_seq_lengths_query is not None,
            op,
            "actual_seq_lengths_query (cumulative, [B]) is required for layout_query 'TND'",
        )
        return None, None, T, N, D
    ref_check(
        query.dim() == 4, op, f"query must be 4-D [B, S, N, D] for layout_query 'BSND', got {query.dim()}-D"
    )
    B, S, N, D = query.shape
    return B, S, B * S, N, D


def check_kv_layout(
    op: str,
    key: torch.Tensor,
    block_table: Optional[torch.Tensor],
    seq_lengths: Optional[torch.Tensor],
    layout: str,
    B: int,
    *,
    layout_arg: str,
    lengths_arg: str,
) -> None:
    """Block table and kv lengths for kv layout ``PA_BSND`` (both required) or ``BSND`` (no table).

    ``layout_arg``/``lengths_arg`` are the op's names of the layout string and the lengths tensor.
    """
    if layout == "PA_BSND":
        ref_check(block_table is not None, op, f"block_table is required for {layout_arg} 'PA_BSND'")
        ref_check(seq_lengths is not None, op, f"{lengths_arg} is required for {layout_arg} 'PA_BSND'")
        ref_check(
            block_table.dim() == 2 and block_table.size(0) == B,
            op,
            f"block_table must be [B={B}, max_blocks], got {tuple(block_table.shape)}",
        )
        ref_check(
            block_table.dtype in INDEX_DTYPES,
            op,
            f"block_table must be int32/int64, got {block_table.dtype}",
        )
    else:
        ref_check(
            key.size(0) == B, op, f"key dim 0 must equal batch B={B} for {layout_arg} 'BSND', got {key.size(0)}"
        )
        ref_check(block_table is None, op, f"block_table must be None for {layout_arg} 'BSND'")
    if seq_lengths is not None:
        ref_check(
            seq_lengths.dim() == 1 and seq_lengths.size(0) == B,
            op,
            f"{lengths_arg} must be 1-D of length B={B}, got {tuple(seq_lengths.shape)}",
        )
        ref_check(
            seq_lengths.dtype in INDEX_DTYPES,
            op,
            f"{lengths_arg} must be int32/int64, got {seq_lengths.dtype}",
        )


def kv_addressing(
    key: torch.Tensor,
    block_table: Optional[torch.Tensor],
    seq_lengths: Optional[torch.Tensor],
    layout: str,
    B: int,
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """``(table, kv_len, num_blocks, block_size)`` for :func:`paged_rows` (validated inputs).

    ``BSND`` is read as a paged cache with one block per batch row (identity table); without lengths
    every row of it is visible.
    """
    num_blocks, bs = key.size(0), key.size(1)
    if layout == "PA_BSND":
        return block_table, seq_lengths.to(torch.int64), num_blocks, bs
    table = torch.arange(B, dtype=torch.int64).view(B, 1)
    kv_len = (
        seq_lengths.to(torch.int64) if seq_lengths is not None else torch.full((B,), bs, dtype=torch.int64)
    )
    return table, kv_len, num_blocks, bs


def token_positions(
    layout_query: str,
    actual_seq_lengths_query: Optional[torch.Tensor],
    T: int,
    S: Optional[int],
    op: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(batch_of_t, i_of_t, sq_of_t)`` for every query token ``t < T`` (see :func:`query_token_map`).

    ``BSND`` has ``S`` tokens per batch row; lengths, if given, must all equal ``S``.
    """
    if layout_query == "TND":
        return query_token_map(actual_seq_lengths_query, T, op)
    if actual_seq_lengths_query is not None:
        ref_check(
            bool((actual_seq_lengths_query.to(torch.int64) == S).all().item()),
            op,
            f"layout_query 'BSND' supports only actual_seq_lengths_query == S={S} for every batch",
        )
    t = torch.arange(T, dtype=torch.int64)
    b_of_t = torch.div(t, S, rounding_mode="floor")
    i_of_t = t - b_of_t * S
    sq_of_t = torch.full((T,), S, dtype=torch.int64)
    return b_of_t, i_of_t, sq_of_t


# --------------------------------------------------------------------------------------------
# the indexers' visible-key window and top-k selection (npu_lightning_indexer and
# npu_quant_lightning_indexer differ only in how a (token, key) score is computed)
# --------------------------------------------------------------------------------------------


def indexer_window(
    kv_len: torch.Tensor,
    b_of_t: torch.Tensor,
    i_of_t: torch.Tensor,
    sq_of_t: torch.Tensor,
    sparse_mode: int,
) -> tuple[torch.Tensor, int]:
    """Visible keys per query token: ``n[t]`` (``[T]`` int64, >= 0) and ``max(n)``.

    ``sparse_mode`` 3 (right-down causal): ``n = L[b] - Sq + i + 1``; 0: ``n = L[b]``. ``n <= 0``
    means no visible key (the token's row is all -1).
    """
    if sparse_mode == 3:
        n = kv_len[b_of_t] - sq_of_t + i_of_t + 1
    else:
        n = kv_len[b_of_t]
    n = n.clamp(min=0)
    return n, (int(n.max().item()) if n.numel() > 0 else 0)


# The indexers' fp32 sums in one defined order. A BLAS product leaves its summation order to the library
# (torch's CPU bmm already rounds differently when only the width of the key window changes), so a top-k
# computed that way is not reproducible by any other kernel. In this order every IEEE single operation is
# fixed, and custom_ops/cuda/npu_lightning_indexer.py computes the same bits on any device.


def pairwise_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum of fp32 ``x`` over ``dim`` in a fixed order: padded with ``-0.0`` (the exact identity of addition)
    to a power of two ``w``, then halves, ``x[i] + x[i + w/2]``, until one element is left."""
    n = x.size(dim)
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        pad = list(x.shape)
        pad[dim] = width - n
        x = torch.cat([x, x.new_full(pad, -0.0)], dim=dim)
    while width > 1:
        width //= 2
        x = x.narrow(dim, 0, width) + x.narrow(dim, width, width)
    return x.squeeze(dim)


def fold_heads(terms: torch.Tensor) -> torch.Tensor:
    """``[T, N, W] -> [T, W]``: the head terms summed in head order, ``((t0 + t1) + t2) + ...`` (fp32)."""
    acc = terms[:, 0]
    for h in range(1, terms.size(1)):
        acc = acc + terms[:, h]
    return acc


def indexer_topk(score: torch.Tensor, n: torch.Tensor, needed: torch.Tensor, K: int) -> torch.Tensor:
    """``[T, K]`` int32 ids of the ``min(K, n[t])`` largest ``score[t, :n[t]]``, -1 padded.

    Order: score descending, equal scores by ascending id (stable sort). ``needed`` = ``j < n[t]``.
    """
    T, nmax = score.shape
    out = torch.full((T, K), -1, dtype=torch.int32)
    if nmax == 0:
        return out
    score = score.masked_fill(~needed, float("-inf"))
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices
    c = min(K, nmax)
    top = order[:, :c].to(torch.int32)
    keep = torch.arange(c).unsqueeze(0) < n.clamp(max=K).unsqueeze(1)
    out[:, :c] = torch.where(keep, top, torch.full_like(top, -1))
    return out


INDEXER_MAX_SPARSE_COUNT = SHARED_LIMITS["INDEXER_MAX_SPARSE_COUNT"].value


def check_sparse_count(op: str, sparse_count: int) -> None:
    ref_check(
        0 < sparse_count <= INDEXER_MAX_SPARSE_COUNT,
        op,
        f"sparse_count must be in (0, {INDEXER_MAX_SPARSE_COUNT}], got {sparse_count}",
    )


def check_indexer_query_lengths(op: str, actual_seq_lengths_query: Optional[torch.Tensor], B: int) -> None:
    """Optional query lengths of an indexer: 1-D of length ``B`` (> 0), int32/int64."""
    if actual_seq_lengths_query is None:
        return
    ref_check(
        actual_seq_lengths_query.dim() == 1 and actual_seq_lengths_query.size(0) == B and B > 0,
        op,
        f"actual_seq_lengths_query must be 1-D of length B={B} (> 0), got {tuple(actual_seq_lengths_query.shape)}",
    )
    ref_check(
        actual_seq_lengths_query.dtype in INDEX_DTYPES,
        op,
        f"actual_seq_lengths_query must be int32/int64, got {actual_seq_lengths_query.dtype}",
    )


def check_indexer_key(op: str, key: torch.Tensor, layout_key: str, D: int) -> None:
    """An indexer's key cache: 4-D, one key head, head dim ``D`` (the kv layout is checked separately)."""
    ref_check(key.dim() == 4, op, f"key must be 4-D ({layout_key}), got {key.dim()}-D")
    ref_check(key.size(2) == 1, op, f"key dim 2 (key heads N2) must be 1, got {key.size(2)}")
    ref_check(key.size(3) == D, op, f"key head dim {key.size(3)} must equal query head dim D={D}")


def indexer_out_shape(info: dict, layout_query: str, K: int) -> tuple:
    """Shape of the indexers' top-k ids: ``[T, 1, K]`` (TND) or ``[B, S, 1, K]`` (BSND)."""
    if layout_query == "TND":
        return (info["T"], 1, K)
    return (info["B"], info["S"], 1, K)


def indexer_reference(
    op: str,
    info: dict,
    key: torch.Tensor,
    block_table: Optional[torch.Tensor],
    actual_seq_lengths_query: Optional[torch.Tensor],
    actual_seq_lengths_key: Optional[torch.Tensor],
    layout_query: str,
    layout_key: str,
    sparse_count: int,
    sparse_mode: int,
    score: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Body of both indexer references (validated inputs, ``info`` from the op's validation).

    ``score(rows)`` maps the flat key-row ids ``[T, nmax]`` of every query token's visible window
    (paged addressing applied; positions beyond ``n[t]`` read row 0 and are masked afterwards) to fp32
    scores ``[T, nmax]``; it is called only when some token sees a key. Returns the top-k ids in the
    op's output shape.
    """
    B, T = info["B"], info["T"]
    b_of_t, i_of_t, sq_of_t = token_positions(layout_query, actual_seq_lengths_query, T, info["S"], op)
    table, kv_len, num_blocks, bs = kv_addressing(key, block_table, actual_seq_lengths_key, layout_key, B)
    ref_check(bool((kv_len >= 0).all().item()), op, "actual_seq_lengths_key must be >= 0")
    n, nmax = indexer_window(kv_len, b_of_t, i_of_t, sq_of_t, sparse_mode)  # n <= 0: the row is all -1
    scores = torch.zeros((T, 0), dtype=torch.float32)
    needed = torch.zeros((T, 0), dtype=torch.bool)
    if nmax > 0:
        pos = torch.arange(nmax, dtype=torch.int64)
        needed = pos.unsqueeze(0) < n.unsqueeze(1)  # [T, nmax]
        rows = paged_rows(
            table, b_of_t.unsqueeze(1).expand(T, nmax), pos.unsqueeze(0).expand(T, nmax), needed, bs, num_blocks, op
        )
        scores = score(rows)
    return indexer_topk(scores, n, needed, sparse_count).view(indexer_out_shape(info, layout_query, sparse_count))
