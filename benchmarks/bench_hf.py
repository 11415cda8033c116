"""Decode-step time of the unmodified HF GLM-5 DSA model vs the same model compiled with the backend,
at several context lengths, measured in one run (``hf-glm5-attn``: GLM-5's real attention dimensions,
narrow elsewhere).

    python benchmarks/bench_hf.py                          # 4K, 16K, 32K; bf16; sdpa
    python benchmarks/bench_hf.py --contexts 4096 --steps 2 --json
    python benchmarks/bench_hf.py --generate --contexts 4096 16384   # generate() decode tokens/s
    python benchmarks/bench_hf.py --generate --synthetic-context --contexts 16384   # no dense prefill

``--generate``: the user's own loop, ``model.generate(prompt of T tokens, max_new_tokens=steps + 2,
cache_implementation="static", greedy)``, unmodified vs ``compile_config=offload_compile_config()`` (the
decode step compiled with the backend, sparse + offload; HF runs the prefill eagerly in both). Tokens/s
of the decode steps: a logits processor timestamps every step, the prefill's token and the first
compiled step (it compiles) are left out.

``--generate --synthetic-context``: the same decode tokens/s over a synthetic context instead of a dense
prefill (which at 16K needs the unmodified indexer's T x T x 32 fp32 scores, 34 GB). Each model gets its own
``StaticCache`` (B = 1, ``max_cache_len`` = T + steps + 1, what HF would allocate) whose first T - 1 rows are
filled by ``HfDecoder.synthetic_context`` with the same seed, so both models start from identical caches; then
``generate(input_ids=<T tokens>, cache=cache, ...)`` (``past_key_values=`` up to transformers 5.23): HF sees T - 1 cached tokens and runs only the
last prompt token (eagerly) before decoding. Prefill is not timed; the decode steps are timed as above.

The dense model expands the whole latent cache through kv_b_proj and attends over all T positions at
every step (O(T)); the rewritten one gathers / serves K = 2048 rows (O(K)), so the ratio grows with T.
Columns: ``sparse`` = the sparse rewrite alone (``enable_offload=False``), ``offload`` = sparse +
shared-indexer plan / serve / install (pools on the CPU here, so it measures the extra op cost, not
host-link savings). The context is synthetic (``HfDecoder.synthetic_context``): seeded random cache
rows, since the step's cost does not depend on where they came from.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch  # noqa: E402

from offload_passes import _compat  # noqa: E402
from offload_passes.backend import make_offload_backend, offload_compile_config  # noqa: E402
from offload_passes.models import hf  # noqa: E402


def _time_steps(dec, fn, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        dec.step(fn)
        out.append(time.perf_counter() - t0)
    return out


def bench(config: str, contexts: list[int], steps: int, attn: str, dtype: str) -> list[dict]:
    built = hf.build(config, attn=attn, dtype=dtype)
    model = built.model
    rows = []
    for ctx in contexts:
        row: dict = {"context": ctx}
        variants = (("unmodified", None), ("sparse", False), ("offload", True))
        for name, offload in variants:
            torch._dynamo.reset()
            gc.collect()
            dec = built.decoder(max_cache_len=ctx + steps + 2)
            dec.synthetic_context(ctx)
            if offload is None:
                fn = None
            else:
                backend = make_offload_backend(enable_offload=offload)
                fn = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
            t0 = time.perf_counter()
            dec.step(fn)  # warm-up (compiles the rewritten graph)
            row[f"{name}_first_s"] = time.perf_counter() - t0
            ts = _time_steps(dec, fn, steps)
            row[f"{name}_ms"] = 1e3 * statistics.median(ts)
            if offload is not None:
                rep = backend.reports[-1]
                row[f"{name}_rewritten"] = bool(rep["rewritten"]) and bool(rep["hf"]["offload"]) == offload
                row["K"] = rep["hf"]["sites"][0]["K"]
            del dec, fn
        row["speedup_sparse"] = row["unmodified_ms"] / row["sparse_ms"]
        row["speedup_offload"] = row["unmodified_ms"] / row["offload_ms"]
        rows.append(row)
        print(f"  {ctx:>6}: unmodified {row['unmodified_ms']:9.1f} ms   sparse {row['sparse_ms']:8.1f} ms "
              f"({row['speedup_sparse']:5.1f}x)   sparse+offload {row['offload_ms']:8.1f} ms "
              f"({row['speedup_offload']:5.1f}x)", file=sys.stderr, flush=True)
    return rows


class _Stamps:
    """A logits processor that only records when each step's logits arrive."""

    def __init__(self) -> None:
        self.t: list[float] = []

    def __call__(self, input_ids, scores):
        self.t.append(time.perf_counter())
        return scores


def synthetic_cache(built, context: int, max_cache_len: int, seed: int = 0):
    """A B = 1 ``StaticCache`` that holds ``context`` synthetic tokens (seeded: the same rows for every model
    built from one preset), for ``generate(cache=...)`` (``past_key_values=`` up to transformers 5.23) to continue
    from without a dense prefill."""
    dec = built.decoder(batch_size=1, max_cache_len=max_cache_len)
    dec.synthetic_context(context, seed=seed)
    return dec.cache


