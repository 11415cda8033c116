"""TEST DOUBLE for the CANN-linked module ``torchair.core._torchair`` (``_torchair.so`` in torch_npu).

The real module is a C++ extension linked against CANN's Graph Engine; it cannot load on a machine
without CANN. This pure-Python double provides just what TorchAir's Python code touches when it
*builds* GE graphs (docs/platform.md §3 "Stand-ins needed for CPU GE-graph tests"):

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
# definition order.
_I = "required"
_O = "optional"
_ATTR_KINDS = {"IntType": "VT_INT", "FloatType": "VT_FLOAT", "BoolType": "VT_BOOL", "StringType": "VT_STRING"}


def ir_from_spec(spec) -> Tuple[List[Tuple[str, str]], List[Tuple[str, str]], List[Tuple[str, str]]]:
    """The CANN definition of one of OUR ops, derived from its ``OpSpec`` (the CANN op definitions,
    ops/ascendc/src/<op>/op_host/<op>_def.cpp of cann-recipes-infer, follow the same rule: tensor
    arguments as inputs in schema order, the others as attrs, the spec's output names)."""
    from offload_passes.custom_ops.opspec import is_tensor_arg

    args = spec.parsed.arguments
    inputs = [(a.name, _O if a.type.kind() == "OptionalType" else _I) for a in args if is_tensor_arg(a)]
    attrs = [(spec.ge_attr(a.name), _ATTR_KINDS[a.type.kind()]) for a in args if not is_tensor_arg(a)]
    return inputs, [(o, _I) for o in spec.ge_outputs], attrs


def _our_ops() -> dict:
    from offload_passes.custom_ops import OP_SPECS

    return {s.ge_type: ir_from_spec(s) for s in OP_SPECS if s.namespace == "custom" and s.ge_type}


IR_TABLE: Dict[str, Tuple[List[Tuple[str, str]], List[Tuple[str, str]], List[Tuple[str, str]]]] = {
    # DsaPlan, DsaServe, DsaInstall, GatherSelectionKvCache
    **_our_ops(),
    # torch_npu's attention ops, transcribed from torch_npu's converters (facts about GE, not ours;
    # tests/ops/test_opspec.py checks they agree with our references' specs)
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
