"""``offload(model)`` under a chat server's traffic (offload_passes/hf_generate.py): ``generate()`` with its
defaults, prompt lengths and batch sizes varying call to call, at Dynamo's default ``recompile_limit`` (8).
Every call gives the unmodified model's tokens (bf16_check against the fp32 and bf16 unmodified models) and is
offloaded on its own cache wherever the cache is longer than the top-k; the graphs compiled are the distinct
(batch, cache length bucket) pairs, the count docs/hf.md states."""
import warnings

import pytest
import torch
from torch import nn

from offload_passes import _compat
from offload_passes.backend import OffloadWarning
from offload_passes.decorator import offload, static_cache_state
from offload_passes.hf_generate import MIN_CACHE_LEN, bucket_cache_len, check_cache_len_buckets

import traffic
from traffic import NEW

#: docs/hf.md, "A server's traffic": graphs compiled by 100 varied calls (batch 1-3, prompt 62-190, 4 new
#: tokens): one per (batch, cache length bucket) = 3 x {128, 256}
GRAPHS_PER_100_CALLS = 6


@pytest.fixture(scope="module")
def refs():
    return {"float32": traffic.model("float32"), "bfloat16": traffic.model("bfloat16")}


def test_cache_length_buckets():
    assert [bucket_cache_len(n) for n in (1, 63, 64, 65, 128, 129, 193, 4097)] == [64, 64, 64, 128, 128, 256, 256,
                                                                                   8192]
    assert MIN_CACHE_LEN == 64
    b = check_cache_len_buckets([100, 300])
    assert b == (100, 300)
    assert [bucket_cache_len(n, b) for n in (1, 100, 101, 300, 301, 601)] == [100, 100, 300, 300, 600, 900]
    with pytest.raises(ValueError, match="bucket_cache_len: n must be >= 1, got 0"):
        bucket_cache_len(0)


@pytest.mark.parametrize("value, err, msg", [
    ("256", TypeError, "offload: cache_len_buckets must be None or a sequence of ints, got str"),
    (256, TypeError, "offload: cache_len_buckets must be None or a sequence of ints, got int"),
    ([64, 1.5], TypeError, r"offload: cache_len_buckets must hold ints, got 1.5 \(float\)"),
    ([True], TypeError, r"offload: cache_len_buckets must hold ints, got True \(bool\)"),
    ([], ValueError, "offload: cache_len_buckets must not be empty"),
    ([0, 64], ValueError, r"offload: cache_len_buckets must be strictly increasing ints >= 1, got \[0, 64\]"),
    ([128, 64], ValueError, r"strictly increasing ints >= 1, got \[128, 64\]"),
    ([64, 64], ValueError, r"strictly increasing ints >= 1, got \[64, 64\]"),
])
def test_bad_cache_len_buckets_are_refused_naming_the_argument(value, err, msg):
    m = nn.Linear(2, 2)
    with pytest.raises(err, match=msg):
        offload(m, cache_len_buckets=value)
    with pytest.raises(err, match=msg):
        offload(cache_len_buckets=value)
    assert not hasattr(m, "offload_backend") and "forward" not in m.__dict__  # a refused call changes nothing


def test_bad_host_kv_is_refused_naming_the_argument():
    with pytest.raises(TypeError, match="offload: host_kv must be a bool, got str"):
        offload(nn.Linear(2, 2), host_kv="yes")


def test_100_varied_calls_all_offloaded_with_one_graph_per_batch_and_bucket(refs):
    """100 calls, generate()'s defaults, recompile_limit 8: every call gives the unmodified model's tokens and
    has pool hits on its own cache (every prompt reaches the pool: its cache is longer than K), and one graph is
    compiled per (batch, cache length bucket)."""
    calls = traffic.traffic(100, seed=7, shortest=62)
    with torch._dynamo.config.patch(recompile_limit=8), warnings.catch_warnings():
        warnings.simplefilter("error", OffloadWarning)  # no refusal, no recompile limit on the way
        run = traffic.run("offload", "default", calls, refs)
    assert all(c.checked for c in run.calls)
    run.check_errors()
    assert [c.cache_len for c in run.calls] == [bucket_cache_len(L + NEW - 1) for _, L in calls]
    assert all(c.hits > 0 for c in run.calls) and run.offloaded == run.reaching == 100
    keys = {(B, bucket_cache_len(L + NEW - 1)) for B, L in calls}
    assert run.compiles == len(keys) == GRAPHS_PER_100_CALLS


