"""``generate()``, Hugging Face users' own loop, on the unmodified transformers model compiled with the
backend (``cache_implementation="static"``, greedy), against the same model unmodified: every entry point,
prompts of different lengths, a shared prefix, left padding, a change of batch size, default ``dynamic`` and
``dynamic=False``. Each call checks that the offload engaged on that call's own caches (pool hits > 0) and
that the number of graphs compiled is the bound docs/hf.md states."""
import logging
import warnings

import pytest
import torch
from transformers import CompileConfig

from offload_passes.backend import OffloadWarning, backend_for_options, make_offload_backend, offload_compile_config
from offload_passes.decorator import offload, static_cache_state
from offload_passes.models import hf

from hf_helpers import BF16_FACTOR, bf16_check

OVER = dict(num_hidden_layers=2, index_topk_pattern="FS")  # one IndexShare group of 2 layers, K = 64
NEW = 4  # new tokens: the prefill's, then 3 decode steps (the pool hits from the second one)
FP32_TOL = 1e-4


def _model(dtype: str = "bfloat16", cls=None):
    if cls is None:
        m = hf.build("hf-tiny", dtype=dtype, **OVER).model
    else:  # the @offload class form: same seeded init, the decorated class
        cfg, runner = hf.load_config("hf-tiny", dtype=dtype, **OVER)
        torch.manual_seed(runner.seed)
        m = cls(cfg).to(runner.torch_dtype).eval()
    m.generation_config.eos_token_id = None  # random weights: every call generates NEW tokens
    return m


def _prompt(B: int, L: int, seed: int, pad: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 256, (B, L), generator=g)
    mask = torch.ones_like(ids)
    if pad:  # row 1 left-padded
        ids[1, :pad] = 0
        mask[1, :pad] = 0
    return ids, mask


def _generate(m, ids, mask, **kw):
    return m.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, cache_implementation="static",
                      output_scores=True, return_dict_in_generate=True, pad_token_id=0, **kw)


@pytest.fixture(scope="module")
def refs():
    """The unmodified models (fp32 and bf16), run eagerly."""
    return {"float32": _model("float32"), "bfloat16": _model("bfloat16")}


def _check_call(out, refs, ids, mask, dtype="bfloat16", offload_on=True):
    r32 = _generate(refs["float32"], ids, mask)
    if dtype == "float32":
        assert torch.equal(out.sequences, r32.sequences)
        err = max(float((o - r).abs().max() / r.abs().max()) for o, r in zip(out.scores, r32.scores))
        assert err <= FP32_TOL, err
    else:
        r16 = _generate(refs["bfloat16"], ids, mask)
        bf16_check(r32.sequences[:, ids.shape[1]:], r32.scores, r16.scores, out.sequences[:, ids.shape[1]:],
                   out.scores)
    st = static_cache_state(out)
    if offload_on:
        assert st.groups and st.totals()["hits"] > 0, st.totals() if st.groups else "no offload state"
    return st


def _count(backend):
    return len(backend.reports)


def _kinds(backend, n):
    """(decode graphs rewritten with the offload, prefill graphs dense by design) among the newest n."""
    reps = list(backend.reports)[len(backend.reports) - n:] if n else []
    dec = sum(1 for r in reps if r["rewritten"] and r["hf"]["offload"])
    pre = sum(1 for r in reps if r.get("dense") and r["dense"]["reason"] == "prefill")
    return dec, pre


