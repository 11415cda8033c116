"""A refused announcement changes nothing (docs/new-requests.md, "The engine's contract").

The static ``tiny`` model at batch 2, compiled with the offload backend, beside the unmodified model. Two
requests swap rows: the engine moves their KV, then announces the swap with one entry too many
(``move_rows([1, 0, -1])``: there is no graph or model of batch 3). The call is refused naming the
limit, nothing changes, and the corrected ``move_rows([1, 0])`` keeps every later step bit-identical
with the unmodified model. The same for ``begin_request`` (a row past the batch) and for
``EngineAdapter.step`` (bad ``rows`` / ``written``)."""
from __future__ import annotations

import pytest
import torch

from offload_passes import make_offload_backend, models
from offload_passes.engine import EngineAdapter
from offload_passes.models.glm.serve import follow_requests, request_rows
from offload_passes.state import GroupLayout, OffloadState, module_state

OVER = dict(enable_offload=True, batch_size=2, decode_steps=24, prefill_len=64, pa_max_length=256,
            num_hidden_layers=4, index_topk_pattern="FSFS")
KV = ("kv_cache", "k_rope_cache", "key_cache", "key_scale_cache")


class Pair:
    """The unmodified model and the compiled one, stepped on the same tokens."""

    def __init__(self) -> None:
        self.ref, self.comp = models.build("tiny", **OVER), models.build("tiny", **OVER)
        self.be = make_offload_backend(pool_size=64)
        self.fn = torch.compile(self.comp.model, backend=self.be)

    def restart(self) -> None:
        self.ref.driver.prefill()
        self.comp.driver.prefill()
        st = module_state(self.comp.model)
        if st.groups:
            st.reset()

    def step(self) -> float:
        b = self.comp.driver.step(self.fn)  # first: a refused step must not advance the unmodified model
        a = self.ref.driver.step()
        return (a.logits.float() - b.logits.float()).abs().max().item()

    def swap_kv(self, m) -> None:
        """The engine's move of the two requests' KV (identity block layout: row b owns its blocks)."""
        with torch.no_grad():
            for n, t in m.cache_buffers().items():
                if n.endswith(KV):
                    v = t.view(2, -1, *t.shape[1:])
                    v.copy_(v[torch.tensor([1, 0])])

    def swap(self, with_rows: bool) -> None:
        """Both models' requests swap rows: KV, lengths; the unmodified model's selection rows and ledgers
        too (its own requirement), the compiled model's unless the engine adapter moves them."""
        for drv, rows in ((self.ref.driver, True), (self.comp.driver, with_rows)):
            self.swap_kv(drv.model)
            if rows:
                follow_requests(*request_rows(drv.model), [1, 0], 2)
            drv.cur_len = drv.cur_len[[1, 0]].clone()

    def snapshot(self) -> list:
        st = module_state(self.comp.model)
        ts = [t.clone() for t in st.tensors().values()]
        return ts + [[g.shared.announced for g in st.groups], [g.pool_ids.size(0) for g in st.groups]]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
                                    for x, y in zip(a, b))


@pytest.fixture(scope="module")
def pair():
    return Pair()


def test_a_too_long_src_is_refused_at_the_call_and_the_corrected_retry_is_exact(pair):
    pair.restart()
    assert [pair.step() for _ in range(3)] == [0.0] * 3
    pair.swap(with_rows=True)
    st = module_state(pair.comp.model)
    before = pair.snapshot()
    with pytest.raises(ValueError, match=r"OffloadState\.move_rows: src must have one entry per batch row of the "
                                         r"next step, 1 to 2 \(.*batch 2.*\), got 3"):
        st.move_rows([1, 0, -1])
    assert _same(before, pair.snapshot()), "the refused announcement changed the state"
    st.move_rows([1, 0])
    diffs = [pair.step() for _ in range(6)]
    assert diffs == [0.0] * 6, diffs
    assert module_state(pair.comp.model).totals("step")["hits"] > 0  # the swapped rows stayed warm


