"""offload-capacity: the KV arithmetic against hand-computed numbers for the 78-layer GLM-5.2 layout at 64K,
the reference deployment's 64 -> 128 global batch, IndexShare parsing and bad input."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from offload_passes.tools import capacity_plan as cp
from offload_passes.tools.capacity_plan_model import derive_indexer_types, groups_of, load_model_shape

ROOT = Path(__file__).resolve().parents[2]

GiB = 1 << 30

# ---- hand-computed GLM-5.2 numbers (78 layers + 1 MTP layer, next_n = 3, 64K context, bf16 KV) ----
CTX = 65536
LATENT = (512 + 64) * 2                      # 1152 B per token per attention layer
IDX = 128 * 2                                # 256 B per token per full (indexer) layer
N_ATTN = 78 + 1                              # + MTP layer
N_IDX = 21 + 1                               # 21 full layers + MTP
PER_TOKEN = N_ATTN * LATENT + N_IDX * IDX    # 91008 + 5632
FULL_KV = CTX * N_ATTN * LATENT              # latent KV (host when offloaded)
IDX_CACHE = CTX * N_IDX * IDX
SEL_LAYER = 4 * 2048 * 576 * 2 + 4 * 2049 * 4 + 4 * 16 * 4      # rows + ledger + block table
POOL_LAYER = {8192: 8192 * 1152, 16384: 16384 * 1152}
META_GROUP = {8192: (8192 + 131072 + 512) * 4, 16384: (16384 + 131072 + 1024) * 4}
PLAN_SCRATCH = 4 * 2048 * 2 * 4 + 4 * 4 + 4 * 8 * 4096 + 4096
STAGING = CTX * 576 * 2
# weights per rank: attention (q_a, q_b, kv_a, kv_b, o), indexer, experts, EP over 32 ranks, W8A8
ATTN = 6144 * 2048 + 2048 * 64 * 256 + 6144 * 576 + 512 * 64 * 448 + 64 * 256 * 6144
INDEXER = 2048 * 32 * 128 + 6144 * 128 + 6144 * 32
EXPERT = 3 * 6144 * 2048
WEIGHTS = (76 * 256 * EXPERT // 32                                   # routed experts (75 MoE + MTP) / 32 ranks
           + 79 * ATTN + 22 * INDEXER + 76 * EXPERT + 3 * 3 * 6144 * 12288 + 2 * 6144 * 6144   # replicated, 1 B
           + 76 * 6144 * 256 * 4                                     # fp32 router
           + 2 * 154880 * 6144 * 2 // 32)                            # bf16 embedding + lm_head / 32


def glm(budget: cp.Budget | None = None, **kw) -> cp.Plan:
    return cp.plan(load_model_shape("glm-5.2"), budget or cp.Budget(), **kw)


def test_per_token_and_per_request_bytes_78_layers_64k():
    p = glm()
    assert p.model["groups"] == 21 and p.model["full_layers"] == 21 and p.model["mtp_layers"] == 1
    assert p.model["group_sizes"] == [1, 1] + [4] * 19
    assert PER_TOKEN == 96640
    assert p.per_token["total"] == PER_TOKEN
    assert p.per_request["full_kv"] == FULL_KV == 5_964_300_288
    assert p.per_request["indexer_cache"] == IDX_CACHE == 369_098_752
    assert p.mode("no offload").device_per_request == FULL_KV + IDX_CACHE == 6_333_399_040
    assert p.per_request["selection_per_layer"] == SEL_LAYER == 9_470_224
    for ps in (8192, 16384):
        assert p.per_request[f"pool_{ps}_per_layer"] == POOL_LAYER[ps]
        assert p.per_request[f"pool_{ps}_metadata_per_group"] == META_GROUP[ps]
        dev = IDX_CACHE + N_ATTN * SEL_LAYER + 78 * POOL_LAYER[ps] + 21 * META_GROUP[ps] + PLAN_SCRATCH
        m = p.mode(f"shared-indexer offload, pool {ps}")
        assert m.device_per_request == dev and m.device_fixed == STAGING and m.host_per_request == FULL_KV
    assert p.mode("shared-indexer offload, pool 16384").device_per_request == 2_602_120_192
    assert p.mode("basic offload").device_per_request == IDX_CACHE + N_ATTN * SEL_LAYER


def test_weights_and_largest_batch_with_default_assumptions():
    p = glm()
    assert p.per_rank["weights"] == WEIGHTS == 40_414_937_088
    free = 64 * GiB - WEIGHTS - 10 * GiB
    assert p.per_rank["free"] == free
    assert p.mode("no offload").max_per_rank == free // (FULL_KV + IDX_CACHE) == 2
    assert p.mode("no offload").max_global == 64
    for ps, per_rank in ((8192, 9), (16384, 6)):
        m = p.mode(f"shared-indexer offload, pool {ps}")
        assert m.max_per_rank == (free - STAGING) // m.device_per_request == per_rank
        assert m.max_global == 32 * per_rank and m.bound_by == "HBM"
        assert m.pool_bytes_per_rank == per_rank * (78 * POOL_LAYER[ps] + 21 * META_GROUP[ps])
        assert m.host_bytes_per_device == 2 * per_rank * FULL_KV


@pytest.mark.parametrize("reserve_gib", [9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 14.5])
def test_reference_doubling_64_to_128_on_16_devices(reserve_gib):
    """Huawei's GLM-5.2 guide: 2 x Atlas A3 (16 cards, 32 ranks), 64K, MTP3: global batch 64 without
    offload, 128 with it (8K and 16K pools). The arithmetic gives exactly 64 without offload and room
    for 128 with either pool over the whole reserve range in which the no-offload answer is 64."""
    p = glm(cp.Budget(reserve_gib_per_rank=reserve_gib), batch=128)
    assert p.mode("no offload").max_global == 64
    checks = {c["mode"]: c["fits"] for c in p.batch_check}
    assert checks["no offload"] is False
    assert checks["shared-indexer offload, pool 8192"] is True
    assert checks["shared-indexer offload, pool 16384"] is True
    for ps in (8192, 16384):
        assert p.mode(f"shared-indexer offload, pool {ps}").max_global >= 2 * p.mode("no offload").max_global


def test_reserve_window_is_the_exact_range_of_the_no_offload_answer():
    p = glm()
    lo, hi = p.mode("no offload").reserve_window_gib
    per_req = FULL_KV + IDX_CACHE
    assert lo == pytest.approx((64 * GiB - WEIGHTS - 3 * per_req) / GiB)
    assert hi == pytest.approx((64 * GiB - WEIGHTS - 2 * per_req) / GiB)
    assert round(lo, 2) == 8.67 and round(hi, 2) == 14.56
    inside = glm(cp.Budget(reserve_gib_per_rank=hi - 1e-6)).mode("no offload").max_global
    above = glm(cp.Budget(reserve_gib_per_rank=hi + 1e-3)).mode("no offload").max_global
    below = glm(cp.Budget(reserve_gib_per_rank=lo - 1e-3)).mode("no offload").max_global
    assert (below, inside, above) == (96, 64, 32)


def test_host_memory_bounds_the_offload_batch():
    # 48 GiB of host memory per card = 24 GiB per rank: floor(24 GiB / 5.555 GiB) = 4 requests per rank
    p = glm(cp.Budget(host_mem_per_device_gib=48))
    m = p.mode("shared-indexer offload, pool 16384")
    assert m.max_per_rank == (24 * GiB) // FULL_KV == 4 and m.bound_by == "host memory" and m.max_global == 128
    assert m.reserve_window_gib is None
    assert p.mode("no offload").bound_by == "HBM" and p.mode("no offload").max_global == 64


def test_repository_preset_has_the_same_kv_layout():
    """models/configs/glm-5.2-78l.yaml keeps GLM-5.2's KV / indexer layout (with small weights)."""
    shape = load_model_shape("glm-5.2-78l")
    assert shape.groups == load_model_shape("glm-5.2").groups
    p = cp.plan(shape, cp.Budget(next_n=3), weights_like=load_model_shape("glm-5.2"))
    ref = glm()
    assert p.per_token == ref.per_token and p.per_request == ref.per_request
    assert [m.max_global for m in p.modes] == [m.max_global for m in ref.modes]
    assert p.model["weights_from"] == "glm-5.2"


