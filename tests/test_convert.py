"""`bebop convert`: HF -> Megatron -> HF is bit-exact, Megatron logits equal transformers at TP=1
and TP=2, TP/PP layouts reshard, the engine loads the export, and bad input fails cleanly."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bebop_megatron.convert.hf_megatron import hf_to_megatron, megatron_to_hf
from bebop_megatron.convert.layout import ConversionError
from bebop_megatron.rollout.modeling import CausalLMWithMTP, make_batch_index
from tests.distributed import run_distributed
from tests.tiny_models import make_hf_checkpoint

ROOT = Path(__file__).resolve().parents[1]
IDS = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(3))


def hf_tensors(path):
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    d = tmp_path_factory.mktemp("q3")
    model = make_hf_checkpoint(d / "hf", "qwen3", "deepseek", num_mtp=2, tie=False)
    with torch.no_grad():
        ref = model(IDS).logits
    return d, ref


def _megatron_logits(rank, world, ckpt_root, tp):
    from megatron.core import parallel_state

    from bebop_megatron.checkpointing import checkpoint_config, latest_checkpoint, load_checkpoint
    from bebop_megatron.config import Config
    from bebop_megatron.model import build_model
    from bebop_megatron.parallel import initialize_distributed

    ckpt = latest_checkpoint(ckpt_root)
    cfg = Config.from_dict(checkpoint_config(ckpt))
    cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size = tp, 1
    platform = initialize_distributed(tp, 1, seed=77)
    model = build_model(cfg, platform)
    load_checkpoint(ckpt, model)
    model.eval()
    with torch.no_grad():
        local = model(IDS, torch.arange(IDS.shape[1]).expand_as(IDS), None)
    parts = [torch.empty_like(local) for _ in range(tp)]
    torch.distributed.all_gather(parts, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, -1)[..., : cfg.model.vocab_size]


@pytest.mark.parametrize("convert_tp,convert_pp,load_tp", [(1, 1, 1), (1, 1, 2), (2, 1, 1), (1, 2, 1)])
def test_megatron_logits_equal_transformers_across_layouts(qwen3, convert_tp, convert_pp, load_tp):
    d, ref = qwen3
    out = d / f"mc_{convert_tp}_{convert_pp}"
    if not out.exists():
        res = hf_to_megatron(d / "hf", out, tp=convert_tp, pp=convert_pp)
        assert not res["fresh_mtp_layers"] and res["mtp_layers"] == 2
    logits = run_distributed(_megatron_logits, load_tp, str(out), load_tp)[0]
    assert (logits - ref).abs().max() < 1e-4


@pytest.mark.parametrize("arch,layout,tie,tp", [("qwen3", "deepseek", False, 2), ("qwen2", "qwen3_next", True, 1)])
def test_round_trip_is_bit_exact_and_engine_matches_transformers(tmp_path, arch, layout, tie, tp):
    make_hf_checkpoint(tmp_path / "hf", arch, layout, num_mtp=2, tie=tie)
    hf_to_megatron(tmp_path / "hf", tmp_path / "mc", tp=tp)
    res = megatron_to_hf(tmp_path / "mc", tmp_path / "back")
    src, back = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "back")
    # the Qwen3-Next layout's one module becomes recurrent MTP (one megatron layer, not copies)
    # and exports back under its own names
    assert res["tensors"] == len(back)
    assert set(back) == set(src) - ({"lm_head.weight"} if tie else set())
    for n, t in src.items():
        if tie and n == "lm_head.weight":
            continue
        assert torch.equal(back[n], t), n
    if layout == "qwen3_next":
        cfg = json.loads((tmp_path / "back" / "config.json").read_text())
        assert cfg["mtp_num_hidden_layers"] == 1 and "num_nextn_predict_layers" not in cfg
    # the exported folder loads in transformers and in the engine with identical logits
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    ours = CausalLMWithMTP.from_pretrained(tmp_path / "back")
    assert len(ours.mtp) == (2 if layout == "deepseek" else 1)
    with torch.no_grad():
        ref = hf(IDS).logits
        normed, _ = ours.trunk(IDS, ours.new_cache(2, 16, "trunk"), make_batch_index([0, 1], [0, 0], [13, 13], "cpu"))
    assert (ours.logits(normed) - ref).abs().max() < 1e-4


def test_model_without_mtp_gets_fresh_layers_and_says_so(tmp_path):
    make_hf_checkpoint(tmp_path / "hf", "qwen3", num_mtp=0)
    proc = subprocess.run([sys.executable, "-m", "bebop_megatron.cli", "convert", "hf-to-megatron", "--input",
                           str(tmp_path / "hf"), "--output", str(tmp_path / "mc"), "--mtp-layers", "3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "freshly initialised" in proc.stdout and "γ=3" in proc.stdout


def _break(path, how):
    files = sorted(Path(path).glob("model*.safetensors"))
    t = load_file(str(files[0]))
    if how == "missing":
        t.pop("model.layers.1.mlp.up_proj.weight")
    elif how == "unexpected":
        t["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    elif how == "shape":
        t["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(48, 40)
    save_file(t, str(files[0]))


@pytest.mark.parametrize("how,needle", [
    ("missing", "model.layers.1.mlp.up_proj.weight"),
    ("unexpected", "model.layers.0.mlp.extra.weight"),
    ("shape", "self_attention.linear_proj"),
    ("arch", "unsupported architecture"),
    ("tp", "not divisible by TP 3"),
])
def test_bad_input_names_the_problem_and_writes_nothing(tmp_path, how, needle):
    make_hf_checkpoint(tmp_path / "hf", "qwen3", "deepseek", num_mtp=1)
    tp = 3 if how == "tp" else 1
    if how == "arch":
        cfgp = tmp_path / "hf" / "config.json"
        cfg = json.loads(cfgp.read_text())
        cfg.update(model_type="llama", architectures=["LlamaForCausalLM"])
        cfgp.write_text(json.dumps(cfg))
    elif how != "tp":
        _break(tmp_path / "hf", how)
    with pytest.raises(ConversionError, match=needle):
        hf_to_megatron(tmp_path / "hf", tmp_path / "out", tp=tp)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_cli_refuses_to_overwrite(tmp_path):
    make_hf_checkpoint(tmp_path / "hf", "qwen3", num_mtp=1)
    (tmp_path / "out").mkdir()
    proc = subprocess.run([sys.executable, "-m", "bebop_megatron.cli", "convert", "hf-to-megatron", "--input",
                           str(tmp_path / "hf"), "--output", str(tmp_path / "out")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--overwrite" in proc.stderr and "Traceback" not in proc.stderr


def _buckets_worker(rank, world, ckpt_root, bucket_bytes):
    from bebop_megatron.checkpointing import checkpoint_config, latest_checkpoint, load_checkpoint
    from bebop_megatron.config import Config
    from bebop_megatron.convert.hf_megatron import iter_hf_buckets
    from bebop_megatron.convert.layout import Shapes
    from bebop_megatron.model import build_model
    from bebop_megatron.parallel import initialize_distributed

    ckpt = latest_checkpoint(ckpt_root)
    cfg = Config.from_dict(checkpoint_config(ckpt))
    cfg.parallel.tensor_model_parallel_size = 2
    model = build_model(cfg, initialize_distributed(2, 1, seed=5))
    load_checkpoint(ckpt, model)
    buckets = list(iter_hf_buckets(model, Shapes.from_config(cfg, 2), bucket_bytes))
    return buckets


def test_live_tp2_model_streams_exact_hf_buckets(qwen3):
    """Rollout weight sync path: a TP=2 model yields the original HF tensors in bounded buckets."""
    d, _ = qwen3
    out = d / "mc_1_1"
    if not out.exists():
        hf_to_megatron(d / "hf", out, tp=1)
    limit = 40_000
    buckets = run_distributed(_buckets_worker, 2, str(out), limit)[0]
    src = hf_tensors(d / "hf")
    got = {}
    for b in buckets:
        size = sum(t.numel() * t.element_size() for t in b.values())
        assert size <= limit or len(b) == 1
        got.update(b)
    assert set(got) == set(src)
    assert all(torch.equal(got[n], src[n]) for n in src)
    assert len(buckets) > 3


def test_dense_qwen3_recurrent_mtp_exports_one_module_the_engine_drafts_gamma_from(tmp_path):
    """configs/bench_deep.yaml's shape in miniature: a dense qwen3 trunk (tied embeddings) with ONE
    recurrent MTP layer for γ = 3 steps exports as one ``mtp.*`` module; the engine loads it and
    drafts 3 tokens per round from it (every depth reached), greedy equal to plain decoding."""
    from bebop_megatron.rollout.engine import Engine, SamplingParams, SpecConfig

    make_hf_checkpoint(tmp_path / "hf", "qwen3", "qwen3_next", num_mtp=1, tie=True, scale=2.0)
    res = hf_to_megatron(tmp_path / "hf", tmp_path / "mc", tp=1, mtp_layers=3)
    assert res["mtp_recurrent"] and res["mtp_layers"] == 3
    megatron_to_hf(tmp_path / "mc", tmp_path / "back")
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["mtp_num_hidden_layers"] == 1 and cfg["bebop_mtp_draft_steps"] == 3
    model = CausalLMWithMTP.from_pretrained(tmp_path / "back", dtype=torch.float64)
    assert len(model.mtp) == 1 and model.config.mtp_layout == "qwen3_next"
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    eng = Engine(model, spec=SpecConfig("mtp", cfg["bebop_mtp_draft_steps"]), max_running=2, max_len=64)
    assert eng.gamma == 3
    sampled = eng.generate(prompts, SamplingParams(max_new_tokens=24, temperature=1.0, seed=0))
    assert all(len(r.output_ids) == 24 for r in sampled) and all(n > 0 for n in eng.stats()["spec_reached_per_depth"])
    sp = SamplingParams(max_new_tokens=16, temperature=0.0)
    plain = Engine(model, spec=SpecConfig("none"), max_running=2, max_len=64).generate(prompts, sp)
    spec = Engine(model, spec=SpecConfig("mtp", 3), max_running=2, max_len=64).generate(prompts, sp)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
