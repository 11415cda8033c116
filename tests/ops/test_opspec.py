"""The op specs (``custom_ops/opspec.py``) are the single source of every op fact, and what is derived from
them is what the registries, converters and passes actually install.

The tables are re-derived here from the dispatcher's own schemas (alias annotations), not from the spec
helpers, and compared with exact values and with what registration produces.
"""
from __future__ import annotations

import dataclasses
import runpy
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import fx

from offload_passes import _compat
from offload_passes.custom_ops import CUSTOM_OPS, OP_SPECS, spec_for
from offload_passes.custom_ops.opspec import GeOp, Limit, OpSpec, counted_names, ge_ref_table, reinplace_pairs

STANDIN = Path(__file__).resolve().parents[1] / "testdoubles" / "torchair_core.py"

CUSTOM = ["custom::dsa_install", "custom::dsa_install_functional", "custom::dsa_plan", "custom::dsa_serve",
          "custom::dsa_serve_functional", "custom::npu_gather_selection_kv_cache",
          "custom::npu_gather_selection_kv_cache_functional"]
OFFLOAD_REF = ["offload_ref::dsa_install_sc", "offload_ref::npu_lightning_indexer",
               "offload_ref::npu_mla_prolog_cache_write_", "offload_ref::npu_moe_distribute_combine_v2",
               "offload_ref::npu_moe_distribute_dispatch_v2", "offload_ref::npu_quant_lightning_indexer",
               "offload_ref::npu_scatter_nd_update_", "offload_ref::npu_sparse_flash_attention",
               "offload_ref::static_cache_write_"]
# functional twin -> (in-place op, mutated argument positions)
PAIRS = {
    "custom::dsa_serve_functional": ("custom::dsa_serve", (5, 6)),
    "custom::dsa_install_functional": ("custom::dsa_install", (4, 5, 6, 7, 8)),
    "custom::npu_gather_selection_kv_cache_functional": ("custom::npu_gather_selection_kv_cache", (0, 1, 2, 3)),
}
COUNTED = ["dsa_install", "dsa_install_functional", "dsa_install_sc", "dsa_plan", "dsa_serve", "dsa_serve_functional",
           "npu_gather_selection_kv_cache", "npu_gather_selection_kv_cache_functional", "npu_lightning_indexer",
           "npu_quant_lightning_indexer", "npu_sparse_flash_attention"]


def _all_names():
    return [q for s in OP_SPECS for q in (s.qualname, s.functional_qualname) if q]


def _overload(qualname):
    ns, name = qualname.split("::")
    return getattr(getattr(torch.ops, ns), name).default