def test_forward_compiled_growing_prompts_prefix_padding_and_batch(refs):
    """model.forward = torch.compile(model.forward, backend=...), default dynamic: one decode graph per
    (batch, max_cache_len), prefill graphs dense (the first shape, then one dynamic graph per dimension that
    changed: at most 3)."""
    torch._dynamo.reset()
    m = _model()
    be = make_offload_backend(pool_size=1024)
    m.forward = torch.compile(m.forward, backend=be)
    p2 = _prompt(2, 80, 2, pad=5)
    prefix = (torch.cat([p2[0][:, :70], _prompt(2, 6, 3)[0]], 1), torch.cat([p2[1][:, :70], torch.ones(2, 6,
                                                                                     dtype=torch.long)], 1))
    calls = [("first", _prompt(2, 72, 1), (1, 1)),
             ("longer, left-padded", p2, (1, 1)),  # max_cache_len grows: new decode graph; prefill goes dynamic
             ("shares a prefix, shorter", prefix, (0, 0)),  # HF keeps max_cache_len: both graphs reused
             ("batch 1", _prompt(1, 80, 4), (1, 1))]  # new (batch, max_cache_len); prefill dynamic in the batch
    with warnings.catch_warnings():
        warnings.simplefilter("error", OffloadWarning)  # no refusal, no fallback on the way
        for name, (ids, mask), (dec, pre) in calls:
            n0 = _count(be)
            out = _generate(m, ids, mask)
            n = _count(be) - n0
            assert _kinds(be, n) == (dec, pre), (name, _kinds(be, n))
            assert n == dec + pre, name
            _check_call(out, refs, ids, mask)
    rep = [r for r in be.reports if r["rewritten"]][-1]
    assert [g["layers"] for g in rep["groups"]] == [[0, 1]] and rep["hf"]["sites"][0]["K"] == 64


def test_forward_compiled_dynamic_false(refs):
    """dynamic=False: a prefill graph per (batch, prompt length), a decode graph per (batch, max_cache_len)."""
    torch._dynamo.reset()
    m = _model()
    be = make_offload_backend(pool_size=1024)
    m.forward = torch.compile(m.forward, backend=be, dynamic=False)
    for L in (72, 80):
        n0 = _count(be)
        ids, mask = _prompt(2, L, L)
        out = _generate(m, ids, mask)
        assert _kinds(be, _count(be) - n0) == (1, 1) and _count(be) - n0 == 2
        _check_call(out, refs, ids, mask)
        assert not [r for r in be.reports if r.get("specialised")]  # static already: nothing to specialise


def test_compile_config_fp32_exact_and_the_named_backend(refs):
    """generate(compile_config=CompileConfig(backend="dsa_offload")) with HF's defaults (mode
    "reduce-overhead", dynamic None): the decode step compiles, the prefill runs eagerly; fp32: the sparse
    rewrite alone, exact tokens. A second, longer prompt: one more decode graph, no crash."""
    torch._dynamo.reset()
    m = _model("float32")
    cc = CompileConfig(backend="dsa_offload")
    cc._compile_all_devices = True  # HF compiles on accelerators only unless asked (this is a CPU test)
    be = backend_for_options({})
    for L in (72, 80):
        n0 = _count(be)
        ids, mask = _prompt(2, L, 10 + L)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OffloadWarning)  # fp32: "kv_dtype", the sparse rewrite stays
            out = _generate(m, ids, mask, compile_config=cc)
        assert _count(be) - n0 == 1
        rep = be.reports[-1]
        assert rep["rewritten"] and not rep["hf"]["offload"]
        assert {r["reason"] for r in rep["hf"]["offload_refusals"]} == {"kv_dtype"}
        _check_call(out, refs, ids, mask, dtype="float32", offload_on=False)


def test_compile_config_helper_and_what_torch_rejects(refs):
    """offload_compile_config(**options) carries options (mode=None); HF's default mode plus options is torch's
    "Either mode or options" error, and a non-torch mode gets ours, naming what to pass."""
    torch._dynamo.reset()
    m = _model()
    ids, mask = _prompt(2, 72, 20)
    cc = offload_compile_config(pool_size=1024)
    out = _generate(m, ids, mask, compile_config=cc)
    assert len(cc.backend.reports) == 1 and cc.backend.reports[0]["hf"]["offload"]
    _check_call(out, refs, ids, mask)
    ids, mask = _prompt(2, 84, 21)  # longer: Dynamo's automatic dynamic shapes, made concrete by the backend
    out = _generate(m, ids, mask, compile_config=cc)
    rep = cc.backend.reports[-1]
    assert len(cc.backend.reports) == 2 and rep["hf"]["offload"] and rep["specialised"]["K"]["value"] == 64
    _check_call(out, refs, ids, mask)
    with pytest.raises(RuntimeError, match="Either mode or options"):
        torch.compile(m.forward, backend="dsa_offload", mode="reduce-overhead", options={"pool_size": 1024})
    be = make_offload_backend()
    with pytest.raises(ValueError, match=r"mode='fast' is not a torch.compile mode.*exe_mode"):
        be(torch.fx.symbolic_trace(torch.nn.Identity()), [torch.ones(1)], mode="fast")


