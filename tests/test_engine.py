"""Embedded engine: HF-layout model equals transformers, MTP drafting equals a cache-free
training-style recomputation, greedy speculation equals plain decoding, stops, batching."""

import itertools
import json
import math
import re
from collections import deque

import pytest
import torch

from bebop_megatron.data import CharTokenizer
from bebop_megatron.rollout.engine import Engine, RequestError, SamplingParams, SpecConfig, step_counts
from bebop_megatron.rollout.modeling import CausalLMWithMTP, make_batch_index
from bebop_megatron.rollout.sampling import SamplingTensors, process_logits
from tests.tiny_models import make_hf_checkpoint


@pytest.fixture(scope="module")
def qwen3_dir(tiny_checkpoint):
    return tiny_checkpoint(seed=0), None  # (folder, unused): the session's shared tiny Qwen3 + 3 MTP heads


@pytest.mark.parametrize("arch,tie", [("qwen3", False), ("qwen2", True)])
def test_logits_equal_transformers(tmp_path, arch, tie):
    hf = make_hf_checkpoint(tmp_path, arch, "qwen3_next", num_mtp=1, tie=tie)
    ours = CausalLMWithMTP.from_pretrained(tmp_path)
    assert ours.config.qk_norm == (arch == "qwen3") and ours.config.qkv_bias == (arch == "qwen2")
    ids = torch.randint(0, 64, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    cache = ours.new_cache(2, 32, "trunk")
    normed, _ = ours.trunk(ids, cache, make_batch_index([0, 1], [0, 0], [19, 19], "cpu"))
    assert (ours.logits(normed) - ref).abs().max() < 1e-4
    # incremental decoding through the cache gives the same logits as the full forward
    cache2 = ours.new_cache(1, 32, "trunk")
    ours.trunk(ids[:1, :10], cache2, make_batch_index([0], [0], [10], "cpu"))
    step, _ = ours.trunk(ids[:1, 10:13], cache2, make_batch_index([0], [10], [3], "cpu"))
    assert (ours.logits(step[0]) - ref[0, 10:13]).abs().max() < 1e-4
    # 13 rows of different lengths (attention by matmul from MANUAL_ATTENTION_MIN_ROWS rows), then one step each
    ids13 = torch.randint(0, 64, (13, 12), generator=torch.Generator().manual_seed(2))
    lens = [4 + i % 8 for i in range(13)]
    with torch.no_grad():
        ref13 = hf(ids13).logits
    cache3 = ours.new_cache(13, 32, "trunk")
    pre, _ = ours.trunk(ids13[:, :11], cache3, make_batch_index(list(range(13)), [0] * 13, lens, "cpu", N=11))
    nxt = torch.stack([ids13[i, n] for i, n in enumerate(lens)])[:, None]
    step13, _ = ours.trunk(nxt, cache3, make_batch_index(list(range(13)), lens, [1] * 13, "cpu", N=1))
    for i, n in enumerate(lens):
        assert (ours.logits(pre[i, :n]) - ref13[i, :n]).abs().max() < 1e-4
        assert (ours.logits(step13[i, 0]) - ref13[i, n]).abs().max() < 1e-4


def test_mtp_input_fold_equals_its_definition_and_follows_weight_updates(qwen3_dir, monkeypatch):
    """The folded MTP input (a gathered enorm(E)·W_eᵀ table plus W_h·hnorm(h)) equals
    eh_proj([enorm(emb(x)), hnorm(h)]); an in-place update of any weight it reads rebuilds the
    table; no table above MTP_FOLD_MAX_BYTES, with autograd on, or for inference-mode weights."""
    import bebop_megatron.rollout.modeling as modeling

    m = CausalLMWithMTP.from_pretrained(qwen3_dir[0])
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, 5, m.config.hidden_size, generator=gen)
    ids = torch.randint(0, m.config.vocab_size, (2, 5), generator=gen)

    def definition(i):
        mm = m.mtp[i]
        return mm.eh_proj(torch.cat([mm.enorm(m.embed_tokens(ids)), mm.hnorm(h)], dim=-1))

    with torch.no_grad():
        for i in range(len(m.mtp)):
            assert torch.allclose(m.mtp_input(i, h, ids), definition(i), atol=1e-5)
        assert set(m._mtp_folds) == set(range(len(m.mtp)))
        for w in (m.mtp[0].eh_proj.weight, m.mtp[0].enorm.weight, m.embed_tokens.weight):
            w.mul_(1.5)  # in place, as Engine.update_weights copies
            assert torch.allclose(m.mtp_input(0, h, ids), definition(0), atol=1e-5)
        monkeypatch.setattr(modeling, "MTP_FOLD_MAX_BYTES", 0)
        m._mtp_folds.clear()
        assert torch.allclose(m.mtp_input(1, h, ids), definition(1), atol=1e-5) and not m._mtp_folds
    monkeypatch.setattr(modeling, "MTP_FOLD_MAX_BYTES", 64 << 20)
    # with autograd on, the (detached) table is not used: gradients reach the embedding and the norms
    m.mtp_input(0, h, ids).sum().backward()
    assert not m._mtp_folds and m.embed_tokens.weight.grad is not None and m.mtp[0].enorm.weight.grad is not None
    # inference-mode weights have no version counter to key the table on: the unfolded path runs
    with torch.inference_mode():
        mi = CausalLMWithMTP.from_pretrained(qwen3_dir[0])
        mm = mi.mtp[0]
        ref = mm.eh_proj(torch.cat([mm.enorm(mi.embed_tokens(ids)), mm.hnorm(h)], dim=-1))
        assert torch.allclose(mi.mtp_input(0, h, ids), ref, atol=1e-5)
    assert not mi._mtp_folds


def test_rope_with_signed_sin_equals_the_textbook_rotation():
    """x·cos + swap_halves(x)·[-sin, sin] is x·cos + rotate_half(x)·sin bit for bit, for full and
    partial RoPE (the first rd dims of each head)."""
    from bebop_megatron.rollout.modeling import _rope_apply, _rotate_half

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 6, 16, generator=gen)
    for rd in (16, 8):
        ang = torch.rand(1, 5, 1, rd // 2, generator=gen) * 10
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        signed = torch.cat([-ang.sin(), ang.sin()], -1)
        r = x[..., :rd]
        ref = torch.cat([r * cos + _rotate_half(r) * sin, x[..., rd:]], dim=-1)
        assert torch.equal(_rope_apply(x, cos, signed), ref)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_fused_cpu_weights_equal_the_modules_and_follow_weight_updates(tmp_path, arch, monkeypatch):
    """Attention (q/k/v as one matmul, q and k normed and rotated together), MLP (gate and up as one)
    and the LM head run from fused [in, out] copies of their weights (``_fast_weights``): the same
    logits as the modules themselves; an in-place update of any weight rebuilds the copies; none
    above FAST_WEIGHTS_MAX_BYTES or with autograd on (gradients then reach the weights)."""
    import bebop_megatron.rollout.modeling as modeling

    make_hf_checkpoint(tmp_path, arch, "qwen3_next", num_mtp=1)
    m = CausalLMWithMTP.from_pretrained(tmp_path)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))

    def logits(fast: bool):
        monkeypatch.setattr(modeling, "FAST_WEIGHTS_MAX_BYTES", (8 << 20) if fast else 0)
        for mod in m.modules():
            mod.__dict__.pop("_fast", None)
        normed, _ = m.trunk(ids, m.new_cache(2, 16, "trunk"), make_batch_index([0, 1], [0, 0], [9, 9], "cpu"))
        with torch.no_grad():
            out = m.logits(normed)
        built = [mod.__dict__["_fast"][1] is not None for mod in (m.layers[0].self_attn, m.layers[0].mlp, m)]
        assert built == [fast] * 3
        return out

    ref = logits(False)
    assert (logits(True) - ref).abs().max() < 1e-5
    layer = m.layers[1]
    with torch.no_grad():  # in place, as Engine.update_weights copies; the caches stay from the run above
        for w in (layer.self_attn.k_proj.weight, layer.self_attn.q_norm.weight if arch == "qwen3" else
                  layer.self_attn.v_proj.bias, layer.mlp.up_proj.weight, m.lm_head.weight):
            w.mul_(1.5)
    normed, _ = m.trunk(ids, m.new_cache(2, 16, "trunk"), make_batch_index([0, 1], [0, 0], [9, 9], "cpu"))
    with torch.no_grad():
        fast = m.logits(normed)
    assert (fast - logits(False)).abs().max() < 1e-5 and (fast - ref).abs().max() > 1e-2
    # a replaced parameter (not written in place: a new tensor with its own version counter) is seen too
    logits(True)
    layer.mlp.down_proj.weight = torch.nn.Parameter(layer.mlp.down_proj.weight.detach() * 2)
    normed, _ = m.trunk(ids, m.new_cache(2, 16, "trunk"), make_batch_index([0, 1], [0, 0], [9, 9], "cpu"))
    with torch.no_grad():
        fast = m.logits(normed)
    assert (fast - logits(False)).abs().max() < 1e-5
    # a move to another dtype (new storage, versions unchanged) rebuilds them too
    monkeypatch.setattr(modeling, "FAST_WEIGHTS_MAX_BYTES", 8 << 20)
    logits(True)
    m.double()
    normed, _ = m.trunk(ids, m.new_cache(2, 16, "trunk"), make_batch_index([0, 1], [0, 0], [9, 9], "cpu"))
    with torch.no_grad():
        fast64 = m.logits(normed)
    assert fast64.dtype == torch.float64 and (fast64 - logits(False)).abs().max() < 1e-9
    m.float()
    # autograd on: the modules run, and gradients reach their weights
    monkeypatch.setattr(modeling, "FAST_WEIGHTS_MAX_BYTES", 8 << 20)
    b = make_batch_index([0], [0], [9], "cpu")
    x = m.embed_tokens(ids[:1])
    cos, sin = m._rope_for(b, x.dtype)
    layer(x, cos, sin, m.new_cache(1, 16, "trunk").layers[1], b).sum().backward()
    assert layer.self_attn.q_proj.weight.grad is not None and layer.mlp.gate_proj.weight.grad is not None


