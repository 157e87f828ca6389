"""``bebop serve``: SGLang's native HTTP API on the embedded engine.

Request and response JSON follow SGLang (``/generate`` with ``text`` | ``input_ids``,
``sampling_params``, ``return_logprob``, ``stream`` (SSE), ``rid``; ``meta_info`` with ``id``,
``finish_reason``, ``prompt_tokens``, ``completion_tokens``, ``output_token_logprobs``,
``weight_version`` and the speculative counters), plus ``/v1/completions``. The accepted/proposed
draft counts are reported under every key spelling SGLang has used, so clients of any version
(slime, verl) read real acceptance instead of 0.

Reliability (docs/reliability.md):

* every body is read under a size limit and parsed with bounded depth and number sizes, then
  checked by one validator (:mod:`bebop_megatron.rollout.validation`) before anything reaches the
  engine: a bad request fails alone with a 4xx;
* the event loop never waits for the engine: new requests go through an inbox that the engine
  thread drains between steps, aborts are flags, and weight loads run in worker threads, so
  ``/health`` and ``/abort_request`` answer at once under load;
* streaming sends immutable snapshots taken by the engine thread, so the final event (with its
  ``finish_reason``) always precedes ``[DONE]``;
* a client that disconnects (streaming or not) has its requests aborted.

Safety: binds 127.0.0.1 unless told otherwise; optional API key (``Authorization: Bearer``; from
``--api-key``, ``--api-key-file`` or ``BEBOP_API_KEY``); ``/update_weights_from_tensor`` takes only
safetensors payloads (never pickles); ``/update_weights_from_disk`` reads regular files only.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import gc
import hmac
import json
import logging
import os
import stat
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from bebop_megatron.rollout.engine import Engine, Request, SpecConfig
from bebop_megatron.rollout import openai_api
from bebop_megatron.rollout.modeling import CausalLMWithMTP
from bebop_megatron.rollout.protocol import spec_meta_info
from bebop_megatron.rollout.validation import (MAX_BATCH, MAX_N, BadRequest, GenerateInput, Limits, as_bool,
                                               as_int, parse_json_object, validate_generate)

log = logging.getLogger("bebop.serve")

__all__ = ["BebopServer", "BadRequest", "MAX_BATCH", "MAX_N", "add_serve_args", "build_server", "serve"]

MAX_BODY_BYTES = 16 << 20  # every route but the weight payload route
MAX_WEIGHT_BODY_BYTES = 1 << 30  # /update_weights_from_tensor (base64 safetensors buckets)
WEIGHT_PAYLOAD_ROUTES = ("/update_weights_from_tensor",)
MAX_PATH_CHARS = 4096
WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# --------------------------------------------------------------------------- ASGI guard


class _Guard:
    """Pure ASGI middleware (no BaseHTTPMiddleware: it would hide client disconnects): API key
    (constant-time compare) and a body-size limit enforced on Content-Length and on the bytes
    actually received (chunked bodies)."""

    def __init__(self, app, server: "BebopServer"):
        self.app = app
        self.server = server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        s = self.server
        path = scope.get("path", "")
        headers = dict(scope.get("headers") or [])
        if s.api_key and path != "/health":
            got = headers.get(b"authorization", b"")
            if not hmac.compare_digest(got, f"Bearer {s.api_key}".encode()):
                return await _send_json(send, 401, {"error": {"message": "invalid or missing API key"}})
        limit = s.max_weight_body if path in WEIGHT_PAYLOAD_ROUTES else s.max_body
        cl = headers.get(b"content-length")
        if cl is not None:
            try:
                n = int(cl)
            except ValueError:
                return await _send_json(send, 400, {"error": {"message": "invalid Content-Length"}})
            if n > limit:
                return await _send_json(send, 413, _error_body(f"body of {n} bytes exceeds the limit of {limit}"))
        seen = 0

        async def limited_receive():
            nonlocal seen
            msg = await receive()
            if msg.get("type") == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise BadRequest(f"body exceeds the limit of {limit} bytes", status=413)
            return msg

        await self.app(scope, limited_receive, send)


async def _send_json(send, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _error_body(message: str) -> dict:
    # SGLang-style error plus {success, message} (what its control routes answer on failure)
    return {"error": {"message": message}, "success": False, "message": message}


# --------------------------------------------------------------------------- engine thread


class Submission:
    """A batch of sequences waiting in the inbox; the engine thread turns it into Requests."""

    def __init__(self, gi: GenerateInput, on_update: Callable[[int, Request], None], loop,
                 resolve: Callable[[Optional[list], Optional[BaseException]], None]):
        self.gi = gi
        self.on_update = on_update
        self.loop = loop
        self.resolve = resolve
        self.cancelled = False
        self.reqs: list[Request] = []


class EngineWorker:
    """Runs ``engine.step()`` in a thread. HTTP handlers never take the engine lock: they put
    submissions in an inbox that this thread drains between steps, and abort by flag."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.cv = threading.Condition()
        self.inbox: list[Submission] = []
        self.live: dict[int, Request] = {}  # id(request) -> request (dataclasses are unhashable)
        self.live_lock = threading.Lock()
        self.paused = False
        self.stopping = False
        self.error: Optional[str] = None
        self.thread = threading.Thread(target=self._loop, name="bebop-engine", daemon=True)
        self.thread.start()

    def submit(self, sub: Submission) -> None:
        with self.cv:
            self.inbox.append(sub)
            self.cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self.stopping and not self.inbox and (self.paused or not self.engine.has_work()):
                    self.cv.wait(timeout=0.5)
                if self.stopping:
                    return
                batch, self.inbox = self.inbox, []
            for sub in batch:
                try:
                    self._admit(sub)
                except Exception:  # noqa: BLE001 - never let one submission kill the engine thread
                    log.exception("admitting a request failed")
            if self.paused or not self.engine.has_work():
                continue
            try:
                self.engine.step()
            except Exception as e:  # last resort (validation should make this unreachable)
                log.exception("engine step failed")
                self.error = repr(e)
                with self.engine.lock:
                    for r in list(self.engine.running) + list(self.engine.waiting):
                        r.aborted = True

    def _admit(self, sub: Submission) -> None:
        gi, reqs = sub.gi, []
        try:
            for i, (ids, sp, lp, rid) in enumerate(zip(gi.prompts, gi.params, gi.return_logprob, gi.rids)):
                opts = {}
                if i < len(gi.logprob_start_len):
                    opts = dict(logprob_start_len=gi.logprob_start_len[i], top_logprobs_num=gi.top_logprobs_num[i],
                                token_ids_logprob=gi.token_ids_logprob[i])
                reqs.append(self.engine.add_request(ids, sp, rid=rid, return_logprob=lp,
                                                    spec_record_topk=gi.return_spec_records,
                                                    on_update=_bind(sub.on_update, i), **opts))
        except Exception as e:  # noqa: BLE001 - the request fails alone
            for r in reqs:
                r.aborted = True
            _call_in_loop(sub.loop, sub.resolve, None, BadRequest(f"request rejected: {e}"))
            return
        for i, r in enumerate(reqs):  # per-request response options (copied into snapshots)
            r.return_text_in_logprobs = gi.return_text_in_logprobs
            r.stream_interval = gi.stream_interval[i] if i < len(gi.stream_interval) else 1
        with self.live_lock:
            self.live.update((id(r), r) for r in reqs)
        sub.reqs = reqs
        if sub.cancelled:
            for r in reqs:
                r.aborted = True
        _call_in_loop(sub.loop, sub.resolve, reqs, None)

    def forget(self, reqs: list[Request]) -> None:
        with self.live_lock:
            for r in reqs:
                self.live.pop(id(r), None)

    def abort(self, rid: Optional[str]) -> int:
        """Flag requests (all with rid=None) for abort; the engine reaps them at its next step.
        Never waits for a step."""
        n = 0
        with self.live_lock:
            for r in self.live.values():
                if not r.finished and (rid is None or r.rid == rid) and not r.aborted:
                    r.aborted = True
                    n += 1
        with self.cv:
            for sub in self.inbox:
                if rid is None or rid in sub.gi.rids:
                    sub.cancelled = True
                    n += sum(1 for x in sub.gi.rids if rid is None or x == rid)
            self.cv.notify_all()
        return n

    def wake(self) -> None:
        with self.cv:
            self.cv.notify_all()

    def stop(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify_all()
        self.thread.join(timeout=10)


def _bind(fn, i):
    return lambda r: fn(i, r)


def _call_in_loop(loop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed (server shutting down)
        pass


def _snapshot(r: Request) -> Request:
    """An immutable copy of a request's visible state, taken by the engine thread (under its
    lock) so that an event never mixes two steps, and ``finished`` is exact for that event."""
    s = copy.copy(r)
    s.output_ids = list(r.output_ids)
    s.output_logprobs = list(r.output_logprobs)
    s.finish_reason = dict(r.finish_reason) if r.finish_reason is not None else None
    s.accepted_per_depth = list(r.accepted_per_depth)
    s.reached_per_depth = list(r.reached_per_depth)
    s.spec_records = list(r.spec_records)
    s.output_top_logprobs = list(r.output_top_logprobs)
    s.output_token_ids_logprobs = list(r.output_token_ids_logprobs)
    s.spec_histogram = list(r.spec_histogram)
    s.weight_events = list(r.weight_events)
    return s


# --------------------------------------------------------------------------- server


class BebopServer:
    def __init__(self, engine: Engine, model_path: str = "", api_key: Optional[str] = None,
                 served_model_name: str = "bebop", max_body: int = MAX_BODY_BYTES,
                 max_weight_body: int = MAX_WEIGHT_BODY_BYTES):
        self.engine = engine
        self.worker = EngineWorker(engine)
        self.model_path = model_path
        self.api_key = api_key
        self.served_model_name = served_model_name
        self.max_body = max_body
        self.max_weight_body = max_weight_body
        self.limits = Limits(vocab_size=engine.model.config.vocab_size, context_length=engine.max_len)
        self._staged: dict = {}
        self._staged_version: Optional[str] = None
        self._weights_lock: Optional[asyncio.Lock] = None
        self.started = time.time()
        self.spec_algorithm_name = "NEXTN"  # SGLang's name for MTP-head drafts (build_server sets the flag given)
        self.model_type, self.architectures = _hf_identity(model_path)
        self.app = self._build_app()

    # ------------------------------------------------------------------ helpers
    def _tokenize(self, text: str) -> list[int]:
        tok = self.engine.tokenizer
        if tok is None:
            raise BadRequest("this server has no tokenizer: send input_ids")
        if len(text) > 16 * self.engine.max_len + 1024:
            raise BadRequest(f"text of {len(text)} characters is far beyond the context length")
        try:
            return list(tok.encode(text))
        except Exception as e:
            raise BadRequest(f"cannot tokenize text: {e}") from e

    def _decode(self, ids: list[int]) -> str:
        tok = self.engine.tokenizer
        return tok.decode(ids) if tok is not None else ""

    def _text(self, r: Request) -> str:
        """Output text; with ``no_stop_trim`` false (SGLang's default) the matched stop string or
        stop token is cut from the text (output_ids keep it)."""
        ids = r.output_ids
        fr = r.finish_reason or {}
        if fr.get("type") == "stop" and not r.params.no_stop_trim:
            matched = fr.get("matched")
            if isinstance(matched, int) and ids and ids[-1] == matched:
                return self._decode(ids[:-1])
            text = self._decode(ids)
            if isinstance(matched, str) and matched in text:
                return text[: text.index(matched)]
            return text
        return self._decode(ids)

    def _meta(self, r: Request) -> dict:
        completion = len(r.output_ids)
        spans = self.engine.weight_version_spans(r, self.engine.weight_version)
        meta: dict[str, Any] = {
            "id": r.rid,
            "finish_reason": r.finish_reason,
            "prompt_tokens": len(r.input_ids),
            "completion_tokens": completion,
            "cached_tokens": 0,
            "weight_version": spans[-1]["version"],
            "weight_versions": spans,
            "num_retractions": r.retractions,
            "e2e_latency": time.time() - r.created,
        }
        if r.return_logprob:
            text = bool(getattr(r, "return_text_in_logprobs", False))
            meta["input_token_logprobs"] = self._logprob_entries(r.input_token_logprobs or [], text)
            meta["output_token_logprobs"] = self._logprob_entries(list(zip(r.output_logprobs, r.output_ids)), text)
            meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
            if r.top_logprobs_num:
                meta["input_top_logprobs"] = self._position_entries(r.input_top_logprobs or [], text)
                meta["output_top_logprobs"] = self._position_entries(r.output_top_logprobs, text)
            if r.token_ids_logprob is not None:
                meta["input_token_ids_logprobs"] = self._position_entries(r.input_token_ids_logprobs or [], text)
                meta["output_token_ids_logprobs"] = self._position_entries(r.output_token_ids_logprobs, text)
        if self.engine.gamma:
            meta.update(spec_meta_info(r.verify_ct, completion, r.accepted, r.proposed, r.accepted_per_depth,
                                       r.reached_per_depth, r.verify_tokens, r.plain_rounds, r.gamma_sum))
            if r.spec_histogram:
                meta["spec_correct_drafts_histogram"] = list(r.spec_histogram)
            if r.spec_record_topk:
                meta["spec_verify_records"] = r.spec_records
        return meta

    def _logprob_entries(self, pairs: list, text: bool) -> list:
        """SGLang's ``[logprob, token_id, text | None]`` entries."""
        return [[lp, t, self._decode([t]) if text else None] for lp, t in pairs]

    def _position_entries(self, rows: list, text: bool) -> list:
        """Per position: None (SGLang's first input position) or a list of entries."""
        return [None if row is None else self._logprob_entries(row, text) for row in rows]

    def _result(self, r: Request) -> dict:
        return {"text": self._text(r), "output_ids": list(r.output_ids), "meta_info": self._meta(r)}

    def _validate(self, body: Any) -> GenerateInput:
        return validate_generate(body, self.limits, self._tokenize)

    async def _submit(self, gi: GenerateInput, on_update: Callable[[int, Request], None]) -> list[Request]:
        """Hand a validated batch to the engine thread; never touches the engine lock."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def resolve(reqs, err):
            if fut.done():  # the handler is gone (client disconnected): drop its requests
                for r in reqs or []:
                    r.aborted = True
                return
            fut.set_exception(err) if err is not None else fut.set_result(reqs)

        sub = Submission(gi, on_update, loop, resolve)
        self.worker.submit(sub)
        try:
            return await fut
        except asyncio.CancelledError:
            sub.cancelled = True
            for r in sub.reqs:
                r.aborted = True
            self.worker.wake()
            raise

    def _abort_own(self, reqs: list[Request]) -> None:
        hit = False
        for r in reqs:
            if not r.finished:
                r.aborted = True
                hit = True
        if hit:
            self.worker.wake()

    async def _run_blocking(self, request: HTTPRequest, gi: GenerateInput) -> list[Request]:
        """Submit and wait for all sequences; a client that disconnects has them aborted."""
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        reqs_box: list[Request] = []

        def on_update(i, r):
            if r.finished:
                _call_in_loop(loop, _check_done)

        def _check_done():
            if reqs_box and all(r.finished for r in reqs_box):
                done.set()

        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            reqs = await self._submit(gi, on_update)
            reqs_box.extend(reqs)
            _check_done()
            waiter = asyncio.ensure_future(done.wait())
            await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not done.is_set():  # the client left
                waiter.cancel()
                self._abort_own(reqs)
                log.info("client disconnected: aborted %d request(s)", sum(not r.finished for r in reqs))
            return reqs
        finally:
            watcher.cancel()
            self.worker.forget(reqs_box)

    async def _stream(self, reqs: list[Request], queue: asyncio.Queue, fmt: Optional[Callable] = None):
        """SSE: one event per change, from engine-thread snapshots; the finished snapshot of every
        sequence is sent before ``[DONE]``. A client that disconnects has its requests aborted."""
        pending = set(range(len(reqs)))
        sent: dict[int, int] = {}
        try:
            while pending:
                i, s = await queue.get()
                if i not in pending:
                    continue
                every = getattr(s, "stream_interval", 1)  # SGLang's stream_interval: tokens per event
                if s.finished or len(s.output_ids) >= sent.get(i, 0) + every:
                    sent[i] = len(s.output_ids)
                    payload = self._result(s) | {"index": i} if fmt is None else fmt(i, s)
                    if payload is not None:
                        yield f"data: {json.dumps(payload)}\n\n"
                if s.finished:
                    pending.discard(i)
            yield "data: [DONE]\n\n"
        finally:
            self._release(reqs)

    def _release(self, reqs: list[Request]) -> None:
        self._abort_own(reqs)
        self.worker.forget(reqs)

    # ------------------------------------------------------------------ weights
    def _prepare_tensors(self, tensors: dict) -> dict:
        """Cast every tensor to the dtype of the parameter it will replace, then check that it
        is finite *after* the cast (float64 1e300 becomes inf in float32); refuse dtypes that
        are not weights (float8, integers). Unknown names are left to the model's validation."""
        model = self.engine.model
        by_hf = {v: k for k, v in model.hf_state_dict_names().items()}
        params = dict(model.named_parameters())
        out = {}
        for n, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise BadRequest(f"tensor {n}: not a tensor")
            if n not in by_hf:
                out[n] = t
                continue
            if t.dtype not in WEIGHT_DTYPES:
                raise BadRequest(f"weight update rejected, nothing changed: tensor {n} has dtype {t.dtype}; "
                                 f"supported: float16, bfloat16, float32, float64")
            p = params[by_hf[n]]
            if tuple(t.shape) != tuple(p.shape):
                raise BadRequest(f"weight update rejected, nothing changed: tensor {n}: shape {tuple(t.shape)} "
                                 f"!= expected {tuple(p.shape)}")
            c = t.to(dtype=p.dtype)
            if not bool(torch.isfinite(c).all()):
                raise BadRequest(f"weight update rejected, nothing changed: tensor {n} is not finite "
                                 f"in the model's dtype {p.dtype}")
            out[n] = c
        return out

    def _stage_weights(self, tensors: dict, version) -> dict:
        """Hold a validated bucket until the sync's last (unstaged) call applies everything at
        once: a sync interrupted midway leaves the served weights untouched. Buckets staged for
        another version (an abandoned sync) are dropped."""
        if not isinstance(version, str) or not version:
            raise BadRequest("staged weight buckets need stage_version (the version the sync will commit)")
        tensors = self._prepare_tensors(tensors)
        try:
            self.engine.model.validate_hf_tensors(tensors)
        except ValueError as e:
            raise BadRequest(f"weight bucket rejected: {e}") from e
        if self._staged_version != version:
            self._staged, self._staged_version = {}, version
        self._staged.update(tensors)
        return {"success": True, "message": f"staged {len(tensors)} tensors", "num_paused_requests": 0,
                "staged": len(tensors), "staged_total": len(self._staged), "weight_version": version}

    def _apply_weights(self, tensors: dict, version, flush: bool = True, abort_all: bool = False) -> dict:
        """Swap weights between engine steps: trunk and MTP heads move together (one lock), so
        no step ever runs on a mix; KV computed under the old weights is re-prefilled (or, with
        ``abort_all``, the requests in flight are aborted first, as SGLang's
        ``abort_all_requests``). Buckets staged for this version are applied in the same swap;
        all tensors are cast and validated first. Runs in a worker thread."""
        if version is not None and not isinstance(version, (str, int, float)):
            raise BadRequest("weight_version must be a string")
        if self._staged and self._staged_version == version:
            tensors = {**self._staged, **tensors}
        self._staged, self._staged_version = {}, None
        tensors = self._prepare_tensors(tensors)
        with self.engine.lock:
            try:
                self.engine.model.validate_hf_tensors(tensors)
            except ValueError as e:
                raise BadRequest(f"weight update rejected, nothing changed: {e}") from e
            paused = 0
            if abort_all:
                paused = self.engine.abort(None)
                self.engine.step()  # reaps the aborted requests (no compute)
            try:
                loaded = self.engine.update_weights(tensors, version)
            except (ValueError, TypeError, RuntimeError) as e:
                raise BadRequest(f"weight update rejected: {e}") from e
            if flush:
                paused += self.engine.retract_all()
        self.worker.wake()
        mtp = [n for n in loaded if n.startswith("mtp.") or _is_deepseek_mtp(n, self.engine.model)]
        return {"success": True, "message": f"updated {len(loaded)} tensors ({len(mtp)} MTP)",
                "num_paused_requests": paused, "num_tensors": len(loaded), "num_mtp_tensors": len(mtp),
                "weight_version": self.engine.weight_version}

    def _load_from_disk(self, path: str) -> dict:
        """Read ``*.safetensors`` of a folder after checking every file: regular files only (a
        FIFO, device, folder or dangling/looping symlink is refused before any read), non-empty,
        opened non-blocking. Runs in a worker thread."""
        from safetensors.torch import load_file

        p = Path(path)
        try:
            if not stat.S_ISDIR(os.stat(p).st_mode):
                raise BadRequest(f"model_path {path!r} is not a folder")
            names = sorted(e.name for e in os.scandir(p) if e.name.endswith(".safetensors"))
        except OSError as e:
            raise BadRequest(f"model_path {_short_path(path)}: {e.strerror or e}") from e
        if not names:
            raise BadRequest(f"{_short_path(path)}: no *.safetensors files")
        files = []
        for name in names:
            f = p / name
            try:
                st = os.stat(f)  # follows symlinks: dangling or looping ones raise here
            except OSError as e:
                raise BadRequest(f"{name}: {e.strerror or e}") from e
            if not stat.S_ISREG(st.st_mode):
                raise BadRequest(f"{name}: not a regular file")
            if st.st_size < 8:
                raise BadRequest(f"{name}: empty or truncated safetensors file ({st.st_size} bytes)")
            try:  # a file swapped for a FIFO after the check must not block: open non-blocking, re-check
                fd = os.open(f, os.O_RDONLY | os.O_NONBLOCK)
                try:
                    if not stat.S_ISREG(os.fstat(fd).st_mode):
                        raise BadRequest(f"{name}: not a regular file")
                finally:
                    os.close(fd)
            except OSError as e:
                raise BadRequest(f"{name}: {e.strerror or e}") from e
            files.append(f)
        tensors: dict = {}
        for f in files:
            try:
                tensors.update(load_file(str(f)))
            except Exception as e:  # noqa: BLE001 - corrupt header, unsupported dtype...
                raise BadRequest(f"cannot read {f.name} as safetensors: {type(e).__name__}: {e}") from e
        return tensors

    def _weights_guard(self) -> asyncio.Lock:
        if self._weights_lock is None:
            self._weights_lock = asyncio.Lock()
        return self._weights_lock

    # ------------------------------------------------------------------ app
    def _build_app(self) -> FastAPI:
        """The FastAPI app: the ASGI guard (body limits, API key), JSON error handlers, the routes
        (rollout/routes.py, plain functions over ``app.state.server``) and SGLang's distributed
        weight-update routes (/init_weights_update_group, /update_weights_from_distributed,
        /destroy_weights_update_group)."""
        from bebop_megatron.rollout.routes import install_error_handlers, router
        from bebop_megatron.rollout.weight_update_group import register_routes

        app = FastAPI(title="bebop serve (SGLang-compatible)")
        app.state.server = self
        app.add_middleware(_Guard, server=self)
        install_error_handlers(app)
        app.include_router(router)
        register_routes(app, self)
        return app

    def _completion_input(self, body: dict) -> GenerateInput:
        """OpenAI ``/v1/completions`` -> the same validated input as ``/generate``."""
        p = body.get("prompt")
        if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(x, str) for x in p)):
            key = "text"
        elif isinstance(p, list):
            key = "input_ids"
        else:
            raise BadRequest("prompt must be a string, a list of strings, a list of token ids or a list of such lists")
        d = openai_api.sampling_from(body)
        d["max_new_tokens"] = 16 if body.get("max_tokens") is None else body["max_tokens"]
        if d["max_new_tokens"] == 0:
            raise BadRequest("max_tokens must be at least 1")
        lp = body.get("logprobs")
        top = 0
        if lp is not None and lp is not False:
            top = as_int(lp, "logprobs", 0, openai_api.MAX_TOP_LOGPROBS)  # OpenAI: the number of top logprobs
        echo = False if body.get("echo") is None else as_bool(body.get("echo"), "echo")
        stream = False if body.get("stream") is None else as_bool(body.get("stream"), "stream")
        gen = {key: p, "sampling_params": d, "return_logprob": lp is not None and lp is not False, "stream": stream}
        if top:
            gen["top_logprobs_num"] = top
        if echo and gen["return_logprob"]:
            gen["logprob_start_len"] = 0  # the prompt's logprobs too (the first is null)
        return self._validate(gen)

    def _openai_response(self, body: dict, gi: GenerateInput, reqs: list[Request], choices: list, obj: str,
                         prefix: str) -> dict:
        model = body.get("model")
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
                "model": model if isinstance(model, str) else self.served_model_name, "choices": choices,
                "usage": self._usage(gi, reqs)}

    @staticmethod
    def _usage(gi: GenerateInput, reqs: list[Request]) -> dict:
        ptoks = sum(len(p) for p in {id(p): p for p in gi.prompts}.values())  # each prompt once (n > 1)
        ctoks = sum(len(r.output_ids) for r in reqs)
        return {"prompt_tokens": ptoks, "completion_tokens": ctoks, "total_tokens": ptoks + ctoks}

    async def _stream_openai(self, body: dict, gi: GenerateInput, chat: bool) -> StreamingResponse:
        """OpenAI streaming (completions or chat): text deltas per choice (chat: a first delta with
        the role), finish_reason and matched_stop on the last chunk of each choice, an optional
        usage chunk (``stream_options.include_usage``), then [DONE]."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        reqs = await self._submit(gi, lambda i, r: loop.call_soon_threadsafe(queue.put_nowait, (i, _snapshot(r))))
        cid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        model = body.get("model") if isinstance(body.get("model"), str) else self.served_model_name
        opts = body.get("stream_options")
        usage = isinstance(opts, dict) and opts.get("include_usage") is True
        sent_text: dict[int, str] = {}
        sent_tokens: dict[int, int] = {}

        def chunk(i, s):
            text = self._text(s) if s.finished else self._decode(s.output_ids)
            first = i not in sent_text
            prev = sent_text.get(i, "")
            delta = text[len(prev):] if text.startswith(prev) else ""
            sent_text[i] = text if text.startswith(prev) else prev
            kind, matched = openai_api.finish(s) if s.finished else (None, None)
            if not delta and not s.finished and not (chat and first):
                return None
            choice: dict[str, Any] = {"index": i, "logprobs": None, "finish_reason": kind, "matched_stop": matched}
            if chat:
                choice["delta"] = {"role": "assistant", "content": delta} if first else {"content": delta}
                if s.return_logprob:
                    choice["logprobs"] = openai_api.chat_logprobs(s, self._decode, sent_tokens.get(i, 0))
                    sent_tokens[i] = len(s.output_ids)
            else:
                choice["text"] = delta
            return {"id": cid, "object": obj, "created": created, "model": model, "choices": [choice]}

        async def events():
            async for ev in self._stream(reqs, queue, chunk):
                if ev == "data: [DONE]\n\n" and usage:
                    yield "data: " + json.dumps({"id": cid, "object": obj, "created": created, "model": model,
                                                 "choices": [], "usage": self._usage(gi, reqs)}) + "\n\n"
                yield ev

        return StreamingResponse(events(), media_type="text/event-stream", background=BackgroundTask(self._release, reqs))


def _hf_identity(model_path: str) -> tuple[Optional[str], Optional[list]]:
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
        return cfg.get("model_type"), cfg.get("architectures")
    except (OSError, ValueError, TypeError):
        return None, None


def _short_path(p: str) -> str:
    return repr(p) if len(p) <= 80 else repr(p[:60]) + f"...({len(p)} chars)"


def _is_deepseek_mtp(name: str, model: CausalLMWithMTP) -> bool:
    if not name.startswith("model.layers."):
        return False
    return int(name.split(".")[2]) >= model.config.num_hidden_layers


async def _json_object(request: HTTPRequest, allow_empty: bool = False, offload: bool = False) -> dict:
    """The body as a JSON object: size-limited (by the guard), bounded depth and numbers, 4xx on
    anything else. ``offload`` parses in a worker thread (large weight payloads)."""
    raw = await request.body()
    if offload and len(raw) > (1 << 20):
        return await asyncio.to_thread(parse_json_object, raw, allow_empty)
    return parse_json_object(raw, allow_empty)


async def _wait_disconnect(request: HTTPRequest) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while True:
        msg = await request.receive()
        if msg.get("type") == "http.disconnect":
            return


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
    p.add_argument("--api-key", default=None,
                   help="visible in /proc/PID/cmdline: prefer --api-key-file or the BEBOP_API_KEY variable")
    p.add_argument("--api-key-file", default=None, help="file holding the API key (first line)")
    p.add_argument("--max-body-mb", type=float, default=MAX_BODY_BYTES / 2**20,
                   help="request body limit (413 beyond), all routes but /update_weights_from_tensor")
    p.add_argument("--max-weight-body-mb", type=float, default=MAX_WEIGHT_BODY_BYTES / 2**20,
                   help="request body limit of /update_weights_from_tensor")
    p.add_argument("--speculative-algorithm", default=None, help="NEXTN | EAGLE | MTP (MTP heads) or none")
    p.add_argument("--speculative-num-steps", type=int, default=3, help="γ drafts per verify step")
    p.add_argument("--speculative-eagle-topk", type=int, default=1)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None, help="= steps + 1 for topk 1")
    p.add_argument("--speculative-use-rejection-sampling", action="store_true", default=True)
    p.add_argument("--speculative-verify", default="rejection", choices=["rejection", "target_only"])
    p.add_argument("--speculative-adaptive", action="store_true",
                   help="bebop: choose γ per round (0..num-steps) from measured round costs and acceptance, so "
                        "speculation is not slower than plain decoding at large batches (SGLang: fixed γ)")
    p.add_argument("--speculative-token-map", default=None, metavar="PATH",
                   help="reduced-vocabulary draft (FR-Spec): a .pt (or .json) list of the token ids the MTP draft "
                        "may propose; verification stays exact against the full vocabulary")
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--context-length", type=int, default=2048)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.add_argument("--device", default="cpu", help="where the model and the engine run: cpu, cuda, cuda:1, ...")


def build_server(args) -> BebopServer:
    algo = (args.speculative_algorithm or "none").lower()
    if args.speculative_eagle_topk != 1:
        raise SystemExit("bebop serve: only --speculative-eagle-topk 1 (chain drafts) is supported")
    if args.speculative_num_draft_tokens is not None and args.speculative_num_draft_tokens != args.speculative_num_steps + 1:
        raise SystemExit("bebop serve: --speculative-num-draft-tokens must be --speculative-num-steps + 1")
    model = CausalLMWithMTP.from_pretrained(args.model_path, dtype=getattr(torch, args.dtype),
                                            device=getattr(args, "device", "cpu"))
    token_map = getattr(args, "speculative_token_map", None)
    if token_map and not Path(token_map).is_file():
        raise SystemExit(f"bebop serve: --speculative-token-map {token_map}: no such file")
    spec = SpecConfig("mtp" if algo in ("nextn", "eagle", "mtp") else "none", args.speculative_num_steps,
                      args.speculative_verify, draft_vocab=token_map or None,
                      adaptive=bool(getattr(args, "speculative_adaptive", False)))
    engine = Engine(model, load_tokenizer_for(args.model_path, args.tokenizer), spec,
                    max_running=args.max_running_requests, max_len=args.context_length,
                    weight_version=args.weight_version)
    server = BebopServer(engine, args.model_path, api_key=resolve_api_key(args),
                          max_body=int(getattr(args, "max_body_mb", MAX_BODY_BYTES / 2**20) * 2**20),
                          max_weight_body=int(getattr(args, "max_weight_body_mb", MAX_WEIGHT_BODY_BYTES / 2**20) * 2**20))
    if algo in ("nextn", "eagle", "mtp"):
        server.spec_algorithm_name = "NEXTN" if algo == "mtp" else algo.upper()
    return server


def resolve_api_key(args) -> Optional[str]:
    """``--api-key``, else ``--api-key-file`` (first line), else ``$BEBOP_API_KEY``; None: no key."""
    if getattr(args, "api_key", None):
        return args.api_key
    path = getattr(args, "api_key_file", None)
    if path:
        try:
            key = Path(path).read_text().splitlines()[0].strip() if Path(path).stat().st_size else ""
        except (OSError, IndexError) as e:
            raise SystemExit(f"bebop serve: cannot read --api-key-file {path}: {e}") from e
        if not key:
            raise SystemExit(f"bebop serve: --api-key-file {path} is empty")
        return key
    return os.environ.get("BEBOP_API_KEY") or None


def serve(args) -> None:
    import uvicorn

    server = build_server(args)
    # the engine thread runs Python between torch ops: hand the GIL to the event loop more often
    # (default 5 ms per hand-off), so that /health and aborts answer in milliseconds under load
    sys.setswitchinterval(0.001)
    # Everything alive now (torch, fastapi, the model: ~190k objects) lives as long as the server.
    # Freezing it out of the cyclic GC keeps a full collection from scanning it: unfrozen, one takes
    # ~180 ms here, a stall of the event loop that set /health's p99 under load.
    gc.collect()
    gc.freeze()
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("binding %s: the server is reachable beyond this machine%s", args.host,
                    "" if server.api_key else " and has no API key")
    log.info("bebop serve on http://%s:%d (speculative: %s, γ=%d%s)", args.host, args.port,
             server.engine.spec.algorithm, server.engine.gamma, ", adaptive" if server.engine.spec.adaptive else "")
    try:
        uvicorn.run(server.app, host=args.host, port=args.port, log_level="warning", timeout_keep_alive=30)
    finally:
        server.worker.stop()
