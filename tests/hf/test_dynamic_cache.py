"""generate()'s default cache (a ``DynamicCache``) under the compiled-forward form: the graph reads a cache
grown by ``torch.cat`` at every step, which the offload cannot serve. It is refused by name
(``dynamic_cache``), with one warning that names the remedy, and the model runs unmodified: its tokens are
the unmodified model's."""
import warnings

import pytest
import torch

from offload_passes.backend import OffloadRefused, OffloadWarning, _recompile_limit_message, make_offload_backend
from offload_passes.models import hf

OVER = dict(num_hidden_layers=2, index_topk_pattern="FS")  # one IndexShare group of 2 layers, K = 64
NEW = 4


def _model():
    m = hf.build("hf-tiny", dtype="bfloat16", **OVER).model
    m.generation_config.eos_token_id = None  # random weights: every call generates NEW tokens
    return m


def _prompt(B: int, L: int, seed: int):
    ids = torch.randint(2, 256, (B, L), generator=torch.Generator().manual_seed(seed))
    return ids, torch.ones_like(ids)


def _generate(m, ids, mask):
    # generate()'s defaults: no cache_implementation, so transformers builds a DynamicCache
    return m.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)


def test_forward_form_on_the_default_cache_is_refused_by_name_with_the_remedy():
    torch._dynamo.reset()
    ref, m = _model(), _model()
    be = make_offload_backend(pool_size=1024)
    m.forward = torch.compile(m.forward, backend=be)
    ids, mask = _prompt(2, 72, 1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = _generate(m, ids, mask)
    ours = [str(w.message) for w in seen if issubclass(w.category, OffloadWarning)]
    assert len(ours) == 1, ours
    msg = ours[0]
    assert "DSA offload not applied: dynamic_cache (layers 0, 1)" in msg
    assert ("the graph reads a DynamicCache (generate()'s default cache) or another cache that grows by "
            "concatenation: its tensors are new at every step, which the offload cannot serve") in msg
    assert ("Use offload(model).generate(...), which supplies a bucketed StaticCache, or generate(..., "
            "cache_implementation=\"static\", max_cache_len=N) with a fixed N") in msg
    # the prefill (a cat onto an empty tensor) and every decode graph (a cat onto the cache input): same reason
    assert len(be.reports) >= 2
    for rep in be.reports:
        assert not rep["rewritten"] and [r["reason"] for r in rep["refusals"]] == ["dynamic_cache"] * 2, rep
        assert "= torch.cat([cache, this step's rows], dim=-2)" in rep["refusals"][0]["detail"]
    assert torch.equal(out, _generate(ref, ids, mask))


def test_strict_raises_naming_the_dynamic_cache():
    torch._dynamo.reset()
    m = _model()
    m.forward = torch.compile(m.forward, backend=make_offload_backend(pool_size=1024, strict=True))
    ids, mask = _prompt(1, 72, 2)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="DSA offload not applied: dynamic_cache") as ei:
        _generate(m, ids, mask)
    assert isinstance(ei.value.inner_exception, OffloadRefused)


def test_recompile_limit_warning_points_a_hf_user_at_offload():
    frame = {"recompile_limit": 8, "frame_compile_id": 7, "models": 1}
    hf_msg = _recompile_limit_message("graph_007", frame, hf=True)
    assert hf_msg.startswith("graph_007: Dynamo's recompile_limit (8) is reached for this frame (compile #8)")
    assert "For a Hugging Face model use offload(model).generate(...): it supplies a StaticCache of bucketed " \
           "lengths" in hf_msg
    assert "offload(model)" not in _recompile_limit_message("graph_007", frame, hf=False)
