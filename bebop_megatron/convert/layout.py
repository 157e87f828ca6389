"""Hugging Face <-> megatron-core tensor names and layouts for Qwen2/Qwen3 dense models and the
Qwen3.5 hybrid (Gated DeltaNet + gated attention), with MTP.

One place for the mapping, used by ``bebop convert`` (both directions) and by rollout weight
sync. Megatron names here are *full* (TP=1) tensors with *global* layer indices; TP sharding is
``bebop_megatron.model.tp_layout``'s job and PP offsets are applied by the callers.

* ``linear_qkv`` is [q_g, k_g, v_g] per query group g (heads_per_group*hd, hd, hd rows);
* ``linear_fc1`` is [gate; up];
* local-spec norms (``input_layernorm``, ``pre_mlp_layernorm``) and Transformer Engine's fused
  ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight`` both map to HF's norms;
* MTP depth k (``mtp.layers.k``) <-> DeepSeek-V3 ``model.layers.{L+k}.{enorm,hnorm,eh_proj,
  shared_head.norm,<decoder layer>}`` or Qwen3-Next ``mtp.{pre_fc_norm_embedding,
  pre_fc_norm_hidden,fc,norm,layers.0.<decoder layer>}`` (one module, used for every depth);
  with recurrent MTP megatron holds that one module as ``mtp.layers.0`` (no copies);
* Qwen3.5: gated attention ``q_proj`` rows are [q_h; gate_h] per head, megatron's ``linear_qkv``
  [q_g.., gate_g.., k_g, v_g] per group; GDN ``in_proj`` = [in_proj_qkv; in_proj_z; in_proj_b;
  in_proj_a]; all norms map 1:1 (both sides zero-centred; GDN's output norm plain on both sides);
  multimodal checkpoints prefix the decoder with ``model.language_model.`` (``hf_prefix``).
* Qwen3-Next: GDN ``in_proj_qkvz`` rows are [q_h, k_h, v_h.., z_h..] per key head h and
  ``in_proj_ba`` [b_h.., a_h..] per key head; megatron's ``in_proj`` is [q, k, v, z, β, α] whole.
* MoE (Qwen3.5-MoE / Qwen3-Next): ``mlp.router`` <-> ``mlp.gate``; expert e's ``linear_fc1``
  (local ``experts.local_experts.e`` or Transformer Engine's grouped ``experts.linear_fc1.weight<e>``)
  = [gate_proj; up_proj] of HF's ``mlp.experts.e``, ``linear_fc2`` = ``down_proj``; the shared
  expert (``mlp.shared_experts``) <-> ``mlp.shared_expert`` and its ``gate_weight`` <->
  ``mlp.shared_expert_gate.weight``. Expert indices here are global (EP offsets are the callers').
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

import re

from bebop_megatron.config import HYBRID_ARCHS, MOE_ARCHS


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
    arch: str = "qwen3"
    mtp_recurrent: bool = False  # megatron holds ONE MTP layer (mtp.layers.0) applied γ times
    hf_prefix: str = "model."  # "model.language_model." in Qwen3.5 ForConditionalGeneration checkpoints
    # hybrid (qwen3_5) only
    layer_types: tuple = ()
    linear: tuple = ()  # (key_head_dim, value_head_dim, num_key_heads, num_value_heads, conv_kernel)
    rotary_factor: float = 1.0
    # MoE archs only: (num_experts, topk, moe_ffn, shared_ffn, norm_topk_prob, layer_freq, mlp_only_layers)
    moe: tuple = ()
    ffn_hidden_size: int = 0
    mtp_ffn_hidden_size: int = 0  # a narrower MTP MLP (0: ffn_hidden_size); HF: bebop_mtp_intermediate_size

    @classmethod
    def from_config(cls, cfg, tp: int = 1, mtp_layout: str = "deepseek", hf_prefix: str = "model.") -> "Shapes":
        m = cfg.model
        hybrid = m.arch in HYBRID_ARCHS
        if hybrid:
            mtp_layout = "qwen3_next"  # the only MTP layout of this family
        return cls(m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.kv_channels,
                   m.vocab_size, m.padded_vocab_size(tp), m.tie_word_embeddings, m.mtp_num_layers, mtp_layout,
                   bool(m.add_qkv_bias), bool(m.qk_layernorm), m.arch, bool(m.mtp_recurrent), hf_prefix,
                   tuple(m.resolved_layer_types()) if hybrid else (),
                   (m.linear_key_head_dim, m.linear_value_head_dim, m.linear_num_key_heads,
                    m.linear_num_value_heads, m.linear_conv_kernel_dim) if hybrid else (),
                   float(m.partial_rotary_factor),
                   moe=(m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size,
                        m.moe_shared_expert_intermediate_size, bool(m.moe_norm_topk_prob), int(m.moe_layer_freq),
                        tuple(m.mlp_only_layers or ())) if m.arch in MOE_ARCHS else (),
                   ffn_hidden_size=m.ffn_hidden_size, mtp_ffn_hidden_size=m.mtp_ffn_hidden_size or 0)

    @property
    def hybrid(self) -> bool:
        return self.arch in HYBRID_ARCHS

    @property
    def mtp_modules(self) -> int:
        """MTP layers megatron holds (one when recurrent)."""
        return min(self.mtp_layers, 1) if self.mtp_recurrent else self.mtp_layers


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


def gated_qkv_to_megatron(q: Tensor, k: Tensor, v: Tensor, s: Shapes) -> Tensor:
    """HF gated attention (``q_proj`` rows per head [q_h; gate_h]) -> megatron's per-group
    [q_g.., gate_g.., k_g, v_g] (``attention_output_gate``)."""
    g, hd = s.num_groups, s.head_dim
    hpg = s.num_heads // g
    tail = q.shape[1:]
    q = q.reshape(g, hpg, 2, hd, *tail)
    query, gate = q[:, :, 0].reshape(g, hpg * hd, *tail), q[:, :, 1].reshape(g, hpg * hd, *tail)
    return torch.cat([query, gate, k.reshape(g, hd, *tail), v.reshape(g, hd, *tail)], dim=1).reshape(-1, *tail)


def gated_qkv_from_megatron(w: Tensor, s: Shapes) -> tuple[Tensor, Tensor, Tensor]:
    g, hd = s.num_groups, s.head_dim
    hpg = s.num_heads // g
    tail = w.shape[1:]
    w = w.reshape(g, 2 * hpg * hd + 2 * hd, *tail)
    query, gate, k, v = torch.split(w, [hpg * hd, hpg * hd, hd, hd], dim=1)
    q = torch.stack([query.reshape(g, hpg, hd, *tail), gate.reshape(g, hpg, hd, *tail)], dim=2)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def gdn_in_proj_sizes(s: Shapes) -> list[int]:
    """Rows of HF's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a (megatron's in_proj stacks them)."""
    dk, dv, nk, nv, _ = s.linear
    return [2 * dk * nk + dv * nv, dv * nv, nv, nv]


def gdn_qkvz_ba_to_megatron(qkvz: Tensor, ba: Tensor, s: Shapes) -> Tensor:
    """Qwen3-Next's per-key-head interleaved ``in_proj_qkvz`` / ``in_proj_ba`` -> megatron's
    [q, k, v, z, β, α] ``in_proj``."""
    dk, dv, nk, nv, _ = s.linear
    r = nv // nk
    tail = qkvz.shape[1:]
    q, k, v, z = torch.split(qkvz.reshape(nk, 2 * dk + 2 * r * dv, *tail), [dk, dk, r * dv, r * dv], dim=1)
    b, a = torch.split(ba.reshape(nk, 2 * r, *tail), [r, r], dim=1)
    return torch.cat([x.reshape(-1, *tail) for x in (q, k, v, z, b, a)], 0)


def gdn_qkvz_ba_from_megatron(w: Tensor, s: Shapes) -> list[Tensor]:
    dk, dv, nk, nv, _ = s.linear
    tail = w.shape[1:]
    q, k, v, z, b, a = (x.reshape(nk, -1, *tail) for x in
                        torch.split(w, [nk * dk, nk * dk, nv * dv, nv * dv, nv, nv], 0))
    return [torch.cat([q, k, v, z], 1).reshape(-1, *tail), torch.cat([b, a], 1).reshape(-1, *tail)]


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


# Gated DeltaNet (megatron-core ``GatedDeltaNet`` as ``self_attention``) <-> HF ``linear_attn``
_GDN_1TO1 = {
    "self_attention.conv1d.weight": "linear_attn.conv1d.weight",
    "self_attention.A_log": "linear_attn.A_log",
    "self_attention.dt_bias": "linear_attn.dt_bias",
    "self_attention.out_norm.weight": "linear_attn.norm.weight",  # plain (not zero-centred) gain
    "self_attention.out_proj.weight": "linear_attn.out_proj.weight",
    "self_attention.in_proj.layer_norm_weight": "input_layernorm.weight",  # TE fused
}


# MoE MLP (megatron-core ``MoELayer``) <-> HF ``SparseMoeBlock``
_MOE_1TO1 = {
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
}
_EXPERT = re.compile(r"mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))$")


def expert_suffix(e: int, fc: str, grouped: bool = False) -> str:
    """megatron suffix of expert ``e``'s fc1/fc2 weight (sequential or TE-grouped experts)."""
    return f"mlp.experts.{fc}.weight{e}" if grouped else f"mlp.experts.local_experts.{e}.{fc}.weight"


