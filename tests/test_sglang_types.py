"""The RL client sends only what SGLang 0.5.23 accepts: every body is checked against SGLang's
own types, loaded from the real wheel (``pip download sglang==0.5.23 --no-deps``, cached).

* ``/generate``: ``sglang/api/v1/api_types.py`` (the generated JSON contract; unknown
  ``sampling_params`` keys are a 400 there, so ``seed`` instead of ``sampling_seed`` fails).
* weight updates, pause, weight checker: the ``*ReqInput`` structs of
  ``sglang/srt/managers/io_struct.py``, validated the way SGLang's HTTP server does it
  (``msgspec_struct_pydantic_core_schema`` from ``sglang/srt/utils/msgspec_utils.py``).
  io_struct.py imports the whole runtime, so only the request classes are taken from its source.

The bodies are the real ones: the rollout manager's payload builder, and the bridge's weight
syncs run over a transport that records each request (it checks, it does not emulate SGLang).
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType, SimpleNamespace

import httpx
import pytest
import torch

from bebop_megatron.rollout import protocol

VERSION = "0.5.23"
CACHE = Path(os.environ.get("BEBOP_SGLANG_CACHE", Path.home() / ".cache" / "bebop_megatron" / f"sglang-{VERSION}"))
FILES = ("sglang/api/v1/api_types.py", "sglang/srt/managers/io_struct.py", "sglang/srt/utils/msgspec_utils.py")
REQ_CLASSES = ("UpdateWeightFromDiskReqInput", "UpdateWeightsFromDistributedReqInput", "InitWeightsUpdateGroupReqInput",
               "DestroyWeightsUpdateGroupReqInput", "UpdateWeightsFromTensorReqInput", "BeginWeightUpdateReqInput",
               "EndWeightUpdateReqInput", "CheckWeightsReqInput", "PauseGenerationReqInput",
               "ContinueGenerationReqInput")
ROUTES = {"/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
          "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
          "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
          "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
          "/begin_weight_update": "BeginWeightUpdateReqInput", "/end_weight_update": "EndWeightUpdateReqInput",
          "/weights_checker": "CheckWeightsReqInput", "/pause_generation": "PauseGenerationReqInput",
          "/continue_generation": "ContinueGenerationReqInput"}


def _pip(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args, "-q", "--disable-pip-version-check"],
                          capture_output=True, text=True, timeout=600)


def _ensure_sources(files: tuple = FILES) -> Path:
    """SGLang's source files (paths inside the wheel) under the cache; downloads the wheel once."""
    src = CACHE / "src"
    if all((src / f).exists() for f in files):
        return src
    wheels = sorted(CACHE.glob(f"sglang-{VERSION}-*.whl"))
    if not wheels:
        CACHE.mkdir(parents=True, exist_ok=True)
        # only source files are read: take the one wheel whatever the local interpreter is
        out = _pip("download", f"sglang=={VERSION}", "--no-deps", "--only-binary=:all:", "--python-version", "3.11",
                   "--platform", "manylinux_2_34_x86_64", "-d", str(CACHE))
        wheels = sorted(CACHE.glob(f"sglang-{VERSION}-*.whl"))
        if not wheels:
            pytest.skip(f"cannot download sglang=={VERSION} (package registry unreachable?): {out.stderr[-300:]}")
    with zipfile.ZipFile(wheels[0]) as z:
        for f in files:
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            (src / f).write_bytes(z.read(f))
    return src


def _ensure_msgspec() -> None:
    if importlib.util.find_spec("msgspec") is None:
        site = CACHE / "site"
        if not (site / "msgspec").exists():
            out = _pip("install", "--no-deps", "--target", str(site), "msgspec")
            if not (site / "msgspec").exists():
                pytest.skip(f"cannot install msgspec (SGLang's type library; registry unreachable?): "
                            f"{out.stderr[-300:]}")
        sys.path.insert(0, str(site))


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def sgl():
    src = _ensure_sources()
    _ensure_msgspec()
    api = _load(src / FILES[0], "sglang_api_types_0523")
    mu = _load(src / FILES[2], "sglang_msgspec_utils_0523")
    tree = ast.parse((src / FILES[1]).read_text())
    wanted = {"BaseReq", *REQ_CLASSES}
    nodes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in wanted]
    assert {n.name for n in nodes} == wanted, "SGLang's io_struct.py no longer defines these request types"
    import typing

    import msgspec

    mod = ModuleType("sglang_io_struct_0523")  # a real module: msgspec resolves annotations through it
    ns = mod.__dict__
    ns.update({name: getattr(typing, name) for name in typing.__all__})
    ns.update(msgspec=msgspec, Base64Bytes=mu.Base64Bytes,
              msgspec_struct_pydantic_core_schema=mu.msgspec_struct_pydantic_core_schema)
    sys.modules[mod.__name__] = mod
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(src / FILES[1]), "exec"), ns)
    return SimpleNamespace(api=api, io={n: ns[n] for n in REQ_CLASSES})


