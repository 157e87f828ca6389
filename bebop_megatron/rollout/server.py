"""``bebop serve``: SGLang's native HTTP API on the embedded engine.

Request and response JSON follow SGLang (``/generate`` with ``text`` | ``input_ids``,
``sampling_params``, ``return_logprob``, ``stream`` (SSE), ``rid``; ``meta_info`` with ``id``,
``finish_reason``, ``prompt_tokens``, ``completion_tokens``, ``output_token_logprobs``,
``weight_version`` and the speculative counters), plus ``/v1/completions``. The accepted/proposed
draft counts are reported under every key spelling SGLang has used, so clients of any version
(slime, verl) read real acceptance instead of 0.

Safety: binds 127.0.0.1 unless told otherwise; optional API key (``Authorization: Bearer``);
``/update_weights_from_tensor`` takes only safetensors payloads (never pickles); malformed
requests get a 4xx JSON error and the server keeps serving.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Optional, Union

import torch
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from bebop_megatron.rollout.engine import Engine, Request, RequestError, SamplingParams, SpecConfig
from bebop_megatron.rollout.modeling import CausalLMWithMTP

log = logging.getLogger("bebop.serve")

SUPPORTED_SAMPLING = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
                      "ignore_eos", "n", "seed", "no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens",
                      "sampling_seed"}
# accepted only at their neutral values (the embedded engine does not implement them)
NEUTRAL_SAMPLING = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                    "min_new_tokens": 0, "regex": None, "json_schema": None, "ebnf": None,
                    "structural_tag": None, "logit_bias": None, "custom_params": None}
MAX_N = 64
MAX_BATCH = 1024


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[dict, list[dict]]] = None
    return_logprob: Optional[Union[bool, list[bool]]] = False
    stream: bool = False
    rid: Optional[Union[str, list[str]]] = None
    # bebop extension (GrowMTP): record the verifier's target distribution as top-k per verify step
    return_spec_records: int = 0


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    logprobs: Optional[int] = None
    stream: bool = False


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class EngineWorker:
    """Runs ``engine.step()`` in a thread; HTTP handlers wait on per-request asyncio queues."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.cv = threading.Condition()
        self.paused = False
        self.stopping = False
        self.error: Optional[str] = None
        self.thread = threading.Thread(target=self._loop, name="bebop-engine", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self.stopping and (self.paused or not self.engine.has_work()):
                    self.cv.wait(timeout=0.5)
                if self.stopping:
                    return
            try:
                self.engine.step()
            except Exception as e:  # keep serving: fail the in-flight requests, not the server
                log.exception("engine step failed")
                self.error = repr(e)
                with self.engine.lock:
                    for r in list(self.engine.running) + list(self.engine.waiting):
                        r.aborted = True

    def wake(self) -> None:
        with self.cv:
            self.cv.notify_all()

    def stop(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify_all()
        self.thread.join(timeout=10)


def _sampling_from_dict(d: dict) -> tuple[SamplingParams, int]:
    if not isinstance(d, dict):
        raise BadRequest("sampling_params must be an object")
    unknown = set(d) - SUPPORTED_SAMPLING - set(NEUTRAL_SAMPLING)
    if unknown:
        raise BadRequest(f"unknown sampling_params: {sorted(unknown)}")
    for k, neutral in NEUTRAL_SAMPLING.items():
        if k in d and d[k] not in (neutral, None):
            raise BadRequest(f"sampling_params.{k}={d[k]!r} is not supported by the embedded engine")
    n = d.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not (1 <= n <= MAX_N):
        raise BadRequest(f"sampling_params.n must be an integer in [1, {MAX_N}]")
    kw = {}
    types = {"max_new_tokens": int, "temperature": (int, float), "top_p": (int, float), "top_k": int,
             "min_p": (int, float), "ignore_eos": bool, "no_stop_trim": bool, "seed": int, "sampling_seed": int}
    for k, t in types.items():
        if k in d and d[k] is not None:
            v = d[k]
            if isinstance(v, bool) and t is not bool:
                raise BadRequest(f"sampling_params.{k} must be a number")
            if not isinstance(v, t):
                raise BadRequest(f"sampling_params.{k} has the wrong type: {type(v).__name__}")
            kw["seed" if k == "sampling_seed" else k] = float(v) if t == (int, float) else v
    if "stop" in d and d["stop"] is not None:
        kw["stop"] = [d["stop"]] if isinstance(d["stop"], str) else d["stop"]
        if not isinstance(kw["stop"], list):
            raise BadRequest("sampling_params.stop must be a string or a list of strings")
    if "stop_token_ids" in d and d["stop_token_ids"] is not None:
        if not isinstance(d["stop_token_ids"], list):
            raise BadRequest("sampling_params.stop_token_ids must be a list of integers")
        kw["stop_token_ids"] = d["stop_token_ids"]
    sp = SamplingParams(**kw)
    try:
        sp.validate()
    except RequestError as e:
        raise BadRequest(str(e)) from e
    return sp, n


def _listify(value, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise BadRequest(f"{name} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


class BebopServer:
    def __init__(self, engine: Engine, model_path: str = "", api_key: Optional[str] = None,
                 served_model_name: str = "bebop"):
        self.engine = engine
        self.worker = EngineWorker(engine)
        self.model_path = model_path
        self.api_key = api_key
        self.served_model_name = served_model_name
        self._staged: dict = {}
        self._staged_version: Optional[str] = None
        self.app = self._build_app()

    # ------------------------------------------------------------------ helpers
    def _tokenize(self, text: str) -> list[int]:
        tok = self.engine.tokenizer
        if tok is None:
            raise BadRequest("this server has no tokenizer: send input_ids")
        try:
            return list(tok.encode(text))
        except Exception as e:
            raise BadRequest(f"cannot tokenize text: {e}") from e

    def _decode(self, ids: list[int]) -> str:
        tok = self.engine.tokenizer
        return tok.decode(ids) if tok is not None else ""

    def _meta(self, r: Request) -> dict:
        completion = len(r.output_ids)
        meta: dict[str, Any] = {
            "id": r.rid,
            "finish_reason": r.finish_reason,
            "prompt_tokens": len(r.input_ids),
            "completion_tokens": completion,
            "cached_tokens": 0,
            "weight_version": self.engine.weight_version,
            "e2e_latency": time.time() - r.created,
        }
        if r.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.output_logprobs, r.output_ids)]
        if self.engine.gamma:
            meta.update(spec_metrics(r.verify_ct, completion, r.accepted, r.proposed, r.accepted_per_depth))
            if r.spec_record_topk:
                meta["spec_verify_records"] = r.spec_records
        return meta

    def _result(self, r: Request) -> dict:
        return {"text": self._decode(r.output_ids), "output_ids": list(r.output_ids), "meta_info": self._meta(r)}

    def _submit(self, prompts: list[list[int]], params: list[SamplingParams], logprobs: list[bool],
                rids: list[Optional[str]], loop, on_event, spec_record_topk: int = 0) -> list[Request]:
        reqs = []
        try:
            for ids, sp, lp, rid in zip(prompts, params, logprobs, rids):
                reqs.append(self.engine.add_request(
                    ids, sp, rid=rid, return_logprob=bool(lp), spec_record_topk=spec_record_topk,
                    on_update=lambda r: loop.call_soon_threadsafe(on_event, r)))
        except RequestError as e:
            for r in reqs:
                self.engine.abort(r.rid)
            self.worker.wake()
            raise BadRequest(str(e)) from e
        self.worker.wake()
        return reqs

    def _expand(self, body: GenerateRequest):
        if (body.text is None) == (body.input_ids is None):
            raise BadRequest("give exactly one of text or input_ids")
        if body.text is not None:
            texts = [body.text] if isinstance(body.text, str) else body.text
            if not texts:
                raise BadRequest("text is an empty list")
            prompts = [self._tokenize(t) for t in texts]
            single = isinstance(body.text, str)
        else:
            ids = body.input_ids
            single = len(ids) == 0 or not isinstance(ids[0], list)
            prompts = [ids] if single else ids
        if len(prompts) > MAX_BATCH:
            raise BadRequest(f"at most {MAX_BATCH} prompts per request")
        sps = _listify(body.sampling_params or {}, len(prompts), "sampling_params")
        lps = _listify(body.return_logprob or False, len(prompts), "return_logprob")
        rids = _listify(body.rid, len(prompts), "rid") if body.rid is not None else [None] * len(prompts)
        flat_prompts, flat_sp, flat_lp, flat_rid = [], [], [], []
        for i, (p, d, lp, rid) in enumerate(zip(prompts, sps, lps, rids)):
            sp, n = _sampling_from_dict(d)
            for j in range(n):
                spj = SamplingParams(**vars(sp))
                if spj.seed is not None and n > 1:
                    spj.seed = spj.seed + j
                flat_prompts.append(p)
                flat_sp.append(spj)
                flat_lp.append(lp)
                flat_rid.append((rid if n == 1 else f"{rid}-{j}") if rid is not None else None)
        if len(flat_prompts) > MAX_BATCH:
            raise BadRequest(f"at most {MAX_BATCH} sequences (prompts x n) per request")
        return flat_prompts, flat_sp, flat_lp, flat_rid, single and len(flat_prompts) == 1

    # ------------------------------------------------------------------ app
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="bebop serve (SGLang-compatible)")
        server = self

        @app.middleware("http")
        async def auth(request: HTTPRequest, call_next):
            if server.api_key and request.url.path not in ("/health",):
                if request.headers.get("authorization", "") != f"Bearer {server.api_key}":
                    return JSONResponse({"error": {"message": "invalid or missing API key"}}, status_code=401)
            return await call_next(request)

        @app.exception_handler(BadRequest)
        async def bad_request(_, exc: BadRequest):
            return JSONResponse({"error": {"message": str(exc)}}, status_code=exc.status)

        @app.exception_handler(RequestValidationError)
        async def invalid(_, exc: RequestValidationError):
            # only strings: the offending input (NaN, inf...) may not even be valid JSON to echo back
            detail = [{"loc": [str(x) for x in e.get("loc", ())], "msg": str(e.get("msg", "")),
                       "type": str(e.get("type", ""))} for e in exc.errors()]
            return JSONResponse({"error": {"message": "invalid request body", "detail": detail}}, status_code=400)

        @app.exception_handler(Exception)
        async def internal(_, exc: Exception):
            log.exception("request failed")
            return JSONResponse({"error": {"message": f"internal error: {type(exc).__name__}"}}, status_code=500)

        @app.get("/health")
        async def health():
            return JSONResponse({"status": "ok"}) if server.worker.thread.is_alive() else \
                JSONResponse({"status": "engine down"}, status_code=503)

        @app.get("/health_generate")
        async def health_generate():
            if server.worker.paused:
                return JSONResponse({"status": "paused"}, status_code=503)
            loop = asyncio.get_running_loop()
            done = asyncio.Event()
            server._submit([[0]], [SamplingParams(max_new_tokens=1, temperature=0.0)], [False], [None], loop,
                           lambda r: done.set() if r.finished else None)
            try:
                await asyncio.wait_for(done.wait(), timeout=60)
            except asyncio.TimeoutError:
                return JSONResponse({"status": "timeout"}, status_code=503)
            return JSONResponse({"status": "ok"})

        @app.get("/get_model_info")
        async def model_info():
            c = server.engine.model.config
            return {"model_path": server.model_path, "tokenizer_path": server.model_path, "is_generation": True,
                    "weight_version": server.engine.weight_version, "vocab_size": c.vocab_size,
                    "num_mtp_modules": len(server.engine.model.mtp), "served_model_name": server.served_model_name}

        @app.get("/get_server_info")
        async def server_info():
            st = server.engine.stats()
            return {"version": "bebop-0.1.0", "model_path": server.model_path,
                    "speculative_algorithm": server.engine.spec.algorithm if server.engine.gamma else None,
                    "speculative_num_steps": server.engine.gamma, "speculative_verify": server.engine.spec.verify,
                    "max_running_requests": server.engine.max_running, "context_length": server.engine.max_len,
                    "paused": server.worker.paused, "weight_version": server.engine.weight_version,
                    "internal_states": [st]}

        @app.post("/flush_cache")
        async def flush_cache():
            if server.engine.has_work():
                return JSONResponse({"success": False, "message": "cannot flush while requests are pending"},
                                    status_code=400)
            return {"success": True, "message": "cache flushed"}

        @app.post("/abort_request")
        async def abort_request(request: HTTPRequest):
            body = await _json_object(request)
            if body.get("abort_all"):
                n = server.engine.abort(None)
            elif isinstance(body.get("rid"), str):
                n = server.engine.abort(body["rid"])
            else:
                raise BadRequest("give rid (string) or abort_all: true")
            server.worker.wake()
            return {"success": True, "aborted": n}

        @app.post("/pause_generation")
        async def pause(request: HTTPRequest):
            body = await _json_object(request, allow_empty=True)
            mode = body.get("mode", "abort")
            if mode not in ("abort", "retract", "in_place"):
                raise BadRequest("mode must be abort, retract or in_place")
            with server.worker.cv:
                server.worker.paused = True

            def apply() -> int:
                with server.engine.lock:  # waits for the step in flight
                    if mode == "abort":
                        n = server.engine.abort(None)
                        server.engine.step()  # reaps the aborted requests (no compute)
                        return n
                    if mode == "retract":
                        return server.engine.retract_all()
                    return len(server.engine.running)

            n = await asyncio.to_thread(apply)
            return {"success": True, "mode": mode, "affected": n}

        @app.post("/continue_generation")
        async def continue_generation():
            with server.worker.cv:
                server.worker.paused = False
                server.worker.cv.notify_all()
            return {"success": True}

        @app.post("/update_weights_from_disk")
        async def update_from_disk(request: HTTPRequest):
            body = await _json_object(request)
            path = body.get("model_path")
            if not isinstance(path, str) or not Path(path).is_dir():
                raise BadRequest("model_path must be an existing folder of *.safetensors")
            from safetensors.torch import load_file

            files = sorted(Path(path).glob("*.safetensors"))
            if not files:
                raise BadRequest(f"{path}: no *.safetensors files")
            tensors = {}
            for f in files:
                tensors.update(load_file(str(f)))
            return await asyncio.to_thread(server._apply_weights, tensors, body.get("weight_version"),
                                           body.get("flush_cache", True))

        @app.post("/update_weights_from_tensor")
        async def update_from_tensor(request: HTTPRequest):
            body = await _json_object(request)
            fmt = body.get("load_format") or "safetensors"
            if fmt != "safetensors":
                raise BadRequest("only load_format=safetensors is accepted (pickled tensors are refused)")
            payloads = body.get("serialized_named_tensors")
            if isinstance(payloads, str):
                payloads = [payloads]
            if not isinstance(payloads, list) or not payloads or not all(isinstance(p, str) for p in payloads):
                raise BadRequest("serialized_named_tensors must be a base64 safetensors string or a list of them")
            from safetensors.torch import load as st_load

            tensors = {}
            try:
                for p in payloads:
                    tensors.update(st_load(base64.b64decode(p, validate=True)))
            except Exception as e:
                raise BadRequest(f"cannot decode safetensors payload: {type(e).__name__}: {e}") from e
            if body.get("stage"):
                return server._stage_weights(tensors, body.get("stage_version"))
            return await asyncio.to_thread(server._apply_weights, tensors, body.get("weight_version"),
                                           body.get("flush_cache", True))

        @app.post("/generate")
        async def generate(body: GenerateRequest):
            prompts, sps, lps, rids, single = server._expand(body)
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue = asyncio.Queue()
            reqs = server._submit(prompts, sps, lps, rids, loop, queue.put_nowait,
                                  spec_record_topk=body.return_spec_records)
            if body.stream:
                return StreamingResponse(server._stream(reqs, queue), media_type="text/event-stream")
            await _wait_all(reqs, queue)
            results = [server._result(r) for r in reqs]
            return results[0] if single else results

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest):
            p = body.prompt
            if isinstance(p, str):
                prompts = [server._tokenize(p)]
            elif isinstance(p, list) and p and isinstance(p[0], str):
                prompts = [server._tokenize(x) for x in p]
            elif isinstance(p, list) and p and isinstance(p[0], list):
                prompts = p
            else:
                prompts = [p]
            if body.stream:
                raise BadRequest("stream is not supported on /v1/completions; use /generate with stream")
            d = {"max_new_tokens": body.max_tokens, "temperature": body.temperature, "top_p": body.top_p,
                 "top_k": body.top_k, "n": body.n, "stop": body.stop, "seed": body.seed}
            gen = GenerateRequest(input_ids=prompts, sampling_params=[d] * len(prompts),
                                  return_logprob=body.logprobs is not None)
            flat, sps, lps, rids, _ = server._expand(gen)
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue = asyncio.Queue()
            reqs = server._submit(flat, sps, lps, rids, loop, queue.put_nowait)
            await _wait_all(reqs, queue)
            choices = []
            for i, r in enumerate(reqs):
                fr = (r.finish_reason or {}).get("type")
                choice = {"index": i, "text": server._decode(r.output_ids),
                          "finish_reason": {"stop": "stop", "length": "length"}.get(fr, fr)}
                if r.return_logprob:
                    choice["logprobs"] = {"tokens": [server._decode([t]) for t in r.output_ids],
                                          "token_logprobs": list(r.output_logprobs)}
                choices.append(choice)
            ptoks = sum(len(r.input_ids) for r in reqs)
            ctoks = sum(len(r.output_ids) for r in reqs)
            return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                    "model": body.model or server.served_model_name, "choices": choices,
                    "usage": {"prompt_tokens": ptoks, "completion_tokens": ctoks, "total_tokens": ptoks + ctoks}}

        return app

    def _stage_weights(self, tensors: dict, version) -> dict:
        """Hold a validated bucket until the sync's last (unstaged) call applies everything at
        once: a sync interrupted midway leaves the served weights untouched. Buckets staged for
        another version (an abandoned sync) are dropped."""
        if not isinstance(version, str) or not version:
            raise BadRequest("staged weight buckets need stage_version (the version the sync will commit)")
        try:
            self.engine.model.validate_hf_tensors(tensors)
        except ValueError as e:
            raise BadRequest(f"weight bucket rejected: {e}") from e
        if self._staged_version != version:
            self._staged, self._staged_version = {}, version
        self._staged.update(tensors)
        return {"success": True, "staged": len(tensors), "staged_total": len(self._staged), "weight_version": version}

    def _apply_weights(self, tensors: dict, version, flush: bool) -> dict:
        """Swap weights between engine steps: trunk and MTP heads move together (one lock), so
        no step ever runs on a mix; KV computed under the old weights is re-prefilled. Buckets
        staged for this version are applied in the same swap; all tensors are validated first."""
        if self._staged and self._staged_version == version:
            tensors = {**self._staged, **tensors}
        self._staged, self._staged_version = {}, None
        with self.engine.lock:
            try:
                loaded = self.engine.update_weights(tensors, version)
            except ValueError as e:
                raise BadRequest(f"weight update rejected, nothing changed: {e}") from e
            if flush:
                self.engine.retract_all()
        self.worker.wake()
        mtp = [n for n in loaded if n.startswith("mtp.") or _is_deepseek_mtp(n, self.engine.model)]
        return {"success": True, "message": f"updated {len(loaded)} tensors ({len(mtp)} MTP)",
                "num_tensors": len(loaded), "num_mtp_tensors": len(mtp),
                "weight_version": self.engine.weight_version}

    async def _stream(self, reqs: list[Request], queue: asyncio.Queue):
        sent = {r.rid: -1 for r in reqs}
        pending = {r.rid for r in reqs if not r.finished}
        for r in reqs:
            if r.finished:
                yield f"data: {json.dumps(self._result(r) | {'index': reqs.index(r)})}\n\n"
        while pending:
            r = await queue.get()
            if r.rid not in pending and not r.finished:
                continue
            if len(r.output_ids) != sent[r.rid] or r.finished:
                sent[r.rid] = len(r.output_ids)
                yield f"data: {json.dumps(self._result(r) | {'index': reqs.index(r)})}\n\n"
            if r.finished:
                pending.discard(r.rid)
        yield "data: [DONE]\n\n"


