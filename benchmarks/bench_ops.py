"""Kernel benchmark of the DSA offload ops at GLM-5.2 production shapes (CPU).

Prints ONE table of ratios measured in the same run (docs/design.md §5):

* every op: its time through ``torch.ops`` (``op ms``) beside its bare C++ kernel's (``bare ms``,
  ``offload_cpu::<op>`` called directly) and their ratio ``op / bare``: the per-call work outside the
  kernel (binding, validation, Python), which the ops' C++ CPU entry removes (docs/ops.md §13); and, in
  microseconds, that work alone: op and bare kernel on each op's smallest legal call;
* ``dsa_serve``   C++ vs ``torch.index_select`` of the same rows (pool rows from the pool, full rows
  from the full cache, zero rows zeroed) and vs a plain ``copy_`` of the same bytes;
* ``dsa_install`` C++ (``metadata_update=0``, the per-layer call) vs ``index_select`` of the rows it
  installs and vs ``copy_`` of the same bytes;
* ``dsa_plan``    C++ vs its pure-torch reference;
* ``npu_gather_selection_kv_cache`` C++ vs its reference and vs ``index_select`` of every valid row
  (what a gather without the reuse ledger moves), cold (empty ledger) and warm (~59 % reuse).

Ratios are ``baseline_time / op_time`` (> 1: the op is faster), except ``op / bare`` (1: no per-call
overhead). Every group of timings is taken in interleaved rounds (op, baselines, op, ...) and the minimum
per function is used, which keeps the ratios meaningful on a shared machine; in each round a function runs
once untimed right before its timed call, so every function is timed with the caches its own previous call
left (the function timed after another one's call would otherwise inherit its warm inputs).

Usage: ``python benchmarks/bench_ops.py [--repeat N] [--quick] [--threads T] [--full-len F]``
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch  # noqa: E402

import offload_passes  # noqa: E402,F401  (registers the ops)
from offload_passes.custom_ops import _library as Lib  # noqa: E402
from offload_passes.custom_ops._pool import id_range_for  # noqa: E402
from offload_passes.custom_ops.plan_kind import NUM_PLAN_KINDS, PlanKind  # noqa: E402
from offload_passes.custom_ops import npu_gather_selection_kv_cache as gather_mod  # noqa: E402
from offload_passes.custom_ops import dsa_serve as serve_mod  # noqa: E402
from _harness import timeit  # noqa: E402  (benchmarks/_harness.py: the interleaved min timing)

B, K, DKV, DR, SBS = 4, 2048, 512, 64, 128
DTYPE = torch.bfloat16
HIT_RATE = 0.85  # pool hit rate of the plan inputs (guide: ~85 % with an 8K pool)
MTP_OVERLAP = 0.9  # fraction of ids a row s > 0 shares with row s = 0 of the same batch row
STEP_OVERLAP = 0.59  # ledger reuse between adjacent steps (guide: 58.85 %)


#: rounds of the op / bare-kernel pairs per round of the other timings: their ratio is the finest figure of
#: the table (a few percent), so it gets the most samples
PAIR_ROUNDS = 3


# ------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------

def make_topk(S: int, F: int, g: torch.Generator, prev: torch.Tensor | None = None) -> torch.Tensor:
    """[B, S, 1, K]: K distinct ids per row from [0, F-S-1]; rows s > 0 share MTP_OVERLAP with s = 0;
    with ``prev``, row (b, 0) keeps STEP_OVERLAP of prev's row (b, 0)."""
    out = torch.empty(B, S, 1, K, dtype=torch.int32)
    hi = F - S  # ids <= max_valid for every s (no decode-window rows)
    for b in range(B):
        pool = torch.randperm(hi, generator=g)
        if prev is not None:
            keep = prev[b, 0, 0, : int(K * STEP_OVERLAP)].long()
            fresh = pool[~torch.isin(pool, keep)][: K - keep.numel()]
            base = torch.cat([keep, fresh])
        else:
            base = pool[:K]
        base = base[torch.randperm(K, generator=g)]
        out[b, 0, 0] = base.to(torch.int32)
        spare = pool[~torch.isin(pool, base)]
        for s in range(1, S):
            row = base.clone()
            n_new = K - int(K * MTP_OVERLAP)
            pos = torch.randperm(K, generator=g)[:n_new]
            row[pos] = spare[(s - 1) * n_new: s * n_new]
            out[b, s, 0] = row.to(torch.int32)
    return out


