"""MTP objectives vs a dense float64 reference (values and gradients), and e2e-TV vs simulated
rejection sampling."""

import math

import pytest
import torch

from bebop_megatron.mtp.losses import mtp_objective, segment_ids_from_position_ids, vocab_parallel_alpha

LOSSES = ["ce", "kl", "tv", "e2e_tv"]


def dense_reference(main, mtps, loss_type, loss_mask, labels, seg, true_vocab, kl_weight=0.0):
    """Straightforward full-vocab implementation written from the formulas."""
    s, b, V = main.shape
    gamma = len(mtps)
    pad = torch.arange(V) >= true_vocab
    p = torch.softmax(main.detach().masked_fill(pad, -math.inf), -1)

    def valid(k):
        v = torch.zeros(b, s, dtype=torch.bool)
        for t in range(s - k):
            v[:, t] = loss_mask[:, t + k].bool() & (seg[:, t] == seg[:, t + k])
        return v.t()  # [s, b]

    alphas, terms = [], []
    for k in range(1, gamma + 1):
        pk = torch.zeros_like(p)
        pk[: s - k] = p[k:]
        z = mtps[k - 1]
        logq = torch.log_softmax(z.masked_fill(pad, -math.inf), -1)
        q = logq.exp()
        alpha = torch.minimum(pk, q).sum(-1)
        alphas.append(alpha)
        vk = valid(k).double()
        if loss_type == "ce":
            lab = torch.zeros_like(labels)
            lab[:, : s - k] = labels[:, k:]
            ce = -logq.gather(-1, lab.t().unsqueeze(-1)).squeeze(-1)
            terms.append((ce * vk).sum() / vk.sum())
        elif loss_type == "kl" or kl_weight > 0:
            kl = torch.where(pk > 0, pk * (torch.log(pk.clamp_min(1e-300)) - logq), torch.zeros_like(pk)).sum(-1)
            terms.append((1.0 if loss_type == "kl" else kl_weight) * (kl * vk).sum() / vk.sum())
        if loss_type == "tv":
            terms.append(((1 - alpha) * vk).sum() / vk.sum())
    chain = torch.stack([valid(k) for k in range(1, gamma + 1)]).all(0).double()
    if loss_type == "e2e_tv":
        acc = torch.zeros(s, b, dtype=torch.float64)
        prod = torch.ones(s, b, dtype=torch.float64)
        for a in alphas:
            prod = prod * a
            acc = acc + prod
        loss = ((1 - acc / gamma) * chain).sum() / chain.sum()
        if terms:
            loss = loss + sum(terms) / gamma
    else:
        loss = sum(terms) / gamma
    return loss, torch.stack(alphas)


def make_case(seed=0, s=12, b=3, V=40, true_vocab=35, gamma=3, packed=True, sharp=3.0):
    g = torch.Generator().manual_seed(seed)
    main = torch.randn(s, b, V, generator=g, dtype=torch.float64) * sharp
    mtps = [(torch.randn(s, b, V, generator=g, dtype=torch.float64) * sharp).requires_grad_() for _ in range(gamma)]
    loss_mask = (torch.rand(b, s, generator=g) > 0.2).double()
    labels = torch.randint(0, true_vocab, (b, s), generator=g)
    pos = torch.arange(s).repeat(b, 1)
    if packed:  # second document starts at t=7 in row 0
        pos[0, 7:] = torch.arange(s - 7)
    return main, mtps, loss_mask, labels, pos, true_vocab


@pytest.mark.parametrize("loss_type,kl_weight", [(x, 0.0) for x in LOSSES] + [("tv", 0.3), ("e2e_tv", 0.3)])
def test_matches_dense_reference_value_and_grad(loss_type, kl_weight):
    main, mtps, loss_mask, labels, pos, tv = make_case()
    seg = segment_ids_from_position_ids(pos)
    out = mtp_objective(main, mtps, loss_type, loss_mask, labels=labels, segment_ids=seg,
                        true_vocab_size=tv, kl_weight=kl_weight)
    grads = torch.autograd.grad(out.loss, mtps)
    ref_mtps = [m.detach().clone().requires_grad_() for m in mtps]
    ref_loss, ref_alpha = dense_reference(main, ref_mtps, loss_type, loss_mask, labels, seg, tv, kl_weight)
    ref_grads = torch.autograd.grad(ref_loss, ref_mtps)
    assert torch.allclose(out.loss.double(), ref_loss, rtol=1e-10, atol=1e-12), (out.loss, ref_loss)
    for g, rg in zip(grads, ref_grads):
        assert torch.allclose(g, rg, rtol=1e-8, atol=1e-12)
    assert (grads[0].abs().sum() > 0)
    # logged per-depth acceptance = mean α_k over valid positions
    s = main.shape[0]
    for k in range(len(mtps)):
        v = torch.zeros_like(ref_alpha[k], dtype=torch.bool)
        v[: s - k - 1] = (loss_mask[:, k + 1 :].bool() & (seg[:, : s - k - 1] == seg[:, k + 1 :])).t()
        assert torch.isclose(out.alpha[k].double(), ref_alpha[k][v].mean().detach(), rtol=1e-10)


