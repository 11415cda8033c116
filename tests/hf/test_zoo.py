"""Every transformers model family with an indexer, unmodified, through the HF front-end (docs/hf.md, "Model
families"): the installed release is surveyed (``models/hf/survey.py``) and every family it finds must be a row
of ``families.FAMILY_TABLE``, offloaded or refused with a named reason; each row's outcome is checked on a tiny
random model of the installed release. fp32: the sparse rewrite equals the dense model (<= 1e-4 relative to the
largest logit); bf16: the offload engages where the table says so, and is refused by the named reasons where
the table says "sparse"; a family the backend refuses, or leaves unmodified, runs exactly as transformers wrote it.

Presets are shrunk for the test (2 to 5 layers, prompt 80, cache 96, 4 decode steps): K = 64 (67 with
glm5_next's tail pool) of 80+ cached positions, so the selection is really sparse."""
from __future__ import annotations

import contextlib
import copy
import functools
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import yaml

from offload_passes import _compat, pipeline
from offload_passes.backend import OffloadWarning, make_offload_backend
from offload_passes.apps.hf import FP32_REL_TOL
from offload_passes.models import hf
from offload_passes.models.hf import families, survey
from offload_passes.passes.frontends.hf import hf_sparse_attention

from hf_helpers import rel_err, teacher_forced_bf16_check

STEPS = 4
RUN = {"prefill_len": 80, "max_cache_len": 96, "decode_steps": STEPS}
DOCS = Path(__file__).resolve().parents[2] / "docs" / "hf.md"


@dataclass(frozen=True)
class Family:
    model: dict  # model_config overrides (shrinking the preset)
    attn: str  # the attention the fp32 run uses (the bf16 run uses the preset's)
    sites: int  # DSA layers the detector finds
    groups: list  # top-k sharing groups (site numbers)
    graphs: Optional[int]  # decode graphs compiled over STEPS steps (None: not pinned, a graph break per step)
    steps: int = STEPS
    # the model indexes with a boolean mask (data-dependent shapes): Dynamo before torch 2.10 traces it in
    # a full graph only with ``capture_dynamic_output_shape_ops`` (``_compat.dynamo_traces_mask_indexing``)
    mask_indexing: bool = False
    # layer -> the earlier layer of its group whose cache it reads (kv_source_layers): one pool, served and
    # installed once
    pool_source: Optional[dict] = None


FAMILIES = {
    "glm_moe_dsa": Family({"num_hidden_layers": 2, "index_topk_pattern": "FS"}, "eager", 2, [[0, 1]], 1),
    "deepseek_v32": Family({"num_hidden_layers": 2}, "eager", 2, [[0], [1]], 1),
    "axk2": Family({"num_hidden_layers": 2}, "sdpa", 2, [[0], [1]], 1),
    "hy_v4": Family({"num_hidden_layers": 2, "indexer_types": ["full", "shared"]}, "eager", 2, [[0, 1]], 1),
    "hy_v4_vl": Family({"num_hidden_layers": 2, "indexer_types": ["full", "shared"]}, "eager", 2, [[0, 1]], 1),
    # the sliding-window layer stays dense. transformers' sliding cache keeps its length as a Python int:
    # Dynamo specialises the first step on it, then makes it dynamic (2 graphs)
    "dots3_note": Family({"num_hidden_layers": 2, "layer_types": ["indexed_attention", "sliding_attention"]},
                         "eager", 1, [[0]], 2),
    # IndexShare F S F S, layer 1 reads layer 0's latent cache (kv_source_layers), layer 3 is NoPE (Dr = 0: the
    # ops' no-rope mode) and shares layer 2's top-k
    "mistral_large4": Family({"num_hidden_layers": 4, "indexer_types": ["full", "shared", "full", "shared"],
                              "kv_source_layers": [0, 0, 2, 3]}, "sdpa", 4, [[0, 1], [2, 3]], 1,
                             pool_source={1: 0}),
    # linear attention on layer 0, NoPE k-pool DSA on 1 and 2 (2 reuses 1's top-k); K = 67 ids padded to 128
    "glm5_next": Family({"num_hidden_layers": 3,
                         "layer_types": ["linear_attention", "indexed_attention", "indexed_attention"],
                         "mlp_layer_types": ["dense", "sparse", "sparse"], "indexer_types": ["full", "full", "shared"]},
                        "sdpa", 2, [[0, 1]], 1, mask_indexing=True),
    # compressed sparse attention over in-graph compressed entries: refused by name, the model runs as it is
    "deepseek_v4": Family({}, "eager", 0, [], 1, steps=1),
    # block top-k per indexer head on layers 0 and 2: refused by name (block_topk)
    "minimax_m3_vl": Family({}, "sdpa", 0, [], 1),
    # data-dependent Python loops in the indexers: no full graph; with graph breaks nothing is rewritten and
    # one warning names the indexer (indexer_split)
    "qwen4_exp": Family({}, "sdpa", 0, [], None),
    "kolibri1_1": Family({}, "sdpa", 0, [], None),
    # per-head dynamic-mask top-k over a GQA cache: no DSA site; refused by name (attention_topk)
    "doge": Family({}, "sdpa", 0, [], 1),
}


