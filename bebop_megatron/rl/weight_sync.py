"""Weight sync from the megatron-core policy to rollout engines.

The policy streams its weights as bounded buckets of HF-named tensors (``iter_hf_buckets``: TP
shards gathered, global layer names, trunk and MTP heads); an in-process engine loads each bucket
between steps, remote servers receive the same buckets through the rollout bridge.
"""

from __future__ import annotations

from typing import Optional

from bebop_megatron.config import MOE_ARCHS, Config
from bebop_megatron.convert.hf_megatron import iter_hf_buckets
from bebop_megatron.convert.layout import Shapes
from bebop_megatron.rollout.engine import Engine
from bebop_megatron.rollout.modeling import CausalLMWithMTP, LMConfig


def rollout_model_for(cfg: Config, dtype=None) -> CausalLMWithMTP:
    """An (uninitialised) engine model with the policy's shapes; weights come from a sync."""
    import torch

    m = cfg.model
    lm = LMConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size or 0,
                  num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                  num_key_value_heads=m.num_query_groups, head_dim=m.kv_channels, rms_norm_eps=m.norm_epsilon,
                  rope_theta=m.rotary_base, qk_norm=bool(m.qk_layernorm), qkv_bias=bool(m.add_qkv_bias),
                  tie_word_embeddings=m.tie_word_embeddings, num_mtp_modules=1 if m.mtp_recurrent else m.mtp_num_layers,
                  mtp_layout="deepseek", mtp_hidden="normed", mtp_intermediate_size=m.mtp_ffn_hidden_size or 0)
    if m.hybrid:  # Qwen3.5-style: Gated DeltaNet + gated attention; ONE MTP module in the mtp.* layout
        lm.layer_types = tuple(m.resolved_layer_types())
        lm.linear_key_head_dim, lm.linear_value_head_dim = m.linear_key_head_dim, m.linear_value_head_dim
        lm.linear_num_key_heads, lm.linear_num_value_heads = m.linear_num_key_heads, m.linear_num_value_heads
        lm.linear_conv_kernel_dim = m.linear_conv_kernel_dim
        lm.partial_rotary_factor = float(m.partial_rotary_factor)
        lm.attn_output_gate = lm.zero_centered_norm = True
        lm.mtp_layout = "qwen3_next"  # the converter's only MTP layout for this family (Shapes.from_config)
        lm.num_mtp_modules = 1 if m.mtp_num_layers else 0
        lm.gdn_layout = "qwen3_next" if m.arch == "qwen3_next" else "qwen3_5"  # the HF names the sync sends
    if m.arch in MOE_ARCHS:  # routed experts arrive as per-expert HF tensors (mlp.experts.E.*)
        lm.num_experts, lm.num_experts_per_tok = m.num_moe_experts, m.moe_router_topk
        lm.moe_intermediate_size = m.moe_ffn_hidden_size
        lm.shared_expert_intermediate_size = m.moe_shared_expert_intermediate_size or 0
        lm.norm_topk_prob = bool(m.moe_norm_topk_prob)
        lm.decoder_sparse_step, lm.mlp_only_layers = int(m.moe_layer_freq), tuple(m.mlp_only_layers or ())
    return CausalLMWithMTP(lm).to(dtype or torch.float32).eval()


def sync_engine(policy, cfg: Config, engine: Engine, version: Optional[str] = None,
                bucket_bytes: int = 256 << 20) -> dict:
    """Push the policy's current weights into an in-process engine (between engine steps).
    Returns counts; raises if the MTP heads were not part of the sync."""
    from megatron.core import parallel_state

    if cfg.model.moe and parallel_state.get_expert_model_parallel_world_size() > 1:
        raise NotImplementedError("sync_engine with expert parallelism: each rank holds only its own experts "
                                  "(the in-process engine needs them all); sync at EP=1")
    shapes = Shapes.from_config(cfg, parallel_state.get_tensor_model_parallel_world_size(), "deepseek")
    n, n_mtp = 0, 0
    L = cfg.model.num_layers
    with engine.lock:
        for bucket in iter_hf_buckets(policy, shapes, bucket_bytes):
            engine.model.load_hf_state_dict(bucket, strict=False)
            n += len(bucket)
            n_mtp += sum(1 for k in bucket if k.startswith("mtp.")
                         or (k.startswith("model.layers.") and int(k.split(".")[2]) >= L))
        if version is not None:
            engine.weight_version = str(version)
    if cfg.model.mtp_num_layers and n_mtp == 0:
        raise RuntimeError("weight sync carried no MTP (draft) tensors")
    return {"tensors": n, "mtp_tensors": n_mtp}


