"""The megatron policy's weights (trunk + MTP) synced into the embedded engine reproduce the policy."""

import pytest
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


def _narrow_mtp_worker(rank, world, recurrent):
    from bebop_megatron.model import build_model
    from bebop_megatron.parallel import initialize_distributed
    from bebop_megatron.rl.weight_sync import rollout_model_for, sync_engine
    from bebop_megatron.rollout.engine import Engine, SpecConfig
    from bebop_megatron.rollout.modeling import make_batch_index
    from tests.tiny_models import tiny_config

    cfg = tiny_config(tie_word_embeddings=False, mtp_num_layers=2, mtp_recurrent=recurrent, mtp_ffn_hidden_size=24)
    policy = build_model(cfg, initialize_distributed(1, 1, seed=5))
    policy.eval()
    fc1 = {n: tuple(p.shape) for n, p in policy.named_parameters() if n.startswith("mtp.") and "linear_fc1.weight" in n}
    trunk_fc1 = tuple(policy.decoder.layers[0].mlp.linear_fc1.weight.shape)
    T = 12
    ids = torch.randint(0, 100, (2, T), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(T).expand_as(ids)
    with torch.no_grad():
        rope = policy.rotary_pos_emb(T)
        dec = policy.decoder(policy.embedding(input_ids=ids, position_ids=pos), None, rotary_pos_emb=rope)
        hidden = policy.run_mtp_block(dec, ids, pos, attention_mask=None, rotary_pos_emb=rope)
        ref = [lg.transpose(0, 1)[..., :100] for lg in policy.mtp_logits(hidden)]
    engine = Engine(rollout_model_for(cfg), spec=SpecConfig("mtp", 2), max_running=2, max_len=64)
    sync_engine(policy, cfg, engine, version="narrow")
    m = engine.model
    with torch.no_grad():
        _, h = m.trunk(ids, m.new_cache(2, T + 1, "trunk"), make_batch_index([0, 1], [0, 0], [T, T], "cpu"))
        diffs = []
        for k in range(1, 3):  # depth k at position t reads token t + k and predicts t + k + 1
            n = T - k
            h = m.mtp_step(k - 1, h[:, :n], ids[:, k: k + n], m.new_cache(2, T + 1, "mtp"),
                           make_batch_index([0, 1], [0, 0], [n, n], "cpu"))
            diffs.append((m.logits(h) - ref[k - 1][:, :n]).abs().max().item())
    engine_fc1 = tuple(m.mtp[0].layers[0].mlp.gate_proj.weight.shape) if hasattr(m.mtp[0].layers[0].mlp, "gate_proj") \
        else None
    return {"fc1": fc1, "trunk_fc1": trunk_fc1, "diffs": diffs, "engine_fc1": engine_fc1}


def test_narrow_mtp_layer_syncs_and_drafts_like_the_policy():
    """``model.mtp_ffn_hidden_size``: the MTP layers' MLP is narrower than the trunk's, in megatron
    (separate and recurrent MTP), in the synced engine, and the engine's draft logits equal the
    policy's MTP logits depth by depth."""
    for recurrent in (False, True):
        r = run_distributed(_narrow_mtp_worker, 1, recurrent)[0]
        assert r["fc1"] and all(s == (48, 32) for s in r["fc1"].values()), r["fc1"]
        assert r["trunk_fc1"][0] != 48
        assert len(r["fc1"]) == (1 if recurrent else 2)
        assert r["engine_fc1"] == (24, 32) and max(r["diffs"]) < 1e-4, r


def test_narrow_mtp_width_round_trips_through_the_hf_config():
    from bebop_megatron.config import ConfigError
    from bebop_megatron.convert.hf_megatron import config_from_hf
    from bebop_megatron.convert.layout import Shapes, hf_config
    from bebop_megatron.rollout.modeling import LMConfig
    from tests.tiny_models import tiny_config

    cfg = tiny_config(mtp_ffn_hidden_size=24)
    hc = hf_config(Shapes.from_config(cfg), "qwen3", 1e6, 1e-6, 512)
    hc["intermediate_size"] = cfg.model.ffn_hidden_size
    assert hc["bebop_mtp_intermediate_size"] == 24
    assert LMConfig.from_hf(hc).mtp_intermediate_size == 24
    assert config_from_hf(hc).model.mtp_ffn_hidden_size == 24
    wide = hf_config(Shapes.from_config(tiny_config()), "qwen3", 1e6, 1e-6, 512)
    assert "bebop_mtp_intermediate_size" not in wide and LMConfig.from_hf({**wide, "intermediate_size": 8}).mtp_intermediate_size == 0
    bad = tiny_config({"data.seq_length": 64}, mtp_ffn_hidden_size=0)
    with pytest.raises(ConfigError, match="mtp_ffn_hidden_size"):
        bad.validate()
