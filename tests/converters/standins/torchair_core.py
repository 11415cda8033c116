"""TEST DOUBLE for the CANN-linked module ``torchair.core._torchair`` (``_torchair.so`` in torch_npu).

The real module is a C++ extension linked against CANN's Graph Engine; it cannot load on a machine
without CANN. This pure-Python double provides just what TorchAir's Python code touches when it
*builds* GE graphs (spec/torchair.md §3 "Stand-ins needed for CPU GE-graph tests"):

* ``TorchNpuGraphBase``: ``load``/``set_hint_shape`` accept anything; ``compile``/``run``/``auto_tune``
  raise, because nothing can execute a GE graph here;
* ``get_registered_ir_def(op_type)``: answers from :data:`IR_TABLE` (the CANN op definitions of the
  ops our converters emit) and reports every other op as unregistered, so a converter that emits a
  misspelt op type fails instead of being accepted silently;
* no-op engine / dump / log entry points, ``check_cann_compat`` -> ``""`` and ``TorchDataType``.

It never executes anything: tests that use it assert on the graph protobuf only.
"""
from __future__ import annotations

import types
from typing import Dict, List, Tuple

# IR definitions as GE registers them: (inputs, outputs, attrs), each a list of (name, kind/type) in
# definition order. Transcribed from the CANN op definitions (ops/ascendc/src/<op>/op_host/<op>_def.cpp
# of cann-recipes-infer for the DSA ops; torch_npu's converters for the two attention ops).
_I = "required"
_O = "optional"
IR_TABLE: Dict[str, Tuple[List[Tuple[str, str]], List[Tuple[str, str]], List[Tuple[str, str]]]] = {
    "DsaPlan": (
        [("selection_topk_indices", _I), ("full_kv_actual_seq", _I), ("pool_ids", _I),
         ("id_to_slot", _I), ("lru_counter", _I)],
        [("plan", _I), ("install_records", _I), ("selection_kv_actual_seq", _I)],
        [("raw_seq", "VT_INT"), ("group_id", "VT_INT"), ("owner_layer", "VT_INT"), ("group_kind", "VT_INT")],
    ),
    "DsaServe": (
        [("plan", _I), ("full_kv_cache", _I), ("full_k_rope", _I), ("pool_kv_cache", _I),
         ("pool_k_rope", _I), ("selection_kv_cache", _I), ("selection_k_rope", _I)],
        [("selection_kv_cache", _I), ("selection_k_rope", _I)],
        [("raw_seq", "VT_INT"), ("topk", "VT_INT"), ("selection_block_size", "VT_INT"),
         ("compact_layout", "VT_INT")],
    ),
    "DsaInstall": (
        [("install_records", _I), ("selection_kv_cache", _I), ("selection_k_rope", _I),
         ("selection_kv_block_table", _I), ("pool_kv_cache", _I), ("pool_k_rope", _I),
         ("pool_ids", _I), ("id_to_slot", _I), ("lru_counter", _I)],
        [("pool_kv_cache", _I), ("pool_k_rope", _I), ("pool_ids", _I), ("id_to_slot", _I),
         ("lru_counter", _I)],
        [("raw_seq", "VT_INT"), ("topk", "VT_INT"), ("selection_block_size", "VT_INT"),
         ("metadata_update", "VT_INT")],
    ),
    "GatherSelectionKvCache": (
        [("selection_k_rope", _I), ("selection_kv_cache", _I), ("selection_kv_block_table", _I),
         ("selection_kv_block_status", _I), ("selection_topk_indices", _I), ("full_k_rope", _I),
         ("full_kv_cache", _I), ("full_kv_block_table", _I), ("full_kv_actual_seq", _I),
         ("full_q_actual_seq", _I)],
        [("selection_k_rope", _I), ("selection_kv_cache", _I), ("selection_kv_block_table", _I),
         ("selection_kv_block_status", _I), ("selection_kv_actual_seq", _I)],
        [("selection_topk_block_size", "VT_INT")],
    ),
    "LightningIndexer": (
        [("query", _I), ("key", _I), ("weights", _I), ("actual_seq_lengths_query", _O),
         ("actual_seq_lengths_key", _O), ("block_table", _O)],
        [("sparse_indices", _I), ("sparse_values", _I)],
        [("layout_query", "VT_STRING"), ("layout_key", "VT_STRING"), ("sparse_count", "VT_INT"),
         ("sparse_mode", "VT_INT"), ("pre_tokens", "VT_INT"), ("next_tokens", "VT_INT"),
         ("return_values", "VT_BOOL")],
    ),
    "SparseFlashAttention": (
        [("query", _I), ("key", _I), ("value", _I), ("sparse_indices", _I), ("block_table", _O),
         ("actual_seq_lengths_query", _O), ("actual_seq_lengths_kv", _O), ("query_rope", _O),
         ("key_rope", _O), ("sinks", _O)],
        [("attention_out", _I), ("softmax_max", _I), ("softmax_sum", _I)],
        [("scale_value", "VT_FLOAT"), ("sparse_block_size", "VT_INT"), ("layout_query", "VT_STRING"),
         ("layout_kv", "VT_STRING"), ("sparse_mode", "VT_INT"), ("pre_tokens", "VT_INT"),
         ("next_tokens", "VT_INT"), ("attention_mode", "VT_INT"), ("return_softmax_lse", "VT_BOOL")],
    ),
}

