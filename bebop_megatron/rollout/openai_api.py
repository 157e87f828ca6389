"""OpenAI-compatible bodies for ``bebop serve`` (``/v1/completions``, ``/v1/chat/completions``),
shaped as SGLang 0.5.23's OpenAI layer returns them: ``finish_reason`` plus SGLang's
``matched_stop`` (the stop token id or stop string) per choice, completions ``logprobs``
(``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``) and chat ``logprobs.content``
entries (``token``, ``bytes``, ``logprob``, ``top_logprobs``).

Requests are mapped onto the native ``/generate`` body, so one validator (validation.py) checks
every field."""

from __future__ import annotations

from typing import Any, Callable, Optional

from bebop_megatron.rollout.validation import BadRequest, as_bool, as_int, as_str

MAX_MESSAGES = 1024
MAX_MESSAGE_CHARS = 1 << 20
MAX_TOP_LOGPROBS = 20  # OpenAI's bound
# OpenAI / SGLang request field -> sampling_params field
SAMPLING_FIELDS = (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"),
                   ("n", "n"), ("stop", "stop"), ("seed", "sampling_seed"), ("stop_token_ids", "stop_token_ids"),
                   ("ignore_eos", "ignore_eos"), ("no_stop_trim", "no_stop_trim"),
                   ("frequency_penalty", "frequency_penalty"), ("presence_penalty", "presence_penalty"),
                   ("repetition_penalty", "repetition_penalty"), ("min_tokens", "min_new_tokens"),
                   ("logit_bias", "logit_bias"), ("stop_regex", "stop_regex"),
                   ("skip_special_tokens", "skip_special_tokens"))


def sampling_from(body: dict) -> dict:
    return {dst: body[src] for src, dst in SAMPLING_FIELDS if body.get(src) is not None}


def finish(r) -> tuple[Optional[str], Any]:
    """OpenAI finish_reason and SGLang's matched_stop for a (finished) request."""
    fr = r.finish_reason or {}
    kind = fr.get("type")
    return kind, (fr.get("matched") if kind == "stop" else None)


def chat_prompt(tokenizer, messages: Any) -> list[int]:
    """Token ids of ``messages`` under the tokenizer's chat template (generation prompt added)."""
    if not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES:
        raise BadRequest(f"messages must be a non-empty list of at most {MAX_MESSAGES} messages")
    msgs = []
    for m in messages:
        if not isinstance(m, dict):
            raise BadRequest("each message must be an object with role and content")
        role = as_str(m.get("role"), "messages[].role", 64, allow_empty=False)
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: text only
            parts = []
            for p in content:
                if not isinstance(p, dict) or p.get("type") != "text":
                    raise BadRequest("only text content parts are supported")
                parts.append(as_str(p.get("text"), "messages[].content[].text", MAX_MESSAGE_CHARS))
            content = "".join(parts)
        elif content is None:
            content = ""
        msgs.append({"role": role, "content": as_str(content, "messages[].content", MAX_MESSAGE_CHARS)})
    if tokenizer is None or not hasattr(tokenizer, "apply_chat_template") or not getattr(tokenizer, "chat_template", None):
        raise BadRequest("the served tokenizer has no chat template: /v1/chat/completions is unavailable "
                         "(use /v1/completions or /generate, or serve a tokenizer that defines chat_template)")
    try:
        ids = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - a template error is the request's fault
        raise BadRequest(f"the chat template failed on these messages: {e}") from None
    if hasattr(ids, "keys") and "input_ids" in ids:  # BatchEncoding (newer transformers)
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def chat_generate_body(body: dict, tokenizer, context_length: int) -> dict:
    """``/v1/chat/completions`` -> a native ``/generate`` body."""
    ids = chat_prompt(tokenizer, body.get("messages"))
    d = sampling_from(body)
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    if mt is not None:
        d["max_new_tokens"] = as_int(mt, "max_completion_tokens", 1, context_length)
    else:  # OpenAI: up to the context length
        d["max_new_tokens"] = max(1, context_length - len(ids))
    lp = False if body.get("logprobs") is None else as_bool(body.get("logprobs"), "logprobs")
    top = 0 if body.get("top_logprobs") is None else as_int(body.get("top_logprobs"), "top_logprobs", 0,
                                                              MAX_TOP_LOGPROBS)
    if top and not lp:
        raise BadRequest("top_logprobs needs logprobs: true")
    stream = False if body.get("stream") is None else as_bool(body.get("stream"), "stream")
    out = {"input_ids": ids, "sampling_params": d, "return_logprob": lp, "stream": stream}
    if top:
        out["top_logprobs_num"] = top
    return out


def completion_logprobs(r, decode: Callable[[list[int]], str], offset0: int = 0, echo_prompt: bool = False) -> dict:
    """OpenAI completions ``logprobs`` for one choice (prompt tokens first with ``echo``)."""
    pairs = list(zip(r.output_logprobs, r.output_ids))
    tops = list(r.output_top_logprobs) if r.top_logprobs_num else [None] * len(pairs)
    if echo_prompt and r.input_token_logprobs is not None:
        pairs = list(r.input_token_logprobs) + pairs
        tops = (list(r.input_top_logprobs) if r.top_logprobs_num and r.input_top_logprobs is not None
                else [None] * len(r.input_token_logprobs)) + tops
    tokens = [decode([t]) for _, t in pairs]
    offsets, pos = [], offset0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    out = {"tokens": tokens, "token_logprobs": [lp for lp, _ in pairs], "text_offset": offsets,
           "top_logprobs": None}
    if r.top_logprobs_num:
        out["top_logprobs"] = [None if row is None else {decode([t]): lp for lp, t in row} for row in tops]
    return out


def chat_logprobs(r, decode: Callable[[list[int]], str], start: int = 0) -> dict:
    """OpenAI chat ``logprobs`` (``content`` entries) for output tokens ``start`` onwards."""
    def entry(lp: float, t: int) -> dict:
        s = decode([t])
        return {"token": s, "bytes": list(s.encode("utf-8")), "logprob": lp}

    content = []
    for j in range(start, len(r.output_ids)):
        e = entry(r.output_logprobs[j], r.output_ids[j])
        e["top_logprobs"] = [entry(lp, t) for lp, t in r.output_top_logprobs[j]] if r.top_logprobs_num else []
        content.append(e)
    return {"content": content}
