"""RL trainer: batch layout, prompt order, MTP strategies (what each one updates).
(Entrocraft on a toy policy: tests/test_rl_objectives.py.)"""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from bebop_megatron.rl.batch import prepare_batch
from bebop_megatron.rl.grpo import group_advantages
from bebop_megatron.rl.rollout import PromptSource
from bebop_megatron.rl.types import Prompt, Sample
from tests.distributed import run_distributed
from tests.tiny_models import tiny_config


def rl_tiny_config(strategy: str = "frozen", tp: int = 1):
    """The tiny trunk (tests/tiny_models.py) with a 64-token tied vocabulary and a small GRPO batch."""
    return tiny_config({"parallel.tensor_model_parallel_size": tp, "parallel.micro_batch_size": 4,
                        "data.seq_length": 32, "rl.prompts_per_step": 2, "rl.group_size": 4, "rl.max_new_tokens": 8,
                        "rl.mtp_strategy": strategy, "rl.lr": 1e-2, "rl.steps": 1, "rl.growmtp_topk": 4,
                        "train.progress": False},
                       vocab_size=64, make_vocab_size_divisible_by=32, tie_word_embeddings=True,
                       transformer_impl="local")


def fake_samples(seed: int, n_prompts: int = 2, group: int = 4, gamma: int = 2, topk: int = 4, vocab: int = 58):
    """Rollout-like samples: random prompts/responses, mixed rewards, verify records."""
    rng = random.Random(seed)
    out = []
    for p in range(n_prompts):
        prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(4, 8))]
        for g in range(group):
            resp = [rng.randrange(2, vocab) for _ in range(rng.randint(3, 8))]
            L0 = len(prompt)
            recs = []
            pos = L0 - 1
            while pos < L0 + len(resp) - 2:
                acc = rng.randint(0, gamma)
                ids = [[rng.randrange(0, vocab) for _ in range(topk)] for _ in range(gamma)]
                ids = [list(dict.fromkeys(row + list(range(topk))))[:topk] for row in ids]
                probs = [[0.5 / topk] * topk for _ in range(gamma)]
                recs.append({"pos": pos, "accepted": acc, "topk_ids": ids, "topk_probs": probs})
                pos += acc + 1
            out.append(Sample(prompt_index=p, prompt_ids=prompt, response_ids=resp,
                              rollout_logprobs=[-rng.uniform(0.5, 3.0) for _ in resp], reward=float((p + g) % 2),
                              truncated=False, weight_version=0, spec_records=recs, verify_ct=len(recs)))
    return out


# ----------------------------------------------------------------------------- batch


def test_prepare_batch_aligns_response_tokens_and_logprobs():
    ss = fake_samples(0)
    b = prepare_batch(ss, 4, 32, gamma=2, record_topk=4)
    for i, s in enumerate(ss):
        full = s.prompt_ids + s.response_ids
        p, n = len(s.prompt_ids), len(full) - 1
        assert b.tokens[i, : n + 1].tolist() == full and b.labels[i, :n].tolist() == full[1:]
        # loss exactly on the label positions holding response tokens
        assert b.loss_mask[i].nonzero().flatten().tolist() == list(range(p - 1, n))
        assert b.labels[i, p - 1 : n].tolist() == s.response_ids
        assert torch.allclose(b.rollout_logp[i, p - 1 : n], torch.tensor(s.rollout_logprobs))
        kept = [r["pos"] for r in s.spec_records if r["pos"] + min(r["accepted"] + 1, 2) < n + 1]
        assert [x for x in b.rec["rec_pos"][i].tolist() if x >= 0] == kept
    assert torch.allclose(b.advantages, group_advantages(b.rewards, 4))


def test_dynamic_sampling_and_overlong_filter():
    ss = fake_samples(1)
    for s in ss[:4]:
        s.reward = 1.0  # group 0: all equal -> no signal
    ss[5].truncated = True
    b = prepare_batch(ss, 4, 32, dynamic_sampling=True, overlong_filter=True)
    assert b.keep.tolist() == [False] * 4 + [True, False, True, True]
    mb = b.microbatches(0, 8, 4)
    assert float(mb[0].loss_mask.sum()) == 0 and float(mb[1].loss_mask[1].sum()) == 0
    assert b.num_loss_tokens() == int(mb[1].loss_mask.sum())


def test_prompt_order_is_a_function_of_seed_and_step():
    prompts = [Prompt(text=str(i), answer=str(i)) for i in range(10)]
    a, b = PromptSource(prompts, 3), PromptSource(prompts, 3)
    seq = [a.indices_for_step(s, 4) for s in range(6)]
    assert seq == [b.indices_for_step(s, 4) for s in range(6)]
    flat = [i for row in seq for i in row]
    assert sorted(flat[:10]) == list(range(10))  # an epoch visits every prompt once


# ----------------------------------------------------------------------------- strategies


