"""generate()'s default cache (a ``DynamicCache``) under the compiled-forward form, ``model.forward =
torch.compile(model.forward, backend=...)`` with nothing fixed by the user: the decode graph reads a cache grown
by ``torch.cat`` at every step. The graph keeps the cache length symbolic (one decode graph serves every length),
the pools follow the ``cat`` outputs from step to step and go cold when the cache handed in is not exactly the
one the last step returned. Bit-identical to the unmodified bf16 model; the NPU modes, which bind the state to
the graph, refuse its offload by name (``dynamic_cache``) and keep the sparse attention."""
import re
import warnings

import pytest
import torch

from offload_passes import _compat
from offload_passes.backend import OffloadRefused, OffloadWarning, _recompile_limit_message, make_offload_backend
from offload_passes.decorator import static_cache_state
from offload_passes.options import OffloadOptions
from offload_passes.pipeline import rewrite_for_offload

import traffic

#: docs/hf.md, "A server's traffic": graphs compiled by 100 varied calls of the forward form on generate()'s
#: defaults (batch 1-3, prompt 40-190, 4 new tokens), the same number as Dynamo compiles for this traffic with
#: a backend that changes nothing: prefill {first shape, dynamic length, batch 2, dynamic batch}, decode {first
#: shape, dynamic length, batch 2, batch 3} (the offload keeps one decode graph per batch size)
COMPILES_PER_100_CALLS = 8


@pytest.fixture(scope="module")
def refs():
    return {"float32": traffic.model("float32"), "bfloat16": traffic.model("bfloat16")}


def test_100_varied_calls_on_the_default_cache_are_all_offloaded_at_dynamos_own_compile_count(refs):
    calls = traffic.traffic(100, seed=7, shortest=40)
    assert {B for B, _ in calls} == {1, 2, 3} and min(L for _, L in calls) + traffic.NEW - 1 < traffic.K
    with torch._dynamo.config.patch(recompile_limit=8):
        floor = traffic.dynamo_compiles(calls)
        run = traffic.run("forward", "default", calls, refs)
    assert all(c.checked for c in run.calls)
    assert run.same_tokens == 100  # the bf16 unmodified model's tokens in every call
    run.check_errors()
    assert [c.cache_len for c in run.calls] == [L + traffic.NEW - 1 for _, L in calls]
    # every call offloaded on its own cache, the caches no longer than the top-k too (served whole by the pool)
    assert all(c.hits > 0 for c in run.calls)
    assert run.compiles == floor == COMPILES_PER_100_CALLS
    # the 8th compile reaches the limit: said once, and nothing more is compiled, nothing falls back
    assert len(run.warnings) == 1 and re.match(
        r"graph_\d+: Dynamo's recompile_limit \(8\) is reached for this frame \(compile #8\)", run.warnings[0])


class _Steps:
    """A bf16 reference model and the compiled one, stepped in lockstep on a DynamicCache each."""

    def __init__(self, B: int = 2, L: int = 90):
        torch._dynamo.reset()
        from transformers import DynamicCache

        self.ref, m = traffic.model(), traffic.model()
        self.backend = make_offload_backend(pool_size=1024)
        self.fwd = torch.compile(m.forward, backend=self.backend)
        self.kw = _compat.hf_cache_kwarg()
        self.ids, self.mask = traffic.prompt(B, L, 3)
        self.caches = DynamicCache(config=self.ref.config), DynamicCache(config=m.config)
        self.tok = self.ids

    def step(self) -> tuple[int, int]:
        """One call of both; asserts the logits bit-identical; returns the pools' (hits, misses) so far."""
        if self.tok is not self.ids:
            self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], 1)
        r = self.ref(input_ids=self.tok, attention_mask=self.mask, use_cache=True, **{self.kw: self.caches[0]})
        o = self.fwd(input_ids=self.tok, attention_mask=self.mask, use_cache=True, **{self.kw: self.caches[1]})
        assert torch.equal(r.logits, o.logits)
        self.tok = r.logits[:, -1].argmax(-1, keepdim=True)
        if self.caches[1].get_seq_length() == self.ids.shape[1]:
            return 0, 0  # the prefill: no pools yet
        t = static_cache_state(self.caches[1]).totals()
        return t["hits"], t["misses"]


def test_the_pools_follow_the_cache_the_step_returned_and_nothing_else():
    """A decode step finds the pools by the tensors the last step returned, unwritten since: a cache replaced by
    an edited copy, edited in place or cut is served cold (misses only), and exactly."""
    s = _Steps()
    s.step()  # the prefill
    assert s.step()[0] == 0  # a new cache: cold
    warm = [s.step() for _ in range(2)]
    assert 0 < warm[0][0] < warm[1][0]  # the same pools, warm, step after step
    for c in s.caches:  # an edited copy of layer 0's latent cache
        k = c.layers[0].keys.clone()
        k[:, :, 10:40] *= -1
        c.layers[0].keys = k
    assert s.step()[0] == 0  # other tensors: new pools, cold
    hits = s.step()[0]
    assert hits > 0
    for c in s.caches:  # written in place: the same tensor, a new version
        c.layers[1].keys[:, :, 5:50].mul_(-1)
    assert s.step()[0] == hits  # the same pools, reset cold: no new hit
    hits = s.step()[0]
    assert hits > 0
    n = s.caches[1].get_seq_length() - 3
    for c in s.caches:  # cut by 3 rows (assisted decoding's crop): a view of fewer rows
        c.crop(-3)
    s.mask = s.mask[:, :n]
    assert s.step()[0] == 0  # new pools, cold: the positions past the cut are written again
    assert s.step()[0] > 0


