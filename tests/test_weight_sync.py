"""The megatron policy's weights (trunk + MTP) synced into the embedded engine reproduce the policy."""

import torch

from tests.distributed import run_distributed


def _worker(rank, world, tp):
    from megatron.core import parallel_state

    from bebop_megatron.model import build_model
    from bebop_megatron.parallel import initialize_distributed
    from bebop_megatron.rl.weight_sync import rollout_model_for, sync_engine
    from bebop_megatron.rollout.engine import Engine, SpecConfig
    from bebop_megatron.rollout.modeling import make_batch_index
    from tests.tiny_models import tiny_config

    cfg = tiny_config(tie_word_embeddings=False)
    cfg.parallel.tensor_model_parallel_size = tp
    policy = build_model(cfg, initialize_distributed(tp, 1, seed=3))
    policy.eval()
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        local = policy(ids, torch.arange(12).expand_as(ids), None)
    parts = [torch.empty_like(local) for _ in range(tp)]
    torch.distributed.all_gather(parts, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    ref = torch.cat(parts, -1)[..., :100]
    engine = Engine(rollout_model_for(cfg), spec=SpecConfig("mtp", 2), max_running=2, max_len=64)
    from bebop_megatron.model.tp_layout import gather_tensor

    eh = policy.mtp.layers[1].eh_proj.weight
    eh_full = gather_tensor("mtp.layers.1.eh_proj.weight", eh, parallel_state.get_tensor_model_parallel_group(), True)
    mtp_differed = not torch.equal(eh_full, engine.model.mtp[1].eh_proj.weight)
    info = sync_engine(policy, cfg, engine, version="step-1", bucket_bytes=20_000)
    m = engine.model
    normed, _ = m.trunk(ids, m.new_cache(2, 16, "trunk"), make_batch_index([0, 1], [0, 0], [12, 12], "cpu"))
    # the MTP heads arrived too: depth-1 hidden equals megatron's MTP layer 0 output
    return {"diff": (m.logits(normed) - ref).abs().max().item(), "info": info, "version": engine.weight_version,
            "mtp_equal": torch.equal(eh_full, m.mtp[1].eh_proj.weight), "mtp_differed": mtp_differed}


def test_policy_to_engine_sync_tp1_and_tp2():
    for tp in (1, 2):
        r = run_distributed(_worker, tp, tp)[0]
        assert r["diff"] < 1e-4, r
        assert r["info"]["mtp_tensors"] > 0 and r["version"] == "step-1"
        assert r["mtp_differed"] and r["mtp_equal"]