def test_offload_instance_and_class_keep_generate(refs):
    """offload(model).generate(...) and @offload on the HF class: both offload (the decode step compiled, the
    prefill eager: offload_passes/hf_generate.py), with the caller's cache_implementation="static" as with
    generate()'s defaults, and offload_state / offload_reports show the pools bound to the call's StaticCache."""
    torch._dynamo.reset()
    ids, mask = _prompt(2, 72, 30)
    w = offload(_model(), pool_size=1024)
    out = w.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, cache_implementation="static",
                     output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    assert "forward" not in w.module.__dict__  # the model itself is left as it was
    assert "_prepare_cache_for_generation" not in w.module.__dict__
    st = _check_call(out, refs, ids, mask)
    assert w.offload_state.totals() == st.totals() and w.offload_state.totals()["hits"] > 0
    assert _kinds(w.offload_backend, len(w.offload_reports)) == (1, 0) and len(w.offload_reports) == 1
    assert w.offload_router.supplied == 0 and w.offload_router.compiled == 1  # the caller chose the cache

    torch._dynamo.reset()
    cls = offload(pool_size=1024)(type(refs["float32"]))
    m = _model(cls=cls)
    for kw in ({"cache_implementation": "static"}, {}):  # the caller's StaticCache, then generate()'s defaults
        out = m.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=0, **kw)
        st = _check_call(out, refs, ids, mask)
        assert len(m.offload_state.groups) == 1 and m.offload_state.totals() == st.totals()
    assert _kinds(m.offload_backend, len(m.offload_reports)) == (2, 0) and len(m.offload_reports) == 2
    assert m.offload_router.supplied == 1 and m.offload_router.compiled == 2  # max_cache_len 75, then 128
    assert m.__dict__.get("_compiled_call_impl") is not None and "forward" not in m.__dict__


def test_torch_compile_of_the_model_warns_that_generate_compiles_nothing():
    torch._dynamo.reset()
    m = _model()
    be = make_offload_backend(pool_size=1024)
    cm = torch.compile(m, backend=be)
    ids, mask = _prompt(1, 70, 40)
    cm.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, cache_implementation="static",
                pad_token_id=0)
    assert len(be.reports) == 0  # torch's wrapper handed generate() to the original model
    with pytest.warns(OffloadWarning, match=r"torch.compile\(model\).generate\(\) compiles nothing"):
        assert be.state is None


def test_strict_generate_prefill_is_dense_by_design(refs):
    """strict=True applies to decode graphs with DSA sites: the prefill (it allocates the cache) is dense by
    design and says so, not a refusal."""
    torch._dynamo.reset()
    m = _model()
    be = make_offload_backend(pool_size=1024, strict=True)
    m.forward = torch.compile(m.forward, backend=be)
    ids, mask = _prompt(2, 72, 50)
    out = _generate(m, ids, mask)
    pre = be.reports[0]
    assert pre["dense"]["reason"] == "prefill" and not pre["refusals"] and not pre["rewritten"]
    assert "dense by design" in pre["dense"]["detail"] and "not the latent cache" not in pre["dense"]["detail"]
    _check_call(out, refs, ids, mask)


def test_recompile_limit_is_announced_by_the_package(refs):
    """The compile that reaches Dynamo's recompile_limit warns (OffloadWarning) and its report says so."""
    torch._dynamo.reset()
    m = _model()
    be = make_offload_backend(pool_size=1024)
    m.forward = torch.compile(m.forward, backend=be, dynamic=False)
    ids, mask = _prompt(1, 70, 60)
    with torch._dynamo.config.patch(recompile_limit=2), pytest.warns(OffloadWarning, match="recompile_limit"):
        _generate(m, ids, mask)  # prefill (compile #1) + decode (compile #2, the last one allowed)
    assert [r["dynamo"]["last_allowed"] for r in be.reports] == [False, True]


