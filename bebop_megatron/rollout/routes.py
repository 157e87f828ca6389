"""``bebop serve``'s HTTP routes: plain functions over the engine handle (the :class:`BebopServer`
the app was built for, ``app.state.server``), grouped in one APIRouter.

Each route validates its body (rollout/validation.py) and calls the server's engine-facing methods;
none holds the engine lock across a model step (see the reliability notes in rollout/server.py).
Route shapes follow SGLang 0.5.23's http_server and the OpenAI API (rollout/openai_api.py).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time

from fastapi import APIRouter, Depends, FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from bebop_megatron.rollout import openai_api
from bebop_megatron.rollout.engine import SamplingParams
from bebop_megatron.rollout.validation import BadRequest, GenerateInput, as_bool, as_str
from bebop_megatron.rollout.server import (MAX_PATH_CHARS, BebopServer, _error_body, _json_object, _short_path,
                                           _snapshot)

log = logging.getLogger("bebop.serve")
router = APIRouter()


def engine_server(request: HTTPRequest) -> BebopServer:
    """The engine handle every route works on."""
    return request.app.state.server


def install_error_handlers(app: FastAPI) -> None:
    """Every error is JSON: a BadRequest or a body FastAPI cannot parse is a 400, anything else a
    logged 500 that names only the exception type."""

    @app.exception_handler(BadRequest)
    async def bad_request(_, exc: BadRequest):
        return JSONResponse(_error_body(str(exc)), status_code=exc.status)

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


@router.get("/health")
async def health(server: BebopServer = Depends(engine_server)):
    return JSONResponse({"status": "ok"}) if server.worker.thread.is_alive() else \
        JSONResponse({"status": "engine down"}, status_code=503)


@router.get("/health_generate")
async def health_generate(request: HTTPRequest, server: BebopServer = Depends(engine_server)):
    if server.worker.paused:
        return JSONResponse({"status": "paused"}, status_code=503)
    gi = GenerateInput([[0]], [SamplingParams(max_new_tokens=1, temperature=0.0)], [False], [None], True)
    try:
        await asyncio.wait_for(server._run_blocking(request, gi), timeout=60)
    except asyncio.TimeoutError:
        return JSONResponse({"status": "timeout"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info(server: BebopServer = Depends(engine_server)):
    c = server.engine.model.config
    return {"model_path": server.model_path, "tokenizer_path": server.model_path, "is_generation": True,
            "served_model_name": server.served_model_name, "preferred_sampling_params": None,
            "weight_version": server.engine.weight_version, "load_format": "safetensors",
            "model_type": server.model_type, "architectures": server.architectures,
            "has_image_understanding": False, "has_audio_understanding": False,
            "vocab_size": c.vocab_size, "num_mtp_modules": len(server.engine.model.mtp)}


@router.get("/get_server_info")
@router.get("/server_info")
async def server_info(server: BebopServer = Depends(engine_server)):
    e = server.engine
    st = {**e.stats(), "weight_version": e.weight_version}
    return {"version": "bebop-0.1.0", "model_path": server.model_path,
            "served_model_name": server.served_model_name,
            "speculative_algorithm": server.spec_algorithm_name if e.gamma else None,
            "speculative_num_steps": e.gamma, "speculative_eagle_topk": 1 if e.gamma else None,
            "speculative_num_draft_tokens": e.gamma + 1 if e.gamma else None,
            "speculative_verify": e.spec.verify, "speculative_adaptive": bool(e.gamma and e.spec.adaptive),
            "speculative_token_map": e.spec.draft_vocab if isinstance(e.spec.draft_vocab, str) else None,
            "max_running_requests": e.max_running,
            "max_total_num_tokens": e.max_running * e.max_len, "context_length": e.max_len,
            "tp_size": 1, "dp_size": 1, "pp_size": 1, "paused": server.worker.paused,
            "weight_version": e.weight_version, "internal_states": [st]}


@router.get("/v1/models")
async def models(server: BebopServer = Depends(engine_server)):
    name = server.served_model_name
    return {"object": "list", "data": [{"id": name, "object": "model", "created": int(server.started),
                                        "owned_by": "bebop", "root": name, "parent": None,
                                        "max_model_len": server.engine.max_len}]}


@router.get("/v1/loads")
async def loads(server: BebopServer = Depends(engine_server)):
    e = server.engine
    st = e.stats()
    return {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "version": "bebop-0.1.0",
            "accelerator": None, "num_accelerators": 0,
            "loads": [{"timestamp": time.time(), "dp_rank": 0, "num_running_reqs": st["num_running_reqs"],
                       "num_waiting_reqs": st["num_waiting_reqs"] + len(server.worker.inbox),
                       "max_running_requests": e.max_running,
                       "max_total_num_tokens": e.max_running * e.max_len}]}


@router.get("/get_weight_version")
async def get_weight_version(server: BebopServer = Depends(engine_server)):
    return {"weight_version": server.engine.weight_version}


@router.post("/update_weight_version")
async def update_weight_version(request: HTTPRequest, server: BebopServer = Depends(engine_server)):
    body = await _json_object(request)
    new = body.get("new_version")
    if isinstance(new, (int, float)) and not isinstance(new, bool):
        new = str(new)
    new = as_str(new, "new_version", 256, allow_empty=False)
    abort = True if body.get("abort_all_requests") is None else \
        as_bool(body.get("abort_all_requests"), "abort_all_requests")
    if abort:
        server.worker.abort(None)
    await asyncio.to_thread(server.engine.set_weight_version, new)
    return {"success": True, "message": f"Weight version updated to {new}", "new_version": new}


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(server: BebopServer = Depends(engine_server)):
    if server.engine.has_work() or server.worker.inbox:
        return JSONResponse({"success": False, "message": "cannot flush while requests are pending"},
                            status_code=400)
    return {"success": True, "message": "cache flushed"}


@router.post("/abort_request")
async def abort_request(request: HTTPRequest, server: BebopServer = Depends(engine_server)):
    body = await _json_object(request, allow_empty=True)
    abort_all = body.get("abort_all")
    abort_all = False if abort_all is None else as_bool(abort_all, "abort_all")
    rid = body.get("rid")
    if abort_all:
        n = server.worker.abort(None)
    elif rid is None or rid == "":
        n = 0  # SGLang: nothing to abort is not an error
    else:
        n = server.worker.abort(as_str(rid, "rid", 256))
    return {"success": True, "aborted": n}


@router.post("/pause_generation")
async def pause(request: HTTPRequest, server: BebopServer = Depends(engine_server)):
    body = await _json_object(request, allow_empty=True)
    mode = body.get("mode", "abort")
    if mode not in ("abort", "retract", "in_place"):
        raise BadRequest("mode must be abort, retract or in_place")
    with server.worker.cv:
        server.worker.paused = True

    def apply() -> int:
        with server.engine.lock:  # waits for the step in flight (in a worker thread)
            if mode == "abort":
                n = server.engine.abort(None)
                server.engine.step()  # reaps the aborted requests (no compute)
                return n
            if mode == "retract":
                return server.engine.retract_all()
            return len(server.engine.running)

    n = await asyncio.to_thread(apply)
    return {"success": True, "mode": mode, "affected": n}


@router.post("/continue_generation")
async def continue_generation(server: BebopServer = Depends(engine_server)):
    with server.worker.cv:
        server.worker.paused = False
        server.worker.cv.notify_all()
    return {"success": True}


@router.post("/update_weights_from_disk")
async def update_from_disk(request: HTTPRequest, server: BebopServer = Depends(engine_server)):
    body = await _json_object(request)
    path = body.get("model_path")
    if not isinstance(path, str) or not path or len(path) > MAX_PATH_CHARS or "\x00" in path:
        raise BadRequest(f"model_path must be a folder path of at most {MAX_PATH_CHARS} characters")
    fmt = body.get("load_format")
    if fmt not in (None, "auto", "safetensors"):
        raise BadRequest(f"load_format {_short_path(str(fmt))} is not supported (safetensors only)")
    flush = True if body.get("flush_cache") is None else as_bool(body.get("flush_cache"), "flush_cache")
    abort_all = False if body.get("abort_all_requests") is None else \
        as_bool(body.get("abort_all_requests"), "abort_all_requests")
    async with server._weights_guard():
        tensors = await asyncio.to_thread(server._load_from_disk, path)
        res = await asyncio.to_thread(server._apply_weights, tensors, body.get("weight_version"), flush,
                                      abort_all)
    server.model_path = path
    return res


@router.post("/update_weights_from_tensor")
async def update_from_tensor(request: HTTPRequest, server: BebopServer = Depends(engine_server)):
    body = await _json_object(request, offload=True)
    fmt = body.get("load_format") or "safetensors"
    if fmt != "safetensors":
        raise BadRequest("only load_format=safetensors is accepted (pickled tensors are refused)")
    payloads = body.get("serialized_named_tensors")
    if isinstance(payloads, str):
        payloads = [payloads]
    if not isinstance(payloads, list) or not payloads or not all(isinstance(p, str) for p in payloads):
        raise BadRequest("serialized_named_tensors must be a base64 safetensors string or a list of them")
    flush = True if body.get("flush_cache") is None else as_bool(body.get("flush_cache"), "flush_cache")

    def decode() -> dict:
        from safetensors.torch import load as st_load

        tensors = {}
        try:
            for p in payloads:
                tensors.update(st_load(base64.b64decode(p, validate=True)))
        except Exception as e:  # noqa: BLE001
            raise BadRequest(f"cannot decode safetensors payload: {type(e).__name__}: {e}") from e
        return tensors

    async with server._weights_guard():
        tensors = await asyncio.to_thread(decode)
        if body.get("stage"):
            return await asyncio.to_thread(server._stage_weights, tensors, body.get("stage_version"))
        return await asyncio.to_thread(server._apply_weights, tensors, body.get("weight_version"), flush)


@router.post("/generate")
async def generate(request: HTTPRequest, server: BebopServer = Depends(engine_server)):
    gi = server._validate(await _json_object(request))
    if gi.stream:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        # runs in the engine thread: snapshot there, hand over in order
        on_update = lambda i, r: loop.call_soon_threadsafe(queue.put_nowait, (i, _snapshot(r)))  # noqa: E731
        reqs = await server._submit(gi, on_update)
        # the background task also runs when the client left before the stream started
        return StreamingResponse(server._stream(reqs, queue), media_type="text/event-stream",
                                 background=BackgroundTask(server._release, reqs))
    reqs = await server._run_blocking(request, gi)
    results = [server._result(r) for r in reqs]
    return results[0] if gi.single else results


@router.post("/v1/completions")
async def completions(request: HTTPRequest, server: BebopServer = Depends(engine_server)):
    body = await _json_object(request)
    gi = server._completion_input(body)
    if gi.stream:
        return await server._stream_openai(body, gi, chat=False)
    reqs = await server._run_blocking(request, gi)
    echo = body.get("echo") is True
    choices = []
    for i, r in enumerate(reqs):
        kind, matched = openai_api.finish(r)
        prefix = server._decode(r.input_ids) if echo else ""
        choice = {"index": i, "text": prefix + server._text(r), "logprobs": None, "finish_reason": kind,
                  "matched_stop": matched}
        if r.return_logprob:
            choice["logprobs"] = openai_api.completion_logprobs(r, server._decode, echo_prompt=echo)
        choices.append(choice)
    return server._openai_response(body, gi, reqs, choices, "text_completion", "cmpl")


@router.post("/v1/chat/completions")
async def chat_completions(request: HTTPRequest, server: BebopServer = Depends(engine_server)):
    body = await _json_object(request)
    gen = openai_api.chat_generate_body(body, server.engine.tokenizer, server.limits.context_length)
    gi = server._validate(gen)
    if gi.stream:
        return await server._stream_openai(body, gi, chat=True)
    reqs = await server._run_blocking(request, gi)
    choices = []
    for i, r in enumerate(reqs):
        kind, matched = openai_api.finish(r)
        choices.append({"index": i, "message": {"role": "assistant", "content": server._text(r)},
                        "logprobs": openai_api.chat_logprobs(r, server._decode) if r.return_logprob else None,
                        "finish_reason": kind, "matched_stop": matched})
    return server._openai_response(body, gi, reqs, choices, "chat.completion", "chatcmpl")
