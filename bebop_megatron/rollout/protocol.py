"""The SGLang wire format in one place: what the RL client sends, how it reads the answers, and
how a rollout server is started.

Everything here is plain data (no HTTP, no torch): the rollout bridge, ``rl/rollout.py``, the
trainer's weight sync, ``bebop serve`` and both launchers build on it.

* **Requests.** :func:`sampling_params` and :func:`generate_request` build ``/generate`` bodies
  with SGLang's field names (``sampling_seed``, not ``seed``: SGLang >= 0.5 rejects unknown
  sampling fields). The weight-update bodies follow ``sglang/srt/managers/io_struct.py``
  (``UpdateWeightFromDiskReqInput``, ``InitWeightsUpdateGroupReqInput``,
  ``UpdateWeightsFromDistributedReqInput``, ...). Fields only ``bebop serve`` reads are listed in
  :data:`BEBOP_EXTENSIONS`; SGLang ignores unknown top-level keys of these bodies.
  ``tests/test_sglang_types.py`` checks every body against SGLang 0.5.23's own types.
* **Weight transports.** ``update_weights_from_disk`` (a shared file system) and
  ``init_weights_update_group`` + ``update_weights_from_distributed`` (a torch.distributed group,
  NCCL on GPUs, gloo on CPUs, the trainer's rank 0 broadcasting) work with real SGLang and with
  ``bebop serve``. Our ``update_weights_from_tensor`` with ``load_format: "safetensors"``
  (base64 safetensors, never pickles) is a ``bebop serve`` extension: SGLang's own
  ``update_weights_from_tensor`` carries pickled ``MultiprocessingSerializer`` tensors (CUDA IPC
  handles), which only work for an engine co-located with the trainer; we never send those.
* **Speculative metrics.** SGLang renamed the accepted/proposed draft counters twice; the writer
  (:func:`spec_meta_info`) emits every spelling, the reader (:func:`parse_spec_metrics`, via
  :func:`parse_meta`) takes the newest one present. ``spec_verify_records`` carries GrowMTP's
  :class:`SpecRecord` s (a bebop extension, asked for with ``return_spec_records``).
* **Server command lines.** :func:`server_command` for ``bebop serve`` and
  ``sglang.launch_server`` with the MTP speculation flags (used by the trainer's local servers,
  ``launch/slurm.py`` and ``launch/sglang.py``).
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

# ----------------------------------------------------------------------------- metric keys

SPEC_VERIFY_CT = "spec_verify_ct"
SPEC_ACCEPT_LENGTH = "spec_accept_length"  # completion_tokens / spec_verify_ct
SPEC_ACCEPT_RATE = "spec_accept_rate"
# (accepted, proposed) draft-count key pairs, newest first: >= 0.5.12, 0.5.11, <= 0.5.10
SPEC_KEY_PAIRS = (
    ("spec_num_correct_drafts", "spec_num_proposed_drafts"),
    ("spec_accepted_drafts", "spec_proposed_drafts"),
    ("spec_accept_token_num", "spec_draft_token_num"),
)
SPEC_ACCEPTED_PER_DEPTH = "spec_accepted_per_depth"  # bebop: accepted drafts at depth 1..γ
SPEC_REACHED_PER_DEPTH = "spec_reached_per_depth"  # bebop: verify steps where draft k could be emitted
SPEC_VERIFY_RECORDS = "spec_verify_records"  # bebop: GrowMTP records (return_spec_records > 0)
# bebop, for adaptive γ (rounds decoded plainly emit tokens that are not verify tokens):
SPEC_VERIFY_TOKENS = "spec_verify_tokens"  # tokens emitted by verify steps
SPEC_PLAIN_ROUNDS = "spec_plain_rounds"  # rounds the request was decoded plainly (γ = 0)
SPEC_GAMMA_SUM = "spec_gamma_sum"  # Σ γ over its verify steps

# fields our client may send that SGLang does not read (it ignores unknown top-level keys of
# these bodies); bebop serve uses them
BEBOP_EXTENSIONS = {
    "generate": {"return_spec_records"},
    "update_weights_from_tensor": {"stage", "stage_version"},
}
DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name


def tokens_from_verify(verify_tokens: Optional[int], completion_tokens: int, verify_ct: int) -> int:
    """Tokens a response got from verify steps: as reported (bebop), else every token after the
    prefill's (SGLang, where every decode round verifies). The one definition for SpecStats and Sample."""
    if verify_tokens is not None:
        return verify_tokens
    return max(completion_tokens - 1, 0) if verify_ct else 0


