"""Qwen-style megatron-core ``GPTModel`` with MTP layers trained by a selectable objective.

megatron-core 0.16.1 computes the MTP cross entropy inline in ``GPTModel._postprocess``
(shared with the main loss through ``compute_language_model_loss``), so the MTP objective is
swapped by overriding ``_postprocess``. The override keeps Megatron's conventions:

* MTP runs on the last pipeline stage with the (tied) embedding built there;
* the MTP loss enters autograd through ``MTPLossAutoScaler`` attached to the main loss, so
  the schedule's loss scale (``MTPLossAutoScaler.set_loss_scale``) applies to it;
* the returned value is the per-token main-head loss ``[b, s]`` (or logits without labels).

With ``mtp_detach_trunk`` the MTP block sees detached decoder hidden states, a no-grad
embedding and a detached output-layer weight: MTP gradients reach only MTP parameters.
The main-head target distribution is always detached.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler
from megatron.core.transformer.transformer_config import TransformerConfig

from bebop_megatron.config import Config
from bebop_megatron.mtp.losses import mtp_objective, segment_ids_from_position_ids
from bebop_megatron.mtp.metrics import MTPMetrics
from bebop_megatron.platform import Platform


class _LazyMTPLogits:
    """Computes depth-k logits when indexed, so that only one depth's full logits is alive."""

    def __init__(self, model: "BebopGPTModel", hiddens: list[Tensor], weight: Optional[Tensor]):
        self.model, self.hiddens, self.weight = model, hiddens, weight

    def __len__(self) -> int:
        return len(self.hiddens)

    def __getitem__(self, i: int) -> Tensor:
        logits, _ = self.model.output_layer(self.hiddens[i], weight=self.weight)
        return logits