def test_the_docs_snippet_runs():
    """docs/hf.md's generate() snippet, as written."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "hf.md").read_text()
    section = text[text.index("## `generate()`"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    torch._dynamo.reset()
    ns: dict = {}
    exec(compile(code, "docs/hf.md", "exec"), ns)
    assert static_cache_state(ns["out"]).totals()["hits"] > 0
    assert [r["dense"]["reason"] if "dense" in r else r["hf"]["offload"] for r in ns["backend"].reports] == \
        ["prefill", True]


def test_a_refusal_reaches_a_user_without_logging(monkeypatch):
    """With no logging configured, an offload refusal is an OffloadWarning, issued once per reason."""
    from offload_passes import pipeline
    from test_sparse_semantics import _base, _compile, _from_scores, _inputs

    monkeypatch.setattr(pipeline, "_warned", set())
    torch._dynamo.reset()
    q, latent, rope, w = (t.to(torch.bfloat16) for t in _inputs(6))
    base = _base("sdpa", 12, 0)
    scores = torch.randn(2, 1, 40, generator=torch.Generator().manual_seed(8)).masked_fill(~base[:, 0], float("-inf"))
    fn, backend, _ = _compile(lambda *a: _from_scores(*a, kind="sdpa"), enable_offload=True)
    with pytest.warns(OffloadWarning, match=r"shared-indexer offload not applied.*cache_layout"):
        fn(q, latent, rope, w, scores, base)
    torch._dynamo.reset()
    fn, backend, _ = _compile(lambda *a: _from_scores(*a, kind="sdpa"), enable_offload=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn(q, latent, rope, w, scores, base)  # the same reasons: logged, not warned again
    assert not [x for x in seen if issubclass(x.category, OffloadWarning)]
    assert backend.reports[-1]["hf"]["offload_refusals"]


def test_prefill_chunk_on_an_existing_cache_is_sparse_without_offload_under_strict():
    """S = 5 query tokens (> MAX_RAW_SEQ) on a cache that exists, S*K < T: the exact sparse rewrite, no
    offload, reported as the prefill's design; strict does not raise."""
    torch._dynamo.reset()
    b = hf.build("hf-tiny", **OVER)
    ref16, ref32 = hf.build("hf-tiny", **OVER), hf.build("hf-tiny", dtype="float32", **OVER)
    be = make_offload_backend(pool_size=1024, strict=True)
    fn = torch.compile(b.model, backend=be, fullgraph=True)
    outs = []
    for built, step in ((ref32, ref32.model), (ref16, ref16.model), (b, fn)):
        dec = hf.HfDecoder(built.model, built.config, built.runner, 2, 400)
        dec.prefill(3)  # eager: allocates the cache
        with torch.no_grad():
            pos = torch.arange(3, 8).view(1, 5).expand(2, 5)
            outs.append(step(dec.tokens[:, 3:8], use_cache=True, position_ids=pos, **dec.cache_kwargs()).logits)
    rep = be.reports[-1]
    assert rep["rewritten"] and not rep["hf"]["offload"] and rep["dense"]["reason"] == "prefill"
    assert {r["reason"] for r in rep["hf"]["offload_refusals"]} == {"raw_seq"}
    err = [float((o.float() - outs[0]).abs().max() / outs[0].abs().max()) for o in outs[1:]]
    assert err[1] <= BF16_FACTOR * err[0], err  # no further from fp32 than the unmodified bf16 model


def _beams(m, ids, mask, beams):
    return m.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, cache_implementation="static",
                      num_beams=beams, output_scores=True, return_dict_in_generate=True, pad_token_id=0)


