"""``bebop convert``: Hugging Face folders <-> megatron-core ``torch_dist`` checkpoints.

HF -> Megatron runs one process per (TP, PP) rank of the chosen layout: each builds only its
shard of the model and reads, lazily through ``safetensors.safe_open``, just the HF tensors its
parameters need, one parameter at a time; peak memory stays near one shard plus one layer.
Megatron -> HF loads the checkpoint (reshardable) at TP1/PP1 and streams tensors out.
The same name mapping feeds rollout weight sync: :func:`iter_hf_buckets` turns a live model
(any TP/PP rank) into bounded-size buckets of HF-named tensors.
Outputs appear only when complete: everything is written to ``<output>.partial`` and renamed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch
from torch import Tensor

from bebop_megatron.config import HYBRID_ARCHS, MOE_ARCHS, Config, ConfigError, ModelConfig
from bebop_megatron.convert.layout import ConversionError, Shapes, hf_config, recipe_for

IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq", "shared_head.head.weight")
IGNORABLE_PREFIXES = ("model.visual.",)  # Qwen3.5 vision tower: bebop trains the text model only


# ------------------------------------------------------------------------ HF input


class LazyHF:
    """Tensors of a HF folder (sharded or not), read on demand."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        self.path = Path(path)
        if not (self.path / "config.json").exists():
            raise ConversionError(f"{self.path}: no config.json (not a Hugging Face model folder)")
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ConversionError(f"{self.path}: no *.safetensors weights (only safetensors are read)")
        self.config = json.loads((self.path / "config.json").read_text())
        self._where: dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    self._where[k] = f

    def keys(self) -> set[str]:
        return set(self._where)

    @property
    def prefix(self) -> str:
        """Prefix of the decoder tensors: ``model.`` or, in Qwen3.5's multimodal checkpoints,
        ``model.language_model.``."""
        return "model.language_model." if any(k.startswith("model.language_model.") for k in self._where) else "model."

    def get(self, name: str) -> Tensor:
        from safetensors import safe_open

        if name not in self._where:
            raise ConversionError(f"missing tensor {name!r} in {self.path}")
        # open per tensor: a cached handle keeps the whole file memory-mapped in this process
        with safe_open(str(self._where[name]), framework="pt") as h:
            return h.get_tensor(name).clone()


def text_config(cfg: dict) -> dict:
    """The language model's fields (Qwen3.5 nests them in ``text_config``), over the top level."""
    tc = cfg.get("text_config")
    if not isinstance(tc, dict):
        return cfg
    return {**{k: v for k, v in cfg.items() if k != "text_config"}, **tc}


