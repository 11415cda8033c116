"""The seven custom:: schemas are CANN's strings exactly, and a schema CANN already defined is kept."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import offload_passes
from offload_passes.custom_ops import CUSTOM_OPS

# Oracle: copied verbatim from docs/ops.md (§1, §2, §3, §4), i.e. CANN's ops_def_registration.cpp.
SPEC_SCHEMAS = {
    "npu_gather_selection_kv_cache": "npu_gather_selection_kv_cache(Tensor(a!) selection_k_rope, Tensor(b!) selection_kv_cache, Tensor(c!) selection_kv_block_table, Tensor(d!) selection_kv_block_status, Tensor selection_topk_indices, Tensor full_k_rope, Tensor full_kv_cache, Tensor full_kv_block_table, Tensor full_kv_actual_seq, Tensor full_q_actual_seq, *, int selection_topk_block_size=64) -> Tensor",
    "npu_gather_selection_kv_cache_functional": "npu_gather_selection_kv_cache_functional(Tensor selection_k_rope, Tensor selection_kv_cache, Tensor selection_kv_block_table, Tensor selection_kv_block_status, Tensor selection_topk_indices, Tensor full_k_rope, Tensor full_kv_cache, Tensor full_kv_block_table, Tensor full_kv_actual_seq, Tensor full_q_actual_seq, *, int selection_topk_block_size=64) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    "dsa_plan": "dsa_plan(Tensor selection_topk_indices, Tensor full_kv_actual_seq, Tensor pool_ids, Tensor id_to_slot, Tensor lru_counter, *, int raw_seq=1, int group_id=0, int owner_layer=0, int group_kind=0) -> (Tensor, Tensor, Tensor)",
    "dsa_serve": "dsa_serve(Tensor plan, Tensor full_kv_cache, Tensor full_k_rope, Tensor pool_kv_cache, Tensor pool_k_rope, Tensor(a!) selection_kv_cache, Tensor(b!) selection_k_rope, *, int raw_seq=1, int topk=2048, int selection_block_size=128, int compact_layout=1) -> ()",
    "dsa_serve_functional": "dsa_serve_functional(Tensor plan, Tensor full_kv_cache, Tensor full_k_rope, Tensor pool_kv_cache, Tensor pool_k_rope, Tensor selection_kv_cache, Tensor selection_k_rope, *, int raw_seq=1, int topk=2048, int selection_block_size=128, int compact_layout=1) -> (Tensor, Tensor)",
    "dsa_install": "dsa_install(Tensor install_records, Tensor selection_kv_cache, Tensor selection_k_rope, Tensor selection_kv_block_table, Tensor(a!) pool_kv_cache, Tensor(b!) pool_k_rope, Tensor(c!) pool_ids, Tensor(d!) id_to_slot, Tensor(e!) lru_counter, *, int raw_seq=1, int topk=2048, int selection_block_size=128, int metadata_update=1) -> ()",
    "dsa_install_functional": "dsa_install_functional(Tensor install_records, Tensor selection_kv_cache, Tensor selection_k_rope, Tensor selection_kv_block_table, Tensor pool_kv_cache, Tensor pool_k_rope, Tensor pool_ids, Tensor id_to_slot, Tensor lru_counter, *, int raw_seq=1, int topk=2048, int selection_block_size=128, int metadata_update=1) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
}


def _env() -> dict:
    return dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")


def test_the_seven_ops_are_listed():
    assert sorted(CUSTOM_OPS) == sorted(SPEC_SCHEMAS)


@pytest.mark.parametrize("name", sorted(SPEC_SCHEMAS))
def test_schema_string_is_cann_exact(name):
    schema = getattr(torch.ops.custom, name).default._schema
    assert str(schema) == "custom::" + SPEC_SCHEMAS[name]


@pytest.mark.parametrize("name", sorted(SPEC_SCHEMAS))
def test_every_op_has_cpu_and_fake_kernels(name):
    qual = f"custom::{name}"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, "CPU")
    from torch._library.simple_registry import singleton

    assert singleton.find(qual).fake_impl.kernel is not None or torch._C._dispatch_has_kernel_for_dispatch_key(qual, "Meta")


@pytest.mark.parametrize("name", ["dsa_serve", "dsa_install", "npu_gather_selection_kv_cache"])
def test_inplace_ops_have_functionalize_kernels(name):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"custom::{name}", "Functionalize")


def test_import_prints_schema_in_a_fresh_process():
    res = subprocess.run(
        [sys.executable, "-c", "import offload_passes, torch; print(torch.ops.custom.dsa_plan.default._schema)"],
        env=_env(), capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "custom::" + SPEC_SCHEMAS["dsa_plan"]


_CANN_FIRST = textwrap.dedent(
    """
    import torch
    # Stand-in for CANN's custom_ops extension loaded before us: it owns the schema of dsa_serve and
    # a Meta kernel for dsa_serve_functional (no CPU kernels, as on a real Ascend install).
    cann = torch.library.Library("custom", "FRAGMENT")
    cann.define({serve!r})
    cann.define({serve_f!r})
    meta_calls = []
    def cann_meta(plan, fkv, frope, pkv, prope, skv, srope, raw_seq=1, topk=2048, selection_block_size=128,
                  compact_layout=1):
        meta_calls.append(1)
        return torch.empty_like(skv), torch.empty_like(srope)
    cann.impl("dsa_serve_functional", cann_meta, "Meta")
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("custom::dsa_serve", "CPU")

    import offload_passes
    from offload_passes.custom_ops import _library as Lib
    from torch._subclasses.fake_tensor import FakeTensorMode

    defined = set(Lib.defined_ops())
    assert "dsa_serve" not in defined and "dsa_serve_functional" not in defined, defined
    assert {{"dsa_plan", "dsa_install", "npu_gather_selection_kv_cache"}} <= defined, defined
    assert str(torch.ops.custom.dsa_serve.default._schema) == "custom::" + {serve!r}
    for key in ("CPU", "Functionalize"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key("custom::dsa_serve", key), key
    assert torch._C._dispatch_has_kernel_for_dispatch_key("custom::dsa_serve_functional", "CPU")

    B, S, K, sbs, PS, F, D, Dr = 1, 1, 64, 16, 16, 20, 4, 2
    plan = torch.stack([torch.full((K,), 2, dtype=torch.int32), torch.arange(K, dtype=torch.int32) % F], 1)
    fkv, frope = torch.randn(B, F, D).bfloat16(), torch.randn(B, F, Dr).bfloat16()
    pkv, prope = torch.zeros(B, PS, D).bfloat16(), torch.zeros(B, PS, Dr).bfloat16()
    skv, srope = torch.zeros(K // sbs, sbs, D).bfloat16(), torch.zeros(K // sbs, sbs, Dr).bfloat16()
    kw = dict(raw_seq=S, topk=K, selection_block_size=sbs)
    torch.ops.custom.dsa_serve(plan, fkv, frope, pkv, prope, skv, srope, **kw)   # our CPU kernel
    assert torch.equal(skv.view(-1, D), fkv[0, torch.arange(K) % F])
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (plan, fkv, frope, pkv, prope, skv, srope)]
        torch.ops.custom.dsa_serve(*fake, **kw)                                      # our fake kernel
        try:
            torch.ops.custom.dsa_serve(*fake, raw_seq=9, topk=K, selection_block_size=sbs)
            raise AssertionError("fake kernel did not validate")
        except RuntimeError as e:
            assert "custom::dsa_serve: raw_seq must be in [1, 4], got 9" in str(e), e
        out = torch.ops.custom.dsa_serve_functional(*fake, **kw)                     # CANN's Meta kernel kept
        assert out[0].shape == skv.shape and meta_calls, meta_calls
    print("OK")
    """
)


def test_existing_cann_schema_is_not_redefined():
    from offload_passes.custom_ops import dsa_serve

    code = _CANN_FIRST.format(serve=dsa_serve.SPEC.schema, serve_f=dsa_serve.SPEC.functional_schema)
    res = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stdout.strip().splitlines()[-1] == "OK"
