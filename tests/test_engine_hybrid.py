"""Embedded engine on the Qwen3.5-style hybrid (Gated DeltaNet + gated full attention, zero-centred
norms, partial RoPE, one recurrent MTP layer in the ``mtp.*`` layout):

* logits equal transformers' ``Qwen3_5ForCausalLM`` (prefill, then decode steps through the cache);
* speculation rolls the linear-attention states back exactly: after a verify forward over γ+1
  tokens and a rollback to any position, decoding continues as a fresh prefill of the committed
  tokens would;
* greedy speculative decoding equals plain greedy decoding token for token; sampled speculative
  decoding reports logprobs equal to a fresh full forward over its output;
* rejection sampling is exact: the joint law of 3 emitted tokens is the target's (chi-square).

Tiny random models (tests/test_qwen3_5.py's ``make_qwen3_5``), float32/float64 on CPU.
"""

import json
import os

import pytest
import torch

from bebop_megatron.rollout.engine import Engine, SamplingParams, SpecConfig
from bebop_megatron.rollout.modeling import CausalLMWithMTP, LMConfig, make_batch_index
from tests.test_engine import three_token_law
from tests.test_qwen3_5 import make_qwen3_5

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TYPES = ("linear_attention", "full_attention", "linear_attention")


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_5")
    hf = make_qwen3_5(d, layer_types=TYPES, seed=3)
    return d, hf


def test_config_and_weights_load(hybrid_dir):
    d, _ = hybrid_dir
    c = LMConfig.from_hf(json.loads((d / "config.json").read_text()))
    assert c.hybrid and c.layer_types == TYPES and c.rotary_dim == 4 and c.zero_centered_norm
    assert c.num_mtp_modules == 1 and c.mtp_layout == "qwen3_next" and c.attn_output_gate
    m = CausalLMWithMTP.from_pretrained(d)
    assert m.has_mtp and m.layers[0].kind == "linear_attention" and m.layers[1].kind == "full_attention"
    # the multimodal layout (text model under model.language_model., a vision tower) loads too
    from safetensors.torch import load_file

    sd = {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    mm = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v + 1.0
          for k, v in sd.items()}
    mm["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    cfg = json.loads((d / "config.json").read_text())
    top = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": cfg,
           "tie_word_embeddings": False}
    m2 = CausalLMWithMTP(LMConfig.from_hf(top))
    m2.load_hf_state_dict(mm, strict=True)
    assert torch.equal(m2.layers[0].linear_attn.A_log, m.layers[0].linear_attn.A_log + 1.0)


def test_logits_equal_transformers_prefill_and_decode(hybrid_dir):
    d, hf = hybrid_dir
    assert_logits_equal_prefill_and_decode(CausalLMWithMTP.from_pretrained(d), hf)


def assert_logits_equal_prefill_and_decode(ours, hf, tol=1e-4):
    """The engine model ``ours`` against the transformers model ``hf`` (vocab 64) through the cache:
    a batched prefill of two rows of different lengths, a mixed decode/extend step, decode steps."""
    ids = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    # batched prefill of two rows of different lengths (padding must not touch the states)
    cache = ours.new_cache(3, 32, "trunk")
    normed, _ = ours.trunk(ids[:, :9], cache, make_batch_index([2, 0], [0, 0], [9, 6], "cpu"))
    lg = ours.logits(normed)
    assert (lg[0] - ref[0, :9]).abs().max() < tol
    assert (lg[1, :6] - ref[1, :6]).abs().max() < tol
    # decode: row 0 one token at a time, row 1 catches up with 3 tokens, then both one at a time
    normed, _ = ours.trunk(torch.stack([torch.cat([ids[0, 9:10], ids[0, 9:11]]), ids[1, 6:9]]), cache,
                           make_batch_index([2, 0], [9, 6], [1, 3], "cpu"))
    lg = ours.logits(normed)
    assert (lg[0, 0] - ref[0, 9]).abs().max() < tol
    assert (lg[1] - ref[1, 6:9]).abs().max() < tol
    for t in range(9, 12):  # row 0 feeds position t+1, row 1 position t (row 0's padding above is overwritten)
        rows = [ids[0, t + 1: t + 2], ids[1, t: t + 1]]
        normed, _ = ours.trunk(torch.stack(rows), cache, make_batch_index([2, 0], [t + 1, t], [1, 1], "cpu"))
        lg = ours.logits(normed[:, 0])
        assert (lg[0] - ref[0, t + 1]).abs().max() < tol
        assert (lg[1] - ref[1, t]).abs().max() < tol


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rollback_after_verify_equals_fresh_prefill(hybrid_dir, dtype):
    """Verify-style forward over γ+1 = 4 tokens keeping the states, rollback to position m, then
    feed the next token: logits equal those of a fresh prefill of the committed tokens, for every m."""
    d, _ = hybrid_dir
    m_ = CausalLMWithMTP.from_pretrained(d, dtype=dtype)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    seq = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(7)).tolist()
    P, g = 8, 3
    for m in range(g + 1):
        cache = m_.new_cache(2, 32, "trunk")
        slot = torch.tensor([1])
        m_.trunk(torch.tensor([seq[:P - 1]]), cache, make_batch_index([1], [0], [P - 1], "cpu"))
        b = make_batch_index([1], [P - 1], [g + 1], "cpu")
        b.keep_states = True
        m_.trunk(torch.tensor([seq[P - 1: P + g]]), cache, b)
        cache.rollback(slot, torch.tensor([m]))
        # committed: seq[:P + m] processed; continue with two tokens that differ from the drafts
        nxt = [(seq[P + m] + 1) % 64, 5]
        normed, _ = m_.trunk(torch.tensor([nxt]), cache, make_batch_index([1], [P + m], [2], "cpu"))
        fresh_ids = torch.tensor([seq[:P + m] + nxt])
        fresh, _ = m_.trunk(fresh_ids, m_.new_cache(1, 32, "trunk"),
                            make_batch_index([0], [0], [P + m + 2], "cpu"))
        assert (m_.logits(normed[0]) - m_.logits(fresh[0, P + m:])).abs().max() < tol, m