class BebopGPTModel(GPTModel):
    def __init__(
        self,
        *args,
        mtp_loss: str = "e2e_tv",
        mtp_detach_trunk: bool = True,
        true_vocab_size: Optional[int] = None,
        fp8_mtp: bool = True,
        mtp_recurrent: bool = False,
        mtp_ffn_hidden_size: Optional[int] = None,
        **kwargs,
    ):
        if mtp_recurrent and kwargs.get("mtp_block_spec") is not None:
            from bebop_megatron.model.recurrent_mtp import one_layer_block_spec

            # GPTModel builds a plain one-layer block from this; it is replaced below
            kwargs["mtp_block_spec"] = one_layer_block_spec(kwargs["mtp_block_spec"])
        super().__init__(*args, **kwargs)
        self.mtp_recurrent = mtp_recurrent
        narrow = mtp_ffn_hidden_size is not None and mtp_ffn_hidden_size != self.config.ffn_hidden_size
        self.mtp_ffn_hidden_size = mtp_ffn_hidden_size if narrow else None
        if self.mtp_process and (mtp_recurrent or narrow or (self.config.fp8 and not fp8_mtp)):
            self._rebuild_mtp(kwargs.get("vp_stage"), fp8=fp8_mtp or not self.config.fp8)
        self.mtp_loss_type = mtp_loss
        self.mtp_detach_trunk = mtp_detach_trunk
        self.true_vocab_size = true_vocab_size
        self.mtp_kl_weight = 0.0  # set by trainers for a KL warm-up
        # the ``postprocess_fn`` of the forward call in progress (see forward); None outside one
        self._postprocess_fn: Optional[Callable] = None
        gamma = self.config.mtp_num_layers or 0
        self.mtp_metrics = MTPMetrics(gamma)
        if self.mtp_process and not self.post_process:
            raise ValueError("MTP layers must live on the last pipeline stage (no custom PP layout)")
        if (self.share_embeddings_and_output_weights and self.mtp_process and not self.pre_process
                and self.output_layer.weight is not None):
            # megatron-core 0.16.1 allocates an output weight on the MTP stage even though the
            # tied head uses that stage's embedding copy (shared_embedding_or_output_weight), and
            # its own sharded_state_dict asserts the weight is absent: drop the dead parameter.
            self.output_layer.weight = None

    def _rebuild_mtp(self, vp_stage, fp8: bool) -> None:
        """Rebuild the MTP block that ``GPTModel`` made:

        * recurrent MTP (``mtp_recurrent``): a :class:`RecurrentMultiTokenPredictionBlock`, one
          layer applied γ times (megatron-core 0.17's ``mtp_use_repeated_layer``);
        * ``fp8=False``: keep the MTP layers in bf16 under an FP8 trunk. megatron-core 0.16.1 runs
          them in the global FP8 context whenever ``config.fp8`` is set, and FP8 noise in the draft
          heads costs acceptance; the block is rebuilt from a config copy with FP8 off (its own fp8
          checks then give a null context; the trunk keeps FP8);
        * ``mtp_ffn_hidden_size``: the MTP layers' MLP from a config copy of that width."""
        import dataclasses

        from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

        from bebop_megatron.model.recurrent_mtp import RecurrentMultiTokenPredictionBlock

        changes = {} if fp8 else {"fp8": None}
        if self.mtp_ffn_hidden_size is not None:
            changes["ffn_hidden_size"] = self.mtp_ffn_hidden_size
        config = dataclasses.replace(self.config, **changes) if changes else self.config
        cls = RecurrentMultiTokenPredictionBlock if self.mtp_recurrent else MultiTokenPredictionBlock
        self.mtp = cls(config=config, spec=self.mtp_block_spec, vp_stage=vp_stage)

    # ------------------------------------------------------------------ helpers
    def _no_grad_embedding(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        with torch.no_grad():
            return self.embedding(input_ids=input_ids, position_ids=position_ids)

    def _output_weight(self) -> Optional[Tensor]:
        if self.share_embeddings_and_output_weights:
            return self.shared_embedding_or_output_weight()
        return None

    def run_mtp_block(self, hidden_states: Tensor, input_ids: Tensor, position_ids: Tensor, **kw) -> list[Tensor]:
        """MTP hidden states [s, b, h] for depths 1..γ, from decoder output ``hidden_states``."""
        detach = self.mtp_detach_trunk
        out = self.mtp(
            input_ids=input_ids,
            position_ids=position_ids,
            hidden_states=hidden_states.detach() if detach else hidden_states,
            embedding=self._no_grad_embedding if detach else self.embedding,
            **kw,
        )
        return list(torch.chunk(out, 1 + self.config.mtp_num_layers, dim=0))[1:]

    def mtp_logits(self, mtp_hidden: list[Tensor]) -> _LazyMTPLogits:
        weight = self._output_weight()
        if self.mtp_detach_trunk:
            weight = (weight if weight is not None else self.output_layer.weight).detach()
        return _LazyMTPLogits(self, mtp_hidden, weight)

    def vocab_start(self, local_vocab: int) -> int:
        return parallel_state.get_tensor_model_parallel_rank() * local_vocab

    def mtp_objective(self, logits: Tensor, mtp_hidden: list[Tensor], loss_type: str, labels: Tensor,
                      loss_mask: Tensor, position_ids: Optional[Tensor]):
        """The MTP objective (vocab-parallel) against the detached main head; records metrics when
        training. Call before the main CE (megatron's vocab-parallel CE edits logits in place)."""
        out = mtp_objective(
            logits,
            self.mtp_logits(mtp_hidden),
            loss_type,
            loss_mask,
            labels=labels,
            segment_ids=segment_ids_from_position_ids(position_ids) if position_ids is not None else None,
            tp_group=self.pg_collection.tp,
            vocab_start=self.vocab_start(logits.shape[-1]),
            true_vocab_size=self.true_vocab_size,
            kl_weight=self.mtp_kl_weight,
        )
        if self.training:
            self.mtp_metrics.update(out)
        return out

    # -------------------------------------------------------------- postprocess
    def forward(self, *args, postprocess_fn: Optional[Callable] = None, **kwargs):
        """``GPTModel.forward``, plus one injected seam: ``postprocess_fn``, when given with ``labels``,
        replaces the loss computation on the last stage for this call only (RL: a
        :class:`bebop_megatron.rl.policy_forward.RLForward` bound to its micro-batch). It is called as
        ``postprocess_fn(model, hidden_states, input_ids, position_ids, labels, loss_mask, mtp_kwargs)``
        with the decoder output and returns the output tensor; earlier stages return their hidden
        states as usual. Like megatron-core's MTP block, which takes its embedding as a callable, the
        caller passes the computation in rather than setting it on the model: megatron's forward
        has no parameter to carry it to ``_postprocess``, so it is held for the duration of the call."""
        if postprocess_fn is None:
            return super().forward(*args, **kwargs)
        self._postprocess_fn = postprocess_fn
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._postprocess_fn = None

    def _postprocess(
        self,
        hidden_states,
        input_ids,
        position_ids,
        labels,
        rotary_pos_emb,
        rotary_pos_cos,
        rotary_pos_sin,
        mtp_in_postprocess=None,
        loss_mask=None,
        decoder_input=None,
        attention_mask=None,
        inference_params=None,
        packed_seq_params=None,
        sequence_len_offset=None,
        runtime_gather_output=None,
        extra_block_kwargs=None,
        inference_context=None,
    ):
        if self._postprocess_fn is not None and labels is not None and inference_context is None:
            if not self.post_process:
                return hidden_states
            mtp_kwargs = dict(attention_mask=attention_mask, inference_params=inference_params,
                              rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos,
                              rotary_pos_sin=rotary_pos_sin, packed_seq_params=packed_seq_params,
                              sequence_len_offset=sequence_len_offset, **(extra_block_kwargs or {}))
            return self._postprocess_fn(self, hidden_states, input_ids, position_ids, labels, loss_mask, mtp_kwargs)
        if inference_context is not None or not self.config.mtp_num_layers or labels is None:
            # Inference / logits-only forward: the main head alone (MTP drafting is the
            # rollout engine's job, which runs the MTP layers with its own KV cache).
            if not self.post_process:
                return hidden_states
            logits, _ = self.output_layer(
                hidden_states, weight=self._output_weight(), runtime_gather_output=runtime_gather_output
            )
            if labels is None:
                return logits.transpose(0, 1).contiguous()
            return self.compute_language_model_loss(labels, logits)

        if not self.post_process:
            return hidden_states

        mtp_hidden = self.run_mtp_block(
            hidden_states,
            input_ids,
            position_ids,
            attention_mask=attention_mask,
            inference_params=inference_params,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
            **(extra_block_kwargs or {}),
        )
        logits, _ = self.output_layer(
            hidden_states, weight=self._output_weight(), runtime_gather_output=runtime_gather_output
        )
        if loss_mask is None:
            loss_mask = torch.ones_like(labels, dtype=torch.float)
        out = self.mtp_objective(logits, mtp_hidden, self.mtp_loss_type, labels, loss_mask, position_ids)
        token_loss = self.compute_language_model_loss(labels, logits)
        # attached to the per-token main loss (not the logits: the vocab-parallel CE edits them in place)
        return MTPLossAutoScaler.apply(token_loss, self.config.mtp_loss_scaling_factor * out.loss)


# ----------------------------------------------------------------------- builders


def build_transformer_config(cfg: Config, platform: Platform, use_te: bool,
                             initialize: bool = True) -> TransformerConfig:
    m, p = cfg.model, cfg.parallel
    dtype = getattr(torch, m.params_dtype)
    on_gpu = platform.is_cuda
    kwargs = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=m.add_qkv_bias,
        qk_layernorm=m.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=m.init_method_std,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        sequence_parallel=p.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        mtp_num_layers=m.mtp_num_layers,
        mtp_loss_scaling_factor=cfg.mtp.loss_scaling_factor,
        use_cpu_initialization=not on_gpu,
        perform_initialization=initialize,  # off when every weight is loaded right after (conversion)
        # fused kernels exist only on GPU
        bias_activation_fusion=on_gpu and use_te,
        bias_dropout_fusion=on_gpu,
        masked_softmax_fusion=False,
        apply_rope_fusion=on_gpu and use_te,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    if m.hybrid:
        from bebop_megatron.model.qwen3_5 import hybrid_config_kwargs

        kwargs.update(hybrid_config_kwargs(m))
    if m.moe:
        from bebop_megatron.model.qwen3_5 import moe_config_kwargs

        kwargs.update(moe_config_kwargs(m, p, use_te, on_gpu))
    if m.fp8:
        kwargs.update(
            fp8=m.fp8,
            fp8_recipe=m.fp8_recipe,
            fp8_margin=m.fp8_margin,
            fp8_amax_history_len=m.fp8_amax_history_len,
            fp8_amax_compute_algo=m.fp8_amax_compute_algo,
        )
    return TransformerConfig(**kwargs)


def build_model(cfg: Config, platform: Platform, initialize: bool = True) -> BebopGPTModel:
    """Build this rank's pipeline stage of the model (parallel_state must be initialised).
    ``initialize=False`` skips weight initialisation (all weights are loaded right after)."""
    from bebop_megatron.model.spec import build_layer_spec, build_mtp_block_spec, use_transformer_engine

    use_te = use_transformer_engine(cfg.model)
    tconf = build_transformer_config(cfg, platform, use_te, initialize)
    m = cfg.model
    if m.hybrid:
        from bebop_megatron.model.qwen3_5 import build_hybrid_block_spec, build_hybrid_mtp_block_spec

        layer_spec = build_hybrid_block_spec(m, tconf, use_te)
        mtp_spec = build_hybrid_mtp_block_spec(tconf, use_te, moe=m.moe)
    else:
        layer_spec = build_layer_spec(cfg.model, use_te)
        mtp_spec = build_mtp_block_spec(tconf, layer_spec, use_te)
    model = BebopGPTModel(
        config=tconf,
        transformer_layer_spec=layer_spec,
        vocab_size=m.padded_vocab_size(cfg.parallel.tensor_model_parallel_size),
        max_sequence_length=m.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=m.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=m.rotary_base,
        rotary_percent=m.partial_rotary_factor,
        mtp_block_spec=mtp_spec,
        mtp_loss=cfg.mtp.loss,
        mtp_detach_trunk=cfg.mtp.detach_trunk,
        true_vocab_size=m.vocab_size,
        fp8_mtp=m.fp8_mtp,
        mtp_recurrent=m.mtp_recurrent,
        mtp_ffn_hidden_size=m.mtp_ffn_hidden_size,
    )
    if not initialize:
        from bebop_megatron.model.tp_layout import ensure_tp_attributes

        ensure_tp_attributes(model)
    if m.hybrid:
        from bebop_megatron.model.qwen3_5 import tag_gdn_tp_sections

        tag_gdn_tp_sections(model)
    return model.to(platform.device)
