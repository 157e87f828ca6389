"""`bebop serve` as a real process on loopback: SGLang's native API, weight updates (MTP too),
malformed requests answered with 4xx JSON while the server keeps serving."""

import base64
import json
import pickle

import httpx
import pytest
import torch
from safetensors.torch import load_file, save

from bebop_megatron.data import CharTokenizer
from bebop_megatron.rollout.engine import Engine, SamplingParams, SpecConfig
from bebop_megatron.rollout.modeling import CausalLMWithMTP
from tests.server_utils import ServerProcess
from tests.tiny_models import make_hf_checkpoint

SPEC = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "4", "--dtype", "float64"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    a = tmp_path_factory.mktemp("model_a")
    b = tmp_path_factory.mktemp("model_b")
    make_hf_checkpoint(a, "qwen3", "deepseek", num_mtp=3, seed=0, scale=2.0)
    make_hf_checkpoint(b, "qwen3", "deepseek", num_mtp=3, seed=5, scale=2.0)
    return a, b


@pytest.fixture(scope="module")
def server(ckpts):
    s = ServerProcess(ckpts[0], *SPEC, api_key="sekret")
    yield s
    s.stop()


def local_engine(path, spec=True):
    model = CausalLMWithMTP.from_pretrained(path, dtype=torch.float64)
    return Engine(model, CharTokenizer(), SpecConfig("mtp" if spec else "none", 3), max_running=8, max_len=2048)


def test_generate_matches_engine_and_reports_spec_metrics(server, ckpts):
    r = server.post("/generate", {"text": "12+7=", "sampling_params": {"max_new_tokens": 16, "temperature": 0},
                                  "return_logprob": True})
    assert r.status_code == 200, r.text
    out = r.json()
    ref = local_engine(ckpts[0], spec=False).generate([CharTokenizer().encode("12+7=")],
                                                       SamplingParams(max_new_tokens=16, temperature=0.0))[0]
    assert out["output_ids"] == ref.output_ids
    assert out["text"] == CharTokenizer().decode(ref.output_ids)
    m = out["meta_info"]
    assert m["finish_reason"] == {"type": "length", "length": 16}
    assert m["prompt_tokens"] == 5 and m["completion_tokens"] == 16 and m["weight_version"] == "default"
    assert len(m["output_token_logprobs"]) == 16 and all(lp[1] == t for lp, t in zip(m["output_token_logprobs"], out["output_ids"]))
    assert m["spec_verify_ct"] >= 1 and abs(m["spec_accept_length"] - 16 / m["spec_verify_ct"]) < 1e-9
    for a, b in [("spec_num_correct_drafts", "spec_num_proposed_drafts"), ("spec_accepted_drafts", "spec_proposed_drafts"),
                 ("spec_accept_token_num", "spec_draft_token_num")]:
        assert m[a] == m["spec_num_correct_drafts"] and m[b] == 3 * m["spec_verify_ct"]
    assert sum(m["spec_accepted_per_depth"][:1]) == m["spec_accepted_per_depth"][0]


def test_batches_n_rid_and_stream(server):
    r = server.post("/generate", {"input_ids": [[5, 6, 7], [8, 9]],
                                  "sampling_params": [{"max_new_tokens": 4, "temperature": 0},
                                                      {"max_new_tokens": 5, "temperature": 1.0, "n": 3, "seed": 1, "ignore_eos": True}],
                                  "rid": ["a", "b"]})
    assert r.status_code == 200, r.text
    outs = r.json()
    assert len(outs) == 4 and [o["meta_info"]["id"] for o in outs] == ["a", "b-0", "b-1", "b-2"]
    assert [len(o["output_ids"]) for o in outs] == [4, 5, 5, 5]
    with httpx.stream("POST", server.url + "/generate", headers=server.headers, timeout=60,
                      json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 6, "temperature": 0},
                            "stream": True}) as resp:
        chunks = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert events[-1]["output_ids"] == outs[0]["output_ids"] + events[-1]["output_ids"][4:]
    lens = [len(e["output_ids"]) for e in events]
    assert lens == sorted(lens) and lens[-1] == 6


