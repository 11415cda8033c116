"""``offload()``-wrapped and ``@offload``-decorated modules under ``torch.save`` / ``torch.load`` and
``copy.deepcopy``: the copy is compiled again by its own backend with the same options, its reports and
state are its own, and both the copy and the original stay exact against the unmodified model."""
from __future__ import annotations

import copy
import io

import torch

import dsa_synth as synth
from backend_helpers import run_pair
from offload_passes import offload

PS = 64
CFG = synth.SynthConfig(pattern="FS", S=1, router=False)


@offload(pool_size=PS)
class TopLevelDecorated(synth.SynthDSA):  # module level: pickle finds classes by name
    pass


def _continue(wrapped, base, module, lengths, start: int, steps: int = 2) -> dict:
    """``steps`` more decode steps of ``wrapped`` beside the unmodified ``base`` (same caches so far)."""
    return run_pair(CFG, steps, wrapped.offload_backend, pair=(base, module), compiled=wrapped, start_step=start,
                    lengths=lengths)


def test_torch_save_of_a_wrapped_module_loads_and_recompiles():
    """torch.save failed with "Can't pickle local object 'WeakValueDictionary...'" (the backend)."""
    torch._dynamo.reset()
    base, m = synth.make_pair(CFG, [300, 280])
    w = offload(m, pool_size=PS)
    res = run_pair(CFG, 2, w.offload_backend, pair=(base, m), compiled=w)
    assert res["max_a"] == 0 and len(w.offload_reports) == 1
    buf = io.BytesIO()
    torch.save(w, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded) is type(w) and loaded.offload_backend is not w.offload_backend
    assert loaded.offload_backend.options == w.offload_backend.options  # pool_size 64 kept
    assert len(loaded.offload_reports) == 0 and loaded.offload_state.groups == []  # not compiled yet
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), w.state_dict().values()))
    res2 = _continue(loaded, copy.deepcopy(base), loaded.module, res["lengths"], start=2)
    assert res2["max_a"] == 0 and res2["max_h"] == 0
    assert len(loaded.offload_reports) == 1 and loaded.offload_reports[0]["rewritten"] is True
    assert [g.layers for g in loaded.offload_state.groups] == [[0, 1]]
    assert len(w.offload_reports) == 1  # the original's reports list only its own graph


def test_deepcopy_of_a_wrapped_module_is_compiled_with_its_own_reports():
    """A deep copy used to carry a copy of the original's backend: its reports listed the original's
    graph beside its own."""
    torch._dynamo.reset()
    base, m = synth.make_pair(CFG, [300, 280])
    w = offload(m, pool_size=PS)
    res = run_pair(CFG, 2, w.offload_backend, pair=(base, m), compiled=w)
    c = copy.deepcopy(w)
    assert c.module is not m and c.offload_backend is not w.offload_backend
    assert len(c.offload_reports) == 0 and c.offload_state.groups == []
    base_c = copy.deepcopy(base)
    rc = _continue(c, base_c, c.module, res["lengths"], start=2)
    assert rc["max_a"] == 0 and rc["max_h"] == 0
    assert len(c.offload_reports) == 1 and c.offload_reports[0]["rewritten"] is True
    assert c.offload_state.counters()[0]["total"]["steps"] == 2  # the copy's own two steps
    ro = _continue(w, base, m, res["lengths"], start=2)  # the original goes on, unaffected
    assert ro["max_a"] == 0 and len(w.offload_reports) == 1
    assert w.offload_state.counters()[0]["total"]["steps"] == 4


def test_deepcopy_of_a_decorated_class_instance_runs_its_own_compiled_model():
    """nn.Module.__getstate__ drops the compiled call: a deep copy ran uncompiled while its (copied)
    backend still listed the original's reports."""
    torch._dynamo.reset()

    @offload(pool_size=PS)
    class Decorated(synth.SynthDSA):
        pass

    d = Decorated(CFG).eval()
    d.prefill([300, 280])
    base = synth.SynthDSA(CFG).eval()
    base.prefill([300, 280])
    res = run_pair(CFG, 2, d.offload_backend, pair=(base, d), compiled=d)
    assert res["max_a"] == 0 and len(d.offload_reports) == 1
    c = copy.deepcopy(d)
    assert isinstance(c, Decorated) and c.offload_backend is not d.offload_backend
    assert len(c.offload_reports) == 0 and c.offload_state.groups == []
    rc = run_pair(CFG, 2, c.offload_backend, pair=(copy.deepcopy(base), c), compiled=c, start_step=2,
                  lengths=res["lengths"])
    assert rc["max_a"] == 0 and rc["max_h"] == 0
    assert len(c.offload_reports) == 1 and c.offload_reports[0]["rewritten"] is True  # compiled, by its backend
    assert c.offload_state.counters()[0]["total"]["steps"] == 2
    assert len(d.offload_reports) == 1


def test_torch_save_of_a_decorated_class_instance_loads_compiled():
    torch._dynamo.reset()
    d = TopLevelDecorated(CFG).eval()
    d.prefill([300, 280])
    buf = io.BytesIO()
    torch.save(d, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert isinstance(loaded, TopLevelDecorated) and loaded.offload_backend is not d.offload_backend
    base = synth.SynthDSA(CFG).eval()
    base.prefill([300, 280])
    res = run_pair(CFG, 2, loaded.offload_backend, pair=(base, loaded), compiled=loaded)
    assert res["max_a"] == 0 and res["max_h"] == 0
    assert len(loaded.offload_reports) == 1 and loaded.offload_reports[0]["rewritten"] is True
    assert loaded.offload_backend.options.resolved_pool_size == PS and len(d.offload_reports) == 0
