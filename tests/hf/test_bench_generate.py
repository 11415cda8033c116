"""``benchmarks/bench_hf.py --generate --synthetic-context`` on a 2-layer ``hf-tiny``: ``generate()`` continues
from a seeded synthetic ``StaticCache`` (no dense prefill), the unmodified and the compiled model give the same
greedy tokens from identical caches, and the compiled one offloads."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from offload_passes import _compat
from offload_passes.models import hf

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_hf.py"
TINY = dict(num_hidden_layers=2, index_topk_pattern="FS")  # one IndexShare group: one compile, seconds
CTX = 100  # > K = 64: the selection is really sparse
NEW = 4


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_hf_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_synthetic_context_same_tokens_and_offload(bench):
    # eager bf16: the rewritten model's logits equal the unmodified one's (docs/hf.md, tolerances)
    (row,) = bench.bench_generate("hf-tiny", [CTX], NEW - 2, "eager", "bfloat16", synthetic=True, **TINY)
    assert row["synthetic_context"] and row["new_tokens"] == NEW
    assert row["same_tokens"] is True
    assert row["compiled_offload"] is True and row["graphs"] == 1  # the decode graph only: prefill stays eager
    assert row["pool"]["hits"] > 0 and row["pool"]["misses"] > 0  # this call's own cache served the steps
    assert row["unmodified_tok_s"] > 0 and row["compiled_tok_s"] > 0


def test_generate_continues_from_the_synthetic_cache(bench):
    built = hf.build("hf-tiny", attn="eager", dtype="float32", **TINY)
    model = built.model
    model.generation_config.eos_token_id = None
    ids = torch.randint(2, 256, (1, CTX), generator=torch.Generator().manual_seed(5))

    def gen(seed: int):
        cache = bench.synthetic_cache(built, CTX - 1, CTX + NEW - 1, seed=seed)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **{_compat.hf_cache_kwarg(): cache},
                                 max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                                 return_dict_in_generate=True, output_logits=True)
        assert cache.get_seq_length() == CTX + NEW - 1  # HF ran only the uncached last prompt token, then decoded
        return out

    out = gen(0)
    assert out.sequences.shape == (1, CTX + NEW) and torch.equal(out.sequences[:, :CTX], ids)
    # the same continuation written by hand: last prompt token at position CTX - 1 over an identical cache
    cache = bench.synthetic_cache(built, CTX - 1, CTX + NEW - 1, seed=0)
    tok, want = ids[:, -1:], []
    with torch.no_grad():
        for pos in range(CTX - 1, CTX - 1 + NEW):
            logits = model(tok, use_cache=True, position_ids=torch.tensor([[pos]]), **{_compat.hf_cache_kwarg(): cache}).logits
            tok = logits[:, -1:].argmax(-1)
            want.append(tok)
    assert torch.equal(out.sequences[:, CTX:], torch.cat(want, 1))
    # the synthetic rows are what the tokens depend on: another seed, other logits from the first step on
    assert not torch.equal(gen(1).logits[0], out.logits[0])