@dataclass
class SpecStats:
    """Speculative counters of one response (or a sum of them). ``verify_tokens`` is None where the
    server does not report it (SGLang): every token after the prefill's then came from a verify step."""

    verify_ct: int = 0
    accepted: int = 0
    proposed: int = 0
    completion_tokens: int = 0
    verify_tokens: Optional[int] = None
    plain_rounds: int = 0
    gamma_sum: int = 0

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def emitted_by_verify(self) -> int:
        return tokens_from_verify(self.verify_tokens, self.completion_tokens, self.verify_ct)

    @property
    def tokens_per_verify(self) -> float:
        """Tokens emitted by verify steps / verify steps (the prefill's token is not a verify token)."""
        return self.emitted_by_verify / self.verify_ct if self.verify_ct else 0.0

    @property
    def mean_gamma(self) -> float:
        """Mean drafts per decode round (plain rounds count as γ = 0)."""
        rounds = self.verify_ct + self.plain_rounds
        return self.gamma_sum / rounds if rounds else 0.0

    def __add__(self, o: "SpecStats") -> "SpecStats":
        vt = self.emitted_by_verify + o.emitted_by_verify  # resolved per response, then summed
        return SpecStats(self.verify_ct + o.verify_ct, self.accepted + o.accepted, self.proposed + o.proposed,
                         self.completion_tokens + o.completion_tokens, vt, self.plain_rounds + o.plain_rounds,
                         self.gamma_sum + o.gamma_sum)


def parse_spec_metrics(meta: Mapping) -> SpecStats:
    """Speculative counters from a ``meta_info`` of any SGLang version (missing keys: zeros).

    When only ``spec_verify_ct`` and ``spec_accept_length`` exist (older servers), accepted drafts
    are recovered as completion_tokens - 1 - verify_ct (the prefill emits the first token, and each
    verify step one non-draft token).
    """
    verify = int(meta.get(SPEC_VERIFY_CT) or 0)
    completion = int(meta.get("completion_tokens") or 0)
    accepted = proposed = None
    for a, p in SPEC_KEY_PAIRS:
        if a in meta and meta[a] is not None:
            accepted, proposed = int(meta[a]), int(meta.get(p) or 0)
            break
    if accepted is None:
        accepted = max(completion - 1 - verify, 0) if verify else 0
        proposed = 0
    vt = meta.get(SPEC_VERIFY_TOKENS)
    return SpecStats(verify, accepted, proposed, completion, None if vt is None else int(vt),
                     int(meta.get(SPEC_PLAIN_ROUNDS) or 0), int(meta.get(SPEC_GAMMA_SUM) or 0))


def spec_meta_info(verify_ct: int, completion: int, accepted: int, proposed: int,
                   per_depth: Sequence[int], reached_per_depth: Sequence[int] = (),
                   verify_tokens: Optional[int] = None, plain_rounds: int = 0, gamma_sum: int = 0) -> dict:
    """``meta_info`` speculative counters under every SGLang spelling (the server's writer).

    ``proposed`` counts drafts that could still be emitted (not past a stop or the length limit),
    so accepted/proposed is the acceptance a user sees; per depth k, accepted[k] / reached[k] is
    the exact per-draft acceptance α_k. ``spec_accept_length`` is SGLang's completion tokens / verify
    steps, counted without the tokens of plain rounds when ``verify_tokens`` is given (adaptive γ:
    1 + verify_tokens); ``spec_verify_tokens``, ``spec_plain_rounds`` and ``spec_gamma_sum`` say which
    tokens came from verify steps and the γ chosen."""
    out = {
        SPEC_VERIFY_CT: verify_ct,
        SPEC_ACCEPT_LENGTH: ((completion if verify_tokens is None else 1 + verify_tokens) / verify_ct
                             if verify_ct else 0.0),
        SPEC_ACCEPT_RATE: accepted / proposed if proposed else 0.0,
    }
    for a, p in SPEC_KEY_PAIRS:
        out[a], out[p] = accepted, proposed
    out[SPEC_ACCEPTED_PER_DEPTH] = list(per_depth)
    out[SPEC_REACHED_PER_DEPTH] = list(reached_per_depth)
    if verify_tokens is not None:
        out[SPEC_VERIFY_TOKENS] = int(verify_tokens)
        out[SPEC_PLAIN_ROUNDS] = int(plain_rounds)
        out[SPEC_GAMMA_SUM] = int(gamma_sum)
    return out