#: what the refusal's detail says, per named reason of a "refused" family (the node and the cause)
REFUSAL_DETAIL = {"hf_compressed_kv": "not rows of a cache graph input: there is no host copy to serve them from",
                  "indexer_split": "the decode step is split over several graphs (graph breaks: torch.compile without "
                                   "fullgraph=True",
                  "block_topk": "the indexer selects blocks of 8 keys per indexer head",
                  "attention_topk": "DogeAttention selects keys with a top-k of its own"}


def _release(version: str) -> tuple[int, int]:
    return tuple(int(p) for p in version.split(".")[:2])


def installed(family: str) -> bool:
    """The family ships with the installed transformers (its table row's ``since``)."""
    since = families.FAMILY_TABLE[family].since
    return since is None or _compat.transformers_version() >= _release(since)


INSTALLED = [f for f in FAMILIES if installed(f)]

#: Dynamo's message where it will not inline ``collections.UserDict.__init__`` (transformers' ``KVSharingDict()``)
SKIPS_USER_DICT = r"Attempted to inline function marked as skipped(.|\n)*`UserDict.__init__`"


def dynamo_limit(family: str) -> Optional[str]:
    return families.dynamo_limit(families.FAMILY_TABLE[family].model_types[0])


def assert_dynamo_stops_in_transformers(family: str, dtype: str) -> None:
    """On a torch whose Dynamo skips ``collections.UserDict`` (2.8): compiling the family's decode step in one
    graph stops at transformers' ``KVSharingDict()``, before the backend sees any graph."""
    torch._dynamo.reset()
    comp = hf.build(_config(family), attn=FAMILIES[family].attn if dtype == "float32" else None, dtype=dtype)
    backend = make_offload_backend(enable_offload=True)
    fn = torch.compile(comp.model, backend=backend, fullgraph=True)
    dec = comp.decoder()
    dec.prefill()
    with pytest.raises(Exception, match=SKIPS_USER_DICT):
        dec.step(fn)
    assert list(backend.reports) == []


def _config(family: str) -> dict:
    fam = FAMILIES[family]
    raw = copy.deepcopy(yaml.safe_load((hf.CONFIG_DIR / f"{families.FAMILY_TABLE[family].preset}.yaml").read_text()))
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
    warnings: list  # the OffloadWarnings the compiled steps issued


@functools.lru_cache(maxsize=None)
def run(family: str, dtype: str) -> Run:
    fam = FAMILIES[family]
    torch._dynamo.reset()
    attn = fam.attn if dtype == "float32" else None  # bf16: the preset's attention
    base = hf.build(_config(family), attn=attn, dtype=dtype)
    comp = hf.build(_config(family), attn=attn, dtype=dtype)
    backend = make_offload_backend(enable_offload=True)
    fn = torch.compile(comp.model, backend=backend, fullgraph=comp.runner.cache == "static" and comp.runner.fullgraph)
    ref = base.run(steps=fam.steps)
    dec = comp.decoder()
    dec.prefill()
    dynamo = _compat.mask_indexing_traced() if fam.mask_indexing else contextlib.nullcontext()
    pipeline._warned.clear()  # each family's run shows its own warnings (warned once per process otherwise)
    with dynamo, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", OffloadWarning)
        out = [dec.step(fn) for _ in range(fam.steps)]
    offload_warnings = [str(w.message) for w in caught if issubclass(w.category, OffloadWarning)]
    return Run(ref, out, backend, len(backend.reports), backend.reports[-1], dec, offload_warnings)