@pytest.mark.parametrize("nh,nkv", [(4, 2), (4, 4), (6, 1)])
def test_matmul_attention_equals_sdpa(monkeypatch, nh, nkv):
    """``_attend``'s matmul path (batches of MANUAL_ATTENTION_MIN_ROWS rows and more on a CPU) equals
    SDPA with the boolean mask: rows of different starts and lengths, grouped-query heads."""
    import bebop_megatron.rollout.modeling as modeling

    gen = torch.Generator().manual_seed(0)
    B, N, hd = 13, 4, 8
    starts, lens = [int(x) for x in torch.randint(0, 20, (B,), generator=gen)], [1 + i % N for i in range(B)]
    b = make_batch_index(list(range(B)), starts, lens, "cpu", N=N)
    q = torch.randn(B, N, nh, hd, generator=gen)
    keys, values = torch.randn(2, B, nkv, b.span, hd, generator=gen)
    fast = modeling._attend(q, keys, values, b)
    monkeypatch.setattr(modeling, "MANUAL_ATTENTION_MIN_ROWS", B + 1)
    ref = modeling._attend(q, keys, values, b)
    assert fast.shape == (B, N, nh * hd) and (fast - ref).abs().max() < 1e-5
    # half precision stays on SDPA (its CPU kernel keeps the scores in float32)
    monkeypatch.setattr(modeling, "MANUAL_ATTENTION_MIN_ROWS", 12)
    qh, kh, vh = q.bfloat16(), keys.bfloat16(), values.bfloat16()
    sdpa = torch.nn.functional.scaled_dot_product_attention(qh.transpose(1, 2), kh, vh, attn_mask=b.attn_mask,
                                                            enable_gqa=nh != nkv)
    assert torch.equal(modeling._attend(qh, kh, vh, b), sdpa.transpose(1, 2).reshape(B, N, nh * hd))


def test_single_row_batch_index_views_equal_the_general_path():
    """One row built on the host reads its causal mask and RoPE rows as slices of cached tables;
    they equal the general path's (tensor-built) mask and gathered RoPE rows."""
    from bebop_megatron.rollout.modeling import LMConfig

    m = CausalLMWithMTP(LMConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    for start, n in [(0, 1), (0, 7), (10, 1), (10, 4), (5000, 3)]:
        one = make_batch_index([2], [start], [n], "cpu")
        ref = make_batch_index(torch.tensor([2]), torch.tensor([start]), torch.tensor([n]))
        assert one.single_start == start and ref.single_start is None
        assert one.attn_mask.shape == ref.attn_mask.shape and torch.equal(one.attn_mask, ref.attn_mask)
        for a, b in zip(m._rope_for(one, torch.float32), m._rope_for(ref, torch.float32)):
            assert torch.equal(a, b)
    two = make_batch_index([0, 1], [3, 5], [2, 2], "cpu")
    assert two.single_start is None and two.attn_mask.shape == (2, 1, 2, 7)


def full_mtp_distributions(model, tokens, gamma, st):
    """Megatron-style (no cache) MTP chain over a whole sequence: q_k at every position."""
    T = len(tokens)
    ids = torch.tensor([tokens])
    normed, h = model.trunk(ids, model.new_cache(1, T + 1, "trunk"), make_batch_index([0], [0], [T], "cpu"))
    out = {}
    for k in range(1, gamma + 1):
        n = T - k
        b = make_batch_index([0], [0], [n], "cpu")
        h = model.mtp_step(k - 1, h[:, :n], ids[:, k: k + n], model.new_cache(1, T + 1, "mtp"), b)
        out[k] = process_logits(model.logits(h[0]), st.expand(n))  # [n, V]
    return out


def _force_acceptance(monkeypatch, num_accepted, next_token=None):
    """Make the engine's verify accept ``num_accepted(res, drafts)`` drafts per row (the real verify
    still runs); the next token is ``next_token(res, p, m)``, by default the real one."""
    import bebop_megatron.rollout.engine as engine_mod

    real = engine_mod.verify_chain

    def forced(p, q, drafts, mode, uniforms=None):
        res = real(p, q, drafts, mode, uniforms=uniforms)
        m = num_accepted(res, drafts)
        return type(res)(m, res.next_token if next_token is None else next_token(res, p, m))

    monkeypatch.setattr(engine_mod, "verify_chain", forced)


@pytest.mark.parametrize("forced", [False, True])  # True: every acceptance count 0..γ, per row and round
@pytest.mark.parametrize("rows", [4, 1])  # 1: the single-row draft pass (slices, no gathers)
@pytest.mark.parametrize("layout,gammas", [("deepseek", [3] * 6), ("qwen3_next", [3, 3, 1, 0, 0, 2, 1, 3]),
                                            ("deepseek", [3, 3, 2, 2, 2])])  # the last: drafts at γ = 2 < 3
def test_draft_distributions_equal_cache_free_recomputation(tmp_path, monkeypatch, layout, gammas, rows, forced):
    """The lean round (each depth once, extend fused with the draft; the entries a round computed
    from drafts that were then accepted are kept) drafts exactly what a cache-free megatron-style
    recomputation gives, also after rounds at a smaller γ (stale depths) and when the drafts
    themselves are at a smaller γ than the engine's (carry rows are strided by the engine's γ; the
    rows sit in slots 1.. so a wrong stride lands in another depth or request). A random model
    accepts few drafts, so ``forced`` overrides the verify's acceptance count (the cache must
    follow the committed tokens whatever the verify decided)."""
    make_hf_checkpoint(tmp_path, "qwen3", layout, num_mtp=3, scale=2.0)
    model = CausalLMWithMTP.from_pretrained(tmp_path, dtype=torch.float64)
    gamma = 3
    eng = Engine(model, spec=SpecConfig("mtp", gamma, "rejection"), max_running=rows + 1, max_len=96,
                 sampling_dtype=torch.float64)
    eng.free_slots.remove(0)  # slots 1..rows
    moved = []
    if forced:
        calls = itertools.count()

        def cycle(res, drafts):
            c, g = next(calls), drafts.shape[1]
            m = torch.tensor([g - (c + i) % (g + 1) for i in range(drafts.shape[0])])
            moved.append(int((m > 0).sum()))
            return m

        _force_acceptance(monkeypatch, cycle, lambda res, p, m: torch.where(
            m == res.num_accepted, res.next_token, (res.next_token + 1) % 64))
    prompts = [[10, 11, 12, 13, 14, 15, 16, 17], [9], [1, 2], [3, 4, 5, 6, 7]][:rows]
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=60, temperature=1.0, seed=i)) for i, p in enumerate(prompts)]
    eng.step()  # prefill
    for g in gammas:
        (eng._speculative_round(reqs, g) if g else eng._plain_round(reqs))
    assert all(not r.finished for r in reqs) and all(r.verify_ct >= 4 for r in reqs)
    if forced:
        assert sum(moved) >= 4, moved
        monkeypatch.undo()
    st = SamplingTensors.build([r.params for r in reqs])
    L = torch.tensor([len(r.tokens) for r in reqs])
    g = gammas[-1]  # drafts at the schedule's last γ
    u = torch.rand(len(reqs), g, dtype=torch.float64)
    drafts, q = eng._draft([r.slot for r in reqs], L, st, g, u)
    assert [r.slot for r in reqs] == list(range(1, rows + 1))
    for i, r in enumerate(reqs):
        L = len(r.tokens)
        seq = r.tokens + drafts[i, : g - 1].tolist()  # drafts stand in for the future tokens
        ref = full_mtp_distributions(model, seq, g, SamplingTensors.build([r.params]))
        for k in range(1, g + 1):
            assert torch.allclose(q[i, k - 1], ref[k][L - 2], atol=1e-10), (i, k)


@pytest.mark.parametrize("m", [0, 1, 3])
def test_depths_run_over_the_accepted_positions_only(tmp_path, monkeypatch, m):
    """After a round that accepted m of γ = 3 drafts, depth k runs over m + 1 positions where its
    entries from the drafts were kept (m >= k - 1), else over k (the entries that read a rejected
    draft): 4+4+4 after m = 3 (it was 4+5+6 when every draft-fed entry was recomputed)."""
    make_hf_checkpoint(tmp_path, "qwen3", "deepseek", num_mtp=3, scale=2.0)
    model = CausalLMWithMTP.from_pretrained(tmp_path, dtype=torch.float64)
    eng = Engine(model, spec=SpecConfig("mtp", 3, "rejection"), max_running=1, max_len=96)
    _force_acceptance(monkeypatch, lambda res, drafts: torch.full_like(res.num_accepted, m))
    (r,) = [eng.add_request([5, 6, 7, 8, 9, 10], SamplingParams(max_new_tokens=40, temperature=1.0, seed=0,
                                                                 ignore_eos=True))]
    eng.step()  # prefill
    work = []
    for _ in range(4):
        eng._speculative_round([r], 3)
        work.append(eng._draft_positions)
    assert work[1:] == [sum(m + 1 if m >= k - 1 else k for k in (1, 2, 3))] * 3, work
    # the keep reads only each depth's last k outputs (L-1-k..L-2), and none are kept past it (a
    # catch-up round's outputs span a whole prompt per depth)
    assert eng._draft_tails == [None]
    st = SamplingTensors.build([r.params])
    eng._draft([r.slot], [len(r.tokens)], st, 3, torch.rand(1, 3))
    assert [tuple(t.shape) for t, _ in eng._draft_tails[1:]] == [(1, 1, 48), (1, 2, 48), (1, 3, 48)]