def test_info_endpoints_and_completions(server):
    assert server.get("/health").json() == {"status": "ok"}
    assert server.get("/health_generate").status_code == 200
    info = server.get("/get_model_info").json()
    assert info["is_generation"] and info["num_mtp_modules"] == 3
    si = server.get("/get_server_info").json()
    assert si["speculative_num_steps"] == 3 and si["internal_states"][0]["avg_spec_accept_length"] >= 1.0
    assert server.post("/flush_cache").json()["success"]
    c = server.post("/v1/completions", {"prompt": "3*4=", "max_tokens": 5, "temperature": 0, "logprobs": 1})
    assert c.status_code == 200, c.text
    body = c.json()
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 5
    assert len(body["choices"][0]["logprobs"]["token_logprobs"]) == 5


def test_api_key_required(server):
    assert httpx.post(server.url + "/generate", json={"input_ids": [1]}).status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("body,status", [
    ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, 400),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, 400),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10 ** 9}}, 400),
    ({"input_ids": [1, 99999]}, 400),
    ({"input_ids": []}, 400),
    ({"text": "hi", "input_ids": [1]}, 400),
    ({"text": 5}, 400),
    ({"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}}, 400),
    ({"input_ids": [1], "sampling_params": {"bogus": 1}}, 400),
    ({"input_ids": [1], "sampling_params": {"n": 0}}, 400),
    ({"text": "é"}, 400),
])
def test_malformed_requests_get_4xx_json(server, body, status):
    r = server.post("/generate", body)
    assert r.status_code == status and "error" in r.json(), (body, r.text)