def test_no_mtp_when_next_n_is_zero():
    p = glm(cp.Budget(next_n=0))
    assert p.model["mtp_layers"] == 0
    assert p.per_token["total"] == 78 * LATENT + 21 * IDX
    assert p.per_request["selection_per_layer"] == 1 * 2048 * 1152 + 2049 * 4 + 16 * 4


@pytest.mark.parametrize("preset, groups", [
    ("tiny", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("small", [[0], [1], [2, 3, 4, 5], [6, 7, 8, 9], [10, 11, 12, 13], [14, 15]]),
])
def test_presets_groups(preset, groups):
    assert load_model_shape(preset).groups == groups


def test_indexer_types_sources():
    t, src = derive_indexer_types({"indexer_types": ["full", "shared", "full"]}, 3)
    assert t == ["full", "shared", "full"] and src == "indexer_types"
    t, _ = derive_indexer_types({"index_topk_pattern": "FSSF"}, 4)
    assert groups_of(t) == [[0, 1, 2], [3]]
    t, src = derive_indexer_types({}, 3)
    assert t == ["full"] * 3 and "one indexer per layer" in src
    with pytest.raises(ValueError, match="index_topk_pattern: letters must be 'F' or 'S'"):
        derive_indexer_types({"index_topk_pattern": "FX"}, 2)
    with pytest.raises(ValueError, match="has 2 entries, num_hidden_layers is 3"):
        derive_indexer_types({"indexer_types": ["full", "shared"]}, 3)
    with pytest.raises(ValueError, match="layer 0 must be 'full'"):
        derive_indexer_types({"index_topk_pattern": "SF"}, 2)


def test_user_yaml_flat_keys(tmp_path):
    cfg = {"num_hidden_layers": 4, "kv_lora_rank": 64, "qk_rope_head_dim": 16, "index_head_dim": 32,
           "index_topk": 128, "index_topk_pattern": "FSFS", "num_nextn_predict_layers": 0}
    f = tmp_path / "m.yaml"
    f.write_text(yaml.safe_dump(cfg))
    p = cp.plan(load_model_shape(str(f)), cp.Budget(next_n=0, context_len=1000, pa_block_size=64,
                                                   pool_sizes=(256,), weights_gib_per_rank=1.0))
    ctx = 1024                                            # 1000 rounded up to the 64-token block
    assert p.per_request["context_tokens"] == ctx
    assert p.per_request["full_kv"] == ctx * 4 * 80 * 2 and p.per_request["indexer_cache"] == ctx * 2 * 32 * 2
    assert p.per_request["pool_256_metadata_per_group"] == (256 + 131072 + 16) * 4


# -- bad input ----------------------------------------------------------------------------------

def test_missing_keys_and_unknown_preset(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump({"model_config": {"num_hidden_layers": 4, "kv_lora_rank": 64}}))
    with pytest.raises(ValueError, match=r"missing required key\(s\) \['qk_rope_head_dim', 'index_head_dim', 'index_topk'\]"):
        load_model_shape(str(f))
    with pytest.raises(ValueError, match=r"--config 'nope': not a yaml file and not a preset \(presets: glm-5.2, "):
        load_model_shape("nope")
    f.write_text("a: [1, 2")
    with pytest.raises(ValueError, match="not valid yaml"):
        load_model_shape(str(f))
    f.write_text(yaml.safe_dump({"num_hidden_layers": 0, "kv_lora_rank": 64, "qk_rope_head_dim": 16,
                                 "index_head_dim": 32, "index_topk": 64}))
    with pytest.raises(ValueError, match="num_hidden_layers must be > 0, got 0"):
        load_model_shape(str(f))


def test_weight_dims_missing_needs_weights_gib():
    shape = load_model_shape("tiny")
    bare = replace(shape, dims={})
    b = cp.Budget(pa_block_size=16, pool_sizes=(256,), next_n=0)
    with pytest.raises(ValueError, match="weights_gib_per_rank: .* lacks .*hidden_size.*pass --weights-gib"):
        cp.plan(bare, b)
    assert cp.plan(bare, replace(b, weights_gib_per_rank=1.0)).per_rank["weights"] == GiB
    with pytest.raises(ValueError, match="index_topk 64 must be divisible by pa_block_size 128"):
        cp.plan(shape, cp.Budget(weights_gib_per_rank=1.0))


@pytest.mark.parametrize("kw, message", [
    ({"next_n": 4}, r"next_n must be an integer in \[0, 3\] \(raw_seq = 1 \+ next_n <= custom::dsa_install's "
                     r"MAX_RAW_SEQ 4\), got 4"),
    ({"pool_sizes": (1000,)}, r"pool_size must be a multiple of 16 \(dsa_plan / dsa_install limits\), got 1000"),
    ({"pool_sizes": (32768,)}, r"pool_size must be in \(0, 16384\] \(dsa_plan / dsa_install limits\), got 32768"),
    ({"pool_sizes": (48 * 16,)}, r"pool_size / 16 \(sets\) must be a power of two \(dsa_plan / dsa_install "
                                  r"limits\), got 48"),
    ({"pool_sizes": (16 * 4,)}, r"pool_size must be a multiple of the selection block size 128 "
                                r"\(dsa_plan / dsa_install limits\), got 64"),
    ({"pool_sizes": (8192.0,)}, r"pool_size must be an integer, got 8192.0"),
    ({"devices": 0}, r"devices must be an integer in \[1, 8192\] \(up to 8192 devices\), got 0"),
    ({"hbm_per_device_gib": 64.0}, "hbm_per_device_gib: 64 GiB per device leaves no room for KV"),
    ({"reserve_gib_per_rank": -1.0}, r"reserve_gib_per_rank must be a finite number in \[0, 4096\] \(GiB per rank\), "
                                       r"got -1.0"),
    ({"kv_dtype_bytes": 1}, "kv_dtype_bytes must be 2 .* or 4 .*, got 1: the int8"),
])
def test_bad_budget(kw, message):
    with pytest.raises(ValueError, match=message):
        glm(cp.Budget(**kw))


def test_f32_kv_is_planned_but_the_pool_mode_is_refused():
    p = glm(cp.Budget(kv_dtype_bytes=4, hbm_per_device_gib=256), batch=32)
    assert p.per_token["latent_per_layer"] == 576 * 4
    m = p.mode("shared-indexer offload, pool 8192")
    assert m.applicable is False and "f16/bf16 KV only" in m.note
    assert {c["mode"]: c["fits"] for c in p.batch_check}["shared-indexer offload, pool 8192"] is False


def test_batch_must_be_a_multiple_of_ranks():
    with pytest.raises(ValueError, match="batch must be a positive multiple of the 32 ranks"):
        glm(batch=100)


# -- CLI ----------------------------------------------------------------------------------------

def test_cli_text_shows_the_arithmetic(capsys):
    assert cp.main(["--batch", "128"]) == 0
    out = capsys.readouterr().out
    assert "latent row / token / layer         = (kv_lora_rank 512 + qk_rope_head_dim 64) * 2 B  = 1,152 B" in out
    assert "KV / token                         = 79 * 1152 + 22 * 256  = 96,640 B" in out
    assert "no offload: global batch           = 2 * 32 ranks  = 64" in out
    assert "batch 128 (4/rank) with no offload: needs" in out and "does NOT fit" in out
    assert out.count("-> fits") == 3                     # basic + both pools


def test_cli_json_and_errors(capsys):
    assert cp.main(["--json", "--pool-size", "16384", "--host-gib", "48"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["budget"]["pool_sizes"] == [16384] and j["budget"]["ranks"] == 32
    modes = {m["mode"]: m for m in j["modes"]}
    assert modes["shared-indexer offload, pool 16384"]["max_global"] == 128
    assert j["per_token"]["total"] == PER_TOKEN
    assert cp.main(["--config", "nope"]) == 2
    assert "offload-capacity: error: --config 'nope'" in capsys.readouterr().err
    assert cp.main(["--next-n", "5"]) == 2
    assert "--next-n must be an integer in [0, 3]" in capsys.readouterr().err


def test_offload_plan_is_an_alias_of_offload_capacity(capsys):
    """Both console scripts are installed (setup.py); the alias prints the same JSON and one stderr note."""
    scripts = re.findall(r'"(offload-[\w-]+) = ([\w.]+:\w+)"', (ROOT / "setup.py").read_text())
    assert ("offload-capacity", "offload_passes.tools.capacity_plan:main") in scripts
    assert ("offload-plan", "offload_passes.tools.capacity_plan:main_alias") in scripts
    argv = ["--config", "tiny", "--weights-gib", "1", "--context", "512", "--json"]
    assert cp.main(argv) == 0
    want = capsys.readouterr()
    assert cp.main_alias(argv) == 0
    got = capsys.readouterr()
    assert got.out == want.out and json.loads(got.out)["per_request"]["context_tokens"] == 512
    assert want.err == ""
    assert got.err.splitlines() == ["offload-plan: note: this command is offload-capacity; the name offload-plan "
                                    "is deprecated and will be removed in the next release"]


def test_console_entry_point():
    r = subprocess.run([sys.executable, "-m", "offload_passes.tools.capacity_plan", "--config", "tiny",
                        "--weights-gib", "1", "--context", "512", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["model"]["groups"] == 2 and j["per_request"]["context_tokens"] == 512


def test_weights_gib_beyond_the_device_is_one_line_error(capsys):
    # 1e308 GiB overflowed int() in the planner (a traceback)
    assert cp.main(["--config", "glm-5.2", "--weights-gib", "1e308"]) == 2
    err = capsys.readouterr().err
    assert err == "offload-capacity: error: --weights-gib must be a finite number in (0, 4096] (GiB per rank), got 1e+308\n"
    assert cp.main(["--config", "glm-5.2", "--weights-gib", "200"]) == 2
    assert capsys.readouterr().err == ("offload-capacity: error: --weights-gib must be <= --hbm-gib / "
                                       "--ranks-per-device (64 GiB per rank), got 200\n")