@pytest.mark.parametrize("verify", ["rejection", "target_only"])
def test_greedy_speculation_equals_plain_decoding(qwen3_dir, verify):
    d, _ = qwen3_dir
    model = CausalLMWithMTP.from_pretrained(d, dtype=torch.float64)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13]]
    sp = SamplingParams(max_new_tokens=24, temperature=0.0)
    plain = Engine(model, spec=SpecConfig("none"), max_running=4, max_len=64).generate(prompts, sp)
    spec = Engine(model, spec=SpecConfig("mtp", 3, verify), max_running=4, max_len=64).generate(prompts, sp)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    assert all(len(r.output_ids) == 24 for r in spec)
    # each request alone gives the same tokens as in the batch (no cross-request leakage)
    for p, r in zip(prompts, plain):
        alone = Engine(model, spec=SpecConfig("mtp", 3, verify), max_running=1, max_len=64).generate([p], sp)[0]
        assert alone.output_ids == r.output_ids


def test_continuous_batching_more_requests_than_slots(qwen3_dir):
    d, _ = qwen3_dir
    model = CausalLMWithMTP.from_pretrained(d, dtype=torch.float64)
    prompts = [[i % 60 + 1, (3 * i) % 60 + 1] for i in range(10)]
    sp = SamplingParams(max_new_tokens=9, temperature=0.0)
    eng = Engine(model, spec=SpecConfig("mtp", 2, "rejection"), max_running=3, max_len=64)
    out = eng.generate(prompts, sp)
    ref = Engine(model, spec=SpecConfig("none"), max_running=10, max_len=64).generate(prompts, sp)
    assert [r.output_ids for r in out] == [r.output_ids for r in ref]
    assert len(eng.free_slots) == 3 and not eng.running


def test_seeded_sampling_is_reproducible_and_logprobs_match(qwen3_dir):
    d, _ = qwen3_dir
    model = CausalLMWithMTP.from_pretrained(d, dtype=torch.float64)
    sp = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.95, seed=123)
    eng = lambda: Engine(model, spec=SpecConfig("mtp", 3, "rejection"), max_running=2, max_len=64)
    a = eng().generate([[5, 6, 7]], sp, return_logprob=True)[0]
    b = eng().generate([[5, 6, 7]], sp, return_logprob=True)[0]
    assert a.output_ids == b.output_ids and len(a.output_logprobs) == 16
    # logprobs are log softmax(logits / T) of the emitted tokens under the target
    seq = [5, 6, 7] + a.output_ids
    normed, _ = model.trunk(torch.tensor([seq]), model.new_cache(1, 64, "trunk"),
                            make_batch_index([0], [0], [len(seq)], "cpu"))
    lp = torch.log_softmax(model.logits(normed[0]).double() / 0.8, -1)
    ref = [lp[2 + j, t].item() for j, t in enumerate(a.output_ids)]
    assert max(abs(x - y) for x, y in zip(a.output_logprobs, ref)) < 1e-9


def test_stops_eos_and_validation(tmp_path):
    make_hf_checkpoint(tmp_path, "qwen3", "deepseek", num_mtp=2, scale=2.0)
    model = CausalLMWithMTP.from_pretrained(tmp_path, dtype=torch.float64)
    tok = CharTokenizer()
    eng = Engine(model, tokenizer=tok, spec=SpecConfig("mtp", 2), max_running=2, max_len=64)
    base = eng.generate([[5, 6]], SamplingParams(max_new_tokens=20, temperature=0.0))[0].output_ids
    stop_tok = base[6]
    first = base.index(stop_tok)
    r = eng.generate([[5, 6]], SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=[stop_tok]))[0]
    assert r.output_ids == base[: first + 1] and r.finish_reason["type"] == "stop"
    eng.eos_id = stop_tok
    r = eng.generate([[5, 6]], SamplingParams(max_new_tokens=20, temperature=0.0))[0]
    assert r.output_ids == base[: first + 1]
    r = eng.generate([[5, 6]], SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True))[0]
    assert r.output_ids == base and r.finish_reason == {"type": "length", "length": 20}
    eng.eos_id = None
    text = tok.decode(base)
    stop_str = text[3:5] if len(text) >= 5 else text[-1:]
    if stop_str:
        r = eng.generate([[5, 6]], SamplingParams(max_new_tokens=20, temperature=0.0, stop=[stop_str]))[0]
        assert stop_str in tok.decode(r.output_ids) and r.finish_reason == {"type": "stop", "matched": stop_str}
        assert len(r.output_ids) < 20
    for bad in [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=0), dict(max_new_tokens=-2)]:
        with pytest.raises(RequestError):
            eng.add_request([1, 2], SamplingParams(**bad))
    with pytest.raises(RequestError, match="out of range"):
        eng.add_request([1, 999], SamplingParams())
    with pytest.raises(RequestError, match="empty prompt"):
        eng.add_request([], SamplingParams())
    with pytest.raises(RequestError, match="context length"):
        eng.add_request([1] * 10, SamplingParams(max_new_tokens=100))
    r = eng.add_request([1, 2], SamplingParams(max_new_tokens=50, temperature=1.0))
    eng.step()
    assert eng.abort(r.rid) == 1
    eng.step()
    assert r.finish_reason["type"] == "abort" and len(eng.free_slots) == 2



def test_step_counts_rule():
    # all 3 drafts accepted, the first is a stop token: 1 draft could be emitted, it was accepted
    assert step_counts(3, 3, 1, 40, 1) == (1, 1, 1)
    # 2 tokens left before the length limit: drafts 3.. could never be emitted
    assert step_counts(3, 3, 2, 2, None) == (2, 2, 2)
    # draft 2 rejected: 3 proposed, 1 accepted, depths 1 and 2 reached
    assert step_counts(3, 1, 2, 40, None) == (3, 1, 2)
    # the resampled token (not a draft) is a stop: all drafts could have been emitted
    assert step_counts(3, 0, 1, 40, None) == (3, 0, 1)


def test_last_rounds_draft_no_further_than_the_tokens_left(qwen3_dir):
    """A round drafts at most the largest tokens left in the batch (drafts past it are never emitted),
    and a row's tokens do not change with that: requests with 1-3 tokens left run rounds at γ < 3, and
    their outputs are the prefixes of the same seeded requests run with a long budget (at γ = 3)."""
    d, _ = qwen3_dir
    model = CausalLMWithMTP.from_pretrained(d, dtype=torch.float64)
    prompts = [[i % 60 + 1, (7 * i) % 60 + 2, 3] for i in range(6)]

    def run(budgets):
        eng = Engine(model, spec=SpecConfig("mtp", 3, "rejection"), max_running=6, max_len=64)
        reqs = eng.generate(prompts, [SamplingParams(max_new_tokens=n, temperature=1.0, seed=i, ignore_eos=True)
                                      for i, n in enumerate(budgets)])
        return eng, [r.output_ids for r in reqs]

    long_eng, long = run([12] * 6)
    for budgets in ([2] * 6, [3] * 6, [2, 3, 4, 2, 3, 4]):
        eng, out = run(budgets)
        assert out == [o[:n] for o, n in zip(long, budgets)]
        assert sum(eng.gamma_hist[1:3]) > 0 and eng.gamma_hist[0] == 0  # capped rounds, none plain
        assert set(eng._chain_yield) <= {3}  # a capped round says nothing of γ < 3's lost drafts
    assert sum(long_eng.gamma_hist[1:3]) > 0  # the long run's last round too


def test_acceptance_metric_counts_only_drafts_that_could_be_emitted(qwen3_dir):
    """Short answers ending in a stop token (or at the length limit) do not lower the acceptance
    rate: seeded runs that stop early are prefixes of the long run (randomness is per request and round), and their counters equal the
    long run's over the same verify steps minus only the drafts that could never be emitted."""
    d, _ = qwen3_dir
    model = CausalLMWithMTP.from_pretrained(d, dtype=torch.float64)
    prompts = [[i % 60 + 1, (7 * i) % 60 + 2, 3] for i in range(8)]
    g = 3

    def run(**kw):
        eng = Engine(model, spec=SpecConfig("mtp", g, "rejection"), max_running=8, max_len=96)
        reqs = [eng.add_request(p, SamplingParams(temperature=1.0, seed=i, **kw), spec_record_topk=1)
                for i, p in enumerate(prompts)]
        while not all(r.finished for r in reqs):
            eng.step()
        return eng, reqs

    eng, long = run(max_new_tokens=30, ignore_eos=True)
    for e, reqs in [(eng, long)] + [run(max_new_tokens=30, stop_token_ids=[long[i].output_ids[5 + i]]) for i in (0, 1)] \
            + [run(max_new_tokens=n, ignore_eos=True) for n in (4, 7)]:
        st = e.stats()
        assert st["spec_verify_ct"] == sum(r.verify_ct for r in reqs) > 0
        # every output token but the prefill's comes from a verify step
        assert sum(r.verify_tokens for r in reqs) == sum(len(r.output_ids) - 1 for r in reqs)
        assert abs(st["avg_spec_accept_length"] - sum(len(r.output_ids) - 1 for r in reqs) / st["spec_verify_ct"]) < 1e-12
        assert st["spec_accepted_drafts"] == sum(r.accepted for r in reqs) == sum(st["spec_accepted_per_depth"])
        for r, ref in zip(reqs, long):
            assert r.output_ids == ref.output_ids[: len(r.output_ids)]
            n = r.verify_ct
            # the same steps as the long run, the last one possibly cut short
            assert [x["accepted"] for x in r.spec_records[:-1]] == [x["accepted"] for x in ref.spec_records[: max(n - 1, 0)]]
            assert r.accepted_per_depth[0] <= r.reached_per_depth[0] == n
            if r is ref:
                assert r.proposed == g * n - sum(max(0, g - (30 - 1 - sum(y["accepted"] + 1 for y in r.spec_records[:j])))
                                                 for j in range(n))
            # proposed = Σ over steps of the drafts that could still be emitted
            cnt, prop = 1, 0
            stops = set(r.params.stop_token_ids)
            for x in r.spec_records:
                acc = x["accepted"]
                emit = min(acc + 1, len(r.output_ids) - cnt)
                stop_at = next((j for j in range(1, min(acc, emit) + 1) if r.output_ids[cnt + j - 1] in stops), None)
                prop += step_counts(g, acc, emit, r.params.max_new_tokens - cnt, stop_at)[0]
                cnt += emit
            assert cnt == len(r.output_ids) and prop == r.proposed
            # long-run acceptance over the same steps, drafts that could be emitted only
            for k in range(g - 1):
                assert r.reached_per_depth[k + 1] <= r.accepted_per_depth[k]
    assert eng.stats()["spec_accepted_drafts"] > 0


