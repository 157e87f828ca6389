#!/usr/bin/env python
"""Peak memory of `bebop convert hf-to-megatron` on a random ~0.5B-parameter Qwen3 (bf16).

Writes the random HF checkpoint one layer per safetensors shard (so creating it stays small),
runs the conversion as a subprocess and samples the RSS of the whole process tree.

    python tools/convert_memory_report.py [--layers 24] [--workdir /tmp/bebop_mem]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import torch
from safetensors.torch import save_file


def make_model(d: Path, layers: int, hidden=1024, heads=16, kv=8, hd=128, ffn=3072, vocab=151936) -> int:
    d.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16)
    n = 0

    def put(name_tensors, fname):
        nonlocal n
        n += sum(t.numel() for t in name_tensors.values())
        save_file(name_tensors, str(d / fname))

    put({"model.embed_tokens.weight": rnd(vocab, hidden), "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)},
        "model-embed.safetensors")
    for i in range(layers + 1):  # the last one is the MTP module (DeepSeek-V3 layout)
        p = f"model.layers.{i}."
        t = {p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
             p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
             p + "self_attn.q_proj.weight": rnd(heads * hd, hidden), p + "self_attn.k_proj.weight": rnd(kv * hd, hidden),
             p + "self_attn.v_proj.weight": rnd(kv * hd, hidden), p + "self_attn.o_proj.weight": rnd(hidden, heads * hd),
             p + "self_attn.q_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
             p + "self_attn.k_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
             p + "mlp.gate_proj.weight": rnd(ffn, hidden), p + "mlp.up_proj.weight": rnd(ffn, hidden),
             p + "mlp.down_proj.weight": rnd(hidden, ffn)}
        if i == layers:
            t.update({p + "enorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                      p + "hnorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                      p + "eh_proj.weight": rnd(hidden, 2 * hidden),
                      p + "shared_head.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)})
        put(t, f"model-layer{i:03d}.safetensors")
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab, "hidden_size": hidden,
           "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv, "head_dim": hd, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
           "rope_theta": 1000000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
           "num_nextn_predict_layers": 1}
    (d / "config.json").write_text(json.dumps(cfg))
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--workdir", default="/tmp/bebop_convert_mem")
    args = ap.parse_args(argv)
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    n = make_model(work / "hf", args.layers)
    layer_bytes = max(f.stat().st_size for f in (work / "hf").glob("model-layer*.safetensors"))
    embed_bytes = (work / "hf" / "model-embed.safetensors").stat().st_size
    proc = subprocess.Popen([sys.executable, "-m", "bebop_megatron.cli", "convert", "hf-to-megatron", "--input",
                             str(work / "hf"), "--output", str(work / "mc")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    peak = {"tree": 0, "worker": 0}

    def sample():
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                procs = [root] + root.children(recursive=True)
                rss = {p.pid: p.memory_info().rss for p in procs}
                peak["tree"] = max(peak["tree"], sum(rss.values()))
                peak["worker"] = max(peak["worker"], max(rss.values()))
            except psutil.Error:
                pass
            time.sleep(0.05)

    t = threading.Thread(target=sample)
    t0 = time.time()
    t.start()
    out = proc.communicate()[0].decode()
    t.join()
    if proc.returncode:
        print(out[-3000:])
        return 1
    model_bytes = sum(f.stat().st_size for f in (work / "hf").glob("*.safetensors"))
    gib = 1 << 30
    print(f"random Qwen3: {n / 1e9:.3f}B parameters, {model_bytes / gib:.2f} GiB of bf16 safetensors "
          f"(largest shard: embeddings {embed_bytes / gib:.2f} GiB, one layer {layer_bytes / gib:.3f} GiB)")
    print(f"conversion took {time.time() - t0:.1f}s; peak RSS: worker {peak['worker'] / gib:.2f} GiB, "
          f"whole process tree {peak['tree'] / gib:.2f} GiB")
    print(f"peak worker RSS / model size: {peak['worker'] / model_bytes:.2f}x: the worker holds its model shard "
          f"(the whole model at TP=1) plus the Python/torch/megatron baseline (~0.35 GiB) and the tensors in "
          f"flight; the tree sum also counts the parent and the checkpoint writer's forked processes, whose "
          f"shared pages RSS counts once per process")
    return 0


if __name__ == "__main__":
    sys.exit(main())
