"""Soak: thousands of decode steps of ``tiny`` with random new requests, every step checked.

    python benchmarks/soak.py --steps 10000 [--pool-size 128] [--p-new 0.02] [--seed 0] [--json]
    python benchmarks/soak.py --serve --steps 5000        # the serving loop (models/glm/serve.py)

Two copies of the GLM-5.2 ``tiny`` preset (offload layout: selection buffers + gather ledger): the
unmodified one runs eager (the gather path), the other through ``torch.compile`` with the offload
backend. Every step both get the same random tokens. Per step and row, with probability ``--p-new``
(and always when the row's cache is full), the row starts a new request with a random prompt length:
both models prefill that row (``model.prefill(rows=[b])``: caches and gather ledger reset); half of
these are *announced* (``offload_state.reset(rows=[b])``), half are *unannounced* (only the model's own
reset: the rewritten graph must detect them itself).

After every step: the logits of the two models are compared (``max |diff|``, must be 0: the rewrite is
bit-exact here) and the pool invariants of docs/ops.md §8.4 (pool_ids / id_to_slot inverse, set of
each slot, no duplicate id, 0 <= lru <= 15) and §8.5 (pool rows == full-cache rows, bitwise) are
checked on every group; each failing check counts as one violation. Prints steps, steps/s, max diff,
hit rate, new requests (announced / unannounced), violations and RSS growth (VmRSS after the first
100 steps vs at the end).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from offload_passes._cli import ArgumentParser, int_arg


def _rss_kib() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:  # pragma: no cover - not Linux
        pass
    return 0


def pool_violations(state: Any, full_of: Any) -> list[str]:
    """docs/ops.md §8.4 / §8.5 on every group of ``state``; ``full_of(layer) -> (kv [B,F,Dkv], rope [B,F,Dr])``."""
    bad: list[str] = []
    for g in state.groups:
        pid, i2s, lru = g.pool_ids, g.id_to_slot, g.lru_counter
        B, PS = pid.shape
        NS = PS // 16
        if int(lru.min()) < 0 or int(lru.max()) > 15:
            bad.append(f"group {g.group_id}: lru_counter outside [0, 15]")
        for b in range(B):
            slots = torch.nonzero(pid[b] >= 0).flatten()
            xs = pid[b, slots].long()
            if xs.unique().numel() != xs.numel():
                bad.append(f"group {g.group_id} row {b}: an id is resident twice")
            if not torch.equal(i2s[b, xs].long(), slots):
                bad.append(f"group {g.group_id} row {b}: pool_ids -> id_to_slot not inverse")
            back = torch.nonzero(i2s[b] >= 0).flatten()
            if not torch.equal(pid[b, i2s[b, back].long()].long(), back):
                bad.append(f"group {g.group_id} row {b}: id_to_slot -> pool_ids not inverse")
            if not torch.equal(slots // 16, xs & (NS - 1)):
                bad.append(f"group {g.group_id} row {b}: a slot outside its id's set")
            for l in g.layers:
                kv, rope = state.pools[l]
                fk, fr = full_of(l)
                if not (torch.equal(kv[b, slots], fk[b, xs]) and torch.equal(rope[b, slots], fr[b, xs])):
                    bad.append(f"group {g.group_id} row {b}: pool of layer {l} differs from the full cache")
    return bad


REFILLS = ("random_length", "same_length", "eager_step_between")


def run(steps: int = 10000, pool_size: int = 128, p_new: float = 0.02, seed: int = 0, min_prompt: int = 16,
        max_prompt: int = 300, log_every: int = 0, rss_after: int = 100, max_seconds: float = 0.0,
        bookkeeping: bool = True) -> dict:
    """``max_seconds`` > 0: stop after that wall time (the figures then cover the steps done).
    ``bookkeeping=False``: the rewrite keeps no gather ledger (the NPU modes' default), so new requests
    are seen through the caches' version counters and the length window only (docs/new-requests.md).
    A new request re-fills its row by one of :data:`REFILLS`: a random prompt length, a prompt exactly as
    long as the row's current length (a continuation by length alone), or a random length followed by
    one decode step of both models through the unmodified module (the eager gather rewrites the ledger)."""
    from offload_passes import make_offload_backend, models
    from offload_passes.state import module_state

    torch.manual_seed(seed)
    over = dict(enable_offload=True, decode_steps=1)
    base, comp = models.build("tiny", **over), models.build("tiny", **over)
    bm, cm = base.model, comp.model
    B, S = cm.batch_size, cm.seq_per_step
    cap = cm.block_table.size(1) * cm.block_size
    V = cm.config.vocab_size
    backend = make_offload_backend(pool_size=pool_size, update_ledger=bookkeeping)
    step_fn = torch.compile(cm, backend=backend)
    g = torch.Generator().manual_seed(seed)

    def rand_int(lo: int, hi: int) -> int:  # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    def new_request(b: int, n: int = 0) -> int:
        n = n or rand_int(min_prompt, max_prompt)
        prompt = torch.randint(0, V, (1, n), generator=g)
        for m in (bm, cm):
            m.prefill(prompt, torch.tensor([n]), rows=[b])
        return n

    with torch.no_grad():
        cur = torch.tensor([new_request(b) for b in range(B)], dtype=torch.int64)
    announced = unannounced = 0
    by_path = {k: 0 for k in REFILLS}
    max_diff = 0.0
    violations: list[str] = []
    n_viol = 0
    rss0 = rss_mid = _rss_kib()
    t0 = time.perf_counter()
    t_steady = None

    def full_of(l: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = cm.model.layers[l].self_attn
        return a.kv_cache.view(B, -1, a.kv_cache.size(-1)), a.k_rope_cache.view(B, -1, a.k_rope_cache.size(-1))

    done = 0
    with torch.no_grad():
        for i in range(steps):
            if max_seconds and time.perf_counter() - t0 > max_seconds:
                break
            done = i + 1
            if i:  # new requests: random rows, and rows whose cache is full
                eager_step = False
                for b in range(B):
                    if cur[b] + S > cap or float(torch.rand((), generator=g)) < p_new:
                        path = REFILLS[rand_int(0, len(REFILLS) - 1)]
                        if path == "same_length" and min_prompt <= int(cur[b]) <= max_prompt:
                            cur[b] = new_request(b, int(cur[b]))
                        else:
                            path = "random_length" if path == "same_length" else path
                            cur[b] = new_request(b)
                        by_path[path] += 1
                        eager_step = eager_step or path == "eager_step_between"
                        if rand_int(0, 1):
                            module_state(cm).reset(rows=[b])
                            announced += 1
                        else:
                            unannounced += 1
                if eager_step and bool((cur + 2 * S <= cap).all()):  # one step of both through the unmodified module
                    ids = torch.randint(0, V, (B, S), generator=g)
                    pos = cur.unsqueeze(1) + torch.arange(S)
                    e0, e1 = bm(ids, pos), cm(ids, pos)
                    max_diff = max(max_diff, float((e0.float() - e1.float()).abs().max()))
                    cur += S
            ids = torch.randint(0, V, (B, S), generator=g)
            pos = cur.unsqueeze(1) + torch.arange(S)
            y0 = bm(ids, pos)
            y1 = step_fn(ids, pos)
            cur += S
            d = float((y0.float() - y1.float()).abs().max())
            max_diff = max(max_diff, d)
            bad = pool_violations(module_state(cm), full_of)
            n_viol += len(bad)
            violations.extend(f"step {i}: {m}" for m in bad[: max(0, 20 - len(violations))])
            if i + 1 == rss_after:
                rss_mid = _rss_kib()
                t_steady = time.perf_counter()
            if log_every and (i + 1) % log_every == 0:
                print(f"  step {i + 1}: max diff {max_diff:g}, violations {n_viol}, rss {_rss_kib() / 1024:.1f} MiB",
                      file=sys.stderr, flush=True)
    t1 = time.perf_counter()
    st = module_state(cm)
    tot = st.totals()
    rss1 = _rss_kib()
    steady = done - rss_after if t_steady is not None else done
    return {
        "steps": done, "steps_requested": steps, "B": B, "S": S, "pool_size": pool_size, "p_new": p_new, "seed": seed,
        "max_abs_diff_logits": max_diff,
        "hits": tot["hits"], "misses": tot["misses"], "window": tot["window"],
        "hit_rate": tot["hits"] / (tot["hits"] + tot["misses"]) if tot["hits"] + tot["misses"] else 0.0,
        "new_requests": {"announced": announced, "unannounced": unannounced, "by_path": by_path},
        "bookkeeping": bookkeeping,
        "invariant_violations": n_viol, "violation_examples": violations,
        "graphs_compiled": len(backend.reports), "rewritten": bool(backend.reports and backend.reports[-1]["rewritten"]),
        "rss_mib": {"start": rss0 / 1024, "after_warmup": rss_mid / 1024, "end": rss1 / 1024,
                    "growth_after_warmup": (rss1 - rss_mid) / 1024},
        "seconds": t1 - t0,
        "steps_per_s": steady / (t1 - t_steady) if t_steady is not None and t1 > t_steady else done / (t1 - t0),
    }


def summary(o: dict) -> str:
    n = o["new_requests"]
    return "\n".join([
        f"soak: tiny, {o['steps']} decode steps (of {o['steps_requested']} requested), B={o['B']} S={o['S']} pool={o['pool_size']} p_new={o['p_new']} "
        f"seed={o['seed']}",
        f"  max |diff| logits vs unmodified model: {o['max_abs_diff_logits']:g}",
        f"  hit rate {o['hit_rate']:.1%}  (hits {o['hits']}, misses {o['misses']}, window {o['window']})",
        f"  new requests: {n['announced']} announced, {n['unannounced']} unannounced (model reset only); "
        f"by re-fill path {n.get('by_path')}; gather ledger kept: {o.get('bookkeeping')}",
        f"  invariant violations (docs/ops.md §8.4-8.5, every step): {o['invariant_violations']}",
        f"  RSS: {o['rss_mib']['after_warmup']:.1f} MiB after warm-up -> {o['rss_mib']['end']:.1f} MiB at the end "
        f"(growth {o['rss_mib']['growth_after_warmup']:+.1f} MiB)",
        f"  {o['seconds']:.0f} s, {o['steps_per_s']:.1f} steps/s; graphs compiled: {o['graphs_compiled']}",
    ] + [f"  {v}" for v in o["violation_examples"][:5]])


def serve_main(a: argparse.Namespace) -> int:
    """``--serve``: ``offload_passes.apps.serve.run_serve`` with a lane told nothing beside the announcing one,
    memory sampled as the static soak does."""
    from offload_passes._cli import UsageError
    from offload_passes.apps.demo import check_arrival, parse_buckets
    from offload_passes.apps.serve import run_serve

    try:
        buckets = parse_buckets(a.buckets, 4)
        check_arrival(a.arrival)
    except UsageError as e:
        print(f"soak: error: {e}", file=sys.stderr)
        return 2

    torch.set_num_threads(a.threads)
    rss = {"start": _rss_kib(), "after_warmup": 0}
    rss_after = min(100, a.steps)

    def on_step(i: int, srv: Any) -> None:
        if i + 1 == rss_after:
            rss["after_warmup"] = _rss_kib()
        if a.log_every and (i + 1) % a.log_every == 0:
            print(f"  step {i + 1}: admitted {srv.next_rid}, rss {_rss_kib() / 1024:.1f} MiB", file=sys.stderr,
                  flush=True)

    out = run_serve("tiny", a.steps, "eager", 256 if a.pool_size == 128 else a.pool_size, next_n=3, batch=4,
                    seed=a.seed, threads=a.threads, unannounced=True, on_step=on_step, max_seconds=a.max_seconds,
                    buckets=buckets, arrival=a.arrival, update_ledger=a.bookkeeping == "on")
    end = _rss_kib()
    out["rss_mib"] = {"start": rss["start"] / 1024, "after_warmup": rss["after_warmup"] / 1024, "end": end / 1024,
                      "growth_after_warmup": (end - rss["after_warmup"]) / 1024}
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        u = out.get("unannounced", {})
        st = out.get("static", {})
        print("\n".join([
            f"soak --serve: tiny, {out['steps']} decode steps (of {out['steps_requested']} requested), B={out['B']} "
            f"S={out['S']} pool={out['pool_size']} seed={a.seed} update_ledger={a.bookkeeping == 'on'}; "
            f"{out['requests_admitted']} requests, "
            f"batch changed on {out['batch_changes']} steps",
            f"  max |diff| logits vs unmodified model: announcing {out['max_abs_diff']:g}, told nothing "
            f"{u.get('max_abs_diff', float('nan')):g}",
            f"  hit rate: announcing {out['hit_rate']:.2%}, told nothing {u.get('hit_rate', float('nan')):.2%}, "
            f"same requests in a static batch {st.get('hit_rate', float('nan')):.2%}",
            f"  served / static hits {out.get('hit_ratio_vs_static', float('nan')):.4f} "
            f"({out.get('hit_rate_points_vs_static', float('nan')):+.2f} points)",
            *([f"  steps per batch bucket: {out['buckets']} (arrival {a.arrival})"] if out.get("buckets") else []),
            f"  RSS: {out['rss_mib']['start']:.1f} MiB at the start, {out['rss_mib']['after_warmup']:.1f} MiB after "
            f"warm-up -> {out['rss_mib']['end']:.1f} MiB at the end (growth {out['rss_mib']['growth_after_warmup']:+.1f} "
            f"MiB); {out['run_s']:.0f} s, {out['steps'] / max(out['run_s'], 1e-9):.2f} steps/s",
        ]))
    ok = out["max_abs_diff"] == 0 and out.get("unannounced", {}).get("max_abs_diff", 0) == 0
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="soak.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int_arg("--steps", 1), default=10000)
    p.add_argument("--pool-size", type=int_arg("--pool-size", 16), default=128,
                   help="pool slots per row (small: evictions every step)")
    p.add_argument("--p-new", type=float, default=0.02, help="per row and step: probability of a new request")
    p.add_argument("--seed", type=int_arg("--seed", 0), default=0)
    p.add_argument("--threads", type=int_arg("--threads", 1), default=1)
    p.add_argument("--log-every", type=int_arg("--log-every", 0), default=0,
                   help="progress line on stderr every N steps")
    p.add_argument("--max-seconds", type=float, default=0.0, help="stop after this wall time (0: no limit)")
    p.add_argument("--bookkeeping", choices=("on", "off"), default="on",
                   help="off: no gather ledger in the rewrite (update_ledger=False, the NPU modes' default); "
                        "--serve too")
    p.add_argument("--serve", action="store_true",
                   help="the serving loop instead (models/glm/serve.py: continuous batching on paged KV, "
                        "B=4 rows per rank, MTP next_n=3 with varying acceptance, a C++ KV transfer); compares "
                        "with the same requests in a static batch, in one run")
    p.add_argument("--buckets", default="", metavar="B1,B2",
                   help="--serve: batch buckets, e.g. 2,4 (one graph per batch size over the same caches)")
    p.add_argument("--arrival", type=float, default=1.0,
                   help="--serve: probability that a request waits when a row frees (1: the batch stays full)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.serve:
        return serve_main(a)
    if not 0.0 <= a.p_new <= 1.0:
        p.error("--p-new must be in [0, 1]")
    torch.set_num_threads(a.threads)
    out = run(a.steps, a.pool_size, a.p_new, a.seed, log_every=a.log_every, rss_after=min(100, a.steps),
              max_seconds=a.max_seconds, bookkeeping=a.bookkeeping == "on")
    print(json.dumps(out, indent=1) if a.json else summary(out))
    return 0 if out["max_abs_diff_logits"] == 0 and out["invariant_violations"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
