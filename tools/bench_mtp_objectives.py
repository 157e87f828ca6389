"""Objectives benchmark (issue #11): which MTP training objective gives the most acceptable drafts?

From ONE trunk checkpoint, MTP heads are trained with each objective (ce, kl, tv, e2e_tv) and with
the recommended recipe (``mtp.warmup_loss`` for ``mtp.warmup_steps``, then ``mtp.loss``), all at
the same total step budget, over several seeds. Each set of heads is then evaluated on held-out
data of two distributions:

* ``sft``: the SFT mixture (documents of solved problems), teacher-forced; the engine continues
  the documents (no stop), which includes the high-entropy "invent the next problem" positions;
* ``rl``:  the RL task prompts (``rl.task``); teacher-forced on the frozen trunk's own sampled
  answers (T = 1, up to the stop: what rollouts verify), and the engine answers the prompts and
  stops at ``rl.stop``, as RL rollouts do.

Measured per (objective, seed, distribution, temperature):
* per-depth α_k = Σ_v min(p_k, q_k) exactly from the logits (p, q both at temperature T), the
  expected accepted drafts E[acc] = Σ_j Π_{i≤j} α_i (what rejection sampling accepts per verify
  step), and the target's mean entropy (teacher-forced over the held-out tokens);
* the engine's tokens per verify step and acceptance rate with ``rejection`` and ``target_only``
  verification, and ``greedy`` at T = 0 (acceptance counted only over drafts that could still be
  emitted: see the engine's metric definition).

Prints mean ± std over seeds, the issue's targets, writes ``--json`` records and a PNG of
acceptance vs entropy per objective and verification mode with linear fits.

    python tools/bench_mtp_objectives.py                 # the default size (~20 min on 2 cores)
    python tools/bench_mtp_objectives.py --quick         # smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BASELINES = ("ce", "kl", "tv", "e2e_tv")
VERIFY_MODES = ("rejection", "target_only")


@dataclass
class EvalSet:
    """A held-out distribution: teacher-forced token batches and engine prompts."""

    name: str
    tokens: torch.Tensor  # [b, s]
    labels: torch.Tensor  # [b, s]
    loss_mask: torch.Tensor  # [b, s]: which labels count (depth k at t is scored iff loss_mask[t+k])
    prompts: list[list[int]]
    stop_token_ids: list[int]
    stops: list[str] = field(default_factory=list)  # multi-token stop strings (``split_stops``)


# ----------------------------------------------------------------------------- data


def _pad_rows(rows: list[list[int]], length: int) -> torch.Tensor:
    out = torch.zeros(len(rows), length, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r[:length])
    return out


def build_eval_sets(cfg, n: int, seed: int = 987_654) -> list[EvalSet]:
    from bebop_megatron.data import load_tokenizer, synthetic_documents, synthetic_problem
    from bebop_megatron.rl.rollout import split_stops

    tok = load_tokenizer(cfg.data.tokenizer)
    s = cfg.data.seq_length
    # sft: held-out documents of the training mixture (a seed the training data never uses)
    docs = [list(tok.encode(d)) + [tok.eos_id] for d in synthetic_documents(n, seed, cfg.data.synthetic_task)]
    rows = [d[: s + 1] for d in docs]
    full = _pad_rows(rows, s + 1)
    mask = torch.zeros(len(rows), s)
    for i, r in enumerate(rows):
        mask[i, : len(r) - 1] = 1.0
    rng = random.Random(seed + 1)
    sft_prompts = [list(tok.encode(synthetic_problem(rng, cfg.data.synthetic_task)[0])) for _ in range(n)]
    sft = EvalSet("sft", full[:, :-1].contiguous(), full[:, 1:].contiguous(), mask, sft_prompts, [])
    # rl: the RL prompts with their answers; only answer (+ stop) tokens are scored
    stop = "".join(cfg.rl.stop[:1]) or ";"
    # as `bebop rl` sends them: single-token stops as ids, longer ones as strings (every token of a
    # longer stop as an id would stop at its first token)
    stop_ids, stop_strs = split_stops(tok, list(cfg.rl.stop))
    kinds = [k.strip() for k in cfg.rl.task.split(",")]
    rows, masks, prompts = [], [], []
    for i in range(n):
        p, a = synthetic_problem(rng, kinds[i % len(kinds)])
        pi, ai = list(tok.encode(p)), list(tok.encode(a + stop))
        seq = (pi + ai)[: s + 1]
        rows.append(seq)
        m = torch.zeros(s)
        m[len(pi) - 1 : len(seq) - 1] = 1.0  # label at t is token t+1: the answer starts at label len(pi)-1
        masks.append(m)
        prompts.append(pi)
    full = _pad_rows(rows, s + 1)
    rl = EvalSet("rl", full[:, :-1].contiguous(), full[:, 1:].contiguous(), torch.stack(masks), prompts, stop_ids,
                 stop_strs)
    return [sft, rl]


@torch.no_grad()
def on_policy(em, cfg, ev: EvalSet, max_new_tokens: int, temperature: float = 1.0) -> EvalSet:
    """``ev`` with the answers replaced by the trunk's own samples (plain decoding at T): the
    tokens that speculative rollouts actually verify. The trunk is frozen during MTP training, so
    one sampling serves every objective and seed."""
    from bebop_megatron.data import load_tokenizer
    from bebop_megatron.rollout.engine import Engine, SamplingParams, SpecConfig

    eng = Engine(em, load_tokenizer(cfg.data.tokenizer), SpecConfig("none"), max_running=len(ev.prompts),
                 max_len=max(len(p) for p in ev.prompts) + max_new_tokens + 2)
    reqs = eng.generate([list(p) for p in ev.prompts],
                        [SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                        stop=list(ev.stops), stop_token_ids=list(ev.stop_token_ids),
                                        seed=7_000 + i)
                         for i in range(len(ev.prompts))])
    s = ev.tokens.shape[1]
    rows, masks = [], []
    for p, r in zip(ev.prompts, reqs):
        seq = (list(p) + list(r.output_ids))[: s + 1]
        m = torch.zeros(s)
        m[len(p) - 1 : len(seq) - 1] = 1.0
        rows.append(seq)
        masks.append(m)
    full = _pad_rows(rows, s + 1)
    return EvalSet(ev.name, full[:, :-1].contiguous(), full[:, 1:].contiguous(), torch.stack(masks), ev.prompts,
                   ev.stop_token_ids, ev.stops)


# ------------------------------------------------------------------ teacher-forced α


@torch.no_grad()
def teacher_forced(model, ev: EvalSet, temperatures: list[float]) -> dict[float, dict]:
    """Per-depth α_k, E[accepted] and target entropy at each temperature, exactly from the logits."""
    from bebop_megatron.mtp.losses import mtp_objective

    captured = {}

    def capture(m, hidden, input_ids, position_ids, labels, loss_mask, mtp_kwargs):
        mtp_hidden = m.run_mtp_block(hidden, input_ids, position_ids, **mtp_kwargs)
        logits, _ = m.output_layer(hidden, weight=m._output_weight())
        lazy = m.mtp_logits(mtp_hidden)
        captured["main"], captured["mtp"] = logits.float(), [lazy[k].float() for k in range(len(lazy))]
        return torch.zeros(labels.shape, device=labels.device)

    was_training = model.training
    model.eval()
    try:
        b, s = ev.tokens.shape
        pos = torch.arange(s).expand(b, s).contiguous()
        dev = next(model.parameters()).device
        model(ev.tokens.to(dev), pos.to(dev), None, labels=ev.labels.to(dev), loss_mask=ev.loss_mask.to(dev),
              postprocess_fn=capture)
    finally:
        model.train(was_training)
    out = {}
    for T in temperatures:
        main, mtp = captured["main"] / T, [z / T for z in captured["mtp"]]
        r = mtp_objective(main, mtp, "tv", ev.loss_mask.to(dev), true_vocab_size=model.true_vocab_size)
        out[T] = {"alpha": [round(float(a), 5) for a in r.alpha], "e_accepted": float(r.cum_alpha.sum()),
                  "entropy": float(r.target_entropy),
                  "alpha_by_entropy": alpha_by_entropy(main, mtp, ev.loss_mask.to(dev), model.true_vocab_size)}
    return out


ENTROPY_BINS = (0.1, 0.5, 1.0)  # nats: [0, 0.1) near-deterministic targets ... [1, inf) spread ones


@torch.no_grad()
def alpha_by_entropy(main: torch.Tensor, mtp: list[torch.Tensor], loss_mask: torch.Tensor,
                     true_vocab_size: int) -> dict:
    """Where the missing acceptance lives: per depth, the share of scored positions and their mean
    α_k in bins of the target's entropy H(p_k). Positions pair as in ``mtp_objective``
    (p_k(t) = main head at t+k, scored where ``shifted_valid_mask``)."""
    from bebop_megatron.mtp.losses import shifted_valid_mask

    V = true_vocab_size
    p_all = torch.softmax(main[..., :V].double(), -1)  # [s, b, V]
    edges = torch.tensor(ENTROPY_BINS, dtype=torch.float64)
    s = main.shape[0]
    share, alpha = [], []
    for k, z in enumerate(mtp, start=1):
        p = p_all[k:]
        q = torch.softmax(z[: s - k, :, :V].double(), -1)
        valid = shifted_valid_mask(loss_mask, None, k).t()[: s - k]  # [s-k, b]
        a = torch.minimum(p, q).sum(-1)[valid]
        h = -(p * p.clamp_min(1e-300).log()).sum(-1)[valid]
        bins = torch.bucketize(h, edges, right=True)  # 0..len(edges)
        n = max(int(valid.sum()), 1)
        share.append([round(float((bins == i).sum()) / n, 5) for i in range(len(edges) + 1)])
        alpha.append([round(float(a[bins == i].mean()), 5) if bool((bins == i).any()) else float("nan")
                      for i in range(len(edges) + 1)])
    return {"edges": list(ENTROPY_BINS), "share": share, "alpha": alpha}


# -------------------------------------------------------------------------- engine


def engine_model(cfg, model):
    """The trained megatron model's weights in the rollout engine's HF-layout model."""
    from bebop_megatron.convert.hf_megatron import iter_hf_buckets
    from bebop_megatron.convert.layout import Shapes
    from bebop_megatron.rl.weight_sync import rollout_model_for

    em = rollout_model_for(cfg)
    for bucket in iter_hf_buckets(model, Shapes.from_config(cfg, 1, "deepseek"), 64 << 20):
        em.load_hf_state_dict(bucket, strict=False)
    return em


@torch.no_grad()
def engine_run(em, cfg, ev: EvalSet, verify: str, temperature: float, max_new_tokens: int, seed: int) -> dict:
    from bebop_megatron.data import load_tokenizer
    from bebop_megatron.rollout.engine import Engine, SamplingParams, SpecConfig

    tok = load_tokenizer(cfg.data.tokenizer)
    longest = max(len(p) for p in ev.prompts)
    eng = Engine(em, tok, SpecConfig("mtp", cfg.model.mtp_num_layers, verify), max_running=len(ev.prompts),
                 max_len=longest + max_new_tokens + 2)
    params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                             stop=list(ev.stops), stop_token_ids=list(ev.stop_token_ids),
                             seed=seed * 100_003 + i)
              for i in range(len(ev.prompts))]
    eng.generate([list(p) for p in ev.prompts], params)
    st = eng.stats()
    return {"tokens_per_verify": float(st["avg_spec_accept_length"]), "accept_rate": float(st["spec_accept_rate"])}


# ------------------------------------------------------------------------ training


def objective_config(cfg, objective: str, seed: int, out: Path, warmup: tuple[str, int]):
    c = copy.deepcopy(cfg)
    c.train.seed = seed
    c.train.output_dir = str(out)
    c.train.save_interval = 0
    c.train.progress = False
    c.train.resume = False
    if objective == "recommended":  # the config's recipe (incl. any mtp.kl_warmup_steps anneal)
        c.mtp.loss, (c.mtp.warmup_loss, c.mtp.warmup_steps) = "e2e_tv", warmup
    else:  # a plain baseline
        c.mtp.loss, c.mtp.warmup_loss, c.mtp.warmup_steps, c.mtp.kl_warmup_steps = objective, None, 0, 0
    return c


def train_heads(cfg, platform, trunk_ckpt: Path, out: Path):
    from megatron.core import tensor_parallel

    from bebop_megatron.training.train_mtp import run_phase

    torch.manual_seed(cfg.train.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.train.seed)
    # the trunk is shared; each seed initialises its own heads
    res = run_phase(cfg, platform, "mtp", out, cfg.train.steps, cfg.train.lr, trunk_ckpt, fresh_heads=True)
    return res.model


def ensure_trunk(cfg, platform, path: Optional[str], out: Path) -> Path:
    from bebop_megatron.checkpointing import latest_checkpoint
    from bebop_megatron.training.train_mtp import run_phase

    for cand in ([Path(path)] if path else []) + [Path(cfg.train.output_dir) / "trunk", out / "trunk"]:
        ck = latest_checkpoint(cand)
        if ck is not None:
            return ck
    if path:
        raise FileNotFoundError(f"--trunk {path} holds no checkpoint")
    print(f"no trunk checkpoint: training one ({cfg.train.trunk_warmup_steps} SFT steps) under {out / 'trunk'}")
    res = run_phase(cfg, platform, "trunk", out / "trunk", cfg.train.trunk_warmup_steps, cfg.train.trunk_lr, None)
    return res.checkpoint


# -------------------------------------------------------------------------- report


def _ms(xs: list[float], signed: bool = False) -> str:
    """mean ± sample std (ddof 1) over seeds."""
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return "-"
    return f"{np.mean(xs):{'+' if signed else ''}.3f} ± {np.std(xs, ddof=1) if len(xs) > 1 else 0.0:.3f}"


def _sel(records, **kw):
    return [r for r in records if all(r.get(k) == v for k, v in kw.items())]


def linear_fit(x: list[float], y: list[float]) -> dict:
    """rl/report.py's least-squares fit, with NaN (not None) where x has no spread, for the tables."""
    from bebop_megatron.rl.report import linear_fit as fit

    return {k: (float("nan") if v is None else v) for k, v in fit(x, y).items()}