@dataclass
class SpecRecord:
    """One verify step recorded for GrowMTP: the verifier's target distribution at depths 1..γ
    as top-k (``topk_ids``/``topk_probs``: [γ][k]), at sequence position ``pos`` (the last
    committed token before the drafts), with ``accepted`` drafts accepted.

    Wire form: a JSON object with exactly these keys. Item access (``rec["pos"]``) is kept so
    code written against the old untyped dicts keeps working."""

    pos: int
    accepted: int
    topk_ids: list = field(default_factory=list)
    topk_probs: list = field(default_factory=list)

    @classmethod
    def from_wire(cls, d: Any) -> "SpecRecord":
        if isinstance(d, SpecRecord):
            return d
        if not isinstance(d, Mapping) or "pos" not in d or "accepted" not in d:
            raise ValueError(f"not a spec record: {d!r:.200}")
        return cls(int(d["pos"]), int(d["accepted"]), list(d.get("topk_ids") or []),
                   list(d.get("topk_probs") or []))

    def to_wire(self) -> dict:
        return asdict(self)

    def __getitem__(self, key: str):
        return getattr(self, key)


@dataclass
class GenerateMeta:
    """Everything the RL client reads from one ``/generate`` result's ``meta_info``."""

    finish_type: Optional[str]
    weight_version: Optional[str]
    prompt_tokens: int
    completion_tokens: int
    output_logprobs: list[float]
    spec: SpecStats
    accepted_per_depth: list[int]
    spec_records: list[SpecRecord]

    @property
    def truncated(self) -> bool:
        return self.finish_type == "length"

    @property
    def aborted(self) -> bool:
        return self.finish_type == "abort"

    def version_int(self, default: int = 0) -> int:
        try:
            return int(self.weight_version)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return default


def finish_type(meta: Mapping) -> Optional[str]:
    fr = meta.get("finish_reason")
    if isinstance(fr, Mapping):
        return fr.get("type")
    return fr if isinstance(fr, str) else None


def parse_meta(meta: Optional[Mapping]) -> GenerateMeta:
    """The one parser of SGLang's ``meta_info`` (any version) and bebop's extensions."""
    meta = meta or {}
    lps = meta.get("output_token_logprobs") or []
    wv = meta.get("weight_version")
    return GenerateMeta(
        finish_type=finish_type(meta),
        weight_version=None if wv is None else str(wv),
        prompt_tokens=int(meta.get("prompt_tokens") or 0),
        completion_tokens=int(meta.get("completion_tokens") or 0),
        # SGLang: [logprob, token_id, text|None]; the first prompt entry of input logprobs is null
        output_logprobs=[float(x[0]) if isinstance(x, (list, tuple)) else float(x) for x in lps],
        spec=parse_spec_metrics(meta),
        accepted_per_depth=[int(x) for x in meta.get(SPEC_ACCEPTED_PER_DEPTH) or []],
        spec_records=[SpecRecord.from_wire(r) for r in meta.get(SPEC_VERIFY_RECORDS) or []],
    )


def is_aborted(result: Mapping) -> bool:
    return finish_type(result.get("meta_info") or {}) == "abort"


# ----------------------------------------------------------------------------- requests


def sampling_params(*, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                    top_k: Optional[int] = None, seed: Optional[int] = None, stop: Sequence[str] = (),
                    stop_token_ids: Sequence[int] = (), ignore_eos: Optional[bool] = None) -> dict:
    """SGLang ``sampling_params`` (field names of ``sglang.api.v1.SamplingParams``)."""
    sp: dict[str, Any] = {"max_new_tokens": int(max_new_tokens), "temperature": float(temperature),
                          "top_p": float(top_p)}
    if top_k is not None:
        sp["top_k"] = int(top_k)
    if seed is not None:
        sp["sampling_seed"] = int(seed)
    if stop:
        sp["stop"] = list(stop)
    if stop_token_ids:
        sp["stop_token_ids"] = [int(t) for t in stop_token_ids]
    if ignore_eos is not None:
        sp["ignore_eos"] = bool(ignore_eos)
    return sp


def generate_request(input_ids: Sequence[int], sampling: Mapping, *, return_logprob: bool = True,
                     rid: Optional[str] = None, spec_records_topk: int = 0) -> dict:
    """A ``/generate`` body for one tokenized prompt."""
    body: dict[str, Any] = {"input_ids": [int(t) for t in input_ids], "sampling_params": dict(sampling),
                            "return_logprob": bool(return_logprob)}
    if rid is not None:
        body["rid"] = rid
    if spec_records_topk:
        body["return_spec_records"] = int(spec_records_topk)  # bebop extension
    return body


