"""The host half of new-request detection (offload_passes/state.py, docs/new-requests.md): the full
caches' version counters are compared before every step with their values after the state's last step."""
from __future__ import annotations

import logging

import torch

from offload_passes.state import GroupLayout, StateRegistry, after_step, cache_versions


def _bound():
    reg = StateRegistry()
    kv, rope = torch.zeros(2, 64, 8, dtype=torch.bfloat16), torch.zeros(2, 64, 4, dtype=torch.bfloat16)
    lay = GroupLayout(0, 0, [0], 2, 32, 64, [(8, 4, torch.bfloat16)])
    st = reg.bind("g", [lay], [[kv, rope]])
    return reg, st, kv, rope


def _step(reg, st, caches, write=None):
    """What _Compiled does around one call: activate, (the graph reads the flag), after the call."""
    reg.activate(st, [caches])
    flag = int(st.groups[0].external_write[0])
    if write is not None:
        write()  # the graph's own cache write (moves the counter too: recorded after the call)
    after_step(st.groups[0].shared, caches)
    return flag


def test_an_outside_write_sets_the_flag_for_one_step_only():
    reg, st, kv, rope = _bound()
    assert _step(reg, st, [kv, rope]) == 0  # fresh: nothing cached, nothing to invalidate
    assert _step(reg, st, [kv, rope], write=lambda: kv[0, 5].fill_(1)) == 0  # the graph's own write
    assert _step(reg, st, [kv, rope]) == 0
    rope[1, 3] = 2.0  # an eager prefill of row 1, say
    assert _step(reg, st, [kv, rope]) == 1
    assert int(st.groups[0].external_write[0]) == 0  # cleared after the step that consumed it
    assert _step(reg, st, [kv, rope]) == 0


def test_an_announcement_does_not_hide_an_outside_write():
    """reset(rows=[1]) invalidates row 1 at once, but a counter cannot say that only row 1 was
    written (the soak's announced re-fill of one row beside an unannounced one of the other): the flag
    still invalidates every row."""
    reg, st, kv, rope = _bound()
    _step(reg, st, [kv, rope])
    st.reset(rows=[1])
    kv[1].zero_()
    kv[0, 3].fill_(2.0)  # another row re-filled in the same interval, unannounced
    assert _step(reg, st, [kv, rope]) == 1


def test_a_full_reset_needs_no_flag():
    reg, st, kv, rope = _bound()
    _step(reg, st, [kv, rope])
    st.reset()
    kv.zero_()
    assert _step(reg, st, [kv, rope]) == 0  # nothing is cached after a full reset


def test_inference_tensors_are_invalidated_every_step_with_one_warning(caplog):
    with torch.inference_mode():
        kv, rope = torch.zeros(2, 64, 8, dtype=torch.bfloat16), torch.zeros(2, 64, 4, dtype=torch.bfloat16)
    assert cache_versions([kv, rope]) is None
    reg = StateRegistry()
    lay = GroupLayout(0, 0, [0], 2, 32, 64, [(8, 4, torch.bfloat16)])
    st = reg.bind("inference_graph", [lay], [[kv, rope]])
    with caplog.at_level(logging.WARNING, logger="offload_passes"):
        flags = [_step(reg, st, [kv, rope]) for _ in range(3)]
    assert flags == [1, 1, 1]
    warns = [r for r in caplog.records if "inference tensors" in r.getMessage()]
    assert len(warns) == 1 and "torch.no_grad()" in warns[0].getMessage()