@pytest.mark.parametrize("verify", ["rejection", "target_only"])
def test_greedy_speculation_equals_plain_decoding(hybrid_dir, verify):
    d, _ = hybrid_dir
    model = CausalLMWithMTP.from_pretrained(d, dtype=torch.float64)
    assert_greedy_speculation_equals_plain(model, verify, reuse_slots=verify == "rejection")


def assert_greedy_speculation_equals_plain(model, verify: str, max_new_tokens: int = 14, reuse_slots: bool = True):
    """Greedy speculative decoding (γ = 3) emits plain greedy decoding's tokens; with ``reuse_slots``
    also at γ = 2 with fewer slots than requests (a reused slot's states must start fresh).
    Returns the γ = 3 engine's stats."""
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13]]
    sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    plain = Engine(model, spec=SpecConfig("none"), max_running=4, max_len=48).generate(prompts, sp)
    eng = Engine(model, spec=SpecConfig("mtp", 3, verify), max_running=4, max_len=48)
    spec = eng.generate(prompts, sp)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    assert all(len(r.output_ids) == max_new_tokens for r in spec)
    assert eng.stats()["spec_verify_ct"] > 0
    if reuse_slots:
        few = Engine(model, spec=SpecConfig("mtp", 2, verify), max_running=2, max_len=48).generate(prompts, sp)
        assert [r.output_ids for r in few] == [r.output_ids for r in plain]
    return eng.stats()


def test_sampled_speculation_logprobs_equal_fresh_forward(hybrid_dir):
    d, _ = hybrid_dir
    assert_sampled_speculation_logprobs_exact(CausalLMWithMTP.from_pretrained(d, dtype=torch.float64))


def assert_sampled_speculation_logprobs_exact(model):
    """Rejections at every depth happen here; the logprobs the engine reports come from its verify
    logits, so they equal a fresh full forward only if every rollback restored the exact states."""
    sp = [SamplingParams(max_new_tokens=24, temperature=1.0, seed=s, ignore_eos=True) for s in range(4)]
    prompts = [[5, 6, 7], [1], [9, 8, 7, 6, 5], [3, 3]]
    eng = Engine(model, spec=SpecConfig("mtp", 3, "rejection"), max_running=4, max_len=48)
    reqs = eng.generate(prompts, sp, return_logprob=True)
    st = eng.stats()
    assert st["spec_verify_ct"] > 0 and 0 < st["spec_accepted_drafts"] < st["spec_proposed_drafts"]
    for p, r in zip(prompts, reqs):
        seq = p + r.output_ids
        normed, _ = model.trunk(torch.tensor([seq]), model.new_cache(1, 64, "trunk"),
                                make_batch_index([0], [0], [len(seq)], "cpu"))
        lp = torch.log_softmax(model.logits(normed[0]).double(), -1)
        ref = [lp[len(p) - 1 + j, t].item() for j, t in enumerate(r.output_ids)]
        assert max(abs(x - y) for x, y in zip(r.output_logprobs, ref)) < 1e-9


