#!/usr/bin/env python
"""Rollout speed, measured honestly: variants interleaved in one process on the same model and prompts.

Variants (``--variants``): ``plain`` (engine, no speculation), ``mtp_rejection`` (MTP drafts +
rejection sampling, fixed γ), ``mtp_target_only`` (MTP drafts + target-only verification),
``adaptive`` (MTP + rejection sampling, γ chosen per round from measured cost and acceptance),
``hf_generate`` (Hugging Face ``generate``, batched with left padding) and ``hf_assisted`` (HF
assisted generation, self-speculative early exit; batch 1 in transformers, so run per prompt).

For every batch size, each repetition runs every variant once, in turn (interleaved: a slow
patch of a shared CPU hits all variants alike), in an order shuffled per repetition (seeded). In a
fixed order a variant always runs right after the same one. In one comparison, an engine that decoded
every round plainly measured 2-5% slower than the plain engine when it always followed MTP+RS, and
not otherwise; that is within the noise, but a fixed order would make it systematic. A variant's
repetition generates the batch as many times back to back as plain decoding needs for
``--min-rep-seconds`` (one batch of the tiny model lasts ~0.1 s, too short to time on a shared
machine: single batches scattered ±10%); the figures are medians over ``--reps`` (≥5) repetitions,
in wall time and in CPU time (``time.process_time``). Engines are built and warmed up once per
(variant, batch) and reused across repetitions, as a server would (the adaptive engine keeps what it
measured). Torch runs with ``--threads`` threads (default 1).

Prints tokens/s and the ratio to ``plain`` at the same batch (of the medians, in wall and in CPU
time, and "paired": the median over repetitions of each repetition's ratio to the plain run beside
it, which a slow patch spanning one round of the interleaving moves less), tokens per verify step (tokens
emitted by verify steps / verify steps) next to the bound (1 - α^{γ+1}) / (1 - α) from the
measured per-draft acceptance α (accepted / reached drafts, pooled over depths; for adaptive γ the
mean of each γ's bound weighted by rounds, while tokens per verify is per request-step: the two differ
where the γ mix changes with the batch size), and writes
``--json PATH``: one record per (variant, batch) with ``variant``, ``batch``, ``tokens_per_s``,
``speedup_vs_plain``, ``tokens_per_verify``, ``accept_rate`` (and more).

    python tools/bench_rollout.py                          # the `make run` model (exported to HF first)
    python tools/bench_rollout.py --model-path HF_DIR --batch 1 4 --reps 5 --json out.json

A reduced-vocabulary draft head (FR-Spec; SGLang's ``--speculative-token-map``):
``--draft-vocab N`` adds, for every MTP variant, a twin ``<variant>+dvN`` whose draft proposes only
the N most frequent token ids of the synthetic prompts + answers (drawn with another seed than the
benchmark prompts); ``--draft-vocab PATH`` takes the ids from a .pt / .json token map instead.

A realistic trunk/draft cost ratio (16 trunk layers, ONE recurrent MTP layer for γ = 3):

    bebop train-mtp --config configs/bench_deep.yaml      # -> outputs/train_mtp_deep (a few minutes, 2 CPUs)
    python tools/bench_rollout.py --run-dir outputs/train_mtp_deep --batch 1 4 16
    # --run-dir DIR exports DIR/mtp to DIR/hf on first use (as the default model), then loads DIR/hf;
    # equivalently: bebop convert megatron-to-hf --input DIR/mtp --output DIR/hf, then --model-path DIR/hf
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from bebop_megatron.data import CharTokenizer, synthetic_problem
from bebop_megatron.rollout.engine import Engine, SamplingParams, SpecConfig
from bebop_megatron.rollout.modeling import CausalLMWithMTP
from bebop_megatron.rollout.sampling import expected_tokens_per_step

DEFAULT_RUN = Path("outputs/train_mtp_tiny")
VARIANTS = ("plain", "mtp_rejection", "mtp_target_only", "adaptive", "hf_generate", "hf_assisted")


def default_model(run_dir: Path = DEFAULT_RUN) -> Path:
    """``run_dir/hf``, exported from the `bebop train-mtp` run's ``run_dir/mtp`` on first use."""
    run_dir = Path(run_dir)
    hf = run_dir / "hf"
    if not (hf / "config.json").exists():
        if not (run_dir / "mtp" / "checkpoints").exists():
            hint = "run `make run` first" if run_dir == DEFAULT_RUN else f"train it: bebop train-mtp (output_dir {run_dir})"
            sys.exit(f"no model in {run_dir}: {hint}, or pass --model-path")
        from bebop_megatron.convert.hf_megatron import megatron_to_hf

        megatron_to_hf(run_dir / "mtp", hf, overwrite=True)
    return hf


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng, tok = random.Random(seed), CharTokenizer()
    return [tok.encode(synthetic_problem(rng)[0]) for _ in range(n)]