def _written(schema) -> list[int]:
    return [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


# ------------------------------------------------------------------------------------------ coverage

def test_every_custom_dispatcher_op_has_a_spec():
    assert _compat.dispatcher_op_names("custom") == CUSTOM
    assert sorted(q for q in _all_names() if q.startswith("custom::")) == CUSTOM
    assert sorted(f"custom::{n}" for n in CUSTOM_OPS) == CUSTOM
    assert _compat.dispatcher_op_names("offload_ref") == OFFLOAD_REF
    assert sorted(q for q in _all_names() if q.startswith("offload_ref::")) == OFFLOAD_REF


@pytest.mark.parametrize("qualname", CUSTOM + OFFLOAD_REF)
def test_spec_schema_is_the_dispatchers(qualname):
    spec = spec_for(qualname)
    ns, name = qualname.split("::")
    own = spec.schema if name == spec.name else spec.functional_schema
    assert _compat.dispatcher_schema(qualname) == f"{ns}::{own}"


@pytest.mark.parametrize("spec", OP_SPECS, ids=lambda s: s.name)
def test_derived_mutated_args_match_the_alias_info(spec):
    schema = _overload(spec.qualname)._schema
    idx = _written(schema)
    assert spec.mutated_positions == tuple(idx)
    assert spec.mutated == tuple(schema.arguments[i].name for i in idx)
    assert spec.num_leading_outputs == sum(r.alias_info is None for r in schema.returns)
    if spec.functional:
        twin = _overload(spec.functional_qualname)._schema
        assert [a.name for a in twin.arguments] == [a.name for a in schema.arguments]
        assert _written(twin) == []
        assert len(twin.returns) == spec.num_leading_outputs + len(spec.mutated)
        assert spec.functional_outputs[spec.num_leading_outputs:] == spec.mutated


def test_every_mutating_custom_op_is_covered_by_every_table():
    pairs, refs, counted = reinplace_pairs(OP_SPECS), ge_ref_table(OP_SPECS), counted_names(OP_SPECS)
    for q in CUSTOM:
        spec = spec_for(q)
        assert q.split("::")[1] in counted
        assert spec.ge_type is not None, f"{q} has no GE converter"
        if spec.mutated:
            assert pairs[spec.functional_qualname][0] == spec.qualname
            assert spec.ge_type in refs or spec.ge.ref_known


# ------------------------------------------------------------------------------------------ reinplace

def _fake_registry(monkeypatch, pkg="opspec_fake_registry"):
    """A registry module with the fields register_reinplace writes (TorchAir's is a test copy elsewhere)."""
    mod = types.ModuleType(f"{pkg}._acl_concrete_graph.graph_pass")

    @dataclasses.dataclass
    class InplaceableNpuOp:
        inplace_op: object
        mutated_arg: list
        extra_check: object

    mod.InplaceableNpuOp = InplaceableNpuOp
    mod.inplaceable_npu_ops = {}
    mod.check_multi_stream_for_multi_reinplace = lambda node: True
    mod._mutated_input_reinplace = lambda *args: None
    utils = types.ModuleType(f"{pkg}._utils.graph_utils")  # event-aware package: its own stream check
    utils.verify_cross_stream_event_protected = lambda *args: True
    monkeypatch.setitem(sys.modules, utils.__name__, utils)
    return mod


def test_reinplace_pairs_are_what_the_registry_installs(monkeypatch):
    from offload_passes.converters.npu_reinplace_registry import register_reinplace, registered

    expected = {}
    for q in CUSTOM:
        spec = spec_for(q)
        if spec.functional and q == spec.functional_qualname:  # re-derived from the dispatcher's schema
            expected[q] = (spec.qualname, tuple(_written(_overload(spec.qualname)._schema)))
    assert expected == PAIRS == reinplace_pairs(OP_SPECS)

    mod = _fake_registry(monkeypatch)
    done = register_reinplace([mod])
    assert done == {mod.__name__: [q.split("::")[1] for q in PAIRS]}
    installed = {k.name(): (v.inplace_op.name(), tuple(v.mutated_arg)) for k, v in mod.inplaceable_npu_ops.items()}
    assert installed == PAIRS
    assert registered(mod) == {k: list(v[1]) for k, v in PAIRS.items()}


def test_passes_reinplace_finds_our_twins_through_the_specs():
    from offload_passes.passes.reinplace_candidates import inplace_of

    for functional, (inplace, _) in PAIRS.items():
        assert inplace_of(_overload(functional)) is _overload(inplace)


# ------------------------------------------------------------------------------------------ GE

def test_ge_ref_table_is_the_patched_one():
    from offload_passes.converters.ge_ref_patch import REF_IDX, ref_pairs

    assert REF_IDX == ge_ref_table(OP_SPECS) == {"DsaServe": {0: 5, 1: 6},
                                                 "DsaInstall": {0: 4, 1: 5, 2: 6, 3: 7, 4: 8}}
    # TorchAir's own table lists the gather with these pairs (tests/converters/test_ge_converters.py)
    assert spec_for("npu_gather_selection_kv_cache").ge_ref_map == {0: 0, 1: 1, 2: 2, 3: 3}
    for ge_type, pairs in REF_IDX.items():
        spec = next(s for s in OP_SPECS if s.ge_type == ge_type)
        schema = _overload(spec.qualname)._schema
        tensors = [a.name for a in schema.arguments if a.type.kind() in ("TensorType", "OptionalType")]
        desc = types.SimpleNamespace
        op = desc(type=ge_type, name="n", input_desc=[desc(name=n) for n in tensors],
                  output_desc=[desc(name=n) for n in spec.ge_outputs])
        assert ref_pairs(op) == pairs
        assert {spec.ge_outputs[o]: tensors[i] for o, i in pairs.items()} == {m: m for m in spec.mutated}


def test_ir_table_of_the_test_double_agrees_with_the_specs():
    core = types.SimpleNamespace(**runpy.run_path(str(STANDIN)))  # the _torchair test double's module
    with_ge = {s.ge_type: s for s in OP_SPECS if s.ge_type}
    assert sorted(core.IR_TABLE) == sorted(with_ge) == ["DsaInstall", "DsaPlan", "DsaServe", "GatherSelectionKvCache",
                                                         "LightningIndexer", "SparseFlashAttention"]
    for ge_type, spec in with_ge.items():
        inputs, outputs, attrs = core.IR_TABLE[ge_type]
        assert tuple(n for n, _ in inputs) == spec.ge_inputs, ge_type
        assert tuple(n for n, _ in outputs) == spec.ge_outputs, ge_type
        assert tuple(n for n, _ in attrs) == spec.ge_attrs, ge_type
        assert attrs == core.ir_from_spec(spec)[2], ge_type  # attr names and value types
        if spec.namespace == "custom":  # ours: derived; torch_npu's: hand-written facts about GE
            assert core.IR_TABLE[ge_type] == core.ir_from_spec(spec)
    # the one place the hand-written SFA definition and the schema differ: CANN requires `value`
    assert dict(core.IR_TABLE["SparseFlashAttention"][0])["value"] == "required"
    assert dict(core.ir_from_spec(spec_for("npu_sparse_flash_attention"))[0])["value"] == "optional"
    assert spec_for("npu_lightning_indexer").ge_attrs[-1] == "return_values"


# ------------------------------------------------------------------------------------------ count_ops

def test_count_ops_keys_derive_from_the_specs():
    from offload_passes.passes import _fx
    from offload_passes.passes.producers import PRODUCER_NAMES

    assert sorted(counted_names(OP_SPECS)) == sorted(_fx.COUNTED_OPS) == COUNTED
    assert PRODUCER_NAMES <= _fx.COUNTED_OPS
    g = fx.Graph()
    x = g.placeholder("x")
    for q in _all_names():  # every op of ours once, the twin of dsa_serve twice
        for _ in range(2 if q == "custom::dsa_serve_functional" else 1):
            g.call_function(_overload(q), (x,))
    g.call_function(torch.ops.aten.add.Tensor, (x, x))
    counts = _fx.count_ops(g)
    assert list(counts) == COUNTED
    assert counts == {n: 2 if n == "dsa_serve_functional" else 1 for n in COUNTED}
    assert _fx.count_ops(fx.Graph()) == {n: 0 for n in COUNTED}


# ------------------------------------------------------------------------------------------ limits

def test_limits_have_one_definition():
    from offload_passes import options
    from offload_passes.custom_ops import _pool, dsa_install, dsa_plan, dsa_serve, npu_gather_selection_kv_cache
    from offload_passes.passes import preconditions

    plan, serve, install = spec_for("dsa_plan"), spec_for("dsa_serve"), spec_for("dsa_install")
    for name, value in (("MAX_TOPK", 2048), ("MAX_RAW_SEQ", 4), ("MAX_POOL", 16384)):
        assert plan.limit(name) == serve.limit(name) == install.limit(name) == value
    assert (serve.limit("MAX_DKV"), serve.limit("MAX_DR")) == (install.limit("MAX_DKV"), install.limit("MAX_DR")) \
        == (512, 128)
    # each user binds the spec's number
    assert (dsa_plan.MAX_TOPK, dsa_install.MAX_TOPK, npu_gather_selection_kv_cache.MAX_TOPK,
            preconditions.MAX_TOPK, dsa_serve.PROD_LIMITS["topk"]) == (2048,) * 5
    assert (_pool.MAX_POOL, options.MAX_POOL_SIZE, dsa_serve.PROD_LIMITS["pool_size"]) == (16384,) * 3
    # the one pool rule (options, preconditions, the HF front-end and the ops call it) takes the install's numbers
    assert _pool.pool_size_problem(install.limit("MAX_POOL")) is None
    assert _pool.pool_size_problem(install.limit("MAX_POOL") + install.limit("WAYS"))[0] == "must be in (0, 16384]"
    assert _pool.pool_size_problem(install.limit("WAYS") * 3) == ("/ 16 (sets) must be a power of two", 3)
    # the id range: one rule (the capacity planner sizes id_to_slot with it too, tests/tools/test_capacity_plan.py)
    assert _pool.id_range_for(1000) == _pool.MIN_ID_RANGE == 131072
    assert _pool.id_range_for(200_000) == 200_000 and _pool.id_range_for(200_000, 4096) == 4096
    assert (dsa_serve.MAX_KV_DIM, dsa_serve.MAX_ROPE_DIM, preconditions.MAX_DKV, preconditions.MAX_DR) \
        == (512, 128, 512, 128)
    assert (_pool.WAYS, options.WAYS, options.MAX_NEXT_N) == (16, 16, 3)
    assert npu_gather_selection_kv_cache.MAX_KV_DIM == 656
    assert all(isinstance(lim, Limit) and lim.meaning for s in OP_SPECS for lim in s.limits)


def test_limit_and_spec_for_errors_name_the_argument():
    with pytest.raises(KeyError, match=r"spec_for: name 'dsa_nope' is not one of our ops; known: \['dsa_install', "):
        spec_for("dsa_nope")
    with pytest.raises(KeyError, match=r"custom::dsa_plan has no limit 'MAX_DKV'; its limits: \['MAX_TOPK', "):
        spec_for("dsa_plan").limit("MAX_DKV")
    assert spec_for("custom::dsa_serve_functional") is spec_for("dsa_serve") is spec_for("custom::dsa_serve")


def test_opspec_rejects_inconsistent_data():
    base = dict(namespace="t", name="f", schema="f(Tensor(a!) x, Tensor y) -> ()", summary="s")
    with pytest.raises(ValueError, match=r"OpSpec f: role must be one of \('offload', 'decode', 'cache_write', 'comm'\)"):
        OpSpec(role="other", **base)
    with pytest.raises(ValueError, match=r"OpSpec f: mutated inputs \['x'\] have no same-named GE output"):
        OpSpec(role="offload", ge=GeOp("F", outputs=("y",)), **base)
    with pytest.raises(ValueError, match=r"OpSpec f: schema names 'g'"):
        OpSpec(role="offload", **dict(base, schema="g(Tensor x) -> ()"))
    with pytest.raises(ValueError, match=r"OpSpec f: a functional twin needs mutated arguments"):
        OpSpec(role="offload", functional="f_functional", **dict(base, schema="f(Tensor x) -> Tensor"))
    spec = OpSpec(role="offload", functional="f_functional", ge=GeOp("F", outputs=("x",)), **base)
    assert spec.functional_schema == "f_functional(Tensor x, Tensor y) -> Tensor"
    assert (spec.ge_inputs, spec.ge_ref_map, spec.functional_outputs) == (("x", "y"), {0: 0}, ("x",))
    with pytest.raises(ValueError, match=r"OpSpec f: arg_roles names \['z'\], not arguments of the schema"):
        OpSpec(role="offload", arg_roles={"z": "plan"}, **base)
    with pytest.raises(ValueError, match=r"OpSpec f: arg_roles must be among \('plan', .*\), got \['weights'\]"):
        OpSpec(role="offload", arg_roles={"x": "weights"}, **base)


def test_argument_roles_are_the_same_arguments_in_every_install():
    """The side-stream schedule reads installs by role: ``dsa_install_sc`` has ``dsa_install``'s roles on the
    same argument names, plus its plan (first, so every position differs); an install writes exactly its
    pools and metadata; serve, the gather and the install name their selection buffers alike."""
    inst, sc = spec_for("dsa_install"), spec_for("dsa_install_sc")
    for role in ("records", "selection", "selection_table", "pool", "metadata"):
        assert inst.args_of(role) == sc.args_of(role) != ()
    assert (inst.args_of("plan"), sc.args_of("plan")) == ((), ("plan",))
    assert sorted(inst.args_of("pool") + inst.args_of("metadata")) == sorted(inst.mutated)
    assert inst.arg_names.index("selection_kv_cache") != sc.arg_names.index("selection_kv_cache")
    selections = {spec_for(n).args_of("selection") for n in ("dsa_serve", "dsa_install")}
    assert selections == {("selection_kv_cache", "selection_k_rope")}
    assert set(spec_for("npu_gather_selection_kv_cache").args_of("selection")) == set(inst.args_of("selection"))
    assert spec_for("dsa_plan").args_of("metadata") == inst.args_of("metadata")
    with pytest.raises(KeyError, match=r"custom::dsa_install: unknown argument role 'cache'"):
        inst.args_of("cache")


# ------------------------------------------------------------------------------------- register_twins

def test_bind_orders_the_arguments_as_the_schema():
    # the kernels register_twins writes take (*args, **kwargs): the dispatcher passes keyword-only
    # arguments by name and may leave out those equal to their defaults
    from offload_passes.custom_ops import _library as L
    from offload_passes.custom_ops.opspec import OpArgumentError

    serve = spec_for("dsa_serve")
    tensors = tuple(torch.empty(1) for _ in range(7))
    assert L.bind(serve, tensors, {"topk": 64}) == tensors + (1, 64, 128, 1)
    assert L.bind(serve, tensors + (2, 64, 16, 0), {}) == tensors + (2, 64, 16, 0)
    # one way to fail, naming the op and the argument; a TypeError and a RuntimeError alike
    bad = [((tensors, {"top_k": 64}), "custom::dsa_serve: unknown argument 'top_k'; the schema's arguments are "
                                      "plan, full_kv_cache, "),
           ((tensors[:6], {}), "custom::dsa_serve: missing argument 'selection_k_rope'"),
           ((tensors, {"plan": tensors[0]}), "custom::dsa_serve: argument 'plan' given twice"),
           ((tensors * 2, {}), "custom::dsa_serve: 14 positional arguments, the schema takes 11")]
    for (args, kwargs), msg in bad:
        for err in (TypeError, RuntimeError, OpArgumentError):
            with pytest.raises(err) as e:
                L.bind(serve, args, kwargs)
            assert str(e.value).startswith(msg), str(e.value)
    # the twin's binder names the twin
    with pytest.raises(OpArgumentError, match=r"^custom::dsa_serve_functional: missing argument 'plan'$"):
        serve.twin_binder((), {})


def test_every_caller_binds_through_the_one_binder():
    """The passes' node binding rejects a bad call with the binder's message (the kernels, the CUDA runner and
    the GE converters bind with the same Binder: tests/cuda, tests/converters)."""
    from torch import fx

    from offload_passes.custom_ops.opspec import OpArgumentError, schema_binder
    from offload_passes.passes import _fx

    plan = torch.ops.custom.dsa_plan.default
    g = fx.Graph()
    x = g.placeholder("x")
    node = g.call_function(plan, (x, x, x, x))
    with pytest.raises(OpArgumentError, match=r"^custom::dsa_plan: missing argument 'lru_counter'$"):
        _fx.bind(node)
    assert schema_binder(plan._schema) is schema_binder(plan._schema)
    node.args = (x, x, x, x, x)
    assert _fx.bind(node)["raw_seq"] == 1 and list(_fx.bind(node))[:2] == ["selection_topk_indices",
                                                                           "full_kv_actual_seq"]