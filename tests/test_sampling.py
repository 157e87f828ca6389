"""Speculative verification is lossless and accepts at the predicted rate (strict statistics)."""

import math
from types import SimpleNamespace

import pytest
import torch

from bebop_megatron.rollout.sampling import (
    SamplingTensors,
    draft_tokens,
    expected_tokens_per_step,
    load_token_map,
    process_logits,
    reduced_draft_probs,
    reduced_draft_probs_reference,
    sample_rows,
    round_uniforms,
    sample_with_uniform,
    verify_chain,
)


def gens(n, seed):
    return [torch.Generator().manual_seed(seed * 100003 + i) for i in range(n)]


def chi2_sf(stat: float, dof: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "sampled a zero-probability outcome"
    exp = probs[keep] * n
    stat = ((counts[keep] - exp) ** 2 / exp).sum().item()
    return chi2_sf(stat, int(keep.sum()) - 1)


def rand_dist(V, g, sharp=1.0):
    return torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * sharp, -1)


@pytest.mark.parametrize("mode", ["rejection", "target_only"])
def test_single_draft_acceptance_rate_matches_theory(mode):
    g = torch.Generator().manual_seed(0)
    V, N = 11, 40000
    p, q = rand_dist(V, g, 1.5), rand_dist(V, g, 1.5)
    q[3] = 0.0  # a token the draft never proposes
    q = q / q.sum()
    gs = gens(N, 1)
    P = p.expand(N, 1, V).repeat(1, 2, 1)  # [N, γ+1=2, V]
    Q = q.expand(N, 1, V).clone()
    d = draft_tokens(Q[:, 0], mode, gs)
    res = verify_chain(P, Q, d.unsqueeze(-1), mode, gs)
    rate = res.num_accepted.double().mean().item()
    expected = torch.minimum(p, q).sum().item() if mode == "rejection" else p[q.argmax()].item()
    sigma = math.sqrt(expected * (1 - expected) / N)
    assert abs(rate - expected) < 4 * sigma, (rate, expected, sigma)
    # the emitted first token is distributed as p
    first = torch.where(res.num_accepted > 0, d, res.next_token)
    assert chi2_pvalue(torch.bincount(first, minlength=V).double(), p) > 1e-4