def spec_metrics(verify_ct: int, completion: int, accepted: int, proposed: int, per_depth: list[int]) -> dict:
    """meta_info speculative counters under every SGLang spelling."""
    return {
        "spec_verify_ct": verify_ct,
        "spec_accept_length": completion / verify_ct if verify_ct else 0.0,
        "spec_accept_rate": accepted / proposed if proposed else 0.0,
        "spec_num_correct_drafts": accepted, "spec_num_proposed_drafts": proposed,  # >= 0.5.12
        "spec_accepted_drafts": accepted, "spec_proposed_drafts": proposed,  # 0.5.11
        "spec_accept_token_num": accepted, "spec_draft_token_num": proposed,  # <= 0.5.10
        "spec_accepted_per_depth": list(per_depth),
    }


def _is_deepseek_mtp(name: str, model: CausalLMWithMTP) -> bool:
    if not name.startswith("model.layers."):
        return False
    return int(name.split(".")[2]) >= model.config.num_hidden_layers


async def _json_object(request: HTTPRequest, allow_empty: bool = False) -> dict:
    raw = await request.body()
    if not raw.strip():
        if allow_empty:
            return {}
        raise BadRequest("empty body: a JSON object is required")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"invalid JSON: {e}") from e
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


async def _wait_all(reqs: list[Request], queue: asyncio.Queue) -> None:
    while not all(r.finished for r in reqs):
        await queue.get()


