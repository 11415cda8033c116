"""GE converters (ge_graph mode), run against TorchAir's real graph-building code.

Each converter is called inside a ``GeGraph`` on ``Data`` inputs, as TorchAir's parser does, and the
protobuf node is checked against the CANN op definition kept in the ``_torchair`` test double: op type,
input order and names, output (ref) names, typed attrs; functional twins must ``TensorMove`` exactly the
mutated inputs and return the functional schema's outputs.
"""
from __future__ import annotations

import pytest
import torch

from offload_passes.converters.ge_ref_patch import REF_IDX
from offload_passes.custom_ops import OP_SPECS, spec_for

CUSTOM_SPECS = tuple(s for s in OP_SPECS if s.namespace == "custom")
REF_SPECS = tuple(s for s in OP_SPECS if s.namespace == "offload_ref" and s.ge_type)  # torch_npu ops' references

pytestmark = pytest.mark.usefixtures("torchair")

F16, I32, I8 = "DT_FLOAT16", "DT_INT32", "DT_INT8"

# Per op: (dtype of each tensor input, attrs passed as kwargs). Attr values differ from the schema
# defaults so a dropped or defaulted attr is caught.
CASES = {
    "dsa_plan": ([I32] * 5, {"raw_seq": 3, "group_id": 4, "owner_layer": 6, "group_kind": 1}),
    "dsa_serve": ([I32] + [F16] * 6, {"raw_seq": 2, "topk": 64, "selection_block_size": 16, "compact_layout": 0}),
    "dsa_install": ([I8, F16, F16, I32, F16, F16, I32, I32, I32],
                    {"raw_seq": 4, "topk": 128, "selection_block_size": 32, "metadata_update": 0}),
    "npu_gather_selection_kv_cache": ([F16, F16] + [I32] * 3 + [F16, F16] + [I32] * 3,
                                      {"selection_topk_block_size": 1}),
}
REF_CASES = {
    "npu_lightning_indexer": (
        ["DT_BF16", "DT_BF16", "DT_BF16", I32, I32, I32],
        {"layout_query": "TND", "layout_key": "PA_BSND", "sparse_count": 64, "sparse_mode": 3,
         "return_value": True},
    ),
    "npu_sparse_flash_attention": (
        ["DT_BF16", "DT_BF16", "DT_BF16", I32, I32, I32, I32, "DT_BF16", "DT_BF16"],
        {"layout_query": "TND", "layout_kv": "PA_BSND", "sparse_mode": 3, "attention_mode": 2,
         "sparse_block_size": 1},
    ),
}


def _ge():
    from torchair._ge_concrete_graph import ge_apis as ge
    from torchair.ge._ge_graph import DataType, GeGraph

    return ge, DataType, GeGraph


def _tensor_args(overload):
    return [a for a in overload._schema.arguments if "Tensor" in str(a.type)]


def _build(ns: str, name: str, dtypes, kwargs, extra_positional=(), shapes=None):
    """Run ``name``'s converter on Data inputs (``[4, 8]``, or ``shapes[arg]``); return (graph proto, result)."""
    ge, DataType, GeGraph = _ge()
    overload = getattr(getattr(torch.ops, ns), name).default
    targs = _tensor_args(overload)[: len(dtypes)]
    shapes = shapes or {}
    with GeGraph() as g:
        inputs = [ge.Data(index=i, dtype=getattr(DataType, dt), shape=shapes.get(a.name, [4, 8]), placement="NPU",
                          node_name=a.name)
                  for i, (a, dt) in enumerate(zip(targs, dtypes))]
        positional = [t for a, t in zip(targs, inputs) if not a.kwarg_only]
        by_name = {a.name: t for a, t in zip(targs, inputs) if a.kwarg_only}
        result = overload._ge_converter(*positional, *extra_positional, meta_outputs=None, **by_name, **kwargs)
    return g._proto, result


def _nodes(proto, op_type):
    return [op for op in proto.op if op.type == op_type]


def _attr_value(a):
    field = a.WhichOneof("value")
    v = getattr(a, field)
    return v.decode() if isinstance(v, bytes) else v


def _check_node(node, ir, kwargs, spec):
    inputs, outputs, attrs = ir
    assert [d.name for d in node.input_desc] == [n for n, _ in inputs]
    assert [d.name for d in node.output_desc] == [n for n, _ in outputs] == list(spec.ge_outputs)
    ir_attrs = dict(attrs)
    expected_kind = {"VT_INT": "i", "VT_FLOAT": "f", "VT_STRING": "s", "VT_BOOL": "b"}
    for k, v in kwargs.items():
        ge_name = spec.ge_attr(k)
        assert ge_name in ir_attrs, f"attr {ge_name} not in the CANN definition"
        a = node.attr[ge_name]
        assert a.WhichOneof("value") == expected_kind[ir_attrs[ge_name]], ge_name
        assert _attr_value(a) == v
    # every attr the node carries is a CANN attr (no stray python-only names)
    assert {k for k in node.attr if not k.startswith("_")} <= set(ir_attrs)