def test_a_row_past_the_batch_in_begin_request_is_refused_and_the_retry_is_exact(pair):
    pair.restart()
    assert [pair.step() for _ in range(3)] == [0.0] * 3
    for drv in (pair.ref.driver, pair.comp.driver):  # row 1 starts a new request (same prompt in both)
        drv.reset_row(1, prompt_len=80)
    st = module_state(pair.comp.model)
    before = pair.snapshot()
    with pytest.raises(ValueError, match=r"OffloadState\.begin_request: rows entries must be in \[0, 2\) "
                                         r"\(.*batch 2.*\), got \[2\]"):
        st.begin_request([1, 2])
    assert _same(before, pair.snapshot())
    st.begin_request([1])
    assert [pair.step() for _ in range(4)] == [0.0] * 4


@pytest.mark.parametrize("rows,written,exc,msg", [
    (["b", "a"], None, TypeError, r"EngineAdapter\.step: written must be a collection of request ids .*got None"),
    (["b", "a"], 5, TypeError, r"EngineAdapter\.step: written must be a collection of request ids .*got int 5"),
    (["b", "a"], "ab", TypeError, r"EngineAdapter\.step: written must be a collection .*got str"),
    (["b", "a"], [["a"]], TypeError, r"EngineAdapter\.step: written\[0\] is list \['a'\], not a request id "
                                     r"\(ids must be hashable\)"),
    ([["b"], "a"], (), TypeError, r"EngineAdapter\.step: rows\[0\] is list \['b'\], not a request id "
                                  r"\(ids must be hashable; None: a padding row\)"),
    (["b", "a", "c"], (), ValueError, r"EngineAdapter\.step: rows must have 1 to 2 entries \(the batch\), got 3"),
    ("ba", (), TypeError, r"EngineAdapter\.step: rows must be a list or tuple of request ids"),
    (["a", "a"], (), ValueError, r"EngineAdapter\.step: a request runs in one row only"),
])
def test_the_adapter_refuses_bad_input_changing_nothing_and_the_retry_is_exact(pair, rows, written, exc, msg):
    pair.restart()
    ad = EngineAdapter(pair.comp.model)
    assert ad.step(["a", "b"], written={"a", "b"}) == [-1, -1]
    assert [pair.step() for _ in range(3)] == [0.0] * 3
    ad.step(["a", "b"])
    pair.swap(with_rows=False)  # the engine moves the KV; the adapter moves the model's rows
    before = pair.snapshot() + [t.clone() for t in ad.row_tensors + ad.ledgers] + [list(ad._rows)]
    with pytest.raises(exc, match=msg):
        ad.step(rows, written)
    assert _same(before, pair.snapshot() + [t.clone() for t in ad.row_tensors + ad.ledgers] + [list(ad._rows)])
    assert ad.step(["b", "a"]) == [1, 0] and ad.batch_changes == 2
    assert [pair.step() for _ in range(4)] == [0.0] * 4


def test_the_adapter_asks_the_state_before_it_moves_the_models_rows():
    """A state that refuses the announcement (here: a state of one row for an adapter of two) leaves the
    model's rows and the adapter's account as they were: a retry then moves them once, not twice."""
    sel = torch.arange(8, dtype=torch.float32).view(2, 4)
    ledger = torch.arange(4, dtype=torch.int32).view(2, 2)
    small = OffloadState.allocate("g", [GroupLayout(0, 0, [0], 1, 16, 64, [(8, 4, torch.bfloat16)])])
    ad = EngineAdapter(None, row_tensors=[sel], ledgers=[ledger], state=lambda: small)
    assert ad.step(["a"]) == [-1]
    sel[1], ledger[1] = 9, 9  # the engine's row 1 (not a request of the adapter's yet)
    before = (sel.clone(), ledger.clone())
    with pytest.raises(ValueError, match=r"OffloadState\.move_rows: src must have one entry per batch row .*"
                                         r"1 to 1 .*got 2"):
        ad.step(["b", "a"])
    assert torch.equal(sel, before[0]) and torch.equal(ledger, before[1]) and ad._rows == ["a"]
    assert ad.batch_changes == 1