#: Every op type TorchAir asked about (tests can assert the converters only used known IR).
QUERIED: List[str] = []


class TorchNpuGraphBase:
    """Graph handle of the real extension; here it only remembers what was loaded."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.loaded = None

    def load(self, serialized_graph, *args, **kwargs) -> None:
        self.loaded = serialized_graph

    def set_hint_shape(self, *args, **kwargs) -> None:
        return None

    def compile(self, *args, **kwargs):
        raise RuntimeError("TEST DOUBLE torchair.core._torchair: GE graphs cannot be compiled without CANN")

    def auto_tune(self, *args, **kwargs):
        raise RuntimeError("TEST DOUBLE torchair.core._torchair: GE graphs cannot be tuned without CANN")

    def run(self, *args, **kwargs):
        raise RuntimeError("TEST DOUBLE torchair.core._torchair: GE graphs cannot run without CANN")


def get_registered_ir_def(op_type: str):
    QUERIED.append(op_type)
    if op_type not in IR_TABLE:
        return "ERROR", [], [], []
    inputs, outputs, attrs = IR_TABLE[op_type]
    return "SUCCESS", list(inputs), list(outputs), list(attrs)


def check_cann_compat(*args, **kwargs) -> str:
    return ""


def _noop(*args, **kwargs):
    return None


class _DataTypes:
    """``TorchDataType.<NAME>`` -> a distinct int per name (only read at import time)."""

    def __init__(self) -> None:
        self._ids: Dict[str, int] = {}

    def __getattr__(self, name: str) -> int:
        if name.startswith("__"):
            raise AttributeError(name)
        return self._ids.setdefault(name, len(self._ids))


def _unavailable(name: str):
    def fn(*args, **kwargs):
        raise RuntimeError(f"TEST DOUBLE torchair.core._torchair: {name} needs CANN")

    return fn


def make_module(qualname: str = "torchair.core._torchair") -> types.ModuleType:
    """A fresh module object exposing this double's API, labelled as a test double."""
    mod = types.ModuleType(qualname, __doc__)
    mod.__file__ = __file__
    mod.TEST_DOUBLE = True
    mod.IR_TABLE = IR_TABLE
    mod.QUERIED = QUERIED
    mod.TorchNpuGraphBase = TorchNpuGraphBase
    mod.get_registered_ir_def = get_registered_ir_def
    mod.check_cann_compat = check_cann_compat
    mod.TorchDataType = _DataTypes()
    for name in ("InitializeGraphEngine", "FinalizeGraphEngine", "InitDeviceStdoutChannel",
                 "SetDebugLogPath", "AclmdlSetDump", "AclopStartDumpArgs", "AclopStopDumpArgs"):
        setattr(mod, name, _noop)
    mod.StupidRepeat = lambda word, times: word * times
    mod.GetSocName = lambda: "TEST_DOUBLE"
    mod.export = _unavailable("export")
    mod.as_torch_tensors = _unavailable("as_torch_tensors")
    return mod
