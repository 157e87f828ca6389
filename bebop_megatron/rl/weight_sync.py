"""Weight sync from the megatron-core policy to rollout engines.

The policy streams its weights as bounded buckets of HF-named tensors (``iter_hf_buckets``: TP
shards gathered, global layer names, trunk and MTP heads); an in-process engine loads each bucket
between steps, remote servers receive the same buckets through the rollout bridge.
"""

from __future__ import annotations

from typing import Optional

from bebop_megatron.config import Config
from bebop_megatron.convert.hf_megatron import iter_hf_buckets
from bebop_megatron.convert.layout import Shapes
from bebop_megatron.rollout.engine import Engine
from bebop_megatron.rollout.modeling import CausalLMWithMTP, LMConfig


def rollout_model_for(cfg: Config, dtype=None) -> CausalLMWithMTP:
    """An (uninitialised) engine model with the policy's shapes; weights come from a sync."""
    import torch

    m = cfg.model
    lm = LMConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
                  num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                  num_key_value_heads=m.num_query_groups, head_dim=m.kv_channels, rms_norm_eps=m.norm_epsilon,
                  rope_theta=m.rotary_base, qk_norm=bool(m.qk_layernorm), qkv_bias=bool(m.add_qkv_bias),
                  tie_word_embeddings=m.tie_word_embeddings, num_mtp_modules=m.mtp_num_layers,
                  mtp_layout="deepseek", mtp_hidden="normed")
    return CausalLMWithMTP(lm).to(dtype or torch.float32).eval()


def sync_engine(policy, cfg: Config, engine: Engine, version: Optional[str] = None,
                bucket_bytes: int = 256 << 20) -> dict:
    """Push the policy's current weights into an in-process engine (between engine steps).
    Returns counts; raises if the MTP heads were not part of the sync."""
    from megatron.core import parallel_state

    shapes = Shapes.from_config(cfg, parallel_state.get_tensor_model_parallel_world_size(), "deepseek")
    n, n_mtp = 0, 0
    L = cfg.model.num_layers
    with engine.lock:
        for bucket in iter_hf_buckets(policy, shapes, bucket_bytes):
            engine.model.load_hf_state_dict(bucket, strict=False)
            n += len(bucket)
            n_mtp += sum(1 for k in bucket if k.startswith("model.layers.") and int(k.split(".")[2]) >= L)
        if version is not None:
            engine.weight_version = str(version)
    if cfg.model.mtp_num_layers and n_mtp == 0:
        raise RuntimeError("weight sync carried no MTP (draft) tensors")
    return {"tensors": n, "mtp_tensors": n_mtp}
