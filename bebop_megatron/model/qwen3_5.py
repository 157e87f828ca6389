"""Qwen3.5-style hybrid decoder from megatron-core specs.

The trunk is megatron-core's ``TransformerLayer`` with two token mixers, chosen per layer from
``layer_types`` (HF) / ``full_attention_interval``:

* ``linear_attention``: megatron-core's ``GatedDeltaNet`` (``ssm/gated_delta_net.py``);
* ``full_attention``: megatron-core's ``SelfAttention`` with ``attention_output_gate`` (the
  per-head sigmoid gate of Qwen3-Next / Qwen3.5), QK-norm and partial RoPE (``rotary_percent``).

Every norm is zero-centred, ``(1 + w) · x̂`` (``layernorm_zero_centered_gamma``), as in HF's
``Qwen3_5RMSNorm``. Transformer Engine's norms honour that flag; megatron-core's local
``WrappedTorchNorm`` refuses it, so the local (CPU) spec uses :class:`ZeroCenteredRMSNorm`. The one
exception is Gated DeltaNet's output norm, whose HF weight is a plain gain: it is a
:class:`PlainRMSNorm` on both backends, so its weight maps 1:1 (no ``w - 1``, bit-exact round trips).

The MTP layer is a gated full-attention layer (HF's ``mtp.layers.0``) with zero-centred
enorm / hnorm / final norm (``mtp.pre_fc_norm_embedding`` / ``pre_fc_norm_hidden`` / ``norm``).

MoE archs (``qwen3_5_moe``: Qwen3.5-MoE, ``qwen3_next``: Qwen3-Next) swap the layer's MLP for
megatron-core's ``MoELayer`` (the GPT layer specs with ``num_experts``: softmax top-k router, sequential
experts on the local spec / grouped-GEMM experts under Transformer Engine, a shared expert with its
sigmoid gate, ``moe_shared_expert_gate``), per layer from ``ModelConfig.moe_layer_pattern`` (Qwen3-Next's
``decoder_sparse_step`` / ``mlp_only_layers``); their MTP layer is an MoE layer too, as HF ships it.
The two archs differ only in HF tensor layout (see ``convert/layout.py``) and ``norm_topk_prob``.

megatron-core's hybrid block builder (``experimental_attention_variant_module_specs``) only
supports Transformer Engine, so the per-layer specs are assembled here from its module-level
helpers (``get_gated_delta_net_module_spec``) and the GPT layer specs.

``GatedDeltaNet`` needs flash-linear-attention (``fla``) for ``l2norm`` and the chunked kernel;
where it is absent (CPU) :func:`install_gated_delta_rule_fallback` binds megatron-core's own
pure-torch ``torch_chunk_gated_delta_rule`` in its place (the CPU-compatibility idiom of
``bebop_megatron.platform``).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

LINEAR, FULL = "linear_attention", "full_attention"


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm with a zero-centred gain, ``(1 + w) · x / rms(x)`` computed in fp32 (HF's
    ``Qwen3_5RMSNorm``); megatron-core's norm-module signature."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **kwargs):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class PlainRMSNorm(ZeroCenteredRMSNorm):
    """``w · x / rms(x)`` with ``w`` initialised to one: Gated DeltaNet's output norm, whose HF
    weight (``linear_attn.norm``, ``Qwen3_5RMSNormGated``) is not zero-centred. Kept plain so the
    weight maps 1:1 (bit-exact round trips) instead of through ``w - 1``."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **kwargs):
        super().__init__(config, hidden_size, eps)
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y).type_as(x)


# --------------------------------------------------------------------- GDN fallback


