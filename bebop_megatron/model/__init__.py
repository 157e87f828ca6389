"""Qwen-style megatron-core model with MTP layers."""

from bebop_megatron.model.gpt import BebopGPTModel, build_model, build_transformer_config  # noqa: F401

__all__ = ["BebopGPTModel", "build_model", "build_transformer_config"]