# --------------------------------------------------------------------------- CLI


def load_tokenizer_for(model_path: str, spec: Optional[str]):
    from bebop_megatron.data import CharTokenizer, load_tokenizer

    if spec:
        return load_tokenizer(spec)
    p = Path(model_path)
    if (p / "tokenizer.json").exists() or (p / "tokenizer_config.json").exists():
        return load_tokenizer(str(p))
    cfg = json.loads((p / "config.json").read_text()) if (p / "config.json").exists() else {}
    return CharTokenizer() if cfg.get("bebop_tokenizer", "char") == "char" else None


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", required=True, help="Hugging Face layout folder (config.json + *.safetensors)")
    p.add_argument("--tokenizer", default=None, help="'char' or a local tokenizer folder (default: the model's)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None)
    p.add_argument("--speculative-algorithm", default=None, help="NEXTN | EAGLE | MTP (MTP heads) or none")
    p.add_argument("--speculative-num-steps", type=int, default=3, help="γ drafts per verify step")
    p.add_argument("--speculative-eagle-topk", type=int, default=1)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None, help="= steps + 1 for topk 1")
    p.add_argument("--speculative-use-rejection-sampling", action="store_true", default=True)
    p.add_argument("--speculative-verify", default="rejection", choices=["rejection", "target_only"])
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--context-length", type=int, default=2048)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])


