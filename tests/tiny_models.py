"""Tiny random Qwen2/Qwen3 checkpoints in the Hugging Face layout, built offline from
transformers' own configs, with MTP weights added in the DeepSeek-V3 or Qwen3-Next layout."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def make_hf_checkpoint(path, arch="qwen3", mtp_layout="deepseek", num_mtp=3, vocab=64, hidden=48,
                       layers=2, heads=4, kv_heads=2, tie=False, seed=0, scale=1.0):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
              rope_theta=50000.0, tie_word_embeddings=tie, rms_norm_eps=1e-6)
    if arch == "qwen3":
        cfg, cls = Qwen3Config(head_dim=hidden // heads, **kw), Qwen3ForCausalLM
    else:
        cfg, cls = Qwen2Config(**kw), Qwen2ForCausalLM
    model = cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, scale * 0.2)
    path = Path(path)
    model.save_pretrained(str(path), safe_serialization=True)
    if num_mtp:
        add_mtp_weights(path, model, mtp_layout, num_mtp, seed=seed + 1, scale=scale)
    return model


def add_mtp_weights(path, model, layout, num_mtp, seed=1, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    h, L = cfg.hidden_size, cfg.num_hidden_layers
    layer_sd = {k.split(".", 3)[3]: v for k, v in model.state_dict().items() if k.startswith("model.layers.0.")}
    tensors = {}

    def rnd(shape, norm=False):
        return (1.0 + 0.1 * torch.randn(shape, generator=g)) if norm else torch.randn(shape, generator=g) * 0.2 * scale

    modules = num_mtp if layout == "deepseek" else 1
    for k in range(modules):
        base = f"model.layers.{L + k}." if layout == "deepseek" else "mtp."
        names = ({"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "final": "shared_head.norm"}
                 if layout == "deepseek" else
                 {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc", "final": "norm"})
        tensors[base + names["enorm"] + ".weight"] = rnd((h,), True)
        tensors[base + names["hnorm"] + ".weight"] = rnd((h,), True)
        tensors[base + names["eh_proj"] + ".weight"] = rnd((h, 2 * h))
        tensors[base + names["final"] + ".weight"] = rnd((h,), True)
        layer_base = base if layout == "deepseek" else "mtp.layers.0."
        for n, v in layer_sd.items():
            tensors[layer_base + n] = rnd(tuple(v.shape), "norm" in n)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(Path(path) / "mtp.safetensors"))
    cfg_path = Path(path) / "config.json"
    raw = json.loads(cfg_path.read_text())
    if layout == "deepseek":
        raw["num_nextn_predict_layers"] = num_mtp
    else:
        raw["mtp_num_hidden_layers"] = 1
    cfg_path.write_text(json.dumps(raw, indent=2))


def init_hybrid_weights(model) -> None:
    """Random weights for a tiny Qwen3.5-family HF model that exercise every term (the torch RNG is
    seeded by the caller): zero-centred norms get (1 + w) offsets, the GDN gated norm a plain gain near
    1, the decay parameters A_log/dt_bias a wider spread, everything else N(0, 0.2)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))  # plain gain
            elif "norm" in name:
                p.copy_(0.1 * torch.randn_like(p))  # zero-centred (1 + w)
            elif name.endswith(("A_log", "dt_bias")):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)


def tiny_hybrid_config(arch: str = "qwen3_5"):
    """``configs/tiny_qwen3p5_cpu.yaml`` cut to 2 layers (GDN + gated attention) at width 32, as ``arch``:
    qwen3_5 (tied), qwen3_5_moe (tied) or qwen3_next (untied); the MoE archs get 4 experts, top-2, and a
    shared expert. One recurrent MTP layer (γ = 3)."""
    from bebop_megatron.config import Config

    cfg = Config.load(str(Path(__file__).resolve().parents[1] / "configs" / "tiny_qwen3p5_cpu.yaml"))
    m = cfg.model
    m.arch, m.num_layers, m.full_attention_interval, m.hidden_size, m.ffn_hidden_size = arch, 2, 2, 32, 48
    m.kv_channels, m.linear_key_head_dim, m.linear_value_head_dim = 8, 8, 8
    m.tie_word_embeddings = arch != "qwen3_next"
    if arch != "qwen3_5":
        m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size = 4, 2, 16
        m.moe_shared_expert_intermediate_size = 24
    return cfg


# The tests' one tiny megatron trunk: 2 layers, hidden 32, 4 heads in 2 query groups, γ = 2 MTP layers.
TINY_MODEL = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  kv_channels=8, mtp_num_layers=2)


def tiny_config(overrides: dict | None = None, **model):
    """The tiny megatron ``Config`` every in-process and worker test builds from (a function, not only a
    fixture, because gloo workers build it in their own process). ``model`` sets model fields over
    ``TINY_MODEL``; ``overrides`` sets any field by its dotted name, as ``--set`` does
    (``{"rl.lr": 1e-2, "data.seq_length": 32}``). Unknown names fail loudly."""
    from bebop_megatron.config import Config

    cfg = Config()
    for k, v in {**TINY_MODEL, "vocab_size": 100, "make_vocab_size_divisible_by": 64, **model}.items():
        _set(cfg, f"model.{k}", v)
    _set(cfg, "data.seq_length", 16)
    for k, v in (overrides or {}).items():
        _set(cfg, k, v)
    return cfg


def _set(cfg, dotted: str, value) -> None:
    section, key = dotted.split(".")
    obj = getattr(cfg, section)
    if not hasattr(obj, key):
        raise AttributeError(f"tiny_config: no field {dotted!r}")
    setattr(obj, key, value)