def frequent_token_ids(n: int, samples: int = 2000, seed: int = 12345) -> list[int]:
    """The n most frequent ids of synthetic prompts + answers (+ eos), ties by lower id."""
    from collections import Counter

    rng, tok = random.Random(seed), CharTokenizer()
    cnt = Counter()
    for _ in range(samples):
        prompt, answer = synthetic_problem(rng)
        cnt.update(tok.encode(prompt + answer) + [tok.eos_id])
    return sorted(sorted(cnt, key=lambda t: (-cnt[t], t))[:n])


class EngineVariant:
    def __init__(self, model, spec: SpecConfig, batch: int, new_tokens: int, temperature: float, max_len: int):
        self.eng = Engine(model, CharTokenizer(), spec, max_running=batch, max_len=max_len)
        self.new_tokens, self.temperature = new_tokens, temperature
        self.rep = 0

    def run(self, ps, batches: int = 1) -> dict:
        """``batches`` generate calls of the prompts back to back (fresh seeds each), timed as one."""
        self.eng.reset_stats()
        tokens, wall, cpu = 0, 0.0, 0.0
        for _ in range(batches):
            self.rep += 1
            sp = [SamplingParams(max_new_tokens=self.new_tokens, temperature=self.temperature, ignore_eos=True,
                                 seed=1000 * self.rep + i) for i in range(len(ps))]
            w0, c0 = time.perf_counter(), time.process_time()
            reqs = self.eng.generate(ps, sp)
            wall, cpu = wall + time.perf_counter() - w0, cpu + time.process_time() - c0
            tokens += sum(len(r.output_ids) for r in reqs)
        st = self.eng.stats()
        out = {"tokens": tokens, "wall_s": wall, "cpu_s": cpu}
        if self.eng.gamma:
            reach, acc = sum(st["spec_reached_per_depth"]), sum(st["spec_accepted_per_depth"])
            out.update(verify_ct=st["spec_verify_ct"], verify_tokens=self.eng.total_verify_tokens,
                       accepted=st["spec_accepted_drafts"], proposed=st["spec_proposed_drafts"],
                       reached=reach, accepted_depth=acc, per_depth_acc=st["spec_accepted_per_depth"],
                       per_depth_reach=st["spec_reached_per_depth"], gamma_hist=st["spec_gamma_hist"])
        return out


class HFVariant:
    def __init__(self, path, new_tokens: int, temperature: float, assisted: bool, batch: int, device: str = "cpu"):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # the MTP tensors are "unexpected" to transformers: expected
        self.model = AutoModelForCausalLM.from_pretrained(str(path)).to(device).eval()
        self.device = device
        self.kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=temperature > 0, pad_token_id=0)
        if temperature > 0:
            self.kw["temperature"] = temperature
        self.assisted = assisted
        if assisted:
            n_layers = self.model.config.num_hidden_layers
            self.kw["assistant_early_exit"] = max(1, n_layers // 2)

    def run(self, ps, batches: int = 1) -> dict:
        w0, c0 = time.perf_counter(), time.process_time()
        toks = 0
        with torch.no_grad():
            for _ in range(batches):
                if self.assisted:  # assisted generation is batch-size 1 in transformers
                    for p in ps:
                        out = self.model.generate(torch.tensor([p], device=self.device), **self.kw)
                        toks += out.shape[1] - len(p)
                else:
                    n = max(len(p) for p in ps)
                    ids = torch.tensor([[0] * (n - len(p)) + p for p in ps])
                    mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in ps])
                    out = self.model.generate(ids.to(self.device), attention_mask=mask.to(self.device), **self.kw)
                    toks += (out.shape[1] - n) * len(ps)
        return {"tokens": toks, "wall_s": time.perf_counter() - w0, "cpu_s": time.process_time() - c0}


