"""``offload_passes.hf_cache.HostStaticCache`` on the CPU: it is a ``StaticCache`` (the unmodified model
gives the same tokens, scores and cached rows bit for bit), its write is ``offload_ref::static_cache_write_``,
which the Hugging Face front-end reads the step's positions from, and ``generate()`` with it offloads
through every entry point ``tests/hf/test_generate.py`` runs (``model.forward`` compiled, ``compile_config``
with our helper and with ``CompileConfig(backend="dsa_offload")``, ``offload(model).generate``, the
``@offload`` class): the same greedy check against the unmodified model, pools hit on that call's own cache.
The device side (host caches, device rows, kernels) is ``tests/cuda/test_fake_cuda_hf.py``."""
import warnings

import pytest
import torch
from transformers import CompileConfig, StaticCache

from offload_passes import cuda as C
from offload_passes.backend import OffloadWarning, backend_for_options, make_offload_backend, offload_compile_config
from offload_passes.decorator import offload, static_cache_state
from offload_passes.hf_cache import HostIndexedLayer, HostStaticCache, host_kv_shapes
from offload_passes.models import hf

from test_generate import NEW, OVER, _check_call, _model, _prompt

B, L = 2, 72
MAX = L + NEW - 1  # what generate() sizes its own StaticCache to: the same T as the unmodified runs


def _host_cache(m, batch=B, dtype=torch.bfloat16, **kw):
    return HostStaticCache(m.config, max_cache_len=MAX, batch_size=batch, device="cpu", dtype=dtype, **kw)


def _gen(m, ids, mask, cache, **kw):
    return m.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, past_key_values=cache,
                      output_scores=True, return_dict_in_generate=True, pad_token_id=0, **kw)


@pytest.fixture(scope="module")
def refs():
    return {"float32": _model("float32"), "bfloat16": _model("bfloat16")}


def test_the_unmodified_model_is_bit_identical_on_it(refs):
    """Eager generate() on a HostStaticCache and on a StaticCache of the same size: the same tokens and
    scores bit for bit, the same rows in every cache tensor; the DSA layers are host layers, the counters
    count alike."""
    m = refs["bfloat16"]
    ids, mask = _prompt(B, L, 1, pad=5)
    host = _host_cache(m)
    static = StaticCache(config=m.config, max_cache_len=MAX)
    a, b = _gen(m, ids, mask, host), _gen(m, ids, mask, static)
    assert torch.equal(a.sequences, b.sequences)
    assert all(torch.equal(x, y) for x, y in zip(a.scores, b.scores))
    assert all(isinstance(layer, HostIndexedLayer) for layer in host.layers)
    for h, s in zip(host.layers, static.layers):
        for name in ("keys", "values", "indexer_keys"):  # a shared layer has no indexer keys (None in both)
            x, y = getattr(h, name), getattr(s, name)
            assert (x is None and y is None) or torch.equal(x, y), name
        assert int(h.cumulative_length) == int(s.cumulative_length) == MAX
    assert host.get_seq_length() == static.get_seq_length()


def test_lazy_allocation_in_an_eager_call_equals_construction_time_allocation(refs):
    m = refs["float32"]
    ids, mask = _prompt(B, L, 2)
    lazy = HostStaticCache(m.config, max_cache_len=MAX)
    assert all(not layer.is_initialized for layer in lazy.layers)
    a, b = _gen(m, ids, mask, lazy), _gen(m, ids, mask, _host_cache(m, dtype=torch.float32))
    assert torch.equal(a.sequences, b.sequences)
    k, v = host_kv_shapes(m.config, B, MAX)
    assert tuple(lazy.layers[0].keys.shape) == k == (B, 1, MAX, m.config.kv_lora_rank)
    assert tuple(lazy.layers[0].values.shape) == v == (B, 1, MAX, m.config.qk_rope_head_dim)


