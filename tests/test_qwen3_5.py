"""Qwen3.5 (dense hybrid: Gated DeltaNet + gated full attention) and recurrent MTP.

* HF -> Megatron: megatron-core logits equal transformers' ``Qwen3_5ForCausalLM`` (fp32, 1e-4) on a
  tiny random model, at TP=1 and after resharding to TP=2; HF -> Megatron -> HF is bit-exact and
  keeps ONE MTP module (``mtp.*``), never copies of it.
* The megatron MTP chain equals a reference written with transformers' own Qwen3.5 decoder layer
  (``mtp.fc(cat(pre_fc_norm_embedding(emb), pre_fc_norm_hidden(h)))`` -> ``mtp.layers.0`` -> ``mtp.norm``).
* Recurrent MTP (``model.mtp_recurrent``) on the dense qwen3 arch: one layer, γ applications, equal to
  γ distinct layers holding copies of it, for all four objectives; checkpoints hold the one layer.

Sizes are tiny: the chunked Gated DeltaNet torch fallback pads to 64-token chunks.
"""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.distributed import run_distributed
from tests.tiny_models import init_hybrid_weights

os.environ.setdefault("HF_HUB_OFFLINE", "1")

IDS = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(5))
LOSSES = ["ce", "kl", "tv", "e2e_tv"]


def hf_tensors(path):
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def make_qwen3_5(path, tie=False, layer_types=("linear_attention", "full_attention"), seed=0, mtp=True):
    """A tiny random ``Qwen3_5ForCausalLM`` (+ Qwen3.5-layout MTP weights) saved as a HF folder."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    cfg = Qwen3_5TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, layer_types=list(layer_types),
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )
    model = Qwen3_5ForCausalLM(cfg).float().eval()
    init_hybrid_weights(model)
    path = Path(path)
    model.save_pretrained(str(path), safe_serialization=True)
    if mtp:
        g = torch.Generator().manual_seed(seed + 1)
        full = next(i for i, t in enumerate(layer_types) if t == "full_attention")
        layer = {k.split(".", 3)[3]: v for k, v in model.state_dict().items() if k.startswith(f"model.layers.{full}.")}
        h = cfg.hidden_size
        t = {"mtp.fc.weight": 0.2 * torch.randn(h, 2 * h, generator=g)}
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            t[f"mtp.{n}.weight"] = 0.1 * torch.randn(h, generator=g)
        for n, v in layer.items():
            t["mtp.layers.0." + n] = (0.1 if "norm" in n else 0.2) * torch.randn(v.shape, generator=g)
        save_file(t, str(path / "mtp.safetensors"))
        raw = json.loads((path / "config.json").read_text())
        raw["mtp_num_hidden_layers"] = 1
        (path / "config.json").write_text(json.dumps(raw, indent=2))
    return model


def mtp_reference(model, mtp_sd, ids, gamma):
    """Recurrent MTP written with transformers' Qwen3.5 modules: depth-k logits [b, s, V]."""
    import copy

    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

    cfg = copy.deepcopy(model.config)
    cfg.layer_types = ["full_attention"]
    layer = Qwen3_5DecoderLayer(cfg, 0).float().eval()
    layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in mtp_sd.items() if k.startswith("mtp.layers.0.")})
    return mtp_chain(model, layer, Qwen3_5RMSNorm, mtp_sd, ids, gamma)