def check_io(sgl, cls_name: str, body: dict, extensions=frozenset()):
    """Validate like SGLang's FastAPI route (JSON body -> msgspec struct); unknown keys are
    silently dropped there, so they must not exist at all (except declared bebop extensions)."""
    import msgspec
    from pydantic import TypeAdapter

    cls = sgl.io[cls_name]
    obj = TypeAdapter(cls).validate_json(json.dumps(body))
    fields = {f.name for f in msgspec.structs.fields(cls)}
    assert set(body) - fields <= set(extensions), f"{cls_name}: SGLang ignores {sorted(set(body) - fields)}"
    return obj


def check_generate(sgl, body: dict):
    req = sgl.api.GenerateRequest.from_json_value(body)  # JsonContractError (SGLang: 400) if invalid
    fields = set(sgl.api.GenerateRequest.__struct_fields__)
    assert set(body) - fields <= protocol.BEBOP_EXTENSIONS["generate"], sorted(set(body) - fields)
    return req


def _manager(record_topk=0, stop=(";", "end")):
    from bebop_megatron.config import Config
    from tests.server_utils import offline_rollout_manager

    cfg = Config()
    cfg.rl.stop = list(stop)
    return offline_rollout_manager(cfg, record_topk)  # the payload builder only: no servers, no loop


def _job(ids, seed):
    from bebop_megatron.rl.rollout import _Job
    from bebop_megatron.rl.types import Prompt

    return _Job(0, list(ids), Prompt(text="", answer=""), seed)


def test_generate_bodies_are_valid_sglang_requests(sgl):
    for topk in (0, 8):
        body = _manager(record_topk=topk)._payload([_job([5, 6, 7], 1234)])
        req = check_generate(sgl, body)
        sp = req.sampling_params
        assert sp.sampling_seed == 1234 and sp.max_new_tokens == body["sampling_params"]["max_new_tokens"]
        assert ("return_spec_records" in body) == bool(topk)
        assert sp.stop_token_ids and sp.stop == ["end"]
    # the batch form (several samples per request): lists of prompts and of sampling params
    for topk in (0, 8):
        body = _manager(record_topk=topk)._payload([_job([5, 6, 7], 1), _job([8, 9], 2), _job([5, 6, 7], 3)])
        req = check_generate(sgl, body)
        assert [sp.sampling_seed for sp in req.sampling_params] == [1, 2, 3]
        assert req.input_ids == [[5, 6, 7], [8, 9], [5, 6, 7]] and req.return_logprob is True
        assert ("return_spec_records" in body) == bool(topk)
    # the validator is strict where SGLang is: the old `seed` field is a 400
    with pytest.raises(sgl.api.JsonContractError, match="unknown field `seed`"):
        sgl.api.GenerateRequest.from_json_value({"input_ids": [1], "sampling_params": {"seed": 1}})


def test_sglang_responses_parse(sgl):
    api = sgl.api
    meta = api.GenerateMetaInfo(id="r", prompt_tokens=3, completion_tokens=4,
                                finish_reason=api.FinishLength(length=4),
                                output_token_logprobs=[api.LogprobEntry(logprob=-0.5, token_id=t) for t in range(4)],
                                weight_version="7")
    wire = api.GenerateResponse(text="abcd", meta_info=meta, output_ids=[0, 1, 2, 3]).to_json_value()
    wire = json.loads(json.dumps(wire))
    wire["meta_info"].update({"spec_verify_ct": 2, "spec_num_correct_drafts": 2, "spec_num_proposed_drafts": 6})
    m = protocol.parse_meta(wire["meta_info"])
    assert m.truncated and not m.aborted and m.version_int() == 7 and m.output_logprobs == [-0.5] * 4
    assert (m.spec.verify_ct, m.spec.accepted, m.spec.proposed) == (2, 2, 6)
    abort = json.loads(json.dumps(api.GenerateResponse(meta_info=api.GenerateMetaInfo(
        finish_reason=api.FinishAbort(message="paused"))).to_json_value()))
    assert protocol.is_aborted(abort)


def test_weight_update_bodies_are_valid_sglang_requests(sgl):
    check_io(sgl, "UpdateWeightFromDiskReqInput", protocol.update_weights_from_disk_request("/w/v3", "3"))
    check_io(sgl, "InitWeightsUpdateGroupReqInput",
             protocol.init_weights_update_group_request("10.0.0.1", 29500, 1, 3, "g", "nccl"))
    names, dtypes, shapes = protocol.tensor_meta([("a", torch.zeros(2, 3, dtype=torch.bfloat16)),
                                                  ("model.layers.4.eh_proj.weight", torch.zeros(4))])
    obj = check_io(sgl, "UpdateWeightsFromDistributedReqInput",
                   protocol.update_weights_from_distributed_request(names, dtypes, shapes, "3", group_name="g"))
    assert obj.dtypes == ["bfloat16", "float32"] and obj.shapes == [[2, 3], [4]] and obj.selector == "all"
    check_io(sgl, "DestroyWeightsUpdateGroupReqInput", protocol.destroy_weights_update_group_request("g"))
    check_io(sgl, "BeginWeightUpdateReqInput", protocol.begin_weight_update_request())
    check_io(sgl, "CheckWeightsReqInput", protocol.weights_checksum_request("draft"))
    check_io(sgl, "PauseGenerationReqInput", protocol.pause_request("abort"))
    # our safetensors tensor path is a bebop extension, not an SGLang request: SGLang would
    # base64-decode the payload and unpickle it (MultiprocessingSerializer)
    body = protocol.update_weights_from_tensor_request("AAAA", "3", flush_cache=True)
    assert body["load_format"] == "safetensors"
    check_io(sgl, "UpdateWeightsFromTensorReqInput", body, protocol.BEBOP_EXTENSIONS["update_weights_from_tensor"])


