"""GRPO pieces, Entrocraft, GrowMTP's DCA loss and OCC's coefficient."""

import math

import pytest
import torch

from bebop_megatron.mtp.losses import vocab_parallel_alpha
from bebop_megatron.rl.entropy import EntrocraftConfig, EntrocraftController, token_mean_entropy
from bebop_megatron.rl.grpo import (dynamic_sampling_keep, group_advantages, kl_k3, overlong_keep, policy_loss,
                                    tis_weights)
from bebop_megatron.rl.mtp_objectives import dca_loss, occ_coefficient, topk_residual_alpha


def test_group_advantages_and_filters():
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(r, 4)
    assert torch.allclose(adv[:4], torch.tensor([1.0, -1.0, 1.0, -1.0]), atol=1e-5)
    assert torch.all(adv[4:] == 0)
    assert torch.allclose(group_advantages(r, 4, normalize_std=False)[:4], torch.tensor([0.5, -0.5, 0.5, -0.5]))
    assert dynamic_sampling_keep(r, 4).tolist() == [True, False]
    assert overlong_keep(torch.tensor([True, False])).tolist() == [False, True]
    with pytest.raises(ValueError):
        group_advantages(r, 3)


def test_policy_loss_matches_formula_and_clips():
    torch.manual_seed(0)
    logp = torch.randn(3, 5, requires_grad=True)
    old = logp.detach() + 0.3 * torch.randn(3, 5)
    adv = torch.tensor([1.0, -1.0, 0.5])
    mask = torch.ones(3, 5)
    mask[2, 3:] = 0
    out = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    ratio = torch.exp(logp.detach() - old)
    ref = torch.zeros(())
    for b in range(3):
        for t in range(5):
            if mask[b, t]:
                a = adv[b]
                ref += max(-a * ratio[b, t], -a * ratio[b, t].clamp(0.8, 1.28))
    assert torch.isclose(out.loss.detach(), ref / mask.sum(), atol=1e-6)
    out.loss.backward()
    g = logp.grad
    # tokens clipped on the side the advantage pushes get no gradient
    clipped = ((ratio > 1.28) & (adv[:, None] > 0)) | ((ratio < 0.8) & (adv[:, None] < 0))
    assert torch.all(g[clipped] == 0) and torch.all(g[mask == 0] == 0)
    assert 0 <= out.clip_frac <= 1 and out.clip_frac == (clipped & (mask > 0)).sum() / mask.sum()


def test_tis_and_kl():
    w = tis_weights(torch.tensor([0.0, 2.0]), torch.tensor([0.0, 0.0]), cap=2.0)
    assert torch.allclose(w, torch.tensor([1.0, 2.0]))
    lp = torch.log_softmax(torch.randn(10), -1)
    assert torch.all(kl_k3(lp, lp) == 0) and torch.all(kl_k3(lp, lp.roll(1)) >= 0)
    logp = torch.zeros(2, 3, requires_grad=True)
    out = policy_loss(logp, torch.zeros(2, 3), torch.ones(2), torch.ones(2, 3), ref_logp=torch.full((2, 3), -0.5),
                      kl_coef=0.1)
    assert out.kl_ref > 0


def test_entrocraft_band_and_masks():
    ctl = EntrocraftController(EntrocraftConfig(0.6, 0.4, 0.7, 0.5, anneal_steps=100))
    assert ctl.band(0) == (0.6, 0.7) and ctl.band(100) == (0.4, 0.5)
    assert all(math.isclose(a, b) for a, b in zip(ctl.band(50), (0.5, 0.6)))
    adv = torch.tensor([1.0, -1.0, 0.0, 2.0])
    assert ctl.keep(0, 0.9, adv)[0].tolist() == [True, False, False, True]
    assert ctl.keep(0, 0.1, adv)[0].tolist() == [False, True, False, False]
    assert ctl.keep(0, 0.65, adv)[0].all()
    with pytest.raises(ValueError):
        EntrocraftConfig(0.8, 0.4, 0.7, 0.5)
    logits = torch.zeros(2, 3, 4)
    assert torch.isclose(token_mean_entropy(logits, torch.ones(2, 3)), torch.tensor(math.log(4)))


