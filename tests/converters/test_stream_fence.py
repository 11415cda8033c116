"""converters/stream_fence.py: the event-ordering check used where npugraph_ex / TorchAir only accept
users on one stream (torch-npu 2.8). Plain FX graphs; the event ops are stand-in functions with
npugraph_ex's op names (only names and ``stream_label`` meta matter to the check)."""
from __future__ import annotations

import operator

import pytest
from torch import fx

from offload_passes.converters.stream_fence import event_fenced, fenced_stream_check


def tagged_event_record(tag):  # stand-ins: the check reads op names and the tag argument only
    pass


def tagged_event_wait(tag):
    pass


class G:
    """Builds a graph node by node; ``stream`` is the ``stream_label`` meta (None = main)."""

    def __init__(self):
        self.g = fx.Graph()
        self.x = self.g.placeholder("x")
        self.x.meta["stream_label"] = None

    def op(self, name, stream=None, *args):
        n = self.g.call_function(operator.neg if not args else args[0], (self.x,) if not args else args[1:])
        n.name = name
        n.meta["stream_label"] = stream
        return n

    def rec(self, tag, stream=None):
        n = self.g.call_function(tagged_event_record, (tag,))
        n.meta["stream_label"] = stream
        return n

    def wait(self, tag, stream=None):
        n = self.g.call_function(tagged_event_wait, (tag,))
        n.meta["stream_label"] = stream
        return n


def test_same_stream_users_need_no_events():
    b = G()
    w = b.op("write", "side")
    u = b.op("user", "side")
    assert event_fenced(w, [u])


def test_cross_stream_user_without_events_is_refused():
    b = G()
    w = b.op("write", "side")
    u = b.op("user", None)
    assert not event_fenced(w, [u])


def test_record_after_write_and_wait_before_user_fences_it():
    b = G()
    w = b.op("write", "side")
    b.rec("done", "side")
    b.wait("done", None)
    u = b.op("user", None)
    assert event_fenced(w, [u])


def test_wait_after_the_user_does_not_fence_it():
    b = G()
    w = b.op("write", "side")
    b.rec("done", "side")
    u = b.op("user", None)
    b.wait("done", None)
    assert not event_fenced(w, [u])


def test_record_issued_before_the_write_does_not_fence_it():
    b = G()
    b.rec("early", "side")
    w = b.op("write", "side")
    b.wait("early", None)
    u = b.op("user", None)
    assert not event_fenced(w, [u])


def test_events_chain_through_a_third_stream():
    b = G()
    w = b.op("write", "side")
    b.rec("a", "side")
    b.wait("a", "other")
    b.rec("b", "other")
    b.wait("b", None)
    u = b.op("user", None)
    assert event_fenced(w, [u])


def test_user_ordered_before_the_write_by_events():
    """The serve (main) reads a pool that the side-stream install writes after waiting on ``ready``."""
    b = G()
    u = b.op("serve", None)
    b.rec("ready", None)
    b.wait("ready", "side")
    w = b.op("install", "side")
    assert event_fenced(w, [u])


def test_user_recorded_after_the_wait_is_not_ordered_before_the_write():
    b = G()
    b.rec("ready", None)
    u = b.op("serve", None)
    b.wait("ready", "side")
    w = b.op("install", "side")
    assert not event_fenced(w, [u])


def test_unlabelled_graph_falls_back_to_one_stream_rule():
    b = G()
    w = b.op("write", "side")
    del w.meta["stream_label"]
    u1, u2 = b.op("u1", None), b.op("u2", None)
    assert event_fenced(w, [u1])  # fewer than two users: nothing to order
    assert event_fenced(w, [u1, u2])  # all users on one labelled stream
    u2.meta["stream_label"] = "side"
    assert not event_fenced(w, [u1, u2])


@pytest.mark.parametrize("fenced", [True, False])
def test_stream_check_applies_to_every_mutated_argument(fenced):
    b = G()
    w = b.op("write", "side")
    if fenced:
        b.rec("done", "side")
        b.wait("done", None)
    u = b.op("user", None)
    calls = []

    def users_of(node, indices):
        calls.append((node, list(indices)))
        return [[], [u]]  # first mutated argument unused, second read on the main stream

    assert fenced_stream_check(users_of, [5, 6])(w) is fenced
    assert calls == [(w, [5, 6])]
