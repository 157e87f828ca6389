"""Recurrent MTP: ONE megatron-core ``MultiTokenPredictionLayer`` applied γ times.

Qwen3-Next, Qwen3.5 and GLM ship a single MTP module that SGLang's NEXTN worker runs once per
draft step. megatron-core 0.17 calls this ``mtp_use_repeated_layer``; 0.16.1 has no such switch, so
the block is a subclass of its ``MultiTokenPredictionBlock`` built from a one-layer spec whose
``forward`` reuses that layer for every depth. ``config.mtp_num_layers`` stays γ (the number of
draft steps): ``GPTModel`` and the objectives see the usual ``[(1+γ)·s, b, h]`` output, depth k's
chunk being the layer's output after k applications. Each application consumes the previous
step's hidden state and the embedding of the next ground-truth token (the layer itself rolls
``input_ids`` / ``position_ids`` by one and returns them), exactly as γ distinct layers would.

Checkpoints hold the one layer (``mtp.layers.0.*``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    MultiTokenPredictionBlockSubmodules,
    get_mtp_layer_offset,
)


def one_layer_block_spec(block_spec: Optional[MultiTokenPredictionBlockSubmodules]):
    """The γ-layer block spec megatron-core builds, reduced to its first layer (None stays None:
    pipeline stages without MTP)."""
    if block_spec is None:
        return None
    return MultiTokenPredictionBlockSubmodules(layer_specs=list(block_spec.layer_specs[:1]))


class RecurrentMultiTokenPredictionBlock(MultiTokenPredictionBlock):
    """``MultiTokenPredictionBlock`` whose single layer is applied ``config.mtp_num_layers`` times."""

    def __init__(self, config, spec, vp_stage=None, pg_collection=None):
        super().__init__(config=config, spec=one_layer_block_spec(spec), vp_stage=vp_stage,
                         pg_collection=pg_collection)
        if len(self.layers) != 1:
            raise ValueError(f"recurrent MTP builds one layer, got {len(self.layers)}")
        if get_mtp_layer_offset(self.config, self.vp_stage):
            raise ValueError("recurrent MTP needs all MTP steps on one pipeline stage")

    @property
    def num_steps(self) -> int:
        return int(self.config.mtp_num_layers or 0)

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        hidden_states: Tensor,
        attention_mask: Tensor,
        context: Optional[Tensor] = None,
        context_mask: Optional[Tensor] = None,
        rotary_pos_emb: Optional[Tensor] = None,
        rotary_pos_cos: Optional[Tensor] = None,
        rotary_pos_sin: Optional[Tensor] = None,
        attention_bias: Optional[Tensor] = None,
        inference_params=None,
        packed_seq_params=None,
        sequence_len_offset: Optional[Tensor] = None,
        extra_block_kwargs: Optional[dict] = None,
        embedding=None,
    ) -> Tensor:
        layer = self.layers[0]
        outputs = [hidden_states]
        for _ in range(self.num_steps):
            hidden_states, input_ids, position_ids = layer(
                input_ids=input_ids,
                position_ids=position_ids,
                hidden_states=hidden_states,
                attention_mask=attention_mask,
                inference_params=inference_params,
                rotary_pos_emb=rotary_pos_emb,
                rotary_pos_cos=rotary_pos_cos,
                rotary_pos_sin=rotary_pos_sin,
                packed_seq_params=packed_seq_params,
                sequence_len_offset=sequence_len_offset,
                embedding=embedding,
                **(extra_block_kwargs or {}),
            )
            outputs.append(hidden_states)
        return torch.cat(outputs, dim=0)