@functools.lru_cache(maxsize=None)
def unmodified_fp32_with_bf16_attention(family: str) -> list:
    """The fp32 unmodified model with the attention the bf16 run uses: the reference both bf16 models are
    measured against (tests/hf/hf_helpers.py ``bf16_check``)."""
    return hf.build(_config(family), dtype="float32").run(steps=FAMILIES[family].steps)


# -- the survey and the table ---------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def surveyed() -> dict:
    return {e.family: e for e in survey.survey()}


def test_every_family_with_an_indexer_in_the_installed_release_is_in_the_table():
    found = surveyed()
    assert sorted(set(found) - set(families.FAMILY_TABLE)) == [], "families with an indexer missing from FAMILY_TABLE"
    for fam, entry in families.FAMILY_TABLE.items():
        if installed(fam):
            assert fam in found, f"{fam}: in FAMILY_TABLE but the survey of the installed release does not find it"
            assert found[fam].model_types == entry.model_types, fam
            cfg, runner = hf.load_config(entry.preset)
            assert cfg.model_type in entry.model_types and runner.fullgraph == entry.fullgraph, fam
        else:  # a family of a newer release: this one does not ship it
            assert not (survey.transformers_models_dir() / fam).exists(), fam
    assert set(FAMILIES) == set(families.FAMILY_TABLE)  # every row is checked below on a tiny model


@pytest.mark.parametrize("family", INSTALLED)
def test_every_family_is_offloaded_or_refused_by_name(family):
    entry = families.FAMILY_TABLE[family]
    assert entry.outcome == "offload" or entry.reasons, f"{family}: {families.OUTCOMES[entry.outcome]}"


def test_dynamo_limit_names_the_families_this_torch_cannot_trace():
    limited = sorted(f for f in families.FAMILY_TABLE if dynamo_limit(f) is not None)
    if _compat.dynamo_traces_user_dict():
        assert limited == []
    else:  # kolibri1_1 builds a KVSharingDict too, but has no full graph on any torch (refused by indexer_split)
        assert limited == ["mistral_large4"]
        assert dynamo_limit("mistral_large4") == (
            f"mistral_large4: torch {torch.__version__}'s Dynamo cannot trace its decode step: transformers' "
            "KVSharingDict is a collections.UserDict, whose __init__ this Dynamo skips (torch 2.13 traces it)")
    assert families.dynamo_limit("no_such_type") is None


def test_docs_family_table_is_the_generated_one():
    text = DOCS.read_text()
    block = re.search(r"<!-- family-table: begin.*?-->\n(.*?)<!-- family-table: end -->", text, re.S)
    assert block is not None, "docs/hf.md has no generated family table block"
    assert block.group(1) == families.family_table_markdown()


# the survey's criterion on synthetic modeling / configuration files (models/hf/survey.py): each signal alone
# counts, an MoE router's top-k does not
_ROUTER = """
class FooTopkRouter(nn.Module):
    def forward(self, hidden):
        logits = self.gate(hidden)
        top_idx = logits.topk(2, dim=-1)[1]
        weights = torch.zeros_like(logits).scatter(1, top_idx, logits.gather(1, top_idx))
        return self.experts(hidden, weights)

class FooAttention(nn.Module):
    def forward(self, hidden, mask):
        q, k, v = self.q(hidden), self.k(hidden), self.v(hidden)
        return eager_attention_forward(self, q, k, v, mask)
"""
_SELECTS = """
class FooAttention(nn.Module):
    def pick(self, scores, k):
        return scores.topk(k, dim=-1).indices

    def forward(self, hidden, mask):
        scores = self.score(hidden)
        ids = self.pick(scores, 8)
        keep = mask.new_ones(mask.shape)
        keep.scatter_(-1, ids, 0)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", eager_attention_forward)
        return attention_interface(self, hidden, hidden, hidden, keep)
"""


def _tree(text: str):
    import ast

    return ast.parse(text)


def test_survey_criterion_each_signal_alone_and_not_a_router():
    assert survey.indexer_classes(_tree("class BarIndexer(nn.Module):\n    pass\nclass Indexed:\n    pass\n")) == \
        ["BarIndexer"]
    conf = ("class FooConfig(PreTrainedConfig):\n    index_topk: int = 2048\n    image_token_index: int = 3\n"
            "    num_experts: int = 4\n    indexer_types = None\n"
            "    def __init__(self, index_block_size=8, index=1, **kw):\n        self.indexer_budget = 64\n")
    assert survey.config_fields(_tree(conf)) == ["index_block_size", "index_topk", "indexer_budget", "indexer_types"]
    assert survey.topk_into_attention(_tree(_SELECTS)) == ["FooAttention.forward"]
    assert survey.topk_into_attention(_tree(_ROUTER)) == []
    assert survey.indexer_classes(_tree(_ROUTER)) == [] and survey.config_fields(_tree(_ROUTER)) == []
    # a top-k that only reaches a non-attention call is not a selection of keys
    assert survey.topk_into_attention(_tree(_SELECTS.replace("attention_interface(self", "self.mlp(self"))) == []