class _Recorder:
    """Records every request the bridge makes and checks it against SGLang's types; answers
    with SGLang's response shapes (``{success, message}``)."""

    def __init__(self, sgl):
        self.sgl, self.seen = sgl, []
        self.draft, self.apply_draft = 0, True

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else {}
        self.seen.append((path, body))
        if path == "/get_server_info":
            return httpx.Response(200, json={"tp_size": 1})
        if path == "/generate":
            check_generate(self.sgl, body)
            return httpx.Response(200, json={"text": "", "output_ids": [], "meta_info": {"finish_reason": {
                "type": "length"}}})
        check_io(self.sgl, ROUTES[path], body)
        if path == "/weights_checker":  # SGLang's shape: draft keys prefixed with the role
            return httpx.Response(200, json={"success": True, "message": "", "ranks": [
                {"checksums": {"draft.model.layers.2.eh_proj.weight": str(self.draft)}, "per_gpu_checksum": "x",
                 "parallelism_info": [{"role": "draft"}]}]})
        if path in ("/update_weights_from_disk", "/update_weights_from_distributed"):
            self.draft += self.apply_draft  # the server applied new draft weights (or, the bug, did not)
        return httpx.Response(200, json={"success": True, "message": "ok", "num_paused_requests": 0})


class _NullSender:
    def __init__(self):
        self.calls = []

    def init(self):
        self.calls.append("init")

    def broadcast(self, bucket):
        self.calls.append(("broadcast", list(bucket)))

    def destroy(self):
        self.calls.append("destroy")


def test_bridge_weight_syncs_send_only_sglang_requests(sgl):
    from bebop_megatron.rollout.bridge import RolloutBridge, RolloutError

    rec = _Recorder(sgl)
    sender = _NullSender()
    buckets = [{"model.embed_tokens.weight": torch.zeros(4, 2)}, {"model.layers.2.eh_proj.weight": torch.ones(2, 4)}]

    async def scenario():
        bridge = RolloutBridge(["http://sglang-a:30000", "http://sglang-b:30000"], transport=httpx.MockTransport(rec))
        await bridge.update_weights_from_disk("/shared/v1", "1")
        info = await bridge.init_weights_update_group(lambda world: sender, "10.0.0.1", 29500, "g", "gloo")
        assert info["world_size"] == 3 and info["rank_offsets"] == [1, 2]
        res = await bridge.update_weights_from_distributed(buckets, "2")
        assert res["servers"] == 2 and bridge.weight_version == "2"
        out = await bridge.generate(_manager()._payload([_job([1, 2], 3)]))
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        # a sync that leaves the draft untouched is an error (sglang#27718)
        rec.apply_draft = False
        with pytest.raises(RolloutError, match="draft"):
            await bridge.update_weights_from_disk("/shared/v3", "3")
        await bridge.close()

    asyncio.run(scenario())
    paths = [p for p, _ in rec.seen]
    assert paths.count("/init_weights_update_group") == 2 and paths.count("/update_weights_from_distributed") == 4
    assert paths.count("/begin_weight_update") == 2 and paths.count("/end_weight_update") == 2
    assert "/update_weights_from_tensor" not in paths
    assert [c for c in sender.calls if c != "destroy"] == ["init", ("broadcast", ["model.embed_tokens.weight"]),
                                                          ("broadcast", ["model.layers.2.eh_proj.weight"])]
    last = [b for p, b in rec.seen if p == "/update_weights_from_distributed"][-1]
    assert last["weight_version"] == "2" and last["flush_cache"] is True


def test_generate_bodies_with_processors_and_logprob_options_are_valid_sglang_requests(sgl):
    """The sampling processors and logprob options bebop serve implements are SGLang's fields."""
    body = {"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
            "token_ids_logprob": [1, 2], "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 0, "min_new_tokens": 0, "frequency_penalty": 0.5,
                                "presence_penalty": -0.5, "repetition_penalty": 1.2, "logit_bias": {"3": 1.5},
                                "stop_regex": ["a+b"], "stop": ["x"], "stop_token_ids": [4]}}
    req = check_generate(sgl, body)
    assert req.sampling_params.repetition_penalty == 1.2 and req.logprob_start_len == 0
