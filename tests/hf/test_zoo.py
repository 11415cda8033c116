"""Every DSA family of the pinned transformers, unmodified, through the HF front-end (docs/hf.md, "DSA
families"): fp32 the sparse rewrite equals the dense model (<= 1e-4 relative to the largest logit), bf16
the offload engages where the geometry allows, and a family it cannot apply to is refused by name.

Presets are shrunk for the test (2 or 3 layers, prompt 80, cache 96, 4 decode steps): K = 64 (67 with
glm5_next's tail pool) of 80+ cached positions, so the selection is really sparse."""
from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass
from typing import Any, Optional

import pytest
import torch
import yaml

from offload_passes import _compat
from offload_passes.backend import make_offload_backend
from offload_passes.demo_hf import FP32_REL_TOL
from offload_passes.models import hf
from offload_passes.passes.frontends.hf import hf_sparse_attention

from hf_helpers import rel_err, teacher_forced_bf16_check

STEPS = 4
RUN = {"prefill_len": 80, "max_cache_len": 96, "decode_steps": STEPS}


@dataclass(frozen=True)
class Family:
    preset: str
    model: dict  # model_config overrides (shrinking the preset)
    attn: str  # the attention the fp32 run uses (the bf16 run uses the preset's)
    sites: int  # DSA layers the detector finds
    groups: list  # top-k sharing groups (site numbers)
    graphs: int  # decode graphs compiled over STEPS steps
    offload: bool  # the offload applies in bf16
    offload_refusals: tuple = ("kv_dtype",)  # reasons the fp32 run reports for keeping the sparse rewrite only
    refusal: Optional[str] = None  # the graph's named refusal (the family is not rewritten)
    steps: int = STEPS
    # the model indexes with a boolean mask (data-dependent shapes): Dynamo before torch 2.10 traces it in
    # a full graph only with ``capture_dynamic_output_shape_ops`` (``_compat.dynamo_traces_mask_indexing``)
    mask_indexing: bool = False


FAMILIES = {
    "glm_moe_dsa": Family("hf-tiny", {"num_hidden_layers": 2, "index_topk_pattern": "FS"}, "eager", 2,
                          [[0, 1]], 1, True),
    "deepseek_v32": Family("hf-deepseek-v32", {"num_hidden_layers": 2}, "eager", 2, [[0], [1]], 1, True),
    "axk2": Family("hf-axk2", {"num_hidden_layers": 2}, "sdpa", 2, [[0], [1]], 1, True),
    "hy_v4": Family("hf-hy-v4", {"num_hidden_layers": 2, "indexer_types": ["full", "shared"]}, "eager",
                    2, [[0, 1]], 1, True),
    # the sliding-window layer stays dense. transformers' sliding cache keeps its length as a Python int:
    # Dynamo specialises the first step on it, then makes it dynamic (2 graphs)
    "dots3_note_text": Family("hf-dots3-note", {"num_hidden_layers": 2,
                                                 "layer_types": ["indexed_attention", "sliding_attention"]},
                              "eager", 1, [[0]], 2, True),
    # linear attention on layer 0, NoPE k-pool DSA on 1 and 2 (2 reuses 1's top-k)
    "glm5_next": Family("hf-glm5-next", {"num_hidden_layers": 3,
                                         "layer_types": ["linear_attention", "indexed_attention", "indexed_attention"],
                                         "mlp_layer_types": ["dense", "sparse", "sparse"],
                                         "indexer_types": ["full", "full", "shared"]},
                        "sdpa", 2, [[0, 1]], 1, False, ("kv_dtype", "dims", "topk_alignment"), mask_indexing=True),
    # compressed sparse attention over in-graph compressed entries: refused by name, the model runs as it is
    "deepseek_v4": Family("hf-deepseek-v4", {}, "eager", 0, [], 1, False, (), "hf_compressed_kv", steps=1),
}


def _config(fam: Family) -> dict:
    raw = yaml.safe_load((hf.CONFIG_DIR / f"{fam.preset}.yaml").read_text())
    raw = copy.deepcopy(raw)
    mc = raw["model_config"]
    (mc["text_config"] if "text_config" in mc else mc).update(fam.model)
    raw["runner_config"].update(RUN, decode_steps=fam.steps)
    return raw


@dataclass
class Run:
    ref: list
    out: list
    backend: Any
    graphs: int
    report: dict
    decoder: Any  # keeps the caches (and so the offload state) alive


@functools.lru_cache(maxsize=None)
def run(family: str, dtype: str) -> Run:
    fam = FAMILIES[family]
    torch._dynamo.reset()
    over = {"dtype": dtype} if dtype == "float32" else {}
    attn = fam.attn if dtype == "float32" else None
    base = hf.build(_config(fam), attn=attn, **over)
    comp = hf.build(_config(fam), attn=attn, **over)
    backend = make_offload_backend(enable_offload=True)
    fn = torch.compile(comp.model, backend=backend, fullgraph=comp.runner.cache == "static")
    ref = base.run(steps=fam.steps)
    dec = comp.decoder()
    dec.prefill()
    dynamo = (torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)
              if fam.mask_indexing and not _compat.dynamo_traces_mask_indexing() else contextlib.nullcontext())
    with dynamo:
        out = [dec.step(fn) for _ in range(fam.steps)]
    return Run(ref, out, backend, len(backend.reports), backend.reports[-1], dec)