def _decode_graph():
    """The first decode graph of generate() on a DynamicCache, as Dynamo hands it to a backend."""
    torch._dynamo.reset()
    got = []

    def capture(gm, ex):
        if not got and ex[0].shape[-1] == 1:
            got.append((gm, ex))
        return gm.forward

    m = traffic.model()
    m.forward = torch.compile(m.forward, backend=capture)
    ids, mask = traffic.prompt(2, 90, 4)
    m.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    return got[0]


@pytest.mark.parametrize("mode", ["ge_graph", "npugraph_ex", "cuda"])
def test_the_graph_bound_modes_refuse_a_grown_cache_by_name(mode):
    """The NPU and CUDA lowerings bind the offload state to the graph: a cache whose tensors are new at every
    step cannot be followed there. The core passes (what the lowering would receive) refuse the offload by name,
    with the remedy, and keep the sparse attention."""
    gm, ex = _decode_graph()
    _, state, rep = rewrite_for_offload(gm, ex, OffloadOptions(exe_mode=mode, pool_size=1024))
    assert state is None  # no offload; the sparse attention is kept (as for any offload refusal of the HF form)
    reasons = rep.to_dict()["groups"][0]["offload_refusals"]
    assert [s["sfa_node"] for s in rep.to_dict()["sites"]] == ["hf_sparse_attention", "hf_sparse_attention_1"]
    assert [r["reason"] for r in reasons] == ["dynamic_cache"] * 2  # layers 0 and 1
    assert (f"(a DynamicCache, generate()'s default): exe_mode {mode!r} binds its offload state to the graph, "
            "which cannot follow a cache whose tensors are new at every step; the CPU modes follow it"
            ) in reasons[0]["detail"]
    gm, ex = _decode_graph()
    with pytest.raises(OffloadRefused, match="dynamic_cache"):
        rewrite_for_offload(gm, ex, OffloadOptions(exe_mode=mode, pool_size=1024, strict=True))


def test_a_cache_past_the_id_range_is_refused_by_name():
    """The pools of a grown cache hold ids up to a fixed id range (option ``id_range``): a longer cache is refused
    ``id_range`` (sparse attention kept), a shorter one offloaded; Dynamo guards the length on that bound."""
    gm, ex = _decode_graph()  # a cache of 91 positions
    _, state, rep = rewrite_for_offload(gm, ex, OffloadOptions(pool_size=1024, id_range=64))
    refusals = rep.to_dict()["groups"][0]["offload_refusals"]
    assert state is None and [r["reason"] for r in refusals] == ["id_range"] * 2
    assert refusals[0]["detail"] == ("keys: a cache of 91 positions is past the id range 64 the pools can hold "
                                     "(option id_range, at most 1409024)")
    gm, ex = _decode_graph()
    _, state, rep = rewrite_for_offload(gm, ex, OffloadOptions(pool_size=1024, id_range=128))
    assert state is not None and state.id_range == 128 and rep.to_dict()["groups"][0]["offload"]


def test_strict_compiles_the_default_cache_without_a_refusal_a_one_token_prompt_too():
    torch._dynamo.reset()
    ref, m = traffic.model(), traffic.model()
    be = make_offload_backend(pool_size=1024, strict=True)
    m.forward = torch.compile(m.forward, backend=be)
    ids, mask = traffic.prompt(1, 72, 2)
    kw = dict(max_new_tokens=traffic.NEW, do_sample=False, pad_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OffloadWarning)
        out = m.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(out, ref.generate(ids, attention_mask=mask, **kw))
    decode = [r for r in be.reports if r["rewritten"]]
    assert decode and all(s["cache"] == "grown" for r in decode for s in r["hf"]["sites"])
    assert all(g["offload"] for r in decode for g in r["groups"])
    # a one-token prompt (generate() with no input starts from BOS): its prefill, a cache grown from nothing,
    # is dense by its size, no refusal; the decode past the top-k is offloaded
    one = torch.tensor([[5]])
    kw["max_new_tokens"] = 70
    with warnings.catch_warnings():
        warnings.simplefilter("error", OffloadWarning)
        out = m.generate(one, attention_mask=torch.ones_like(one), **kw)
    assert torch.equal(out, ref.generate(one, attention_mask=torch.ones_like(one), **kw))


def test_recompile_limit_warning_points_a_hf_user_at_offload():
    frame = {"recompile_limit": 8, "frame_compile_id": 7, "models": 1}
    hf_msg = _recompile_limit_message("graph_007", frame, hf=True)
    assert hf_msg.startswith("graph_007: Dynamo's recompile_limit (8) is reached for this frame (compile #8)")
    assert "For a Hugging Face model use offload(model).generate(...): it supplies a StaticCache of bucketed " \
           "lengths" in hf_msg
    assert "offload(model)" not in _recompile_limit_message("graph_007", frame, hf=False)


def test_beam_search_on_the_default_cache_stays_exact_and_warm():
    """Beam search reorders the grown cache after every step (new tensors by index_select): the pools follow the
    reorder (hf_reorder) and the growth, so the search keeps its pools, and its sequences are the unmodified
    model's."""
    torch._dynamo.reset()
    ref, m = traffic.model(), traffic.model()
    m.forward = torch.compile(m.forward, backend=make_offload_backend(pool_size=1024))
    for B, L, beams in ((1, 90, 2), (2, 80, 3)):
        ids, mask = traffic.prompt(B, L, 5)
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, num_beams=beams, return_dict_in_generate=True)
        out = m.generate(ids, attention_mask=mask, **kw)
        assert torch.equal(out.sequences, ref.generate(ids, attention_mask=mask, **kw).sequences)
        t = static_cache_state(out).totals()
        assert t["hits"] > t["misses"] > 0  # five decode steps on one lineage of pools: mostly hits
