"""Core attention on ``torch.nn.functional.scaled_dot_product_attention``.

Used by the local (non-Transformer-Engine) spec: megatron-core's own ``DotProductAttention``
materialises the full score matrix and does not handle packed sequences; SDPA picks a fused
kernel where one exists (flash / memory-efficient on GPU, a fused C++ kernel on CPU).
Same constructor and forward signature as megatron-core's core-attention modules.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide


class SDPAAttention(MegatronModule):
    """query [sq, b, np, hn], key/value [sk, b, ng, hn] -> context [sq, b, np * hn]."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAAttention does not support context parallelism; use Transformer Engine")
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale
        self.layer_number = layer_number

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params=None,
    ) -> Tensor:
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by SDPAAttention")
        mask_type = attn_mask_type or self.attn_mask_type
        sq, b, np_, hn = query.shape
        sk = key.shape[0]
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if k.shape[1] != np_:
            rep = divide(np_, k.shape[1])
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        mask = None
        is_causal = False
        if packed_seq_params is not None:
            mask = _packed_causal_mask(packed_seq_params.cu_seqlens_q, sq, q.device)
        elif attention_mask is not None and mask_type != AttnMaskType.causal:
            mask = ~attention_mask.bool()  # megatron: True = masked out; SDPA: True = attend
        else:
            is_causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal) and sq == sk
            if not is_causal and sq != sk:
                # decoding with a cache: the sq new queries are the last positions of sk
                mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        dropout = self.dropout_p if self.training else 0.0
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal, scale=self.softmax_scale
        )
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)


def _packed_causal_mask(cu_seqlens: Tensor, total: int, device) -> Tensor:
    """Block-diagonal causal mask for packed (thd-like, b=1) sequences."""
    seg = torch.zeros(total, dtype=torch.long, device=device)
    bounds = cu_seqlens[1:-1].to(device)
    seg[bounds[bounds < total]] = 1
    seg = seg.cumsum(0)
    same = seg[:, None] == seg[None, :]
    return same & torch.ones(total, total, dtype=torch.bool, device=device).tril()
