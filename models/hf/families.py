"""Which ``transformers`` classes a preset builds, and what the backend does with each family that has an indexer.

A preset's config class and causal-LM class are both looked up from the yaml's ``model_type`` in transformers'
own auto mappings (never a class hard-coded per family). A model type with a causal-LM class (``glm_moe_dsa``,
``deepseek_v32``, ``hy_v4``, ``dots3_note_text``, ``deepseek_v4``, ...) builds that class; a multimodal type
whose text decoder is only reachable through its image-text-to-text class (``glm5_next``, ``mistral_large4``)
builds that one, and a text-only prompt runs its text decoder.

:data:`FAMILY_TABLE` accounts for every family ``survey.survey()`` finds in a verified transformers release
(``tests/hf/test_zoo.py`` enumerates the installed one and checks each row's outcome on a tiny random model);
docs/hf.md's family table is :func:`family_table_markdown` (checked equal by ``tests/hf/test_zoo.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

DEFAULT_MODEL_TYPE = "glm_moe_dsa"


def _auto():
    from transformers.models.auto import configuration_auto, modeling_auto

    return configuration_auto, modeling_auto


def model_types() -> list[str]:
    """Every model type transformers can build a config for."""
    return sorted(_auto()[0].CONFIG_MAPPING_NAMES)


def make_config(model_type: str, model_config: Mapping[str, Any]) -> Any:
    """The model type's config class, built from the preset's ``model_config`` mapping."""
    conf_auto, _ = _auto()
    if model_type not in conf_auto.CONFIG_MAPPING_NAMES:
        raise ValueError(f"model_type {model_type!r} is not a transformers model type (transformers knows "
                         f"{len(conf_auto.CONFIG_MAPPING_NAMES)} types, e.g. {DEFAULT_MODEL_TYPE!r})")
    return conf_auto.CONFIG_MAPPING[model_type](**dict(model_config))


def model_class(config: Any) -> type:
    """The class that decodes text for ``config``: causal LM first, else image-text-to-text."""
    _, mod_auto = _auto()
    for mapping in (mod_auto.MODEL_FOR_CAUSAL_LM_MAPPING, mod_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING):
        if type(config) in mapping:
            return mapping[type(config)]
    raise ValueError(f"model_type {config.model_type!r} has no causal-LM or image-text-to-text class in transformers")


def set_attn_implementation(config: Any, cls: type, attn: str) -> None:
    """Set ``attn`` on the config and every sub-config; refuse an implementation the class does not support
    (transformers' own ``_supports_sdpa`` flag), which it would otherwise run as a different model."""
    if attn == "sdpa" and not getattr(cls, "_supports_sdpa", False):
        raise ValueError(f"attn_implementation 'sdpa': {cls.__name__} ({config.model_type}) does not support it "
                         "(transformers' _supports_sdpa is False); use 'eager'")
    config._attn_implementation = attn
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            sub._attn_implementation = attn


def text_config(config: Any) -> Any:
    """The decoder's config (the config itself for a text model)."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


#: what the backend does with a family's decode graph today, on its tiny preset (``tests/hf/test_zoo.py``)
OUTCOMES = {
    "offload": "rewritten to sparse attention, offloaded (f16/bf16 caches)",
    "sparse": "rewritten to sparse attention (exact); the offload is refused with the named reasons",
    "refused": "compiled unmodified; the backend refuses it with the named reasons (one warning)",
    "unnamed": "compiled unmodified and no reason is reported",
}


@dataclass(frozen=True)
class FamilyEntry:
    """One transformers model family (the folder ``transformers/models/<family>/``) whose code has an indexer."""

    model_types: tuple[str, ...]  # its decoding model types (survey.decoding_model_types)
    preset: str  # models/configs/<preset>.yaml: a tiny random model of the family
    selection: str  # how it selects the keys each query attends to
    outcome: str  # a key of OUTCOMES
    reasons: tuple[str, ...] = ()  # the refusal codes the backend reports ("sparse": offload refusals)
    since: Optional[str] = None  # the transformers release that added the family, when newer than 5.23
    fullgraph: bool = True  # Dynamo traces its decode step into one graph (fullgraph=True compiles)
    needs: str = ""  # what the offload of this family would take (outcomes other than "offload")
    # its decode step builds transformers' KVSharingDict (a collections.UserDict): a Dynamo that skips UserDict
    # (torch 2.8's) cannot trace it (dynamo_limit)
    kv_sharing_dict: bool = False

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {sorted(OUTCOMES)}, got {self.outcome!r}")
        if (self.outcome in ("sparse", "refused")) != bool(self.reasons):
            raise ValueError(f"outcome {self.outcome!r}: reasons {self.reasons} (named exactly for sparse / refused)")


_MLA = "MLA latent + rope caches"
FAMILY_TABLE: dict[str, FamilyEntry] = {
    "glm_moe_dsa": FamilyEntry(("glm_moe_dsa",), "hf-tiny", f"lightning indexer top-k, IndexShare; {_MLA}", "offload"),
    "deepseek_v32": FamilyEntry(("deepseek_v32",), "hf-deepseek-v32", f"lightning indexer top-k per layer; {_MLA}",
                                "offload"),
    "axk2": FamilyEntry(("axk2",), "hf-axk2", f"lightning indexer top-k per layer; {_MLA}", "offload"),
    "hy_v4": FamilyEntry(("hy_v4",), "hf-hy-v4", f"lightning indexer top-k, IndexShare, attention sinks; {_MLA}",
                         "offload"),
    "hy_v4_vl": FamilyEntry(("hy_v4_vl",), "hf-hy-v4-vl", "hy_v4's, with multimodal rope (text decoder)", "offload",
                            since="5.24"),
    "dots3_note": FamilyEntry(("dots3_note", "dots3_note_text"), "hf-dots3-note",
                              f"lightning indexer top-k on indexed layers, sliding-window layers dense; {_MLA}",
                              "offload"),
    "mistral_large4": FamilyEntry(
        ("mistral_large4",), "hf-mistral-large4",
        f"lightning indexer top-k, IndexShare, cross-layer KV sharing (kv_source_layers), NoPE every 4th layer "
        f"(served in the ops' no-rope mode, Dr = 0); {_MLA}", "offload", kv_sharing_dict=True),
    "glm5_next": FamilyEntry(
        ("glm5_next",), "hf-glm5-next",
        "pooled indexer: top pools of index_kpool tokens expanded to token ids + the tail pool; NoPE MLA; "
        "linear-attention layers; K = index_topk + index_kpool - 1 ids, padded with -1 to a multiple of 64 for "
        "the offload; NoPE (Dr = 0)", "offload"),
    "deepseek_v4": FamilyEntry(
        ("deepseek_v4",), "hf-deepseek-v4", "indexer top-k over compressed KV entries computed in the graph",
        "refused", ("hf_compressed_kv",),
        needs="a static, index-addressable cache of the compressed entries"),
    "minimax_m3_vl": FamilyEntry(
        ("minimax_m3_vl", "minimax_m3_vl_text"), "hf-minimax-m3",
        "block top-k per indexer head (= per KV head), expanded to a [B, H, S, T] float mask; GQA, no MLA",
        "refused", ("block_topk",),
        needs="serving at block granularity with one selection per KV head (GQA K / V caches, no latent)"),
    "qwen4_exp": FamilyEntry(
        ("qwen4_exp", "qwen4_exp_text"), "hf-qwen4-exp",
        "QSA: per row and query, a Python loop pools visible keys in blocks and keeps the best blocks; GQA",
        "refused", ("indexer_split",), fullgraph=False,
        needs="a traceable selection (transformers' loop branches on data: no full graph with any backend), "
              "then GQA caches and block granularity"),
    "kolibri1_1": FamilyEntry(
        ("kolibri1_1",), "hf-kolibri1-1",
        "indexer layers choose a candidate pool from block summaries, every indexed layer the top-k of its pool "
        "+ sink and local tokens (bool masks); GQA, NoPE, cross-layer KV sharing", "refused", ("indexer_split",),
        since="5.25", fullgraph=False,
        needs="a traceable selection (transformers' loops branch on data), then GQA caches, a no-rope mode and "
              "shared pools", kv_sharing_dict=True),
    "doge": FamilyEntry(
        ("doge",), "hf-doge", "no indexer: per-head top-k of a value-derived bias (dynamic mask attention); GQA",
        "refused", ("attention_topk",), needs="per-head selection over GQA caches (no shared selection per query row)"),
}


def dynamo_limit(model_type: str) -> Optional[str]:
    """Why this torch's Dynamo cannot trace the decode step of the family that decodes ``model_type`` at all
    (with any backend), or None. The HF demo refuses such a preset with this sentence."""
    from offload_passes import _compat

    fam = next((f for f, e in FAMILY_TABLE.items() if model_type in e.model_types), None)
    entry = FAMILY_TABLE.get(fam) if fam is not None else None
    # a family without a full graph on any torch only breaks earlier there (the backend refuses it the same way)
    if entry is None or not (entry.kv_sharing_dict and entry.fullgraph) or _compat.dynamo_traces_user_dict():
        return None
    import torch

    return (f"{fam}: torch {torch.__version__}'s Dynamo cannot trace its decode step: transformers' KVSharingDict "
            f"is a collections.UserDict, whose __init__ this Dynamo skips (torch 2.13 traces it)")


def family_table_markdown() -> str:
    """docs/hf.md's family table, one row per :data:`FAMILY_TABLE` entry."""
    rows = ["| family (model types) | since | preset | how it selects | outcome | named reason | what the offload "
            "would need |", "|---|---|---|---|---|---|---|"]
    for fam, e in FAMILY_TABLE.items():
        types = ", ".join(f"`{t}`" for t in e.model_types)
        reasons = ", ".join(f"`{r}`" for r in e.reasons) or ("—" if e.outcome == "offload" else "none reported")
        outcome = e.outcome + ("" if e.fullgraph else "; no full graph")
        if e.kv_sharing_dict and e.fullgraph:
            outcome += "; not on torch 2.8 (its Dynamo skips `collections.UserDict`: transformers' `KVSharingDict`)"
        rows.append(f"| `{fam}` ({types}) | {e.since or '5.23'} | `{e.preset}` | {e.selection} | {outcome} | "
                    f"{reasons} | {e.needs or '—'} |")
    return "\n".join(rows) + "\n"


__all__ = ["DEFAULT_MODEL_TYPE", "FAMILY_TABLE", "FamilyEntry", "OUTCOMES", "dynamo_limit", "family_table_markdown",
           "make_config", "model_class", "model_types", "set_attn_implementation", "text_config"]