def entropy_table(records: list[dict], objectives: list[str]) -> str:
    """Mean over depths and seeds (T = 1) of α in each target-entropy bin, with the bin's share of
    positions and its share of the missing acceptance, Σ_bins share·(1 − α) = 1 − mean α."""
    recs = [r for r in records if r.get("temperature") == 1.0 and r.get("verify") == "rejection"
            and r.get("alpha_by_entropy")]
    if not recs:
        return ""
    edges = recs[0]["alpha_by_entropy"]["edges"]
    names = [f"H<{edges[0]}"] + [f"{a}≤H<{b}" for a, b in zip(edges, edges[1:])] + [f"H≥{edges[-1]}"]
    out = ["", "α by the target's entropy (nats; T=1, mean over depths and seeds): "
           "share of positions / α / share of the missing acceptance (1 − α summed)"]
    out.append(f"{'objective':<12} {'dist':<4} " + " ".join(f"{n:<22}" for n in names))
    for dist in ("sft", "rl"):
        for obj in objectives:
            rs = [r["alpha_by_entropy"] for r in _sel(recs, objective=obj, distribution=dist)]
            if not rs:
                continue
            share = np.nanmean([d["share"] for d in rs], axis=(0, 1))
            alpha = np.nanmean([d["alpha"] for d in rs], axis=(0, 1))
            miss = np.nanmean([[[s_ * (1 - a_) for s_, a_ in zip(sd, ad)] for sd, ad in zip(d["share"], d["alpha"])]
                               for d in rs], axis=(0, 1))
            out.append(f"{obj:<12} {dist:<4} " + " ".join(
                f"{f'{sh:.2f} / {a:.3f} / {m:.4f}':<22}" for sh, a, m in zip(share, alpha, miss)))
    return "\n".join(out)