@functools.lru_cache(maxsize=None)
def unmodified_fp32_with_bf16_attention(family: str) -> list:
    """The fp32 unmodified model with the attention the bf16 run uses: the reference both bf16 models are
    measured against (tests/hf/hf_helpers.py ``bf16_check``)."""
    fam = FAMILIES[family]
    return hf.build(_config(fam), dtype="float32").run(steps=fam.steps)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sparse_rewrite_is_exact_in_fp32(family):
    fam = FAMILIES[family]
    r = run(family, "float32")
    rep = r.report
    assert rel_err(r.ref, r.out) <= FP32_REL_TOL
    assert r.graphs == fam.graphs
    if fam.refusal is not None:
        assert not rep["rewritten"]
        assert [f["reason"] for f in rep["refusals"]] == [fam.refusal]
        return
    assert rep["rewritten"] and rep["refusals"] == []
    assert len(rep["hf"]["sites"]) == fam.sites
    assert [g["layers"] for g in rep["groups"]] == fam.groups
    assert rep["hf"]["dense_masks_left"] == 0 and rep["hf"]["offload"] is False
    assert {f["reason"] for f in rep["hf"]["offload_refusals"]} == set(fam.offload_refusals)


@pytest.mark.parametrize("family", [f for f, v in FAMILIES.items() if v.offload])
def test_offload_engages_in_bf16(family):
    fam = FAMILIES[family]
    r = run(family, "bfloat16")
    rep = r.report
    # no further from the fp32 unmodified model than the bf16 unmodified model is (x BF16_FACTOR)
    teacher_forced_bf16_check(unmodified_fp32_with_bf16_attention(family), r.ref, r.out)
    assert r.graphs == fam.graphs
    assert rep["rewritten"] and rep["hf"]["offload"] is True and rep["hf"]["offload_refusals"] == []
    assert [g["layers"] for g in rep["groups"]] == fam.groups
    ops = rep["ops"]["after"]
    assert sum(v for k, v in ops.items() if k.endswith("dsa_plan")) == len(fam.groups)
    assert sum(v for k, v in ops.items() if k.endswith("dsa_serve")) == fam.sites
    t = r.backend.state.totals()
    # every step, every group looks up B * S * K ids: each one is a pool hit, a miss, or in the window
    B, S, K = (rep["hf"]["sites"][0][k] for k in ("B", "S", "K"))
    assert t["hits"] + t["misses"] + t["window"] == fam.steps * len(fam.groups) * B * S * K
    assert t["hits"] > 0, t


def test_count_mask_form_counts_a_repeated_id_once():
    """The count-mask form (glm5_next) does not prove its ids distinct: a repeated id is one key."""
    torch.manual_seed(0)
    B, H, S, T, C, R, n, v = 1, 2, 1, 12, 8, 4, 6, 5
    q = torch.randn(B, H, S, n + R)
    lat, rope = torch.randn(B, 1, T, C), torch.randn(B, 1, T, R)
    w = torch.randn(H * (n + v), C)
    ids = torch.tensor([[[3, 7, 3, -1, 7, 0]]], dtype=torch.int32)
    got = hf_sparse_attention(q, lat, rope, w, ids, None, 0.3, n, v, "eager", -3.0e38, dedup=True)
    want = hf_sparse_attention(q, lat, rope, w, torch.tensor([[[3, 7, 0]]], dtype=torch.int32), None, 0.3, n, v,
                               "eager", -3.0e38)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    twice = hf_sparse_attention(q, lat, rope, w, ids, None, 0.3, n, v, "eager", -3.0e38)  # without: weighted twice
    assert (twice - want).abs().max() > 1e-3


def test_preset_model_type_picks_the_class_and_bad_input_is_named():
    cfg, runner = hf.load_config("hf-hy-v4")
    assert cfg.model_type == "hy_v4" and runner.attn_implementation == "eager"
    cfg, _ = hf.load_config("hf-tiny")  # no model_type key: glm_moe_dsa
    assert cfg.model_type == "glm_moe_dsa"
    with pytest.raises(ValueError, match=r"attn_implementation 'sdpa': HYV4ForCausalLM \(hy_v4\) does not support it"):
        hf.load_config("hf-hy-v4", attn_implementation="sdpa")
    with pytest.raises(ValueError, match="model_type 'no_such_type' is not a transformers model type"):
        hf.load_config({"model_type": "no_such_type", "model_config": {}, "runner_config": {}})
    with pytest.raises(ValueError, match="runner cache must be 'static' or 'dynamic', got 'paged'"):
        hf.load_config("hf-tiny", cache="paged")