def mtp_chain(model, layer, norm_cls, mtp_sd, ids, gamma):
    """ONE MTP ``layer`` (a transformers decoder layer holding ``mtp.layers.0``) applied ``gamma``
    times as megatron-core's recurrent MTP: step k sees step k-1's hidden and the tokens k ahead."""
    norms = {}
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[n] = norm_cls(model.config.hidden_size, model.config.rms_norm_eps)
        norms[n].weight.data.copy_(mtp_sd[f"mtp.{n}.weight"])
    fc = mtp_sd["mtp.fc.weight"]
    with torch.no_grad():
        h = model.model(ids).last_hidden_state  # normed trunk output (megatron-core's MTP input)
        s = ids.shape[1]
        pos = torch.arange(s).expand(ids.shape[0], -1)
        cos_sin = model.model.rotary_emb(h, pos)
        mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
        shifted = ids
        logits = []
        for _ in range(gamma):
            shifted = torch.roll(shifted, -1, dims=1)
            shifted[:, -1] = 0  # megatron's roll_tensor zero-fills
            emb = model.model.embed_tokens(shifted)
            x = torch.cat([norms["pre_fc_norm_embedding"](emb), norms["pre_fc_norm_hidden"](h)], -1) @ fc.t()
            x = layer(x, position_embeddings=cos_sin, attention_mask=mask, position_ids=pos)
            if isinstance(x, tuple):
                x = x[0]
            h = norms["norm"](x)
            logits.append(model.lm_head(h))
    return logits


# ------------------------------------------------------------------- conversion


def _megatron_logits(rank, world, ckpt_root, tp, gamma):
    from megatron.core import parallel_state

    from bebop_megatron.checkpointing import checkpoint_config, latest_checkpoint, load_checkpoint
    from bebop_megatron.config import Config
    from bebop_megatron.model import build_model
    from bebop_megatron.parallel import initialize_distributed

    ckpt = latest_checkpoint(ckpt_root)
    cfg = Config.from_dict(checkpoint_config(ckpt))
    cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size = tp, 1
    cfg.parallel.sequence_parallel = False  # activations' layout only (11 tokens do not split); same weights
    cfg.model.mtp_num_layers = gamma
    platform = initialize_distributed(tp, 1, seed=77)
    model = build_model(cfg, platform)
    load_checkpoint(ckpt, model)
    model.eval()
    group = parallel_state.get_tensor_model_parallel_group()

    def gather(x):
        parts = [torch.empty_like(x) for _ in range(tp)]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, -1)[..., : cfg.model.vocab_size]

    pos = torch.arange(IDS.shape[1]).expand_as(IDS)
    with torch.no_grad():
        main = gather(model(IDS, pos, None))
        decoder_out = model.decoder(model.embedding(input_ids=IDS, position_ids=pos), None,
                                    rotary_pos_emb=model.rotary_pos_emb(IDS.shape[1]))
        hidden = model.run_mtp_block(decoder_out, IDS, pos, attention_mask=None,
                                     rotary_pos_emb=model.rotary_pos_emb(IDS.shape[1]))
        mtp = [gather(lg).transpose(0, 1) for lg in model.mtp_logits(hidden)]
    names = sorted(n for n, _ in model.named_parameters() if n.startswith("mtp."))
    return main, mtp, names


@pytest.fixture(scope="module")
def q35(tmp_path_factory):
    from bebop_megatron.convert.hf_megatron import hf_to_megatron

    d = tmp_path_factory.mktemp("q35")
    model = make_qwen3_5(d / "hf")
    with torch.no_grad():
        ref = model(IDS).logits
    res = hf_to_megatron(d / "hf", d / "mc", tp=1)
    assert res["mtp_recurrent"] and not res["fresh_mtp_layers"]
    return d, model, ref


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen3_5_megatron_logits_and_mtp_equal_transformers(q35, tp):
    d, model, ref = q35
    gamma = 2
    main, mtp, names = run_distributed(_megatron_logits, tp, str(d / "mc"), tp, gamma)[0]
    assert (main - ref).abs().max() < 1e-4, (main - ref).abs().max()
    # one MTP layer in the model, applied γ times
    assert names and all(n.startswith("mtp.layers.0.") for n in names)
    mtp_ref = mtp_reference(model, load_file(str(d / "hf" / "mtp.safetensors")), IDS, gamma)
    s = IDS.shape[1]
    for k in range(gamma):  # positions whose ground-truth tokens exist
        diff = (mtp[k][:, : s - k - 1] - mtp_ref[k][:, : s - k - 1]).abs().max()
        assert diff < 1e-4, (k, diff)