@pytest.mark.parametrize("beams", [2, 3])
def test_beam_search_keeps_the_pools_warm_and_exact(beams, monkeypatch, caplog):
    """generate(num_beams=...): transformers reorders every cache row after every step
    (``Cache.reorder_cache``); the pools follow the reorder (offload_passes/hf_reorder.py). Bit-identical to
    the same compiled model whose pools go cold at every reorder (every row read from the full cache, what
    the offload must equal), with pool hits; the pools following the caches without their rows (the
    reorder patched out of the pools only) serve stale rows, so the comparison can fail."""
    from offload_passes.state import REGISTRY, StateRegistry

    ids, mask = _prompt(2, 72, 70 + beams)

    def run():
        torch._dynamo.reset()
        m = _model()
        m.forward = torch.compile(m.forward, backend=make_offload_backend(pool_size=1024))
        out = _beams(m, ids, mask, beams)
        return out, static_cache_state(out.past_key_values)

    warm, st = run()
    assert st.groups and st.totals()["hits"] > 0, st.totals() if st.groups else "no state"
    with monkeypatch.context() as mp, caplog.at_level(logging.WARNING, logger="offload_passes.state"):
        mp.setattr(REGISTRY, "follow_rows", lambda old, new, src: 0)  # every reorder: new caches, new pools
        cold, st_cold = run()
    assert not st_cold.groups  # the last reorder's caches: no state followed them
    said = [r.getMessage() for r in caplog.records if "were new tensors on each of the last 3 calls" in r.getMessage()]
    assert len(said) == 1 and "StaticCache's beam-search reorder" in said[0], said  # once, to an HF user
    assert torch.equal(warm.sequences, cold.sequences)
    assert all(torch.equal(a, b) for a, b in zip(warm.scores, cold.scores))
    with monkeypatch.context() as mp:  # the pools follow the caches but keep their rows: stale
        mp.setattr(REGISTRY, "follow_rows", lambda old, new, src: StateRegistry.follow_rows(
            REGISTRY, old, new, list(range(len(src)))))
        stale, _ = run()
    assert any(not torch.equal(a, b) for a, b in zip(stale.scores, cold.scores))



def test_models_that_share_transformers_forward_share_dynamo_budget_unless_given_their_own():
    """Dynamo's recompile_limit counts per code object, and every transformers model's forward is one
    wrapper function: with the limit at 4, the second model compiled through ``model.forward`` reaches it
    (the warning names the sharing and the fix) and a third runs unmodified, never reaching its backend
    (whose state says why). Compiled through ``own_forward`` (what ``offload(model)`` does), three models
    each get their own budget and are all offloaded."""
    from offload_passes import backend as backend_mod
    from offload_passes.decorator import own_forward

    ids, mask = _prompt(2, 72, 95)

    def three(compile_forward):
        torch._dynamo.reset()
        backend_mod._FRAME_MODELS.clear()
        backend_mod._LIMIT_REACHED.clear()
        out = []
        for _ in range(3):
            m = _model()
            be = make_offload_backend(pool_size=1024)
            m.forward = torch.compile(compile_forward(m), backend=be)
            _generate(m, ids, mask)
            out.append(be)
        return out

    with torch._dynamo.config.patch(recompile_limit=4):
        with pytest.warns(OffloadWarning, match=r"2 models compiled in this process share this one \(every "
                                                r"transformers model's forward is one wrapper function.*own_forward"):
            shared = three(lambda m: m.forward)
        assert [len(be.reports) for be in shared] == [2, 2, 0]
        with pytest.warns(OffloadWarning, match="recompile_limit was reached in this process for a code object that "
                                                "several models share"):
            assert shared[2].state is None
        own = three(own_forward)
    assert [[r["rewritten"] for r in be.reports] for be in own] == [[False, True]] * 3
    assert {r["dynamo"]["frame_compile_id"] for be in own for r in be.reports} == {0, 1}


def test_counters_of_a_cache_passed_to_several_calls_add_up_until_reset():
    """``static_cache_state(cache).totals()`` counts that cache's pools since it was created (docs/hf.md): per
    call with the cache ``generate()`` makes; a StaticCache passed to two calls adds both, and
    ``reset_counters()`` between them counts the second alone."""
    torch._dynamo.reset()
    m = _model()
    m.forward = torch.compile(m.forward, backend=make_offload_backend(pool_size=1024))
    ids, mask = _prompt(2, 72, 99)
    from transformers import StaticCache

    cache = StaticCache(config=m.config, max_cache_len=80)

    def call():
        cache.reset()  # a cache reused by the caller starts empty, as generate() would make it
        out = m.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, past_key_values=cache,
                         return_dict_in_generate=True, pad_token_id=0)
        assert out.past_key_values is cache
        return static_cache_state(cache).totals()

    one = call()
    both = call()
    assert one["hits"] > 0 and both["hits"] > one["hits"] and both["misses"] > one["misses"], (one, both)
    static_cache_state(cache).reset_counters()
    third = call()
    assert third == {k: both[k] - one[k] for k in third}, (one, both, third)  # the same call again: the same counts