def test_the_write_op_is_index_copy():
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 3, 10, 5, generator=g), torch.randn(2, 3, 10, 4, generator=g)
    ks, vs = torch.randn(2, 3, 4, 5, generator=g), torch.randn(2, 3, 4, 4, generator=g)
    pos = torch.tensor([7, 0, 9, 3])
    want_k, want_v = keys.clone().index_copy_(2, pos, ks), values.clone().index_copy_(2, pos, vs)
    torch.ops.offload_ref.static_cache_write_(keys, values, pos, ks, vs)
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)
    from offload_passes.custom_ops.static_cache_write import reference_static_cache_write_

    k2, v2 = torch.zeros_like(keys), torch.zeros_like(values)
    reference_static_cache_write_(k2, v2, pos, ks, vs)
    assert torch.equal(k2[:, :, pos], ks) and torch.equal(v2[:, :, pos], vs)


@pytest.mark.parametrize("bad, message", [
    (dict(pos=torch.tensor([10])), r"cache_position must be in \[0, 10\), got values in \[10, 10\]"),
    (dict(pos=torch.tensor([-1])), r"cache_position must be in \[0, 10\), got values in \[-1, -1\]"),
    (dict(pos=torch.tensor([3, 3]), S=2), r"cache_position must hold distinct positions, got \[3, 3\]"),
    (dict(pos=torch.tensor([3.0])), r"cache_position must be a 1-D int32/int64 tensor, got torch.float32 \(1,\)"),
    (dict(pos=torch.tensor([[3]])), r"cache_position must be a 1-D int32/int64 tensor, got torch.int64 \(1, 1\)"),
    (dict(pos=torch.tensor([True])), r"cache_position must be a 1-D int32/int64 tensor, got torch.bool \(1,\)"),
    (dict(kdt=torch.float16), r"key_states dtype torch.float16 != keys dtype torch.float32"),
    (dict(S=2), r"key_states must be \[B, H, S, D\] = \(2, 1, 1, 5\) \(S = len\(cache_position\)\), got \(2, 1, 2, 5\)"),
    (dict(vT=9), r"keys and values must have the same \[B, H, T\], got \(2, 1, 10\) and \(2, 1, 9\)"),
])
def test_bad_input_raises_before_any_write(bad, message):
    S, vT = bad.get("S", 1), bad.get("vT", 10)
    keys, values = torch.zeros(2, 1, 10, 5), torch.zeros(2, 1, vT, 4)
    ks = torch.ones(2, 1, S, 5, dtype=bad.get("kdt", torch.float32))
    vs = torch.ones(2, 1, S, 4)
    with pytest.raises(RuntimeError, match=r"offload_ref::static_cache_write_: " + message):
        torch.ops.offload_ref.static_cache_write_(keys, values, bad.get("pos", torch.tensor([2])), ks, vs)
    assert not keys.any() and not values.any()


def test_bad_construction_arguments():
    cfg = hf.load_config("hf-tiny", **OVER)[0]
    with pytest.raises(ValueError, match=r"batch_size, device and dtype allocate the KV together; missing: "
                                         r"\['device', 'dtype'\]"):
        HostStaticCache(cfg, max_cache_len=8, batch_size=2)
    with pytest.raises(ValueError, match=r"batch_size must be an int >= 1, got True"):
        HostStaticCache(cfg, max_cache_len=8, batch_size=True, device="cpu", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"batch_size must be an int >= 1, got 0"):
        HostStaticCache(cfg, max_cache_len=8, batch_size=0, device="cpu", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"dtype must be a torch.dtype, got 'bfloat16'"):
        HostStaticCache(cfg, max_cache_len=8, batch_size=2, device="cpu", dtype="bfloat16")
    with pytest.raises(ValueError, match=r"offloading=True .* does not combine with KV that already lives in host"):
        HostStaticCache(cfg, max_cache_len=8, offloading=True)
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match=r"config LlamaConfig has no indexed_attention \(DSA\) layer"):
        HostStaticCache(LlamaConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                    intermediate_size=8, vocab_size=8), max_cache_len=8)


