"""rollout/protocol.py: one writer and one parser for the spec-metric spellings, SpecRecord
wire compatibility, request builders with SGLang's field names, and one server command line for
the trainer's local servers, launch/slurm.py and launch/sglang.py."""

import json

import pytest
import torch

from bebop_megatron.config import Config
from bebop_megatron.rollout import protocol
from bebop_megatron.rollout.protocol import SPEC_KEY_PAIRS, SpecRecord, parse_meta, parse_spec_metrics, server_command


def test_spec_metric_writer_and_parser_agree_for_every_spelling():
    meta = {"completion_tokens": 30, **protocol.spec_meta_info(10, 30, 20, 30, [9, 7, 4])}
    assert all(meta[a] == 20 and meta[p] == 30 for a, p in SPEC_KEY_PAIRS)
    assert meta["spec_accept_length"] == 3.0 and abs(meta["spec_accept_rate"] - 2 / 3) < 1e-12
    for a, p in SPEC_KEY_PAIRS:  # a server of any version (only its own spelling)
        st = parse_spec_metrics({"completion_tokens": 30, "spec_verify_ct": 10, a: 20, p: 30})
        assert (st.accepted, st.proposed, st.verify_ct, st.tokens_per_verify) == (20, 30, 10, 2.9)
    legacy = parse_spec_metrics({"completion_tokens": 30, "spec_verify_ct": 10, "spec_accept_length": 3.0})
    assert (legacy.accepted, legacy.proposed) == (19, 0)  # the prefill's token is not a verify token
    m = parse_meta(meta)
    assert m.accepted_per_depth == [9, 7, 4] and m.spec.accept_rate == pytest.approx(2 / 3)
    # SGLang reports no verify tokens: all but the prefill's token came from verify steps
    assert m.spec.verify_tokens is None and m.spec.tokens_per_verify == pytest.approx(29 / 10)
    # bebop with adaptive γ: 30 tokens = 1 (prefill) + 22 from 8 verify steps + 7 plain rounds
    ada = parse_spec_metrics({"completion_tokens": 30, **protocol.spec_meta_info(8, 30, 14, 20, [6, 5, 3], [8, 6, 6],
                                                                                 verify_tokens=22, plain_rounds=7,
                                                                                 gamma_sum=20)})
    assert (ada.verify_tokens, ada.plain_rounds, ada.gamma_sum) == (22, 7, 20)
    # SGLang's accept length (completion / verify steps) without the plain rounds' tokens
    assert protocol.spec_meta_info(8, 30, 14, 20, [6, 5, 3], verify_tokens=22)["spec_accept_length"] == 23 / 8
    assert ada.tokens_per_verify == pytest.approx(22 / 8) and ada.mean_gamma == pytest.approx(20 / 15)
    both = ada + m.spec  # sums keep the verify tokens of each kind of server
    assert both.emitted_by_verify == 22 + 29 and both.verify_ct == 18
    # the bridge and rl/rollout.py read through the same parser
    from bebop_megatron.rollout import bridge

    assert bridge.parse_spec_metrics is parse_spec_metrics and bridge.SPEC_KEY_PAIRS is SPEC_KEY_PAIRS


def test_parse_meta_fields_and_spec_records_round_trip():
    rec = {"pos": 4, "accepted": 1, "topk_ids": [[1, 2], [3, 4]], "topk_probs": [[0.6, 0.3], [0.5, 0.4]]}
    meta = {"finish_reason": {"type": "length", "length": 3}, "weight_version": "12", "prompt_tokens": 2,
            "completion_tokens": 3, "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None], [-0.3, 7, "x"]],
            "spec_verify_records": [rec]}
    m = parse_meta(json.loads(json.dumps(meta)))
    assert m.truncated and not m.aborted and m.version_int() == 12 and m.output_logprobs == [-0.1, -0.2, -0.3]
    r = m.spec_records[0]
    assert isinstance(r, SpecRecord) and r.to_wire() == rec
    assert (r["pos"], r["accepted"], r["topk_ids"]) == (4, 1, rec["topk_ids"])  # old dict-style readers
    assert parse_meta({"finish_reason": {"type": "abort"}, "weight_version": "default"}).version_int() == 0
    assert parse_meta(None).spec.verify_ct == 0
    with pytest.raises(ValueError):
        SpecRecord.from_wire({"pos": 1})