def _check_round_trip(hf_dir, back_dir, tie, layer_types, gamma):
    src, back = hf_tensors(hf_dir), hf_tensors(back_dir)
    if tie:
        src.pop("lm_head.weight", None)
    assert set(back) == set(src)  # one MTP module (mtp.*), never copies of it
    for n, t in src.items():
        assert torch.equal(back[n], t), n
    cfg = json.loads((back_dir / "config.json").read_text())
    assert cfg["mtp_num_hidden_layers"] == 1 and cfg["bebop_mtp_draft_steps"] == gamma
    assert cfg["layer_types"] == list(layer_types)


def test_qwen3_5_round_trip_is_bit_exact_and_loads_in_transformers(q35, tmp_path):
    from transformers import AutoModelForCausalLM

    from bebop_megatron.convert.hf_megatron import megatron_to_hf

    d, _, ref = q35
    megatron_to_hf(d / "mc", tmp_path / "back")
    _check_round_trip(d / "hf", tmp_path / "back", False, ("linear_attention", "full_attention"), 1)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    assert type(hf).__name__ == "Qwen3_5ForCausalLM"
    with torch.no_grad():
        assert torch.equal(hf(IDS).logits, ref)


def test_qwen3_5_tied_round_trip_is_bit_exact(tmp_path):
    from bebop_megatron.convert.hf_megatron import hf_to_megatron, megatron_to_hf

    layer_types = ("full_attention", "linear_attention")
    make_qwen3_5(tmp_path / "hf", tie=True, layer_types=layer_types)
    res = hf_to_megatron(tmp_path / "hf", tmp_path / "mc", tp=1, mtp_layers=3)
    assert res["mtp_recurrent"] and res["mtp_layers"] == 3
    megatron_to_hf(tmp_path / "mc", tmp_path / "back")
    _check_round_trip(tmp_path / "hf", tmp_path / "back", True, layer_types, 3)


# ------------------------------------------------------------ recurrent MTP (dense)


def _recurrent_worker(rank, world, ckpt_dir):
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    from bebop_megatron.checkpointing import load_checkpoint, model_sharded_state_dict, save_checkpoint
    from bebop_megatron.model import build_model
    from bebop_megatron.parallel import initialize_distributed
    from tests.test_parallel import _batch
    from tests.tiny_models import tiny_config

    gamma = 3
    cfg = tiny_config(mtp_num_layers=gamma, mtp_recurrent=True)
    platform = initialize_distributed(1, 1, seed=3)
    rec = build_model(cfg, platform)
    cfg_unrolled = tiny_config(mtp_num_layers=gamma)
    unrolled = build_model(cfg_unrolled, platform)
    rp = dict(rec.named_parameters())
    out = {"rec_mtp_names": sorted(n for n in rp if n.startswith("mtp."))}
    with torch.no_grad():  # the unrolled model: every depth a copy of the one recurrent layer
        for n, p in unrolled.named_parameters():
            src = n
            if n.startswith("mtp.layers."):
                src = "mtp.layers.0." + n.split(".", 3)[3]
            p.copy_(rp[src])
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    tokens, labels, mask, pos = _batch(7)
    res = {}
    for loss_type in LOSSES:
        vals = []
        for model in (rec, unrolled):
            model.zero_grad()
            model.mtp_loss_type = loss_type
            token_loss = model(tokens, pos, None, labels=labels, loss_mask=mask)
            ((token_loss * mask).sum() / mask.sum()).backward()
            metrics = model.mtp_metrics.reduce()
            grads = {}
            for n, p in model.named_parameters():
                if n.startswith("mtp.") and p.grad is not None:
                    key = "mtp.layers.0." + n.split(".", 3)[3]
                    grads[key] = grads.get(key, 0) + p.grad.clone()  # tied copies: sum of depth grads
            vals.append((metrics, grads))
        (m_rec, g_rec), (m_unr, g_unr) = vals
        res[loss_type] = dict(
            loss=abs(m_rec["mtp/loss"] - m_unr["mtp/loss"]),
            alpha=max(abs(m_rec[f"mtp/alpha_{k}"] - m_unr[f"mtp/alpha_{k}"]) for k in range(1, gamma + 1)),
            grad=max((g_rec[n] - g_unr[n]).abs().max().item() for n in g_rec),
            gnorm=sum(g.abs().sum().item() for g in g_rec.values()),
            same_keys=set(g_rec) == set(g_unr),
        )
    out["losses"] = res
    # a checkpoint holds the one layer and loads back exactly
    path = save_checkpoint(ckpt_dir, 1, rec, extra={})
    fresh = build_model(cfg, platform)
    load_checkpoint(path, fresh)
    out["reload_equal"] = all(torch.equal(p, rp[n]) for n, p in fresh.named_parameters())
    out["ckpt_mtp_keys"] = sorted(k for k in model_sharded_state_dict(rec) if k.startswith("mtp."))
    return out


