"""Hostile traffic against a real `bebop serve` process: thousands of malformed requests, concurrent
aborts and weight updates during generation. Every answer must be a JSON error (4xx) or a valid
result, the server must never die or answer 5xx, and a normal request afterwards must still be correct."""

import base64
import json
import random
import threading

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save

from bebop_megatron.data import CharTokenizer
from bebop_megatron.rollout.engine import Engine, SamplingParams, SpecConfig
from bebop_megatron.rollout.modeling import CausalLMWithMTP
from tests.server_utils import ServerProcess
from tests.tiny_models import make_hf_checkpoint

N_EXAMPLES = 2200


def fl(lo, hi):
    return st.one_of(st.floats(lo, hi), st.sampled_from([float("nan"), float("inf"), -float("inf")]))


json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True),
                        st.text(max_size=40))
json_value = st.recursive(json_scalar, lambda c: st.one_of(st.lists(c, max_size=5),
                                                           st.dictionaries(st.text(max_size=12), c, max_size=5)),
                          max_leaves=12)
sampling = st.fixed_dictionaries({}, optional={
    "max_new_tokens": st.one_of(st.integers(-5, 10**9), json_value),
    "temperature": st.one_of(fl(-2, 5), json_value),
    "top_p": st.one_of(fl(-1, 2), json_value),
    "top_k": st.one_of(st.integers(-3, 10**6), json_value),
    "min_p": fl(-1, 2),
    "n": st.one_of(st.integers(-2, 200), json_value),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=3), json_value),
    "stop_token_ids": st.one_of(st.lists(st.integers(-5, 100), max_size=4), json_value),
    "ignore_eos": st.one_of(st.booleans(), json_value),
    "frequency_penalty": st.floats(-2, 2),
    "unknown_field": json_value,
})
ids = st.one_of(st.lists(st.integers(-3, 70), max_size=20), st.lists(st.lists(st.integers(0, 70), max_size=8), max_size=3),
                json_value)
body = st.fixed_dictionaries({}, optional={
    "text": st.one_of(st.text(max_size=30), st.lists(st.text(max_size=10), max_size=3), json_value),
    "input_ids": ids, "sampling_params": st.one_of(sampling, st.lists(sampling, max_size=3), json_value),
    "return_logprob": st.one_of(st.booleans(), json_value), "stream": st.booleans(),
    "rid": st.one_of(st.text(max_size=8), json_value), "extra": json_value,
})
paths = st.sampled_from(["/generate", "/generate", "/generate", "/v1/completions", "/abort_request",
                         "/update_weights_from_tensor", "/update_weights_from_disk", "/pause_generation",
                         "/flush_cache", "/get_server_info", "/nonexistent"])


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    make_hf_checkpoint(d, "qwen3", "deepseek", num_mtp=2, scale=2.0)
    s = ServerProcess(d, "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2", "--context-length", "48",
                      "--max-running-requests", "8", "--dtype", "float64")
    yield s, d
    s.stop()


TALLY = {"requests": 0, "ok": 0, "client_errors": 0}


def _check(resp: httpx.Response, stream: bool):
    TALLY["requests"] += 1
    assert resp.status_code < 500, (resp.status_code, resp.text[:500])
    if resp.status_code >= 400:
        TALLY["client_errors"] += 1
        payload = resp.json()  # always JSON
        assert isinstance(payload, dict) and ("error" in payload or "detail" in payload)
        return
    TALLY["ok"] += 1
    if stream:
        lines = [l for l in resp.text.splitlines() if l.startswith("data: ")]
        assert lines and lines[-1] == "data: [DONE]"
        return
    resp.json()


@settings(max_examples=N_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(path=paths, payload=body, raw=st.one_of(st.none(), st.binary(max_size=60)))
def test_fuzz_server(target, path, payload, raw):
    s, _ = target
    headers = {"content-type": "application/json"}
    if raw is not None and len(raw) % 3 == 0:  # broken or arbitrary bytes
        resp = httpx.post(s.url + path, content=raw, headers=headers, timeout=60)
        _check(resp, False)
        return
    if path == "/get_server_info":
        _check(httpx.get(s.url + path, timeout=60), False)
        return
    if path == "/pause_generation":  # keep the server usable: pause and continue at once
        _check(httpx.post(s.url + path, json={"mode": random.choice(["abort", "retract", "in_place", "x"])},
                          timeout=60), False)
        _check(httpx.post(s.url + "/continue_generation", json={}, timeout=60), False)
        return
    try:
        resp = httpx.post(s.url + path, content=json.dumps(payload, allow_nan=True), headers=headers, timeout=60)
    except httpx.ReadTimeout:
        raise AssertionError(f"server hung on {path} {payload!r}")
    _check(resp, path == "/generate" and payload.get("stream") is True)


def test_concurrent_aborts_and_weight_updates_during_generation(target):
    s, d = target
    tensors = {}
    for f in sorted(d.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    payload = base64.b64encode(save(tensors)).decode()
    errors = []

    def client(i):
        for j in range(6):
            try:
                r = httpx.post(s.url + "/generate", json={"input_ids": [5, 6, 7], "rid": f"c{i}-{j}",
                                                          "sampling_params": {"max_new_tokens": 30, "ignore_eos": True}},
                               timeout=60)
                TALLY["requests"] += 1
                if r.status_code != 200 or r.json()["meta_info"]["finish_reason"]["type"] not in ("length", "abort"):
                    errors.append(r.text[:300])
            except Exception as e:
                errors.append(repr(e))

    def chaos():
        for j in range(10):
            for r in (httpx.post(s.url + "/abort_request", json={"rid": f"c{j % 6}-{j % 6}"}, timeout=60),
                      httpx.post(s.url + "/update_weights_from_tensor",
                                 json={"serialized_named_tensors": [payload], "weight_version": f"w{j}"}, timeout=60),
                      httpx.post(s.url + "/abort_request", json={"abort_all": True}, timeout=60)):
                TALLY["requests"] += 1
                if r.status_code != 200:
                    errors.append(r.text[:300])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)] + [threading.Thread(target=chaos)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]


def test_server_survives_and_still_answers_correctly(target):
    s, d = target
    assert s.alive()
    r = httpx.post(s.url + "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 12,
                                                                                          "temperature": 0}}, timeout=60)
    assert r.status_code == 200, r.text
    model = CausalLMWithMTP.from_pretrained(d, dtype=torch.float64)
    ref = Engine(model, CharTokenizer(), SpecConfig("none"), max_running=1, max_len=48).generate(
        [[5, 6, 7]], SamplingParams(max_new_tokens=12, temperature=0.0))[0]
    assert r.json()["output_ids"] == ref.output_ids
    print(f"\nfuzz tally: {TALLY}")
    assert TALLY["requests"] >= 2000


def test_load_64_clients(tmp_path):
    """64 concurrent clients on loopback (15 s in CI; tools/load_test.py defaults to 60 s)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "tools" / "load_test.py"), "--clients", "64", "--duration", "15",
                          "--json", str(tmp_path / "load.json")], cwd=root, capture_output=True, text=True, timeout=600)
    res = json.loads((tmp_path / "load.json").read_text())
    assert out.returncode == 0 and res["errors"] == 0 and res["server_alive"], res
    assert res["requests"] > 64
    assert res["rss_mib_last_third"] < 1.2 * res["rss_mib_first_third"]  # no growth under steady load