@pytest.mark.parametrize("spec", CUSTOM_SPECS, ids=lambda s: s.name)
def test_inplace_converter_node(spec, torchair_core_double):
    dtypes, kwargs = CASES[spec.name]
    proto, result = _build(spec.namespace, spec.name, dtypes, kwargs)
    (node,) = _nodes(proto, spec.ge_type)
    assert not _nodes(proto, "TensorMove"), "the in-place op must work on the original inputs"
    _check_node(node, torchair_core_double.IR_TABLE[spec.ge_type], kwargs, spec)
    # inputs wired straight to the Data nodes, in schema order
    data_names = [a.name for a in _tensor_args(getattr(torch.ops.custom, spec.name).default)]
    assert list(node.input) == [f"{n}:0" for n in data_names]
    # returns exactly what the torch schema returns
    if spec.name in ("dsa_serve", "dsa_install"):
        assert result is None
    elif spec.name == "npu_gather_selection_kv_cache":
        assert result.tensor == f"{node.name}:{spec.ge_outputs.index('selection_kv_actual_seq')}"
    else:  # dsa_plan
        assert [t.tensor for t in result] == [f"{node.name}:{i}" for i in range(3)]


@pytest.mark.parametrize("spec", [s for s in CUSTOM_SPECS if s.functional], ids=lambda s: s.functional)
def test_functional_converter_tensormoves_exactly_the_mutated_inputs(spec, torchair_core_double):
    dtypes, kwargs = CASES[spec.name]
    proto, result = _build(spec.namespace, spec.functional, dtypes, kwargs)
    (node,) = _nodes(proto, spec.ge_type)
    _check_node(node, torchair_core_double.IR_TABLE[spec.ge_type], kwargs, spec)
    moves = {op.name: op for op in _nodes(proto, "TensorMove")}
    assert sorted(m.input[0] for m in moves.values()) == sorted(f"{n}:0" for n in spec.mutated)
    names = [d.name for d in node.input_desc]
    for name, src in zip(names, node.input):
        if name in spec.mutated:
            assert src.split(":")[0] in moves and moves[src.split(":")[0]].input[0] == f"{name}:0"
        else:
            assert src == f"{name}:0"
    # returns (*non-ref outputs, *updated mutated inputs in schema order)
    expected = [spec.ge_outputs.index(n) for n in spec.non_ref_outputs + spec.mutated]
    assert [t.tensor for t in result] == [f"{node.name}:{i}" for i in expected]
    assert len(result) == len(getattr(torch.ops.custom, spec.functional).default._schema.returns)


@pytest.mark.parametrize("name", ["dsa_serve", "dsa_serve_functional", "dsa_install", "dsa_install_functional"])
def test_no_rope_mode_passes_zero_width_rope_inputs(name, torchair_core_double):
    """The no-rope mode (Dr = 0, docs/ops.md §3.3): the rope inputs reach the CANN node as zero-width tensors
    ``[..., 0]`` at their schema positions (CANN's schema and input count unchanged); a twin's TensorMove copies
    the zero-width rope it mutates."""
    spec = spec_for(name)
    dtypes, kwargs = CASES[spec.name]
    rope = {"full_k_rope": [2, 40, 0], "pool_k_rope": [2, 32, 0], "selection_k_rope": [8, 16, 0]}
    proto, _ = _build(spec.namespace, name, dtypes, kwargs, shapes=rope)
    (node,) = _nodes(proto, spec.ge_type)
    _check_node(node, torchair_core_double.IR_TABLE[spec.ge_type], kwargs, spec)
    moved = spec.mutated if name == spec.functional else ()
    seen = {d.name: list(d.shape.dim) for d in node.input_desc if d.name in rope and d.name not in moved}
    assert seen == {n: v for n, v in rope.items() if n in spec.ge_inputs and n not in moved}, seen
    data = {op.name: list(op.output_desc[0].shape.dim) for op in proto.op if op.type == "Data"}
    for move in _nodes(proto, "TensorMove"):  # a twin copies its mutated rope: the zero-width Data
        src = move.input[0].split(":")[0]
        assert src in spec.mutated and (src not in rope or data[src] == rope[src])