def test_request_builders_use_sglang_names():
    sp = protocol.sampling_params(max_new_tokens=8, temperature=0.7, top_p=0.9, seed=3, stop=["ab"],
                                  stop_token_ids=[2])
    assert sp == {"max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9, "sampling_seed": 3, "stop": ["ab"],
                  "stop_token_ids": [2]}
    body = protocol.generate_request([1, 2], sp)
    assert "seed" not in body["sampling_params"] and "return_spec_records" not in body
    assert protocol.generate_request([1], sp, spec_records_topk=4)["return_spec_records"] == 4
    names, dtypes, shapes = protocol.tensor_meta([("w", torch.zeros(2, 3, dtype=torch.bfloat16))])
    assert (names, dtypes, shapes) == (["w"], ["bfloat16"], [[2, 3]])
    with pytest.raises(ValueError):
        protocol.update_weights_from_distributed_request(["a"], [], [], "1")
    with pytest.raises(ValueError):
        protocol.pause_request("later")


def test_server_command_for_both_engines():
    cfg = Config()
    cfg.model.mtp_num_layers = 3
    bebop = server_command(cfg, "bebop", model_path="/m", port=31000, context_length=512, weight_version="0")
    s = " ".join(bebop)
    assert bebop[1:4] == ["-m", "bebop_megatron.cli", "serve"] and "--port 31000" in s
    assert "--speculative-algorithm MTP --speculative-num-steps 3 --speculative-verify rejection" in s
    assert "--context-length 512" in s and "--weight-version 0" in s and "--host" not in s
    sgl = " ".join(server_command(cfg, "sglang", model_path="/m", port=30000, host="0.0.0.0", python="python",
                                  api_key="$BEBOP_API_KEY"))
    assert sgl.startswith("python -m sglang.launch_server --model-path /m --host 0.0.0.0 --port 30000 --tp-size 1")
    assert ("--speculative-algorithm NEXTN --speculative-num-steps 3 --speculative-eagle-topk 1 "
            "--speculative-num-draft-tokens 4 --speculative-use-rejection-sampling") in sgl
    assert "--mem-fraction-static" in sgl and sgl.endswith("--api-key $BEBOP_API_KEY")
    cfg.rl.mtp_strategy = "none"  # no speculation
    assert "--speculative" not in " ".join(server_command(cfg, "sglang", model_path="/m", port=1))
    cfg.rl.mtp_strategy, cfg.rl.verify = "frozen", "target_only"
    assert "rejection" not in " ".join(server_command(cfg, "sglang", model_path="/m", port=1))
    assert "--speculative-num-steps" not in " ".join(server_command(cfg, "bebop", model_path="/m", port=1, gamma=0))
    assert "--speculative-adaptive" not in s
    cfg.rl.adaptive_gamma = True  # bebop serve's own mode; SGLang keeps its fixed γ
    assert server_command(cfg, "bebop", model_path="/m", port=1)[-1] == "--speculative-adaptive"
    assert "adaptive" not in " ".join(server_command(cfg, "sglang", model_path="/m", port=1))
    assert "adaptive" not in " ".join(server_command(cfg, "bebop", model_path="/m", port=1, adaptive=False))
    with pytest.raises(ValueError, match="lossy"):
        server_command(None, "sglang", model_path="/m", port=1, gamma=2,
                       extra=["--speculative-accept-threshold-acc", "0.5"])
    with pytest.raises(ValueError):
        server_command(None, "vllm", model_path="/m", port=1)


def test_local_server_command_is_server_command(tmp_path):
    from bebop_megatron.rollout import local_servers

    calls = []

    envs = []

    class P:  # no process: only the command line is checked
        def __init__(self, cmd, env=None, **kw):
            calls.append(cmd)
            envs.append(env or {})

        def poll(self):
            return None

    orig = local_servers.subprocess.Popen
    local_servers.subprocess.Popen = P
    try:
        s = local_servers.LocalServer(tmp_path, ["--dtype", "float64"], log_dir=tmp_path, api_key="k")
        s._log.close()
        # the API key travels in the environment, never on the command line (/proc/PID/cmdline)
        assert calls[0] == server_command(None, "bebop", model_path=str(tmp_path), port=s.port,
                                          extra=["--dtype", "float64"])
        assert "k" not in calls[0] and envs[0]["BEBOP_API_KEY"] == "k"
        s2 = local_servers.LocalServer(tmp_path, log_dir=tmp_path, command=lambda port: ["echo", str(port)])
        s2._log.close()
        assert calls[1] == ["echo", str(s2.port)]
    finally:
        local_servers.subprocess.Popen = orig