def _strategy_worker(rank, world, strategies):
    """One GRPO step per strategy from the same initial weights on the same batch."""
    from bebop_megatron.parallel import destroy_distributed
    from bebop_megatron.rl.trainer import RLTrainer

    results = {}
    samples = fake_samples(7)
    for strat in strategies:
        cfg = rl_tiny_config(strat, tp=world)
        tr = RLTrainer(cfg)
        before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
        m = tr.train_step(samples)
        delta = {n: (p.detach() - before[n]) for n, p in tr.model.named_parameters()}
        results[strat] = {
            "mtp_changed": max(float(d.abs().max()) for n, d in delta.items() if n.startswith("mtp.")),
            "trunk_changed": max(float(d.abs().max()) for n, d in delta.items() if not n.startswith("mtp.")),
            # numpy: torch tensors would travel back through shared memory the exiting worker frees
            "trunk_delta": {n: d.numpy() for n, d in delta.items() if not n.startswith("mtp.")},
            "metrics": m,
        }
        tr.close()
        destroy_distributed()
    if rank != 0:
        return None
    return results


def _assert_strategies(res):
    none_trunk = res["none"]["trunk_delta"]
    for strat, r in res.items():
        assert r["trunk_changed"] > 0, strat  # the policy always trains
        assert math.isfinite(r["metrics"]["loss/pg"])
    assert res["frozen"]["mtp_changed"] == 0.0
    assert res["none"]["mtp_changed"] == 0.0
    for strat in ("online", "growmtp", "occ"):
        assert res[strat]["mtp_changed"] > 0, strat
    # online / growmtp: the MTP loss is detached from the trunk -> the trunk update equals plain GRPO's
    for strat in ("frozen", "online", "growmtp"):
        for n, d in res[strat]["trunk_delta"].items():
            assert np.allclose(d, none_trunk[n], atol=1e-7, rtol=0), (strat, n)
    # occ: the MTP policy loss reaches the trunk
    diff = max(float(np.abs(res["occ"]["trunk_delta"][n] - none_trunk[n]).max()) for n in none_trunk)
    assert diff > 1e-6
    assert res["growmtp"]["metrics"]["growmtp/positions"] > 0
    assert "occ/coef" in res["occ"]["metrics"]
    assert "mtp_online/loss" in res["online"]["metrics"]


def test_strategies_update_only_what_they_should():
    res = run_distributed(_strategy_worker, 1, ["none", "frozen", "online", "growmtp", "occ"])[0]
    _assert_strategies(res)


def test_strategies_tp2():
    # one process group per strategy (re-initialising gloo twice in a row on one port can stall)
    res = {}
    for strat in ("none", "growmtp", "occ"):
        res.update(run_distributed(_strategy_worker, 2, [strat])[0])
    assert res["growmtp"]["mtp_changed"] > 0 and res["occ"]["mtp_changed"] > 0
    for n, d in res["growmtp"]["trunk_delta"].items():
        assert np.allclose(d, res["none"]["trunk_delta"][n], atol=1e-7, rtol=0), n


def _kl_entrocraft_worker(rank, world):
    from bebop_megatron.rl.trainer import RLTrainer

    cfg = rl_tiny_config("frozen")
    cfg.rl.kl_coef, cfg.rl.entropy_control = 0.1, "entrocraft"
    cfg.rl.entrocraft_low, cfg.rl.entrocraft_high = [10.0, 10.0], [11.0, 11.0]  # entropy is below: "low"
    tr = RLTrainer(cfg)
    m1 = tr.train_step(fake_samples(7))
    m2 = tr.train_step(fake_samples(8))
    tr.close()
    return m1, m2


def test_kl_reference_and_entrocraft_in_the_trainer():
    m1, m2 = run_distributed(_kl_entrocraft_worker, 1)[0]
    assert m1["loss/kl_ref"] == 0.0  # the reference is the initial policy
    assert m2["loss/kl_ref"] > 0.0  # one update later the policy has moved away from it
    assert m1["entrocraft/regime"] == -1  # below the band: only negative-advantage samples are kept
    assert 0 < m1["data/kept_samples"] < 1


def _postprocess_seam_worker(rank, world):
    from bebop_megatron.model import build_model
    from bebop_megatron.parallel import initialize_distributed

    cfg = rl_tiny_config("frozen")
    model = build_model(cfg, initialize_distributed(1, 1, seed=0, force_cpu=True))
    tokens = torch.randint(0, 58, (2, 16))
    pos = torch.arange(16).expand(2, 16).contiguous()
    seen = []

    def fn(mdl, hidden, input_ids, position_ids, labels, loss_mask, mtp_kwargs):
        seen.append((mdl is model, tuple(hidden.shape), bool(torch.equal(labels, tokens))))
        return torch.full((2, 16, 2), 7.0)

    out = model(tokens, pos, None, labels=tokens, loss_mask=torch.ones(2, 16), postprocess_fn=fn)
    fn_only_for_its_call = model._postprocess_fn is None
    plain = model(tokens, pos, None, labels=tokens, loss_mask=torch.ones(2, 16))  # megatron's own loss path

    def boom(*a):
        raise KeyError("boom")

    try:
        model(tokens, pos, None, labels=tokens, postprocess_fn=boom)
    except KeyError:
        pass
    return (seen, bool((out == 7.0).all()), fn_only_for_its_call, model._postprocess_fn is None,
            tuple(plain.shape))


def test_postprocess_fn_is_the_one_loss_seam():
    """The RL loss enters through the forward's ``postprocess_fn`` argument, for that call only."""
    seen, replaced, scoped, scoped_after_error, plain_shape = run_distributed(_postprocess_seam_worker, 1)[0]
    assert seen == [(True, (16, 2, 32), True)] and replaced
    assert scoped and scoped_after_error
    assert plain_shape == (2, 16)  # without it: megatron's per-token LM loss
