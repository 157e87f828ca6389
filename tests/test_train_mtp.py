"""`bebop train-mtp` end to end (subprocess, as a user runs it): acceptance rises, only MTP weights
change, kill-and-resume continues without duplicated or skipped steps, checkpoints reshard."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from tests.distributed import run_distributed
from tests.tiny_models import tiny_config

ROOT = Path(__file__).resolve().parents[1]
FAST = [
    "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.mtp_num_layers=2",
    "data.seq_length=32", "data.synthetic_samples=600", "parallel.micro_batch_size=8",
    "parallel.global_batch_size=8", "train.progress=false", "train.log_interval=10", "mtp.rollout_share=0",
]


def bebop(*args, check=True):
    cmd = [sys.executable, "-m", "bebop_megatron.cli", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def train(out, *extra, check=True):
    sets = [f"--set={x}" for x in FAST + [f"train.output_dir={out}", *extra]]
    return bebop("train-mtp", "--config", "configs/tiny_cpu.yaml", *sets, check=check)


def _load_state(rank, world, ckpt):
    from bebop_megatron.checkpointing import checkpoint_config, load_checkpoint
    from bebop_megatron.config import Config
    from bebop_megatron.model import build_model
    from bebop_megatron.parallel import initialize_distributed

    cfg = Config.from_dict(checkpoint_config(ckpt))
    platform = initialize_distributed(1, 1, seed=0)
    model = build_model(cfg, platform)
    extra = load_checkpoint(ckpt, model)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, extra


def load_state(ckpt):
    return run_distributed(_load_state, 1, str(ckpt))[0]


def test_train_mtp_raises_acceptance_and_only_touches_mtp(tmp_path):
    out = tmp_path / "run"
    proc = train(out, "train.trunk_warmup_steps=120", "train.steps=80", "train.lr=0.003", "mtp.warmup_steps=40")
    assert "MTP training done" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    first, last = summary["mtp"]["first"], summary["mtp"]["last"]
    # e2e-TV training raises acceptance on the frozen target
    assert last["mtp/accept_rate"] > first["mtp/accept_rate"] + 0.05, (first, last)
    assert last["mtp/loss"] < first["mtp/loss"]
    # TensorBoard event files for both phases
    assert list((out / "trunk" / "tensorboard").glob("events.out.tfevents.*"))
    assert list((out / "mtp" / "tensorboard").glob("events.out.tfevents.*"))
    # trunk frozen during MTP training: trunk weights identical, MTP weights changed
    trunk_state, _ = load_state(summary["trunk"]["checkpoint"])
    mtp_state, extra = load_state(summary["mtp"]["checkpoint"])
    assert extra["step"] == 80 and extra["phase"] == "mtp"
    changed = [n for n in trunk_state if not torch.equal(trunk_state[n], mtp_state[n])]
    assert changed and all(n.startswith("mtp.") for n in changed), changed
    assert len(changed) == len([n for n in trunk_state if n.startswith("mtp.")])


def test_kill_and_resume_equals_uninterrupted(tmp_path):
    # the two-stage recipe: KL for 4 steps, then e2e-TV; the run is cut at step 3 and resumed, so the
    # resumed invocation crosses the objective switch
    # half the MTP tokens are the trunk's own answers to the RL prompts, sampled once before the phase:
    # the resumed invocation reads them back from the phase's rollout_data.json
    common = ["train.trunk_warmup_steps=0", "train.steps=6", "train.save_interval=3", "train.log_interval=1",
              "mtp.loss=e2e_tv", "mtp.warmup_loss=kl", "mtp.warmup_steps=4", "mtp.rollout_share=0.5",
              "rl.task=sorting", "rl.max_new_tokens=12"]
    full = tmp_path / "full"
    proc = train(full, *common)
    saved = json.loads((full / "mtp" / "rollout_data.json").read_text())
    from bebop_megatron.data import CharTokenizer

    texts = [CharTokenizer().decode(d) for d in saved["docs"]]
    assert texts and all(t.startswith("sort ") and ":" in t for t in texts), texts[:3]
    answers = [t.split(":", 1)[1] for t in texts]  # the (random) trunk's: at most rl.max_new_tokens, cut at the stop
    assert all(len(a) <= 12 for a in answers) and sum(map(len, answers)) > 4 * len(answers), answers[:5]
    assert all(";" not in a[:-1] for a in answers), [a for a in answers if ";" in a[:-1]][:3]
    assert "sampled %d rollout documents" % len(texts) in proc.stdout + proc.stderr
    assert saved["meta"]["task"] == "sorting" and saved["meta"]["max_new_tokens"] == 12
    from bebop_megatron.config import Config
    from bebop_megatron.data import load_documents

    cfg = Config.load(ROOT / "configs" / "tiny_cpu.yaml", FAST + common)
    budget = round(0.5 * sum(len(d) for d in load_documents(cfg, cfg.model.vocab_size)))
    n = [len(d) + 1 for d in saved["docs"]]  # + the EOS each gets in the mix
    assert saved["meta"]["tokens"] == budget and sum(n) >= budget > sum(n[:-1])
    assert "step 5: objective e2e_tv" in proc.stdout + proc.stderr
    sf = json.loads((full / "summary.json").read_text())["mtp"]
    assert sf["first"]["mtp/objective_is_main"] == 0.0 and sf["last"]["mtp/objective_is_main"] == 1.0
    part = tmp_path / "part"
    first = train(part, *common, "train.exit_interval=3")
    assert "rerun the same command to resume" in first.stdout
    s1 = json.loads((part / "summary.json").read_text())
    assert s1["exited_early"] and s1["mtp"]["step"] == 3
    cache = part / "mtp" / "rollout_data.json"
    assert json.loads(cache.read_text())["docs"] == saved["docs"]  # seeded: the same answers
    stamp = cache.stat().st_mtime_ns
    train(part, *common)
    assert cache.stat().st_mtime_ns == stamp  # the resume read them back, it did not sample again
    s2 = json.loads((part / "summary.json").read_text())
    assert s2["mtp"]["start_step"] == 3 and s2["mtp"]["steps_run"] == 3 and s2["mtp"]["step"] == 6
    # resuming the optimizer under another TP/PP is refused with a clear message
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "bebop_megatron.cli",
         "train-mtp", "--config", "configs/tiny_cpu.yaml", *[f"--set={x}" for x in FAST + common],
         f"--set=train.output_dir={part}", "--set=train.steps=8", "--set=parallel.tensor_model_parallel_size=2"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "optimizer state was saved at TP/PP" in proc.stderr, proc.stderr[-3000:]
    assert json.loads((part / "config.json").read_text())["parallel"]["tensor_model_parallel_size"] == 1
    a, ea = load_state(json.loads((full / "summary.json").read_text())["mtp"]["checkpoint"])
    b, eb = load_state(s2["mtp"]["checkpoint"])
    assert ea["consumed_samples"] == eb["consumed_samples"] == 6 * 8
    for n in a:
        assert torch.allclose(a[n], b[n], rtol=0, atol=1e-6), n


def test_bad_data_and_load_paths_are_clear_errors(tmp_path):
    bad = tmp_path / "d.jsonl"
    bad.write_text('{"text": "1+1=2;"}\n{"input_ids": [1, 2, 500]}\n')
    proc = train(tmp_path / "o", f"data.path={bad}", check=False)
    assert proc.returncode == 2 and "d.jsonl:2: token id 500" in proc.stderr and "Traceback" not in proc.stderr
    proc = train(tmp_path / "o2", f"train.load={tmp_path / 'nothing'}", check=False)
    assert proc.returncode == 2 and "holds no checkpoint" in proc.stderr
    # a rerun resumes in its output_dir: a run of another model there (separate heads, not the
    # recurrent one) is refused by name, not loaded in part
    short = ["train.trunk_warmup_steps=0", "train.steps=2", "mtp.warmup_steps=0", "mtp.kl_warmup_steps=0"]
    train(tmp_path / "o3", *short, "model.mtp_recurrent=false")
    proc = train(tmp_path / "o3", *short, "train.steps=4", "model.mtp_recurrent=true", check=False)
    assert proc.returncode == 2 and "mtp_recurrent: False there, True here" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_bad_config_is_a_clear_error(tmp_path):
    proc = train(tmp_path / "bad", "model.mtp_num_layers=0", check=False)
    assert proc.returncode == 2
    assert "mtp_num_layers" in proc.stderr and "Traceback" not in proc.stderr
    proc = train(tmp_path / "bad", "mtp.loss=l2", check=False)
    assert proc.returncode == 2 and "mtp.loss" in proc.stderr
    proc = train(tmp_path / "bad", "mtp.warmup_loss=kl", "mtp.warmup_steps=300", "train.steps=300", check=False)
    assert proc.returncode == 2 and "mtp.warmup_steps (300) must be < train.steps" in proc.stderr
    assert not (tmp_path / "bad").exists()


def _reshard_worker(rank, world, ckpt_dir):
    """Save at TP=1 (DP=2), load the same checkpoint at TP=2: identical logits."""
    from megatron.core import parallel_state

    from bebop_megatron.checkpointing import latest_checkpoint, load_checkpoint, save_checkpoint
    from bebop_megatron.model import build_model
    from bebop_megatron.parallel import initialize_distributed
    from tests.test_parallel import _batch
    from tests.tiny_models import tiny_config

    cfg = tiny_config(tie_word_embeddings=False)
    tokens, _, _, pos = _batch(5)
    platform = initialize_distributed(1, 1, seed=0)
    m1 = build_model(cfg, platform)
    m1.eval()
    with torch.no_grad():
        ref = m1(tokens, pos, None)
    save_checkpoint(ckpt_dir, 7, m1, extra={"consumed_samples": 3})
    parallel_state.destroy_model_parallel()

    cfg.parallel.tensor_model_parallel_size = 2
    platform = initialize_distributed(2, 1, seed=99)  # different init: weights must come from the file
    m2 = build_model(cfg, platform)
    m2.eval()
    extra = load_checkpoint(latest_checkpoint(ckpt_dir), m2)
    with torch.no_grad():
        local = m2(tokens, pos, None)  # [b, s, V/TP]
    parts = [torch.empty_like(local) for _ in range(2)]
    torch.distributed.all_gather(parts, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    got = torch.cat(parts, dim=-1)
    return {"max_diff": (got - ref).abs().max().item(), "extra": extra}


def test_checkpoint_round_trip_and_tp_reshard(tmp_path):
    results = run_distributed(_reshard_worker, 2, str(tmp_path / "ck"))
    for r in results:
        assert r["max_diff"] < 1e-5, r
        assert r["extra"]["step"] == 7 and r["extra"]["consumed_samples"] == 3
    ck = tmp_path / "ck" / "checkpoints"
    assert (ck / "latest").read_text() == "iter_0000007"
    assert not list(ck.glob("*.tmp"))


def _weights_only_worker(rank, world, ckpt_dir):
    """A trunk saved with 2 MTP heads loads into a model with 3: the trunk and heads 0-1 come from
    the file, head 2 keeps its initialisation; ``fresh`` keeps every head's; a tensor the file lacks
    and nobody allowed to be missing is a clear error."""
    from bebop_megatron.checkpointing import CheckpointMismatch, latest_checkpoint, load_model_weights, save_checkpoint
    from bebop_megatron.model import build_model
    from bebop_megatron.parallel import initialize_distributed

    platform = initialize_distributed(1, 1, seed=0)
    saved = build_model(tiny_config(mtp_num_layers=2), platform)
    save_checkpoint(ckpt_dir, 1, saved)
    ck = latest_checkpoint(ckpt_dir)
    src = {n: p.detach().clone() for n, p in saved.named_parameters()}
    is_head = lambda name: name.startswith("mtp.")  # noqa: E731
    out = {}
    for case in ("missing_ok", "fresh", "strict"):
        torch.manual_seed(1234)  # another initialisation than the saved model's
        m = build_model(tiny_config(mtp_num_layers=3), platform)
        init = {n: p.detach().clone() for n, p in m.named_parameters()}
        try:
            kept = load_model_weights(ck, m, fresh=is_head if case == "fresh" else None,
                                      missing_ok=None if case == "strict" else is_head)
        except CheckpointMismatch as e:
            out[case] = {"error": str(e)}
            continue
        now = dict(m.named_parameters())
        out[case] = {
            "kept": sorted(kept),
            "not_from_file": sorted(n for n in now if n not in src or not torch.equal(now[n], src[n])),
            "not_init": sorted(n for n in now if not torch.equal(now[n], init[n])),
            "names": sorted(now),
            "init_differs": sorted(n for n in src if not torch.equal(init[n], src[n])),
        }
    # heads of another width (model.mtp_ffn_hidden_size): with missing_ok they start fresh; a trunk of
    # another width is named with both shapes
    torch.manual_seed(1234)
    narrow = build_model(tiny_config(mtp_num_layers=2, mtp_ffn_hidden_size=24), platform)
    init = {n: p.detach().clone() for n, p in narrow.named_parameters()}
    kept = load_model_weights(ck, narrow, missing_ok=is_head)
    now = dict(narrow.named_parameters())
    out["narrow"] = {"kept": sorted(k for k in kept if not k.endswith("._extra_state")),
                     "heads_init": all(torch.equal(now[n], init[n]) for n in now if n.startswith("mtp.")),
                     "trunk_from_file": all(torch.equal(now[n], src[n]) for n in now if not n.startswith("mtp.")),
                     "heads": sorted(n for n in now if n.startswith("mtp."))}
    try:
        load_model_weights(ck, build_model(tiny_config(mtp_num_layers=2, ffn_hidden_size=96), platform),
                           missing_ok=is_head)
    except CheckpointMismatch as e:
        out["wide_trunk"] = str(e)
    return out


def test_weights_only_load_keeps_missing_or_fresh_heads(tmp_path):
    r = run_distributed(_weights_only_worker, 1, str(tmp_path / "ck"))[0]
    head2 = [n for n in r["missing_ok"]["names"] if n.startswith("mtp.layers.2.")]
    heads01 = [n for n in r["missing_ok"]["names"] if n.startswith(("mtp.layers.0.", "mtp.layers.1."))]
    trunk = [n for n in r["missing_ok"]["names"] if not n.startswith("mtp.")]
    assert head2 and heads01 and trunk
    assert set(r["missing_ok"]["init_differs"]) & set(heads01) and set(r["missing_ok"]["init_differs"]) & set(trunk)
    # missing_ok: everything the file has is loaded; head 2 keeps its init
    assert set(r["missing_ok"]["not_from_file"]) == set(head2)
    assert not set(r["missing_ok"]["not_init"]) & set(head2)
    assert {k for k in r["missing_ok"]["kept"] if not k.endswith("._extra_state")} == set(head2)
    # fresh: the trunk from the file, every head its own init
    assert set(r["fresh"]["not_from_file"]) <= set(heads01 + head2)
    assert not set(r["fresh"]["not_init"]) & set(heads01 + head2)
    # strict: the missing head is named
    assert "holds no mtp.layers.2." in r["strict"]["error"] and "different model config" in r["strict"]["error"]
    # narrow heads: every head tensor keeps its init (the saved heads are wider), the trunk loads
    assert r["narrow"]["heads_init"] and r["narrow"]["trunk_from_file"] and set(r["narrow"]["kept"]) == set(r["narrow"]["heads"])
    assert "other shapes" in r["wide_trunk"] and "(2, 32, 64) there, (2, 32, 96) here" in r["wide_trunk"], r["wide_trunk"]


def test_rollout_share_samples_once_across_tensor_parallel_ranks(tmp_path):
    """TP=2: rank 0 gathers both shards of the trunk, samples the answers alone and broadcasts them;
    the phase trains on them on both ranks."""
    out = tmp_path / "tp2"
    common = FAST + ["train.trunk_warmup_steps=0", "train.steps=2", "mtp.warmup_steps=0", "mtp.kl_warmup_steps=0",
                     "mtp.rollout_share=0.5", "rl.task=sorting", "rl.max_new_tokens=12",
                     "parallel.tensor_model_parallel_size=2", f"train.output_dir={out}"]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "bebop_megatron.cli",
         "train-mtp", "--config", "configs/tiny_cpu.yaml", *[f"--set={x}" for x in common]],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    docs = json.loads((out / "mtp" / "rollout_data.json").read_text())["docs"]
    log = proc.stdout + proc.stderr
    assert log.count(f"sampled {len(docs)} rollout documents") == 1, log[-2000:]  # rank 0 alone
    assert json.loads((out / "summary.json").read_text())["mtp"]["step"] == 2