def test_rejection_sampling_joint_law_matches_target(hybrid_dir):
    """Seeded requests through the engine's float32 fast path: the joint law of 3 emitted tokens
    (the prefill's, then the first verify step's, or a second verify step's after a rejection of
    the first draft: rolled-back states) equals the target's, by chi-square (cells < 5 expected
    pooled). top_k = 6 keeps the law on few cells (the random model is flat); target and draft are
    processed with the same parameters, as in serving."""
    d, _ = hybrid_dir
    model = CausalLMWithMTP.from_pretrained(d, dtype=torch.float64)
    prompt, N = [5, 6, 7], 1500
    eng = Engine(model, spec=SpecConfig("mtp", 2, "rejection"), max_running=750, max_len=12)
    reqs = eng.generate([prompt] * N, [SamplingParams(max_new_tokens=3, temperature=1.0, top_k=6, seed=i,
                                                      ignore_eos=True) for i in range(N)])
    out = torch.tensor([r.output_ids for r in reqs])
    st_e = eng.stats()
    assert st_e["spec_verify_ct"] > 0 and st_e["spec_accepted_drafts"] > 0
    pvalue, cells, _, _ = three_token_law(model, prompt, out, SamplingParams(temperature=1.0, top_k=6))
    assert cells > 50
    assert pvalue > 1e-4


# ------------------------------------------------------------- weight sync from the megatron policy


def _sync_worker(rank, world, ckpt_root, hf_dir):
    from bebop_megatron.checkpointing import checkpoint_config, latest_checkpoint, load_checkpoint
    from bebop_megatron.config import Config
    from bebop_megatron.model import build_model
    from bebop_megatron.parallel import initialize_distributed
    from bebop_megatron.rl.weight_sync import rollout_model_for, sync_engine

    ckpt = latest_checkpoint(ckpt_root)
    cfg = Config.from_dict(checkpoint_config(ckpt))
    cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size = world, 1
    cfg.parallel.sequence_parallel &= world > 1  # a TP=2 MoE checkpoint has it on; megatron refuses it at TP=1
    policy = build_model(cfg, initialize_distributed(world, 1, seed=5))
    load_checkpoint(ckpt, policy)
    policy.eval()
    engine = Engine(rollout_model_for(cfg), spec=SpecConfig("mtp", 2), max_running=2, max_len=32)
    info = sync_engine(policy, cfg, engine, version="v1", bucket_bytes=20_000)
    ref = CausalLMWithMTP.from_pretrained(hf_dir)
    got = dict(engine.model.named_parameters())
    mismatch = [n for n, p in ref.named_parameters() if not torch.equal(p, got[n])]
    # the synced engine generates greedily as the reference model does (speculation on)
    sp = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    out = engine.generate([[1, 2, 3]], sp)[0].output_ids
    want = Engine(ref, spec=SpecConfig("none"), max_running=1, max_len=32).generate([[1, 2, 3]], sp)[0].output_ids
    return {"info": info, "mismatch": mismatch, "same_tokens": out == want, "version": engine.weight_version}


def test_policy_to_engine_sync_qwen3_5(tmp_path):
    """HF -> megatron (qwen3_5, recurrent MTP) -> sync_engine: the engine holds exactly the HF weights
    (trunk and the mtp.* module) and decodes as the HF-loaded engine model."""
    from bebop_megatron.convert.hf_megatron import hf_to_megatron
    from tests.distributed import run_distributed

    make_qwen3_5(tmp_path / "hf", layer_types=TYPES, seed=3)
    hf_to_megatron(tmp_path / "hf", tmp_path / "mc", tp=1)
    r = run_distributed(_sync_worker, 1, str(tmp_path / "mc"), str(tmp_path / "hf"))[0]
    assert r["mismatch"] == [] and r["same_tokens"] and r["version"] == "v1", r
    assert r["info"]["mtp_tensors"] > 0


def test_chunked_delta_rule_equals_recurrence():
    """The prefill's chunked gated delta rule (2+ chunks, rows of different lengths with g = β = 0
    padding) equals the token-by-token recurrence, outputs and final states (float64)."""
    from bebop_megatron.rollout.modeling import _l2norm, chunked_gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    B, N, H, dk, dv = 2, 150, 3, 8, 5
    q = _l2norm(torch.randn(B, N, H, dk, generator=gen, dtype=torch.float64)) / dk ** 0.5
    k = _l2norm(torch.randn(B, N, H, dk, generator=gen, dtype=torch.float64))
    v = torch.randn(B, N, H, dv, generator=gen, dtype=torch.float64)
    g = -torch.rand(B, N, H, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, N, H, generator=gen, dtype=torch.float64)
    S0 = torch.randn(B, H, dk, dv, generator=gen, dtype=torch.float64)
    lengths = [150, 97]
    valid = torch.arange(N)[None, :] < torch.tensor(lengths)[:, None]
    out, S = chunked_gated_delta_rule(q, k, v, g * valid[..., None], beta * valid[..., None], S0.clone())
    for r, n in enumerate(lengths):
        St = S0[r].clone()
        for t in range(n):
            St = St * g[r, t].exp()[:, None, None]
            u = beta[r, t, :, None] * (v[r, t] - torch.einsum("hkv,hk->hv", St, k[r, t]))
            St = St + k[r, t, :, :, None] * u[:, None, :]
            assert (out[r, t] - torch.einsum("hkv,hk->hv", St, q[r, t])).abs().max() < 1e-10
        assert (S[r] - St).abs().max() < 1e-10
