#!/usr/bin/env python
"""Rollout speed, measured side by side in one run on the same model and prompts.

Rows: the embedded engine without speculation, with MTP drafts + rejection sampling, with MTP
drafts + target-only verification; Hugging Face ``generate`` plain, and assisted (self-speculative
early exit, and prompt lookup). Prints tokens/s as ratios to the plain engine, and the measured
tokens per verify step next to the bound (1 - α^{γ+1}) / (1 - α) from the measured per-depth α.

    python tools/bench_rollout.py                         # the `make run` model (exported to HF first)
    python tools/bench_rollout.py --model-path HF_DIR --batch 1 8 --max-new-tokens 64 --temperature 1.0
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from bebop_megatron.data import CharTokenizer, synthetic_problem
from bebop_megatron.rollout.engine import Engine, SamplingParams, SpecConfig
from bebop_megatron.rollout.modeling import CausalLMWithMTP
from bebop_megatron.rollout.sampling import expected_tokens_per_step

DEFAULT_RUN = Path("outputs/train_mtp_tiny")


def default_model() -> Path:
    hf = DEFAULT_RUN / "hf"
    if not (hf / "config.json").exists():
        if not (DEFAULT_RUN / "mtp" / "checkpoints").exists():
            sys.exit("no model: run `make run` first, or pass --model-path")
        from bebop_megatron.convert.hf_megatron import megatron_to_hf

        megatron_to_hf(DEFAULT_RUN / "mtp", hf)
    return hf


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng, tok = random.Random(seed), CharTokenizer()
    return [tok.encode(synthetic_problem(rng)[0]) for _ in range(n)]


def run_engine(model, spec: SpecConfig, ps, batch, new_tokens, temperature) -> dict:
    eng = Engine(model, CharTokenizer(), spec, max_running=batch, max_len=512)
    sp = [SamplingParams(max_new_tokens=new_tokens, temperature=temperature, ignore_eos=True, seed=i)
          for i in range(len(ps))]
    eng.generate(ps[:batch], sp[:batch])  # warm-up
    eng = Engine(model, CharTokenizer(), spec, max_running=batch, max_len=512)
    t0 = time.perf_counter()
    reqs = eng.generate(ps, sp)
    dt = time.perf_counter() - t0
    toks = sum(len(r.output_ids) for r in reqs)
    out = {"tokens": toks, "seconds": dt, "tok_s": toks / dt}
    if eng.gamma:
        verify = sum(r.verify_ct for r in reqs)
        per_depth = [sum(r.accepted_per_depth[k] for r in reqs) for k in range(eng.gamma)]
        # conditional acceptance per depth: P(accept k | accepted k-1)
        prev = [verify] + per_depth[:-1]
        alphas = [a / p for a, p in zip(per_depth, prev) if p]
        alpha = sum(alphas) / len(alphas) if alphas else 0.0
        out.update(tokens_per_verify=toks / verify, alpha=alpha, alpha_per_depth=alphas,
                   bound=expected_tokens_per_step(alpha, eng.gamma))
    return out


def run_hf(path, ps, new_tokens, temperature, **gen_kw) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the MTP tensors are "unexpected" to transformers: expected
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=temperature > 0, pad_token_id=0)
    if temperature > 0:
        kw["temperature"] = temperature
    with torch.no_grad():
        model.generate(torch.tensor([ps[0]]), **kw, **gen_kw)  # warm-up
        t0 = time.perf_counter()
        toks = 0
        for p in ps:  # assisted generation is batch-size 1 in transformers
            out = model.generate(torch.tensor([p]), **kw, **gen_kw)
            toks += out.shape[1] - len(p)
        dt = time.perf_counter() - t0
    return {"tokens": toks, "seconds": dt, "tok_s": toks / dt}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--gamma", type=int, default=None, help="drafts per step (default: the model's MTP depth)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    path = Path(args.model_path) if args.model_path else default_model()
    model = CausalLMWithMTP.from_pretrained(path)
    gamma = args.gamma or max(len(model.mtp), 1)
    ps = prompts(args.num_prompts)
    rows = []
    for b in args.batch:
        for name, spec in [("engine, no speculation", SpecConfig("none")),
                           ("engine, MTP + rejection sampling", SpecConfig("mtp", gamma, "rejection")),
                           ("engine, MTP + target-only", SpecConfig("mtp", gamma, "target_only"))]:
            if spec.algorithm == "mtp" and not model.has_mtp:
                continue
            r = run_engine(model, spec, ps, b, args.max_new_tokens, args.temperature)
            rows.append({"name": name, "batch": b, **r})
    if not args.skip_hf:
        n_layers = model.config.num_hidden_layers
        for name, kw in [("HF generate", {}),
                         (f"HF assisted (early exit at layer {max(1, n_layers // 2)})",
                          {"assistant_early_exit": max(1, n_layers // 2)}),
                         ("HF assisted (prompt lookup)", {"prompt_lookup_num_tokens": gamma})]:
            try:
                r = run_hf(path, ps, args.max_new_tokens, args.temperature, **kw)
            except Exception as e:  # report, don't hide: some modes need features a model may lack
                print(f"{name}: skipped ({type(e).__name__}: {e})", file=sys.stderr)
                continue
            rows.append({"name": name, "batch": 1, **r})
    base = {r["batch"]: r["tok_s"] for r in rows if r["name"] == "engine, no speculation"}
    b1 = base.get(1, next(iter(base.values())))
    print(f"\nmodel: {path}  γ={gamma}  prompts={len(ps)}  new tokens={args.max_new_tokens}  "
          f"temperature={args.temperature}  threads={torch.get_num_threads()}")
    print(f"{'configuration':44s} {'batch':>5s} {'tok/s':>9s} {'vs plain':>9s} {'tok/verify':>10s} "
          f"{'bound':>7s} {'alpha':>6s}")
    for r in rows:
        ref = base.get(r["batch"], b1)
        extra = (f"{r['tokens_per_verify']:10.3f} {r['bound']:7.3f} {r['alpha']:6.3f}"
                 if "tokens_per_verify" in r else f"{'':10s} {'':7s} {'':6s}")
        print(f"{r['name']:44s} {r['batch']:5d} {r['tok_s']:9.1f} {r['tok_s'] / ref:8.2f}x {extra}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