def test_broken_json_and_pickles_refused_server_survives(server):
    r = httpx.post(server.url + "/generate", content=b"{not json", headers={**server.headers, "content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    evil = base64.b64encode(pickle.dumps({"model.norm.weight": torch.ones(48)})).decode()
    r = server.post("/update_weights_from_tensor", {"serialized_named_tensors": [evil], "load_format": "direct"})
    assert r.status_code == 400 and "pickled" in r.json()["error"]["message"]
    r = server.post("/update_weights_from_tensor", {"serialized_named_tensors": [evil]})
    assert r.status_code == 400 and "safetensors" in r.json()["error"]["message"]
    bad_shape = base64.b64encode(save({"model.norm.weight": torch.ones(7)})).decode()
    r = server.post("/update_weights_from_tensor", {"serialized_named_tensors": [bad_shape]})
    assert r.status_code == 400 and "model.norm.weight" in r.json()["error"]["message"]
    assert server.alive()
    ok = server.post("/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 4


def test_abort_and_pause_continue(server):
    import threading

    result = {}

    def long_request():
        result["r"] = server.post("/generate", {"input_ids": [5, 6], "rid": "long",
                                                "sampling_params": {"max_new_tokens": 1500, "temperature": 1.0,
                                                                    "ignore_eos": True}})

    t = threading.Thread(target=long_request)
    t.start()
    import time

    deadline = time.time() + 30
    while server.get("/get_server_info").json()["internal_states"][0]["num_running_reqs"] < 1:
        assert time.time() < deadline, "the long request never started"
        time.sleep(0.05)
    assert server.post("/abort_request", {"rid": "long"}).json()["aborted"] == 1
    t.join(60)
    assert result["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert server.post("/pause_generation", {"mode": "in_place"}).json()["success"]
    assert server.get("/get_server_info").json()["paused"]
    assert server.post("/continue_generation").json()["success"]
    assert server.post("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}).status_code == 200


def test_weight_update_moves_trunk_and_mtp(ckpts):
    a, b = ckpts
    s = ServerProcess(a, *SPEC)
    try:
        prompt = [5, 6, 7, 8]
        sp = {"max_new_tokens": 24, "temperature": 0}
        before = s.post("/generate", {"input_ids": prompt, "sampling_params": sp}).json()
        tensors = {}
        for f in sorted(b.glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        payload = base64.b64encode(save(tensors)).decode()
        r = s.post("/update_weights_from_tensor", {"serialized_named_tensors": [payload], "weight_version": "v2"})
        assert r.status_code == 200, r.text
        assert r.json()["num_mtp_tensors"] > 0 and r.json()["weight_version"] == "v2"
        after = s.post("/generate", {"input_ids": prompt, "sampling_params": sp}).json()
        ref = local_engine(b).generate([prompt], SamplingParams(max_new_tokens=24, temperature=0.0))[0]
        assert after["output_ids"] == ref.output_ids != before["output_ids"]
        # the draft heads moved too: greedy acceptance counts equal the new model's exactly
        assert after["meta_info"]["spec_num_correct_drafts"] == ref.accepted
        assert after["meta_info"]["weight_version"] == "v2"
        # from disk, back to model a
        r = s.post("/update_weights_from_disk", {"model_path": str(a), "weight_version": "v3"})
        assert r.status_code == 200 and r.json()["num_mtp_tensors"] > 0
        again = s.post("/generate", {"input_ids": prompt, "sampling_params": sp}).json()
        assert again["output_ids"] == before["output_ids"]
        assert again["meta_info"]["spec_num_correct_drafts"] == before["meta_info"]["spec_num_correct_drafts"]
    finally:
        s.stop()


def test_interrupted_sync_leaves_old_weights_and_versions_switch_atomically(ckpts):
    a, b = ckpts
    s = ServerProcess(a, *SPEC)
    try:
        prompt, sp = [5, 6, 7, 8], {"max_new_tokens": 16, "temperature": 0}
        before = s.post("/generate", {"input_ids": prompt, "sampling_params": sp}).json()
        tensors = {}
        for f in sorted(b.glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        names = sorted(tensors)
        third = len(names) // 3
        chunks = [names[:third], names[third:2 * third], names[2 * third:]]
        enc = lambda ns: base64.b64encode(save({n: tensors[n] for n in ns})).decode()
        # a sync that dies after two of its three buckets: nothing is served from them
        for ns in chunks[:2]:
            r = s.post("/update_weights_from_tensor", {"serialized_named_tensors": [enc(ns)], "stage": True,
                                                       "stage_version": "v-dead"})
            assert r.status_code == 200 and r.json()["staged"] == len(ns)
        mid = s.post("/generate", {"input_ids": prompt, "sampling_params": sp}).json()
        assert mid["output_ids"] == before["output_ids"] and mid["meta_info"]["weight_version"] == "default"
        # a bad bucket is refused at staging time, before anything could be applied
        bad = base64.b64encode(save({"model.norm.weight": torch.full((48,), float("nan"))})).decode()
        r = s.post("/update_weights_from_tensor", {"serialized_named_tensors": [bad], "stage": True, "stage_version": "v9"})
        assert r.status_code == 400 and "finite" in r.json()["error"]["message"]
        # a complete new sync replaces the abandoned staging and switches in one step
        for i, ns in enumerate(chunks):
            last = i == 2
            r = s.post("/update_weights_from_tensor", {"serialized_named_tensors": [enc(ns)], "stage": not last,
                                                       "stage_version": None if last else "v2",
                                                       "weight_version": "v2" if last else None})
            assert r.status_code == 200, r.text
        assert r.json()["num_tensors"] == len(names) and r.json()["num_mtp_tensors"] > 0
        after = s.post("/generate", {"input_ids": prompt, "sampling_params": sp}).json()
        ref = local_engine(b).generate([prompt], SamplingParams(max_new_tokens=16, temperature=0.0))[0]
        assert after["output_ids"] == ref.output_ids and after["meta_info"]["weight_version"] == "v2"
    finally:
        s.stop()
