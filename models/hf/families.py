"""Which ``transformers`` classes a preset builds: its config class and its causal-LM class, both looked up
from the yaml's ``model_type`` in transformers' own auto mappings (never a class hard-coded per family).

A model type with a causal-LM class (``glm_moe_dsa``, ``deepseek_v32``, ``hy_v4``, ``dots3_note_text``,
``deepseek_v4``, ...) builds that class; a multimodal type whose text decoder is only reachable through its
image-text-to-text class (``glm5_next``) builds that one, and a text-only prompt runs its text decoder.
"""
from __future__ import annotations

from typing import Any, Mapping

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


__all__ = ["DEFAULT_MODEL_TYPE", "make_config", "model_class", "model_types", "set_attn_implementation",
           "text_config"]
