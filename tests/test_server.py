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
from tests.test_sglang_types import check_generate, sgl  # noqa: F401  (fixture)

SPEC = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "4", "--dtype", "float64"]


@pytest.fixture(scope="module")
def ckpts(tiny_checkpoint):
    return tiny_checkpoint(seed=0), tiny_checkpoint(seed=5)


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
        # proposed: drafts that could still be emitted (the engine's acceptance metric), at most γ per verify
        assert m[a] == m["spec_num_correct_drafts"] and m[b] == m["spec_num_proposed_drafts"]
    assert m["spec_num_correct_drafts"] <= m["spec_num_proposed_drafts"] <= 3 * m["spec_verify_ct"]
    acc, reach = m["spec_accepted_per_depth"], m["spec_reached_per_depth"]
    assert len(acc) == len(reach) == 3 and sum(acc) == m["spec_num_correct_drafts"]
    assert all(a <= r for a, r in zip(acc, reach)) and reach[0] <= m["spec_verify_ct"]
    assert sum(reach) <= m["spec_num_proposed_drafts"] and list(reach) == sorted(reach, reverse=True)


def test_batches_n_rid_and_stream(server):
    # SGLang: every prompt of a batch uses the same n; duplicate rids are refused
    mixed = server.post("/generate", {"input_ids": [[5, 6, 7], [8, 9]],
                                      "sampling_params": [{"max_new_tokens": 4}, {"max_new_tokens": 5, "n": 3}]})
    assert mixed.status_code == 400 and "same n" in mixed.json()["error"]["message"]
    dup = server.post("/generate", {"input_ids": [[5, 6, 7], [8, 9]], "rid": ["x", "x"]})
    assert dup.status_code == 400 and "duplicate" in dup.json()["error"]["message"]
    r = server.post("/generate", {"input_ids": [[5, 6, 7], [8, 9]],
                                  "sampling_params": [{"max_new_tokens": 4, "temperature": 0},
                                                      {"max_new_tokens": 5, "temperature": 1.0, "seed": 1, "ignore_eos": True}],
                                  "rid": ["a", "b"]})
    assert r.status_code == 200, r.text
    assert [o["meta_info"]["id"] for o in r.json()] == ["a", "b"]
    outs = r.json()[:1]
    r = server.post("/generate", {"input_ids": [8, 9], "rid": "b",
                                  "sampling_params": {"max_new_tokens": 5, "n": 3, "sampling_seed": 1, "ignore_eos": True}})
    assert [o["meta_info"]["id"] for o in r.json()] == ["b-0", "b-1", "b-2"]
    assert [len(o["output_ids"]) for o in r.json()] == [5, 5, 5]
    # one rid string for a batch: rid_0, rid_1, ... (SGLang's _normalize_rid)
    r = server.post("/generate", {"input_ids": [[5, 6], [8, 9]], "rid": "batch", "sampling_params": {"max_new_tokens": 2}})
    assert [o["meta_info"]["id"] for o in r.json()] == ["batch_0", "batch_1"]
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
    gen = server.post("/generate", {"text": "5+5=", "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert gen.status_code == 200, gen.text  # so that the speculative counters below are this test's own
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
    ({"input_ids": [1], "sampling_params": {"frequency_penalty": 2.5}}, 400),
    ({"input_ids": [1], "sampling_params": {"repetition_penalty": 0}}, 400),
    ({"input_ids": [1], "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 4}}, 400),
    ({"input_ids": [1], "sampling_params": {"logit_bias": {"99999": 1.0}}}, 400),
    ({"input_ids": [1], "sampling_params": {"logit_bias": {"3": 1e300}}}, 400),
    ({"input_ids": [1], "sampling_params": {"stop_regex": "(unclosed"}}, 400),
    ({"input_ids": [1], "sampling_params": {"stop_regex": ["x" * 300]}}, 400),
    ({"input_ids": [1], "sampling_params": {"regex": "a+"}}, 400),
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
    fr = result["r"].json()["meta_info"]["finish_reason"]
    assert fr == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}  # SGLang's FINISH_ABORT()
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


def _running(server):
    st = server.get("/get_server_info").json()["internal_states"][0]
    return st["num_running_reqs"] + st["num_waiting_reqs"], st["total_generated_tokens"]


def _wait_idle(server, timeout=20.0):
    import time

    deadline = time.time() + timeout
    while _running(server)[0]:
        assert time.time() < deadline, "requests of a departed client kept running"
        time.sleep(0.05)


def test_client_disconnect_aborts_its_requests(server):
    """A client that leaves (non-streaming or streaming) has its requests aborted, instead of
    generating to max_new_tokens for nobody."""
    import time

    _wait_idle(server)
    long = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1800, "ignore_eos": True}}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/generate", json=long, headers=server.headers, timeout=1.0)
    _wait_idle(server)
    with httpx.stream("POST", server.url + "/generate", json={**long, "stream": True}, headers=server.headers,
                      timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                break  # one event, then leave
    _wait_idle(server)
    _, tokens = _running(server)
    time.sleep(0.5)
    assert _running(server)[1] == tokens  # nothing generating for departed clients


def test_health_answers_while_the_engine_is_busy(server):
    """The event loop never waits for the engine lock: /health stays fast with work in flight."""
    import threading
    import time

    def busy():
        server.post("/generate", {"input_ids": [[5, 6]] * 8, "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}})

    t = threading.Thread(target=busy)
    t.start()
    while _running(server)[0] == 0:
        time.sleep(0.02)
    lat = []
    for _ in range(20):
        t0 = time.perf_counter()
        assert server.get("/health").status_code == 200
        lat.append(time.perf_counter() - t0)
        time.sleep(0.02)
    t0 = time.perf_counter()
    assert server.post("/abort_request", {"abort_all": True}).status_code == 200
    abort_s = time.perf_counter() - t0
    t.join(60)
    lat.sort()
    assert lat[len(lat) // 2] < 0.2 and abort_s < 2.0, (lat, abort_s)


def test_weight_update_from_odd_files_is_a_clean_400(server, tmp_path):
    """Dangling/looping symlinks, a FIFO, a folder named *.safetensors, empty or corrupt files and
    a 5,000-character path: a 400 each (a FIFO never freezes the server), old weights kept."""
    import os

    sp = {"max_new_tokens": 8, "temperature": 0}
    before = server.post("/generate", {"input_ids": [5, 6, 7], "sampling_params": sp}).json()["output_ids"]
    cases = {}
    for name, make in {
        "dangling": lambda d: (d / "m.safetensors").symlink_to(d / "missing.safetensors"),
        "loop": lambda d: ((d / "a.safetensors").symlink_to(d / "b.safetensors"),
                           (d / "b.safetensors").symlink_to(d / "a.safetensors")),
        "fifo": lambda d: os.mkfifo(d / "model.safetensors"),
        "folder": lambda d: (d / "x.safetensors").mkdir(),
        "empty": lambda d: (d / "m.safetensors").write_bytes(b""),
        "corrupt": lambda d: (d / "m.safetensors").write_bytes(b"\xff" * 64),
        "none": lambda d: None,
    }.items():
        d = tmp_path / name
        d.mkdir()
        make(d)
        cases[name] = str(d)
    cases["long_path"] = "/" + "x" * 5000
    cases["not_a_dir"] = str(tmp_path / "nothing_here")
    for name, path in cases.items():
        r = server.post("/update_weights_from_disk", {"model_path": path, "weight_version": "bad"}, timeout=30)
        assert r.status_code == 400, (name, r.status_code, r.text[:300])
        assert r.json()["success"] is False and r.json()["message"], name
    after = server.post("/generate", {"input_ids": [5, 6, 7], "sampling_params": sp}).json()
    assert after["output_ids"] == before and after["meta_info"]["weight_version"] != "bad"


def test_finite_check_after_cast_and_unsupported_dtypes(server, tmp_path):
    """float64 1e300 becomes inf in the model's float32 -> 400 (the server runs float64 here, so
    float32-overflowing values are checked on a float32 server below); float8 and int tensors -> 400."""
    from safetensors.torch import save_file

    sp = {"max_new_tokens": 8, "temperature": 0}
    before = server.post("/generate", {"input_ids": [5, 6, 7], "sampling_params": sp}).json()["output_ids"]
    for t in (torch.ones(48, dtype=torch.float8_e4m3fn), torch.ones(48, dtype=torch.int32)):
        payload = base64.b64encode(save({"model.norm.weight": t})).decode()
        r = server.post("/update_weights_from_tensor", {"serialized_named_tensors": [payload]})
        assert r.status_code == 400 and "dtype" in r.json()["message"], r.text
        d = tmp_path / str(t.dtype).split(".")[-1]
        d.mkdir()
        save_file({"model.norm.weight": t}, str(d / "m.safetensors"))
        r = server.post("/update_weights_from_disk", {"model_path": str(d)})
        assert r.status_code == 400 and r.json()["success"] is False, r.text
    assert server.post("/generate", {"input_ids": [5, 6, 7], "sampling_params": sp}).json()["output_ids"] == before


def test_finite_check_after_cast_on_a_float32_server(ckpts, tmp_path):
    from safetensors.torch import save_file

    s = ServerProcess(ckpts[0], "--dtype", "float32")
    try:
        sp = {"max_new_tokens": 8, "temperature": 0}
        before = s.post("/generate", {"input_ids": [5, 6, 7], "sampling_params": sp}).json()["output_ids"]
        huge = torch.full((48,), 1e300, dtype=torch.float64)  # finite in float64, inf in float32
        payload = base64.b64encode(save({"model.norm.weight": huge})).decode()
        r = s.post("/update_weights_from_tensor", {"serialized_named_tensors": [payload]})
        assert r.status_code == 400 and "not finite" in r.json()["message"], r.text
        save_file({"model.norm.weight": huge}, str(tmp_path / "m.safetensors"))
        r = s.post("/update_weights_from_disk", {"model_path": str(tmp_path)})
        assert r.status_code == 400 and "not finite" in r.json()["message"], r.text
        assert s.post("/generate", {"input_ids": [5, 6, 7], "sampling_params": sp}).json()["output_ids"] == before
        # a good update answers SGLang's shape
        r = s.post("/update_weights_from_disk", {"model_path": str(ckpts[1]), "weight_version": "v1"})
        assert r.status_code == 200, r.text
        assert {"success", "message", "num_paused_requests"} <= set(r.json()) and r.json()["success"]
    finally:
        s.stop()


def test_api_key_from_env_or_file(tmp_path, monkeypatch):
    import argparse

    from bebop_megatron.rollout.server import resolve_api_key

    ns = lambda **kw: argparse.Namespace(**{"api_key": None, "api_key_file": None, **kw})  # noqa: E731
    monkeypatch.delenv("BEBOP_API_KEY", raising=False)
    assert resolve_api_key(ns()) is None
    monkeypatch.setenv("BEBOP_API_KEY", "from-env")
    assert resolve_api_key(ns()) == "from-env"
    f = tmp_path / "key"
    f.write_text("from-file\n")
    assert resolve_api_key(ns(api_key_file=str(f))) == "from-file"
    assert resolve_api_key(ns(api_key="cli", api_key_file=str(f))) == "cli"
    with pytest.raises(SystemExit):
        resolve_api_key(ns(api_key_file=str(tmp_path / "missing")))


def test_stop_trimming_and_sglang_request_shapes(server):
    """no_stop_trim false (SGLang's default): the text excludes the matched stop, output_ids keep
    it; GET /flush_cache; /abort_request without rid is a no-op 200; huge seeds are 400."""
    tok = CharTokenizer()
    base = server.post("/generate", {"text": "12+7=", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}).json()
    text = base["text"]
    stop = text[3:5]
    assert stop
    r = server.post("/generate", {"text": "12+7=", "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                                       "stop": [stop]}}).json()
    assert r["meta_info"]["finish_reason"]["type"] == "stop" and r["meta_info"]["finish_reason"]["matched"] == stop
    assert stop not in r["text"] and r["text"] == text[: text.index(stop)]
    assert tok.decode(r["output_ids"]).endswith(stop) or stop in tok.decode(r["output_ids"])
    keep = server.post("/generate", {"text": "12+7=", "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                                          "stop": [stop], "no_stop_trim": True}}).json()
    assert keep["text"] == tok.decode(keep["output_ids"]) and stop in keep["text"]
    # a stop token: excluded from the text, kept in output_ids
    sid = base["output_ids"][2]
    r = server.post("/generate", {"input_ids": tok.encode("12+7="), "sampling_params": {
        "max_new_tokens": 12, "temperature": 0, "stop_token_ids": [sid]}}).json()
    assert r["output_ids"][-1] == sid and r["text"] == tok.decode(r["output_ids"][:-1])
    assert server.get("/flush_cache").status_code == 200
    assert server.post("/abort_request", {"abort_all": False}).status_code == 200
    for sp in ({"seed": 2 ** 64}, {"sampling_seed": 2 ** 63}, {"top_k": 2 ** 63}, {"temperature": 10 ** 400}):
        r = server.post("/generate", {"text": "1+1=", "sampling_params": sp})
        assert r.status_code == 400 and "error" in r.json(), (sp, r.text)
    r = server.post("/v1/completions", {"prompt": "1+1=", "max_tokens": 3, "seed": 99999999999999999999})
    assert r.status_code == 400


def test_sglang_info_routes_weight_version_and_accepted_params(server):
    """#14 server gaps: SGLang's info routes, weight-version routes, and valid SGLang sampling
    fields accepted (custom_params, stream_interval, zero logit_bias, return_text_in_logprobs)."""
    mi = server.get("/model_info").json()
    assert mi["is_generation"] and mi["model_type"] == "qwen3" and "weight_version" in mi
    si = server.get("/server_info").json()
    assert si["speculative_algorithm"] == "NEXTN" and si["speculative_eagle_topk"] == 1
    assert si["speculative_num_draft_tokens"] == 4 and si["tp_size"] == si["dp_size"] == si["pp_size"] == 1
    assert si["max_total_num_tokens"] > 0
    assert server.get("/v1/models").json()["data"][0]["id"] == "bebop"
    loads = server.get("/v1/loads").json()["loads"]
    assert loads[0]["num_running_reqs"] >= 0 and loads[0]["dp_rank"] == 0
    v0 = server.get("/get_weight_version").json()["weight_version"]
    r = server.post("/update_weight_version", {"new_version": "manual-7"})
    assert r.status_code == 200 and r.json() == {"success": True, "message": "Weight version updated to manual-7",
                                                 "new_version": "manual-7"}
    assert server.get("/get_weight_version").json()["weight_version"] == "manual-7"
    server.post("/update_weight_version", {"new_version": v0})
    sp = {"max_new_tokens": 6, "temperature": 0, "custom_params": {"return_top_p_token_ids": True},
          "logit_bias": {"5": 0.0}, "stream_interval": 3}
    r = server.post("/generate", {"input_ids": [5, 6, 7], "sampling_params": sp, "return_logprob": True,
                                  "return_text_in_logprobs": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [t for _, t, _ in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]
    assert all(isinstance(txt, str) for _, _, txt in out["meta_info"]["output_token_logprobs"])
    with httpx.stream("POST", server.url + "/generate", headers=server.headers, timeout=60,
                      json={"input_ids": [5, 6, 7], "stream": True, "sampling_params": sp}) as resp:
        events = [json.loads(l[6:]) for l in resp.iter_lines() if l.startswith("data: {")]
    assert [len(e["output_ids"]) for e in events] == [3, 6] or len(events) <= 3, [len(e["output_ids"]) for e in events]
    assert events[-1]["output_ids"] == out["output_ids"]


def test_v1_completions_streaming(server):
    body = {"prompt": "3*4=", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    full = server.post("/v1/completions", body).json()
    with httpx.stream("POST", server.url + "/v1/completions", headers=server.headers, timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as resp:
        assert resp.status_code == 200
        lines = [l[6:] for l in resp.iter_lines() if l.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(c) for c in lines[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == full["choices"][0]["text"]
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])
    assert chunks[-1]["usage"]["completion_tokens"] == 6 and chunks[-1]["usage"]["prompt_tokens"] == 4
    assert server.post("/v1/completions", {**body, "max_tokens": 0}).status_code == 400
    # usage counts each prompt once with n > 1
    # (ignore_eos: a sampled choice may otherwise stop at EOS after one token, and then 5 is right)
    r = server.post("/v1/completions", {"prompt": "3*4=", "max_tokens": 2, "n": 3, "ignore_eos": True}).json()
    assert r["usage"]["prompt_tokens"] == 4 and r["usage"]["completion_tokens"] == 6 and len(r["choices"]) == 3


def test_sglang_logit_processors_and_stop_regex(server, ckpts):
    """SGLang's penalties, logit_bias and min_new_tokens change the output exactly as the engine
    does locally; stop_regex stops on the decoded text and reports the pattern as matched."""
    base = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    sp = {**base, "repetition_penalty": 1.5, "frequency_penalty": 0.5, "presence_penalty": 0.3,
          "logit_bias": {"7": 3.0}}
    r = server.post("/generate", {"text": "12+7=", "sampling_params": sp})
    assert r.status_code == 200, r.text
    eng = local_engine(ckpts[0], spec=False)
    ref = eng.generate([CharTokenizer().encode("12+7=")], SamplingParams(
        max_new_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.5, frequency_penalty=0.5,
        presence_penalty=0.3, logit_bias={7: 3.0}))[0]
    plain = server.post("/generate", {"text": "12+7=", "sampling_params": base}).json()
    assert r.json()["output_ids"] == ref.output_ids != plain["output_ids"]
    import re
    pat = re.escape(plain["text"][3]) + "|never"
    r = server.post("/generate", {"text": "12+7=", "sampling_params": {**base, "stop_regex": [pat]}}).json()
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": pat}
    ids = plain["output_ids"]
    n = next(i for i in range(1, 13) if re.search(pat, CharTokenizer().decode(ids[:i])))
    assert r["output_ids"] == ids[:n] and n <= 4


def test_sglang_logprob_options_and_meta_info(server, ckpts, sgl):  # noqa: F811
    """logprob_start_len (first input entry null; max_new_tokens 0 scores the prompt only),
    top_logprobs_num, token_ids_logprob, text in logprobs, output_token_logprobs_length, weight
    version spans, the accepted-drafts histogram and num_retractions, in SGLang's response types."""
    prompt = [5, 6, 7, 8, 9]
    model = CausalLMWithMTP.from_pretrained(ckpts[0], dtype=torch.float64)
    from bebop_megatron.rollout.modeling import make_batch_index
    with torch.no_grad():
        normed, _ = model.trunk(torch.tensor([prompt]), model.new_cache(1, 8, "trunk"), make_batch_index([0], [0], [5], "cpu"))
        lsm = torch.log_softmax(model.logits(normed[0]).double(), -1)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 2, "token_ids_logprob": [1, 2], "return_text_in_logprobs": True}
    check_generate(sgl, body)
    r = server.post("/generate", body)
    assert r.status_code == 200, r.text
    out = r.json()
    sgl.api.GenerateResponse.from_json_value(out)
    m = out["meta_info"]
    assert out["output_ids"] == [] and m["finish_reason"] == {"type": "length", "length": 0}
    assert [e[1] for e in m["input_token_logprobs"]] == prompt and m["input_token_logprobs"][0][0] is None
    assert all(isinstance(e[2], str) for e in m["input_token_logprobs"])
    ref = [lsm[j, prompt[j + 1]].item() for j in range(4)]
    assert max(abs(e[0] - x) for e, x in zip(m["input_token_logprobs"][1:], ref)) < 1e-9
    assert m["input_top_logprobs"][0] is None and [e[1] for e in m["input_top_logprobs"][1]] == lsm[0].topk(2).indices.tolist()
    assert m["input_token_ids_logprobs"][0] is None and abs(m["input_token_ids_logprobs"][2][1][0] - lsm[1, 2].item()) < 1e-9
    assert m["output_token_logprobs"] == [] and m["output_token_logprobs_length"] == 0

    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, "logprob_start_len": 3, "top_logprobs_num": 3}
    out = server.post("/generate", body).json()
    sgl.api.GenerateResponse.from_json_value(out)
    m = out["meta_info"]
    assert [e[1] for e in m["input_token_logprobs"]] == prompt[3:] and m["input_token_logprobs"][0][0] is None
    assert m["output_token_logprobs_length"] == 6 and len(m["output_top_logprobs"]) == 6
    assert [row[0][1] for row in m["output_top_logprobs"]] == out["output_ids"]  # greedy: the top-1 token
    assert "output_token_ids_logprobs" not in m and m["num_retractions"] == 0
    assert m["weight_versions"] == [{"version": m["weight_version"], "start": 0, "end": 6}]
    hist = m["spec_correct_drafts_histogram"]
    assert sum(hist) == m["spec_verify_ct"] and sum(k * c for k, c in enumerate(hist)) == m["spec_num_correct_drafts"]
    # default logprob_start_len (-1): no prompt entries
    out = server.post("/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}).json()
    assert out["meta_info"]["input_token_logprobs"] == [] and out["meta_info"]["output_token_logprobs_length"] == 2
    for bad in ({"logprob_start_len": 6}, {"logprob_start_len": -2}, {"top_logprobs_num": -1},
                {"token_ids_logprob": [99999]}, {"token_ids_logprob": "x"}, {"top_logprobs_num": 2 ** 64}):
        r = server.post("/generate", {"input_ids": prompt, "return_logprob": True, **bad})
        assert r.status_code == 400 and "error" in r.json(), (bad, r.text)


def test_weight_version_spans_across_a_version_change(server):
    import threading
    import time

    result = {}
    t = threading.Thread(target=lambda: result.update(r=server.post("/generate", {
        "input_ids": [5, 6], "sampling_params": {"max_new_tokens": 400, "temperature": 1.0, "ignore_eos": True}})))
    t.start()
    deadline = time.time() + 30
    while server.get("/get_server_info").json()["internal_states"][0]["num_running_reqs"] < 1:
        assert time.time() < deadline
        time.sleep(0.02)
    v0 = server.get("/get_weight_version").json()["weight_version"]
    time.sleep(0.3)
    assert server.post("/update_weight_version", {"new_version": "span-v2", "abort_all_requests": False}).status_code == 200
    t.join(120)
    server.post("/update_weight_version", {"new_version": v0, "abort_all_requests": False})
    m = result["r"].json()["meta_info"]
    spans = m["weight_versions"]
    assert m["weight_version"] == "span-v2" and spans[-1]["end"] == m["completion_tokens"] == 400
    assert [s["version"] for s in spans] == [v0, "span-v2"] and spans[0]["start"] == 0
    assert 0 < spans[0]["end"] == spans[1]["start"] < 400


def char_chat_tokenizer(d):
    """A Hugging Face tokenizer with the char ids of CharTokenizer and a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CharTokenizer.ALPHABET)}}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    t.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    t.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", eos_token="<eos>")
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}")
    tok.save_pretrained(d)
    return d


def test_v1_chat_completions(ckpts, tmp_path, server):
    """/v1/chat/completions through the tokenizer's chat template, as OpenAI and SGLang shape it
    (matched_stop, logprobs.content, n, usage, streaming); no template: a clear 400."""
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
    s = ServerProcess(ckpts[0], *SPEC, "--tokenizer", str(char_chat_tokenizer(tmp_path / "tok")))
    try:
        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "1+1=?"}]}]
        ids = CharTokenizer().encode("system:be brief;user:1+1=?;assistant:")
        base = {"messages": msgs, "temperature": 0, "max_tokens": 8, "ignore_eos": True, "model": "m"}
        out = s.post("/v1/chat/completions", base).json()
        ref = s.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                         "ignore_eos": True}}).json()
        c = out["choices"][0]
        assert out["object"] == "chat.completion" and out["model"] == "m"
        assert c["message"] == {"role": "assistant", "content": ref["text"]} and c["finish_reason"] == "length"
        assert c["matched_stop"] is None and c["logprobs"] is None
        assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 8, "total_tokens": len(ids) + 8}
        # max_completion_tokens, n, logprobs with top_logprobs
        out = s.post("/v1/chat/completions", {**base, "max_tokens": None, "max_completion_tokens": 5, "n": 2,
                                              "temperature": 1.0, "logprobs": True, "top_logprobs": 2}).json()
        assert len(out["choices"]) == 2 and out["usage"]["completion_tokens"] == 10
        content = out["choices"][1]["logprobs"]["content"]
        assert len(content) == 5 and all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in content)
        assert "".join(e["token"] for e in content) == out["choices"][1]["message"]["content"]
        # stop string: trimmed, reported as matched_stop
        text = ref["text"]
        out = s.post("/v1/chat/completions", {**base, "stop": [text[3]]}).json()
        c = out["choices"][0]
        assert c["finish_reason"] == "stop" and c["matched_stop"] == text[3]
        assert c["message"]["content"] == text[: text.index(text[3])]
        # streaming: role first, deltas add up, the finish on the last choice chunk, usage, [DONE]
        with httpx.stream("POST", s.url + "/v1/chat/completions", headers=s.headers, timeout=60,
                          json={**base, "stream": True, "stream_options": {"include_usage": True}}) as resp:
            lines = [l[6:] for l in resp.iter_lines() if l.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        chunks = [json.loads(x) for x in lines[:-1]]
        deltas = [ch["choices"][0] for ch in chunks if ch["choices"]]
        assert deltas[0]["delta"]["role"] == "assistant" and all(ch["object"] == "chat.completion.chunk" for ch in chunks)
        assert "".join(d["delta"].get("content", "") for d in deltas) == ref["text"]
        assert deltas[-1]["finish_reason"] == "length" and all(d["finish_reason"] is None for d in deltas[:-1])
        assert chunks[-1]["usage"]["completion_tokens"] == 8
        for bad in ({"messages": []}, {"messages": [{"role": "user"}], "top_logprobs": 2},
                    {"messages": "hi"}, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
                    {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}):
            r = s.post("/v1/chat/completions", bad)
            assert r.status_code == 400 and "error" in r.json(), (bad, r.text)
    finally:
        s.stop()


def test_v1_completions_matched_stop_logprobs_and_echo(server):
    body = {"prompt": "3*4=", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    full = server.post("/v1/completions", body).json()["choices"][0]
    assert full["matched_stop"] is None and full["finish_reason"] == "length"
    ids = server.post("/generate", {"text": "3*4=", "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                                        "ignore_eos": True}}).json()["output_ids"]
    c = server.post("/v1/completions", {**body, "stop_token_ids": [ids[2]]}).json()["choices"][0]
    assert c["finish_reason"] == "stop" and c["matched_stop"] == ids[2]
    c = server.post("/v1/completions", {**body, "logprobs": 2, "echo": True}).json()["choices"][0]
    lp = c["logprobs"]
    assert c["text"] == "3*4=" + full["text"] and lp["token_logprobs"][0] is None and len(lp["tokens"]) == 10
    assert lp["top_logprobs"][0] is None and all(len(t) == 2 for t in lp["top_logprobs"][1:])
    assert lp["text_offset"][:5] == [0, 1, 2, 3, 4]


def test_official_openai_client_completions_and_chat(ckpts, tmp_path):
    """The official ``openai`` client (what users point at SGLang) drives /v1/completions and
    /v1/chat/completions, streaming included, and reads them into its own typed models."""
    openai = pytest.importorskip("openai")
    s = ServerProcess(ckpts[0], *SPEC, "--tokenizer", str(char_chat_tokenizer(tmp_path / "tok")), api_key="k")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="k", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["bebop"]
        c = client.completions.create(model="bebop", prompt="1+1=", max_tokens=6, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True})
        ch = c.choices[0]
        assert ch.finish_reason == "length" and len(ch.logprobs.tokens) == 6 and c.usage.completion_tokens == 6
        assert all(len(t) == 2 for t in ch.logprobs.top_logprobs)
        parts = list(client.completions.create(model="bebop", prompt="1+1=", max_tokens=6, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}))
        assert "".join(p.choices[0].text for p in parts if p.choices) == ch.text
        assert [p.choices[0].finish_reason for p in parts if p.choices][-1] == "length"
        msgs = [{"role": "user", "content": "2+2=?"}]
        chat = client.chat.completions.create(model="bebop", messages=msgs, max_tokens=5, temperature=0,
                                              logprobs=True, top_logprobs=1, extra_body={"ignore_eos": True})
        m = chat.choices[0]
        assert m.message.role == "assistant" and len(m.logprobs.content) == 5 and chat.usage.completion_tokens == 5
        stream = client.chat.completions.create(model="bebop", messages=msgs, max_tokens=5, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True})
        assert "".join(p.choices[0].delta.content or "" for p in stream if p.choices) == m.message.content
        with pytest.raises(openai.BadRequestError):  # a 400 the client maps to its own error type
            client.completions.create(model="bebop", prompt="1+1=", max_tokens=0)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).models.list()
    finally:
        s.stop()