def test_padded_vocab_is_masked():
    """Probability mass must not leak into padded ids (logits there are arbitrary)."""
    main, mtps, loss_mask, labels, pos, tv = make_case(packed=False)
    a = mtp_objective(main, mtps, "tv", loss_mask, true_vocab_size=tv).loss
    main2 = main.clone()
    main2[..., tv:] = 50.0  # huge logits on padding
    mtps2 = [m.detach().clone() for m in mtps]
    for m in mtps2:
        m[..., tv:] = -20.0
    b = mtp_objective(main2, mtps2, "tv", loss_mask, true_vocab_size=tv).loss
    assert torch.isclose(a, b, rtol=1e-12)


def test_alpha_is_one_minus_tv_and_bounds():
    g = torch.Generator().manual_seed(3)
    z = torch.randn(50, 17, generator=g, dtype=torch.float64)
    p = torch.softmax(torch.randn(50, 17, generator=g, dtype=torch.float64), -1)
    a = vocab_parallel_alpha(z, p)
    q = torch.softmax(z, -1)
    assert torch.allclose(a, 1 - 0.5 * (p - q).abs().sum(-1), atol=1e-12)
    assert torch.all(a >= 0) and torch.all(a <= 1 + 1e-12)
    # p == q: α = 1 and zero gradient
    z2 = torch.randn(5, 9, dtype=torch.float64, requires_grad=True)
    a2 = vocab_parallel_alpha(z2, torch.softmax(z2.detach(), -1))
    assert torch.allclose(a2, torch.ones(5, dtype=torch.float64))


def test_e2e_tv_gradients_only_into_mtp_logits():
    main, mtps, loss_mask, labels, pos, tv = make_case()
    main = main.clone().requires_grad_()
    out = mtp_objective(main, mtps, "e2e_tv", loss_mask, true_vocab_size=tv)
    out.loss.backward()
    assert main.grad is None  # target is detached
    assert all(m.grad is not None for m in mtps)


def test_e2e_tv_equals_simulated_rejection_sampling():
    """1 - L_e2e = E[accepted drafts]/γ, checked by Monte-Carlo rejection sampling of the chain."""
    torch.manual_seed(0)
    s, b, V, gamma = 8, 1, 12, 3
    main = torch.randn(s, b, V, dtype=torch.float64) * 1.5
    mtps = [torch.randn(s, b, V, dtype=torch.float64) * 1.5 for _ in range(gamma)]
    loss_mask = torch.ones(b, s, dtype=torch.float64)
    out = mtp_objective(main, mtps, "e2e_tv", loss_mask)
    predicted = (1 - out.loss.item()) * gamma  # expected accepted drafts, averaged over positions

    p = torch.softmax(main, -1)[:, 0]  # [s, V]
    n_valid = s - gamma
    trials = 40000
    gen = torch.Generator().manual_seed(1)
    accepted_total = torch.zeros(trials, dtype=torch.float64)
    for t in range(n_valid):
        alive = torch.ones(trials, dtype=torch.bool)
        for k in range(1, gamma + 1):
            q = torch.softmax(mtps[k - 1][t, 0], -1)
            target = p[t + k]
            x = torch.multinomial(q, trials, replacement=True, generator=gen)
            u = torch.rand(trials, generator=gen, dtype=torch.float64)
            acc = u < torch.clamp(target[x] / q[x], max=1.0)
            alive &= acc
            accepted_total += alive.double()
    per_trial = accepted_total / n_valid
    mean, std = per_trial.mean().item(), per_trial.std().item() / math.sqrt(trials)
    assert abs(mean - predicted) < 4 * std, (mean, predicted, std)