def generate_batch_request(input_ids: Sequence[Sequence[int]], sampling: Sequence[Mapping], *,
                           return_logprob: bool = True, spec_records_topk: int = 0) -> dict:
    """A ``/generate`` body for several tokenized prompts, each with its own sampling params
    (SGLang's batch form: lists of ``input_ids`` and ``sampling_params``; the answer is a list in
    the same order). One request instead of many: see ``RolloutManager``'s ``samples_per_request``."""
    if len(input_ids) != len(sampling) or not input_ids:
        raise ValueError(f"a batch needs one sampling-params dict per prompt, got {len(input_ids)} prompts "
                         f"and {len(sampling)} dicts")
    body: dict[str, Any] = {"input_ids": [[int(t) for t in ids] for ids in input_ids],
                            "sampling_params": [dict(sp) for sp in sampling], "return_logprob": bool(return_logprob)}
    if spec_records_topk:
        body["return_spec_records"] = int(spec_records_topk)  # bebop extension
    return body


def pause_request(mode: str = "abort") -> dict:
    if mode not in ("abort", "retract", "in_place"):
        raise ValueError(f"pause mode must be abort, retract or in_place, got {mode!r}")
    return {"mode": mode}


def update_weights_from_disk_request(model_path: str, version: Optional[str], *, flush_cache: bool = True,
                                     abort_all_requests: bool = False, load_format: Optional[str] = None) -> dict:
    body: dict[str, Any] = {"model_path": str(model_path), "weight_version": version, "flush_cache": flush_cache,
                            "abort_all_requests": abort_all_requests}
    if load_format is not None:
        body["load_format"] = load_format
    return body


def update_weights_from_tensor_request(payload_b64: str, version: Optional[str], *, flush_cache: bool,
                                       stage_version: Optional[str] = None) -> dict:
    """bebop serve's safe tensor path: one base64 safetensors payload. Non-final buckets are
    staged (``stage``/``stage_version``: bebop extensions) and applied with the last one."""
    return {"serialized_named_tensors": [payload_b64], "load_format": "safetensors", "flush_cache": flush_cache,
            "weight_version": version, "stage": stage_version is not None, "stage_version": stage_version}


def init_weights_update_group_request(master_address: str, master_port: int, rank_offset: int, world_size: int,
                                      group_name: str = DEFAULT_GROUP, backend: str = "nccl") -> dict:
    return {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend}


def tensor_meta(named: Iterable[tuple[str, Any]]) -> tuple[list[str], list[str], list[list[int]]]:
    """(names, dtypes, shapes) of torch tensors as SGLang expects them (``"bfloat16"``...)."""
    names, dtypes, shapes = [], [], []
    for n, t in named:
        names.append(n)
        dtypes.append(str(t.dtype).removeprefix("torch."))
        shapes.append([int(s) for s in t.shape])
    return names, dtypes, shapes


