"""End-of-run RL report: reward trend (slope ± standard error), acceptance vs entropy controlling for
response length (partial fit), PNG curves, and a speculation benchmark."""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import numpy as np

from bebop_megatron.rl.metrics import task_reward_series


def linear_fit(x: list[float], y: list[float]) -> dict:
    """Least squares y = slope * x + intercept, with r^2 (None when x has no spread)."""
    xa, ya = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(xa) < 2 or np.ptp(xa) == 0:
        return {"slope": None, "intercept": None, "r2": None, "n": int(len(xa))}
    slope, intercept = np.polyfit(xa, ya, 1)
    pred = slope * xa + intercept
    ss_tot = float(((ya - ya.mean()) ** 2).sum())
    r2 = 1.0 - float(((ya - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
    return {"slope": float(slope), "intercept": float(intercept), "r2": r2, "n": int(len(xa))}


def trend_fit(x: list[float], y: list[float]) -> dict:
    """OLS slope of y on x with its standard error (and r²); slope/se None with < 3 points."""
    xa, ya = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    n = len(xa)
    if n < 3 or np.ptp(xa) == 0:
        return {"slope": None, "se": None, "r2": None, "n": int(n)}
    xc = xa - xa.mean()
    sxx = float((xc * xc).sum())
    slope = float((xc * (ya - ya.mean())).sum() / sxx)
    resid = ya - ya.mean() - slope * xc
    se = float(np.sqrt((resid * resid).sum() / (n - 2) / sxx))
    ss_tot = float(((ya - ya.mean()) ** 2).sum())
    return {"slope": slope, "se": se, "t": slope / se if se > 0 else None,
            "r2": 1.0 - float((resid * resid).sum()) / ss_tot if ss_tot > 0 else 1.0, "n": int(n)}


def partial_fit(y: list[float], x: list[float], z: list[float]) -> dict:
    """y = a + b·x + c·z by least squares: b is the slope in x at fixed z (here: acceptance vs entropy
    at fixed response length), with its standard error; also corr(y, x), corr(y, z)."""
    ya, xa, za = (np.asarray(v, dtype=float) for v in (y, x, z))
    n = len(ya)
    if n < 4 or np.ptp(xa) == 0:
        return {"slope_entropy": None, "se_entropy": None, "slope_length": None, "n": int(n)}
    X = np.stack([np.ones(n), xa, za], 1)
    coef, *_ = np.linalg.lstsq(X, ya, rcond=None)
    resid = ya - X @ coef
    dof = max(n - 3, 1)
    cov = np.linalg.pinv(X.T @ X) * float((resid * resid).sum()) / dof
    ss_tot = float(((ya - ya.mean()) ** 2).sum())
    corr = lambda a, b: float(np.corrcoef(a, b)[0, 1]) if np.ptp(a) > 0 and np.ptp(b) > 0 else None  # noqa: E731
    return {"slope_entropy": float(coef[1]), "se_entropy": float(np.sqrt(max(cov[1, 1], 0.0))),
            "slope_length": float(coef[2]), "se_length": float(np.sqrt(max(cov[2, 2], 0.0))),
            "r2": 1.0 - float((resid * resid).sum()) / ss_tot if ss_tot > 0 else 1.0,
            "corr_accept_entropy": corr(ya, xa), "corr_accept_length": corr(ya, za), "n": int(n)}


def plot_curves(rows: list[dict], out_dir: Path) -> dict:
    """PNG curves over RL steps: reward, entropy (with the Entrocraft band when it is on), acceptance
    and tokens per verify; one file, ``rl_curves.png``, next to the TensorBoard logs."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is an install requirement
        return {}
    if not rows:
        return {}
    steps = [r["step"] for r in rows]
    panels = [("rollout/reward", "training reward (rollouts)"), ("policy/entropy", "policy entropy (nats/token)"),
              ("spec/accept_rate", "draft acceptance"), ("spec/tokens_per_verify", "tokens per verify step")]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (key, title) in zip(axes.flat, panels):
        pts = [(s, r[key]) for s, r in zip(steps, rows) if isinstance(r.get(key), (int, float))]
        if pts:
            xs, ys = zip(*pts)
            fams = task_reward_series(rows) if key == "rollout/reward" else {}
            ax.plot(xs, ys, ".-", lw=1, label="all" if fams else None)
            if key == "rollout/reward":
                for t, (fs, fy) in fams.items():  # a task mixture: each family's own reward (the mix moves the pooled one)
                    ax.plot(fs, fy, "-", lw=0.8, alpha=0.6, label=t)
                f = trend_fit(list(xs), list(ys))
                if f["slope"] is not None:
                    xm = np.mean(xs)
                    ax.plot(xs, [np.mean(ys) + f["slope"] * (x - xm) for x in xs], "r--",
                            label=f"slope {f['slope']:.4f} ± {f['se']:.4f}/step")
                if fams or f["slope"] is not None:
                    ax.legend(loc="best", fontsize=8)
            if key == "policy/entropy" and any("entrocraft/low" in r for r in rows):
                band = [(s, r["entrocraft/low"], r["entrocraft/high"]) for s, r in zip(steps, rows)
                        if "entrocraft/low" in r]
                bs, lo, hi = zip(*band)
                ax.fill_between(bs, lo, hi, alpha=0.2, color="green", label="Entrocraft band")
                ax.legend(loc="best", fontsize=8)
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out_dir / "rl_curves.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return {"curves_plot": str(path)}


def _svg_scatter(x, y, fit: dict, xlabel: str, ylabel: str, title: str) -> str:
    W, H, m = 560, 400, 60
    x0, x1 = min(x), max(x)
    y0, y1 = min(min(y), 0.0), max(max(y), 1.0)
    x1 = x1 if x1 > x0 else x0 + 1e-3
    sx = lambda v: m + (v - x0) / (x1 - x0) * (W - 2 * m)  # noqa: E731
    sy = lambda v: H - m - (v - y0) / (y1 - y0) * (H - 2 * m)  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
             f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
             f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>',
             f'<line x1="{m}" y1="{H - m}" x2="{W - m}" y2="{H - m}" stroke="black"/>',
             f'<line x1="{m}" y1="{m}" x2="{m}" y2="{H - m}" stroke="black"/>',
             f'<text x="{W / 2}" y="{H - 15}" text-anchor="middle">{xlabel}</text>',
             f'<text x="15" y="{H / 2}" transform="rotate(-90 15 {H / 2})" text-anchor="middle">{ylabel}</text>']
    for v in (x0, x1):
        parts.append(f'<text x="{sx(v):.1f}" y="{H - m + 15}" text-anchor="middle">{v:.3f}</text>')
    for v in (y0, y1):
        parts.append(f'<text x="{m - 5}" y="{sy(v):.1f}" text-anchor="end">{v:.2f}</text>')
    for a, b in zip(x, y):
        parts.append(f'<circle cx="{sx(a):.1f}" cy="{sy(b):.1f}" r="3" fill="steelblue"/>')
    if fit["slope"] is not None:
        f = lambda v: fit["slope"] * v + fit["intercept"]  # noqa: E731
        parts.append(f'<line x1="{sx(x0):.1f}" y1="{sy(f(x0)):.1f}" x2="{sx(x1):.1f}" y2="{sy(f(x1)):.1f}" '
                     f'stroke="crimson" stroke-width="2"/>')
        parts.append(f'<text x="{W - m}" y="{m}" text-anchor="end" fill="crimson">'
                     f'accept = {fit["slope"]:.3f} H + {fit["intercept"]:.3f} (r² {fit["r2"]:.2f})</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def acceptance_vs_entropy(rows: list[dict], out_dir: Path) -> dict:
    """Per-step (policy entropy, draft acceptance) points, their linear fit, an SVG plot and a JSON.

    Across steps acceptance also follows the response length (short answers end on easy tokens), so
    the slope that means what the paper means is the partial one, at fixed response length
    (``acceptance_vs_entropy_partial``: accept = a + b·H + c·len)."""
    pts = [(r["policy/entropy"], r["spec/accept_rate"], r.get("rollout/response_len", 0.0)) for r in rows
           if "spec/accept_rate" in r and "policy/entropy" in r]
    if not pts:
        return {}
    x, y, ln = [p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts]
    fit = linear_fit(x, y)
    part = partial_fit(y, x, ln)
    (out_dir / "acceptance_vs_entropy.svg").write_text(
        _svg_scatter(x, y, fit, "policy entropy (token mean, nats)", "draft acceptance rate",
                     "MTP acceptance vs policy entropy, one point per RL step"))
    (out_dir / "acceptance_vs_entropy.json").write_text(json.dumps(
        {"entropy": x, "accept_rate": y, "response_len": ln, "fit": fit, "partial_fit": part}, indent=2))
    return {"acceptance_vs_entropy_fit": fit, "acceptance_vs_entropy_partial": part,
            "acceptance_vs_entropy_plot": str(out_dir / "acceptance_vs_entropy.svg")}


def speculation_benchmark(cfg, buckets: list[dict], prompts, tokenizer, repeats: int = 5,
                          min_rep_seconds: float = 0.5) -> dict:
    """Rollout tokens/s of the final policy on the embedded engine: plain decoding, MTP speculation at
    the fixed γ, and adaptive γ (``speedup`` and ``speedup_adaptive``, both against plain).

    Measured as the project's benchmarks are (a shared machine makes one timing meaningless): the
    engines are built and warmed up first (adaptive γ also measures its round costs on the whole
    batch), then each of ``repeats`` (>= 5) repetitions runs plain, fixed, adaptive (in a seeded
    order shuffled per repetition, ``orders``) on the same prompts, seeds and one torch thread; the
    figures are medians over repetitions, and the speed-ups are medians of the per-repetition ratios.
    A repetition generates the batch ``batches_per_rep`` times back to back (other seeds each time, the
    same ones for every variant), as many as plain decoding needs for ``min_rep_seconds``: one batch
    of the short RL answers lasts about 50 ms, too short to time on a shared machine (as
    ``tools/bench_rollout.py --min-rep-seconds``)."""
    import statistics

    import torch

    from bebop_megatron.rl.rollout import split_stops
    from bebop_megatron.rl.weight_sync import rollout_model_for
    from bebop_megatron.rollout.engine import Engine, SamplingParams, SpecConfig

    r = cfg.rl
    model = rollout_model_for(cfg)
    for b in buckets:
        model.load_hf_state_dict(b, strict=False)
    ids = [list(tokenizer.encode(p.text)) for p in prompts[: r.bench_prompts]]
    # the stops as the rollouts send them: single-token ones as ids, longer ones as strings
    stop_ids, stop_strs = split_stops(tokenizer, list(r.stop))
    params = [SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                             stop=stop_strs, stop_token_ids=stop_ids, seed=i) for i in range(len(ids))]
    g = cfg.model.mtp_num_layers
    specs = {"no_spec": SpecConfig("none"), "mtp_spec": SpecConfig("mtp", g, r.verify),
             "adaptive": SpecConfig("mtp", g, r.verify, adaptive=True)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engines = {}
        for name, spec in specs.items():
            eng = Engine(model, tokenizer, spec, max_running=max(len(ids), 1), max_len=cfg.data.seq_length + 8)
            with torch.inference_mode():
                eng.generate(ids[:2], [SamplingParams(**vars(p)) for p in params[:2]])  # warm-up
                for w in range(10 if spec.adaptive else 0):  # its cost measurements on this workload, as
                    # a long-lived rollout server has them after its first steps (each batch shrinks in a
                    # few rounds here, so one pass does not finish measuring); other seeds than the timed runs
                    warm = [SamplingParams(**{**vars(p), "seed": p.seed + 10_000 * (w + 1)}) for p in params]
                    eng.generate(ids, warm)
            eng.reset_stats()
            engines[name] = eng
        def batch_params(j: int) -> list:  # the j-th batch of a repetition: other seeds than the warm-ups'
            return [SamplingParams(**{**vars(p), "seed": p.seed + 1_000 * j}) for p in params]

        with torch.inference_mode():  # how many batches plain decoding needs for min_rep_seconds
            t0 = time.perf_counter()
            engines["no_spec"].generate(ids, batch_params(0))
            one = time.perf_counter() - t0
        engines["no_spec"].reset_stats()
        nb = max(1, min(100, math.ceil(min_rep_seconds / max(one, 1e-6))))
        runs: dict[str, list[dict]] = {name: [] for name in specs}
        orders = []
        for rep in range(max(repeats, 5)):
            # interleaved (a slow patch of the machine hits all), in an order shuffled per repetition
            # (seeded), as tools/bench_rollout.py runs them: in a fixed order adaptive γ always ran right
            # after fixed γ, and an all-plain adaptive engine measured 2-5% slower there (docs/rollout_speed.md, stop 35)
            order = list(engines)
            random.Random(rep).shuffle(order)
            orders.append(order)
            for name in order:
                eng = engines[name]
                dt, toks = 0.0, 0
                with torch.inference_mode():
                    for j in range(nb):
                        batch = batch_params(j)
                        t0 = time.perf_counter()
                        reqs = eng.generate(ids, batch)
                        dt += time.perf_counter() - t0
                        toks += sum(len(q.output_ids) for q in reqs)
                runs[name].append({"tokens": toks, "seconds": dt, "tokens_per_s": toks / dt})
    finally:
        torch.set_num_threads(threads)
    res: dict = {}
    for name, eng in engines.items():
        st = eng.stats()
        rs = runs[name]
        res[name] = {"tokens": statistics.median(x["tokens"] for x in rs),
                     "seconds": statistics.median(x["seconds"] for x in rs),
                     "tokens_per_s": statistics.median(x["tokens_per_s"] for x in rs),
                     "tokens_per_verify": st["avg_spec_accept_length"] if eng.gamma else 1.0,
                     "accept_rate": st["spec_accept_rate"] if eng.gamma else None}
        if eng.spec.adaptive:
            hist = st["spec_gamma_hist"]
            res[name]["mean_gamma"] = sum(k * n for k, n in enumerate(hist)) / max(sum(hist), 1)
    res["speedup"] = statistics.median(s["tokens_per_s"] / p["tokens_per_s"]
                                       for p, s in zip(runs["no_spec"], runs["mtp_spec"]))
    res["speedup_adaptive"] = statistics.median(s["tokens_per_s"] / p["tokens_per_s"]
                                                for p, s in zip(runs["no_spec"], runs["adaptive"]))
    res["repeats"] = len(runs["no_spec"])
    res["batches_per_rep"] = nb
    res["orders"] = orders
    res["batch"] = len(ids)
    return res