def _l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """flash-linear-attention's ``l2norm``: ``x / sqrt(Σx² + eps)``."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def install_gated_delta_rule_fallback() -> bool:
    """Let megatron-core's ``GatedDeltaNet`` run without flash-linear-attention: bind its own
    ``torch_chunk_gated_delta_rule`` and a torch ``l2norm``. Returns True when installed."""
    from megatron.core.ssm import gated_delta_net as gdn

    if gdn.HAVE_FLA and gdn.chunk_gated_delta_rule is not None:
        return False
    gdn.l2norm = _l2norm
    gdn.chunk_gated_delta_rule = gdn.torch_chunk_gated_delta_rule
    gdn.HAVE_FLA = True
    return True


# --------------------------------------------------------------------------- config


def hybrid_config_kwargs(m) -> dict:
    """TransformerConfig fields of a Qwen3.5-style hybrid model."""
    types = m.resolved_layer_types()
    return dict(
        layernorm_zero_centered_gamma=True,
        attention_output_gate=True,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[1 if t == LINEAR else 0 for t in types],
        linear_conv_kernel_dim=m.linear_conv_kernel_dim,
        linear_key_head_dim=m.linear_key_head_dim,
        linear_value_head_dim=m.linear_value_head_dim,
        linear_num_key_heads=m.linear_num_key_heads,
        linear_num_value_heads=m.linear_num_value_heads,
    )


def moe_config_kwargs(m, p, use_te: bool, on_gpu: bool) -> dict:
    """TransformerConfig fields of the MoE archs (Qwen3.5-MoE / Qwen3-Next), matching HF's
    ``SparseMoeBlock``: ``softmax(x·Wᵣ)`` over all experts, top-k, the k weights renormalised when
    ``norm_topk_prob`` (megatron: top-k of the logits, then softmax over those k: the same
    numbers) or kept as they are (megatron: ``moe_router_pre_softmax``); plus the shared expert
    ``sigmoid(x·g) · MLP(x)`` (``moe_shared_expert_gate``). megatron-core's all-to-all dispatcher
    creates a CUDA stream, so CPU runs use the all-gather dispatcher (the same math at EP=1)."""
    kw = dict(
        num_moe_experts=m.num_moe_experts,
        moe_router_topk=m.moe_router_topk,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not m.moe_norm_topk_prob,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if m.moe_aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=float(m.moe_aux_loss_coeff),
        moe_token_dispatcher_type=m.moe_token_dispatcher_type if on_gpu else "allgather",
        moe_grouped_gemm=bool(use_te and m.moe_grouped_gemm),
        expert_model_parallel_size=p.expert_model_parallel_size,
    )
    if m.moe_shared_expert_intermediate_size:
        kw.update(moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
                  moe_shared_expert_gate=True)
    return kw


# ---------------------------------------------------------------------------- specs


def _zero_centre_local_norms(spec: ModuleSpec) -> ModuleSpec:
    """Replace torch norms of a local-spec layer by :class:`ZeroCenteredRMSNorm`."""
    from megatron.core.transformer.identity_op import IdentityOp

    sub = spec.submodules
    for field in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(sub, field) is not IdentityOp:
            setattr(sub, field, ZeroCenteredRMSNorm)
    attn = sub.self_attention.submodules
    for field in ("q_layernorm", "k_layernorm"):
        if getattr(attn, field, None) not in (None, IdentityOp):
            setattr(attn, field, ZeroCenteredRMSNorm)
    return spec


def full_attention_layer_spec(use_te: bool, tconf: TransformerConfig = None, moe: bool = False) -> ModuleSpec:
    """Gated full-attention layer (QK-norm; the output gate is ``config.attention_output_gate``).
    ``moe``: its MLP is megatron-core's ``MoELayer`` (router, experts, gated shared expert) as
    built by the GPT layer specs for ``tconf.num_moe_experts``."""
    from megatron.core.models.gpt import gpt_layer_specs

    moe_kw = {}
    if moe:
        moe_kw = dict(num_experts=tconf.num_moe_experts, moe_grouped_gemm=bool(use_te and tconf.moe_grouped_gemm))
    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True, **moe_kw)
    from bebop_megatron.model.sdpa_attention import SDPAAttention

    spec = copy.deepcopy(gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm",
                                                                  **moe_kw))
    spec.submodules.self_attention.submodules.core_attention = SDPAAttention
    return _zero_centre_local_norms(spec)


def linear_attention_layer_spec(tconf: TransformerConfig, use_te: bool, moe: bool = False) -> ModuleSpec:
    """Gated DeltaNet layer: megatron-core's GDN module spec inside a ``TransformerLayer``."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_gated_delta_net_module_spec,
    )
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules

    install_gated_delta_rule_fallback()
    layer = copy.deepcopy(full_attention_layer_spec(use_te, tconf, moe))
    if use_te:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
        from megatron.core.transformer.identity_op import IdentityOp

        gdn = get_gated_delta_net_module_spec(tconf, backend=TESpecProvider())
        gdn = ModuleSpec(module=gdn.module, params=dict(gdn.params), metainfo=dict(gdn.metainfo),
                         submodules=dataclasses.replace(gdn.submodules, out_norm=PlainRMSNorm))
        layer.submodules.input_layernorm = IdentityOp  # fused into in_proj (layer_norm_weight)
    else:
        local = LocalSpecProvider()
        gdn = get_gated_delta_net_module_spec(tconf, backend=local)
        # the local backend has no fused norm+linear: plain in_proj, the layer's own input norm
        gdn = ModuleSpec(module=gdn.module, params=dict(gdn.params),
                         submodules=GatedDeltaNetSubmodules(in_proj=local.column_parallel_linear(),
                                                            out_norm=PlainRMSNorm,
                                                            out_proj=local.row_parallel_linear()),
                         metainfo={"fuse_input_layernorm": False})
    layer.submodules.self_attention = gdn
    return layer


