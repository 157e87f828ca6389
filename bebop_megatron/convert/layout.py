"""Hugging Face <-> megatron-core tensor names and layouts for Qwen2/Qwen3 dense models with MTP.

One place for the mapping, used by ``bebop convert`` (both directions) and by rollout weight
sync. Megatron names here are *full* (TP=1) tensors with *global* layer indices; TP sharding is
``bebop_megatron.model.tp_layout``'s job and PP offsets are applied by the callers.

* ``linear_qkv`` is [q_g, k_g, v_g] per query group g (heads_per_group*hd, hd, hd rows);
* ``linear_fc1`` is [gate; up];
* local-spec norms (``input_layernorm``, ``pre_mlp_layernorm``) and Transformer Engine's fused
  ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight`` both map to HF's norms;
* MTP depth k (``mtp.layers.k``) <-> DeepSeek-V3 ``model.layers.{L+k}.{enorm,hnorm,eh_proj,
  shared_head.norm,<decoder layer>}`` or Qwen3-Next ``mtp.{pre_fc_norm_embedding,
  pre_fc_norm_hidden,fc,norm,layers.0.<decoder layer>}`` (one module, used for every depth).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor


class ConversionError(ValueError):
    """A checkpoint that cannot be converted; the message names the tensor or setting."""


@dataclass(frozen=True)
class Shapes:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_groups: int
    head_dim: int
    vocab_size: int  # true vocab (HF)
    padded_vocab_size: int  # megatron
    tie: bool
    mtp_layers: int  # megatron γ
    mtp_layout: str  # deepseek | qwen3_next (HF side)
    qkv_bias: bool
    qk_norm: bool

    @classmethod
    def from_config(cls, cfg, tp: int = 1, mtp_layout: str = "deepseek") -> "Shapes":
        m = cfg.model
        return cls(m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.kv_channels,
                   m.vocab_size, m.padded_vocab_size(tp), m.tie_word_embeddings, m.mtp_num_layers, mtp_layout,
                   bool(m.add_qkv_bias), bool(m.qk_layernorm))


# --------------------------------------------------------------------------- transforms


def qkv_to_megatron(q: Tensor, k: Tensor, v: Tensor, s: Shapes) -> Tensor:
    g, hd = s.num_groups, s.head_dim
    tail = q.shape[1:]
    q = q.reshape(g, (s.num_heads // g) * hd, *tail)
    k = k.reshape(g, hd, *tail)
    v = v.reshape(g, hd, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def qkv_from_megatron(w: Tensor, s: Shapes) -> tuple[Tensor, Tensor, Tensor]:
    g, hd = s.num_groups, s.head_dim
    per_q = (s.num_heads // g) * hd
    tail = w.shape[1:]
    w = w.reshape(g, per_q + 2 * hd, *tail)
    q, k, v = torch.split(w, [per_q, hd, hd], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def pad_vocab(t: Tensor, s: Shapes) -> Tensor:
    if t.shape[0] == s.padded_vocab_size:
        return t
    if t.shape[0] > s.padded_vocab_size:
        raise ConversionError(f"vocab rows {t.shape[0]} > padded vocab {s.padded_vocab_size}")
    out = torch.zeros(s.padded_vocab_size, *t.shape[1:], dtype=t.dtype)
    out[: t.shape[0]] = t
    return out


# --------------------------------------------------------------------------- layer maps

# megatron suffix inside a transformer layer -> HF suffix (1:1 tensors)
_LAYER_1TO1 = {
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",  # TE fused
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",  # TE fused
}


@dataclass
class Recipe:
    """How to build one megatron tensor from HF tensors (and back)."""

    hf_names: list[str]
    to_megatron: Callable[[list[Tensor]], Tensor]
    from_megatron: Callable[[Tensor], list[Tensor]]


def _layer_recipe(suffix: str, hf_prefix: str, s: Shapes) -> Optional[Recipe]:
    if suffix in _LAYER_1TO1:
        return Recipe([hf_prefix + _LAYER_1TO1[suffix]], lambda t: t[0], lambda t: [t])
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        names = [f"{hf_prefix}self_attn.{p}_proj.{kind}" for p in "qkv"]
        return Recipe(names, lambda t: qkv_to_megatron(t[0], t[1], t[2], s), lambda t: list(qkv_from_megatron(t, s)))
    if suffix == "mlp.linear_fc1.weight":
        names = [hf_prefix + "mlp.gate_proj.weight", hf_prefix + "mlp.up_proj.weight"]
        return Recipe(names, lambda t: torch.cat(t, 0), lambda t: list(torch.chunk(t, 2, 0)))
    return None


def recipe_for(name: str, s: Shapes) -> Optional[Recipe]:
    """Recipe for a full megatron parameter name (global layer index); None: not in HF."""
    if name == "embedding.word_embeddings.weight":
        return Recipe(["model.embed_tokens.weight"], lambda t: pad_vocab(t[0], s), lambda t: [t[: s.vocab_size]])
    if name == "output_layer.weight":
        if s.tie:
            return None
        return Recipe(["lm_head.weight"], lambda t: pad_vocab(t[0], s), lambda t: [t[: s.vocab_size]])
    if name == "decoder.final_layernorm.weight":
        return Recipe(["model.norm.weight"], lambda t: t[0], lambda t: [t])
    if name.startswith("decoder.layers."):
        i, suffix = name[len("decoder.layers."):].split(".", 1)
        return _layer_recipe(suffix, f"model.layers.{int(i)}.", s)
    if name.startswith("mtp.layers."):
        k, suffix = name[len("mtp.layers."):].split(".", 1)
        k = int(k)
        if s.mtp_layout == "deepseek":
            base = f"model.layers.{s.num_layers + k}."
            heads = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
                     "eh_proj.weight": "eh_proj.weight", "final_layernorm.weight": "shared_head.norm.weight"}
            layer_prefix = base
        else:
            base = "mtp."
            heads = {"enorm.weight": "pre_fc_norm_embedding.weight", "hnorm.weight": "pre_fc_norm_hidden.weight",
                     "eh_proj.weight": "fc.weight", "final_layernorm.weight": "norm.weight"}
            layer_prefix = "mtp.layers.0."
        if suffix in heads:
            return Recipe([base + heads[suffix]], lambda t: t[0], lambda t: [t])
        for layer_attr in ("transformer_layer.", "mtp_model_layer."):  # 0.16 / 0.17+ attribute names
            if suffix.startswith(layer_attr):
                return _layer_recipe(suffix[len(layer_attr):], layer_prefix, s)
    return None


def hf_config(s: Shapes, arch: str, rope_theta: float, norm_eps: float, max_pos: int,
              eos_token_id: Optional[int] = None) -> dict:
    """config.json for the HF export (transformers' Qwen2/Qwen3 fields + the MTP layout)."""
    cls = "Qwen3ForCausalLM" if arch == "qwen3" else "Qwen2ForCausalLM"
    cfg = {
        "architectures": [cls], "model_type": arch, "vocab_size": s.vocab_size, "hidden_size": s.hidden_size,
        "intermediate_size": None, "num_hidden_layers": s.num_layers, "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_groups, "head_dim": s.head_dim, "hidden_act": "silu",
        "max_position_embeddings": max_pos, "rms_norm_eps": norm_eps, "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "tie_word_embeddings": s.tie, "attention_bias": s.qkv_bias, "torch_dtype": "float32",
        "eos_token_id": eos_token_id, "bebop_mtp_hidden": "normed",
    }
    if s.mtp_layers:
        if s.mtp_layout == "deepseek":
            cfg["num_nextn_predict_layers"] = s.mtp_layers
        else:
            cfg["mtp_num_hidden_layers"] = 1
    return cfg
