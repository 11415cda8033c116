"""Test-only stand-in kernels, registered only where the real ones are still missing.

The ops (``custom_ops/``) are written in parallel; until every CPU / fake / Functionalize kernel has
landed, these pure-torch stand-ins (straight restatements of spec/ops.md) let the backend tests run.
Each registration is skipped when a kernel for that dispatch key already exists, so the real kernels
(registered at ``import offload_passes``) always win.
"""
from __future__ import annotations

import torch

from offload_passes.custom_ops import _library as L
from offload_passes.custom_ops._records import decode_records, encode_records, records_layout

_REF_LIB = torch.library.Library("offload_ref", "FRAGMENT")


def _has(qual: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(qual, key)


def _impl(name: str, key: str, fn) -> None:
    if not _has(f"custom::{name}", key):
        L._lib.impl(name, fn, key)


def _fake(name: str, fn) -> None:
    if not _has(f"custom::{name}", "Meta"):
        try:
            torch.library.register_fake(f"custom::{name}", fn, lib=L._lib)
        except RuntimeError:
            pass


# ---------------------------------------------------------------- dsa_plan (§2)

def plan_ref(topk, L_, pool_ids, id_to_slot, lru, *, raw_seq=1, group_id=0, owner_layer=0, group_kind=0):
    B, K = topk.size(0), topk.size(-1)
    S = raw_seq
    rows = topk.reshape(B * S, K).tolist()
    PS, IR, NS, P = pool_ids.size(1), id_to_slot.size(1), pool_ids.size(1) // 16, K // 8
    plan = torch.zeros(B * S * K, 2, dtype=torch.int32)
    act = torch.zeros(B * S, dtype=torch.int32)
    recs = []
    i2s = id_to_slot.tolist()
    pl = [[0, 0] for _ in range(B * S * K)]
    for b in range(B):
        Lb = int(L_[b])
        for s in range(S):
            r = b * S + s
            row = rows[r]
            mv = max(Lb - S - 1, 0)
            ms = Lb - (S - 1 - s) - 1
            empty = Lb <= 0 or ms < 0
            if not empty:
                n = 0
                for x in row:
                    if x < 0:
                        break
                    n += x <= ms
                act[r] = n
            for m in range(8):
                stopped = m > 0 and row[m * P - 1] < 0
                for k in range(m * P, (m + 1) * P):
                    x, q = row[k], r * K + k
                    if stopped:
                        pl[q] = [0, -1]
                    elif x < 0:
                        pl[q] = [5, x]
                        stopped = True
                    elif empty or x > ms:
                        pl[q] = [4, x]
                    else:
                        sl = i2s[b][x] if x < IR else -1
                        sl = sl if 0 <= sl < PS else -1
                        if sl >= 0 and x <= mv:
                            pl[q] = [1, sl]
                        elif x > mv:
                            pl[q] = [3, x]
                        else:
                            pl[q] = [2, x]
                            recs.append((r * 8 + m, x & (NS - 1), x, s, k))
    plan = torch.tensor(pl, dtype=torch.int32).view(B * S * K, 2)
    rec = encode_records(recs if recs else None, None, B, S, K)
    return plan, rec, act


def _plan_fake(topk, L_, pool_ids, id_to_slot, lru, *, raw_seq=1, group_id=0, owner_layer=0, group_kind=0):
    K = topk.size(-1)
    n = topk.numel()
    lay = records_layout(topk.size(0), raw_seq, K)
    return (topk.new_empty((n, 2)), topk.new_empty((lay.alloc,), dtype=torch.int8),
            topk.new_empty((n // K,)))


# ---------------------------------------------------------------- dsa_serve (§3)

def serve_inplace(plan, full_kv, full_rope, pool_kv, pool_rope, sel_kv, sel_rope, *, raw_seq=1, topk=2048,
                  selection_block_size=128, compact_layout=1):
    B, F, PS = full_kv.size(0), full_kv.size(1), pool_kv.size(1)
    rows = plan.size(0)
    b = torch.arange(rows) // (raw_seq * topk)
    kind, v = plan[:, 0].long(), plan[:, 1].long()
    hit = (kind == 1) & (v >= 0) & (v < PS)
    full = ((kind == 2) | (kind == 3)) & (v >= 0) & (v < F)
    for dst, fsrc, psrc in ((sel_kv, full_kv, pool_kv), (sel_rope, full_rope, pool_rope)):
        flat = dst.view(-1, dst.size(-1))
        out = torch.zeros(rows, dst.size(-1), dtype=dst.dtype)
        out[hit] = psrc[b[hit], v[hit]]
        out[full] = fsrc[b[full], v[full]]
        flat[:rows] = out


def _serve_functional(plan, fk, fr, pk, pr, sk, sr, **kw):
    sk, sr = sk.clone(), sr.clone()
    serve_inplace(plan, fk, fr, pk, pr, sk, sr, **kw)
    return sk, sr


# ---------------------------------------------------------------- dsa_install (§4)

def install_inplace(rec, sel_kv, sel_rope, sel_table, pool_kv, pool_rope, pool_ids, id_to_slot, lru, *,
                    raw_seq=1, topk=2048, selection_block_size=128, metadata_update=1):
    B, PS = pool_kv.size(0), pool_kv.size(1)
    S, K, NS, IR = raw_seq, topk, PS // 16, id_to_slot.size(1)
    records, _ = decode_records(rec, B, S, K)
    skf, srf = sel_kv.view(-1, sel_kv.size(-1)), sel_rope.view(-1, sel_rope.size(-1))
    per_b = {}
    for mt, st, x, sq, pos in records.tolist():
        per_b.setdefault(mt // (S * 8), []).append((st, x, sq, pos))
    for b, recs in per_b.items():
        seen = set()
        ctr = lru[b].clone() if metadata_update == 0 else lru[b]
        for st, x, sq, pos in recs:
            if not (0 <= x < IR and 0 <= st < NS and 0 <= sq < S and 0 <= pos < K) or x in seen:
                continue
            seen.add(x)
            way = int(ctr[st]) & 15
            ctr[st] = (int(ctr[st]) + 1) & 15
            slot = st * 16 + way
            if metadata_update == 1:
                old = int(pool_ids[b, slot])
                if 0 <= old < IR:
                    id_to_slot[b, old] = -1
                pool_ids[b, slot] = x
                id_to_slot[b, x] = slot
            src = (b * S + sq) * K + pos
            pool_kv[b, slot] = skf[src]
            pool_rope[b, slot] = srf[src]


def _install_functional(rec, sk, sr, st, pk, pr, pi, i2s, lru, **kw):
    outs = [t.clone() for t in (pk, pr, pi, i2s, lru)]
    install_inplace(rec, sk, sr, st, *outs, **kw)
    return tuple(outs)


# ---------------------------------------------------------------- gather (§1.4, bsz == 1)

def gather_inplace(sel_rope, sel_kv, sel_table, status, topk, full_rope, full_kv, full_table, L_, q_seq, *,
                   selection_topk_block_size=64):
    B = full_table.size(0)
    K = topk.size(-1)
    T = topk.numel() // K
    S = T // B
    st = status.view(T, K + 1)
    tk = topk.reshape(T, K)
    FBS = full_kv.size(1)
    SBS = sel_kv.size(1)
    out = torch.zeros(sel_table.size(0), dtype=torch.int32)
    for r in range(T):
        b, s = divmod(r, S)
        if int(L_[b]) <= 0:
            continue
        Lr = int(L_[b]) - (S - 1 - s)
        if Lr <= 0:
            continue
        max_sel = Lr - 1
        max_reuse = max(max_sel - s - 1, 0)
        ids = [x for x in tk[r].tolist() if 0 <= x <= max_sel]
        n = len(ids)
        old = st[r, :K].tolist()
        pos_of = {x: p for p, x in enumerate(old) if x >= 0}
        keep = {}
        for j, x in enumerate(ids):
            if x <= max_reuse and x in pos_of:
                keep[pos_of[x]] = j
        moved = {}
        if keep and max(keep) + 1 - n > 0:
            for p in range(max(keep), n - 1, -1):
                if p in keep:
                    moved[keep.pop(p)] = p
        kept_j = set(keep.values())
        free = [p for p in range(K) if p not in keep]
        fi = 0
        # moved sources are >= n and destinations < n: snapshot sources first
        snap = {j: (sel_kv.view(-1, sel_kv.size(-1))[sel_table[r, p // SBS] * SBS + p % SBS].clone(),
                    sel_rope.view(-1, sel_rope.size(-1))[sel_table[r, p // SBS] * SBS + p % SBS].clone())
                for j, p in moved.items()}
        for j, x in enumerate(ids):
            if j in kept_j:
                continue
            dst = free[fi]
            fi += 1
            if j in snap:
                kv, rp = snap[j]
            else:
                blk = full_table[b, x // FBS]
                kv, rp = full_kv[blk, x % FBS], full_rope[blk, x % FBS]
            flat = sel_table[r, dst // SBS] * SBS + dst % SBS
            sel_kv.view(-1, sel_kv.size(-1))[flat] = kv
            sel_rope.view(-1, sel_rope.size(-1))[flat] = rp
            st[r, dst] = x
        st[r, n:K] = -1
        st[r, K] = n
        out[r] = n
    return out


def _gather_functional(sr, sk, stb, sts, topk, fr, fk, ft, L_, q, **kw):
    sr, sk, stb, sts = sr.clone(), sk.clone(), stb.clone(), sts.clone()
    act = gather_inplace(sr, sk, stb, sts, topk, fr, fk, ft, L_, q, **kw)
    return act, sr, sk, stb, sts


def register() -> None:
    _impl("dsa_plan", "CPU", plan_ref)
    _fake("dsa_plan", _plan_fake)
    _impl("dsa_serve", "CPU", serve_inplace)
    _impl("dsa_serve_functional", "CPU", _serve_functional)
    _fake("dsa_serve", lambda *a, **k: None)
    _fake("dsa_serve_functional", lambda p, fk, fr, pk, pr, sk, sr, **k: (torch.empty_like(sk), torch.empty_like(sr)))
    L.register_functionalization("dsa_serve", "dsa_serve_functional", ["selection_kv_cache", "selection_k_rope"])
    _impl("dsa_install", "CPU", install_inplace)
    _impl("dsa_install_functional", "CPU", _install_functional)
    _fake("dsa_install", lambda *a, **k: None)
    _fake("dsa_install_functional",
          lambda rec, sk, sr, st, pk, pr, pi, i2s, lru, **k: tuple(torch.empty_like(t) for t in (pk, pr, pi, i2s, lru)))
    L.register_functionalization("dsa_install", "dsa_install_functional",
                                 ["pool_kv_cache", "pool_k_rope", "pool_ids", "id_to_slot", "lru_counter"])
    _impl("npu_gather_selection_kv_cache", "CPU", gather_inplace)
    _impl("npu_gather_selection_kv_cache_functional", "CPU", _gather_functional)
    _fake("npu_gather_selection_kv_cache",
          lambda sr, sk, stb, *a, **k: sk.new_empty((stb.size(0),), dtype=torch.int32))
    _fake("npu_gather_selection_kv_cache_functional",
          lambda sr, sk, stb, sts, *a, **k: (sk.new_empty((stb.size(0),), dtype=torch.int32), torch.empty_like(sr),
                                             torch.empty_like(sk), torch.empty_like(stb), torch.empty_like(sts)))
    L.register_functionalization("npu_gather_selection_kv_cache", "npu_gather_selection_kv_cache_functional",
                                 ["selection_k_rope", "selection_kv_cache", "selection_kv_block_table",
                                  "selection_kv_block_status"], num_leading_outputs=1)


register()
