"""``OffloadState``: the pools and per-group metadata a rewritten graph uses on one set of full caches.

Per layer ``l``: ``pool_kv [B, PS, Dkv]``, ``pool_rope [B, PS, Dr]`` (KV dtype). Per group ``g``:
``pool_ids [B, PS]`` (-1), ``id_to_slot [B, IR]`` (-1), ``lru_counter [B, PS/16]`` (0) int32, and
``stats [2, 7]`` int64 written *in the graph* every step: row 0 = this step's plan-kind counts
(``custom_ops/plan_kind.py``, kinds 0..5, then 1 for the step), row 1 = the running sum. hits =
POOL_HIT, misses = FULL_OLD_MISS, window = DECODE_WINDOW; host rows read = (misses + window) × layers
of the group (every layer serves the same plan from its own host cache). ``seen_len [B]`` int32: each
row's cache length at the previous step; ``external_write [1]`` int32: set by the host when the full
caches were written outside the graph since the last step (version counters). Paged groups also keep
``seen_table [B, maxblk]`` int32, each row's block table at the previous step. The graph uses them to
invalidate new requests' rows; the host side (``OffloadState.begin_request`` / ``move_rows``) is the
engine's account of its batch (docs/new-requests.md).

Ownership: the tensors belong to the full caches, not to a graph. In the CPU modes they are
extra inputs of the rewritten graph, chosen per call by :class:`StateBinder` from :data:`REGISTRY`,
keyed by the caches' storage (:func:`cache_key`: the tensor that owns the memory, the address, shape
and strides; a fresh view object of the same cache finds the same state). Every graph whose group
has the same pool geometry (pool size, id range, dims, paged or not) on the same caches shares one
:class:`GroupPools`, whatever its batch size: its tensors have one row per cache row (the largest
batch bound so far) and a graph of batch ``B`` serves rows ``0 .. B-1`` (views). In the NPU modes the
tensors are buffers of the graph (private) and the same stale-state rule applies. Every method here
works in place: a graph that holds the tensors keeps holding them (only a per-call binding grows a
shared group, see :meth:`GroupPools.grow`).

One job per file: ``checks.py`` (the public calls' argument checks), ``pools.py`` (the tensors:
:class:`GroupPools`, :class:`GroupState`, :class:`GroupLayout`), ``api.py`` (:class:`OffloadState`, what
users and engines call), ``recording.py`` (the recording hook: recorders a state hands its groups'
``dsa_plan`` inputs; the trace package supplies ``record_trace``'s), ``registry.py`` (the state by
the caches: :func:`cache_key`, :class:`StateRegistry`, :func:`module_state`), ``writes.py`` (outside
writes by version counters) and ``binder.py`` (:class:`StateBinder`, the per-call binding).
"""
from __future__ import annotations

from .api import OffloadState
from .binder import StateBinder
from .checks import ROW_FORMS, check_flag, row_indices
from .pools import STATS_WIDTH, GroupLayout, GroupPools, GroupState, reset_shared
from .recording import Recorder, TraceRecorder, set_trace_recorder
from .registry import REGISTRY, StateRegistry, cache_key, cache_keys, module_state
from .writes import after_step, cache_versions, check_outside_writes

__all__ = ["OffloadState", "StateBinder", "ROW_FORMS", "check_flag", "row_indices", "STATS_WIDTH", "GroupLayout",
           "GroupPools", "GroupState", "reset_shared", "Recorder", "TraceRecorder", "set_trace_recorder", "REGISTRY",
           "StateRegistry", "cache_key", "cache_keys", "module_state", "after_step", "cache_versions",
           "check_outside_writes"]