class ToyLM:
    """Context-dependent target and draft over a small vocab: p(x | prev), q_k(x | prev)."""

    def __init__(self, V=5, gamma=3, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.V, self.gamma = V, gamma
        self.T = torch.stack([rand_dist(V, g, 1.2) for _ in range(V)])  # target transitions
        mix = [torch.stack([rand_dist(V, g, 1.2) for _ in range(V)]) for _ in range(gamma)]
        self.Q = [0.5 * self.T + 0.5 * m for m in mix]  # drafts: correlated but different

    def speculative_tokens(self, start, n_tokens, mode, generator):
        """Emit ≥ n_tokens by draft+verify rounds, one request, return the first n_tokens."""
        out, prev = [], start
        while len(out) < n_tokens:
            drafts, qs, p_rows, ctx = [], [], [], prev
            for k in range(self.gamma):
                q = self.Q[k][ctx].unsqueeze(0)
                d = draft_tokens(q, mode, [generator])
                drafts.append(int(d))
                qs.append(q[0])
                ctx = int(d)
            ctx = prev
            for k in range(self.gamma + 1):
                p_rows.append(self.T[ctx])
                if k < self.gamma:
                    ctx = drafts[k]
            res = verify_chain(torch.stack(p_rows).unsqueeze(0), torch.stack(qs).unsqueeze(0),
                               torch.tensor([drafts]), mode, [generator])
            emitted = res.emitted(torch.tensor([drafts]))[0]
            out.extend(emitted)
            prev = emitted[-1]
        return out[:n_tokens]


@pytest.mark.parametrize("mode", ["rejection", "target_only"])
def test_joint_distribution_of_three_tokens_matches_target(mode):
    """Chi-square on the joint law of 3 emitted tokens against the exact target law."""
    toy = ToyLM()
    V, start, N = toy.V, 2, 12000
    gen = torch.Generator().manual_seed(7)
    counts = torch.zeros(V, V, V, dtype=torch.float64)
    for _ in range(N):
        a, b, c = toy.speculative_tokens(start, 3, mode, gen)
        counts[a, b, c] += 1
    exact = toy.T[start].view(V, 1, 1) * toy.T.view(V, V, 1) * toy.T.unsqueeze(0)
    p = chi2_pvalue(counts.flatten(), exact.flatten())
    assert p > 1e-4, p


def test_chi_square_detects_a_lossy_verifier():
    """Sanity of the test itself: accepting every draft (a lossy verifier) must fail it."""
    toy = ToyLM()
    V, start, N = toy.V, 2, 6000
    gen = torch.Generator().manual_seed(3)
    counts = torch.zeros(V ** 3, dtype=torch.float64)
    for _ in range(N):
        a = int(draft_tokens(toy.Q[0][start].unsqueeze(0), "rejection", [gen]))
        b = int(draft_tokens(toy.Q[1][a].unsqueeze(0), "rejection", [gen]))
        c = int(draft_tokens(toy.Q[2][b].unsqueeze(0), "rejection", [gen]))
        counts[a * V * V + b * V + c] += 1
    exact = (toy.T[start].view(V, 1, 1) * toy.T.view(V, V, 1) * toy.T.unsqueeze(0)).flatten()
    assert chi2_pvalue(counts, exact) < 1e-6


def test_greedy_is_argmax_decoding():
    toy = ToyLM(V=7, seed=4)
    gen = torch.Generator().manual_seed(0)
    for mode in ["greedy"]:
        got = toy.speculative_tokens(1, 12, mode, gen)
        ref, prev = [], 1
        for _ in range(12):
            prev = int(toy.T[prev].argmax())
            ref.append(prev)
        assert got == ref


def test_edge_cases_zero_q_empty_residual_equal_dists():
    V = 6
    p = torch.softmax(torch.randn(V, dtype=torch.float64), -1)
    # p == q: always accepted, bonus from p
    P = p.expand(500, 3, V).clone()
    Q = p.expand(500, 2, V).clone()
    gs = gens(500, 9)
    d = torch.stack([draft_tokens(Q[:, k], "rejection", gs) for k in range(2)], -1)
    r = verify_chain(P, Q, d, "rejection", gs)
    assert torch.all(r.num_accepted == 2)
    # draft proposes a token the target gives zero mass: always rejected, never emitted
    p0 = p.clone()
    p0[0] = 0
    p0 /= p0.sum()
    q0 = torch.zeros(V, dtype=torch.float64)
    q0[0] = 1.0
    r = verify_chain(p0.expand(200, 2, V), q0.expand(200, 1, V), torch.zeros(200, 1, dtype=torch.long),
                     "rejection", gens(200, 2))
    assert torch.all(r.num_accepted == 0) and torch.all(r.next_token != 0)


def test_seeded_and_batch_equals_per_request():
    g = torch.Generator().manual_seed(5)
    B, gamma, V = 6, 3, 9
    P = torch.stack([torch.stack([rand_dist(V, g) for _ in range(gamma + 1)]) for _ in range(B)])
    Q = torch.stack([torch.stack([rand_dist(V, g) for _ in range(gamma)]) for _ in range(B)])
    for mode in ["rejection", "target_only", "greedy"]:
        gs = gens(B, 11)
        d = torch.stack([draft_tokens(Q[:, k], mode, gs) for k in range(gamma)], -1)
        batch = verify_chain(P, Q, d, mode, gs).emitted(d)
        single = []
        for b in range(B):
            gb = gens(B, 11)[b]
            db = torch.stack([draft_tokens(Q[b:b + 1, k], mode, [gb]) for k in range(gamma)], -1)
            single.append(verify_chain(P[b:b + 1], Q[b:b + 1], db, mode, [gb]).emitted(db)[0])
        assert batch == single, mode
        gs2 = gens(B, 11)
        d2 = torch.stack([draft_tokens(Q[:, k], mode, gs2) for k in range(gamma)], -1)
        assert verify_chain(P, Q, d2, mode, gs2).emitted(d2) == batch



def test_sampling_flags_skip_only_unused_stages():
    """The host flags (vLLM's all_greedy / no_top_p idiom) only skip stages no row uses: for mixed
    and uniform batches, flagged processing equals running every stage, also after expand()."""
    from dataclasses import replace

    base = {"temperature": 1.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0}
    batches = [[{}, {}], [{"temperature": 0.0}] * 3, [{"temperature": 0.7}, {}],
               [{"top_k": 3}, {"temperature": 0.0}, {"top_p": 0.8}, {"min_p": 0.2, "temperature": 1.3}]]
    torch.manual_seed(0)
    for rows in batches:
        st = SamplingTensors.build([SimpleNamespace(**{**base, **kw}) for kw in rows])
        every = replace(st, any_greedy=True, all_greedy=False, all_unit_temperature=False, any_top_k=True,
                        any_top_p=True, any_min_p=True)
        logits = torch.randn(len(rows), 11) * 3
        assert torch.allclose(process_logits(logits, st), process_logits(logits, every), atol=1e-12), rows
        rep = logits.repeat_interleave(3, dim=0)
        assert torch.allclose(process_logits(rep, st.expand(3)), process_logits(rep, every.expand(3)), atol=1e-12)
    assert SamplingTensors.build([SimpleNamespace(**{**base, "temperature": 0.0})] * 2).all_greedy
    assert not SamplingTensors.build([SimpleNamespace(**base)]).any_top_p

def test_process_logits_filters():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    mk = lambda **kw: SamplingTensors.build([SimpleNamespace(**{"temperature": 1.0, "top_k": -1, "top_p": 1.0,
                                                                 "min_p": 0.0, **kw})])
    full = torch.softmax(logits.double(), -1)
    assert torch.allclose(process_logits(logits, mk()), full)
    assert (process_logits(logits, mk(top_k=2))[0, 2:] == 0).all()
    tp = process_logits(logits, mk(top_p=0.7))
    assert tp[0, 0] > 0 and tp[0, 1] > 0 and (tp[0, 2:] == 0).all()  # 0.57 < 0.7 <= 0.78
    assert (process_logits(logits, mk(min_p=0.3))[0, 2:] == 0).all()
    g0 = process_logits(logits, mk(temperature=0.0))
    assert g0[0, 0] == 1 and g0.sum() == 1
    hot = process_logits(logits, mk(temperature=2.0))
    assert torch.allclose(hot, torch.softmax(logits.double() / 2, -1))
    x = sample_rows(process_logits(logits, mk(top_k=1)), [torch.Generator().manual_seed(0)])
    assert int(x) == 0


def test_tokens_per_step_bound():
    assert expected_tokens_per_step(0.0, 3) == 1.0
    assert expected_tokens_per_step(1.0, 3) == 4.0
    assert abs(expected_tokens_per_step(0.5, 2) - 1.75) < 1e-12


def _fast_rounds(toy, start, n_tokens, mode, N, seed, draft=None):
    """The engine's fast path, vectorised over N independent requests: float32 distributions,
    all of a round's uniforms drawn at once ([N, 2γ+1]), drafts by inverse CDF, verify_chain with
    uniforms. Returns [N, n_tokens] emitted tokens and the per-depth (accepted, reached) counts.
    ``draft(k, ctx)``: the float32 draft distributions [N, V] of depth k (default toy.Q[k][ctx])."""
    g = toy.gamma
    T = toy.T.float()
    Q = [q.float() for q in toy.Q]
    gen = torch.Generator().manual_seed(seed)
    out = torch.full((N, n_tokens), -1, dtype=torch.long)
    filled = torch.zeros(N, dtype=torch.long)
    prev = torch.full((N,), start, dtype=torch.long)
    acc = torch.zeros(g)
    reach = torch.zeros(g)
    rows = torch.arange(N)
    while bool((filled < n_tokens).any()):
        u = torch.rand(N, 2 * g + 1, generator=gen).float()
        drafts, qs, ctx = [], [], prev
        for k in range(g):
            q = Q[k][ctx] if draft is None else draft(k, ctx)
            d = sample_with_uniform(q, u[:, k]) if mode == "rejection" else q.argmax(-1)
            drafts.append(d)
            qs.append(q)
            ctx = d
        D = torch.stack(drafts, 1)
        P = torch.stack([T[prev]] + [T[D[:, k]] for k in range(g)], 1)
        res = verify_chain(P, torch.stack(qs, 1), D, mode, uniforms=u[:, g:])
        m = res.num_accepted
        live = filled < n_tokens
        for k in range(g):
            reach[k] += (live & (m >= k)).sum()
            acc[k] += (live & (m > k)).sum()
        em = torch.cat([D, torch.zeros_like(D[:, :1])], 1)
        em[rows, m] = res.next_token
        for j in range(g + 1):
            put = live & (j <= m) & (filled < n_tokens)
            out[rows[put], filled[put]] = em[put, j]
            filled = filled + put.long()
        prev = torch.where(live, res.next_token, prev)
    return out, acc, reach


@pytest.mark.parametrize("mode", ["rejection", "target_only"])
def test_fast_path_joint_law_and_acceptance(mode):
    """float32 fast path (one draw of uniforms per request and round): chi-square on the joint law
    of 3 tokens, and per-depth acceptance of depth 1 within 4 sigma of Σ min(p, q) / p(argmax q)."""
    toy = ToyLM()
    V, start, N = toy.V, 2, 30000
    out, acc, reach = _fast_rounds(toy, start, 3, mode, N, seed=11)
    counts = torch.bincount(out[:, 0] * V * V + out[:, 1] * V + out[:, 2], minlength=V ** 3).double()
    exact = (toy.T[start].view(V, 1, 1) * toy.T.view(V, V, 1) * toy.T.unsqueeze(0)).flatten()
    assert chi2_pvalue(counts, exact) > 1e-4
    # first round: context `start` for every row
    out1, acc1, reach1 = _fast_rounds(toy, start, 1, mode, N, seed=12)
    p, q = toy.T[start], toy.Q[0][start]
    expected = torch.minimum(p, q).sum().item() if mode == "rejection" else p[q.argmax()].item()
    rate = (acc1[0] / reach1[0]).item()
    assert abs(rate - expected) < 4 * math.sqrt(expected * (1 - expected) / N), (rate, expected)


def test_fast_path_greedy_rows_are_argmax():
    """Temperature-0 rows in the fast path: one-hot p and q make rejection sampling argmax decoding."""
    logits = torch.randn(64, 4, 9)
    st = SamplingTensors.build([SimpleNamespace(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0)] * 64 * 4)
    p = process_logits(logits.view(-1, 9), st, torch.float32).view(64, 4, 9)
    qlog = torch.randn(64, 3, 9)
    st3 = SamplingTensors.build([SimpleNamespace(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0)] * 64 * 3)
    q = process_logits(qlog.view(-1, 9), st3, torch.float32).view(64, 3, 9)
    u = torch.rand(64, 7)
    d = torch.stack([sample_with_uniform(q[:, k], u[:, k]) for k in range(3)], 1)
    assert torch.equal(d, qlog.argmax(-1))
    res = verify_chain(p, q, d, "rejection", uniforms=u[:, 3:])
    ref = verify_chain(p.double(), q.double(), d, "greedy")
    assert torch.equal(res.num_accepted, ref.num_accepted) and torch.equal(res.next_token, ref.next_token)


def test_fast_path_one_row_equals_batched_rows():
    """The one-row verify (accept tests read on the host, the residual row a view) gives each row
    the tokens the batched path gives it, for the same uniforms: rejections at every depth, all γ
    accepted, an empty residual (q == p), zero-mass ids in p."""
    torch.manual_seed(0)
    B, g, V = 400, 3, 11
    p = torch.softmax(torch.randn(B, g + 1, V) * 2, -1)
    p[:, :, 3] = 0  # an id p never emits
    p = p / p.sum(-1, keepdim=True)
    q = torch.softmax(torch.randn(B, g, V) * 2, -1)
    q[: B // 4] = p[: B // 4, :g]  # q == p: every draft passes; the last rows' residuals are empty
    u = torch.rand(B, 2 * g + 1)
    d = torch.stack([sample_with_uniform(q[:, k], u[:, k]) for k in range(g)], 1)
    batched = verify_chain(p, q, d, "rejection", uniforms=u[:, g:])
    assert batched.host_num_accepted is None
    seen = set()
    for i in range(B):
        one = verify_chain(p[i: i + 1], q[i: i + 1], d[i: i + 1], "rejection", uniforms=u[i: i + 1, g:])
        assert one.host_num_accepted == one.num_accepted.tolist() == batched.num_accepted[i: i + 1].tolist()
        assert torch.equal(one.next_token, batched.next_token[i: i + 1])
        seen.add(one.host_num_accepted[0])
    assert seen == set(range(g + 1))  # every acceptance count, 0..γ, was exercised
    # an exactly empty residual at a rejection falls back to p (as the batched path does)
    q1 = p[:1, :g].clone()
    one = verify_chain(p[:1], q1, d[:1], "rejection", uniforms=torch.tensor([[1.0] * g + [0.5]]))
    two = verify_chain(p[:2].clone().copy_(p[:1].expand(2, -1, -1)), q1.expand(2, -1, -1), d[:1].expand(2, -1),
                       "rejection", uniforms=torch.tensor([[1.0] * g + [0.5]] * 2))
    assert one.host_num_accepted == [0] and torch.equal(one.next_token, two.next_token[:1])


# ------------------------------------------------------------ reduced-vocabulary draft (token map)

TEMP1 = SimpleNamespace(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0)


def _toy_head(toy, k):
    """Depth k of the toy draft as a hidden state and an LM head: hidden = one-hot(context),
    head weight [V, V] = log Q_k^T, so logits(ctx) = log Q_k[ctx] and softmax gives Q_k[ctx] back."""
    return toy.Q[k].log().T.contiguous()


def test_reduced_draft_probs_fast_equals_float64_reference():
    """The fast path (the map's LM-head rows only, float32, then scattered) equals the float64
    reference (full-vocab logits, -inf off the map) for every sampling setting, greedy rows included."""
    g = torch.Generator().manual_seed(21)
    V, h, B = 40, 16, 6
    W = torch.randn(V, h, generator=g, dtype=torch.float64)
    hid = torch.randn(B, h, generator=g, dtype=torch.float64)
    ids = load_token_map([7, 3, 3, 11, 0, 25, 39, 18, 30, 12], V)
    assert ids.tolist() == [0, 3, 7, 11, 12, 18, 25, 30, 39]  # sorted, deduplicated
    params = [dict(temperature=1.0), dict(temperature=0.7, top_k=4), dict(temperature=1.3, top_p=0.8),
              dict(temperature=1.0, min_p=0.1), dict(temperature=0.0), dict(temperature=0.9, top_k=50)]
    st = SamplingTensors.build([SimpleNamespace(**{**vars(TEMP1), **kw}) for kw in params])
    ref = reduced_draft_probs_reference(hid, W, ids, st)
    off = torch.ones(V, dtype=torch.bool)
    off[ids] = False
    assert (ref[:, off] == 0).all() and torch.allclose(ref.sum(-1), torch.ones(B, dtype=torch.float64))
    for dtype, tol in [(torch.float64, 1e-12), (torch.float32, 1e-5)]:
        fast = reduced_draft_probs(hid.to(dtype), W[ids].to(dtype), ids, V, st, dtype)
        assert fast.dtype == dtype and (fast[:, off] == 0).all()
        assert (fast.double() - ref).abs().max() < tol, dtype
    assert torch.equal(ref[4].argmax(), ids[(hid[4] @ W[ids].T).argmax()])  # greedy: argmax over the map
    for bad in ([], [[1, 2]], [1.5], [0, V]):
        with pytest.raises(ValueError):
            load_token_map(bad, V)


MAP = [0, 2, 3]  # excludes ids 1 and 4, which have target mass in every context


def _reduced_toy():
    """ToyLM whose drafts are the float64 reference reduced-vocabulary drafts over MAP."""
    toy = ToyLM()
    ids, V = torch.tensor(MAP), toy.V
    st = SamplingTensors.build([TEMP1] * V)
    full_q = [q.clone() for q in toy.Q]
    toy.Q = [reduced_draft_probs_reference(torch.eye(V, dtype=torch.float64), _toy_head(toy, k), ids, st)
             for k in range(toy.gamma)]
    assert all(torch.allclose(toy.Q[k][:, MAP], full_q[k][:, MAP] / full_q[k][:, MAP].sum(-1, keepdim=True))
               for k in range(toy.gamma))
    assert (toy.T[:, [1, 4]].sum(-1) > 0.1).all()  # the excluded ids carry real target mass
    return toy


def test_reduced_draft_vocab_joint_law_matches_target_reference():
    """float64 reference path: drafts drawn from q that is zero off the token map, verified
    against the full-vocab target: the joint law of 3 emitted tokens is the target's (chi-square),
    the ids off the map are emitted (through the residual / bonus), never drafted, and depth-1
    acceptance is Σ_{x∈map} min(p, q) within 4 sigma."""
    toy = _reduced_toy()
    V, start, N = toy.V, 2, 12000
    gen = torch.Generator().manual_seed(17)
    counts = torch.zeros(V, V, V, dtype=torch.float64)
    for _ in range(N):
        a, b, c = toy.speculative_tokens(start, 3, "rejection", gen)
        counts[a, b, c] += 1
    exact = toy.T[start].view(V, 1, 1) * toy.T.view(V, V, 1) * toy.T.unsqueeze(0)
    assert chi2_pvalue(counts.flatten(), exact.flatten()) > 1e-4
    assert counts[1].sum() > 0 and counts[:, 4].sum() > 0
    # depth-1 acceptance at a fixed context
    p, q = toy.T[start], toy.Q[0][start]
    M = 40000
    gs = gens(M, 5)
    d = draft_tokens(q.expand(M, V), "rejection", gs)
    assert set(d.unique().tolist()) <= set(MAP)
    res = verify_chain(p.expand(M, 2, V), q.expand(M, 1, V), d.unsqueeze(-1), "rejection", gs)
    expected = torch.minimum(p, q).sum().item()
    assert expected <= p[MAP].sum().item() + 1e-12
    rate = res.num_accepted.double().mean().item()
    assert abs(rate - expected) < 4 * math.sqrt(expected * (1 - expected) / M), (rate, expected)
    first = torch.where(res.num_accepted > 0, d, res.next_token)
    assert chi2_pvalue(torch.bincount(first, minlength=V).double(), p) > 1e-4


def test_reduced_draft_vocab_fast_path_joint_law_and_acceptance():
    """The engine's fast path with the map: drafts from reduced_draft_probs (the map's head rows,
    float32), one draw of uniforms per request and round; chi-square on the joint law of 3 tokens
    and depth-1 acceptance within 4 sigma of Σ_{x∈map} min(p, q)."""
    toy = ToyLM()
    V, start, N = toy.V, 2, 30000
    ids = torch.tensor(MAP)
    st = SamplingTensors.build([TEMP1] * N)
    heads = [_toy_head(toy, k)[ids].float() for k in range(toy.gamma)]
    eye = torch.eye(V)

    def draft(k, ctx):
        q = reduced_draft_probs(eye[ctx], heads[k], ids, V, st, torch.float32)
        assert (q[:, [1, 4]] == 0).all()
        return q

    out, acc, reach = _fast_rounds(toy, start, 3, "rejection", N, seed=13, draft=draft)
    counts = torch.bincount(out[:, 0] * V * V + out[:, 1] * V + out[:, 2], minlength=V ** 3).double()
    exact = (toy.T[start].view(V, 1, 1) * toy.T.view(V, V, 1) * toy.T.unsqueeze(0)).flatten()
    assert chi2_pvalue(counts, exact) > 1e-4
    assert bool(((out == 1) | (out == 4)).any())
    _, acc1, reach1 = _fast_rounds(toy, start, 1, "rejection", N, seed=14, draft=draft)
    p = toy.T[start]
    q = reduced_draft_probs_reference(eye[start:start + 1].double(), _toy_head(toy, 0), ids,
                                      SamplingTensors.build([TEMP1]))[0]
    expected = torch.minimum(p, q).sum().item()
    rate = (acc1[0] / reach1[0]).item()
    assert abs(rate - expected) < 4 * math.sqrt(expected * (1 - expected) / N), (rate, expected)


def test_fast_sampler_never_picks_a_zero_mass_id():
    """On CPU the fast inverse CDF has no guard: it counts CDF entries below u·total. At the extremes of u
    (the smallest uniform ``round_uniforms`` gives, and 1.0, which a float64 draw rounds to in
    float32) and on flat CDF stretches, unnormalised rows included, it must still land on mass."""
    tiny = torch.finfo(torch.float32).tiny
    rows = torch.tensor([[0.0, 0.0, 0.3, 0.0, 0.7, 0.0],   # zeros at both ends and inside
                         [0.5, 0.0, 0.0, 0.0, 0.0, 0.5],
                         [0.0, 0.0, 0.0, 0.0, 0.0, 2e-3],  # an unnormalised residual
                         [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    for u in (tiny, 1e-30, 0.3, 0.5, float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))), 1.0):
        tok = sample_with_uniform(rows, torch.full((rows.shape[0],), u))
        assert bool((rows.gather(1, tok[:, None]) > 0).all()), (u, tok.tolist())
    assert float(round_uniforms(gens(4, 0), 1000).min()) > 0.0