def update_weights_from_distributed_request(names: Sequence[str], dtypes: Sequence[str],
                                            shapes: Sequence[Sequence[int]], version: Optional[str], *,
                                            group_name: str = DEFAULT_GROUP, flush_cache: bool = True) -> dict:
    """One bucket: the receiver allocates these tensors and joins rank 0's broadcasts, one per
    tensor in this order (SGLang's default ``load_format``)."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError("names, dtypes and shapes must have the same length")
    return {"names": list(names), "dtypes": list(dtypes), "shapes": [list(map(int, s)) for s in shapes],
            "group_name": group_name, "flush_cache": flush_cache, "weight_version": version}


def destroy_weights_update_group_request(group_name: str = DEFAULT_GROUP) -> dict:
    return {"group_name": group_name}


def begin_weight_update_request(selector: str = "all") -> dict:
    return {"selector": selector}


def weights_checksum_request(selector: str = "draft") -> dict:
    """``/weights_checker``: per-tensor checksums of the target and/or draft runners."""
    return {"action": "checksum", "selector": selector}


def draft_checksums(response: Mapping) -> dict[str, str]:
    """The draft runners' tensor checksums from a ``/weights_checker`` answer (SGLang prefixes
    draft keys with their role, e.g. ``draft.model.layers.0...``)."""
    out = {}
    for i, rank in enumerate(response.get("ranks") or []):
        for k, v in (rank.get("checksums") or {}).items():
            if k.startswith("draft"):
                out[f"{i}:{k}"] = v
    return out


# ----------------------------------------------------------------------------- server command


def server_command(cfg=None, engine: str = "bebop", *, model_path: str, port: int,
                   host: Optional[str] = None, python: str = sys.executable, gamma: Optional[int] = None,
                   verify: Optional[str] = None, tp: Optional[int] = None, mem_fraction: Optional[float] = None,
                   dtype: Optional[str] = None, api_key: Optional[str] = None, context_length: Optional[int] = None,
                   max_running: Optional[int] = None, weight_version: Optional[str] = None,
                   algorithm: Optional[str] = None, rejection_flag: bool = True,
                   adaptive: Optional[bool] = None, extra: Sequence[str] = ()) -> list[str]:
    """The command line of one rollout server: ``bebop serve`` (``engine="bebop"``) or
    ``sglang.launch_server`` (``engine="sglang"``), with MTP speculation when γ > 0.

    Defaults come from ``cfg`` when given: γ = ``model.mtp_num_layers`` when ``rl.speculative``
    and ``rl.strategy.speculates`` (else 0), ``rl.verify``, ``launch.rollout_tp`` and
    ``launch.rollout_mem_fraction`` (SGLang). SGLang gets ``--speculative-eagle-topk 1`` and
    ``--speculative-num-draft-tokens γ+1``; both accept thresholds stay at 1.0 (lower is lossy);
    ``--speculative-use-rejection-sampling`` is added for ``verify == "rejection"`` when
    ``rejection_flag`` (the installed SGLang has it). ``adaptive`` (default ``rl.adaptive_gamma``)
    adds bebop serve's ``--speculative-adaptive``; SGLang has no such mode and keeps its fixed γ.
    ``None`` leaves a flag to the server's default.
    """
    if engine not in ("bebop", "sglang"):
        raise ValueError(f"engine must be bebop or sglang, got {engine!r}")
    if cfg is not None:
        r, m = cfg.rl, cfg.model
        if gamma is None:
            gamma = m.mtp_num_layers if (r.speculative and r.strategy.speculates) else 0
        verify = verify or r.verify
        if adaptive is None:
            adaptive = bool(getattr(r, "adaptive_gamma", False))
        if engine == "sglang":
            ln = cfg.launch
            tp = ln.rollout_tp if tp is None else tp
            mem_fraction = ln.rollout_mem_fraction if mem_fraction is None else mem_fraction
    gamma = int(gamma or 0)
    verify = verify or "rejection"
    if gamma < 0:
        raise ValueError("gamma (speculative steps) must be >= 0")
    extra = list(extra)
    for flag in ("--speculative-accept-threshold-single", "--speculative-accept-threshold-acc"):
        if flag in extra:
            raise ValueError(f"{flag} must stay at 1.0 (lower thresholds are lossy)")

    def opt(flag: str, value) -> list[str]:
        return [] if value is None else [flag, str(value)]

    if engine == "sglang":
        algo = (algorithm or "NEXTN").upper()
        if algo not in ("NEXTN", "EAGLE"):
            raise ValueError("algorithm must be NEXTN or EAGLE (MTP heads)")
        cmd = [python, "-m", "sglang.launch_server", "--model-path", str(model_path), *opt("--host", host),
               "--port", str(port), "--tp-size", str(tp or 1), "--trust-remote-code",
               *opt("--mem-fraction-static", mem_fraction), *opt("--context-length", context_length),
               *opt("--max-running-requests", max_running), *opt("--weight-version", weight_version)]
        if gamma:
            cmd += ["--speculative-algorithm", algo, "--speculative-num-steps", str(gamma),
                    "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(gamma + 1)]
            if verify == "rejection" and rejection_flag:
                cmd.append("--speculative-use-rejection-sampling")
    else:
        cmd = [python, "-m", "bebop_megatron.cli", "serve", "--model-path", str(model_path), *opt("--host", host),
               "--port", str(port), *opt("--dtype", dtype), *opt("--context-length", context_length),
               *opt("--max-running-requests", max_running), *opt("--weight-version", weight_version)]
        if gamma:
            cmd += ["--speculative-algorithm", (algorithm or "MTP").upper(), "--speculative-num-steps", str(gamma),
                    "--speculative-verify", verify]
            if adaptive:
                cmd.append("--speculative-adaptive")
    if api_key:
        cmd += ["--api-key", api_key]
    return cmd + extra