def build_hybrid_block_spec(m, tconf: TransformerConfig, use_te: bool, vp_stage=None):
    """``TransformerBlockSubmodules`` of this pipeline stage's layers."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    specs_by_kind = {}
    for moe in {False, m.moe}:
        specs_by_kind[FULL, moe] = full_attention_layer_spec(use_te, tconf, moe)
        specs_by_kind[LINEAR, moe] = linear_attention_layer_spec(tconf, use_te, moe)
    types = m.resolved_layer_types()
    moe_layers = m.moe_layer_pattern()
    offset = get_transformer_layer_offset(tconf, vp_stage=vp_stage)
    n = get_num_layers_to_build(tconf, vp_stage=vp_stage)
    specs = [specs_by_kind[types[i], moe_layers[i]] for i in range(offset, offset + n)]
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        final_norm = TENorm
    else:
        final_norm = ZeroCenteredRMSNorm
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=final_norm)


def build_hybrid_mtp_block_spec(tconf: TransformerConfig, use_te: bool, moe: bool = False):
    """MTP block whose layer is a gated full-attention layer (Qwen3.5's ``mtp.layers.0``; an MoE
    layer in Qwen3.5-MoE / Qwen3-Next), with zero-centred enorm / hnorm / final norm."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    block = get_gpt_mtp_block_spec(tconf, full_attention_layer_spec(use_te, tconf, moe), use_transformer_engine=use_te)
    if block is None or use_te:
        return block
    specs = []
    for spec in block.layer_specs:
        spec = copy.deepcopy(spec)
        spec.submodules = dataclasses.replace(spec.submodules, enorm=ZeroCenteredRMSNorm, hnorm=ZeroCenteredRMSNorm,
                                              layer_norm=ZeroCenteredRMSNorm)
        specs.append(spec)
    return dataclasses.replace(block, layer_specs=specs)


def tag_gdn_tp_sections(model) -> None:
    """Mark Gated DeltaNet parameters with their TP layout (see ``tp_layout``): ``in_proj`` is
    [q, k, v, z, β, α] and ``conv1d`` [q, k, v], each section split over TP ranks separately."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    for mod in model.modules():
        if not isinstance(mod, GatedDeltaNet):
            continue
        qk, v, nv = mod.qk_dim, mod.v_dim, mod.num_value_heads
        sections = {"in_proj": [qk, qk, v, v, nv, nv], "conv1d": [qk, qk, v]}
        for child, secs in sections.items():
            for pname, p in getattr(mod, child).named_parameters(recurse=False):
                if pname in ("weight", "bias"):
                    p.tp_sections = secs
                    if not hasattr(p, "partition_dim"):
                        p.partition_dim = 0
                    p.tensor_model_parallel = True
        for p in (mod.A_log, mod.dt_bias):
            p.partition_dim = 0
