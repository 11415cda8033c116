"""The state's recording hook (offload_passes/state/recording.py): a recorder attached with
``OffloadState.add_recorder`` is called with the inputs of every ``dsa_plan`` call of that state's groups
(and of no other state's), until removed; bad recorders are refused naming the call; ``record_trace``
uses the recorder the trace package registers, and says what to do when none is."""
from __future__ import annotations

import pytest
import torch

from offload_passes.state import GroupLayout, OffloadState, recording


def _state(groups: int = 2) -> OffloadState:
    return OffloadState.allocate("g", [GroupLayout(g, g, [g], 2, 32, 256, [(4, 2, torch.bfloat16)])
                                       for g in range(groups)])


def _plan(g, step: int) -> None:
    topk = (torch.arange(64, dtype=torch.int32) + step).repeat(2, 1).reshape(2, 1, 1, 64).contiguous()
    torch.ops.custom.dsa_plan(topk, torch.tensor([200 + step, 210 + step], dtype=torch.int32), g.pool_ids,
                              g.id_to_slot, g.lru_counter)


def test_a_recorder_gets_its_states_calls_only_until_removed():
    st, other = _state(), _state(1)
    got = []

    def rec(group: int, topk: torch.Tensor, lengths: torch.Tensor) -> None:
        got.append((group, topk.shape, int(topk[0, 0, 0]), lengths.tolist()))

    st.add_recorder(rec)
    for step in range(2):
        for g in st.groups + other.groups:
            _plan(g, step)
    st.remove_recorder(rec)
    _plan(st.groups[0], 5)  # removed: not recorded
    assert got == [(0, torch.Size([2, 1, 64]), 0, [200, 210]), (1, torch.Size([2, 1, 64]), 0, [200, 210]),
                   (0, torch.Size([2, 1, 64]), 1, [201, 211]), (1, torch.Size([2, 1, 64]), 1, [201, 211])]


def test_bad_recorders_are_refused_naming_the_call():
    st = _state()
    with pytest.raises(TypeError, match=r"OffloadState\.add_recorder: recorder must be a callable "
                                        r"rec\(group, topk, lengths\), got int"):
        st.add_recorder(3)
    with pytest.raises(ValueError, match=r"OffloadState\.remove_recorder: this recorder is not attached"):
        st.remove_recorder(print)
    st.add_recorder(print)
    with pytest.raises(ValueError, match=r"OffloadState\.add_recorder: this recorder is attached already"):
        st.add_recorder(print)
    st.remove_recorder(print)
    with pytest.raises(TypeError, match=r"set_trace_recorder: factory must be a callable"):
        recording.set_trace_recorder(None)


def test_record_trace_without_a_trace_package_says_how(monkeypatch):
    monkeypatch.setattr(recording, "_trace_factory", None)
    st = _state()
    with pytest.raises(RuntimeError, match=r"OffloadState\.record_trace: no trace recorder is registered: import "
                                           r"offload_passes\.trace"):
        st.record_trace()
    st.record_trace(False)  # nothing recording: nothing to stop