def _toy_bandit(control: bool, seed: int, steps=800, K=8, n=16, groups=4, band=(0.9, 1.3)):
    """GRPO on a noisy bandit (near-equal Bernoulli rewards): plain GRPO's entropy collapses."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.linspace(0.6, 0.4, K)
    z = torch.zeros(K, requires_grad=True)
    opt = torch.optim.Adam([z], lr=0.01)
    ctl = EntrocraftController(EntrocraftConfig(band[0], band[0], band[1], band[1], 1))
    hist = []
    for step in range(steps):
        p = torch.softmax(z, -1).detach()
        H = float(-(p * p.log()).sum())
        hist.append(H)
        a = torch.multinomial(p, groups * n, replacement=True, generator=g)
        r = (torch.rand(groups * n, generator=g) < mu[a]).float()
        adv = group_advantages(r, n)
        keep = ctl.keep(step, H, adv)[0] if control else torch.ones_like(adv, dtype=torch.bool)
        if not keep.any():
            continue
        logp = torch.log_softmax(z, -1)[a].unsqueeze(-1)
        loss = policy_loss(logp, logp.detach(), adv, keep.unsqueeze(-1).float()).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    tail = hist[-300:]
    return sum(tail) / len(tail)


def test_entrocraft_keeps_toy_policy_entropy_in_band():
    for seed in range(5):
        plain, ctl = _toy_bandit(False, seed), _toy_bandit(True, seed)
        assert plain < 0.8, (seed, plain)  # collapses below the band
        assert 0.9 <= ctl <= 1.5, (seed, ctl)  # held at the band (lower bound strictly, upper loosely)


def test_topk_residual_alpha():
    torch.manual_seed(1)
    V = 12
    z = torch.randn(5, V, requires_grad=True)
    p = torch.softmax(torch.randn(5, V), -1)
    full = topk_residual_alpha(z, torch.arange(V).expand(5, V), p)
    assert torch.allclose(full, vocab_parallel_alpha(z.detach(), p).float(), atol=1e-6)
    top = p.topk(4, -1)
    a4 = topk_residual_alpha(z, top.indices, top.values)
    assert torch.all(a4 >= full - 1e-6) and torch.all(a4 <= 1 + 1e-6)  # coarser bins can only merge mass
    a4.sum().backward()
    assert z.grad.abs().sum() > 0


def test_dca_loss_formula_and_gating():
    alpha = torch.tensor([[0.9, 0.5], [0.8, 0.5], [0.7, 0.5]], requires_grad=True)  # [γ=3, N=2]
    acc = torch.tensor([3, 0])
    loss = dca_loss(alpha, acc)
    a = alpha.detach()
    pos0 = -math.log(a[0, 0] + a[0, 0] * a[1, 0] + a[0, 0] * a[1, 0] * a[2, 0])
    pos1 = -math.log(a[0, 1])  # rejected at depth 1: only l = 1 counts
    assert math.isclose(loss.item(), (pos0 + pos1) / 2, rel_tol=1e-6)
    loss.backward()
    assert alpha.grad[1, 1] == 0 and alpha.grad[2, 1] == 0  # gated depths get no gradient
    assert dca_loss(torch.zeros(2, 1), torch.tensor([1])).isfinite()


def test_occ_coefficient():
    old = torch.zeros(2, 3)
    mtp = torch.tensor([[0.1, 0.2, -0.1], [0.0, 0.3, 0.1]])
    main = 2 * mtp
    mask = torch.ones(2, 3)
    mask[1, 0] = 0
    c = occ_coefficient(mtp, main, old, mask, lam=0.5)
    assert math.isclose(float(c), 0.5 * 2.0, abs_tol=1e-4)