def summarise(records: list[dict], objectives: list[str], temps: list[float], gamma: int) -> dict:
    """The table and the issue's three targets."""
    lines, verdict = [], {}
    head = f"{'objective':<12} {'dist':<4} {'α per depth (T=1)':<26} {'E[acc] T=1':<16}"
    for T in temps:
        head += f" {'RS tpv T=' + str(T):<16} {'TO tpv T=' + str(T):<16}"
    head += f" {'greedy tpv':<16}"
    lines.append(head)
    for dist in ("sft", "rl"):
        for obj in objectives:
            tf = _sel(records, objective=obj, distribution=dist, temperature=1.0, verify="rejection")
            if not tf:
                continue
            alpha = np.mean([r["alpha"] for r in tf], axis=0)
            row = f"{obj:<12} {dist:<4} {' '.join(f'{a:.3f}' for a in alpha):<26} {_ms([r['e_accepted'] for r in tf]):<16}"
            for T in temps:
                for v in VERIFY_MODES:
                    row += f" {_ms([r['tokens_per_verify'] for r in _sel(records, objective=obj, distribution=dist, temperature=T, verify=v)]):<16}"
            row += f" {_ms([r['tokens_per_verify'] for r in _sel(records, objective=obj, distribution=dist, verify='greedy')]):<16}"
            lines.append(row)
    lines.append(entropy_table(records, objectives))
    if "recommended" in objectives:
        for dist in ("sft", "rl"):
            def at_t1(o):  # one record per seed: the teacher-forced figures at T = 1
                return _sel(records, objective=o, distribution=dist, temperature=1.0, verify="rejection")

            def mean_e(o):
                return float(np.mean([r["e_accepted"] for r in at_t1(o)]))

            def mean_a(o):
                return float(np.mean([r["alpha"][-1] for r in at_t1(o)]))
            base = [o for o in ("ce", "kl", "tv") if o in objectives]
            if not base:
                continue
            best = max(base, key=mean_e)
            e_best, e_rec = mean_e(best), mean_e("recommended")
            need = (gamma - e_best) / 3
            best_a = max(base, key=mean_a)

            def tpv_slope(v):
                pts = [(r["temperature"], r["tokens_per_verify"]) for r in
                       _sel(records, objective="recommended", distribution=dist, verify=v)]
                return linear_fit([p[0] for p in pts], [p[1] for p in pts])["slope"]

            # paired by seed (same trunk, same eval set): the seed-to-seed spread of the heads cancels
            e_rec_s, e_best_s = ({r["seed"]: r["e_accepted"] for r in at_t1(o)} for o in ("recommended", best))
            paired = [e_rec_s[s] - e_best_s[s] for s in sorted(e_rec_s) if s in e_best_s]
            s_rs, s_to = tpv_slope("rejection"), tpv_slope("target_only")
            ratio = (s_rs / s_to) if s_to and s_to < 0 else float("nan")
            # None: no slope to judge (one temperature, or --no-engine), not a failed target
            slope_met = (None if math.isnan(s_rs) or math.isnan(s_to)
                         else bool(ratio <= 0.5) if not math.isnan(ratio) else bool(s_rs >= 0))
            verdict[dist] = {
                "best_baseline": best, "e_best": e_best, "e_recommended": e_rec, "gain": e_rec - e_best,
                "gain_by_seed": paired, "gain_needed": need, "headroom_target_met": e_rec - e_best >= need,
                "alpha_last_recommended": mean_a("recommended"), "alpha_last_best": mean_a(best_a),
                "alpha_last_target_met": mean_a("recommended") >= mean_a(best_a),
                "tpv_slope_rejection": s_rs, "tpv_slope_target_only": s_to, "slope_ratio": ratio,
                "slope_target_met": slope_met,
            }
            v = verdict[dist]
            slope_word = {None: "not measured", True: "MET", False: "NOT MET"}[slope_met]
            lines.append(
                f"[{dist}] recommended E[acc] {e_rec:.3f} vs best baseline {best} {e_best:.3f}: gain {e_rec - e_best:+.3f} "
                f"(paired by seed {_ms(paired, signed=True)}; target ≥ {need:+.3f}: {'MET' if v['headroom_target_met'] else 'NOT MET'}); α_{gamma} "
                f"{v['alpha_last_recommended']:.3f} vs best {v['alpha_last_best']:.3f} "
                f"({'MET' if v['alpha_last_target_met'] else 'NOT MET'}); tokens/verify slope over T: RS {s_rs:+.3f}, "
                f"target-only {s_to:+.3f}, ratio {ratio:.2f} (target ≤ 0.5: {slope_word})")
    return {"table": "\n".join(lines), "targets": verdict}