def bench_generate(config: str, contexts: list[int], steps: int, attn: str, dtype: str,
                   synthetic: bool = False, **over) -> list[dict]:
    from transformers import LogitsProcessorList

    from offload_passes.decorator import static_cache_state

    built = hf.build(config, attn=attn, dtype=dtype, **over)
    model = built.model
    model.generation_config.eos_token_id = None  # random weights: every call generates all its tokens
    vocab = model.config.vocab_size
    rows = []
    for ctx in contexts:
        row: dict = {"context": ctx, "new_tokens": steps + 2, "synthetic_context": synthetic}
        ids = torch.randint(2, vocab, (1, ctx), generator=torch.Generator().manual_seed(ctx))
        seqs = {}
        for name in ("unmodified", "compiled"):
            torch._dynamo.reset()
            gc.collect()
            kw = {}
            if name == "compiled":
                kw["compile_config"] = cc = offload_compile_config()
            if synthetic:
                # T - 1 cached rows: HF slices the prompt to its uncached last token (generation/utils.py,
                # _prefill: input_ids.shape[1] - cache.get_seq_length()); max_cache_len as HF would size it
                t0 = time.perf_counter()
                kw[_compat.hf_cache_kwarg()] = cache = synthetic_cache(built, ctx - 1, ctx + steps + 1)
                row[f"{name}_fill_s"] = time.perf_counter() - t0
            else:
                kw["cache_implementation"] = "static"
            st = _Stamps()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps + 2,
                                     do_sample=False, pad_token_id=0,
                                     logits_processor=LogitsProcessorList([st]), **kw)
            row[f"{name}_total_s"] = time.perf_counter() - t0
            row[f"{name}_prefill_s"] = st.t[0] - t0
            # st.t[0]: the prefill's token; st.t[1]: the first decode step (compiles); then `steps` timed steps
            row[f"{name}_tok_s"] = steps / (st.t[-1] - st.t[1])
            seqs[name] = out[:, ctx:]
            if name == "compiled":
                rep = cc.backend.reports[-1]
                row["compiled_offload"] = bool(rep["rewritten"]) and bool(rep["hf"]["offload"])
                row["graphs"] = len(cc.backend.reports)
                if synthetic:
                    row["pool"] = static_cache_state(cache).totals()
            kw.clear()
            cache = None  # the next model's cache is allocated after this one's is gone
        row["same_tokens"] = bool(torch.equal(seqs["unmodified"], seqs["compiled"]))
        row["speedup"] = row["compiled_tok_s"] / row["unmodified_tok_s"]
        rows.append(row)
        tag = " (synthetic)" if synthetic else ""
        print(f"  {ctx:>6}{tag}: generate() decode unmodified {row['unmodified_tok_s']:.3f} tok/s, compiled (sparse + "
              f"offload) {row['compiled_tok_s']:.3f} tok/s ({row['speedup']:.1f}x; offload "
              f"{row['compiled_offload']}, same tokens {row['same_tokens']})", file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="hf-glm5-attn")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--steps", type=int, default=3, help="timed decode steps per variant (median)")
    p.add_argument("--attn", choices=("eager", "sdpa"), default="sdpa")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--generate", action="store_true", help="generate() decode tokens/s, unmodified vs compiled")
    p.add_argument("--synthetic-context", action="store_true",
                   help="with --generate: decode tokens/s over a synthetic context (both models continue from "
                        "identical seeded StaticCaches of T - 1 rows; no dense prefill, prefill not timed)")
    a = p.parse_args(argv)
    if a.steps < 1 or any(c < 2 for c in a.contexts):
        p.error("--steps must be >= 1 and every context >= 2")
    if a.synthetic_context and not a.generate:
        p.error("--synthetic-context applies to --generate only (the decode-step table is always synthetic)")
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"bench_hf: {a.config} attn={a.attn} dtype={a.dtype} threads={torch.get_num_threads()} "
          f"steps={a.steps} (median)", file=sys.stderr)
    if a.generate:
        rows = bench_generate(a.config, a.contexts, a.steps, a.attn, a.dtype, synthetic=a.synthetic_context)
        if a.json:
            print(json.dumps(rows, indent=1))
        else:
            ctx = "context T (synthetic)" if a.synthetic_context else "context T"
            print(f"| {ctx} | unmodified tok/s | compiled (sparse + offload) tok/s | speed-up | same tokens |")
            print("|---:|---:|---:|---:|---|")
            for r in rows:
                print(f"| {r['context']} | {r['unmodified_tok_s']:.3f} | {r['compiled_tok_s']:.3f} | "
                      f"{r['speedup']:.1f}x | {r['same_tokens']} |")
        return 0
    rows = bench(a.config, a.contexts, a.steps, a.attn, a.dtype)
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        print("| context | unmodified ms/step | sparse ms/step | speed-up | sparse + offload ms/step | speed-up |")
        print("|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['context']} | {r['unmodified_ms']:.1f} | {r['sparse_ms']:.1f} | {r['speedup_sparse']:.1f}x "
                  f"| {r['offload_ms']:.1f} | {r['speedup_offload']:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