def make_pool_state(topk: torch.Tensor, PS: int, IR: int, g: torch.Generator):
    """Set-associative pool holding ~HIT_RATE of each batch row's ids (consistent metadata)."""
    NS = PS // 16
    pool_ids = torch.full((B, PS), -1, dtype=torch.int32)
    id_to_slot = torch.full((B, IR), -1, dtype=torch.int32)
    for b in range(B):
        ids = torch.unique(topk[b].flatten().long())
        ids = ids[torch.randperm(ids.numel(), generator=g)][: int(ids.numel() * HIT_RATE)]
        fill = [0] * NS
        for x in ids.tolist():
            st = x & (NS - 1)
            if fill[st] < 16:
                slot = st * 16 + fill[st]
                fill[st] += 1
                pool_ids[b, slot] = x
                id_to_slot[b, x] = slot
    return pool_ids, id_to_slot, torch.zeros(B, NS, dtype=torch.int32)


def payload(shape, g: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=g, dtype=torch.float32).to(DTYPE)


# ------------------------------------------------------------------------------------------------
# benchmarks
# ------------------------------------------------------------------------------------------------

Row = dict


def bench_plan_serve_install(S: int, PS: int, F: int, full: tuple, repeat: int, g: torch.Generator) -> list[Row]:
    full_kv, full_rope = full
    IR = id_range_for(F)
    topk = make_topk(S, F, g)
    L = torch.full((B,), F, dtype=torch.int32)
    pool_ids, id_to_slot, lru = make_pool_state(topk, PS, IR, g)
    pool_kv, pool_rope = payload((B, PS, DKV), g), payload((B, PS, DR), g)
    rows = B * S * K
    nb = rows // SBS
    sel_kv, sel_rope = torch.empty(nb, SBS, DKV, dtype=DTYPE), torch.empty(nb, SBS, DR, dtype=DTYPE)
    sel_table = torch.arange(nb, dtype=torch.int32).view(B * S, K // SBS)
    cfg = f"B{B} S{S} K{K} PS{PS}"
    out: list[Row] = []

    # ---- dsa_plan
    plan_op = torch.ops.custom.dsa_plan.default
    plan, records, act = plan_op(topk, L, pool_ids, id_to_slot, lru, raw_seq=S)
    try:
        from offload_passes.custom_ops.dsa_plan import reference_dsa_plan
    except ImportError:
        reference_dsa_plan = None
    bare_plan = Lib.cpu_op("dsa_plan").default
    t = timeit({"op": lambda: plan_op(topk, L, pool_ids, id_to_slot, lru, raw_seq=S),
                "bare": lambda: bare_plan(topk, L, pool_ids, id_to_slot, lru, S)}, repeat * PAIR_ROUNDS)
    if reference_dsa_plan is not None:
        t.update(timeit({"ref": lambda: reference_dsa_plan(topk, L, pool_ids, id_to_slot, lru, raw_seq=S)},
                        max(2, repeat // 4)))
    kinds = torch.bincount(plan[:, 0].long(), minlength=NUM_PLAN_KINDS)
    hits, misses = int(kinds[PlanKind.POOL_HIT]), int(kinds[PlanKind.FULL_OLD_MISS])
    out.append(dict(op="dsa_plan", cfg=cfg, ms=t["op"] * 1e3, bare=t["bare"] * 1e3, gbs=None, isel=None, copy=None,
                    ref=t["ref"] / t["op"] if "ref" in t else None,
                    note=f"hit {hits / max(hits + misses, 1):.0%}"))

    # ---- dsa_serve
    serve_op = torch.ops.custom.dsa_serve.default
    cpp_serve = Lib.cpu_op("dsa_serve")
    kind, val = plan[:, 0].long(), plan[:, 1].long()
    b_of = torch.arange(rows) // (S * K)
    pm = kind == PlanKind.POOL_HIT
    fm = (kind == PlanKind.FULL_OLD_MISS) | (kind == PlanKind.DECODE_WINDOW)
    pool_idx = (b_of * PS + val)[pm]
    full_idx = (b_of * F + val)[fm]
    n_p, n_f = pool_idx.numel(), full_idx.numel()
    flat = dict(fkv=full_kv.view(-1, DKV), frp=full_rope.view(-1, DR), pkv=pool_kv.view(-1, DKV),
                prp=pool_rope.view(-1, DR), skv=sel_kv.view(-1, DKV), srp=sel_rope.view(-1, DR))

    def isel_serve():
        for src_p, src_f, dst in (("pkv", "fkv", "skv"), ("prp", "frp", "srp")):
            torch.index_select(flat[src_p], 0, pool_idx, out=flat[dst][:n_p])
            torch.index_select(flat[src_f], 0, full_idx, out=flat[dst][n_p:n_p + n_f])
            flat[dst][n_p + n_f:].zero_()

    src_kv, src_rope = payload((rows, DKV), g), payload((rows, DR), g)

    def copy_serve():
        flat["skv"].copy_(src_kv)
        flat["srp"].copy_(src_rope)

    sargs = (plan, full_kv, full_rope, pool_kv, pool_rope, sel_kv, sel_rope)
    t = timeit({"isel": isel_serve, "copy": copy_serve}, repeat)
    t.update(timeit({"op": lambda: serve_op(*sargs, raw_seq=S, topk=K, selection_block_size=SBS),
                     "bare": lambda: cpp_serve(*sargs, S, K, SBS, 1)}, repeat * PAIR_ROUNDS))
    t_ref = timeit({"ref": lambda: serve_mod.reference_dsa_serve(*sargs, S, K, SBS, 1)}, max(2, repeat // 4))
    nbytes = rows * (DKV + DR) * 2
    out.append(dict(op="dsa_serve", cfg=cfg, ms=t["op"] * 1e3, bare=t["bare"] * 1e3, gbs=nbytes / t["op"] / 1e9,
                    isel=t["isel"] / t["op"], copy=t["copy"] / t["op"], ref=t_ref["ref"] / t["op"], note=""))
    serve_op(*sargs, raw_seq=S, topk=K, selection_block_size=SBS)  # selection holds this step's rows

    # ---- dsa_install (metadata_update=0: identical work every call)
    try:
        install_op = torch.ops.custom.dsa_install.default
        # rows installed: distinct FULL_OLD_MISS ids per batch row, first occurrence wins
        src_rows = []
        for b in range(B):
            q = torch.nonzero(kind[b * S * K:(b + 1) * S * K] == PlanKind.FULL_OLD_MISS).flatten()
            ids = val[b * S * K:(b + 1) * S * K][q]
            uniq, inv = torch.unique(ids, return_inverse=True)
            first = torch.full((uniq.numel(),), q.numel(), dtype=torch.long).scatter_reduce(
                0, inv, torch.arange(q.numel()), reduce="amin")
            src_rows.append(b * S * K + q[first])
        src_rows = torch.cat(src_rows) if src_rows else torch.empty(0, dtype=torch.long)
        n_inst = src_rows.numel()
        tmp_kv, tmp_rope = torch.empty(n_inst, DKV, dtype=DTYPE), torch.empty(n_inst, DR, dtype=DTYPE)
        cp_src_kv, cp_src_rope = payload((n_inst, DKV), g), payload((n_inst, DR), g)
        iargs = (records, sel_kv, sel_rope, sel_table, pool_kv, pool_rope, pool_ids, id_to_slot, lru)

        def isel_install():
            torch.index_select(flat["skv"], 0, src_rows, out=tmp_kv)
            torch.index_select(flat["srp"], 0, src_rows, out=tmp_rope)

        def copy_install():
            tmp_kv.copy_(cp_src_kv)
            tmp_rope.copy_(cp_src_rope)

        bare_install = Lib.cpu_op("dsa_install").default
        t = timeit({"isel": isel_install, "copy": copy_install}, repeat)
        t.update(timeit({
            "op": lambda: install_op(*iargs, raw_seq=S, topk=K, selection_block_size=SBS, metadata_update=0),
            "bare": lambda: bare_install(*iargs, S, K, SBS, 0),
        }, repeat * PAIR_ROUNDS))
        nbytes = n_inst * (DKV + DR) * 2
        out.append(dict(op="dsa_install", cfg=cfg, ms=t["op"] * 1e3, bare=t["bare"] * 1e3,
                        gbs=nbytes / t["op"] / 1e9, isel=t["isel"] / t["op"], copy=t["copy"] / t["op"], ref=None,
                        note=f"{n_inst} rows, metadata_update=0"))
    except Exception as e:  # the op belongs to another component; report instead of failing the run
        out.append(dict(op="dsa_install", cfg=cfg, ms=None, bare=None, gbs=None, isel=None, copy=None, ref=None,
                        note=f"n/a: {type(e).__name__}: {str(e)[:60]}"))
    return out


def bench_gather(S: int, F: int, full: tuple, repeat: int, g: torch.Generator) -> list[Row]:
    """GLM's basic offload gather: paged full cache (identity table, block 128), bsz = 1."""
    full_kv, full_rope = full
    FBS = 128
    paged_kv, paged_rope = full_kv.view(-1, FBS, DKV), full_rope.view(-1, FBS, DR)
    fbt = torch.arange(B * F // FBS, dtype=torch.int32).view(B, F // FBS)
    L = torch.full((B,), F, dtype=torch.int32)
    q = torch.arange(1, B + 1, dtype=torch.int32) * S
    maxblk = K // SBS
    sbt = torch.arange(B * S * maxblk, dtype=torch.int32).view(B * S, maxblk)
    sel_kv = torch.zeros(B * S * maxblk, SBS, DKV, dtype=DTYPE)
    sel_rope = torch.zeros(B * S * maxblk, SBS, DR, dtype=DTYPE)
    prev = make_topk(S, F, g)
    topk = make_topk(S, F, g, prev=prev)
    op = torch.ops.custom.npu_gather_selection_kv_cache.default
    cfg = f"B{B} S{S} K{K} F{F}"
    out: list[Row] = []
    status_cold = torch.full((B, S, 1, K + 1), -1, dtype=torch.int32)
    warm = status_cold.clone()
    op(sel_rope, sel_kv, sbt, warm, prev, paged_rope, paged_kv, fbt, L, q, selection_topk_block_size=1)
    # every valid row, as a plain gather (no ledger) would move it
    flat_idx = (torch.arange(B).view(B, 1, 1, 1) * F + topk.long()).flatten()
    all_kv, all_rope = torch.empty(flat_idx.numel(), DKV, dtype=DTYPE), torch.empty(flat_idx.numel(), DR, dtype=DTYPE)
    fkv, frp = full_kv.view(-1, DKV), full_rope.view(-1, DR)

    def isel_all():
        torch.index_select(fkv, 0, flat_idx, out=all_kv)
        torch.index_select(frp, 0, flat_idx, out=all_rope)

    bare = Lib.cpu_op("npu_gather_selection_kv_cache").default
    for label, status0 in (("cold", status_cold), ("warm", warm)):
        status = status0.clone()

        def run_op():
            status.copy_(status0)  # same ledger every call: identical work
            return op(sel_rope, sel_kv, sbt, status, topk, paged_rope, paged_kv, fbt, L, q,
                      selection_topk_block_size=1)

        def run_bare():
            status.copy_(status0)
            return bare(sel_rope, sel_kv, sbt, status, topk, paged_rope, paged_kv, fbt, L, q, 1)

        def run_ref():
            status.copy_(status0)
            return gather_mod.reference_npu_gather_selection_kv_cache(
                sel_rope, sel_kv, sbt, status, topk, paged_rope, paged_kv, fbt, L, q, 1)

        t = timeit({"isel": isel_all}, repeat)
        t.update(timeit({"op": run_op, "bare": run_bare}, repeat * PAIR_ROUNDS))
        t_ref = timeit({"ref": run_ref}, max(2, repeat // 4))
        run_op()
        reused = int(torch.isin(status[..., :K], status0[..., :K]).logical_and(status[..., :K] >= 0).sum())
        moved = B * S * K - reused
        out.append(dict(op=f"gather ({label})", cfg=cfg, ms=t["op"] * 1e3, bare=t["bare"] * 1e3,
                        gbs=moved * (DKV + DR) * 2 / t["op"] / 1e9,
                        isel=t["isel"] / t["op"], copy=None, ref=t_ref["ref"] / t["op"],
                        note=f"reuse {reused / (B * S * K):.0%}, {moved} rows copied"))
    return out


def bench_overhead(repeat: int, calls: int = 500) -> list[tuple[str, float, float]]:
    """Per-call time of each op and of its bare kernel on its smallest legal call (the kernel's own work is
    a few microseconds, so the difference is the work outside it): ``(op, op us, bare us)``, each the min
    over ``repeat`` interleaved samples of ``calls`` calls."""
    g = torch.Generator().manual_seed(1)
    i32, bf = torch.int32, torch.bfloat16
    Bt, Kt, PSt, IRt, sbs = 1, 64, 16, 64, 16
    topk = torch.arange(Kt, dtype=i32).view(1, 1, 1, Kt)
    L = torch.tensor([Kt + 1], dtype=i32)
    pid, i2s, lru = torch.full((1, PSt), -1, dtype=i32), torch.full((1, IRt), -1, dtype=i32), torch.zeros(1, 1, dtype=i32)
    plan, rec, _ = torch.ops.custom.dsa_plan.default(topk, L, pid, i2s, lru)
    fkv, frp = payload((1, Kt + 1, 8), g), payload((1, Kt + 1, 4), g)
    pkv, prp = payload((1, PSt, 8), g), payload((1, PSt, 4), g)
    skv, srp = payload((Kt // sbs, sbs, 8), g), payload((Kt // sbs, sbs, 4), g)
    table = torch.arange(Kt // sbs, dtype=i32).view(1, -1)
    status = torch.full((1, 1, 1, Kt + 1), -1, dtype=i32)
    paged = (payload((5, sbs, 4), g), payload((5, sbs, 8), g))  # (rope, kv) blocks of the full cache
    gather_args = (srp, skv, table, status, topk, *paged, torch.arange(5, dtype=i32).view(1, 5), L,
                   torch.ones(1, dtype=i32))
    ops_ = torch.ops.custom
    pairs = {
        "dsa_plan": (lambda: ops_.dsa_plan.default(topk, L, pid, i2s, lru),
                     lambda b=Lib.cpu_op("dsa_plan").default: b(topk, L, pid, i2s, lru)),
        "dsa_serve": (lambda: ops_.dsa_serve.default(plan, fkv, frp, pkv, prp, skv, srp, topk=Kt, selection_block_size=sbs),
                      lambda b=Lib.cpu_op("dsa_serve").default: b(plan, fkv, frp, pkv, prp, skv, srp, 1, Kt, sbs, 1)),
        "dsa_install": (lambda: ops_.dsa_install.default(rec, skv, srp, table, pkv, prp, pid, i2s, lru, topk=Kt,
                                                         selection_block_size=sbs, metadata_update=0),
                        lambda b=Lib.cpu_op("dsa_install").default: b(rec, skv, srp, table, pkv, prp, pid, i2s, lru,
                                                                      1, Kt, sbs, 0)),
        "npu_gather_selection_kv_cache": (
            lambda: ops_.npu_gather_selection_kv_cache.default(*gather_args, selection_topk_block_size=1),
            lambda b=Lib.cpu_op("npu_gather_selection_kv_cache").default: b(*gather_args, 1)),
    }
    out = []
    for name, (op, bare) in pairs.items():
        def many(f):
            return lambda: [f() for _ in range(calls)]
        t = timeit({"op": many(op), "bare": many(bare)}, repeat)
        out.append((name, t["op"] / calls * 1e6, t["bare"] / calls * 1e6))
    return out


def fmt(v, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=None, help="timed rounds per measurement (default 10, quick 4)")
    ap.add_argument("--quick", action="store_true", help="shorter full cache (16K) and fewer rounds")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--full-len", type=int, default=None, help="tokens per batch row in the full cache (default 65536)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    repeat = args.repeat or (4 if args.quick else 10)
    F = args.full_len or (16384 if args.quick else 65536)
    assert F % 128 == 0 and F > K + 8, "--full-len must be a multiple of 128 and > K"
    assert Lib.cpu_kernel_mode() == "cpp", "unset OFFLOAD_PASSES_CPU_KERNELS to benchmark the C++ kernels"
    g = torch.Generator().manual_seed(0)
    for name in ("dsa_plan", "dsa_serve", "dsa_install", "npu_gather_selection_kv_cache"):
        try:
            Lib.cpu_op(name)  # build outside the timings
        except Exception as e:  # noqa: BLE001
            print(f"warning: C++ kernel {name} unavailable: {e}")
    overhead = bench_overhead(repeat)
    full = (payload((B, F, DKV), g), payload((B, F, DR), g))
    rows: list[Row] = []
    for S in (1, 4):
        for PS in (8192, 16384):
            rows += bench_plan_serve_install(S, PS, F, full, repeat, g)
        rows += bench_gather(S, F, full, repeat, g)

    print(f"\nDSA op kernels on CPU: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"bf16, kv {DKV} + rope {DR}, full cache {F} tokens/row, {repeat} rounds (min)")
    load = os.getloadavg()[0]
    print(f"load average {load:.1f} on {os.cpu_count()} cores"
          + ("  [machine shared: multi-threaded timings include waits for a descheduled worker thread;"
             " compare with --threads 1]" if load > (os.cpu_count() or 1) * 0.75 else ""))
    print("ratios = baseline time / op time (> 1: op faster); op / bare = op time / bare kernel time "
          "(1: no per-call work outside the kernel)\n")
    head = (f"{'op':<16} {'config':<22} {'op ms':>8} {'bare ms':>8} {'op / bare':>9} {'GB/s':>6} "
            f"{'vs index_select':>16} {'vs copy_':>9} {'vs reference':>13}  note")
    print(head)
    print("-" * len(head))
    for r in rows:
        ratio = r["ms"] / r["bare"] if r.get("bare") else None
        print(f"{r['op']:<16} {r['cfg']:<22} {fmt(r['ms'], '8.3f')} {fmt(r.get('bare'), '8.3f')} "
              f"{fmt(ratio, '9.3f')} {fmt(r['gbs'], '6.1f')} "
              f"{fmt(r['isel'], '15.2f') + ('x' if r['isel'] is not None else ' '):>16} "
              f"{fmt(r['copy'], '8.2f') + ('x' if r['copy'] is not None else ' '):>9} "
              f"{fmt(r['ref'], '12.1f') + ('x' if r['ref'] is not None else ' '):>13}  {r['note']}")
    print("\nper-call work outside the kernel: the smallest legal call of each op (B1 S1 K64), "
          "microseconds per call")
    print(f"{'op':<30} {'op us':>7} {'bare us':>8} {'op - bare':>10}")
    for name, t_op, t_bare in overhead:
        print(f"{name:<30} {t_op:7.2f} {t_bare:8.2f} {t_op - t_bare:10.2f}")


if __name__ == "__main__":
    main()