def build_server(args) -> BebopServer:
    algo = (args.speculative_algorithm or "none").lower()
    if args.speculative_eagle_topk != 1:
        raise SystemExit("bebop serve: only --speculative-eagle-topk 1 (chain drafts) is supported")
    if args.speculative_num_draft_tokens is not None and args.speculative_num_draft_tokens != args.speculative_num_steps + 1:
        raise SystemExit("bebop serve: --speculative-num-draft-tokens must be --speculative-num-steps + 1")
    model = CausalLMWithMTP.from_pretrained(args.model_path, dtype=getattr(torch, args.dtype))
    spec = SpecConfig("mtp" if algo in ("nextn", "eagle", "mtp") else "none", args.speculative_num_steps,
                      args.speculative_verify)
    engine = Engine(model, load_tokenizer_for(args.model_path, args.tokenizer), spec,
                    max_running=args.max_running_requests, max_len=args.context_length,
                    weight_version=args.weight_version)
    return BebopServer(engine, args.model_path, api_key=args.api_key)


def serve(args) -> None:
    import uvicorn

    server = build_server(args)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("binding %s: the server is reachable beyond this machine%s", args.host,
                    "" if args.api_key else " and has no --api-key")
    log.info("bebop serve on http://%s:%d (speculative: %s, γ=%d)", args.host, args.port,
             server.engine.spec.algorithm, server.engine.gamma)
    try:
        uvicorn.run(server.app, host=args.host, port=args.port, log_level="warning", timeout_keep_alive=30)
    finally:
        server.worker.stop()
