"""SGLang's distributed weight update end to end over gloo: the trainer side (WeightPusher ->
rollout manager -> bridge, rank 0 broadcasting) against real `bebop serve` processes that
implement /init_weights_update_group, /update_weights_from_distributed and
/destroy_weights_update_group. The draft (MTP) weights must change with the trunk (sglang#27718)."""

import pytest
import torch
from safetensors.torch import load_file

from bebop_megatron.config import Config
from bebop_megatron.data import CharTokenizer
from bebop_megatron.rollout.engine import Engine, SamplingParams, SpecConfig
from bebop_megatron.rollout.modeling import CausalLMWithMTP
from tests.server_utils import ServerProcess

SPEC = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3", "--dtype", "float64"]
PROMPT = [5, 6, 7, 8]
SEED = 7


@pytest.fixture(scope="module")
def ckpts(tiny_checkpoint):
    return tiny_checkpoint(seed=0), tiny_checkpoint(seed=5)


def load(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def reference(path, n=24, draft_from=None):
    """Seeded speculative sampling in-process (rejection sampling at temperature 1): tokens and
    accepted drafts depend on the MTP heads too (``draft_from``: heads from another checkpoint)."""
    model = CausalLMWithMTP.from_pretrained(path, dtype=torch.float64)
    if draft_from is not None:
        L = model.config.num_hidden_layers
        model.load_hf_state_dict({k: v for k, v in load(draft_from).items()
                                  if k.startswith("model.layers.") and int(k.split(".")[2]) >= L}, strict=False)
    eng = Engine(model, CharTokenizer(), SpecConfig("mtp", 3), max_running=4, max_len=512)
    r = eng.generate([PROMPT], SamplingParams(max_new_tokens=n, temperature=1.0, seed=SEED, ignore_eos=True))[0]
    return r.output_ids, r.accepted


def served(s, n=24):
    out = s.post("/generate", {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": n, "temperature": 1.0, "sampling_seed": SEED, "ignore_eos": True}}).json()
    assert out["meta_info"]["finish_reason"]["type"] == "length", out["meta_info"]
    return out["output_ids"], out["meta_info"]["spec_num_correct_drafts"], out["meta_info"]["weight_version"]


def test_update_weights_from_distributed_gloo_against_bebop_serve(ckpts):
    from bebop_megatron.rl.rollout import RolloutManager
    from bebop_megatron.rl.weight_sync import WeightPusher

    a, b = ckpts
    ref_a, ref_b = reference(a), reference(b)
    # a trunk-only update (the sglang#27718 bug) would keep a's draft: another sample
    assert reference(b, draft_from=a) != ref_b and ref_a != ref_b
    servers = [ServerProcess(a, *SPEC) for _ in range(2)]
    manager = None
    try:
        for s in servers:
            assert served(s)[:2] == (ref_a[0], ref_a[1])
            # the routes follow SGLang: {success, message}, 400 on failure
            r = s.post("/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]],
                                                            "group_name": "nope"})
            assert r.status_code == 400 and r.json()["success"] is False and "init_weights_update_group" in r.text
            r = s.post("/destroy_weights_update_group", {"group_name": "nope"})
            assert r.status_code == 400 and r.json()["success"] is False
            r = s.post("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                      "rank_offset": 1, "world_size": 2, "backend": "nccl"})
            assert r.status_code == 400 and "gloo" in r.json()["message"]
        tensors = load(b)
        names = sorted(tensors)
        buckets = [{n: tensors[n].float() for n in names[i:i + 7]} for i in range(0, len(names), 7)]
        cfg = Config()
        manager = RolloutManager([s.url for s in servers], cfg, CharTokenizer(), [])
        pusher = WeightPusher(manager, cfg, "/tmp", expect_mtp=True, mode="distributed", backend="gloo",
                              timeout_s=120)
        res = pusher.push(buckets, 1)
        assert res["servers"] == 2
        for s in servers:
            got = res["results"][s.url]
            assert got["num_tensors"] == len(names) and got["num_mtp_tensors"] > 0
            assert served(s) == (ref_b[0], ref_b[1], "1")  # trunk and draft both hold b now
        # the group stays up: a second push reuses it
        buckets2 = [{n: t for n, t in bk.items()} for bk in buckets]
        assert pusher.push(buckets2, 2)["servers"] == 2
        assert all(served(s)[2] == "2" for s in servers)
        group = manager.bridge._group["name"]
        manager.close()  # destroys the group on both ends
        manager = None
        for s in servers:
            r = s.post("/destroy_weights_update_group", {"group_name": group})
            assert r.status_code == 400  # already destroyed by the bridge
            assert s.get("/health").status_code == 200
    finally:
        if manager is not None:
            manager.close()
        for s in servers:
            s.stop()