# ------------------------------------------------------------ reduced-vocabulary draft (token map)

EVEN = list(range(0, 64, 2))  # a token map that leaves out every odd id


def test_reduced_draft_vocab_drafts_equal_masked_cache_free_recomputation(tmp_path):
    """With SpecConfig(draft_vocab=...) the engine's draft distributions are the cache-free MTP
    distributions restricted to the map and renormalised (0 off the map; T = 1), the drafts lie
    on the map, and the map's LM-head rows are re-sliced after a weight update."""
    make_hf_checkpoint(tmp_path, "qwen3", "qwen3_next", num_mtp=1, scale=2.0)
    model = CausalLMWithMTP.from_pretrained(tmp_path, dtype=torch.float64)
    gamma = 3
    eng = Engine(model, spec=SpecConfig("mtp", gamma, "rejection", draft_vocab=EVEN), max_running=3, max_len=96,
                 sampling_dtype=torch.float64)
    prompts = [[3, 4, 5, 6, 7], [9], [10, 11, 12, 13, 14, 15, 16, 17]]
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=60, temperature=1.0, seed=i)) for i, p in enumerate(prompts)]
    eng.step()
    for _ in range(5):
        eng._speculative_round(reqs, gamma)
    assert eng.stats()["spec_draft_vocab_size"] == 32
    st = SamplingTensors.build([r.params for r in reqs])
    L = torch.tensor([len(r.tokens) for r in reqs])
    drafts, q = eng._draft(torch.tensor([r.slot for r in reqs]), L, st, gamma, torch.rand(3, gamma, dtype=torch.float64))
    assert (drafts % 2 == 0).all() and (q[..., 1::2] == 0).all()
    for i, r in enumerate(reqs):
        seq = r.tokens + drafts[i, : gamma - 1].tolist()
        ref = full_mtp_distributions(model, seq, gamma, SamplingTensors.build([r.params]))
        for k in range(1, gamma + 1):
            full = ref[k][len(r.tokens) - 2]
            masked = torch.zeros_like(full)
            masked[EVEN] = full[EVEN] / full[EVEN].sum()
            assert torch.allclose(q[i, k - 1], masked, atol=1e-10), (i, k)
    # a weight update (in place) is seen by the next draft: the sliced head rows follow the weights
    w = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    name = "model.embed_tokens.weight" if model.lm_head is None else "lm_head.weight"
    eng.update_weights({name: w.detach() * 1.5})
    assert torch.equal(eng._draft_head(), w.detach()[EVEN])


@pytest.mark.parametrize("verify", ["rejection", "target_only"])
def test_greedy_with_reduced_draft_vocab_equals_plain(qwen3_dir, tmp_path, verify):
    """Temperature 0 with a map that leaves out half the vocabulary (argmax targets off the map
    are rejected drafts, then emitted by the verifier) is still plain greedy decoding; the map
    loads from a .pt (SGLang's --speculative-token-map format) or a .json file."""
    d, _ = qwen3_dir
    model = CausalLMWithMTP.from_pretrained(d, dtype=torch.float64)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13]]
    sp = SamplingParams(max_new_tokens=24, temperature=0.0)
    plain = Engine(model, spec=SpecConfig("none"), max_running=4, max_len=64).generate(prompts, sp)
    torch.save(torch.tensor(EVEN), tmp_path / "map.pt")
    (tmp_path / "map.json").write_text(json.dumps(EVEN))
    for token_map in (str(tmp_path / "map.pt"), tmp_path / "map.json"):
        eng = Engine(model, spec=SpecConfig("mtp", 3, verify, draft_vocab=token_map), max_running=4, max_len=64)
        assert eng.draft_ids.tolist() == EVEN
        spec = eng.generate(prompts, sp)
        assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    emitted = [t for r in plain for t in r.output_ids]
    assert any(t % 2 for t in emitted)  # some argmax tokens lie off the map
    assert eng.stats()["spec_proposed_drafts"] > 0  # (random tiny heads: greedy drafts are rarely accepted)
    with pytest.raises(ValueError, match="token map"):
        Engine(model, spec=SpecConfig("mtp", 3, draft_vocab=[0, 64]), max_running=1, max_len=64)


def test_reduced_draft_vocab_engine_joint_law_matches_target(qwen3_dir):
    """End to end through the engine's float32 fast path with a map that leaves out ids carrying
    target mass: the joint law of (prefill token, then two tokens from the first verify step) over
    many seeded requests equals the target's, by chi-square (cells with expected count < 5 pooled)."""
    d, _ = qwen3_dir
    model = CausalLMWithMTP.from_pretrained(d, dtype=torch.float64)
    prompt, N = [5, 6, 7], 4000
    eng = Engine(model, spec=SpecConfig("mtp", 3, "rejection", draft_vocab=EVEN), max_running=500, max_len=16)
    reqs = eng.generate([prompt] * N, [SamplingParams(max_new_tokens=3, temperature=1.0, seed=i, ignore_eos=True)
                                       for i in range(N)])
    out = torch.tensor([r.output_ids for r in reqs])
    assert eng.stats()["spec_verify_ct"] > 0
    pvalue, _, pa, pb = three_token_law(model, prompt, out, SamplingParams(temperature=1.0))
    assert pvalue > 1e-4
    odd_mass = pb[:, 1::2].sum(-1) @ pa  # target mass of the second token off the map
    assert odd_mass > 0.05 and bool((out[:, 1:] % 2 == 1).any())