def hf_arch(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    mt = cfg.get("model_type", "")
    if mt in ("qwen3_5", "qwen3_5_text") or any(a.startswith("Qwen3_5For") for a in archs):
        return "qwen3_5"
    if mt in ("qwen3_5_moe", "qwen3_5_moe_text") or any(a.startswith("Qwen3_5MoeFor") for a in archs):
        return "qwen3_5_moe"
    if mt == "qwen3_next" or any(a.startswith("Qwen3NextFor") for a in archs):
        return "qwen3_next"
    if mt == "qwen3" or any(a.startswith("Qwen3ForCausalLM") for a in archs):
        return "qwen3"
    if mt == "qwen2" or any(a.startswith("Qwen2ForCausalLM") for a in archs):
        return "qwen2"
    raise ConversionError(f"unsupported architecture {archs or mt!r}: bebop converts Qwen2 / Qwen3 / "
                          "Qwen3.5 / Qwen3.5-MoE / Qwen3-Next models")


def hf_mtp_layout(cfg: dict) -> tuple[Optional[str], int]:
    """(layout, modules) of the MTP weights a HF config declares (None, 0 when it has none)."""
    cfg = text_config(cfg)
    n = int(cfg.get("num_nextn_predict_layers") or 0)
    if n:
        return "deepseek", n
    if int(cfg.get("mtp_num_hidden_layers") or 0):
        return "qwen3_next", 1
    return None, 0


def config_from_hf(cfg: dict, mtp_layers: Optional[int] = None, vocab_multiple: int = 128) -> Config:
    """A bebop Config whose model section reproduces the HF model (γ = the HF MTP depth unless given).
    A Qwen3-Next-layout MTP module (one module for every draft step) becomes recurrent MTP."""
    arch = hf_arch(cfg)
    layout, n_modules = hf_mtp_layout(cfg)
    cfg = text_config(cfg)
    gamma = mtp_layers or (n_modules if layout == "deepseek" else 0) or 1
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    heads = cfg["num_attention_heads"]
    m = ModelConfig(
        arch=arch, num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
        # Qwen3.5-MoE has no dense MLP (no intermediate_size): any positive value, unused
        ffn_hidden_size=cfg.get("intermediate_size") or cfg.get("moe_intermediate_size"), num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads", heads), kv_channels=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"], make_vocab_size_divisible_by=vocab_multiple,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rotary_base=float(cfg.get("rope_theta") or rp.get("rope_theta") or 10000.0),
        norm_epsilon=cfg.get("rms_norm_eps", 1e-6), qk_layernorm=arch == "qwen3",
        add_qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), mtp_num_layers=gamma,
        mtp_recurrent=layout == "qwen3_next",
        mtp_ffn_hidden_size=int(cfg.get("bebop_mtp_intermediate_size") or 0) or None,
    )
    if arch in HYBRID_ARCHS:
        m.qk_layernorm, m.add_qkv_bias = True, bool(cfg.get("attention_bias", False))
        m.layer_types = list(cfg["layer_types"]) if cfg.get("layer_types") else None
        m.full_attention_interval = int(cfg.get("full_attention_interval", 4))
        m.partial_rotary_factor = float(rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
        for k in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                  "linear_num_value_heads"):
            if cfg.get(k) is not None:
                setattr(m, k, int(cfg[k]))
    if arch in MOE_ARCHS:
        m.num_moe_experts, m.moe_router_topk = int(cfg["num_experts"]), int(cfg["num_experts_per_tok"])
        m.moe_ffn_hidden_size = int(cfg["moe_intermediate_size"])
        m.moe_shared_expert_intermediate_size = int(cfg.get("shared_expert_intermediate_size") or 0) or None
        # Qwen3.5-MoE always renormalises the top-k weights; Qwen3-Next per norm_topk_prob
        m.moe_norm_topk_prob = bool(cfg.get("norm_topk_prob", True)) if arch == "qwen3_next" else True
        m.moe_layer_freq = int(cfg.get("decoder_sparse_step") or 1)
        m.mlp_only_layers = list(cfg.get("mlp_only_layers") or []) or None
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32").replace("torch.", "")
    m.params_dtype = dtype if dtype in ("float32", "bfloat16", "float16") else "float32"
    c = Config(model=m)
    c.data.seq_length = min(c.data.seq_length, m.max_position_embeddings)
    return c


# ------------------------------------------------------------------ megatron <- HF


def _global_name(name: str, layer_offset: int, expert_offset: int = 0) -> str:
    """Global layer (PP) and expert (EP) indices of a rank-local parameter name."""
    if expert_offset:
        from bebop_megatron.convert.layout import expert_suffix, parse_expert

        head, sep, tail = name.partition("mlp.experts.")
        ex = parse_expert("mlp.experts." + tail) if sep else None
        if ex is not None:
            name = head + expert_suffix(ex[0] + expert_offset, ex[1], grouped="local_experts" not in tail)
    if name.startswith("decoder.layers."):
        i, rest = name[len("decoder.layers."):].split(".", 1)
        return f"decoder.layers.{int(i) + layer_offset}.{rest}"
    return name


