"""Prefix reuse: time to first token of a returning request, its stored prefix reloaded from RAM / disk / a
shared Mooncake Store against recomputed, and the multi-turn shared-prefix workload through the serving loop.

    python benchmarks/bench_reuse.py                     # small config, N = 1024, 4096 (CPU)
    python benchmarks/bench_reuse.py --n 1024,4096,16384 --json out.json

A returning request's prompt is N stored tokens + 1 new one. Recompute: the prefill of all N+1 tokens.
``{tier}_reload_s``: the reload alone; ``{tier}_s``: the reload and the new token's prefill (time to first token).
Reload: the whole reload (key hashing, lookup, load, the checksums and decoding of a byte tier's chunks, the
copy into the prefill model's paged caches) and the prefill of the one new token on top (``prefill_from``). Times are best-of-``--repeats``. The shared store is a
``mooncake_master`` + a holder process on 127.0.0.1 (``offload_passes.store.mooncake_local.LocalMooncake``),
started here and stopped by PID (skipped with a note when
``mooncake_master`` is not installed). Break-even: the prefix length below which a tier's reload loses to
recomputing, measured on a grid and as ``ReuseRule.break_even`` predicts from each tier's fitted cost.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from offload_passes import models  # noqa: E402
from offload_passes.models.glm.reuse import prefill_from  # noqa: E402
from offload_passes.store import DiskTier, KVStore, MooncakeTier, RamTier, ReuseRule, TierCost  # noqa: E402
from offload_passes.store.rule import best_time  # noqa: E402
from offload_passes.store.mooncake_local import LocalMooncake, master_binary  # noqa: E402
from offload_passes.store.paged import PagedStore, extract_paged, paged_fingerprint  # noqa: E402

C = 64  # chunk tokens

def _mooncake(workdir: Path):
    """(tier, local store) or (None, reason): a master + holder on 127.0.0.1 (``LocalMooncake``)."""
    if master_binary() is None:
        return None, "mooncake_master not installed"
    mc = LocalMooncake(workdir, segment=512 << 20, lease_ms=60000).start()
    return (MooncakeTier(mc.master_addr, mc.metadata_url, local_buffer_size=256 << 20), mc), None


def ttft(config: str, sizes: list, repeats: int, tiers: dict) -> dict:
    cap = max(sizes) + 2 * C
    # a preset's position limit below the longest prefix (small: 8,192) is raised to fit it, and said so
    limit = models.load_config(config).model.max_position_embeddings
    over = {"max_position_embeddings": cap} if cap > limit else {}
    pm = models.build(config, batch_size=1, enable_offload=False, pa_max_length=cap, prefill_len=min(sizes),
                      **over).model
    fp = paged_fingerprint(pm, C, weights_id=f"{config}-seed0")
    bpt = fp.bytes_per_token()
    out = {"config": config, "chunk_tokens": C, "bytes_per_token": bpt, "rows": [], "overrides": over}
    if over:
        print(f"{config}: max_position_embeddings {limit} raised to {cap} for N = {max(sizes)}", flush=True)
    g = torch.Generator().manual_seed(0)
    for N in sizes:
        ids = torch.randint(0, pm.config.vocab_size, (N + 1,), generator=g)
        rec = best_time(lambda: pm.prefill(ids.view(1, -1), torch.tensor([N + 1])), repeats)
        chunks = extract_paged(pm, pm.block_table[0].tolist(), N, C)
        row = {"N": N, "recompute_s": rec}
        for name, tier in tiers.items():
            ps = PagedStore(KVStore(fp, C, [tier], block_size=pm.block_size))
            ps.store.put(ids[:N], chunks)

            def reload():
                n = ps.reload(pm, ids, N)
                assert n == N, (name, n)

            t_reload = best_time(reload, repeats)  # the reload alone: what the tier targets count
            t = best_time(lambda: (reload(), prefill_from(pm, ids, N)), repeats)  # + the new token: time to first token
            row[f"{name}_reload_s"], row[f"{name}_reload_x"] = t_reload, rec / t_reload
            row[f"{name}_s"], row[f"{name}_x"] = t, rec / t
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    return out


def break_even(config: str, tiers: dict, repeats: int, grid=(16, 64, 256, 1024)) -> dict:
    """Measured: the smallest grid length where reload (the reload + one token) beats prefill of n+1; predicted:
    ``ReuseRule.break_even`` with the prefill cost interpolated from the grid and each tier's cost fitted from
    its reload times at the two ends of the grid."""
    cap = max(grid) + 2 * C
    pm = models.build(config, batch_size=1, enable_offload=False, pa_max_length=cap, prefill_len=16).model
    fp = paged_fingerprint(pm, C, weights_id=f"{config}-seed0")
    ids = torch.randint(0, pm.config.vocab_size, (max(grid) + 1,), generator=torch.Generator().manual_seed(1))
    rec = {n: best_time(lambda: pm.prefill(ids[: n + 1].view(1, -1), torch.tensor([n + 1])), repeats) for n in grid}
    one = best_time(lambda: prefill_from(pm, ids[: grid[0] + 1], grid[0]), repeats)  # the new token on top
    out = {}
    for name, tier in tiers.items():
        ps = PagedStore(KVStore(fp, C, [tier], block_size=pm.block_size))
        pm.prefill(ids.view(1, -1), torch.tensor([ids.numel()]))
        ps.store.put(ids[: max(grid)], extract_paged(pm, pm.block_table[0].tolist(), max(grid), C))
        rl = {n: best_time(lambda: (ps.reload(pm, ids[: n + 1], n), prefill_from(pm, ids[: n + 1], n)), repeats)
              for n in grid}
        measured = next((n for n in grid if rl[n] < rec[n]), None)
        a, b = grid[0], grid[-1]
        bw = (b - a) * fp.bytes_per_token() / max(rl[b] - rl[a], 1e-9)
        cost = TierCost(max(0.0, rl[a] - one - a * fp.bytes_per_token() / bw), bw)

        def prefill_cost(n: int) -> float:
            return float(torch.tensor(n, dtype=torch.float64).clamp(max=b) / b * rec[b]) if n else 0.0

        rule = ReuseRule(prefill_cost=lambda n: max(0.0, prefill_cost(n) - one), tiers={name: cost})
        out[name] = {"measured_below": measured, "predicted": rule.break_even(name, fp.bytes_per_token()),
                     "reload_s": rl, "recompute_s": rec}
        print(json.dumps({"break_even": name, **{k: v for k, v in out[name].items() if "_s" not in k}}), flush=True)
    return out


def multiturn(steps: int) -> dict:
    """The serving loop on tiny with the multi-turn workload, with and without a store: prefill tokens computed,
    the compiled offload lane's pool hit rate, max |diff| against the reference (recompute, same boundaries)."""
    from offload_passes import make_offload_backend
    from offload_passes.models.glm.serve import Lane, Server, ServeConfig
    from offload_passes.state import module_state
    from offload_passes.store.paged import RecomputeReference

    kw = dict(enable_offload=True, batch_size=2, next_n=1, pa_max_length=512, prefill_len=64, decode_steps=8)
    cfg = ServeConfig(seed=2, output_len=(4, 12), workload="multiturn", shared_prefix=160, branches=4, turns=3,
                      user_len=(8, 40))
    out = {}
    for with_store in (False, True):
        torch._dynamo.reset()
        rl, cm, ref = (models.build("tiny", **kw).model for _ in range(3))
        pm = models.build("tiny", **dict(kw, batch_size=1)).model
        be = make_offload_backend(pool_size=256)
        lanes = [Lane(rl), Lane(cm, torch.compile(cm, backend=be), lambda s, cm=cm: module_state(cm).move_rows(s))]
        if with_store:
            ps = PagedStore(KVStore(paged_fingerprint(pm, 16, weights_id="tiny-seed0"), 16, [RamTier(1 << 28)],
                                    block_size=16))
            srv = Server(lanes + [Lane(ref, reference=True)], pm, cfg, store=ps, reference=RecomputeReference(ps))
        else:
            srv = Server(lanes, pm, cfg)
        diff, n, prefill_tokens = 0.0, 0, 0
        while not srv.done and n < steps:
            outs = srv.step()
            n += 1
            if outs[0].numel():
                diff = max([diff] + [(outs[0].float() - o.float()).abs().max().item() for o in outs[1:]])
        t = module_state(cm).totals()
        st = srv.reuse_stats()
        out["store" if with_store else "no_store"] = {
            "steps": n, "finished": srv.finished, "max_abs_diff": diff,
            "prefill_tokens_total": st.get("prefill_tokens_total"), "prefill_tokens_computed":
                st.get("prefill_tokens_computed"), "chunks_loaded": st.get("chunks_loaded"),
            "chunks_rejected": st.get("chunks_rejected"), "hit_rate": t["hits"] / max(1, t["hits"] + t["misses"])}
        print(json.dumps({"multiturn": out}), flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="small")
    ap.add_argument("--n", default="1024,4096", help="returning prefix lengths (comma separated)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=120, help="multi-turn workload: at most this many steps")
    ap.add_argument("--no-mooncake", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(f"loadavg before: {os.getloadavg()}", flush=True)
    sizes = [int(x) for x in a.n.split(",")]
    res = {"threads": a.threads, "loadavg_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        tiers = {"ram": RamTier(4 << 30), "disk": DiskTier(os.path.join(tmp, "disk"), budget_bytes=8 << 30)}
        cluster = None
        if not a.no_mooncake:
            got, why = _mooncake(Path(tmp))
            if got is None:
                res["mooncake"] = why
                print(f"shared store skipped: {why}", flush=True)
            else:
                tiers["mooncake"], cluster = got
        try:
            res["ttft"] = ttft(a.config, sizes, a.repeats, tiers)
            res["break_even"] = break_even(a.config, tiers, a.repeats)
        finally:
            if cluster is not None:
                cluster.stop()
    res["multiturn"] = multiturn(a.steps)
    res["loadavg_after"] = os.getloadavg()
    print(f"loadavg after: {res['loadavg_after']}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