def three_token_law(model, prompt: list[int], out: torch.Tensor, params: SamplingParams):
    """Chi-square of the emitted (a, b, c) in ``out`` [N, 3] against the target's exact law
    p(a | prompt) p(b | prompt a) p(c | prompt a b) under ``params`` (cells with expected count < 5
    pooled). Returns (p-value, number of unpooled cells, p(a), p(b | a))."""
    from tests.test_sampling import chi2_pvalue

    N, V = out.shape[0], model.config.vocab_size
    st = SamplingTensors.build([params])

    def probs(seqs):
        ids = torch.tensor(seqs)
        b = make_batch_index(list(range(len(seqs))), [0] * len(seqs), [ids.shape[1]] * len(seqs), "cpu")
        normed, _ = model.trunk(ids, model.new_cache(len(seqs), ids.shape[1], "trunk"), b)
        return process_logits(model.logits(normed[:, -1]), st.expand(len(seqs)))

    pa = probs([prompt])[0]
    pb = probs([prompt + [a] for a in range(V)])  # [a, b]
    pc = probs([prompt + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    exact = (pa.view(V, 1, 1) * pb.view(V, V, 1) * pc).flatten()
    counts = torch.bincount(out[:, 0] * V * V + out[:, 1] * V + out[:, 2], minlength=V ** 3).double()
    big = exact * N >= 5
    pooled_c = torch.cat([counts[big], counts[~big].sum().view(1)])
    pooled_p = torch.cat([exact[big], exact[~big].sum().view(1)])
    return chi2_pvalue(pooled_c, pooled_p), int(big.sum()), pa, pb


def test_serve_speculative_token_map_option(qwen3_dir, tmp_path):
    """`bebop serve --speculative-token-map PATH` (SGLang's spelling) builds the reduced-vocabulary draft."""
    import argparse

    from bebop_megatron.rollout.server import add_serve_args, build_server

    d, _ = qwen3_dir
    torch.save(torch.tensor(EVEN), tmp_path / "map.pt")
    p = argparse.ArgumentParser()
    add_serve_args(p)
    base = ["--model-path", str(d), "--tokenizer", "char", "--speculative-algorithm", "NEXTN",
            "--speculative-num-steps", "2", "--max-running-requests", "2", "--context-length", "64"]
    server = build_server(p.parse_args(base + ["--speculative-token-map", str(tmp_path / "map.pt")]))
    try:
        eng = server.engine
        assert eng.gamma == 2 and eng.draft_ids.tolist() == EVEN and eng.stats()["spec_draft_vocab_size"] == 32
    finally:
        server.worker.stop()
    with pytest.raises(SystemExit, match="token-map"):
        build_server(p.parse_args(base + ["--speculative-token-map", str(tmp_path / "nope.pt")]))


class _FixedAlpha(list):
    """Per-depth acceptance the engine cannot update."""

    def __setitem__(self, k, v) -> None:
        pass


class _CostClock:
    """A fake cost clock for adaptive γ: a round at γ costs ``cost(γ)`` (the engine reads the clock
    before and after each round), so the choice is tested without timing anything."""

    def __init__(self, eng: Engine, cost):
        self.eng, self.cost, self.t, self.start = eng, cost, 0.0, True

    def __call__(self) -> float:
        if not self.start:
            self.t += self.cost(self.eng.last_gamma)
        self.start = not self.start
        return self.t


def test_adaptive_gamma_is_exact_and_follows_cost(qwen3_dir):
    d, _ = qwen3_dir
    model = CausalLMWithMTP.from_pretrained(d, dtype=torch.float64)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13]]
    sp = SamplingParams(max_new_tokens=40, temperature=0.0)
    plain = Engine(model, spec=SpecConfig("none"), max_running=4, max_len=64).generate(prompts, sp)
    # greedy with any γ schedule is plain greedy decoding, token for token
    ada = Engine(model, spec=SpecConfig("mtp", 3, adaptive=True), max_running=4, max_len=64)
    assert [r.output_ids for r in ada.generate(prompts, sp)] == [r.output_ids for r in plain]
    assert sum(ada.gamma_hist) > 0 and ada.stats()["spec_gamma_hist"] == ada.gamma_hist

    def run(cost, alpha):
        eng = Engine(model, spec=SpecConfig("mtp", 3, adaptive=True), max_running=4, max_len=200)
        eng._clock = _CostClock(eng, cost)
        eng._alpha = _FixedAlpha([alpha] * 3)  # held fixed: the test is about cost
        eng.generate(prompts, SamplingParams(max_new_tokens=150, temperature=0.0, ignore_eos=True))
        return eng.gamma_hist

    # every draft costs as much as a target step and drafts are rarely accepted: plain wins, and
    # after measuring each γ the engine runs γ = 0 but for short probes at doubling intervals
    hist = run(lambda g: 1.0 + g, 0.1)
    # per γ: one warm-up round and the samples; the first γ > 0 round after plain ones catches up
    measured = 4 * (1 + Engine.ADAPTIVE_SAMPLES) + 1
    probes = math.ceil(math.log2(sum(hist) / Engine.ADAPTIVE_REMEASURE))  # intervals 64, 128, ...
    spec_measured = measured - (1 + Engine.ADAPTIVE_SAMPLES)  # the γ > 0 part of the measuring rounds
    assert sum(hist) - spec_measured - Engine.ADAPTIVE_PROBE_ROUNDS * probes <= hist[0] < sum(hist) - spec_measured, hist
    # drafts are nearly free and usually accepted: the engine speculates at full depth
    hist = run(lambda g: 1.0 + 0.01 * g, 0.9)
    remeasured = (sum(hist) // Engine.ADAPTIVE_REMEASURE) * Engine.ADAPTIVE_SAMPLES  # fresh samples of the others
    assert hist[3] >= sum(hist) - measured - remeasured - 2, hist
    # a predicted gain below the margin is not taken: drafts are free but E[tokens] is only 1.04
    hist = run(lambda g: 1.0, 0.04)
    assert hist[0] >= sum(hist) - measured - sum(hist) // Engine.ADAPTIVE_REMEASURE - 2, hist


@pytest.mark.parametrize("draft_cost", [0.01, 0.6])
def test_adaptive_gamma_prices_re_measuring_plain_decoding(qwen3_dir, monkeypatch, draft_cost):
    """While speculating, re-measuring plain decoding costs what its rounds lose against the running
    γ: ADAPTIVE_SAMPLES x (1 - plain rounds per token of γ). Where γ = 3 triples the speed (drafts
    nearly free) that is paid from the probe budget (1% of the rounds), so plain is re-measured about
    every 200 rounds instead of at every third turn (96 rounds). Where speculation gains ~20% (a
    draft costs 0.6 of a target step) it costs less than a turn's credit: every third turn, as before."""
    d, _ = qwen3_dir
    model = CausalLMWithMTP.from_pretrained(d, dtype=torch.float64)
    eng = Engine(model, spec=SpecConfig("mtp", 3, adaptive=True), max_running=2, max_len=1100)
    eng._clock = _CostClock(eng, lambda g: 1.0 + draft_cost * g)
    eng._alpha = _FixedAlpha([0.9] * 3)
    # every round emits one token per row (the choice sees α = 0.9 all the same): 999 rounds, and both
    # rows end together (no smaller batch bucket to measure at the end)
    _force_acceptance(monkeypatch, lambda res, drafts: torch.zeros_like(res.num_accepted),
                      lambda res, p, m: p[:, 0].argmax(-1))
    log, choose = [], eng._choose_gamma
    eng._choose_gamma = lambda B, reqs=None: log.append(choose(B, reqs)) or log[-1]
    eng.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=1000, temperature=0.0, ignore_eos=True))
    # after the measuring rounds: runs of plain rounds between speculative ones are plain's re-measures
    seq = "".join(map(str, log[Engine.ADAPTIVE_REMEASURE:]))
    plain_runs = len(re.findall(r"(?<=[1-3])0+(?=[1-3])", seq))
    turns = len(seq) // (Engine.ADAPTIVE_REMEASURE * 3)  # every third re-measure turn is plain's
    best = min((1, 2, 3), key=lambda g: (1 + g * draft_cost) / eng.expected_tokens(g))
    price = Engine.ADAPTIVE_SAMPLES * (1 - (1 + best * draft_cost) / eng.expected_tokens(best))
    assert len(log) == 999 and seq.count(str(best)) > 0.8 * len(seq), seq
    if draft_cost < 0.1:
        assert plain_runs <= len(seq) * Engine.ADAPTIVE_PROBE_BUDGET / price + 1 < turns, (plain_runs, turns, seq)
    else:
        assert price < Engine.ADAPTIVE_REMEASURE * 3 * Engine.ADAPTIVE_PROBE_BUDGET
        assert plain_runs >= turns - 1, (plain_runs, turns, seq)


def test_adaptive_gamma_recovers_after_a_noisy_patch(qwen3_dir):
    """Speculation measured expensive for a while (a noisy patch of a shared machine) and cheap
    afterwards: the next probe's fresh samples replace the old ones, so the engine returns to full
    depth within two probe intervals (a due probe waits up to one interval for an admission, which
    never comes in this one long batch) instead of keeping plain decoding on stale costs."""
    d, _ = qwen3_dir
    model = CausalLMWithMTP.from_pretrained(d, dtype=torch.float64)
    eng = Engine(model, spec=SpecConfig("mtp", 3, adaptive=True), max_running=4, max_len=800)
    patch = 100  # rounds during which a γ > 0 round costs 1 + γ
    eng._clock = _CostClock(eng, lambda g: 1.0 + (g if eng._rounds <= patch else 0.01 * g))
    eng._alpha = _FixedAlpha([0.9] * 3)
    log, choose = [], eng._choose_gamma
    eng._choose_gamma = lambda B, reqs=None: log.append((eng._rounds + 1, choose(B, reqs))) or log[-1][1]
    eng.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=700, temperature=0.0, ignore_eos=True))
    # plain during the patch; then probes at intervals 32, 64, 128 (each deferred by at most as much):
    # the first probe after the patch switches back for good
    assert any(g == 0 for r, g in log if r <= patch)
    late = [g for r, g in log if r > patch + 2 * 128 + Engine.ADAPTIVE_PROBE_ROUNDS]
    assert len(late) >= 20 and sum(g == 3 for g in late) >= 0.8 * len(late), "".join(str(g) for _, g in log)


def test_adaptive_gamma_probes_re_check_every_gamma(qwen3_dir):
    """Only γ = 3 is measured in a noisy patch (4x plain instead of 1.6x); γ = 1 and 2 never win.
    Plain decoding wins on those costs, and its probes must re-measure γ = 3, not the γ that is
    cheapest to probe (γ = 1, the least catch-up plus steady cost) every time: that kept γ = 3's slow samples for good
    and plain decoding in 2/3 of the rounds of the tiny model at batch 4, where γ = 3 runs 1.2x plain.
    Every other probe takes the γ measured longest ago: the second probe finds γ = 3 (the first, γ = 1,
    is due 32 rounds after plain first wins, the second 64 after it, and each may wait as long again
    for an admission, which never comes in this one long batch)."""
    d, _ = qwen3_dir
    model = CausalLMWithMTP.from_pretrained(d, dtype=torch.float64)
    eng = Engine(model, spec=SpecConfig("mtp", 3, adaptive=True), max_running=2, max_len=400)
    patch = 40  # rounds during which γ = 3 costs 4x plain (it is measured then, and only then)
    cost = {0: 1.0, 1: 1.8, 2: 2.8}  # per token at α = 0.9: 0.95x and 1.03x plain, so neither wins
    eng._clock = _CostClock(eng, lambda g: cost[g] if g < 3 else (4.0 if eng._rounds <= patch else 1.6))
    eng._alpha = _FixedAlpha([0.9] * 3)
    log, choose = [], eng._choose_gamma
    eng._choose_gamma = lambda B, reqs=None: log.append((eng._rounds + 1, choose(B, reqs))) or log[-1][1]
    eng.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=300, temperature=0.0, ignore_eos=True))
    assert any(g == 0 for r, g in log if r <= patch)
    first_plain = next(r for r, g in log if r > 16 and g == 0)  # after measuring plain and every γ
    late = [g for r, g in log if r > first_plain + 2 * 32 + 2 * 64 + 2 * Engine.ADAPTIVE_PROBE_ROUNDS]
    assert len(late) >= 20 and sum(g == 3 for g in late) >= 0.8 * len(late), "".join(str(g) for _, g in log)


