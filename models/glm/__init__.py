"""GLM-5.2 (HF ``glm_moe_dsa``) decode model, config, weights and driver. See ``offload_passes.models``."""
from .config import GlmConfig, ModelConfig, RunnerConfig, list_presets, load_config, model_config_from_hf
from .driver import Driver, RunResult, StepOutput
from .modeling import GlmMoeDsaForCausalLM
from .npu_ops import OPS_NAMESPACE
from .weights import init_weights, load_safetensors, save_safetensors

__all__ = [
    "GlmConfig", "ModelConfig", "RunnerConfig", "list_presets", "load_config", "model_config_from_hf",
    "Driver", "RunResult", "StepOutput", "GlmMoeDsaForCausalLM", "OPS_NAMESPACE",
    "init_weights", "load_safetensors", "save_safetensors",
]
