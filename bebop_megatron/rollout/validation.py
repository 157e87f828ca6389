"""One request validator in front of the engine (``bebop serve``).

Everything a client sends is parsed and checked here, with bounded sizes, depths, integers and
floats, before anything reaches the engine: a bad request fails alone with a 4xx, and the engine
never sees a value it could choke on (a 2^64 seed, a 400-digit temperature, ``top_k`` 2^63, a
denormal temperature). The rules follow SGLang 0.5.23's ``SamplingParams.verify`` and
``GenerateReqInput`` (field names, ranges, defaults), with these bebop bounds on top:

* JSON: at most ``MAX_JSON_DEPTH`` levels of nesting, integers of at most ``MAX_INT_DIGITS``
  digits, and (checked by the server before parsing) a body-size limit;
* ``temperature`` below ``SAMPLING_EPS`` (SGLang's ``_SAMPLING_EPS``) means greedy, as in SGLang;
  above ``MAX_TEMPERATURE`` is refused;
* ``top_k`` of at least the vocabulary size means "off" (SGLang's ``TOP_K_ALL``), beyond int64 is refused;
* ``sampling_seed`` (``seed`` is accepted as an alias) must lie in SGLang's [-2^63, 2^63 - 1].
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import regex

from bebop_megatron.rollout.engine import SamplingParams

MAX_JSON_DEPTH = 32
MAX_INT_DIGITS = 40  # 2^64 has 20 digits: larger is still refused with a clear message, never parsed further
MAX_FLOAT_CHARS = 64
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
SAMPLING_EPS = 1e-6  # SGLang's _SAMPLING_EPS: temperatures below it are greedy
MAX_TEMPERATURE = 1e6
MAX_N = 64
MAX_BATCH = 1024
MAX_RID_CHARS = 256
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_SPEC_RECORDS = 64

SUPPORTED_SAMPLING = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
                      "ignore_eos", "n", "seed", "sampling_seed", "no_stop_trim", "skip_special_tokens",
                      "spaces_between_special_tokens", "frequency_penalty", "presence_penalty",
                      "repetition_penalty", "min_new_tokens", "logit_bias", "stop_regex"}
# accepted only at their neutral values (the embedded engine does not implement them)
NEUTRAL_SAMPLING = {"regex": None, "json_schema": None, "ebnf": None,
                    "structural_tag": None, "beam_width": None, "watermark": None}
# accepted with SGLang's semantics: custom_params feed custom logit processors (none here, e.g.
# slime's {"return_top_p_token_ids": true} changes nothing); stream_interval spaces SSE events
ACCEPTED_SAMPLING = {"custom_params", "stream_interval"}
MAX_STOP_REGEX_COUNT = 32  # SGLang's limits
MAX_STOP_REGEX_BYTES = 256
MAX_LOGIT_BIAS = 1e6
MAX_TOP_LOGPROBS = 1024
MAX_TOKEN_IDS_LOGPROB = 1024
MAX_STREAM_INTERVAL = 1 << 20


class BadRequest(Exception):
    """A client error: answered with ``status`` (4xx) and a JSON error body."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


# --------------------------------------------------------------------------- JSON


def _parse_int(s: str) -> int:
    if len(s) - (s[0] == "-") > MAX_INT_DIGITS:
        raise BadRequest(f"integer with {len(s)} digits: at most {MAX_INT_DIGITS} are accepted")
    return int(s)


def _parse_float(s: str) -> float:
    if len(s) > MAX_FLOAT_CHARS:
        raise BadRequest(f"number literal of {len(s)} characters: at most {MAX_FLOAT_CHARS} are accepted")
    return float(s)  # may be inf ("1e999"): the field checks refuse non-finite values


def _check_depth(obj: Any, max_depth: int) -> None:
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, (list, dict)):
            if d > max_depth:
                raise BadRequest(f"JSON nested deeper than {max_depth} levels")
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))