@pytest.mark.parametrize("spec", [s for s in CUSTOM_SPECS if s.functional], ids=lambda s: s.name)
def test_ref_outputs_name_their_inputs(spec, torchair_core_double):
    """GE pairs a ref output with the input of the same name; check the index pairs GE will see."""
    dtypes, kwargs = CASES[spec.name]
    proto, _ = _build(spec.namespace, spec.name, dtypes, kwargs)
    (node,) = _nodes(proto, spec.ge_type)
    ins = [d.name for d in node.input_desc]
    pairs = {o: ins.index(d.name) for o, d in enumerate(node.output_desc) if d.name in ins}
    assert [ins[i] for i in pairs.values()] == list(spec.mutated)
    if spec.ge_type in REF_IDX:
        assert pairs == REF_IDX[spec.ge_type]
    else:  # TorchAir already knows GatherSelectionKvCache; its table must agree with our names
        from torchair._ge_concrete_graph import graph_pass

        assert graph_pass._get_output_to_input_ref_idx(node) == pairs == {0: 0, 1: 1, 2: 2, 3: 3}


@pytest.mark.parametrize("spec", REF_SPECS, ids=lambda s: s.name)
def test_reference_attention_ops_map_to_cann_ops(spec, torchair_core_double):
    dtypes, kwargs = REF_CASES[spec.name]
    extra = (0.125,) if spec.name == "npu_sparse_flash_attention" else ()
    proto, result = _build(spec.namespace, spec.name, dtypes, kwargs, extra_positional=extra)
    (node,) = _nodes(proto, spec.ge_type)
    inputs, outputs, attrs = torchair_core_double.IR_TABLE[spec.ge_type]
    got = [d.name for d in node.input_desc]
    assert got == [n for n, _ in inputs][: len(got)]  # trailing optional `sinks` omitted when absent
    assert [d.name for d in node.output_desc] == [n for n, _ in outputs]
    for k, v in kwargs.items():
        assert _attr_value(node.attr[spec.ge_attr(k)]) == v
    if extra:
        assert node.attr["scale_value"].f == pytest.approx(0.125)
    assert "return_value" not in node.attr  # renamed to CANN's return_values
    assert len(result) == len(outputs)


def test_unset_optional_tensor_is_an_empty_input():
    spec = spec_for("npu_lightning_indexer")
    dtypes, kwargs = REF_CASES[spec.name]
    ge, DataType, GeGraph = _ge()
    op = torch.ops.offload_ref.npu_lightning_indexer.default
    with GeGraph() as g:
        q, k, w = (ge.Data(index=i, dtype=DataType.DT_BF16, shape=[2], placement="NPU", node_name=n)
                   for i, n in enumerate(("query", "key", "weights")))
        op._ge_converter(q, k, w, meta_outputs=None)
    (node,) = _nodes(g._proto, "LightningIndexer")
    assert list(node.input)[3:] == ["", "", ""]
    assert node.attr["sparse_count"].i == 2048 and node.attr["layout_query"].s == b"BSND"


def test_converter_rejects_non_tensor_for_tensor_argument():
    ge, DataType, GeGraph = _ge()
    op = torch.ops.custom.dsa_plan.default
    with GeGraph():
        t = ge.Data(index=0, dtype=DataType.DT_INT32, shape=[2], placement="NPU", node_name="t")
        with pytest.raises(RuntimeError, match=r"custom::dsa_plan: tensor argument lru_counter is int"):
            op._ge_converter(t, t, t, t, 3, meta_outputs=None)
        with pytest.raises(RuntimeError, match=r"custom::dsa_plan: missing argument 'lru_counter'"):
            op._ge_converter(t, t, t, t, meta_outputs=None)
        with pytest.raises(RuntimeError, match=r"custom::dsa_plan: argument raw_seq must be a compile-time"):
            op._ge_converter(t, t, t, t, t, raw_seq=t, meta_outputs=None)


def test_converters_only_emit_registered_cann_ops(torchair_core_double):
    """Every GE op type our converters emit is one the IR table (CANN definitions) knows."""
    del torchair_core_double.QUERIED[:]
    for spec in CUSTOM_SPECS:
        dtypes, kwargs = CASES[spec.name]
        for name in filter(None, (spec.name, spec.functional)):
            _build(spec.namespace, name, dtypes, kwargs)
    assert set(torchair_core_double.QUERIED) == {s.ge_type for s in CUSTOM_SPECS}
    assert torchair_core_double.get_registered_ir_def("DsaServ")[0] == "ERROR"


def test_register_is_idempotent_and_replaces_foreign_converters():
    from torchair._ge_concrete_graph.fx2ge_converter import register_fx_node_ge_converter

    from offload_passes import converters

    op = torch.ops.custom.dsa_serve.default

    def foreign(*args, meta_outputs=None, **kwargs):  # e.g. a converter returning the ref outputs
        raise AssertionError("foreign converter used")

    register_fx_node_ge_converter(op)(foreign)
    assert op._ge_converter.__name__ == "foreign"
    first = converters.register_ge()
    second = converters.register_ge()
    assert first == second and "custom::dsa_serve" in first
    assert op._ge_converter.__module__ == "offload_passes.converters.ge_converters"