def test_recurrent_mtp_equals_unrolled_copies_for_all_losses(tmp_path):
    out = run_distributed(_recurrent_worker, 1, str(tmp_path / "ckpt"))[0]
    names = out["rec_mtp_names"]
    assert names and all(n.startswith("mtp.layers.0.") for n in names)
    for loss_type, r in out["losses"].items():
        assert r["same_keys"] and r["gnorm"] > 0, (loss_type, r)
        assert r["loss"] < 1e-5 and r["alpha"] < 1e-5 and r["grad"] < 1e-5, (loss_type, r)
    assert out["reload_equal"]
    assert out["ckpt_mtp_keys"] and all(k.startswith("mtp.layers.0.") for k in out["ckpt_mtp_keys"])


def test_multimodal_qwen3_5_config_and_names_map_to_the_text_model():
    """Published Qwen3.5 checkpoints are ``Qwen3_5ForConditionalGeneration``: text fields nested in
    ``text_config``, decoder tensors under ``model.language_model.``, a vision tower to skip."""
    from bebop_megatron.convert.hf_megatron import config_from_hf, hf_mtp_layout
    from bebop_megatron.convert.layout import Shapes, recipe_for

    raw = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "tie_word_embeddings": False,
           "text_config": {"model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120,
                           "intermediate_size": 17408, "num_hidden_layers": 8, "num_attention_heads": 24,
                           "num_key_value_heads": 4, "head_dim": 256, "full_attention_interval": 4,
                           "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
                           "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "mtp_num_hidden_layers": 1,
                           "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
                           "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25}}}
    assert hf_mtp_layout(raw) == ("qwen3_next", 1)
    cfg = config_from_hf(raw, mtp_layers=3)
    m = cfg.model
    assert (m.arch, m.num_layers, m.kv_channels, m.linear_num_value_heads, m.mtp_num_layers, m.mtp_recurrent) == (
        "qwen3_5", 8, 256, 48, 3, True)
    assert m.partial_rotary_factor == 0.25 and m.rotary_base == 1e7
    assert m.resolved_layer_types() == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"]
    s = Shapes.from_config(cfg, 1, "deepseek", "model.language_model.")
    assert s.mtp_layout == "qwen3_next" and s.mtp_modules == 1
    assert recipe_for("embedding.word_embeddings.weight", s).hf_names == ["model.language_model.embed_tokens.weight"]
    assert recipe_for("decoder.layers.0.self_attention.in_proj.weight", s).hf_names == [
        f"model.language_model.layers.0.linear_attn.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")]
    assert recipe_for("mtp.layers.0.eh_proj.weight", s).hf_names == ["mtp.fc.weight"]
    assert recipe_for("mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight", s).hf_names[0] == (
        "mtp.layers.0.self_attn.q_proj.weight")
    assert recipe_for("mtp.layers.1.eh_proj.weight", s) is None  # recurrent: one module, never copies