def summarise(variant: str, batch: int, runs: list[dict], gamma: int) -> dict:
    med = lambda k: statistics.median(r[k] for r in runs)
    tokens = runs[0]["tokens"]
    rec = {"variant": variant, "batch": batch, "reps": len(runs), "tokens": tokens,
           "wall_s": med("wall_s"), "cpu_s": med("cpu_s"),
           "tokens_per_s": statistics.median(r["tokens"] / r["wall_s"] for r in runs),
           "tokens_per_cpu_s": statistics.median(r["tokens"] / r["cpu_s"] for r in runs),
           "tokens_per_verify": None, "accept_rate": None, "alpha": None, "bound": None}
    if "verify_ct" in runs[0]:
        tot = lambda k: sum(r[k] for r in runs)
        ver = tot("verify_ct")
        alpha = tot("accepted_depth") / tot("reached") if tot("reached") else 0.0
        hist = [sum(r["gamma_hist"][g] for r in runs) for g in range(gamma + 1)]
        spec_rounds = sum(hist[1:])
        mean_gamma = sum(g * h for g, h in enumerate(hist)) / max(sum(hist), 1)
        # the bound of a mix of γ (adaptive): the rounds' mean of each γ's bound (rounds, not row-steps:
        # the γ histogram counts rounds); a fixed γ gets its own bound
        bound = (sum(h * expected_tokens_per_step(alpha, g) for g, h in enumerate(hist) if g) / spec_rounds
                 if spec_rounds else expected_tokens_per_step(alpha, gamma))
        per_acc = [sum(r["per_depth_acc"][k] for r in runs) for k in range(gamma)]
        per_reach = [sum(r["per_depth_reach"][k] for r in runs) for k in range(gamma)]
        rec.update(tokens_per_verify=tot("verify_tokens") / ver if ver else None,
                   accept_rate=tot("accepted") / tot("proposed") if tot("proposed") else 0.0,
                   alpha=alpha, alpha_per_depth=[a / n if n else None for a, n in zip(per_acc, per_reach)],
                   bound=bound, gamma_hist=hist, mean_gamma=mean_gamma)
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="an HF folder (with MTP weights)")
    ap.add_argument("--run-dir", default=None,
                    help="a `bebop train-mtp` output_dir (e.g. outputs/train_mtp_deep): its mtp/ checkpoint is "
                         "exported to DIR/hf on first use")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--min-rep-seconds", type=float, default=1.0,
                    help="each repetition runs the batch back to back as many times as plain decoding (else the "
                         "first variant) needs for this long (one batch of a small model lasts ~0.1 s: too short to time on a "
                         "shared machine); every variant runs the same number")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="where the model and the engine run (cpu, cuda, cuda:1)")
    ap.add_argument("--gamma", type=int, default=None, help="drafts per step (default: the model's MTP depth)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--skip-hf", action="store_true", help="drop the hf_* variants")
    ap.add_argument("--draft-vocab", default=None, metavar="N|PATH",
                    help="also run every MTP variant with a reduced-vocabulary draft: the N most frequent ids of "
                         "the synthetic data, or a .pt/.json token map")
    ap.add_argument("--json", default=None, help="also write the records here")
    args = ap.parse_args(argv)
    if args.max_new_tokens < 48 or args.reps < 5:
        print("note: the honest setting is --max-new-tokens >= 48 and --reps >= 5", file=sys.stderr)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.model_path and args.run_dir:
        ap.error("--model-path and --run-dir are exclusive")
    path = Path(args.model_path) if args.model_path else default_model(Path(args.run_dir or DEFAULT_RUN))
    model = CausalLMWithMTP.from_pretrained(path).to(args.device)
    gamma = args.gamma or max(int(json.loads((path / "config.json").read_text()).get("bebop_mtp_draft_steps", 0)
                                  or len(model.mtp)), 1)
    variants = [v for v in args.variants if not (args.skip_hf and v.startswith("hf_"))]
    if not model.has_mtp:
        variants = [v for v in variants if v in ("plain", "hf_generate", "hf_assisted")]
    specs = {"plain": SpecConfig("none"), "mtp_rejection": SpecConfig("mtp", gamma, "rejection"),
             "mtp_target_only": SpecConfig("mtp", gamma, "target_only"),
             "adaptive": SpecConfig("mtp", gamma, "rejection", adaptive=True)}
    if args.draft_vocab and model.has_mtp:
        from dataclasses import replace

        dv = args.draft_vocab
        token_map = frequent_token_ids(int(dv)) if dv.isdigit() else dv
        tag = f"+dv{dv}" if dv.isdigit() else "+dvmap"
        for v in [v for v in variants if v in specs and v != "plain"]:
            specs[v + tag] = replace(specs[v], draft_vocab=token_map)
            variants.insert(variants.index(v) + 1, v + tag)
    records = []
    for b in args.batch:
        ps = prompts(b, seed=b)
        max_len = max(len(p) for p in ps) + args.max_new_tokens + gamma + 8
        runners = {}
        for v in variants:
            try:
                if v in specs:
                    runners[v] = EngineVariant(model, specs[v], b, args.max_new_tokens, args.temperature, max_len)
                else:
                    runners[v] = HFVariant(path, args.max_new_tokens, args.temperature, v == "hf_assisted", b,
                                           args.device)
                runners[v].run(ps)  # warm-up (and, for adaptive, its first cost measurements)
                if v == "adaptive":
                    runners[v].run(ps)
            except Exception as e:  # report, don't hide: some modes need features a model may lack
                print(f"{v} (batch {b}): skipped ({type(e).__name__}: {e})", file=sys.stderr)
                runners.pop(v, None)
        # repetition length from plain decoding (or the first variant) timed twice; its seeds are reused
        ref = runners.get("plain") or next(iter(runners.values()), None)
        one, batches = 0.0, 1
        if ref is not None:
            rep0 = getattr(ref, "rep", None)
            one = min(ref.run(ps)["wall_s"] for _ in range(2))
            if rep0 is not None:
                ref.rep = rep0  # the timed repetitions stay seed-paired with the other variants
            batches = max(1, math.ceil(args.min_rep_seconds / one))
        runs = {v: [] for v in runners}
        order = list(runners)
        for rep in range(args.reps):
            random.Random(1000 * b + rep).shuffle(order)  # interleaved, no variant always after the same one
            for v in order:
                runs[v].append(runners[v].run(ps, batches))
        recs = {v: summarise(v, b, runs[v], gamma) for v in runners}
        for rec in recs.values():
            rec["batches_per_rep"] = batches
        for v, rec in recs.items():  # draft token-map size (None: the full vocabulary)
            ids = getattr(getattr(runners[v], "eng", None), "draft_ids", None)
            rec["draft_vocab"] = int(ids.numel()) if ids is not None else None
        base = recs.get("plain")
        for v, rec in recs.items():
            rec["speedup_vs_plain"] = rec["tokens_per_s"] / base["tokens_per_s"] if base else None
            rec["speedup_vs_plain_cpu"] = rec["tokens_per_cpu_s"] / base["tokens_per_cpu_s"] if base else None
            # the same ratio per repetition (each variant's run next to plain's in the same round of the
            # interleaving), then the median: a slow patch of the machine that spans one round moves both
            rec["speedup_vs_plain_paired"] = statistics.median(
                (r["tokens"] / r["wall_s"]) / (b["tokens"] / b["wall_s"]) for r, b in zip(runs[v], runs["plain"])
            ) if base else None
            rec["wall_s_reps"] = [r["wall_s"] for r in runs[v]]
        records.extend(recs.values())
        _print(records[-len(recs):], path, gamma, args)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=2))
    return 0