def test_a_lazy_layer_inside_a_compiled_call(refs):
    """A cache built without batch_size allocates (pins) its host KV on the first update; inside a compiled
    prefill that call runs eagerly (a graph break): refused by name under fullgraph=True, with what to pass;
    by default the prefill breaks there and the decode graph is rewritten and offloaded as usual."""
    ids, mask = _prompt(B, L, 3)
    torch._dynamo.reset()
    m = _model()
    m.forward = torch.compile(m.forward, backend=make_offload_backend(pool_size=1024), fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"build the cache with batch_size=, device= and dtype="):
        _gen(m, ids, mask, HostStaticCache(m.config, max_cache_len=MAX))
    torch._dynamo.reset()
    m = _model()
    be = make_offload_backend(pool_size=1024)
    m.forward = torch.compile(m.forward, backend=be)
    cache = HostStaticCache(m.config, max_cache_len=MAX)
    out = _gen(m, ids, mask, cache)
    assert len(_decode_offloaded(be, len(be.reports))) == 1 and be.reports[-1]["hf"]["offload"]
    _check_host_call(out, refs, ids, mask, cache)


def test_placement_of_a_host_cache_and_the_plain_static_cache_refused(refs):
    m = refs["bfloat16"]
    host = _host_cache(m)
    plan = C.plan_placement(host)
    n = len(host.layers)
    assert [(p.name, p.where, p.role) for p in plan if p.where == C.HOST] == [
        (f"cache.layers[{i}].{a}", C.HOST, r) for i in range(n) for a, r in (("keys", "full_latent"),
                                                                              ("values", "full_rope"))]
    assert plan[0].shape == (B, 1, MAX, m.config.kv_lora_rank) and plan[0].dtype == "bfloat16"
    assert C.kv_bytes(plan)[C.HOST] == sum(t.numel() * t.element_size() for layer in host.layers
                                           for t in (layer.keys, layer.values))
    static = StaticCache(config=m.config, max_cache_len=MAX)
    _gen(m, *_prompt(B, L, 4), static)
    with pytest.raises(TypeError, match=r"a transformers StaticCache writes its rows with index_copy_, .*"
                                        r"offload_passes.hf_cache.HostStaticCache"):
        C.place_full_caches(static)


def _check_host_call(out, refs, ids, mask, cache):
    assert out.past_key_values is cache
    st = _check_call(out, refs, ids, mask)  # greedy tokens vs the unmodified model; pools hit on this cache
    assert static_cache_state(cache).totals() == st.totals()


def _decode_offloaded(backend, n):
    return [r for r in list(backend.reports)[-n:] if r["rewritten"] and r["hf"]["offload"]]


def test_forward_compiled_offloads_and_equals_the_static_cache_run_bit_for_bit(refs):
    """model.forward compiled: the decode graph is rewritten and offloaded with the host cache's write in it
    (positions read from static_cache_write_); its tokens and scores equal the same compiled model's on a
    StaticCache bit for bit."""
    ids, mask = _prompt(B, L, 5, pad=3)
    outs = {}
    for kind in ("host", "static"):
        torch._dynamo.reset()
        m = _model()
        be = make_offload_backend(pool_size=1024)
        m.forward = torch.compile(m.forward, backend=be)
        cache = _host_cache(m) if kind == "host" else StaticCache(config=m.config, max_cache_len=MAX)
        with warnings.catch_warnings():
            warnings.simplefilter("error", OffloadWarning)
            outs[kind] = _gen(m, ids, mask, cache)
        assert len(_decode_offloaded(be, len(be.reports))) == 1, [r.get("dense") for r in be.reports]
        if kind == "host":
            _check_host_call(outs[kind], refs, ids, mask, cache)
            g = [gm for gm in [be.final_graph()]][0]
            writes = [n for n in g.nodes if n.target is torch.ops.offload_ref.static_cache_write_.default]
            assert len(writes) == len(cache.layers)
    assert torch.equal(outs["host"].sequences, outs["static"].sequences)
    assert all(torch.equal(a, b) for a, b in zip(outs["host"].scores, outs["static"].scores))