def test_survey_reads_model_folders_and_needs_a_decoding_model_type(tmp_path):
    for name, modeling, config in (("fakedsa", _SELECTS, "class C:\n    pass\n"),
                                   ("fakemoe", _ROUTER, "class C:\n    pass\n"),
                                   ("fakefield", "class M:\n    pass\n", "class C:\n    indexer_n_heads: int = 4\n"),
                                   ("fakeenc", "class EncIndexer:\n    pass\n", "class C:\n    pass\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"modeling_{name}.py").write_text(modeling)
        (tmp_path / name / f"configuration_{name}.py").write_text(config)
    (tmp_path / "fakebroken").mkdir()
    (tmp_path / "fakebroken" / "modeling_fakebroken.py").write_text("class Indexer(:\n")  # unparsable: skipped
    types = {"fakedsa": ("fakedsa",), "fakemoe": ("fakemoe",), "fakefield": ("fakefield", "fakefield_text"),
             "fakebroken": ("fakebroken",)}  # fakeenc has no decoding model type
    found = survey.survey(tmp_path, lambda: types)
    assert [(e.family, e.model_types, e.signals()) for e in found] == [
        ("fakedsa", ("fakedsa",), ["top-k into attention"]),
        ("fakefield", ("fakefield", "fakefield_text"), ["config field"])]


# -- each row's outcome on a tiny random model of the installed release ---------------------------------------
@pytest.mark.parametrize("family", INSTALLED)
def test_outcome_in_fp32_the_sparse_rewrite_is_exact_or_the_model_runs_unmodified(family):
    fam, entry = FAMILIES[family], families.FAMILY_TABLE[family]
    if dynamo_limit(family) is not None:
        assert_dynamo_stops_in_transformers(family, "float32")
        return
    r = run(family, "float32")
    rep = r.report
    assert rel_err(r.ref, r.out) <= FP32_REL_TOL
    if fam.graphs is not None:
        assert r.graphs == fam.graphs
    if entry.outcome == "refused":
        assert not any(x["rewritten"] for x in r.backend.reports)
        # a step over several graphs (no full graph): the graphs that hold part of the indexer name the reason
        refusals = [f for x in r.backend.reports for f in x["refusals"]] if not entry.fullgraph else rep["refusals"]
        assert refusals and {f["reason"] for f in refusals} == set(entry.reasons)
        assert all(REFUSAL_DETAIL[f["reason"]] in f["detail"] for f in refusals), refusals
        if not entry.fullgraph:  # one warning for every graph of the step, naming the indexer's class
            assert len(r.warnings) == 1 and "indexer_split" in r.warnings[0], r.warnings
            assert re.search(r"the indexer's (code \(\w+Indexer\)|cache \w*indexer)", r.warnings[0]), r.warnings
        return
    if entry.outcome == "unnamed":
        assert r.graphs >= 1
        assert all(not x["rewritten"] and x["refusals"] == [] for x in r.backend.reports)
        assert r.warnings == []  # nothing says so
        return
    assert rep["rewritten"] and rep["refusals"] == []
    assert len(rep["hf"]["sites"]) == fam.sites
    assert [g["layers"] for g in rep["groups"]] == fam.groups
    assert rep["hf"]["dense_masks_left"] == 0 and rep["hf"]["offload"] is False
    assert {f["reason"] for f in rep["hf"]["offload_refusals"]} == {"kv_dtype", *entry.reasons}


@pytest.mark.parametrize("family", [f for f in INSTALLED if not families.FAMILY_TABLE[f].fullgraph])
def test_outcome_no_full_graph_with_any_backend(family):
    """transformers' own data-dependent branches: Dynamo cannot trace the decode step into one graph, whatever
    the backend (the unmodified ``eager`` one here)."""
    comp = hf.build(_config(family), dtype="float32", attn=FAMILIES[family].attn)
    dec = comp.decoder()
    dec.prefill()
    torch._dynamo.reset()
    fn = torch.compile(comp.model, backend="eager", fullgraph=True)
    if families.FAMILY_TABLE[family].kv_sharing_dict and not _compat.dynamo_traces_user_dict():
        expected = SKIPS_USER_DICT  # torch 2.8: kolibri1_1 stops earlier, at transformers' KVSharingDict()
    elif not _compat.dynamo_traces_mask_indexing():
        expected = r"Dynamic shape operator(.|\n)*aten.nonzero"  # torch 2.8: at qwen4_exp's boolean-mask index
    else:
        expected = "data-dependent"
    with pytest.raises(Exception, match=expected):
        dec.step(fn)


@pytest.mark.parametrize("family", [f for f in INSTALLED if families.FAMILY_TABLE[f].outcome in ("offload", "sparse")])
def test_outcome_in_bf16_the_offload_engages_or_is_refused_by_the_named_reasons(family):
    fam, entry = FAMILIES[family], families.FAMILY_TABLE[family]
    if dynamo_limit(family) is not None:
        assert_dynamo_stops_in_transformers(family, "bfloat16")
        return
    r = run(family, "bfloat16")
    rep = r.report
    # no further from the fp32 unmodified model than the bf16 unmodified model is (x BF16_FACTOR)
    teacher_forced_bf16_check(unmodified_fp32_with_bf16_attention(family), r.ref, r.out)
    assert r.graphs == fam.graphs
    assert rep["rewritten"] and [g["layers"] for g in rep["groups"]] == fam.groups
    if entry.outcome == "sparse":
        assert rep["hf"]["offload"] is False
        assert {f["reason"] for f in rep["hf"]["offload_refusals"]} == set(entry.reasons)
        return
    assert rep["hf"]["offload"] is True and rep["hf"]["offload_refusals"] == []
    ops = rep["ops"]["after"]
    shared = fam.pool_source or {}
    assert [{int(k): v for k, v in g.get("pool_source", {}).items()} for g in rep["groups"]] == \
        [{l: s for l, s in shared.items() if l in layers} for layers in fam.groups]
    assert sum(v for k, v in ops.items() if k.endswith("dsa_plan")) == len(fam.groups)
    # one serve and one install per distinct cache of a group
    assert sum(v for k, v in ops.items() if k.endswith("dsa_serve")) == fam.sites - len(shared)
    assert sum(v for k, v in ops.items() if k.endswith("dsa_install")) == fam.sites - len(shared)
    pools = {row["layer"] for row in rep["state"] if row["kind"] == "pool"}
    assert pools == {l for g in fam.groups for l in g} - set(shared)
    for layer, src in shared.items():  # the sharing layer reads its source's pool tensors
        assert all(a is b for a, b in zip(r.backend.state.pools[layer], r.backend.state.pools[src]))
    t = r.backend.state.totals()
    # every step, every group looks up B * S * K ids: each one is a pool hit, a miss, or in the window
    B, S, K = (rep["hf"]["sites"][0][k] for k in ("B", "S", "K"))
    looked_up = t["hits"] + t["misses"] + t["window"]
    if any("ids_width" in g for g in rep["groups"]):
        # glm5_next: K ids padded with -1 to the next multiple of 64 (and its own -1, the tail pool's
        # invalid ids, moved to the end): every non-negative id is looked up once, -1 never
        assert [(g["ids_width"], g["K"]) for g in rep["groups"]] == [(K, -(-K // 64) * 64)] * len(fam.groups)
        assert 0 < looked_up <= fam.steps * len(fam.groups) * B * S * K
    else:
        assert looked_up == fam.steps * len(fam.groups) * B * S * K
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
    with pytest.raises(ValueError, match="runner fullgraph must be true or false, got 'no'"):
        hf.load_config("hf-tiny", fullgraph="no")


def test_offload_is_decided_per_group_mistral_large4_in_an_npu_mode():
    """The offload is decided per group: in an NPU mode a NoPE layer is refused (``no_rope_npu``: CANN's
    tilings reject a zero rope width), so its group (layers 2, 3) keeps sparse attention while the RoPE
    group (layers 0, 1) is offloaded; the one warning names both; ``strict`` raises. The graph the NPU
    lowering would receive (``rewrite_for_offload`` with ``exe_mode="ge_graph"``) runs here on the CPU
    ops, equal to the sparse rewrite without any offload."""
    from offload_passes.backend import OffloadRefused, rewrite_for_offload
    from offload_passes.options import OffloadOptions

    if dynamo_limit("mistral_large4") is not None:
        assert_dynamo_stops_in_transformers("mistral_large4", "bfloat16")
        return
    torch._dynamo.reset()
    part, sparse = hf.build(_config("mistral_large4"), dtype="bfloat16"), hf.build(_config("mistral_large4"),
                                                                                  dtype="bfloat16")
    got = {}

    def npu_pass(gm, ex):
        gm2, got["state"], got["report"] = rewrite_for_offload(gm, ex, OffloadOptions(exe_mode="ge_graph"))
        return gm2.forward

    fn = torch.compile(part.model, backend=npu_pass, fullgraph=True)
    fs = torch.compile(sparse.model, backend=make_offload_backend(enable_offload=False), fullgraph=True)
    dp, ds = part.decoder(), sparse.decoder()
    dp.prefill()
    ds.prefill()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", OffloadWarning)
        for _ in range(STEPS):
            assert torch.equal(dp.step(fn), ds.step(fs))
    rep = got["report"]
    assert [(g["layers"], g["offload"]) for g in rep["groups"]] == [([0, 1], True), ([2, 3], False)]
    assert [(r["reason"], r["layer"]) for r in rep["groups"][1]["offload_refusals"]] == [("no_rope_npu", 3)]
    assert rep["hf"]["offload"] is True and rep["ops"]["after"]["dsa_plan"] == 1
    assert rep["ops"]["after"]["dsa_serve"] == 1  # layer 1 reads layer 0's cache: served once
    msgs = [str(w.message) for w in caught if issubclass(w.category, OffloadWarning)]
    assert len(msgs) == 1 and "not applied to group 1 (layers 2, 3)" in msgs[0] and "no_rope_npu (layer 3)" in msgs[0]
    assert "offloaded: group 0 (layers 0, 1)" in msgs[0]
    t = got["state"].totals()
    assert t["hits"] > 0 and t["hits"] + t["misses"] + t["window"] == STEPS * 2 * 64  # one group, B = 2, K = 64
    torch._dynamo.reset()
    strict = hf.build(_config("mistral_large4"), dtype="bfloat16")
    dec = strict.decoder()
    dec.prefill()
    fn = torch.compile(strict.model, fullgraph=True, backend=lambda gm, ex: rewrite_for_offload(
        gm, ex, OffloadOptions(exe_mode="ge_graph", strict=True))[0].forward)
    with pytest.raises(Exception, match="no_rope_npu") as ei:
        dec.step(fn)
    assert any(isinstance(e, OffloadRefused) for e in (ei.value, ei.value.__cause__, ei.value.__context__)) or \
        "OffloadRefused" in str(ei.value)


@pytest.mark.parametrize("family", [f for f in ("mistral_large4", "glm5_next", "hy_v4_vl") if installed(f)])
def test_offload_demo_runs_the_family_preset(family, capsys, caplog):
    """``offload-demo --model hf --config <preset>`` as a user runs it (the whole preset: hf-mistral-large4 has
    8 layers in 3 groups, layer 7 reading layer 3's cache across groups): offloaded, within the demo's
    tolerance, hits; groups of one graph that read one cache run together, so no pool is reset cold."""
    import json
    import logging

    from offload_passes.apps import demo

    torch._dynamo.reset()
    preset = families.FAMILY_TABLE[family].preset
    with caplog.at_level(logging.INFO, logger="offload_passes"):
        rc = demo.main(["--model", "hf", "--config", preset, "--steps", "8", "--json"])
    limit = dynamo_limit(family)
    if limit is not None:  # torch 2.8: refused by name before anything is compiled
        assert limit.startswith(f"{family}: torch {torch.__version__}'s Dynamo cannot trace its decode step")
        assert (rc, capsys.readouterr()) == (2, ("", f"offload-demo: error: --config {preset!r}: {limit}\n"))
        return
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["within_tolerance"] and out["offload"] is True and out["refusals"] == [], out
    assert out["hits"] > 0 and out["ops"]["dsa_plan"] == len(out["groups"])
    assert not [r for r in caplog.records if "were reset" in r.getMessage()]
    if family == "mistral_large4":  # 8 layers; 1 reads 0's cache, 5 reads 4's (same group): 6 serves
        assert out["groups"] == [[0, 1, 2], [3, 4, 5], [6, 7]] and out["ops"]["dsa_serve"] == 6
        assert out["hits"] > 3 * out["misses"], out  # warm after the first step