def test_adaptive_gamma_re_measure_stays_in_its_bucket(qwen3_dir):
    """A re-measure (probe) runs its γ for a few rounds at the batch bucket it was started for. Begun in
    the tail of a shrinking batch (one row left), it must not run on into the next, full batch: there
    its rounds cost several times more (and desynchronise the rows), and they would be recorded as
    samples of the full batch's bucket. The samples it was to replace come back."""
    d, _ = qwen3_dir
    model = CausalLMWithMTP.from_pretrained(d, dtype=torch.float64)
    eng = Engine(model, spec=SpecConfig("mtp", 3, adaptive=True), max_running=2, max_len=64)
    eng._cost_samples[(1, 2)] = deque([1.5, 1.6, 1.7], maxlen=5)
    eng._measured_at[(1, 2)] = 5
    eng._remeasure(1, 2)  # a probe of γ = 2 at bucket 1: catch-up + ADAPTIVE_SAMPLES rounds
    assert eng._probe_left == Engine.ADAPTIVE_SAMPLES and (1, 2) not in eng._cost_samples
    assert eng._choose_gamma(1) == 2  # same bucket: the probe goes on
    eng._cost_samples[(1, 2)] = deque([1.9], maxlen=5)  # one fresh sample before the batch changes
    assert eng._choose_gamma(32) == 0  # a full batch: the probe ends; plain is measured there first
    assert eng._probe_left == 0
    # too few new samples: the old ones come back (oldest first), with their round
    assert list(eng._cost_samples[(1, 2)]) == [1.5, 1.6, 1.7, 1.9] and eng._measured_at[(1, 2)] == 5


def test_adaptive_gamma_probe_schedule_counts_the_bucket_s_own_rounds(qwen3_dir):
    """Plain decoding wins at every bucket; each batch runs 30 rounds at batch 32, then its tail 2
    rounds at batch 1 (answers that stop at different lengths). The probes' intervals (and their
    budget, a share of the plain rounds between them) count each bucket's own rounds: counted in all
    rounds, the tail bucket probed 3 times in its 80 rounds (and bucket 32 as often as now)."""
    d, _ = qwen3_dir
    model = CausalLMWithMTP.from_pretrained(d, dtype=torch.float64)
    eng = Engine(model, spec=SpecConfig("mtp", 3, adaptive=True), max_running=2, max_len=64)
    for bk in (1, 32):  # plain rounds per token: γ = 1 / 2 / 3 cost 2.0 / 2.6 / 3.0 for 1.7 / 2.2 / 2.5 tokens
        for c, ratio in {0: 1.0, 1: 2.0, 2: 2.6, 3: 3.0}.items():
            eng._cost_samples[(bk, c)] = deque([ratio] * Engine.ADAPTIVE_SAMPLES, maxlen=5)
    for _ in range(40):
        for B, rounds in ((32, 30), (1, 2)):
            for _ in range(rounds):
                eng._choose_gamma(B)
    assert eng._probes.get(32, 0) >= 2 and eng._probes.get(1, 0) <= 1, eng._probes


@pytest.mark.parametrize("draft_cost", [0.9, 0.2])
def test_adaptive_gamma_compares_costs_at_the_same_context(qwen3_dir, draft_cost):
    """A round's cost grows with the context it attends over. Probes from plain decoding run right
    after an admission (short contexts), while the latest plain rounds ended the previous batch (long
    ones): compared with those, a γ > 0 round looks cheaper than it is. Every round here costs
    (1 + c γ) x (1 + context / 20). With c = 0.9 plain decoding wins at every context (γ = 1 gives
    1.9 tokens for 1.9x the cost): the engine keeps to it, batch after batch, but for its probes
    (against the previous batch's last plain rounds the probes measured γ = 1 at ~0.3x plain and ran
    whole batches at γ > 0). With c = 0.2 speculation wins at every context and the engine runs γ = 3."""
    d, _ = qwen3_dir
    model = CausalLMWithMTP.from_pretrained(d, dtype=torch.float64)
    eng = Engine(model, spec=SpecConfig("mtp", 3, adaptive=True), max_running=2, max_len=200)
    ctx = []  # the longest context at each round's start (the clock's first read)

    def clock_read(real=_CostClock(eng, lambda g: (1.0 + draft_cost * g) * (1.0 + ctx[-1] / 20.0))):
        if real.start:
            ctx.append(max((len(r.tokens) for r in eng.running), default=0))
        return real()

    eng._clock = clock_read
    eng._alpha = _FixedAlpha([0.9] * 3)
    log, choose = [], eng._choose_gamma
    eng._choose_gamma = lambda B, reqs=None: log.append(choose(B, reqs)) or log[-1]
    spec_rounds, full_depth = [], []
    for i in range(8):
        log.clear()
        eng.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True, seed=i))
        spec_rounds.append(sum(g > 0 for g in log))
        full_depth.append(sum(g == 3 for g in log) / len(log))
    if draft_cost > 0.5:
        # the first batch measures every γ; later ones run plain but for a probe (one catch-up round
        # and ADAPTIVE_SAMPLES steady ones) now and then
        assert all(n <= Engine.ADAPTIVE_PROBE_ROUNDS for n in spec_rounds[2:]), spec_rounds
    else:
        assert all(f >= 0.7 for f in full_depth[2:]), full_depth
    assert eng._plain_ref(2, 10) < eng._plain_ref(2, 90)


def test_adaptive_plain_reference_is_robust_and_bounded(qwen3_dir):
    """The plain-cost line: its level follows the latest rounds (the cost of their time), one slow
    round does not tilt it, and far from the kept contexts it neither runs away nor goes negative."""
    d, _ = qwen3_dir
    eng = Engine(CausalLMWithMTP.from_pretrained(d, dtype=torch.float64), spec=SpecConfig("mtp", 3, adaptive=True),
                 max_running=2, max_len=64)

    def keep(rounds):  # the kept plain rounds (the fitted line is refitted from them)
        eng._plain_ctx[4] = deque(rounds, maxlen=64)
        eng._plain_line.clear()

    line = [(c, 1.0 + 0.01 * c) for c in range(20, 60)]
    keep(line)
    assert eng._plain_ref(4, 40) == pytest.approx(1.4, rel=1e-6)
    keep(line[:-1] + [(59, 50.0)])  # one round 30x slower
    assert eng._plain_ref(4, 30) == pytest.approx(1.3, rel=0.05)
    keep(line[:-5] + [(c, 2 * (1.0 + 0.01 * c)) for c in range(55, 60)])
    assert eng._plain_ref(4, 57) == pytest.approx(2 * 1.57, rel=0.05)  # the machine got twice as slow
    keep(line)
    assert eng._plain_ref(4, 10_000) == pytest.approx(eng._plain_ref(4, 59 + 39))  # one span past the kept
    keep([(c, 1.0 + 0.04 * (c - 40)) for c in range(20, 60)])  # steep: the line
    assert eng._plain_ref(4, 0) == pytest.approx(0.25 * 0.2)  # is negative at 0; the floor holds it above 0
    # the line is cached until the engine keeps another plain round
    before = eng._plain_ref(4, 40)
    assert 4 in eng._plain_line
    eng._cost_warm.add((4, 0))
    eng._record_cost(4, 0, 100.0, ctx=40)
    assert 4 not in eng._plain_line
    assert eng._plain_ref(4, 40) != pytest.approx(before)


PROCESSORS = [dict(repetition_penalty=1.6), dict(frequency_penalty=0.8, presence_penalty=0.5),
              dict(repetition_penalty=0.7, presence_penalty=-0.3), dict(logit_bias={7: 4.0, 9: -3.0})]


@pytest.mark.parametrize("kw", PROCESSORS)
def test_penalties_greedy_speculation_equals_plain_and_change_output(qwen3_dir, kw):
    """SGLang's logit processors act on the target p; greedy speculation stays token-for-token
    plain decoding (verify position j counts the drafts before it), mixed with neutral requests."""
    d, _ = qwen3_dir
    model = CausalLMWithMTP.from_pretrained(d, dtype=torch.float64)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13]]

    def params(kw):  # request 2 stays neutral: the batch mixes processed and plain rows
        return [SamplingParams(max_new_tokens=24, temperature=0.0, **(kw if i != 2 else {})) for i in range(4)]

    plain = Engine(model, spec=SpecConfig("none"), max_running=4, max_len=64).generate(prompts, params(kw))
    spec = Engine(model, spec=SpecConfig("mtp", 3, "rejection"), max_running=4, max_len=64).generate(prompts, params(kw))
    none = Engine(model, spec=SpecConfig("none"), max_running=4, max_len=64).generate(prompts, params({}))
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    assert plain[2].output_ids == none[2].output_ids
    assert any(a.output_ids != b.output_ids for a, b in zip(plain, none))


def test_min_new_tokens_masks_stop_tokens(qwen3_dir):
    d, _ = qwen3_dir
    model = CausalLMWithMTP.from_pretrained(d, dtype=torch.float64)
    free = Engine(model, spec=SpecConfig("none"), max_running=1, max_len=64).generate(
        [[1, 2, 3]], SamplingParams(max_new_tokens=24, temperature=0.0))[0].output_ids
    stop = free[1]  # greedy would stop at the second token
    for spec in (SpecConfig("none"), SpecConfig("mtp", 3)):
        eng = Engine(model, spec=spec, max_running=1, max_len=64)
        early = eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=24, temperature=0.0,
                                                        stop_token_ids=[stop]))[0]
        assert len(early.output_ids) == 2 and early.finish_reason == {"type": "stop", "matched": stop}
        late = eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=[stop],
                                                       min_new_tokens=12))[0]
        assert len(late.output_ids) >= 12 and stop not in late.output_ids[:11]
    with pytest.raises(RequestError, match="min_new_tokens"):
        eng.add_request([1], SamplingParams(max_new_tokens=4, min_new_tokens=5))


def _reference_processed(logits: torch.Tensor, outputs: list[int], kw: dict, stop_ids: list[int]) -> torch.Tensor:
    """A token-by-token restatement of SGLang's penalizers (output counts; additive, then
    repetition, then logit_bias) for one context."""
    z = logits.clone()
    for t in set(outputs):
        z[t] -= kw.get("frequency_penalty", 0.0) * outputs.count(t) + kw.get("presence_penalty", 0.0)
    if len(outputs) < kw.get("min_new_tokens", 0):
        z[stop_ids] = float("-inf")
    rp = kw.get("repetition_penalty", 1.0)
    for t in set(outputs):
        z[t] = z[t] * rp if z[t] < 0 else z[t] / rp
    for t, b in (kw.get("logit_bias") or {}).items():
        z[t] += b
    return z


