"""PPO as slime/verl run it (mini-batches x epochs, recomputed old log-probs, decoupled objective),
OCC's coefficient on rollouts sampled from the policy, online MTP at the sampling temperature."""

from __future__ import annotations

import math

import numpy as np
import torch

from bebop_megatron.rl.grpo import policy_loss
from bebop_megatron.rl.mtp_objectives import occ_coefficient
from bebop_megatron.rl.types import Sample
from tests.distributed import run_distributed
from tests.test_rl import fake_samples, rl_tiny_config


def test_policy_loss_ratio_stats():
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0]]))
    out = policy_loss(logp, torch.zeros(1, 3), torch.ones(1), torch.tensor([[1.0, 1.0, 0.0]]))
    assert math.isclose(float(out.ratio_mean), 1.0, abs_tol=1e-6)
    assert math.isclose(float(out.ratio_max), 1.5, rel_tol=1e-6) and math.isclose(float(out.ratio_min), 0.5,
                                                                                  rel_tol=1e-6)
    assert float(out.clip_frac) == 0.5  # 1.5 > 1.28 with A > 0; 0.5 < 0.8 but A > 0: not clipped


def test_occ_coefficient_is_a_stable_least_squares_slope():
    old = torch.zeros(2, 3)
    mtp = torch.tensor([[0.1, 0.2, -0.1], [1e-9, 0.3, 0.1]])  # a near-zero Δ no longer blows up the mean
    main = 2 * mtp
    c = occ_coefficient(mtp, main, old, torch.ones(2, 3), lam=0.5)
    assert torch.isclose(c, torch.tensor(1.0, dtype=torch.float64))
    assert float(occ_coefficient(old, main, old, torch.ones(2, 3))) == 0.0  # not moved: no coefficient


def _grads(tr) -> dict:
    return {n: p.main_grad.detach().clone().numpy() for n, p in tr.model.named_parameters()
            if getattr(p, "main_grad", None) is not None}


def _on_policy_worker(rank, world):
    """One mini-batch, one epoch: the skipped old-log-prob pass changes nothing (the proximal policy is
    the current one), and the clip never acts."""
    from bebop_megatron.parallel import destroy_distributed
    from bebop_megatron.rl.trainer import RLTrainer

    out = {}
    for force in (False, True):
        cfg = rl_tiny_config("frozen")
        tr = RLTrainer(cfg)
        if force:  # the PPO path: old log-probs from a forward-only pass, then the update
            orig = tr._forward_only
            calls = []
            tr._forward_only = lambda *a, **k: (calls.append(1), orig(*a, **k))[1]
            cfg.rl.num_minibatches = 1
            import bebop_megatron.rl.trainer as T

            real = T.RLTrainer.train_step

            def patched(self, samples):
                self.cfg.rl.ppo_epochs = 2  # makes `multi` true, then stop after the first step
                steps = []
                orig_step = self.opt.step

                def one_step():
                    steps.append(1)
                    if len(steps) == 1:
                        out["grad_ppo"] = _grads(self)
                    return orig_step()
                self.opt.step = one_step
                return real(self, samples)
            m = patched(tr, fake_samples(7))
            out["calls"] = len(calls)
        else:
            orig_step = tr.opt.step

            def one_step():
                out["grad_plain"] = _grads(tr)
                return orig_step()
            tr.opt.step = one_step
            m = tr.train_step(fake_samples(7))
            out["plain_metrics"] = m
        tr.close()
        destroy_distributed()
    return out


def test_one_minibatch_on_policy_gives_todays_gradient():
    res = run_distributed(_on_policy_worker, 1)[0]
    assert res["calls"] == 1
    m = res["plain_metrics"]
    assert m["clip_frac"] == 0.0 and abs(m["approx_kl"]) < 1e-9 and m["optim/steps"] == 1
    assert math.isclose(m["ratio_max"], 1.0) and math.isclose(m["ratio_min"], 1.0)
    gp, gq = res["grad_plain"], res["grad_ppo"]
    assert gp.keys() == gq.keys() and any(np.abs(g).max() > 0 for g in gp.values())
    for n in gp:
        assert np.allclose(gp[n], gq[n], atol=1e-6, rtol=1e-4), n


def _minibatch_worker(rank, world, strategy, n_mb, epochs, lr):
    from bebop_megatron.rl.trainer import RLTrainer

    cfg = rl_tiny_config(strategy)
    cfg.rl.num_minibatches, cfg.rl.ppo_epochs, cfg.rl.lr = n_mb, epochs, lr
    tr = RLTrainer(cfg)
    m = tr.train_step(fake_samples(7))
    tr.close()
    return m


def test_minibatches_make_the_clip_act():
    m = run_distributed(_minibatch_worker, 1, "frozen", 2, 2, 5e-2)[0]
    assert m["optim/steps"] == 4
    assert m["clip_frac"] > 0 and m["approx_kl"] > 0, m
    assert m["ratio_max"] > 1 + 0.28 or m["ratio_min"] < 1 - 0.2, m


# ----------------------------------------------------------------------------- OCC on sampled rollouts