def _expert_offset(model) -> int:
    """Global index of this rank's first expert (expert parallelism)."""
    from megatron.core import parallel_state

    n = getattr(model.config, "num_moe_experts", None)
    if not n:
        return 0
    ep = parallel_state.get_expert_model_parallel_world_size()
    return parallel_state.get_expert_model_parallel_rank() * (n // ep)


def load_hf_into_model(model, hf: LazyHF, shapes: Shapes) -> dict:
    """Fill this rank's (TP/PP-sharded) megatron model from HF tensors.

    Returns {"consumed": set of HF names used, "fresh_mtp": megatron MTP names left at their
    initialisation because the HF model has no MTP weights}.
    """
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from bebop_megatron.model.tp_layout import shard_tensor

    offset = get_transformer_layer_offset(model.config)
    e_offset = _expert_offset(model)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    gated = model.config.gated_linear_unit
    has_mtp = hf_mtp_layout(hf.config)[0] is not None
    available = hf.keys()
    consumed, fresh = set(), []
    for name, param in model.named_parameters():
        gname = _global_name(name, offset, e_offset)
        recipe = recipe_for(gname, shapes)
        if recipe is None:
            if gname == "output_layer.weight" and shapes.tie:
                continue
            raise ConversionError(f"no Hugging Face mapping for megatron parameter {gname!r}")
        if gname.startswith("mtp.") and not has_mtp:
            fresh.append(gname)
            continue
        missing = [n for n in recipe.hf_names if n not in available]
        if missing:
            raise ConversionError(f"missing tensor {missing[0]!r} (needed for {gname})")
        full = recipe.to_megatron([hf.get(n) for n in recipe.hf_names])
        try:
            shard = shard_tensor(gname, full, param, tp_rank, tp_size, gated)
        except ValueError as e:
            raise ConversionError(f"shape mismatch: {e} (from {recipe.hf_names})") from e
        with torch.no_grad():
            param.copy_(shard.to(param.dtype))
        consumed.update(recipe.hf_names)
    return {"consumed": consumed, "fresh_mtp": fresh}


def unexpected_hf_tensors(hf: LazyHF, shapes: Shapes) -> list[str]:
    """HF tensors no megatron parameter would consume (checked once, before converting)."""
    layer_sfx = _LAYER_SUFFIXES + (_GDN_SUFFIXES if shapes.hybrid else ()) + _moe_suffixes(shapes)
    mtp_sfx = _MTP_SUFFIXES + tuple("transformer_layer." + s for s in _moe_suffixes(shapes))
    names = {f"decoder.layers.{i}.{sfx}" for i in range(shapes.num_layers) for sfx in layer_sfx}
    names |= {f"mtp.layers.{k}.{sfx}" for k in range(shapes.mtp_modules) for sfx in mtp_sfx}
    names |= {"embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"}
    used = set()
    for n in names:
        r = recipe_for(n, shapes)
        if r is not None:
            used.update(r.hf_names)
    if shapes.tie:
        used.add("lm_head.weight")  # some tied checkpoints still carry a copy
    return sorted(k for k in hf.keys() - used
                  if not k.endswith(IGNORABLE_SUFFIXES) and not k.startswith(IGNORABLE_PREFIXES))


_LAYER_SUFFIXES = ("input_layernorm.weight", "pre_mlp_layernorm.weight", "self_attention.linear_qkv.weight",
                   "self_attention.linear_qkv.bias", "self_attention.linear_proj.weight",
                   "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight",
                   "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
_GDN_SUFFIXES = ("self_attention.in_proj.weight", "self_attention.in_proj.layer_norm_weight",
                 "self_attention.conv1d.weight", "self_attention.A_log", "self_attention.dt_bias",
                 "self_attention.out_norm.weight", "self_attention.out_proj.weight")
def _moe_suffixes(shapes: Shapes) -> tuple:
    if not shapes.moe:
        return ()
    from bebop_megatron.convert.layout import expert_suffix

    return ("mlp.router.weight", "mlp.shared_experts.gate_weight", "mlp.shared_experts.linear_fc1.weight",
            "mlp.shared_experts.linear_fc2.weight") + tuple(
        expert_suffix(e, fc) for e in range(shapes.moe[0]) for fc in ("linear_fc1", "linear_fc2"))


_MTP_SUFFIXES = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight") + tuple(
    "transformer_layer." + s for s in _LAYER_SUFFIXES)


def _hf_to_megatron_worker(rank, world, hf_path, out_tmp, cfg_dict, tp, pp, layout, prefix="model."):
    from bebop_megatron.checkpointing import save_checkpoint
    from bebop_megatron.model import build_model
    from bebop_megatron.parallel import initialize_distributed

    cfg = Config.from_dict(cfg_dict)
    cfg.model.transformer_impl = "local"  # CPU workers; the checkpoint uses local-spec names
    platform = initialize_distributed(tp, pp, seed=1234, force_cpu=True)
    hf = LazyHF(hf_path)
    # every weight is overwritten unless MTP layers must be created fresh
    model = build_model(cfg, platform, initialize=hf_mtp_layout(hf.config)[0] is None)
    shapes = Shapes.from_config(cfg, tp, layout, prefix)
    info = load_hf_into_model(model, hf, shapes)
    save_checkpoint(out_tmp, 0, model, extra={"config": json.dumps(cfg.to_dict()), "source": str(hf_path),
                                              "consumed_samples": 0, "phase": "converted"})
    return {"fresh_mtp": info["fresh_mtp"], "consumed": sorted(info["consumed"])}


def hf_to_megatron(hf_path: str | Path, output: str | Path, tp: int = 1, pp: int = 1,
                   mtp_layers: Optional[int] = None, vocab_multiple: int = 128, overwrite: bool = False) -> dict:
    from bebop_megatron.parallel import run_local_workers

    hf = LazyHF(hf_path)
    cfg = config_from_hf(hf.config, mtp_layers, vocab_multiple)
    cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size = tp, pp
    cfg.parallel.global_batch_size = cfg.parallel.micro_batch_size = 1
    cfg.parallel.sequence_parallel = cfg.model.moe and tp > 1  # megatron-core trains MoE + TP only with SP
    cfg.model.padded_vocab = cfg.model.padded_vocab_size(tp)  # reshardable: same rows at any TP
    try:
        cfg.validate(world_size=tp * pp)
    except ConfigError as e:
        raise ConversionError(str(e)) from e
    layout, _ = hf_mtp_layout(hf.config)
    shapes = Shapes.from_config(cfg, tp, layout or "deepseek", hf.prefix)
    extra = unexpected_hf_tensors(hf, shapes)
    if extra:
        raise ConversionError(f"unexpected tensor(s) in {hf_path}: {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    out, tmp = _prepare_output(output, overwrite)
    try:
        results = run_local_workers(_hf_to_megatron_worker, tp * pp, str(hf_path), str(tmp), cfg.to_dict(), tp, pp,
                                    layout or "deepseek", hf.prefix)
    except RuntimeError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        msg = str(e)
        for line in reversed(msg.splitlines()):
            if "ConversionError" in line:
                raise ConversionError(line.split("ConversionError:", 1)[-1].strip()) from None
        raise
    consumed = set().union(*(set(r["consumed"]) for r in results))
    fresh = sorted(set().union(*(set(r["fresh_mtp"]) for r in results)))
    (tmp / "bebop_config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    _copy_tokenizer(Path(hf_path), tmp)
    _publish(tmp, out)
    return {"output": str(out), "tensors": len(consumed), "fresh_mtp_layers": bool(fresh),
            "mtp_layers": cfg.model.mtp_num_layers, "mtp_recurrent": cfg.model.mtp_recurrent, "layout": layout,
            "tp": tp, "pp": pp}


# ------------------------------------------------------------------ megatron -> HF


def iter_hf_tensors(model, shapes: Shapes) -> Iterator[tuple[str, Tensor]]:
    """(HF name, full tensor) for this rank's pipeline stage (TP shards gathered: a collective
    over the TP group, so every TP rank must iterate). MTP depths map to distinct DeepSeek-style
    modules; with the single-module Qwen3-Next layout (and with recurrent MTP, which holds one
    layer) only depth 0 is exported."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from bebop_megatron.model.tp_layout import gather_tensor

    from megatron.core import parallel_state

    offset = get_transformer_layer_offset(model.config)
    e_offset = _expert_offset(model)
    group = parallel_state.get_tensor_model_parallel_group()
    gated = model.config.gated_linear_unit
    seen: set[str] = set()
    for name, param in model.named_parameters():
        gname = _global_name(name, offset, e_offset)
        if gname == "embedding.word_embeddings.weight" and not parallel_state.is_pipeline_first_stage():
            continue  # the MTP stage's copy of the (first-stage) embedding
        recipe = recipe_for(gname, shapes)
        if recipe is None:
            continue
        full = gather_tensor(gname, param, group, gated)
        for hf_name, t in zip(recipe.hf_names, recipe.from_megatron(full)):
            if hf_name in seen:
                continue
            seen.add(hf_name)
            yield hf_name, t.contiguous()


def iter_hf_buckets(model, shapes: Shapes, bucket_bytes: int = 512 << 20) -> Iterator[dict[str, Tensor]]:
    """Bounded-size buckets of HF-named tensors (rollout weight sync)."""
    bucket, size = {}, 0
    for name, t in iter_hf_tensors(model, shapes):
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t
        size += nbytes
    if bucket:
        yield bucket


def _megatron_to_hf_worker(rank, world, ckpt, out_tmp, shard_bytes, dtype):
    from bebop_megatron.checkpointing import checkpoint_config, load_checkpoint
    from bebop_megatron.model import build_model
    from bebop_megatron.parallel import initialize_distributed

    cfg = Config.from_dict(checkpoint_config(ckpt))
    # keep the saved vocabulary padding (megatron pads to a multiple of divisible_by * TP)
    cfg.model.padded_vocab = cfg.model.padded_vocab_size(cfg.parallel.tensor_model_parallel_size)
    cfg.parallel.tensor_model_parallel_size = cfg.parallel.pipeline_model_parallel_size = 1
    cfg.parallel.sequence_parallel, cfg.parallel.expert_model_parallel_size = False, 1
    cfg.model.transformer_impl = "local"
    platform = initialize_distributed(1, 1, seed=0, force_cpu=True)
    model = build_model(cfg, platform, initialize=False)
    load_checkpoint(ckpt, model)
    # recurrent MTP exports its one module in the Qwen3-Next layout (mtp.*), as Qwen3.5 ships it
    shapes = Shapes.from_config(cfg, 1, "qwen3_next" if cfg.model.mtp_recurrent else "deepseek")
    return write_hf_folder(iter_hf_buckets(model, shapes, shard_bytes), cfg, shapes, out_tmp, dtype)


def write_hf_folder(buckets: Iterable[dict[str, Tensor]], cfg: Config, shapes: Shapes, out_dir: str | Path,
                    dtype: str = "float32") -> dict:
    """Write HF-named buckets as sharded safetensors + index + config.json (what `bebop serve`,
    SGLang and transformers load)."""
    from safetensors.torch import save_file

    out_tmp = Path(out_dir)
    out_tmp.mkdir(parents=True, exist_ok=True)
    index, files, n = {}, [], 0
    for bucket in buckets:
        n += 1
        fname = f"model-{n:05d}.safetensors"
        save_file({k: v.to(getattr(torch, dtype)).contiguous() for k, v in bucket.items()}, str(out_tmp / fname),
                  metadata={"format": "pt"})
        files.append(fname)
        index.update({k: fname for k in bucket})
    total = len(files)
    for i, f in enumerate(files, 1):  # HF's "-0000i-of-0000N" names once N is known
        final = f"model-{i:05d}-of-{total:05d}.safetensors"
        os.replace(out_tmp / f, out_tmp / final)
        index = {k: (final if v == f else v) for k, v in index.items()}
    (out_tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=2))
    m = cfg.model
    hc = hf_config(shapes, m.arch, m.rotary_base, m.norm_epsilon, m.max_position_embeddings)
    if "intermediate_size" in hc:
        hc["intermediate_size"] = m.ffn_hidden_size
    hc["torch_dtype"] = dtype
    if cfg.data.tokenizer == "char":  # the built-in tokenizer: let `bebop serve` pick it up
        from bebop_megatron.data import CharTokenizer

        hc["eos_token_id"] = CharTokenizer.eos_id
        hc["bebop_tokenizer"] = "char"
    (out_tmp / "config.json").write_text(json.dumps(hc, indent=2))
    return {"tensors": len(index), "files": total}


def megatron_to_hf(ckpt_dir: str | Path, output: str | Path, shard_bytes: int = 2 << 30, dtype: str = "float32",
                   overwrite: bool = False) -> dict:
    from bebop_megatron.checkpointing import latest_checkpoint
    from bebop_megatron.parallel import run_local_workers

    ckpt = latest_checkpoint(ckpt_dir)
    if ckpt is None:
        raise ConversionError(f"{ckpt_dir} holds no megatron dist checkpoint")
    out, tmp = _prepare_output(output, overwrite)
    try:
        res = run_local_workers(_megatron_to_hf_worker, 1, str(ckpt), str(tmp), shard_bytes, dtype)[0]
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    src_tok = Path(ckpt_dir) if (Path(ckpt_dir) / "tokenizer.json").exists() else None
    if src_tok:
        _copy_tokenizer(src_tok, tmp)
    _publish(tmp, out)
    return {"output": str(out), "checkpoint": str(ckpt), **res}


# ------------------------------------------------------------------------ outputs


def _prepare_output(output: str | Path, overwrite: bool) -> tuple[Path, Path]:
    out = Path(output)
    if out.exists() and not overwrite:
        raise ConversionError(f"{out} exists; pass --overwrite to replace it")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return out, tmp


def _publish(tmp: Path, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                 "generation_config.json"):
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)
