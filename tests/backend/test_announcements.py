"""The engine's announcements (``OffloadState.begin_request`` / ``move_rows`` / ``reset``, offload_passes/state/api.py)
refuse what they cannot mean: every hostile input raises a ``TypeError`` / ``ValueError`` naming the call,
the argument, the accepted forms and the limit, and leaves the state exactly as it was. What they accept
(integer sequences, integer tensors and numpy arrays, sets of rows) means what it says."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from offload_passes.state import GroupLayout, OffloadState, module_state, row_indices

B = 4


def _state() -> OffloadState:
    st = OffloadState.allocate("g", [GroupLayout(0, 0, [0], B, 16, 64, [(8, 4, torch.bfloat16)], 4)])
    g = st.groups[0]
    kv, _ = st.pools[0]
    for b in range(B):
        g.pool_ids[b].fill_(b)
        g.seen_len[b] = 10 * (b + 1)
        kv[b].fill_(b + 1)
    return st


def _snapshot(st: OffloadState) -> list:
    return [t.clone() for t in st.tensors().values()] + [st.groups[0].shared.announced]


FORMS_ROWS = "a list, tuple, range or set of ints, or a 1-D integer tensor or numpy array (any device)"
FORMS_SRC = "a list, tuple or range of ints, or a 1-D integer tensor or numpy array (any device)"

HOSTILE = [
    # (call, args, exception, message): the list, and its neighbours
    ("begin_request", (torch.tensor([False, False, False, True]),), TypeError, "rows .*a bool mask Tensor"),
    ("begin_request", (np.array([False, False, False, True]),), TypeError, "rows .*a bool mask ndarray"),
    ("begin_request", ([False, False, False, True],), TypeError, "rows .*holding the bool False"),
    ("begin_request", ([True],), TypeError, "rows .*holding the bool True"),
    ("begin_request", ([1.9],), TypeError, "rows .*holding float 1.9"),
    ("begin_request", ([float("nan")],), TypeError, "rows .*holding float nan"),
    ("begin_request", (2,), TypeError, r"rows .*got int 2 \(one row: pass \[2\]\)"),
    ("begin_request", (None,), TypeError, "rows .*got NoneType"),
    ("begin_request", ([torch.tensor([1, 2])],), TypeError, "rows .*holding Tensor"),
    ("begin_request", ([4],), ValueError, r"rows entries must be in \[0, 4\) .*got \[4\]"),
    ("begin_request", ([-1],), ValueError, r"rows entries must be in \[0, 4\) .*got \[-1\]"),
    ("begin_request", ([2**70],), ValueError, r"rows entries must be in \[0, 4\)"),
    ("begin_request", (torch.tensor([[0, 1]]),), ValueError, r"rows must be 1-D .*got shape \[1, 2\]"),
    ("move_rows", ([1.2, 0.4, 2.0, 3.0],), TypeError, "src .*holding float 1.2"),
    ("move_rows", (torch.tensor([1.0, 0.0, 2.0, 3.0]),), TypeError, "src .*a Tensor of dtype torch.float32"),
    ("move_rows", ("0123",), TypeError, "src .*got str '0123'"),
    ("move_rows", ({0: 1},), TypeError, "src .*got dict"),
    ("move_rows", ({0, 1},), TypeError, "src .*got set"),  # an order matters: a set is no src
    ("move_rows", ((x for x in range(4)),), TypeError, "src .*got generator"),
    ("move_rows", (3,), TypeError, r"src .*got int 3 \(one row: pass \[3\]\)"),
    ("move_rows", ([0, 1, 2, 4],), ValueError, r"src entries must be in \[-1, 4\) .*got \[4\]"),
    ("move_rows", ([0, 1, 2, -2],), ValueError, r"src entries must be in \[-1, 4\)"),
    ("move_rows", ([0, 1, 2, 3, -1],), ValueError, r"src must have one entry per batch row of the next step, 1 to 4 "
                                                   r".*got 5"),
    ("move_rows", ([],), ValueError, "src must have one entry per batch row .*got 0"),
    ("move_rows", ([0, 0, 1, 2],), ValueError, r"src names row\(s\) \[0\] twice"),
    ("move_rows", (np.array([[0, 1, 2, 3]]),), ValueError, r"src must be 1-D .*got shape \[1, 4\]"),
    # tensors with no values to read, other dtypes, NaN
    ("move_rows", (torch.tensor([1, 0, 2, 3], device="meta"),), TypeError, r"src .*got a meta Tensor \(it holds no "
                                                                          r"values\)"),
    ("move_rows", (torch.tensor([1, 0, 2, 3]).to_sparse(),), TypeError, r"src .*got a torch.sparse_coo Tensor \(a "
                                                                       r"row list is a dense tensor"),
    ("begin_request", (torch.tensor([1]).to_sparse(),), TypeError, "rows .*sparse_coo Tensor"),
    ("begin_request", (torch.empty(1, device="meta", dtype=torch.long),), TypeError, "rows .*a meta Tensor"),
    ("move_rows", (torch.tensor([float("nan")] * 4),), TypeError, "src .*a Tensor of dtype torch.float32"),
    ("move_rows", ([float("nan")] * 4,), TypeError, "src .*holding float nan"),
    ("move_rows", (np.array([1.0, 0.0, 2.0, 3.0]),), TypeError, "src .*an? ndarray of dtype float64"),
    ("move_rows", (torch.tensor([1, 0, 2, 3], dtype=torch.complex64),), TypeError, "src .*dtype torch.complex64"),
    ("move_rows", (np.array(["1", "0", "2", "3"]),), TypeError, "src .*ndarray of dtype <U1"),
    ("move_rows", (np.int64(1),), ValueError, r"src must be 1-D .*got shape \[\]"),
    ("move_rows", (torch.tensor(1),), ValueError, r"src must be 1-D .*got shape \[\]"),
    ("begin_request", (b"\x01",), TypeError, r"rows .*got bytes b'\\x01'"),
    ("begin_request", (iter([1]),), TypeError, r"rows .*got list_iterator"),
]


@pytest.mark.parametrize("call,args,exc,msg", HOSTILE, ids=[f"{c}-{i}" for i, (c, *_rest) in enumerate(HOSTILE)])
def test_hostile_announcements_are_refused_naming_the_argument_and_change_nothing(call, args, exc, msg):
    st = _state()
    before = _snapshot(st)
    with pytest.raises(exc, match=rf"OffloadState\.{call}: {msg}") as e:
        getattr(st, call)(*args)
    if exc is TypeError:  # the accepted forms and the limit are in the message
        forms = FORMS_SRC if call == "move_rows" else FORMS_ROWS
        assert forms in str(e.value) and ("[0, 4)" in str(e.value) or "[-1, 4)" in str(e.value)), e.value
    after = _snapshot(st)
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(before, after))


@pytest.mark.parametrize("kw,exc,msg", [
    (dict(rows=1), TypeError, r"OffloadState.reset: rows must be .*got int 1 \(one row: pass \[1\]\)"),
    (dict(rows=[1], counters="no"), TypeError, "OffloadState.reset: counters must be None, True or False, got str"),
    (dict(rows=[1], counters=1), TypeError, "OffloadState.reset: counters must be None, True or False, got int"),
    (dict(rows=[4]), ValueError, r"OffloadState.reset: rows entries must be in \[0, 4\) \(the batch B=4\)"),
    (dict(rows=torch.tensor([True, False, False, False])), TypeError, "OffloadState.reset: rows .*a bool mask"),
])
def test_hostile_resets_are_refused_and_change_nothing(kw, exc, msg):
    st = _state()
    st.groups[0].stats.fill_(5)
    before = _snapshot(st)
    with pytest.raises(exc, match=msg):
        st.reset(**kw)
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(before, _snapshot(st)))


def test_accepted_forms_mean_what_they_say():
    """Integer tensors (int32 / int64 / uint8), numpy arrays of ints, tuples, ranges and sets: the rows they
    name, nothing else; ``move_rows`` with any form moves the same rows."""
    for rows in ([3], (3,), range(3, 4), {3}, torch.tensor([3], dtype=torch.int32), torch.tensor([3]),
                 torch.tensor([3], dtype=torch.uint8), np.array([3]), [np.int64(3)]):
        st = _state()
        st.begin_request(rows)
        assert st.groups[0].pool_ids[:, 0].tolist() == [0, 1, 2, -1], rows
        assert st.groups[0].seen_len.tolist() == [10, 20, 30, 0] and st.groups[0].shared.announced
    for src in ([3, 0, -1, 1], torch.tensor([3, 0, -1, 1]), np.array([3, 0, -1, 1], dtype=np.int32), (3, 0, -1, 1)):
        st = _state()
        st.move_rows(src)
        assert st.groups[0].pool_ids[:, 0].tolist() == [3, 0, -1, 1], src
        assert st.pools[0][0][:, 0, 0].tolist() == [4.0, 1.0, 0.0, 2.0]
    st = _state()
    st.begin_request([])  # nothing new: still the engine's (complete) account of the interval
    assert st.groups[0].shared.announced and st.groups[0].pool_ids[:, 0].tolist() == [0, 1, 2, 3]
    st.reset(rows=torch.tensor([1]), counters=False)
    assert st.groups[0].pool_ids[:, 0].tolist() == [0, -1, 2, 3]


def test_an_empty_state_checks_the_form_too():
    """Before the first compiled call (``module_state`` of a module with nothing compiled: no groups) an
    announcement has nothing to forget, but a hostile one is still refused."""
    st = OffloadState("module", 0, 0, 0)
    st.begin_request([5])
    st.move_rows([0, -1])
    st.reset(rows=[7])
    with pytest.raises(TypeError, match="OffloadState.begin_request: rows .*bool mask"):
        st.begin_request(torch.tensor([True]))
    with pytest.raises(TypeError, match="OffloadState.move_rows: src .*holding float"):
        st.move_rows([0.5])
    with pytest.raises(ValueError, match=r"OffloadState.move_rows: src entries must be in >= -1"):
        st.move_rows([-3])


@pytest.mark.parametrize("call,exc,msg", [
    (lambda st: st.totals("steps"), ValueError, r"OffloadState\.totals: which must be 'step' .* or 'total' .*got "
                                                r"'steps'"),
    (lambda st: st.record_trace("yes"), TypeError, r"OffloadState\.record_trace: enable must be True or False, got "
                                                   r"str 'yes'"),
    (lambda st: st.record_trace(None), TypeError, r"OffloadState\.record_trace: enable must be True or False"),
    (lambda st: st.trace(3), TypeError, r"OffloadState\.trace: model must be a str .*got int"),
    (lambda st: module_state(st), TypeError, r"module_state: module must be a torch\.nn\.Module .*got OffloadState"),
    (lambda st: module_state(torch.nn.Linear(1, 1), registry={}), TypeError,
     r"module_state: registry must be a StateRegistry or None, got dict"),
    (lambda st: module_state(torch.nn.Linear(1, 1), batch_size=0), ValueError,
     r"module_state: batch_size must be an int >= 1 .*got 0"),
    (lambda st: module_state(torch.nn.Linear(1, 1), batch_size=2.0), TypeError,
     r"module_state: batch_size must be an int >= 1 .*got float 2\.0"),
])
def test_every_public_call_names_its_bad_argument_and_changes_nothing(call, exc, msg):
    st = _state()
    before = _snapshot(st)
    with pytest.raises(exc, match=msg):
        call(st)
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(before, _snapshot(st)))


def test_the_row_count_limit_is_the_batch_that_exists():
    """A private state (a graph's buffers) holds one batch and cannot grow: ``move_rows`` takes 1 to B entries
    whatever the model's batch says, and ``begin_request`` rows below B; an empty state (nothing compiled)
    knows only the model's batch, and checks against it."""
    st = _state()
    st.batch_limit = 8  # a model of batch 8: this private state still cannot grow past its 4 rows
    with pytest.raises(ValueError, match=r"src must have one entry per batch row of the next step, 1 to 4 \(the "
                                         r"batch: 4 rows held, graphs of batch 4 ran on these caches, the model's "
                                         r"batch 8 \(private state: it cannot grow\)\), got 5"):
        st.move_rows([0, 1, 2, 3, -1])
    with pytest.raises(ValueError, match=r"rows entries must be in \[0, 4\)"):
        st.begin_request([4])
    empty = module_state(torch.nn.Linear(1, 1), batch_size=2)
    assert empty.groups == [] and empty.batch_limit == 2
    with pytest.raises(ValueError, match=r"OffloadState\.move_rows: src must have one entry per batch row of the "
                                         r"next step, 1 to 2 \(the model's batch 2; no graph has run yet\), got 3"):
        empty.move_rows([-1, -1, -1])
    with pytest.raises(ValueError, match=r"OffloadState\.begin_request: rows entries must be in \[0, 2\)"):
        empty.begin_request([2])
    with pytest.raises(ValueError, match=r"OffloadState\.move_rows: src names row\(s\) \[0\] twice"):
        empty.move_rows([0, 0])
    empty.move_rows([1, -1])
    empty.begin_request([1])


def test_row_indices_names_where_and_the_limit():
    assert row_indices(range(2), "f", "x", 0, 2, "two rows") == [0, 1]
    with pytest.raises(ValueError, match=r"f: x entries must be in \[0, 2\) \(two rows\), got \[2\]"):
        row_indices([2], "f", "x", 0, 2, "two rows")