def _sample_rollouts(model, tok_prompts, group: int, new_tokens: int, seed: int, reward_fn):
    """Rollouts drawn from the policy itself (T = 1), with the policy's own log-probs as behaviour."""
    g = torch.Generator().manual_seed(seed)
    out = []
    model.eval()  # no labels: plain logits (the RL postprocess_fn is passed only by the trainer's forward step)
    try:
        with torch.no_grad():
            for pi, prompt in enumerate(tok_prompts):
                for _ in range(group):
                    ids, lps = list(prompt), []
                    for _ in range(new_tokens):
                        x = torch.tensor([ids])
                        logits = model(x, torch.arange(len(ids)).unsqueeze(0), None)[0, -1, :58].float()
                        lp = torch.log_softmax(logits, -1)
                        t = int(torch.multinomial(lp.exp(), 1, generator=g))
                        ids.append(t)
                        lps.append(float(lp[t]))
                    resp = ids[len(prompt):]
                    out.append(Sample(prompt_index=pi, prompt_ids=list(prompt), response_ids=resp, rollout_logprobs=lps,
                                      reward=reward_fn(resp), truncated=False, weight_version=0))
    finally:
        model.train()
    return out


def _occ_worker(rank, world):
    from bebop_megatron.rl.trainer import RLTrainer

    cfg = rl_tiny_config("occ")
    cfg.rl.num_minibatches, cfg.rl.lr = 2, 1e-2
    tr = RLTrainer(cfg)
    prompts = [[5, 9, 12, 7], [11, 3, 8, 20, 4]]
    coefs = []
    for step in range(2):
        ss = _sample_rollouts(tr.model, prompts, 4, 8, step, lambda r: float(sum(t % 2 == 0 for t in r) >= 4))
        assert len({s.reward for s in ss}) > 1
        m = tr.train_step(ss)
        coefs.append((m.get("occ/coef_batch"), m["occ/coef"], m["occ/moved_tokens"]))
    tr.close()
    return coefs


def test_occ_coefficient_on_sampled_rollouts_is_nonzero_and_positive():
    """Measured after the first mini-batch against the old policy: the main head's log-probs move with
    the MTP head's (the correlation term OCC calibrates), so c > 0 as in the paper."""
    coefs = run_distributed(_occ_worker, 1)[0]
    for c_batch, c_used, moved in coefs:
        assert moved > 0 and c_batch is not None, coefs
        assert c_batch > 1e-3, coefs
    assert coefs[0][0] != 1.0 and math.isfinite(coefs[1][1])


# ----------------------------------------------------------------------------- online MTP temperature


def _online_temp_worker(rank, world, temperature):
    from bebop_megatron.mtp.losses import mtp_objective
    from bebop_megatron.rl.trainer import RLTrainer

    cfg = rl_tiny_config("online")
    cfg.rl.temperature = temperature
    tr = RLTrainer(cfg)
    model, real = tr.model, tr.hook
    got, ref = [], []
    T = temperature

    class Spy:  # the trainer's hook, observed: the forward step binds each micro-batch to it
        def __getattr__(self, name):
            return getattr(real, name)

        def __call__(self, *args, **kw):
            return spy(*args, **kw)

    def spy(mdl, hs, ids, pos, labels, lm, kw, **bound):
        if mdl.training:
            with torch.no_grad():
                logits, _ = mdl.output_layer(hs, weight=mdl._output_weight())
                lazy = mdl.mtp_logits(mdl.run_mtp_block(hs, ids, pos, **kw))
                r = mtp_objective(logits.clone() / T, [lazy[i] / T for i in range(len(lazy))], "e2e_tv", lm,
                                  labels=labels, true_vocab_size=mdl.true_vocab_size)
                ref.append(float(r.loss))
        return real(mdl, hs, ids, pos, labels, lm, kw, **bound)

    update = model.mtp_metrics.update
    model.mtp_metrics.update = lambda out: (got.append(float(out.loss)), update(out))[1]
    tr.hook = Spy()
    tr.train_step(fake_samples(7))
    tr.close()
    return got, ref


def test_online_mtp_q_at_the_sampling_temperature():
    got, ref = run_distributed(_online_temp_worker, 1, 0.5)[0]
    assert got and len(got) == len(ref)
    for a, b in zip(got, ref):
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6), (got, ref)


# ----------------------------------------------------------------------------- PP = 2


def _pp_worker(rank, world, strategy):
    from bebop_megatron.parallel import destroy_distributed
    from bebop_megatron.rl.trainer import RLTrainer

    cfg = rl_tiny_config(strategy)
    cfg.parallel.pipeline_model_parallel_size = world
    cfg.rl.num_minibatches = 2
    tr = RLTrainer(cfg)
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    m1 = tr.train_step(fake_samples(7))
    m2 = tr.train_step(fake_samples(8))
    changed = {n: float((p.detach() - before[n]).abs().max()) for n, p in tr.model.named_parameters()}
    tr.close()
    destroy_distributed()
    return {"m": [m1, m2], "changed": changed}


def test_rl_pipeline_parallel_2():
    """PP=2 through megatron-core's schedule: the forward-only old-log-prob pass and two PPO mini-batches
    per step run on both stages; every stage's trunk moves; frozen MTP heads stay put; metrics reach
    rank 0 from the last stage."""
    for strategy in ("frozen", "occ"):
        res = run_distributed(_pp_worker, 2, strategy)
        for r in res:
            trunk = [v for n, v in r["changed"].items() if not n.startswith("mtp.")]
            mtp = [v for n, v in r["changed"].items() if n.startswith("mtp.")]
            assert trunk and max(trunk) > 0, (strategy, r["changed"])
            if strategy == "frozen":
                assert all(v == 0.0 for v in mtp)
        m1, m2 = res[0]["m"]
        assert m1["optim/steps"] == 2 and math.isfinite(m1["loss/pg"]) and m1["loss/tokens"] > 0
        assert m2["clip_frac"] >= 0 and m2["approx_kl"] > 0  # second mini-batch: the policy has moved
        if strategy == "occ":
            assert m1.get("occ/coef_batch") is not None
        assert res[0]["m"][0]["loss/pg"] == res[1]["m"][0]["loss/pg"]  # every rank reports the same