def test_penalised_speculation_joint_law_matches_penalised_target(qwen3_dir):
    """Rejection-sampled speculation with every processor on emits (a, b, c) with the exact law of
    plain decoding under the same processors (chi-square, float32 fast path)."""
    from tests.test_sampling import chi2_pvalue

    d, _ = qwen3_dir
    model = CausalLMWithMTP.from_pretrained(d, dtype=torch.float64)
    prompt, N, V = [5, 6, 7], 4000, model.config.vocab_size
    # negative penalties make repeats likely: the verifier must count the draft accepted before c
    kw = dict(repetition_penalty=0.5, frequency_penalty=-1.0, presence_penalty=-1.0, logit_bias={3: 1.5}, min_new_tokens=2)
    with torch.no_grad():
        def raw(seqs):
            ids = torch.tensor(seqs)
            b = make_batch_index(list(range(len(seqs))), [0] * len(seqs), [ids.shape[1]] * len(seqs), "cpu")
            normed, _ = model.trunk(ids, model.new_cache(len(seqs), ids.shape[1], "trunk"), b)
            return model.logits(normed[:, -1])

        za = raw([prompt])[0]
        pa = torch.softmax(_reference_processed(za, [], kw, [0]), -1)
        stop = int(pa.argmax())  # a likely token: min_new_tokens has mass to move
        pa = torch.softmax(_reference_processed(za, [], kw, [stop]), -1)
        zb = raw([prompt + [a] for a in range(V)])
        pb = torch.stack([torch.softmax(_reference_processed(zb[a], [a], kw, [stop]), -1) for a in range(V)])
        zc = raw([prompt + [a, b] for a in range(V) for b in range(V)])
        pc = torch.stack([torch.softmax(_reference_processed(zc[a * V + b], [a, b], kw, [stop]), -1)
                          for a in range(V) for b in range(V)]).view(V, V, V)
    exact = (pa.view(V, 1, 1) * pb.view(V, V, 1) * pc).flatten()
    eng = Engine(model, spec=SpecConfig("mtp", 3, "rejection"), max_running=500, max_len=16)
    reqs = eng.generate([prompt] * N, [SamplingParams(max_new_tokens=3, temperature=1.0, seed=i, ignore_eos=True,
                                                      stop_token_ids=[stop], **kw) for i in range(N)])
    out = torch.tensor([r.output_ids for r in reqs])
    assert eng.stats()["spec_verify_ct"] > 0 and not bool((out[:, :2] == stop).any())
    counts = torch.bincount(out[:, 0] * V * V + out[:, 1] * V + out[:, 2], minlength=V ** 3).double()
    big = exact * N >= 5
    pvalue = chi2_pvalue(torch.cat([counts[big], counts[~big].sum().view(1)]),
                         torch.cat([exact[big], exact[~big].sum().view(1)]))
    assert pvalue > 1e-4 and int(big.sum()) > 20
    # targeted: requests done in one verify step drew c at verify position 1, after the accepted
    # draft b; given (a, b) and that acceptance, c ~ p(. | a b) exactly, so its repeats c == b
    # (made likely by the negative penalties) only match if the verifier counts that draft
    one = torch.tensor([r.verify_ct == 1 for r in reqs])
    sel = out[one]
    p_rep = pc[sel[:, 0], sel[:, 1], sel[:, 1]]
    obs, exp = float((sel[:, 2] == sel[:, 1]).sum()), float(p_rep.sum())
    assert len(sel) > 100 and abs(obs - exp) < 4 * float((p_rep * (1 - p_rep)).sum()) ** 0.5 + 1, (obs, exp)


def test_stop_regex_trims_and_a_pathological_pattern_aborts_alone(qwen3_dir):
    d, _ = qwen3_dir
    model = CausalLMWithMTP.from_pretrained(d, dtype=torch.float64)
    tok = CharTokenizer()
    eng = Engine(model, tok, SpecConfig("mtp", 3), max_running=2, max_len=64)
    free = eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))[0]
    text = tok.decode(free.output_ids)
    import re
    pat = re.escape(text[4])
    r = eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True,
                                                stop_regex=[pat]))[0]
    n = next(i for i in range(1, 13) if re.search(pat, tok.decode(free.output_ids[:i])))
    assert r.finish_reason == {"type": "stop", "matched": pat} and r.output_ids == free.output_ids[:n]
    # an end-anchored pattern stops speculation where plain decoding stops (prefixes inside a step count)
    sp = lambda: SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, stop_regex=[pat + "$"])  # noqa: E731
    plain = Engine(model, tok, SpecConfig("none"), max_running=1, max_len=64).generate([[1, 2, 3]], sp())[0]
    assert eng.generate([[1, 2, 3]], sp())[0].output_ids == plain.output_ids == free.output_ids[:n]

    class Repeat:  # decodes any ids to a text on which (a|aa)+$ backtracks exponentially
        def decode(self, ids):
            return "a" * 60 + "b"

    eng.tokenizer = Repeat()
    bad = eng.add_request([1, 2, 3], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True,
                                                    stop_regex="(a|aa)+$"))
    good = eng.add_request([1, 2, 3], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    while not (bad.finished and good.finished):
        eng.step()
    assert bad.finish_reason["type"] == "abort" and bad.finish_reason["err_type"] == "BadRequestError"
    assert good.output_ids == free.output_ids[:8] and good.finish_reason["type"] == "length"
    with pytest.raises(RequestError, match="stop_regex"):
        eng.add_request([1], SamplingParams(stop_regex=["("]))


def test_serve_speculative_adaptive_reports_which_tokens_were_verified(qwen3_dir):
    """`bebop serve --speculative-adaptive`: the engine chooses γ per round, and each response says how
    its tokens came: verify steps + plain rounds + the prefill's token = all of them, and Σγ over its
    verify steps (what `bebop rl` turns into spec/tokens_per_verify and spec/mean_gamma)."""
    import argparse

    from bebop_megatron.rollout.protocol import parse_spec_metrics
    from bebop_megatron.rollout.server import add_serve_args, build_server

    d, _ = qwen3_dir
    p = argparse.ArgumentParser()
    add_serve_args(p)
    server = build_server(p.parse_args(["--model-path", str(d), "--tokenizer", "char", "--speculative-algorithm",
                                        "NEXTN", "--speculative-num-steps", "3", "--max-running-requests", "4",
                                        "--context-length", "96", "--speculative-adaptive"]))
    try:
        eng = server.engine
        assert eng.spec.adaptive and eng.gamma == 3
        # the first rounds at a batch size measure plain and every γ: both kinds of round occur
        reqs = eng.generate([[5, 6, 7], [8, 9], [10, 11, 12], [13]],
                            SamplingParams(max_new_tokens=40, temperature=1.0, ignore_eos=True, seed=3))
        assert sum(eng.gamma_hist[1:]) and eng.gamma_hist[0]
        for r in reqs:
            spec = parse_spec_metrics(server._meta(r))
            assert spec.verify_ct == r.verify_ct > 0 and spec.plain_rounds == r.plain_rounds > 0
            assert spec.emitted_by_verify + spec.plain_rounds + 1 == len(r.output_ids) == spec.completion_tokens
            assert spec.verify_ct <= spec.gamma_sum <= 3 * spec.verify_ct
            assert 0 < spec.mean_gamma < 3
    finally:
        server.worker.stop()


def test_adaptive_gamma_prices_lost_drafts_and_borrows_costs_across_buckets(qwen3_dir):
    """Two facts of RL rollouts: short answers end inside a round, so drafts past the end are lost
    (the prediction is scaled by the realized share of the accepted chain); and a shrinking batch
    visits each tail bucket for a round or two, so a γ measured at one bucket prices the others
    (only plain is measured per bucket) instead of a measurement that never completes."""
    d, _ = qwen3_dir
    model = CausalLMWithMTP.from_pretrained(d, dtype=torch.float64)
    eng = Engine(model, spec=SpecConfig("mtp", 3, adaptive=True), max_running=32, max_len=64)
    eng._alpha = _FixedAlpha([0.95] * 3)
    eng._cost_samples = {(4, 0): deque([1e-3] * 3), (4, 1): deque([1.6] * 3), (4, 2): deque([2.2] * 3),
                         (4, 3): deque([2.5] * 3)}
    # E[tokens] 1.95 / 2.85 / 3.71 over cost ratios 1.6 / 2.2 / 2.5: γ = 3 wins
    assert eng.realized_fraction(3) == 1.0 and eng._choose_gamma(4) == 3
    # much of each accepted chain lost past the answers' ends: 0.98 / 1.90 / 1.86 tokens, plain wins
    eng._chain_yield = {1: deque([(1, 2)] * 8), 2: deque([(2, 3)] * 8), 3: deque([(2, 4)] * 8)}
    assert eng.realized_fraction(3) == 0.5 and eng.effective_tokens(3) == pytest.approx(0.5 * eng.expected_tokens(3))
    assert eng._choose_gamma(4) == 0
    eng._chain_yield = {}
    # bucket 16: plain is measured there first; then the γ costs of bucket 4 stand in
    assert eng._choose_gamma(16) == 0
    eng._cost_samples[(16, 0)] = deque([2e-3] * 3)
    assert eng._choose_gamma(16) == 3 and (16, 3) not in eng._cost_samples
    # a γ measured nowhere is measured (γ = 2 here), wherever the batch is
    del eng._cost_samples[(4, 2)]
    assert eng._choose_gamma(16) == 2


def test_adaptive_gamma_measures_a_tail_bucket_priced_from_a_larger_one(qwen3_dir):
    """A shrinking RL batch: the γ costs come from the full batch (bucket 64), where γ = 3 just misses
    the margin; a tail bucket would decode plainly on that price for good (the borrowed ratio errs
    toward plain, and a bucket where plain wins never measures γ itself). It measures γ once there
    instead (at most ADAPTIVE_EXPLORE_TRIES begun); a γ priced from a SMALLER bucket is not explored,
    nor one far above plain's cost."""
    d, _ = qwen3_dir
    model = CausalLMWithMTP.from_pretrained(d, dtype=torch.float64)
    eng = Engine(model, spec=SpecConfig("mtp", 3, adaptive=True), max_running=64, max_len=64)
    eng._alpha = _FixedAlpha([0.9] * 3)  # E[tokens] 1.9 / 2.71 / 3.44
    eng._cost_samples = {(64, 0): deque([1e-3] * 3), (64, 1): deque([1.9] * 3), (64, 2): deque([2.9] * 3),
                         (64, 3): deque([3.3] * 3), (4, 0): deque([5e-4] * 3)}
    assert eng._choose_gamma(64) == 0  # γ = 3: 0.96 plain rounds per token, short of the 10% margin
    # a catch-up round, a warm-up round (γ's first steady round at this bucket), then ADAPTIVE_SAMPLES samples
    assert eng._choose_gamma(4) == 3 and eng._probe_left == 1 + 1 + eng.ADAPTIVE_SAMPLES - 1
    assert eng._explored[(4, 3)] == 1
    eng._probe_left = 0
    eng._explored[(4, 3)] = eng.ADAPTIVE_EXPLORE_TRIES  # tried often enough: the next γ in price, then plain
    assert eng._choose_gamma(4) == 1
    eng._probe_left = 0
    eng._explored.update({(4, 1): 9, (4, 2): 9})
    assert eng._choose_gamma(4) == 0
    # a γ that wins on its borrowed price but loses to its catch-up over the horizon is not explored
    eng4 = Engine(model, spec=SpecConfig("mtp", 3, adaptive=True), max_running=64, max_len=64)
    eng4._alpha = _FixedAlpha([0.9] * 3)
    eng4._cost_samples = {(64, 0): deque([1e-3] * 3), (64, 1): deque([1.9] * 3), (64, 2): deque([2.9] * 3),
                          (64, 3): deque([2.6] * 3), (4, 0): deque([5e-4] * 3)}  # γ = 3: 0.76 per token
    eng4._switch_cost = lambda bk, c, reqs: 50.0  # every γ's catch-up: 50 plain rounds
    eng4._horizon = lambda reqs: 4.0
    assert eng4._choose_gamma(4, reqs=[object()]) == 0 and not eng4._explored
    # priced from a smaller bucket: no exploration (the borrowed ratio is already the optimistic one)
    eng2 = Engine(model, spec=SpecConfig("mtp", 3, adaptive=True), max_running=64, max_len=64)
    eng2._alpha = _FixedAlpha([0.9] * 3)
    eng2._cost_samples = {(4, 0): deque([1e-3] * 3), (4, 1): deque([1.9] * 3), (4, 2): deque([2.9] * 3),
                          (4, 3): deque([3.3] * 3), (64, 0): deque([5e-4] * 3)}
    assert eng2._choose_gamma(64) == 0 and not eng2._explored
    # far above plain (γ = 3 at 1.5 plain rounds per token): plain, without exploring
    eng3 = Engine(model, spec=SpecConfig("mtp", 3, adaptive=True), max_running=64, max_len=64)
    eng3._alpha = _FixedAlpha([0.9] * 3)
    eng3._cost_samples = {(64, 0): deque([1e-3] * 3), (64, 1): deque([3.0] * 3), (64, 2): deque([4.5] * 3),
                          (64, 3): deque([5.2] * 3), (4, 0): deque([5e-4] * 3)}
    assert eng3._choose_gamma(4) == 0 and not eng3._explored


def test_verify_tokens_count_only_what_a_stop_string_keeps(qwen3_dir, monkeypatch):
    """A stop string found after a verify step cuts the drafts committed past it: they are not
    verify tokens, and the accepted-chain yield that prices adaptive γ does not count them."""
    import bebop_megatron.rollout.engine as engine_mod
    from bebop_megatron.rollout.sampling import VerifyResult

    def accept_all(p, q, drafts, mode, **kw):  # every draft accepted, bonus = argmax
        return VerifyResult(torch.full((drafts.shape[0],), drafts.shape[1], dtype=torch.long), p[:, -1].argmax(-1))

    monkeypatch.setattr(engine_mod, "verify_chain", accept_all)
    d, _ = qwen3_dir
    model = CausalLMWithMTP.from_pretrained(d, dtype=torch.float64)
    tok = CharTokenizer()
    free = Engine(model, tok, SpecConfig("mtp", 3), max_running=1, max_len=64).generate(
        [[5, 6, 7]], SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))[0].output_ids
    # stop at the text of the third token: it arrives inside the first verify step (tokens 2..5)
    stop = tok.decode([free[2]])
    eng = Engine(model, tok, SpecConfig("mtp", 3), max_running=1, max_len=64)
    r = eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True,
                                                 stop=[stop]))[0]
    kept = len(r.output_ids)
    assert r.finish_reason["type"] == "stop" and kept < len(free)
    assert r.verify_ct == 1 and r.verify_tokens + 1 == kept  # the prefill's token + what the step kept
    assert eng.total_verify_tokens == r.verify_tokens and eng._chain_yield[3][-1] == (kept - 1, 4)