def parse_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse a request body with bounded nesting and number sizes; BadRequest on anything else."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"the body is not UTF-8: {e}") from e
    try:
        obj = json.loads(text, parse_int=_parse_int, parse_float=_parse_float)
    except BadRequest:
        raise
    except RecursionError as e:
        raise BadRequest(f"JSON nested deeper than {max_depth} levels") from e
    except (ValueError, TypeError) as e:  # JSONDecodeError is a ValueError
        raise BadRequest(f"invalid JSON: {e}") from e
    _check_depth(obj, max_depth)
    return obj


def parse_json_object(raw: bytes, allow_empty: bool = False) -> dict:
    if not raw.strip():
        if allow_empty:
            return {}
        raise BadRequest("empty body: a JSON object is required")
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


# --------------------------------------------------------------------------- scalar fields


def as_int(v: Any, name: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{name} must be an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise BadRequest(f"{name} must be in [{lo}, {hi}], got {_short(v)}")
    return v


def as_float(v: Any, name: str, lo: float, hi: float, lo_open: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest(f"{name} must be a number, got {type(v).__name__}")
    try:
        f = float(v)
    except OverflowError:
        raise BadRequest(f"{name} is out of range: {_short(v)}") from None
    if not math.isfinite(f):
        raise BadRequest(f"{name} must be a finite number, got {_short(v)}")
    if f < lo or f > hi or (lo_open and f == lo):
        raise BadRequest(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {_short(v)}")
    return f


def as_bool(v: Any, name: str) -> bool:
    if not isinstance(v, bool):
        raise BadRequest(f"{name} must be true or false, got {type(v).__name__}")
    return v


def as_str(v: Any, name: str, max_len: int, allow_empty: bool = True) -> str:
    if not isinstance(v, str):
        raise BadRequest(f"{name} must be a string, got {type(v).__name__}")
    if len(v) > max_len or (not allow_empty and not v):
        raise BadRequest(f"{name} must be a {'non-empty ' if not allow_empty else ''}string of at most {max_len} characters")
    return v


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:20] + f"...({len(s)} chars)"


# --------------------------------------------------------------------------- sampling


@dataclass
class Limits:
    vocab_size: int
    context_length: int
    max_n: int = MAX_N
    max_batch: int = MAX_BATCH


def validate_sampling(d: Any, limits: Limits, where: str = "sampling_params") -> tuple[SamplingParams, int]:
    """A SamplingParams the engine can always serve, and n; BadRequest otherwise."""
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise BadRequest(f"{where} must be an object")
    unknown = set(d) - SUPPORTED_SAMPLING - set(NEUTRAL_SAMPLING) - ACCEPTED_SAMPLING
    if unknown:
        raise BadRequest(f"unknown {where}: {sorted(unknown)[:10]}")
    for k, neutral in NEUTRAL_SAMPLING.items():
        if k in d and d[k] is not None and d[k] != neutral and not (isinstance(neutral, float) and _num_eq(d[k], neutral)):
            raise BadRequest(f"{where}.{k}={_short(d[k])} is not supported by the embedded engine")
    g = lambda k: d.get(k)  # noqa: E731  (None = SGLang's default)
    if g("custom_params") is not None and not isinstance(g("custom_params"), dict):
        raise BadRequest(f"{where}.custom_params must be an object")
    bias = g("logit_bias")
    nonzero: dict[int, float] = {}
    if bias is not None:
        if not isinstance(bias, dict) or len(bias) > limits.vocab_size:
            raise BadRequest(f"{where}.logit_bias must be an object of token id -> bias")
        for tid, b in bias.items():
            try:
                t = int(tid)
            except ValueError:
                raise BadRequest(f"{where}.logit_bias keys must be token ids, got {_short(tid)}") from None
            if not 0 <= t < limits.vocab_size:
                raise BadRequest(f"{where}.logit_bias must have keys in [0, {limits.vocab_size - 1}], got {_short(tid)}")
            b = as_float(b, f"{where}.logit_bias[{tid}]", -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
            if b != 0.0:
                nonzero[t] = b
    sp = SamplingParams()
    sp.logit_bias = nonzero or None
    for k in ("frequency_penalty", "presence_penalty"):
        if g(k) is not None:
            setattr(sp, k, as_float(g(k), f"{where}.{k}", -2.0, 2.0))
    if g("repetition_penalty") is not None:
        sp.repetition_penalty = as_float(g("repetition_penalty"), f"{where}.repetition_penalty", 0.0, 2.0,
                                         lo_open=True)
    patterns = g("stop_regex")
    if patterns is not None:
        patterns = [patterns] if isinstance(patterns, str) else patterns
        if not isinstance(patterns, list) or len(patterns) > MAX_STOP_REGEX_COUNT:
            raise BadRequest(f"{where}.stop_regex must be a string or a list of at most {MAX_STOP_REGEX_COUNT} "
                             "strings")
        for pat in patterns:
            as_str(pat, f"{where}.stop_regex[]", MAX_STOP_REGEX_BYTES, allow_empty=False)
            if len(pat.encode("utf-8")) > MAX_STOP_REGEX_BYTES:
                raise BadRequest(f"{where}.stop_regex is over the {MAX_STOP_REGEX_BYTES}-byte limit")
            try:
                re.compile(pat)
                regex.compile(pat)  # the engine searches with ``regex`` (it has a timeout)
            except (re.error, regex.error, RecursionError, OverflowError, ValueError) as e:
                raise BadRequest(f"{where}.stop_regex {_short(pat)} is not a valid regular expression: {e}") from None
        sp.stop_regex = list(patterns)
    n = 1 if g("n") is None else as_int(g("n"), f"{where}.n", 1, limits.max_n)
    if g("max_new_tokens") is not None:
        sp.max_new_tokens = as_int(g("max_new_tokens"), f"{where}.max_new_tokens", 0, limits.context_length)
    if g("temperature") is not None:
        sp.temperature = as_float(g("temperature"), f"{where}.temperature", 0.0, MAX_TEMPERATURE)
        if sp.temperature < SAMPLING_EPS:
            sp.temperature = 0.0  # greedy (SGLang: temperature < _SAMPLING_EPS -> top_k 1)
    if g("top_p") is not None:
        sp.top_p = as_float(g("top_p"), f"{where}.top_p", 0.0, 1.0, lo_open=True)
    if g("top_k") is not None:
        k = as_int(g("top_k"), f"{where}.top_k", -1, INT64_MAX)
        if k == 0:
            raise BadRequest(f"{where}.top_k must be -1 (disable) or at least 1, got 0")
        sp.top_k = -1 if k >= limits.vocab_size else k  # SGLang's TOP_K_ALL: the whole vocabulary
    if g("min_p") is not None:
        sp.min_p = as_float(g("min_p"), f"{where}.min_p", 0.0, 1.0)
        if sp.min_p >= 1.0:
            sp.min_p = 1.0 - 1e-12  # min_p 1 (SGLang accepts it) keeps only the top token(s)
    for k in ("ignore_eos", "no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens"):
        if g(k) is not None:
            v = as_bool(g(k), f"{where}.{k}")
            if hasattr(sp, k):
                setattr(sp, k, v)
    if g("min_new_tokens") is not None:
        sp.min_new_tokens = as_int(g("min_new_tokens"), f"{where}.min_new_tokens", 0, sp.max_new_tokens)
    seed = g("sampling_seed") if g("sampling_seed") is not None else g("seed")
    if seed is not None:
        sp.seed = as_int(seed, f"{where}.sampling_seed", INT64_MIN, INT64_MAX)
    stop = g("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS:
            raise BadRequest(f"{where}.stop must be a string or a list of at most {MAX_STOP_STRINGS} strings")
        sp.stop = [as_str(s, f"{where}.stop[]", MAX_STOP_CHARS) for s in stop]
        sp.stop = [s for s in sp.stop if s]  # SGLang ignores empty stop strings
    ids = g("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or len(ids) > MAX_STOP_TOKEN_IDS:
            raise BadRequest(f"{where}.stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids")
        # ids beyond the vocabulary can never be generated: harmless, but keep them bounded
        sp.stop_token_ids = sorted({as_int(t, f"{where}.stop_token_ids[]", 0, INT64_MAX) for t in ids})
    return sp, n


def _num_eq(v: Any, x: float) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < 1e300 and float(v) == x


def wrap_seed(seed: Optional[int], j: int) -> Optional[int]:
    """The seed of the j-th of n samples, kept in int64."""
    if seed is None:
        return None
    return (seed + j - INT64_MIN) % 2 ** 64 + INT64_MIN


# --------------------------------------------------------------------------- /generate


@dataclass
class GenerateInput:
    prompts: list[list[int]]
    params: list[SamplingParams]
    return_logprob: list[bool]
    rids: list[Optional[str]]
    single: bool
    stream: bool = False
    return_spec_records: int = 0
    stream_interval: list[int] = field(default_factory=list)  # per sequence (SGLang: tokens per SSE event)
    return_text_in_logprobs: bool = False
    extras: dict = field(default_factory=dict)
    # per sequence, SGLang's logprob options (see Engine.add_request)
    logprob_start_len: list[int] = field(default_factory=list)
    top_logprobs_num: list[int] = field(default_factory=list)
    token_ids_logprob: list[Optional[list[int]]] = field(default_factory=list)


def _listify(value: Any, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise BadRequest(f"{name} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


def validate_token_ids(ids: Any, name: str, limits: Limits) -> list[int]:
    if not isinstance(ids, list):
        raise BadRequest(f"{name} must be a list of token ids")
    if not ids:
        raise BadRequest(f"{name}: empty prompt, at least one token is required")
    if len(ids) > limits.context_length:
        raise BadRequest(f"{name}: {len(ids)} tokens exceed the context length {limits.context_length}")
    V = limits.vocab_size
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V:
            raise BadRequest(f"{name}: token ids must be integers in [0, {V}), got {_short(t)}")
    return ids


def validate_generate(body: Any, limits: Limits, tokenize: Callable[[str], list[int]]) -> GenerateInput:
    """SGLang's ``GenerateReqInput`` -> flat per-sequence prompts/params (n expanded)."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise BadRequest("give exactly one of text or input_ids")
    if text is not None:
        if isinstance(text, str):
            texts, single = [text], True
        elif isinstance(text, list) and all(isinstance(t, str) for t in text):
            texts, single = text, False
        else:
            raise BadRequest("text must be a string or a list of strings")
        if not texts:
            raise BadRequest("text is an empty list")
        if len(texts) > limits.max_batch:
            raise BadRequest(f"at most {limits.max_batch} prompts per request")
        prompts = [validate_token_ids(tokenize(t), "text (tokenized)", limits) for t in texts]
    else:
        if not isinstance(input_ids, list):
            raise BadRequest("input_ids must be a list of token ids or a list of such lists")
        single = len(input_ids) == 0 or not isinstance(input_ids[0], list)
        raw = [input_ids] if single else input_ids
        if len(raw) > limits.max_batch:
            raise BadRequest(f"at most {limits.max_batch} prompts per request")
        prompts = [validate_token_ids(p, "input_ids", limits) for p in raw]
    B = len(prompts)
    sps = _listify(body.get("sampling_params") or {}, B, "sampling_params")
    lps = [bool(x) if x is None else as_bool(x, "return_logprob")
           for x in _listify(body.get("return_logprob") or False, B, "return_logprob")]
    rid = body.get("rid")
    if rid is None:
        rids: list[Optional[str]] = [None] * B
    elif isinstance(rid, str):
        as_str(rid, "rid", MAX_RID_CHARS, allow_empty=False)
        rids = [rid] if B == 1 else [f"{rid}_{i}" for i in range(B)]  # SGLang: one rid for a batch
    elif isinstance(rid, list):
        rids = [as_str(r, "rid[]", MAX_RID_CHARS, allow_empty=False) for r in _listify(rid, B, "rid")]
        if len(set(rids)) != len(rids):
            raise BadRequest("duplicate rids in one batch")
    else:
        raise BadRequest("rid must be a string or a list of strings")
    stream = False if body.get("stream") is None else as_bool(body.get("stream"), "stream")
    spec_records = 0 if body.get("return_spec_records") is None else \
        as_int(body.get("return_spec_records"), "return_spec_records", 0, MAX_SPEC_RECORDS)
    out = GenerateInput([], [], [], [], single, stream, spec_records)
    rtl = body.get("return_text_in_logprobs")
    out.return_text_in_logprobs = False if rtl is None else as_bool(rtl, "return_text_in_logprobs")
    parsed = [validate_sampling(d, limits, "sampling_params" if not isinstance(body.get("sampling_params"), list)
                                else f"sampling_params[{i}]") for i, d in enumerate(sps)]
    if len({n for _, n in parsed}) > 1:
        raise BadRequest("all prompts of a batch must use the same n (SGLang's rule)")
    starts = [-1 if x is None else as_int(x, "logprob_start_len", -1, limits.context_length)
              for x in _listify(body.get("logprob_start_len"), B, "logprob_start_len")]
    for p, st in zip(prompts, starts):
        if st > len(p):
            raise BadRequest(f"logprob_start_len={st} is higher than the number of input tokens {len(p)}")
    tops = [0 if x is None else as_int(x, "top_logprobs_num", 0, min(limits.vocab_size, MAX_TOP_LOGPROBS))
            for x in _listify(body.get("top_logprobs_num"), B, "top_logprobs_num")]
    tids = body.get("token_ids_logprob")
    if tids is None or (isinstance(tids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in tids)):
        tids = [tids] * B  # one list (or none) for every prompt
    elif not isinstance(tids, list) or len(tids) != B:
        raise BadRequest("token_ids_logprob must be a list of token ids, or one such list per prompt")
    for t in tids:
        if t is not None:
            if not isinstance(t, list) or len(t) > MAX_TOKEN_IDS_LOGPROB:
                raise BadRequest(f"token_ids_logprob must list at most {MAX_TOKEN_IDS_LOGPROB} token ids")
            for x in t:
                as_int(x, "token_ids_logprob[]", 0, limits.vocab_size - 1)
    intervals = [1 if not isinstance(d, dict) or d.get("stream_interval") is None else
                 as_int(d["stream_interval"], "sampling_params.stream_interval", 1, MAX_STREAM_INTERVAL) for d in sps]
    for p, (sp, n), lp, r, si, st, tp, ti in zip(prompts, parsed, lps, rids, intervals, starts, tops, tids):
        if len(p) + sp.max_new_tokens > limits.context_length:
            raise BadRequest(f"prompt ({len(p)}) + max_new_tokens ({sp.max_new_tokens}) exceeds the context "
                             f"length {limits.context_length}")
        for j in range(n):
            spj = SamplingParams(**vars(sp))
            spj.stop, spj.stop_token_ids = list(sp.stop), list(sp.stop_token_ids)
            if n > 1:
                spj.seed = wrap_seed(sp.seed, j)
            out.prompts.append(p)
            out.params.append(spj)
            out.return_logprob.append(lp)
            out.stream_interval.append(si)
            out.logprob_start_len.append(st)
            out.top_logprobs_num.append(tp)
            out.token_ids_logprob.append(list(ti) if ti is not None else None)
            out.rids.append((r if n == 1 else f"{r}-{j}") if r is not None else None)
    if len(out.prompts) > limits.max_batch:
        raise BadRequest(f"at most {limits.max_batch} sequences (prompts x n) per request")
    out.single = single and len(out.prompts) == 1
    return out