def _print(rows, path, gamma, args) -> None:
    print(f"\nmodel: {path}  γ≤{gamma}  batch={rows[0]['batch']}  new tokens={args.max_new_tokens}  "
          f"T={args.temperature}  device={args.device}  threads={torch.get_num_threads()}  median of {args.reps} interleaved reps of {rows[0]['batches_per_rep']} batches")
    print(f"{'variant':20s} {'tok/s':>8s} {'vs plain':>8s} {'cpu vs':>7s} {'paired':>7s} {'tok/verify':>10s} {'bound':>6s} "
          f"{'alpha':>6s} {'acc rate':>8s} {'mean γ':>6s}")
    f = lambda x, w, p=3: f"{x:{w}.{p}f}" if isinstance(x, (int, float)) else " " * w
    for r in rows:
        print(f"{r['variant']:20s} {r['tokens_per_s']:8.1f} {f(r['speedup_vs_plain'], 7, 2)}x "
              f"{f(r['speedup_vs_plain_cpu'], 6, 2)}x {f(r.get('speedup_vs_plain_paired'), 6, 2)}x "
              f"{f(r['tokens_per_verify'], 10)} {f(r['bound'], 6)} "
              f"{f(r['alpha'], 6)} {f(r['accept_rate'], 8)} {f(r.get('mean_gamma'), 6, 2)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