def test_a_user_cache_and_cache_implementation_are_honoured(refs):
    """cache_implementation="static": HF's own StaticCache (its max_cache_len, never shrinking), each (batch,
    length) compiled once under its own budget; a StaticCache passed by the caller is used as given."""
    from transformers import StaticCache

    calls = [(2, 100), (1, 60), (2, 130)]
    with torch._dynamo.config.patch(recompile_limit=8), warnings.catch_warnings():
        warnings.simplefilter("error", OffloadWarning)
        run = traffic.run("offload", "static", calls, refs)
    assert all(c.checked for c in run.calls)
    assert [c.cache_len for c in run.calls] == [103, 103, 133]  # HF: the largest prompt + NEW - 1 so far
    assert all(c.hits > 0 for c in run.calls) and run.compiles == 3  # (2, 103), (1, 103), (2, 133)

    m = offload(traffic.model(), pool_size=1024)
    ids, mask = traffic.prompt(2, 90, 5)
    cache = StaticCache(config=m.module.config, max_cache_len=100)
    out = m.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                     return_dict_in_generate=True, **{_compat.hf_cache_kwarg(): cache})
    assert m.offload_router.supplied == 0 and static_cache_state(cache).totals()["hits"] > 0
    assert "forward" not in m.module.__dict__ and "_prepare_cache_for_generation" not in m.module.__dict__


def test_host_kv_supplies_a_host_static_cache(refs):
    """host_kv=True: the supplied cache is a HostStaticCache of the bucketed length, allocated at construction
    (batch, device, dtype), offloaded and checked as the StaticCache is."""
    from offload_passes.hf_cache import HostStaticCache

    m = offload(traffic.model(), pool_size=1024, host_kv=True)
    ids, mask = traffic.prompt(2, 90, 11)
    kw = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    out = m.generate(ids, attention_mask=mask, **kw)
    cache = getattr(out, _compat.hf_cache_kwarg())
    assert type(cache) is HostStaticCache and {layer.max_cache_len for layer in cache.layers} == {128}
    assert static_cache_state(cache).totals()["hits"] > 0 and m.offload_router.supplied == 1
    r32 = refs["float32"].generate(ids, attention_mask=mask, **kw)
    r16 = refs["bfloat16"].generate(ids, attention_mask=mask, **kw)
    traffic.bf16_check(r32.sequences[:, 90:], r32.scores, r16.scores, out.sequences[:, 90:], out.scores,
                       factor=float("inf"))


def test_the_supplied_cache_is_kept_per_shape_and_reset_for_the_next_call(refs):
    """One cache per (rows, bucket): a second call of a shape gets the first call's cache, reset (its tensors the
    same objects, so the decode graph is not compiled again), and its tokens are still the unmodified model's."""
    calls = [(2, 100), (1, 90), (2, 70), (2, 150)]
    with torch._dynamo.config.patch(recompile_limit=8), warnings.catch_warnings():
        warnings.simplefilter("error", OffloadWarning)
        run = traffic.run("offload", "default", calls, refs)
    assert all(c.checked for c in run.calls) and all(c.hits > 0 for c in run.calls)
    assert run.compiles == 3  # (2, 128), (1, 128), (2, 256)

    m = offload(traffic.model(), pool_size=1024)
    kw = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    outs = []
    for B, L, seed in ((2, 100, 1), (2, 70, 2)):
        ids, mask = traffic.prompt(B, L, seed)
        outs.append(m.generate(ids, attention_mask=mask, **kw))
        assert outs[-1].past_key_values.get_seq_length() == L + NEW - 1
    first, second = (o.past_key_values for o in outs)
    assert first is second and m.offload_router.supplied == 2 and len(m.offload_router._caches) == 1
    assert m.offload_router.compiled == 1