def plot(records: list[dict], objectives: list[str], path: Path) -> dict:
    """Engine acceptance vs the target's entropy, per objective and verification mode, with fits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fits = {}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, v in zip(axes, VERIFY_MODES):
        for obj in objectives:
            pts = [(r["entropy"], r["accept_rate"]) for r in _sel(records, objective=obj, verify=v)]
            if not pts:
                continue
            x, y = [p[0] for p in pts], [p[1] for p in pts]
            fit = linear_fit(x, y)
            fits[f"{obj}/{v}"] = fit
            sc = ax.scatter(x, y, s=14, alpha=0.7)
            xs = np.linspace(min(x), max(x), 10)
            ax.plot(xs, fit["slope"] * xs + fit["intercept"], color=sc.get_facecolor()[0],
                    label=f"{obj}: slope {fit['slope']:+.3f}, r² {fit['r2']:.2f}")
        ax.set_title(f"{v} verification")
        ax.set_xlabel("target entropy (nats, teacher-forced)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("draft acceptance rate (engine)")
    fig.suptitle("MTP draft acceptance vs entropy (points: seeds x temperatures x distributions)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fits


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny_cpu.yaml")
    ap.add_argument("--set", action="append", default=[], help="config overrides, e.g. model.mtp_num_layers=5")
    ap.add_argument("--trunk", default=None, help="trunk checkpoint folder (default: the config's train-mtp output)")
    ap.add_argument("--objectives", default="ce,kl,tv,e2e_tv,recommended")
    ap.add_argument("--recommended", default=None,
                    help="warm-up loss:steps for the recommended recipe (default: the config's mtp.warmup_*)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None, help="MTP steps per objective (default: train.steps)")
    ap.add_argument("--temperatures", default="0.6,1.0,1.3")
    ap.add_argument("--eval-samples", type=int, default=32, help="held-out sequences / prompts per distribution")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: robust on a shared machine)")
    ap.add_argument("--out", default="outputs/bench_mtp_objectives")
    ap.add_argument("--json", default=None, help="records (default: <out>/records.json)")
    ap.add_argument("--plot", default=None, help="PNG (default: <out>/acceptance_vs_entropy.png)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 seeds, few steps, small eval")
    ap.add_argument("--no-engine", action="store_true", help="teacher-forced α only (no engine generation)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)

    from bebop_megatron.config import Config
    from bebop_megatron.parallel import initialize_distributed

    cfg = Config.load(args.config, args.set)
    budget = cfg.train.steps  # the recipe's stage lengths scale with the step budget
    if args.steps:
        cfg.train.steps = args.steps
    if args.quick:
        args.seeds, args.eval_samples, args.max_new_tokens = 2, 8, 16
        cfg.train.steps = min(cfg.train.steps, 20)
        cfg.train.trunk_warmup_steps = min(cfg.train.trunk_warmup_steps, 30)
        # fewer SFT documents: mtp.rollout_share's answer budget is a share of their tokens
        cfg.data.synthetic_samples = min(cfg.data.synthetic_samples, 400)
    if args.recommended:
        wl, ws = args.recommended.split(":")
        warmup = (wl, int(ws))
    elif cfg.mtp.warmup_loss:
        warmup = (cfg.mtp.warmup_loss, round(cfg.mtp.warmup_steps * cfg.train.steps / budget))
    else:
        warmup = ("kl", cfg.train.steps // 2)
    warmup = (warmup[0], min(warmup[1], cfg.train.steps - 1))
    cfg.mtp.kl_warmup_steps = round(cfg.mtp.kl_warmup_steps * cfg.train.steps / budget)
    temps = [float(t) for t in args.temperatures.split(",")]
    objectives = [o.strip() for o in args.objectives.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gamma = cfg.model.mtp_num_layers

    platform = initialize_distributed(1, 1, seed=cfg.train.seed, force_cpu=True)
    trunk_cfg = copy.deepcopy(cfg)
    trunk_cfg.train.progress = False
    trunk = ensure_trunk(trunk_cfg, platform, args.trunk, out)
    eval_sets = build_eval_sets(cfg, args.eval_samples)
    print(f"trunk {trunk}; γ={gamma}; {cfg.train.steps} MTP steps per objective; recommended = "
          f"{warmup[0]} x {warmup[1]} then e2e_tv x {cfg.train.steps - warmup[1]}; seeds {args.seeds}")

    records: list[dict] = []
    rl_on_policy = False
    t_start = time.time()
    for seed in range(1, args.seeds + 1):
        for obj in objectives:
            t0 = time.time()
            ocfg = objective_config(cfg, obj, seed, out / "runs" / f"{obj}_s{seed}", warmup)
            model = train_heads(ocfg, platform, trunk, Path(ocfg.train.output_dir))
            em = engine_model(cfg, model)
            if eval_sets[1].name == "rl" and not rl_on_policy:
                eval_sets[1] = on_policy(em, cfg, eval_sets[1], args.max_new_tokens)
                rl_on_policy = True
            em = None if args.no_engine else em
            for ev in eval_sets:
                tf = teacher_forced(model, ev, temps)
                if em is None:
                    records += [{"objective": obj, "seed": seed, "distribution": ev.name, "temperature": T,
                                 "verify": "rejection", **tf[T], "tokens_per_verify": float("nan"),
                                 "accept_rate": float("nan")} for T in temps]
                    continue
                for T in temps:
                    for v in VERIFY_MODES:
                        eng = engine_run(em, cfg, ev, v, T, args.max_new_tokens, seed)
                        records.append({"objective": obj, "seed": seed, "distribution": ev.name, "temperature": T,
                                        "verify": v, **tf[T], **eng})
                # temperature 0: the engine verifies greedily (draft == argmax), whatever the mode
                g = engine_run(em, cfg, ev, "rejection", 0.0, args.max_new_tokens, seed)
                records.append({"objective": obj, "seed": seed, "distribution": ev.name, "temperature": 0.0,
                                "verify": "greedy", **tf[min(temps)], **g})
            r1 = _sel(records, objective=obj, seed=seed, temperature=1.0, verify="rejection")
            print(f"  seed {seed} {obj:<12} " + "  ".join(
                f"{r['distribution']}: α {[round(a, 3) for a in r['alpha']]} E[acc] {r['e_accepted']:.3f} "
                f"tpv {r['tokens_per_verify']:.2f}" for r in r1) + f"  ({time.time() - t0:.0f} s)", flush=True)
            del model, em

    summary = summarise(records, objectives, temps, gamma)
    print("\n" + summary["table"])
    json_path = Path(args.json) if args.json else out / "records.json"
    json_path.write_text(json.dumps(records, indent=1))
    png = Path(args.plot) if args.plot else out / "acceptance_vs_entropy.png"
    fits = {} if args.no_engine else plot(records, objectives, png)
    (out / "summary.json").write_text(json.dumps({"targets": summary["targets"], "fits": fits,
                                                  "recommended": list(warmup), "steps": cfg.train.steps,
                                                  "seeds": args.seeds, "gamma": gamma,
                                                  "seconds": time.time() - t_start}, indent=2))
    print(f"\nrecords: {json_path}\nplot:    {png}\ntotal {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