def test_counters_are_final_when_a_request_is_published(qwen3_dir):
    """The server's waiter (another thread) builds meta_info the moment a request is released, so
    every counter of the last verify step is in place before; on the old code verify_tokens lagged
    one step there (a fresh-clone run saw spec_accept_length 15/14 for 16 tokens in 14 steps)."""
    d, _ = qwen3_dir
    model = CausalLMWithMTP.from_pretrained(d, dtype=torch.float64)
    tok = CharTokenizer()
    for params in (SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True),
                   SamplingParams(max_new_tokens=16, temperature=1.0, seed=3, ignore_eos=True, stop=["7"])):
        eng = Engine(model, tok, SpecConfig("mtp", 3), max_running=2, max_len=64)
        seen = []

        def snap(r):
            seen.append((r.finished, r.verify_ct, r.verify_tokens, r.accepted, r.proposed, len(r.output_ids)))

        r = eng.add_request([5, 6, 7], params, on_update=snap)
        while not r.finished:
            eng.step()
        assert seen[-1][0] and seen[-1][1:] == (r.verify_ct, r.verify_tokens, r.accepted, r.proposed, len(r.output_ids))
        assert r.verify_tokens + 1 == len(r.output_ids)
        # every progress notification of a verify step already counts that step
        assert all(t + 1 == n for _, ct, t, _, _, n in seen if ct)


def test_adaptive_gamma_prices_the_catch_up_against_the_horizon(qwen3_dir):
    """A γ whose MTP depths lag (the rounds before decoded plainly) must first run them over every
    lagging position. That catch-up, priced per position from a measured catch-up round, is paid
    once: worth it for a long remaining horizon, not for a few tokens (the old choice compared
    steady costs only and switched either way, which made a batch's last rounds cost extra)."""
    d, _ = qwen3_dir
    model = CausalLMWithMTP.from_pretrained(d, dtype=torch.float64)

    def engine_after_plain_rounds(max_new_tokens, rounds=40):
        eng = Engine(model, spec=SpecConfig("mtp", 3, adaptive=True), max_running=4, max_len=1200)
        reqs = [eng.add_request([1 + i, 2, 3], SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=i))
                for i in range(4)]
        eng.step()  # prefill
        for _ in range(rounds):
            eng._plain_round(reqs)
        eng._alpha = _FixedAlpha([0.95] * 3)
        # steady ratios 1.6 / 2.2 / 2.5 for E[tokens] 1.95 / 2.85 / 3.71: γ = 3 wins at steady state;
        # a measured γ = 3 catch-up over 56 positions per row cost 5 plain rounds more than a steady round
        eng._cost_samples = {(4, 0): deque([1e-3] * 3), (4, 1): deque([1.6] * 3), (4, 2): deque([2.2] * 3),
                             (4, 3): deque([2.5] * 3)}
        eng._steady_work = {(4, 1): deque([2] * 3), (4, 2): deque([4] * 3), (4, 3): deque([6] * 3)}
        eng._catchup_samples = {4: deque([(2.5 + 5.0, 56, 3)])}
        return eng, reqs

    eng, reqs = engine_after_plain_rounds(max_new_tokens=1000)
    assert eng._position_cost(4) == pytest.approx(0.1)
    lag = eng._depth_work(reqs, 3)
    assert lag >= 3 * 40 and eng._switch_cost(4, 3, reqs) == pytest.approx(0.1 * (lag - 6))
    assert eng._choose_gamma(4, reqs) == 3  # ~960 tokens left: the catch-up is amortised
    # the priced positions are the ones the draft pass runs: Σ over depths of the padded span
    spans, step = [], eng.model.mtp_step
    eng.model.mtp_step = lambda k, h, ids, cache, b: spans.append(ids.shape[1]) or step(k, h, ids, cache, b)
    eng._speculative_round(sorted(reqs, key=lambda r: r.slot), 3)
    assert len(spans) == 3 and sum(spans) == lag == eng._draft_positions  # what step() records as its work
    eng, reqs = engine_after_plain_rounds(max_new_tokens=50)
    assert eng._choose_gamma(4, reqs) == 0  # 9 tokens left: 9 x 0.67 + a ~12-round catch-up > 9