class WeightPusher:
    """Rank 0's push of the policy's HF-named buckets to the rollout servers, by transport:

    * ``tensor``: base64 safetensors buckets (``bebop serve`` only: SGLang's own
      ``update_weights_from_tensor`` takes pickled tensors and serves co-located engines only);
    * ``disk``: one HF folder per version under ``out_dir/weights`` on a file system every server
      sees (``update_weights_from_disk``), keeping the current and the previous version;
    * ``distributed``: a torch.distributed group (NCCL on GPUs, gloo on CPUs) with every
      server, created on the first push; rank 0 broadcasts each bucket
      (``update_weights_from_distributed``). A failed collective re-creates the group once.

    Every transport checks that the draft (MTP) weights changed too (``expect_mtp``).
    """

    def __init__(self, manager, cfg: Config, out_dir, expect_mtp: bool, mode: Optional[str] = None,
                 master_address: Optional[str] = None, backend: Optional[str] = None, keep_versions: int = 2,
                 timeout_s: float = 600.0):
        from pathlib import Path

        self.manager, self.cfg, self.expect_mtp = manager, cfg, expect_mtp
        self.mode = mode or cfg.rl.weight_sync
        if self.mode not in ("tensor", "disk", "distributed"):
            raise ValueError(f"weight sync mode must be tensor, disk or distributed, got {self.mode!r}")
        self.out_dir = Path(out_dir)
        self.master_address, self.backend = master_address, backend
        self.keep_versions = keep_versions
        self.timeout_s = timeout_s  # rendezvous and each collective of the distributed transport
        self._group_ready = False

    def push(self, buckets: list[dict], version: int) -> dict:
        if self.mode == "tensor":
            return self.manager.sync_tensors(buckets, version, expect_mtp=self.expect_mtp)
        if self.mode == "disk":
            return self._push_disk(buckets, version)
        return self._push_distributed(buckets, version)

    def _push_disk(self, buckets: list[dict], version: int) -> dict:
        import shutil

        from bebop_megatron.convert.hf_megatron import write_hf_folder

        root = self.out_dir / "weights"
        d = root / f"v{version}"
        write_hf_folder(buckets, self.cfg, Shapes.from_config(self.cfg, 1, "deepseek"), d)
        res = self.manager.sync_disk(str(d.resolve()), version, expect_mtp=self.expect_mtp)
        for old in root.glob("v*"):  # the servers hold v now: older folders can go
            if old.name != d.name and old.name[1:].isdigit() and int(old.name[1:]) <= version - self.keep_versions:
                shutil.rmtree(old, ignore_errors=True)
        return res

    def _init_group(self) -> None:
        import os
        from datetime import timedelta
        from urllib.parse import urlparse

        import torch

        from bebop_megatron.parallel import free_port
        from bebop_megatron.rollout.weight_update_group import WeightUpdateSender

        backend = self.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        addr = self.master_address or os.environ.get("BEBOP_WEIGHT_SYNC_ADDR")
        if not addr:
            hosts = {urlparse(s.url).hostname for s in self.manager.bridge.servers}
            import socket

            addr = "127.0.0.1" if hosts <= {"127.0.0.1", "localhost", "::1"} else socket.getfqdn()
        port = free_port()
        name = f"bebop_weight_sync_{port}"  # a fresh name per group: a broken one may linger
        timeout = timedelta(seconds=self.timeout_s)
        self.manager.init_weight_group(lambda world: WeightUpdateSender(addr, port, world, name, backend, timeout),
                                       addr, port, backend, name)
        self._group_ready = True

    def _push_distributed(self, buckets: list[dict], version: int) -> dict:
        from bebop_megatron.rollout.bridge import RolloutError

        if not self._group_ready:
            self._init_group()
        try:
            return self.manager.sync_distributed(buckets, version, expect_mtp=self.expect_mtp)
        except RolloutError:
            self._group_ready = False  # the bridge dropped the broken group: one fresh try
            self._init_group()
            return self.manager.sync_distributed(buckets, version, expect_mtp=self.expect_mtp)