def parse_expert(suffix: str) -> Optional[tuple[int, str]]:
    """(expert index, "linear_fc1" | "linear_fc2") of an expert weight suffix, else None."""
    mt = _EXPERT.match(suffix)
    if mt is None:
        return None
    if mt.group(1) is not None:
        return int(mt.group(1)), mt.group(2)
    return int(mt.group(4)), mt.group(3)


def _gate_up(names: list[str]) -> Recipe:
    return Recipe(names, lambda t: torch.cat(t, 0), lambda t: list(torch.chunk(t, 2, 0)))


def _moe_recipe(suffix: str, hf_prefix: str) -> Optional[Recipe]:
    if suffix in _MOE_1TO1:
        return Recipe([hf_prefix + _MOE_1TO1[suffix]], lambda t: t[0], lambda t: [t])
    if suffix == "mlp.shared_experts.linear_fc1.weight":
        return _gate_up([hf_prefix + f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up")])
    ex = parse_expert(suffix)
    if ex is None:
        return None
    e, fc = ex
    if fc == "linear_fc1":
        return _gate_up([hf_prefix + f"mlp.experts.{e}.{p}_proj.weight" for p in ("gate", "up")])
    return Recipe([hf_prefix + f"mlp.experts.{e}.down_proj.weight"], lambda t: t[0], lambda t: [t])


def _layer_recipe(suffix: str, hf_prefix: str, s: Shapes) -> Optional[Recipe]:
    if s.moe and suffix.startswith(("mlp.router.", "mlp.experts.", "mlp.shared_experts.")):
        return _moe_recipe(suffix, hf_prefix)
    if suffix in _LAYER_1TO1:
        return Recipe([hf_prefix + _LAYER_1TO1[suffix]], lambda t: t[0], lambda t: [t])
    if s.hybrid and suffix in _GDN_1TO1:
        return Recipe([hf_prefix + _GDN_1TO1[suffix]], lambda t: t[0], lambda t: [t])
    if s.arch == "qwen3_next" and suffix == "self_attention.in_proj.weight":
        names = [hf_prefix + f"linear_attn.in_proj_{p}.weight" for p in ("qkvz", "ba")]
        return Recipe(names, lambda t: gdn_qkvz_ba_to_megatron(t[0], t[1], s),
                      lambda t: gdn_qkvz_ba_from_megatron(t, s))
    if s.hybrid and suffix == "self_attention.in_proj.weight":
        names = [hf_prefix + f"linear_attn.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")]
        return Recipe(names, lambda t: torch.cat(t, 0), lambda t: list(torch.split(t, gdn_in_proj_sizes(s), 0)))
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        names = [f"{hf_prefix}self_attn.{p}_proj.{kind}" for p in "qkv"]
        if s.hybrid:  # gated attention
            return Recipe(names, lambda t: gated_qkv_to_megatron(t[0], t[1], t[2], s),
                          lambda t: list(gated_qkv_from_megatron(t, s)))
        return Recipe(names, lambda t: qkv_to_megatron(t[0], t[1], t[2], s), lambda t: list(qkv_from_megatron(t, s)))
    if suffix == "mlp.linear_fc1.weight":
        names = [hf_prefix + "mlp.gate_proj.weight", hf_prefix + "mlp.up_proj.weight"]
        return Recipe(names, lambda t: torch.cat(t, 0), lambda t: list(torch.chunk(t, 2, 0)))
    return None


def recipe_for(name: str, s: Shapes) -> Optional[Recipe]:
    """Recipe for a full megatron parameter name (global layer index); None: not in HF."""
    P = s.hf_prefix
    if name == "embedding.word_embeddings.weight":
        return Recipe([P + "embed_tokens.weight"], lambda t: pad_vocab(t[0], s), lambda t: [t[: s.vocab_size]])
    if name == "output_layer.weight":
        if s.tie:
            return None
        return Recipe(["lm_head.weight"], lambda t: pad_vocab(t[0], s), lambda t: [t[: s.vocab_size]])
    if name == "decoder.final_layernorm.weight":
        return Recipe([P + "norm.weight"], lambda t: t[0], lambda t: [t])
    if name.startswith("decoder.layers."):
        i, suffix = name[len("decoder.layers."):].split(".", 1)
        return _layer_recipe(suffix, f"{P}layers.{int(i)}.", s)
    if name.startswith("mtp.layers."):
        k, suffix = name[len("mtp.layers."):].split(".", 1)
        k = int(k)
        if k >= s.mtp_modules:
            return None
        if s.mtp_layout == "deepseek":
            base = f"{P}layers.{s.num_layers + k}."
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
    """config.json for the HF export (transformers' Qwen2/Qwen3/Qwen3.5 fields + the MTP layout).
    MTP: DeepSeek layout declares ``num_nextn_predict_layers`` modules (1 when recurrent: the one
    module is run for every draft step), the Qwen3-Next layout ``mtp_num_hidden_layers: 1``."""
    if s.hybrid:
        return _hybrid_hf_config(s, rope_theta, norm_eps, max_pos, eos_token_id)
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
    _mtp_keys(cfg, s)
    return cfg


def _mtp_keys(cfg: dict, s: Shapes) -> None:
    if s.mtp_layers:
        if s.mtp_layout == "deepseek":
            cfg["num_nextn_predict_layers"] = s.mtp_modules
        else:
            cfg["mtp_num_hidden_layers"] = 1
        cfg["bebop_mtp_draft_steps"] = s.mtp_layers  # γ the module was trained for
        if s.mtp_ffn_hidden_size and s.mtp_ffn_hidden_size != s.ffn_hidden_size:
            cfg["bebop_mtp_intermediate_size"] = s.mtp_ffn_hidden_size


_HF_CLASSES = {"qwen3_5": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
               "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
               "qwen3_next": ("Qwen3NextForCausalLM", "qwen3_next")}


def full_attention_interval(layer_types) -> Optional[int]:
    """N when ``layer_types`` is "every N-th layer is full attention" (layers N-1, 2N-1, ...), else None.
    SGLang 0.5.23 builds its hybrid layers from ``full_attention_interval`` alone and never reads
    ``layer_types`` (``Qwen3NextConfig.layers_block_type`` in ``sglang/srt/configs/qwen3_next.py``)."""
    types = list(layer_types)
    for n in range(1, len(types) + 1):
        if types == ["full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(len(types))]:
            return n
    return None


def _hybrid_hf_config(s: Shapes, rope_theta: float, norm_eps: float, max_pos: int, eos_token_id) -> dict:
    """transformers' ``Qwen3_5TextConfig`` / ``Qwen3_5MoeTextConfig`` / ``Qwen3NextConfig`` (text-only
    ``*ForCausalLM``), readable by SGLang 0.5.23's own config classes too: those take ``rope_theta``,
    ``partial_rotary_factor`` and ``full_attention_interval`` from the top level (its
    ``Qwen3HybridAttentionDecoderLayer`` reads ``config.rope_theta``, defaulting to 10000, and ignores
    ``rope_parameters``), so they are written there as well as in transformers' ``rope_parameters``."""
    dk, dv, nk, nv, conv = s.linear
    cls, model_type = _HF_CLASSES[s.arch]
    cfg = {
        "architectures": [cls], "model_type": model_type, "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size, "intermediate_size": None, "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_heads, "num_key_value_heads": s.num_groups, "head_dim": s.head_dim,
        "hidden_act": "silu", "max_position_embeddings": max_pos, "rms_norm_eps": norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta,
                            "partial_rotary_factor": s.rotary_factor},
        "tie_word_embeddings": s.tie, "attention_bias": s.qkv_bias, "torch_dtype": "float32",
        "layer_types": list(s.layer_types), "linear_conv_kernel_dim": conv, "linear_key_head_dim": dk,
        "linear_value_head_dim": dv, "linear_num_key_heads": nk, "linear_num_value_heads": nv,
        "rope_theta": rope_theta, "partial_rotary_factor": s.rotary_factor,
        "eos_token_id": eos_token_id, "bebop_mtp_hidden": "normed",
    }
    interval = full_attention_interval(s.layer_types)
    if interval is not None:  # else SGLang cannot build this layer pattern (transformers still can)
        cfg["full_attention_interval"] = interval
    if s.moe:
        n, k, ffn, shared, norm_topk, freq, mlp_only = s.moe
        cfg.update(num_experts=n, num_experts_per_tok=k, moe_intermediate_size=ffn,
                   shared_expert_intermediate_size=shared or 0, router_aux_loss_coef=0.001,
                   norm_topk_prob=norm_topk)  # SGLang's MoE block reads it for Qwen3.5-MoE too
        if s.arch == "qwen3_next":
            cfg.update(decoder_sparse_step=freq, mlp_only_layers=list(mlp_only))
        else:
            cfg.pop("intermediate_size")  # Qwen3.5-MoE has no dense MLP
    _mtp_keys(cfg, s)
    return cfg
