"""Layer specs: Transformer Engine on GPUs, megatron-core local modules + torch SDPA elsewhere."""

from __future__ import annotations

import copy
import importlib.util
from functools import lru_cache

from megatron.core.transformer.spec_utils import ModuleSpec

from bebop_megatron.config import ModelConfig


class MissingOptionalDependency(RuntimeError):
    """An optional GPU dependency (Transformer Engine, apex, SGLang) was asked for but is absent."""


@lru_cache(maxsize=None)
def transformer_engine_available() -> bool:
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # broken install / no CUDA runtime
        return False
    return True


def use_transformer_engine(model: ModelConfig) -> bool:
    """Resolve ``transformer_impl`` (auto picks TE when importable); FP8 requires TE."""
    te = transformer_engine_available()
    if model.transformer_impl == "transformer_engine" and not te:
        raise MissingOptionalDependency(
            "model.transformer_impl=transformer_engine but Transformer Engine is not importable. "
            "Install the GPU extra (pip install 'bebop_megatron[gpu]') on a CUDA machine, "
            "or set model.transformer_impl=local."
        )
    if model.fp8 and not te:
        raise MissingOptionalDependency(
            f"model.fp8={model.fp8} needs Transformer Engine, which is not importable here. "
            "Install the GPU extra (pip install 'bebop_megatron[gpu]') on a Hopper/Blackwell GPU, "
            "or set model.fp8=null."
        )
    if model.transformer_impl == "local":
        return False
    return te


def build_layer_spec(model: ModelConfig, use_te: bool) -> ModuleSpec:
    """One decoder layer of a Qwen-style model (RMSNorm, SwiGLU, RoPE, GQA, optional QK-norm)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=model.qk_layernorm)
    from bebop_megatron.model.sdpa_attention import SDPAAttention

    spec = copy.deepcopy(
        gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=model.qk_layernorm, normalization="RMSNorm")
    )
    spec.submodules.self_attention.submodules.core_attention = SDPAAttention
    return spec


def build_mtp_block_spec(transformer_config, layer_spec: ModuleSpec, use_te: bool):
    """MTP block spec (None on pipeline stages that hold no MTP layer)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    return get_gpt_mtp_block_spec(transformer_config, layer_spec, use_transformer_engine=use_te)
