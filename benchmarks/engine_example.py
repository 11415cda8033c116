"""An engine's decode loop around a model compiled with the offload backend: the glue an author writes.

    python benchmarks/engine_example.py [--steps 40] [--seed 0]

The engine is shaped like the reference's online executor (cann-recipes-infer ``executor/online``): a
waiting queue, a block pool whose block 0 is the null block (``models/glm/serve.py::BlockPool``, FIFO), up
to ``B`` running requests decoded together, each prompt prefilled on a batch-1 model and its KV blocks
received by a transfer that moves no version counter (``glm_serve::copy_blocks_``). Per step it retires
finished requests, admits waiting ones, writes its block table into the decode model and tells the
offload what changed through ``offload_passes.engine.EngineAdapter.step(rows, written)``: the only glue
the offload needs (docs/new-requests.md, "The engine's contract"). The unmodified model runs the same
schedule beside it (with its own adapter, which keeps its ledgers with their requests: the model's own
requirement); the script prints the pool hit rate and the largest logits difference, and exits 1 if it
is not 0.
"""
from __future__ import annotations

import argparse
import sys
from collections import deque

import torch

from offload_passes import make_offload_backend, models
from offload_passes.engine import EngineAdapter
from offload_passes.models.glm.serve import BlockPool, load_transfer_op, transfer_blocks
from offload_passes.state import module_state

B = 4  # running requests per rank (the reference's 128 global rows on 32 ranks)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    over = dict(enable_offload=True, batch_size=B, next_n=0, pa_max_length=512, prefill_len=64, decode_steps=1)
    ref = models.build("tiny", **over).model  # the unmodified model (same seed: same weights)
    dec = models.build("tiny", **over).model
    pre = models.build("tiny", **dict(over, batch_size=1)).model  # the prefill instance
    step = torch.compile(dec, backend=make_offload_backend(pool_size=256))
    adapters = [EngineAdapter(ref), EngineAdapter(dec)]
    transfer = load_transfer_op()
    pool = BlockPool(dec.model.layers[0].self_attn.kv_cache.size(0))
    BS, maxblk, vocab = dec.block_size, dec.block_table.size(1), dec.config.vocab_size
    g = torch.Generator().manual_seed(a.seed)
    waiting = deque(range(1000))  # request ids; prompts and output lengths are drawn at admission
    running: list[dict] = []
    worst = 0.0
    with torch.no_grad():
        for _ in range(a.steps):
            # the scheduler: retire finished requests (their blocks go back), admit waiting ones
            for r in [r for r in running if r["left"] == 0]:
                pool.give_back(r["blocks"])
                running.remove(r)
            written = set()
            while len(running) < B and waiting:
                P = int(torch.randint(64, 200, (1,), generator=g))
                r = {"rid": waiting.popleft(), "len": P, "left": int(torch.randint(2, 12, (1,), generator=g)),
                     "blocks": pool.take(-(-(P + 16) // BS))}
                pre.prefill(torch.randint(0, vocab, (1, P), generator=g), torch.tensor([P]))
                for m in (ref, dec):  # the KV transfer into the decode caches
                    transfer_blocks(transfer, pre, m, r["blocks"][: -(-P // BS)])
                running.append(r)
                written.add(r["rid"])
            for r in running:  # allocate_slots: a block for the token this step writes
                if r["len"] + 1 > len(r["blocks"]) * BS:
                    r["blocks"] += pool.take(1)
            # the engine's block table and the offload glue, then the decode step
            table = torch.zeros(B, maxblk, dtype=torch.int32)
            for b, r in enumerate(running):
                table[b, : len(r["blocks"])] = torch.tensor(r["blocks"], dtype=torch.int32)
            rows = [r["rid"] for r in running]
            ids = torch.randint(0, vocab, (B, 1), generator=g)
            pos = torch.tensor([[r["len"]] for r in running])
            outs = []
            for m, fn, adapter in ((ref, ref, adapters[0]), (dec, step, adapters[1])):
                m.block_table.copy_(table)
                adapter.step(rows, written)
                outs.append(fn(ids, pos))
            worst = max(worst, (outs[0].float() - outs[1].float()).abs().max().item())
            for r in running:
                r["len"] += 1
                r["left"] -= 1
    t = module_state(dec).totals()
    rate = t["hits"] / max(1, t["hits"] + t["misses"])
    print(f"engine example: {a.steps} steps, B={B}, {adapters[1].batch_changes} batch changes; pool hit rate "
          f"{rate:.1%}; max |logits diff| vs the unmodified model {worst:.3g}")
    return 0 if worst == 0.0 else 1


if __name__ == "__main__":
    sys.exit(main())