def test_compile_config_entry_points(refs):
    """generate(compile_config=offload_compile_config(...)) and CompileConfig(backend="dsa_offload") (HF's
    defaults; the prefill eager): the decode step offloads on the host cache."""
    ids, mask = _prompt(B, L, 6)
    torch._dynamo.reset()
    m = _model()
    cc = offload_compile_config(pool_size=1024)
    cache = _host_cache(m)
    out = _gen(m, ids, mask, cache, compile_config=cc)
    assert len(_decode_offloaded(cc.backend, len(cc.backend.reports))) == 1
    _check_host_call(out, refs, ids, mask, cache)

    torch._dynamo.reset()
    m = _model()
    cc = CompileConfig(backend="dsa_offload")
    cc._compile_all_devices = True  # HF compiles on accelerators only unless asked (this is a CPU test)
    be = backend_for_options({})
    n0 = len(be.reports)
    cache = _host_cache(m)
    out = _gen(m, ids, mask, cache, compile_config=cc)
    assert len(be.reports) - n0 == 1 and be.reports[-1]["hf"]["offload"]
    _check_host_call(out, refs, ids, mask, cache)


def test_offload_instance_and_class(refs):
    ids, mask = _prompt(B, L, 7)
    torch._dynamo.reset()
    w = offload(_model(), pool_size=1024)
    cache = _host_cache(w.module)
    out = w.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, past_key_values=cache,
                     output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    _check_host_call(out, refs, ids, mask, cache)
    assert w.offload_state.totals() == static_cache_state(cache).totals()

    torch._dynamo.reset()
    cls = offload(pool_size=1024)(type(refs["float32"]))
    m = _model(cls=cls)
    cache = _host_cache(m)
    out = _gen(m, ids, mask, cache)
    _check_host_call(out, refs, ids, mask, cache)
    assert m.offload_state.totals() == static_cache_state(cache).totals()


def test_fp32_keeps_the_exact_sparse_rewrite(refs):
    """fp32 caches: the offload is refused by name (kv_dtype), the sparse attention gathers from the host
    cache; exact tokens."""
    torch._dynamo.reset()
    m = _model("float32")
    cc = offload_compile_config(pool_size=1024)  # the prefill eager, as test_generate.py's fp32 check
    ids, mask = _prompt(B, L, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OffloadWarning)
        out = _gen(m, ids, mask, _host_cache(m, dtype=torch.float32), compile_config=cc)
    rep = cc.backend.reports[-1]
    assert rep["rewritten"] and not rep["hf"]["offload"]
    assert {r["reason"] for r in rep["hf"]["offload_refusals"]} == {"kv_dtype"}
    _check_call(out, refs, ids, mask, dtype="float32", offload_on=False)


def test_reset_and_reorder_keep_the_allocations(refs, monkeypatch):
    """reset() zeroes the host rows, reorder_cache() permutes them in place (the pinned allocations and the
    offload state keyed by them stay); both first wait for the device (on the CPU: nothing to wait for)."""
    m = refs["bfloat16"]
    cache = _host_cache(m)
    _gen(m, *_prompt(B, L, 9), cache)
    layer = cache.layers[0]
    waits = []
    monkeypatch.setattr(C, "before_host_write", lambda dev: waits.append(str(dev)))
    keys, values, idx = layer.keys, layer.values, layer.indexer_keys
    before = keys.clone(), values.clone(), idx.clone()
    layer.device = torch.device("cuda")  # as on a CUDA model: the host rows are not where the model runs
    try:
        cache.reorder_cache(torch.tensor([1, 0]))
        assert layer.keys is keys and layer.values is values and layer.is_initialized
        assert torch.equal(keys, before[0].flip(0)) and torch.equal(values, before[1].flip(0))
        assert torch.equal(layer.indexer_keys, before[2].flip(0))
        cache.reset()
    finally:
        layer.device = torch.device("cpu")
    assert layer.keys is keys and not keys.any() and not values.any() and int(layer.cumulative_length) == 0
    assert waits == ["cuda", "cuda"]
