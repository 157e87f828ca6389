"""Embedded generation engine: continuous batching, optional MTP speculative decoding.

State of a running request with committed tokens x_0..x_{L-1} (prompt + output), per slot:
  * the trunk's KV cache holds positions 0..L-2 (x_{L-1}, the newest token, is not processed
    yet); ``hid`` keeps the hidden state the trunk fed to MTP at every processed position and
    ``tok`` the committed tokens;
  * MTP depth k (1-based) is valid on positions 0..valid[k]-1: position s was computed from the
    depth-(k-1) hidden at s and the embedding of x_{s+k} (megatron-core's MTP layer, run
    causally), and ``carry[k]`` keeps depth k's output at valid[k]-1.

A speculative round with γ_r drafts (the lean round: each MTP depth runs ONCE per round, as
SGLang's draft-extend and vLLM's EagleProposer do):
  1. draft: for k = 1..γ_r one pass of depth k over positions b_k..L-2, i.e. its committed
     positions not yet computed (the "extend" over the tokens accepted last round, fused with
     the draft) followed by its k-1 positions whose token lies beyond x_{L-1} (fed the drafts
     d_1..d_{k-1}); its output at L-2 gives q_k and d_k. When the earlier drafts are accepted,
     q_k is exactly the distribution MTP training saw. b_k starts at valid[k], or earlier where the
     depth below must be recomputed (depths skipped while γ_r was smaller), so any γ_r works.
  2. verify: one trunk forward over [x_{L-1}, d_1..d_γr] gives p at γ_r+1 positions; drafts are
     accepted by rejection sampling (or target_only; temperature 0 = greedy) and one more token
     is drawn; the accepted tokens are committed.
     Hybrid models (Gated DeltaNet layers): their recurrent/conv states are not position-indexed,
     so the verify forward keeps the state after each of its γ_r+1 positions and, once m drafts
     are accepted, each request's state is set to the one after d_m (exact rollback).
  3. keep what the drafts computed: depth k at position s read the drafts d_1..d_{s+k-L+1} (its
     token and, through depth k-1, the ones below), so once m drafts are accepted its entries at
     L-k..L-k-1+min(m, k-1) are exact: valid[k] moves to L-k+min(m, k-1) and ``carry[k]`` to the
     output there. Only entries that read a rejected draft are recomputed: in the round after one
     that accepted m drafts, depth k runs over m+1 positions where m >= k-1, else over k (it was m+k).
A round with γ_r = 0 is a plain decoding step. The trunk prefill does not run MTP: the depths
catch up over the prompt in the first draft pass, batched with every other request's draft.

Reduced-vocabulary draft head (``SpecConfig.draft_vocab``; FR-Spec, SGLang's
``--speculative-token-map``): the MTP draft logits are computed over a token map M of N ids only
(the N rows of the LM head, sliced once: the draft's LM-head matmul costs N/V of the full one),
processed with the request's sampling parameters, and put on the full vocabulary with q = 0 off
M. Verification is unchanged and still exact against the full-vocab target p, because rejection
sampling is exact for ANY draft law q provided the draft is drawn from q and the verifier uses
that same q: draft x is emitted with probability q(x) min(1, p(x)/q(x)) = min(p, q)(x), and on
rejection (probability 1 - Σ min(p, q) = Σ max(0, p - q)) the token is drawn from
norm(max(0, p - q)), so in total P(x) = min(p, q)(x) + max(0, p - q)(x) = p(x). Off the map
q(x) = 0: a draft can never be x, min(p, q)(x) = 0 and the residual max(0, p - q)(x) = p(x) holds
all of x's target mass, so ids outside M are still emitted at their exact rate (through the
residual and the bonus token). The price is acceptance only: α = Σ_{x∈M} min(p, q)(x) ≤ p(M).
target_only (argmax of q, accepted with probability p(x)) and greedy (accept iff the draft is
argmax p) are exact for any draft too, so temperature 0 still equals plain greedy decoding.

Sampling and verification run in float32 (``sampling_dtype``; float64 is the reference) with
all of a request's uniforms for a round drawn at once from its own generator.

γ per round (``SpecConfig.adaptive``): the engine measures the cost of a round for each γ
(0..max) at the current batch size (power-of-two buckets; the median of recent *steady* rounds, i.e.
not those that also catch the MTP depths up over positions decoded plainly or just prefilled; γ > 0
costs as ratios to the plain cost of their time and context length, so a machine whose load drifts,
or a round that attends over a longer context, does not tilt it) and
picks the γ that finishes the batch's remaining tokens at the least cost, E[tokens | γ] = 1 + Σ_{j≤γ}
Π_{i≤j} α_i with the running per-depth acceptance α_i. A γ whose depths lag (the rounds before ran
plainly or at a smaller γ) first pays a catch-up over the lagging positions, priced per position from
measured catch-up rounds and amortised over the remaining tokens (the horizon: the median remaining
token budget of the batch), so a short horizon does not switch for a small steady gain and γ does not
flap. γ > 0 is chosen only when its steady gain exceeds ``ADAPTIVE_MARGIN``. While speculating, every
``ADAPTIVE_REMEASURE`` rounds another γ is re-measured in turn (``ADAPTIVE_SAMPLES`` fresh rounds that
replace its old costs) when its price fits a credit that grows by ``ADAPTIVE_PROBE_BUDGET`` plain rounds
per round: a larger γ's catch-up, and plain decoding's loss against the running γ (plain is re-checked
often where speculation breaks even, rarely where it doubles the speed); else a smaller γ > 0 (free).
While plain (γ = 0) wins, re-checking speculation means paying the catch-up, so it is a probe (one
catch-up round, then ``ADAPTIVE_SAMPLES`` steady rounds whose costs replace the old ones, so that costs
measured in a noisy patch cannot keep plain decoding for good; a probe runs the γ > 0 cheapest to
check, every other one the γ measured longest ago, so that no γ's costs stay stale) at intervals,
counted in rounds at that batch bucket, doubling up to ``ADAPTIVE_PROBE_MAX``, and never closer than
what the last probe lost against plain (its catch-up and steady rounds' costs minus the tokens they
yield) over ``ADAPTIVE_PROBE_BUDGET``. A due probe waits (at most one more interval) for the round
after an admission: where a whole batch was just admitted (RL rollouts, a benchmark), the depths lag
only over its prompts then (with continuous batching the older rows still lag; the price uses the
real rows). While plain wins with the same
rows, nothing a plain round changes can make γ > 0 win (its costs, acceptance and yields move only in
γ > 0 rounds; the horizon shrinks and the catch-up grows), so the choice is reused until a γ > 0 round,
an admission, a release, a re-measure or a due probe: it costs a plain round next to nothing.

Acceptance metric (one definition, everywhere):
  * a draft is *proposed* only if it could still be emitted: drafts past an accepted stop token
    or past the length limit are not counted (a step that ends the request proposes
    min(γ_r, tokens left, position of the accepted stop));
  * ``accepted`` counts proposed drafts that were accepted and emitted; the acceptance rate is
    accepted / proposed;
  * per depth, ``reached_per_depth[k]`` counts verify steps in which drafts 1..k-1 were accepted
    and draft k was proposed, ``accepted_per_depth[k]`` those in which draft k was accepted:
    α_k = accepted_per_depth[k] / reached_per_depth[k];
  * tokens per verify step = tokens emitted by verify steps / verify steps (the first output
    token comes from the prefill, not from a verify step). Rounds with γ_r = 0 are not verify
    steps (they are counted in ``plain_steps``).
"""

from __future__ import annotations

import itertools
import math
import re
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import regex
import torch
from torch import Tensor
from torch.nn import functional as F

from bebop_megatron.rollout.modeling import CausalLMWithMTP, KVCache, make_batch_index
from bebop_megatron.rollout.sampling import (LogitProcessors, SamplingTensors, load_token_map, process_logits,
                                             reduced_draft_probs, round_uniforms, sample_with_uniform, verify_chain)


# SGLang's FINISH_ABORT().to_json() for a client abort (status_code/err_type set for errors only)
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


class RequestError(ValueError):
    """A request the engine cannot serve (bad ids, too long, bad sampling params)."""


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list = field(default_factory=list)
    stop_token_ids: list = field(default_factory=list)
    ignore_eos: bool = False
    seed: Optional[int] = None
    no_stop_trim: bool = False
    # SGLang's logit processors (sampling.LogitProcessors), neutral by default
    min_new_tokens: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict] = None  # token id -> additive bias
    stop_regex: list = field(default_factory=list)  # stop once the decoded output matches one

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise RequestError(f"max_new_tokens must be a non-negative integer, got {self.max_new_tokens!r}")
        if not (self.temperature >= 0):  # also rejects NaN
            raise RequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
            raise RequestError(f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        if not (0 <= self.min_p < 1):
            raise RequestError(f"min_p must be in [0, 1), got {self.min_p!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not all(isinstance(s, str) and s for s in self.stop):
            raise RequestError("stop must be a string or a list of non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise RequestError("stop_token_ids must be a list of non-negative integers")
        if not (isinstance(self.min_new_tokens, int) and 0 <= self.min_new_tokens <= self.max_new_tokens):
            raise RequestError(f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens!r}")
        if not (-2 <= self.frequency_penalty <= 2 and -2 <= self.presence_penalty <= 2):
            raise RequestError("frequency_penalty and presence_penalty must be in [-2, 2]")
        if not (0 < self.repetition_penalty <= 2):
            raise RequestError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}")
        if isinstance(self.stop_regex, str):
            self.stop_regex = [self.stop_regex]
        for pat in self.stop_regex:
            try:
                re.compile(pat)  # SGLang's syntax (``re``); searched with ``regex`` for its timeout
                regex.compile(pat)
            except (re.error, regex.error, TypeError, RecursionError, OverflowError, ValueError) as e:
                raise RequestError(f"invalid stop_regex {pat!r}: {e}") from None


@dataclass
class SpecConfig:
    algorithm: str = "none"  # none | mtp
    num_draft_tokens: int = 3  # γ
    verify: str = "rejection"  # rejection | target_only (temperature 0 always verifies greedily)
    adaptive: bool = False  # pick γ per round (0..num_draft_tokens) from measured cost and acceptance
    # reduced-vocabulary draft head (FR-Spec; SGLang's --speculative-token-map): the token ids the
    # MTP draft may propose (a list / 1-D tensor, or a .pt / .json file of one); None = full vocab
    draft_vocab: Optional[object] = None

    def validate(self, model: CausalLMWithMTP) -> None:
        if self.algorithm not in ("none", "mtp"):
            raise ValueError(f"speculative algorithm must be none or mtp, got {self.algorithm!r}")
        if self.algorithm == "mtp":
            if not model.has_mtp:
                raise ValueError("speculative algorithm mtp needs a model with MTP weights")
            if self.num_draft_tokens < 1:
                raise ValueError("num_draft_tokens must be >= 1")
            if self.verify not in ("rejection", "target_only"):
                raise ValueError(f"verify must be rejection or target_only, got {self.verify!r}")
            if self.draft_vocab is not None:
                load_token_map(self.draft_vocab, model.config.vocab_size)


@dataclass
class Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: Optional[dict] = None
    slot: int = -1
    generator: Optional[torch.Generator] = None
    tokens: list[int] = field(default_factory=list)  # committed: prompt + output
    carry: list[Optional[Tensor]] = field(default_factory=list)  # per depth: output at its last real position
    verify_ct: int = 0
    accepted_per_depth: list[int] = field(default_factory=list)
    reached_per_depth: list[int] = field(default_factory=list)  # verify steps where draft k could be emitted
    proposed: int = 0  # drafts that could still be emitted (see the module docstring)
    accepted: int = 0
    verify_tokens: int = 0  # tokens emitted by verify steps (tokens per verify = verify_tokens / verify_ct)
    plain_rounds: int = 0  # rounds an MTP engine decoded this request plainly (adaptive γ chose 0)
    gamma_sum: int = 0  # Σ γ over its verify steps (mean γ = gamma_sum / (verify_ct + plain_rounds))
    created: float = field(default_factory=time.time)
    done: threading.Event = field(default_factory=threading.Event)
    on_update: Optional[Callable[["Request"], None]] = None
    aborted: bool = False
    # GrowMTP: per verify step, the MTP position t (x_{t+1} was the newest committed token), the
    # drafts accepted, and the verifier's target distribution per depth as top-k ids/probs
    spec_record_topk: int = 0
    spec_records: list[dict] = field(default_factory=list)
    counts: Optional[Tensor] = None  # [V] output-token counts, only for count-based penalties
    # SGLang's logprob options (used with return_logprob): prompt logprobs from logprob_start_len
    # (-1: none), top-k per position, and the logprobs of fixed token ids per position
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: Optional[list[int]] = None
    input_token_logprobs: Optional[list] = None  # [(logprob | None, id)], the first logprob None
    input_top_logprobs: Optional[list] = None  # [None | [(logprob, id)]]
    input_token_ids_logprobs: Optional[list] = None
    output_top_logprobs: list = field(default_factory=list)  # per output token: [(logprob, id)]
    output_token_ids_logprobs: list = field(default_factory=list)
    spec_histogram: list[int] = field(default_factory=list)  # verify steps by number of accepted drafts
    retractions: int = 0
    stop_regex_checked: int = 0  # output tokens whose prefixes were searched for stop_regex
    weight_events: list = field(default_factory=list)  # (old version, output length) at each version change

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0 and self.input_token_logprobs is None


class Engine:
    def __init__(self, model: CausalLMWithMTP, tokenizer=None, spec: Optional[SpecConfig] = None,
                 max_running: int = 32, max_len: int = 2048, weight_version: str = "default",
                 sampling_dtype: torch.dtype = torch.float32):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.spec = spec or SpecConfig()
        self.spec.validate(model)
        self.max_running = max_running
        self.max_len = max_len
        self.weight_version = weight_version
        self.sampling_dtype = sampling_dtype
        self.device = model.embed_tokens.weight.device
        self.gamma = self.spec.num_draft_tokens if self.spec.algorithm == "mtp" else 0
        g, dev = self.gamma, self.device
        self.cache_len = max_len + g + 2
        self.trunk_cache = model.new_cache(max_running, self.cache_len, "trunk")
        self._hybrid = bool(self.trunk_cache.linear)  # Gated DeltaNet layers: recurrent states need rollback
        self.mtp_caches: list[KVCache] = [model.new_cache(max_running, self.cache_len, "mtp") for _ in range(g)]
        h, dtype = model.config.hidden_size, model.embed_tokens.weight.dtype
        if g:
            self.hid = torch.zeros(max_running, self.cache_len, h, dtype=dtype, device=dev)  # trunk -> MTP hidden
            self.tok = torch.zeros(max_running, self.cache_len, dtype=torch.long, device=dev)  # committed tokens
            self.carry = torch.zeros(max_running, g + 1, h, dtype=dtype, device=dev)
            self.valid = [[0] * (g + 1) for _ in range(max_running)]  # host: first uncomputed position per depth
        # reduced-vocabulary draft: the map's ids and their LM-head rows (re-sliced when the weights change)
        self.draft_ids = (load_token_map(self.spec.draft_vocab, model.config.vocab_size).to(dev)
                          if g and self.spec.draft_vocab is not None else None)
        self._draft_head_rows, self._draft_head_key = None, None
        self.free_slots = list(range(max_running))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.lock = threading.RLock()
        self._rid = itertools.count()
        self.eos_id = model.config.eos_token_id
        if self.eos_id is None and tokenizer is not None:
            self.eos_id = getattr(tokenizer, "eos_token_id", None) or getattr(tokenizer, "eos_id", None)
        # cumulative stats (SGLang's /get_server_info internal_states)
        self.reset_stats()
        # adaptive γ, per (batch bucket, γ): recent steady round costs, in seconds for γ = 0 and as
        # ratios to the plain cost of their time for γ > 0; the running per-depth acceptance; and per
        # bucket where plain decoding wins, when to probe speculation again (round, interval)
        self._cost_samples: dict[tuple[int, int], deque] = {}
        self._measured_at: dict[tuple[int, int], int] = {}  # (bucket, γ) -> round of its latest steady sample
        self._explored: dict[tuple[int, int], int] = {}  # (bucket, γ) -> measurements begun on a larger bucket's price
        self._probes: dict[int, int] = {}  # per bucket, probes from plain decoding so far
        self._cost_warm: set[tuple[int, int]] = set()  # keys whose first (warm-up) sample was dropped
        self._alpha = [0.7] * g
        self._life_acc, self._life_reach = [0] * g, [0] * g
        self._rounds = 0
        self._bucket_rounds: dict[int, int] = {}  # rounds run at each batch bucket (the probe schedule's clock)
        self.last_gamma = g
        self._current_depths = 0  # MTP depths 1..n are current for every decoding request
        self._probe_at: dict[int, tuple[int, int]] = {}
        self._probe_left, self._probe_gamma, self._probe_bucket = 0, 0, 0  # a re-measure in progress, at its bucket
        self._probe_saved: tuple = (None, None)  # the samples (and their round) the re-measure replaces
        # per bucket, recent catch-up rounds (cost / plain cost, positions per row, γ), and per (bucket, γ)
        # the positions per row of steady rounds: together they price a catch-up position
        self._catchup_samples: dict[int, deque] = {}
        self._credit: dict[int, float] = {}  # per bucket: plain rounds a re-measuring catch-up may spend
        # bumped by whatever can make speculation win again: a γ > 0 round, an admission, a re-measure
        self._spec_version = 0
        self._just_admitted = False  # the next round follows a prefill: the depths lag least then
        self._plain_wins: Optional[tuple[int, int]] = None  # (bucket, version) where plain last won
        self._steady_work: dict[tuple[int, int], deque] = {}
        # per bucket, recent steady plain rounds as (longest context, seconds): a γ > 0 round's cost
        # is a ratio to plain rounds of its context (a round's cost grows with it)
        self._plain_ctx: dict[int, deque] = {}
        self._plain_line: dict[int, tuple] = {}  # per bucket, the fitted line (level, slope, bounds, floor)
        self._draft_positions = 0  # set by each draft pass (Σ over depths of its padded span)
        # per γ, recent verify rounds' (tokens emitted, tokens the accepted chain would have given):
        # requests that stop or hit max_new_tokens inside a round waste the drafts past their end
        self._chain_yield: dict[int, deque] = {}

    # ------------------------------------------------------------------ requests
    def add_request(self, input_ids: list[int], params: SamplingParams, rid: Optional[str] = None,
                    return_logprob: bool = False, on_update=None, spec_record_topk: int = 0,
                    logprob_start_len: int = -1, top_logprobs_num: int = 0,
                    token_ids_logprob: Optional[list[int]] = None) -> Request:
        """Queue a request. With ``return_logprob``: ``logprob_start_len`` >= 0 also scores the
        prompt from that position (SGLang's input_token_logprobs; with max_new_tokens 0 the request
        only scores its prompt), ``top_logprobs_num`` and ``token_ids_logprob`` add per-position
        top-k and fixed-id logprobs."""
        params.validate()
        if not isinstance(spec_record_topk, int) or spec_record_topk < 0 or spec_record_topk > 64:
            raise RequestError(f"spec_record_topk must be an integer in [0, 64], got {spec_record_topk!r}")
        if not input_ids:
            raise RequestError("empty prompt: input_ids must hold at least one token")
        V = self.model.config.vocab_size
        bad = [t for t in input_ids if not isinstance(t, int) or t < 0 or t >= V]
        if bad:
            raise RequestError(f"token ids out of range [0, {V}): {bad[:5]}")
        if params.logit_bias:
            try:
                params.logit_bias = {int(t): float(b) for t, b in params.logit_bias.items()}
            except (TypeError, ValueError, OverflowError):
                raise RequestError("logit_bias must map token ids to numbers") from None
            if not all(0 <= t < V for t in params.logit_bias):
                raise RequestError(f"logit_bias must have keys in [0, {V - 1}]")
        if params.stop_regex and self.tokenizer is None:
            raise RequestError("stop_regex needs a tokenizer (the server was started without one)")
        if len(input_ids) + params.max_new_tokens > self.max_len:
            raise RequestError(f"prompt ({len(input_ids)}) + max_new_tokens ({params.max_new_tokens}) "
                               f"exceeds the context length {self.max_len}")
        if not return_logprob:
            logprob_start_len, top_logprobs_num, token_ids_logprob = -1, 0, None
        if not isinstance(logprob_start_len, int) or not -1 <= logprob_start_len <= len(input_ids):
            raise RequestError(f"logprob_start_len must be in [-1, {len(input_ids)}] (the prompt length), "
                               f"got {logprob_start_len!r}")
        if not isinstance(top_logprobs_num, int) or not 0 <= top_logprobs_num <= V:
            raise RequestError(f"top_logprobs_num must be in [0, {V}], got {top_logprobs_num!r}")
        if token_ids_logprob is not None and not all(isinstance(t, int) and 0 <= t < V for t in token_ids_logprob):
            raise RequestError(f"token_ids_logprob must hold token ids in [0, {V})")
        req = Request(rid=rid or f"req-{next(self._rid)}", input_ids=list(input_ids), params=params,
                      return_logprob=return_logprob, on_update=on_update, spec_record_topk=spec_record_topk,
                      logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
                      token_ids_logprob=list(token_ids_logprob) if token_ids_logprob is not None else None)
        g = torch.Generator()
        g.manual_seed(params.seed if params.seed is not None else torch.randint(0, 2**62, ()).item())
        req.generator = g
        if LogitProcessors.uses_counts(params):
            req.counts = torch.zeros(V, dtype=torch.float32, device=self.device)
        with self.lock:
            if params.max_new_tokens == 0 and not req.wants_prompt_logprobs:
                self._finish(req, {"type": "length", "length": 0})
            else:
                self.waiting.append(req)
        return req

    def abort(self, rid: Optional[str] = None) -> int:
        """Abort one request (or all with rid=None); returns how many were aborted."""
        n = 0
        with self.lock:
            for req in list(self.waiting) + list(self.running):
                if rid is None or req.rid == rid:
                    req.aborted = True
                    n += 1
        return n

    def has_work(self) -> bool:
        with self.lock:
            return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ main loop
    @torch.no_grad()
    def step(self) -> None:
        """One scheduling round: reap aborts, admit + prefill new requests, decode the rest."""
        with self.lock:
            for req in list(self.waiting):
                if req.aborted:
                    self.waiting.remove(req)
                    self._finish(req, dict(ABORTED))
            for req in list(self.running):
                if req.aborted:
                    self._release(req, dict(ABORTED))
            decoding = sorted(self.running, key=lambda r: r.slot)  # consecutive slots: caches read as views
            admitted = []
            self.free_slots.sort(reverse=True)  # lowest slot first
            while self.waiting and self.free_slots:
                req = self.waiting.popleft()
                req.slot = self.free_slots.pop()
                admitted.append(req)
            if admitted:
                self.running.extend(admitted)
                self._prefill(admitted)
            if decoding:
                gamma = self._choose_gamma(len(decoding), decoding) if self.gamma else 0
                capped = False
                if gamma:
                    # no row emits more than its tokens left, so drafts past the largest budget are
                    # never emitted: a batch's last rounds run a smaller γ (a γ = 3 round costs 2.7
                    # plain rounds at batch 4 of the tiny model, a γ = 1 round 1.6). A row's tokens do
                    # not change with it: with γ >= its tokens left they are the same drafts, tests
                    # and residual draws (uniforms at fixed places, ``_speculative_round``)
                    cap = max(r.params.max_new_tokens - len(r.output_ids) for r in decoding)
                    capped = cap < gamma
                    gamma = self.last_gamma = min(gamma, cap)
                # a capped round is a batch's end, not a γ's: adaptive γ learns nothing from it (its rows
                # emit only what is left, which would read as drafts lost at that γ)
                # a round whose depths missed positions (decoded plainly or at a smaller γ, or just
                # prefilled) also runs them over those (catch-up): not the steady cost of γ
                steady = gamma <= self._current_depths
                ctx = max(len(r.tokens) for r in decoding) if self.spec.adaptive else 0  # the span attention reads
                t0 = self._clock()
                if gamma:
                    self._speculative_round(decoding, gamma, learn=not capped)
                    self._spec_version += 1
                else:
                    self._plain_round(decoding)
                if self.gamma:
                    self.gamma_hist[gamma] += 1  # rounds run at each γ (fixed γ too)
                    if self.spec.adaptive:
                        seconds = self._clock() - t0  # read every round: the clock is read in pairs
                        if not capped:
                            work = self._draft_positions if gamma else 0
                            self._record_cost(len(decoding), gamma, seconds, steady, work, ctx)
                self._current_depths = gamma
            if admitted:  # prefilled requests join the next round with no MTP depth computed yet
                self._current_depths = 0
                self._spec_version += 1
                self._just_admitted = True

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 return_logprob: bool = False) -> list[Request]:
        """Blocking convenience: run the loop until all given prompts finish."""
        plist = params if isinstance(params, list) else [SamplingParams(**vars(params)) for _ in prompts]
        reqs = [self.add_request(p, sp, return_logprob=return_logprob) for p, sp in zip(prompts, plist)]
        while not all(r.finished for r in reqs):
            self.step()
        return reqs

    # ------------------------------------------------------------------ adaptive γ
    def _clock(self) -> float:
        """Cost clock: process CPU time on CPU (robust to other processes on a shared machine),
        synchronised wall time on an accelerator."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return time.perf_counter()
        return time.process_time()

    @staticmethod
    def _bucket(B: int) -> int:
        return 1 << max(0, (B - 1).bit_length())

    def expected_tokens(self, gamma: int) -> float:
        """1 + Σ_{j≤γ} Π_{i≤j} α_i with the running per-depth acceptance."""
        e, prod = 1.0, 1.0
        for a in self._alpha[:gamma]:
            prod *= a
            e += prod
        return e

    def realized_fraction(self, gamma: int) -> float:
        """Share of the accepted chain (accepted drafts + 1) that recent γ rounds could emit. Below 1
        where requests end inside a round (short RL answers: drafts past a stop are lost); 1 before
        any γ round. Plain rounds lose nothing this way, so E[tokens] of γ is scaled by it."""
        rec = self._chain_yield.get(gamma)
        if not rec:
            return 1.0
        return sum(e for e, _ in rec) / max(sum(c for _, c in rec), 1)

    def effective_tokens(self, gamma: int) -> float:
        """Expected tokens per row of a γ round: the acceptance chain times the realized fraction."""
        return self.expected_tokens(gamma) * self.realized_fraction(gamma) if gamma else 1.0

    ADAPTIVE_MARGIN = 0.10  # speculate only if the steady tokens per cost beat plain by more than this
    # (measured costs on a shared machine scatter by about as much)
    ADAPTIVE_SAMPLES = 3  # steady rounds measured per (bucket, γ) before choosing
    ADAPTIVE_REMEASURE = 32  # while speculating, every N-th round starts re-measuring another γ
    ADAPTIVE_PROBE_MAX = 1024  # while plain wins, the probe interval doubles from REMEASURE up to this (a due
    # probe may then wait one more interval for an admission)
    ADAPTIVE_PROBE_ROUNDS = 1 + ADAPTIVE_SAMPLES  # a probe from plain: one catch-up round, then fresh samples
    ADAPTIVE_PROBE_BUDGET = 0.01  # probes may lose at most this share of the plain rounds between them
    ADAPTIVE_EXPLORE_SLACK = 0.25  # a γ priced from a larger bucket at most this far above plain's cost per
    # token is measured in the smaller one: its ratio to plain falls as the batch shrinks
    ADAPTIVE_EXPLORE_TRIES = 3  # ... begun at most this often (a tail bucket may end before its samples are in)

    def _cost(self, bk: int, gamma: int) -> Optional[float]:
        """Median steady cost of γ at bucket ``bk``; for γ > 0 without samples there, the nearest
        measured bucket's (a ratio to plain, which changes slowly with the batch). Measuring every
        bucket first would not finish in a shrinking batch: each tail bucket lasts a round or two,
        and its first γ > 0 round is a catch-up round, which is not a steady sample."""
        own = self._cost_samples.get((bk, gamma))
        if own and len(own) >= self.ADAPTIVE_SAMPLES:
            return statistics.median(own)
        if gamma == 0:
            return None
        lender = self._lender(bk, gamma)
        return statistics.median(self._cost_samples[(lender, gamma)]) if lender is not None else None

    def _lender(self, bk: int, gamma: int) -> Optional[int]:
        """The bucket whose γ cost ``_cost`` borrows for ``bk`` (None: its own, or none measured)."""
        own = self._cost_samples.get((bk, gamma))
        if own and len(own) >= self.ADAPTIVE_SAMPLES:
            return None
        # equally near: the larger bucket (its ratio is the higher, so the borrowed choice errs toward plain)
        near = [(abs(k.bit_length() - bk.bit_length()), -k) for (k, c), v in self._cost_samples.items()
                if c == gamma and len(v) >= self.ADAPTIVE_SAMPLES]
        return -min(near)[1] if near else None

    def _explore(self, bk: int, per_token: dict[int, float], reqs: Optional[list[Request]]) -> int:
        """A γ to measure at ``bk`` although a borrowed cost says plain: one priced from a LARGER bucket
        within ADAPTIVE_EXPLORE_SLACK of plain, and not a winner there (a winner lost to its catch-up
        against the horizon, which a measurement would pay again). Borrowing errs toward plain by design
        (``_cost``), and a bucket where plain is chosen never measures γ on its own: in a shrinking RL
        batch the tail buckets then decode plainly on the price of the full batch. The γ of least
        catch-up + samples cost, where the rows have tokens left for its rounds; at most
        ADAPTIVE_EXPLORE_TRIES begun per (bucket, γ); 0: nothing to explore."""
        H = self._horizon(reqs)
        cands = [c for c in per_token if c and self._explored.get((bk, c), 0) < self.ADAPTIVE_EXPLORE_TRIES
                 and 1.0 < per_token[c] * (1.0 + self.ADAPTIVE_MARGIN)
                 and per_token[c] <= 1.0 + self.ADAPTIVE_EXPLORE_SLACK and (self._lender(bk, c) or 0) > bk
                 and (reqs is None or H >= (self.ADAPTIVE_SAMPLES + 2) * self.effective_tokens(c))]
        if not cands:
            return 0
        c = min(cands, key=lambda c: self.ADAPTIVE_SAMPLES * per_token[c] + self._switch_cost(bk, c, reqs))
        self._explored[(bk, c)] = self._explored.get((bk, c), 0) + 1
        return c

    def _depth_starts(self, slots: list[int], g: int) -> list[list[int]]:
        """b_k per depth and row: depth k starts at its first uncomputed position, or where depth k+1
        must start (depth k+1 reads depth k's output, or its carry, at its own first position)."""
        starts = [[0] * len(slots) for _ in range(g)]
        for i, s in enumerate(slots):
            v = self.valid[s]
            nxt = v[g]
            starts[g - 1][i] = nxt
            for k in range(g - 1, 0, -1):
                nxt = v[k] if v[k] <= nxt + 1 else nxt
                starts[k - 1][i] = nxt
        return starts

    def _depth_work(self, reqs: list[Request], g: int) -> int:
        """Positions per row the depths 1..γ of a round run over (padded to the longest row, as the
        draft pass runs them): a few in a steady round, every lagging position in a catch-up."""
        L = [len(r.tokens) for r in reqs]
        return sum(max(x - 1 - s for x, s in zip(L, st)) for st in self._depth_starts([r.slot for r in reqs], g))

    def _position_cost(self, bk: int) -> float:
        """Cost of one more catch-up position per row, in plain rounds: (catch-up cost - steady cost
        of its γ) / (its positions - steady positions), median over recent catch-ups at the nearest
        bucket that has one; 0 (catch-up unpriced) before any."""
        near = sorted(self._catchup_samples, key=lambda k: (abs(k.bit_length() - bk.bit_length()), -k))
        for k in near:
            per = []
            for ratio, work, g in self._catchup_samples[k]:
                steady, sw = self._cost(k, g), self._steady_work.get((k, g))
                if steady is not None and sw and work > statistics.median(sw):
                    per.append(max(ratio - steady, 0.0) / (work - statistics.median(sw)))
            if per:
                return statistics.median(per)
        return 0.0

    def _switch_cost(self, bk: int, gamma: int, reqs: Optional[list[Request]]) -> float:
        """Extra cost (plain rounds) of running γ next when its depths lag: the catch-up positions
        beyond a steady round's, times the position cost. 0 where γ's depths are current."""
        if reqs is None or gamma <= self._current_depths:
            return 0.0
        sw = self._steady_work.get((bk, gamma)) or next(
            (v for (k, c), v in self._steady_work.items() if c == gamma), None)
        extra = self._depth_work(reqs, gamma) - (statistics.median(sw) if sw else 0)
        return max(extra, 0) * self._position_cost(bk)

    def _horizon(self, reqs: Optional[list[Request]]) -> float:
        """Tokens per row left to generate (median of the remaining budgets: an upper bound where
        answers stop early); 1 without requests (the choice is then per round)."""
        if not reqs:
            return 1.0
        left = [min(r.params.max_new_tokens - len(r.output_ids), self.max_len - len(r.tokens) - self.gamma - 1)
                for r in reqs]
        return float(max(statistics.median(left), 1))

    def _choose_gamma(self, B: int, reqs: Optional[list[Request]] = None) -> int:
        """γ for this round. Measure plain at this batch bucket and every γ once somewhere, then run
        the γ that finishes the remaining tokens at the least predicted cost: (horizon / E[tokens]) x
        its round cost, plus its catch-up where its depths lag. Where plain wins, a γ > 0 round must
        first catch the MTP depths up over every position decoded plainly, so re-checking is not
        free: it is a short probe at intervals that double while plain keeps winning (amortised to a
        few rounds in a thousand)."""
        g = self.gamma
        if not self.spec.adaptive:
            self.last_gamma = g
            return g
        self._rounds += 1
        bk = self._bucket(B)
        # the probe schedule runs on the bucket's own rounds: a shrinking batch (RL answers that stop at
        # different lengths) spends a round or two per batch in each tail bucket, so an interval in all
        # rounds let a tail bucket probe in a third of the rounds it ran (its budget counted the others)
        now = self._bucket_rounds[bk] = self._bucket_rounds.get(bk, 0) + 1
        if self._probe_left and bk != self._probe_bucket:
            # the batch changed bucket: the re-measure is for the old one (its samples would land here).
            # A probe begun in a tail round of a shrinking batch ran on into the next, full batch: at
            # batch 32 of the tiny model, γ = 1 / 2 rounds started at batch 1-16 opened five batches in a row.
            # The samples it replaced come back where it did not take enough new ones
            self._probe_left = 0
            key, (old, at) = (self._probe_bucket, self._probe_gamma), self._probe_saved
            new = self._cost_samples.get(key)
            if old and (not new or len(new) < self.ADAPTIVE_SAMPLES):
                self._cost_samples[key] = deque([*old, *(new or [])], maxlen=old.maxlen)
                if at is not None:
                    self._measured_at[key] = at
        if self._probe_left:
            self._probe_left -= 1
            self.last_gamma = self._probe_gamma
            return self._probe_gamma
        fresh, self._just_admitted = self._just_admitted, False
        if self._plain_wins == (bk, self._spec_version) and now < sum(self._probe_at.get(bk, (0, 0))):
            # nothing plain rounds change can make speculation win again (γ > 0 costs, acceptance and
            # yields move only in γ > 0 rounds; the horizon only shrinks, the catch-up only grows); a
            # due probe waits for an admission, which changes the version, or for one more interval
            self.last_gamma = 0
            return 0
        for cand in (0, *range(g, 0, -1)):  # measure plain here, and each γ where none is measured yet
            if self._cost(bk, cand) is None:
                self.last_gamma = cand
                return cand
        # plain rounds per token of each γ in steady state (plain: 1); the catch-up, which can only
        # make a γ dearer, is worked out where a γ whose depths lag could still win (the choice runs
        # every round: the common case, plain winning at a large batch, stays cheap)
        per_token = {c: self._cost(bk, c) / max(self.effective_tokens(c), 1e-9) for c in range(1, g + 1)}
        per_token[0] = 1.0
        # a predicted gain inside the measurement noise is not worth the risk
        winners = [c for c in range(1, g + 1) if per_token[c] * (1.0 + self.ADAPTIVE_MARGIN) <= 1.0]
        best = min(winners, key=per_token.get, default=0)
        if best and reqs is not None and any(c > self._current_depths for c in winners):
            # the least predicted cost of the remaining tokens (horizon H), in plain rounds
            H = self._horizon(reqs)
            switch = {c: self._switch_cost(bk, c, reqs) for c in winners}
            best = min([0, *winners], key=lambda c: H * per_token[c] + switch.get(c, 0.0))
        if best == 0 and (explore := self._explore(bk, per_token, reqs)):
            self._remeasure(bk, explore)  # a catch-up round (where the depths lag), then steady samples
            if (bk, explore) not in self._cost_warm:
                self._probe_left += 1  # its first steady round there is a warm-up, not a sample
            # the probe schedule restarts after it (an overdue probe would re-measure what was just measured)
            interval = self._probe_at.get(bk, (0, self.ADAPTIVE_REMEASURE))[1]
            self._probe_at[bk] = (now + interval, interval)
            self.last_gamma = explore
            return explore
        if best == 0:
            due, interval = self._probe_at.get(bk, (now + self.ADAPTIVE_REMEASURE, self.ADAPTIVE_REMEASURE))
            # probe a γ > 0 (below: which); a due probe waits for the round
            # after an admission (a batch's start, where the catch-up runs over the prompts only),
            # for at most one more interval
            if now >= due and (fresh or now >= due + interval):
                # the γ > 0 of the least catch-up + steady cost, and every other probe the γ measured
                # longest ago here. Probing the cheapest one every time left a γ whose samples came from
                # a noisy patch with those samples for good: at batch 4 of the tiny model three slow
                # γ = 3 rounds (4.5x plain against 2.6x) kept plain decoding in 2/3 of the rounds, where
                # γ = 3 runs 1.2x plain. Probing the stalest every time recovered more slowly after a
                # noisy patch (a γ = 3 probe costs more, so the next one waits longer)
                sw = {c: self._switch_cost(bk, c, reqs) for c in range(1, g + 1)}
                probe_cost = {c: sw[c] + self.ADAPTIVE_SAMPLES * per_token[c] for c in sw}
                n = self._probes[bk] = self._probes.get(bk, 0) + 1
                if n % 2:
                    best = min(probe_cost, key=probe_cost.get)
                else:
                    best = min(probe_cost, key=lambda c: (self._measured_at.get((bk, c), -1), probe_cost[c]))
                # what a probe loses against plain, in plain rounds: its catch-up round and its steady
                # rounds each cost their ratio and yield E[tokens]; the next one waits until that is
                # at most ADAPTIVE_PROBE_BUDGET of the plain rounds in between
                e, ratio = self.effective_tokens(best), self._cost(bk, best)
                loss = max(0.0, ratio + sw[best] - e) + self.ADAPTIVE_SAMPLES * max(0.0, ratio - e)
                self._remeasure(bk, best)
                interval = min(max(2 * interval, math.ceil(loss / self.ADAPTIVE_PROBE_BUDGET)), self.ADAPTIVE_PROBE_MAX)
                due = now + interval
            self._probe_at[bk] = (due, interval)
            self._plain_wins = (bk, self._spec_version) if best == 0 else None
        else:
            # speculation wins here: the back-off starts over if plain wins again (a choice of plain
            # made on costs from a noisy moment is then re-checked soon; the probe waits for the next
            # admission, where its catch-up is cheap)
            self._probe_at.pop(bk, None)
            # a re-measure spends a credit that grows by ADAPTIVE_PROBE_BUDGET plain rounds per round,
            # as probes from plain do: a larger γ's catch-up, and plain's rounds' loss against the
            # running γ (1 - its plain rounds per token, per round: exact, plain is the unit). Re-measured
            # every 96 rounds, plain cost ~5% of a 2x speed-up; now about 1%, and as often as before where
            # speculation only breaks even. A γ > 0 is priced by its catch-up alone: its cost may be
            # stale (measured in a noisy patch), and that is what re-measuring it finds out
            self._credit[bk] = min(self._credit.get(bk, 0.0) + self.ADAPTIVE_PROBE_BUDGET, self.ADAPTIVE_PROBE_MAX)
            if self._rounds % self.ADAPTIVE_REMEASURE == 0:  # re-measure the others in turn (costs drift)
                others = [c for c in range(g + 1) if c != best]
                cand = others[(self._rounds // self.ADAPTIVE_REMEASURE) % len(others)]

                def price(c: int) -> float:
                    if c == 0:
                        return self.ADAPTIVE_SAMPLES * max(0.0, 1.0 - per_token[best])
                    return self._switch_cost(bk, c, reqs)

                if price(cand) > self._credit[bk]:  # not yet: a smaller γ > 0 instead (free: no catch-up;
                    # plain as a stand-in would spend the credit a larger γ's catch-up is saving up for)
                    cand = next((c for c in reversed(others) if 0 < c <= self._current_depths), None)
                if cand is not None:
                    self._credit[bk] -= price(cand)
                    best = cand
                    self._remeasure(bk, best)
        self.last_gamma = best
        return best

    def _remeasure(self, bk: int, cand: int) -> None:
        """Run γ = ``cand`` for fresh steady samples (after a catch-up round if its depths lag) that
        replace its old ones: otherwise costs measured in a noisy patch of a shared machine outvote
        the one new sample of each visit, and a choice made in that patch sticks."""
        # kept aside for a re-measure cut short by a change of bucket (``_choose_gamma`` puts them back)
        self._probe_saved = (self._cost_samples.pop((bk, cand), None), self._measured_at.pop((bk, cand), None))
        self._spec_version += 1
        catch_up = 1 if cand > self._current_depths else 0
        self._probe_gamma, self._probe_left, self._probe_bucket = cand, catch_up + self.ADAPTIVE_SAMPLES - 1, bk

    PLAIN_CTX_HISTORY = 64  # steady plain rounds kept per bucket with their context length
    PLAIN_CTX_SPAN = 16  # ... whose cost is fitted as a line in the context once they span this many tokens

    def _plain_ref(self, bk: int, ctx: float) -> Optional[float]:
        """Plain cost at bucket ``bk`` for rounds whose longest context (the span attention reads) is
        ``ctx``. A round's cost grows with it (at batch 32 of the tiny model, +12% over a 48-token
        answer), and probes run right after an admission (short contexts) while the latest plain
        rounds ended the previous batch (long ones): against those a γ > 0 round looked 10% cheaper
        than it is. Where the kept plain rounds span ``PLAIN_CTX_SPAN`` tokens or more, the cost is a
        line in the context: its slope from the medians of the shorter and the longer half (one slow
        round cannot tilt it; >= 0), its level from the latest ADAPTIVE_SAMPLES rounds (the cost of
        their time, as the ratios promise), read at ``ctx`` at most one span outside the kept
        contexts and never below a quarter of the cheapest kept round. Else the latest rounds' median."""
        hist = self._plain_ctx.get(bk)
        if not hist or len(hist) < self.ADAPTIVE_SAMPLES:
            plain = self._cost_samples.get((bk, 0))
            return statistics.median(plain) if plain else None
        line = self._plain_line.get(bk)
        if line is None:  # refitted only after new plain rounds (a γ > 0 round then costs one lookup)
            recent = list(hist)[-self.ADAPTIVE_SAMPLES:]
            by_ctx = sorted(hist)
            lo_c, hi_c = by_ctx[0][0], by_ctx[-1][0]
            span = hi_c - lo_c
            if span < self.PLAIN_CTX_SPAN:
                line = (statistics.median(x for _, x in recent), 0.0, lo_c, hi_c, 0.0)
            else:
                lo, hi = by_ctx[: len(by_ctx) // 2], by_ctx[len(by_ctx) // 2:]
                dc = statistics.median(c for c, _ in hi) - statistics.median(c for c, _ in lo)
                dx = statistics.median(x for _, x in hi) - statistics.median(x for _, x in lo)
                slope = max(0.0, dx / dc) if dc > 0 else 0.0
                line = (statistics.median(x - slope * c for c, x in recent), slope, lo_c - span, hi_c + span,
                        0.25 * min(x for _, x in hist))
            self._plain_line[bk] = line
        level, slope, lo, hi, floor = line
        return max(level + slope * min(max(ctx, lo), hi), floor)

    def _record_cost(self, B: int, gamma: int, seconds: float, steady: bool = True, work: int = 0,
                     ctx: int = 0) -> None:
        """Keep the recent steady costs of a round; the first of each (bucket, γ) is a warm-up
        (first shapes) and is dropped. A γ > 0 cost is kept as a ratio to the plain cost measured
        around the same time, so that a machine that gets busier or quieter while the engine
        speculates (or decodes plainly) does not tilt the choice: only ratios are compared.
        A catch-up round's cost (as a ratio) is kept apart with its positions per row (``work``):
        with the steady rounds' positions they price a catch-up position."""
        key = (self._bucket(B), gamma)
        if not steady:
            plain = self._plain_ref(key[0], ctx)
            if gamma and plain:
                self._catchup_samples.setdefault(key[0], deque(maxlen=5)).append((seconds / plain, work, gamma))
            return
        if gamma:
            self._steady_work.setdefault(key, deque(maxlen=16)).append(work)
        if key not in self._cost_warm:
            self._cost_warm.add(key)
            return
        if gamma:
            plain = self._plain_ref(key[0], ctx)
            if not plain:
                return
            seconds /= plain
        else:
            self._plain_ctx.setdefault(key[0], deque(maxlen=self.PLAIN_CTX_HISTORY)).append((ctx, seconds))
            self._plain_line.pop(key[0], None)
        samples = self._cost_samples.setdefault(key, deque(maxlen=5))
        samples.append(seconds)
        if len(samples) >= self.ADAPTIVE_SAMPLES:  # measured here: _cost no longer borrows another bucket's
            self._measured_at[key] = self._rounds

    # ------------------------------------------------------------------ internals
    def _sampling(self, reqs: list[Request]) -> SamplingTensors:
        return SamplingTensors.build([r.params for r in reqs], device=self.device)

    def _processors(self, reqs: list[Request]) -> Optional[LogitProcessors]:
        return LogitProcessors.build(reqs, self.model.config.vocab_size, self.eos_id, self.device)

    def _slots(self, reqs: list[Request]) -> Tensor:
        return torch.tensor([r.slot for r in reqs], dtype=torch.long, device=self.device)

    def _prefill(self, reqs: list[Request]) -> None:
        for r in reqs:
            r.tokens = list(r.input_ids) + list(r.output_ids)  # retracted requests keep their output
            r.accepted_per_depth = r.accepted_per_depth or [0] * self.gamma
            r.reached_per_depth = r.reached_per_depth or [0] * self.gamma
        ctx = [r.tokens for r in reqs]
        lens_l = [len(c) for c in ctx]
        sl = self._slots(reqs)
        b = make_batch_index([r.slot for r in reqs], [0] * len(reqs), lens_l, self.device)
        ids = _pad(ctx, self.device)
        normed, mtp_in = self.model.trunk(ids, self.trunk_cache, b)
        lens = torch.tensor(lens_l, device=self.device)
        rows = torch.arange(len(reqs), device=self.device)
        for i, r in enumerate(reqs):
            if r.wants_prompt_logprobs:
                self._prompt_logprobs(r, normed[i, : len(r.input_ids) - 1])
        logits = self.model.logits(normed[rows, lens - 1])
        if self.gamma:  # MTP runs over the prompt in the first draft pass, batched with the others
            pos = b.positions.clamp(max=self.cache_len - 1)
            self.hid[sl[:, None], pos] = mtp_in.to(self.hid.dtype)
            self.tok[sl[:, None], pos] = ids
            for r in reqs:
                self.valid[r.slot] = [0] * (self.gamma + 1)
        proc = self._processors(reqs)
        if proc is not None:
            logits = proc.apply(logits)
        new_tokens = self._sample(reqs, logits)
        if self.gamma:
            self.tok[sl, lens] = new_tokens
        for i, r in enumerate(reqs):
            if r.params.max_new_tokens == 0:  # prompt scoring only
                self._release(r, {"type": "length", "length": 0})
                continue
            self._commit(r, [int(new_tokens[i])], logits[i: i + 1])
            self._check_done(r)

    def _prompt_logprobs(self, r: Request, normed: Tensor) -> None:
        """SGLang's input logprobs from ``logprob_start_len`` s: the entry of prompt token s has no
        logprob (None), token t > s gets log p(x_t | x_<t); ``normed`` holds positions 0..len-2."""
        s, ids = r.logprob_start_len, r.input_ids
        r.input_token_logprobs = [(None, ids[s])] if s < len(ids) else []
        r.input_top_logprobs = [None] if s < len(ids) and r.top_logprobs_num else ([] if r.top_logprobs_num else None)
        r.input_token_ids_logprobs = ([None] if s < len(ids) else []) if r.token_ids_logprob is not None else None
        if s + 1 >= len(ids):
            return
        lsm = self._log_probs(r, self.model.logits(normed[s:]))  # rows predict tokens s+1..len-1
        tgt = torch.tensor(ids[s + 1:], device=lsm.device)
        r.input_token_logprobs += list(zip(lsm.gather(-1, tgt[:, None]).squeeze(-1).tolist(), ids[s + 1:]))
        if r.top_logprobs_num:
            r.input_top_logprobs += self._top(lsm, r.top_logprobs_num)
        if r.token_ids_logprob is not None:
            r.input_token_ids_logprobs += self._fixed(lsm, r.token_ids_logprob)

    @staticmethod
    def _log_probs(r: Request, logits: Tensor) -> Tensor:
        t = r.params.temperature if r.params.temperature > 0 else 1.0
        return torch.log_softmax(logits.double() / t, -1)

    @staticmethod
    def _top(lsm: Tensor, k: int) -> list:
        top = lsm.topk(min(k, lsm.shape[-1]), dim=-1)
        return [list(zip(v, i)) for v, i in zip(top.values.tolist(), top.indices.tolist())]

    @staticmethod
    def _fixed(lsm: Tensor, ids: list[int]) -> list:
        if not ids:
            return [[] for _ in range(lsm.shape[0])]
        vals = lsm[:, torch.tensor(ids, device=lsm.device)].tolist()
        return [list(zip(v, ids)) for v in vals]

    def _sample(self, reqs: list[Request], logits: Tensor) -> Tensor:
        probs = process_logits(logits, self._sampling(reqs), self.sampling_dtype)
        u = round_uniforms([r.generator for r in reqs], 1, self.sampling_dtype, self.device)
        return sample_with_uniform(probs, u[:, 0])

    @torch.no_grad()
    def _plain_round(self, reqs: list[Request]) -> None:
        B = len(reqs)
        L_l = [len(r.tokens) for r in reqs]
        # host lists: make_batch_index's fast path (one metadata tensor, no device reads)
        b = make_batch_index([r.slot for r in reqs], [x - 1 for x in L_l], [1] * B, self.device, N=1)
        ids = torch.tensor([[r.tokens[-1]] for r in reqs], device=self.device)
        normed, mtp_in = self.model.trunk(ids, self.trunk_cache, b)
        logits = self.model.logits(normed[:, 0])
        proc = self._processors(reqs)
        if proc is not None:
            logits = proc.apply(logits)
        toks = self._sample(reqs, logits)
        if self.gamma:
            sl, last = b.slots, b.positions[:, 0]  # position L-1 per row
            self.hid[sl, last] = mtp_in[:, 0].to(self.hid.dtype)
            self.tok[sl, last + 1] = toks
            self.total_plain_steps += B
        for i, r in enumerate(reqs):
            r.plain_rounds += bool(self.gamma)  # only an MTP engine's plain rounds are "plain rounds"
            self._commit(r, [int(toks[i])], logits[i: i + 1])
            self._check_done(r)

    @torch.no_grad()
    def _speculative_round(self, reqs: list[Request], g: int, learn: bool = True) -> None:
        B = len(reqs)
        dev = self.device
        st = self._sampling(reqs)
        mode = self.spec.verify
        slot_l, L_l = [r.slot for r in reqs], [len(r.tokens) for r in reqs]
        # one row: the verify's reads and writes are slices of the buffers (as in the draft pass)
        single = B == 1 and L_l[0] + g < self.cache_len  # the next token's place L+m (m <= γ) fits
        sl = None if single and not self._hybrid else self._slots(reqs)
        # the uniforms sit at places that do not depend on this round's γ: depth k's draft at k-1, its
        # test at G+k-1, the residual / bonus draw at 2G (G = the engine's γ), so a round at a smaller γ
        # (adaptive, or capped by the tokens left) draws a row's first tokens as a round at G does
        G = self.gamma
        u = round_uniforms([r.generator for r in reqs], 2 * G + 1, self.sampling_dtype, dev)
        # ---- 1. draft (each depth once, extending over its committed positions as it drafts)
        proc = self._processors(reqs)
        drafts, q = self._draft(slot_l, L_l, st, g, u[:, :g], proc)
        # ---- 2. verify over [x_{L-1}, d_1..d_γ]: the drafts already sit in ``tok`` after x_{L-1}
        b = make_batch_index(slot_l, [x - 1 for x in L_l], [g + 1] * B, dev, N=g + 1)
        b.keep_states = self._hybrid  # linear-attention states after every position, for the rollback
        s0, a = slot_l[0], L_l[0] - 1  # one row: its slot and first verified position
        ids = self.tok[s0: s0 + 1, a: a + g + 1] if single else self.tok[sl[:, None], b.positions]
        normed, mtp_in = self.model.trunk(ids, self.trunk_cache, b)
        if single:
            self.hid[s0: s0 + 1, a: a + g + 1] = mtp_in
        else:
            self.hid[sl[:, None], b.positions] = mtp_in.to(self.hid.dtype)
        logits = self.model.logits(normed)  # [B, γ+1, V]
        if proc is not None:  # position j follows the drafts d_1..d_j: they count as output there
            logits = torch.stack([proc.apply(logits[:, j], drafts[:, :j]) for j in range(g + 1)], dim=1)
        p = process_logits(logits.reshape(B * (g + 1), -1), st.expand(g + 1), self.sampling_dtype).view(B, g + 1, -1)
        res = verify_chain(p, q, drafts, "greedy" if st.all_greedy else mode,
                           uniforms=u[:, G:] if g == G else torch.cat([u[:, G: G + g], u[:, 2 * G:]], dim=1))
        num_acc, nxt = res.num_accepted, res.next_token
        m_l = res.host_num_accepted if res.host_num_accepted is not None else num_acc.tolist()
        self._keep_draft_entries(slot_l, L_l, m_l, g)
        if self._hybrid:  # x_{L-1}, d_1..d_m are committed, the bonus token is not processed yet:
            self.trunk_cache.rollback(sl, num_acc)  # linear-attention state := the one after d_m
        # drafts d_1..d_m stay in ``tok``; the next token goes after them (the rest is scratch)
        if single:
            self.tok[s0, a + 1 + m_l[0]: a + 2 + m_l[0]] = nxt
        else:
            self.tok[sl, b.positions[:, 1] + num_acc] = nxt
        # ---- 3. commit + metrics (the drafts and next tokens to the host: accepted drafts, then the next)
        d_l, nxt_l = drafts.tolist(), nxt.tolist()
        em_l = [d_l[i][: m_l[i]] + [nxt_l[i]] for i in range(B)]
        round_emit = 0
        for i, r in enumerate(reqs):
            m = m_l[i]
            left = r.params.max_new_tokens - len(r.output_ids)
            before, out_before = len(r.tokens), len(r.output_ids)
            self._commit(r, em_l[i][: m + 1], logits[i, : m + 1])
            n_emit = len(r.tokens) - before
            stop_at = next((j + 1 for j in range(min(m, n_emit)) if self._stops_at_token(r, em_l[i][j])), None)
            proposed, acc, reached = step_counts(g, m, n_emit, left, stop_at)
            if r.spec_record_topk:
                k = min(r.spec_record_topk, p.shape[-1])
                top = p[i, :g].topk(k, dim=-1)
                r.spec_records.append({"pos": before - 2, "accepted": acc, "topk_ids": top.indices.tolist(),
                                       "topk_probs": [[round(x, 6) for x in row] for row in top.values.tolist()]})
            r.verify_ct += 1
            r.gamma_sum += g
            if len(r.spec_histogram) <= acc:
                r.spec_histogram.extend([0] * (acc + 1 - len(r.spec_histogram)))
            r.spec_histogram[acc] += 1
            r.proposed += proposed
            r.accepted += acc
            for j in range(reached):  # draft j+1 reached: drafts 1..j accepted, j+1 proposed
                r.reached_per_depth[j] += 1
                self.total_reached_per_depth[j] += 1
                self._life_reach[j] += 1
            for j in range(acc):
                r.accepted_per_depth[j] += 1
                self.total_accepted_per_depth[j] += 1
                self._life_acc[j] += 1
            self.total_verify_ct += 1
            self.total_proposed_drafts += proposed
            self.total_accepted_drafts += acc
            # tokens this step kept: a stop string or regex cuts the output after it. Counted before
            # the request is published: its HTTP waiter reads meta_info the moment it is released
            reason = None if r.finished else self._done_reason(r)
            kept = max(min(n_emit, len(r.output_ids) - out_before), 0)
            r.verify_tokens += kept
            self.total_verify_tokens += kept
            round_emit += kept
            if not r.finished:
                self._publish(r, reason)
        if learn:  # not a round capped by the tokens left (``step``)
            self._chain_yield.setdefault(g, deque(maxlen=32)).append((round_emit, sum(m_l) + B))
        # running per-depth acceptance for the γ choice
        for j in range(g):  # lifetime counts (not reset by reset_stats), with a weak prior at 0.7
            self._alpha[j] = (self._life_acc[j] + 1.4) / (self._life_reach[j] + 2.0)

    @torch.no_grad()
    def _draft(self, slots, L, st: SamplingTensors, g: int, u: Tensor,
               proc: Optional[LogitProcessors] = None) -> tuple[Tensor, Tensor]:
        """γ drafts per row and the processed draft distributions q [B, γ, V] they came from.

        Depth k runs once over positions b_k..L-2 (all rows in one padded batch) and drafts from
        its output at L-2; see the module docstring. ``slots`` and ``L`` (committed tokens per row)
        are host lists (tensors are accepted): every position and index of the round is worked
        out on the host, and the device sees one index tensor per gather, as vLLM's and SGLang's
        CPU-side batch metadata do. Draft d_k is written to ``tok`` at L+k-1 (scratch past the
        committed tokens), so the next depths and the verify read their ids with one gather. A
        single row has no padding: its reads and writes are slices of the buffers (no index tensor,
        no gather), which is what batch 1 is bound by. The depths' valid ends and carries are left as
        they were: ``_keep_draft_entries`` sets them after the verify, from the outputs kept in
        ``_draft_tails`` (so a draft pass without a verify changes no depth state)."""
        dev, cl = self.device, self.cache_len
        slot_l = [int(x) for x in (slots.tolist() if isinstance(slots, Tensor) else slots)]
        L_l = [int(x) for x in (L.tolist() if isinstance(L, Tensor) else L)]
        B = len(slot_l)
        sl = torch.tensor(slot_l, dtype=torch.long, device=dev)
        starts = self._depth_starts(slot_l, g)
        self._draft_positions = 0  # positions per row the depths run over (padded): prices the catch-up
        # per depth k: (its output at L-1-k..L-2 [B, k, h], its first position per row): after the
        # verify, _keep_draft_entries takes the last exact one of them as the depth's carry
        self._draft_tails: list = [None]
        # one row (no padding): every read and write of a depth is a slice of the buffers, not a gather
        single = B == 1 and L_l[0] + g <= cl
        d_cols, q_rows = [], []
        prev_out, prev_start, prev_N = None, None, 0
        # [B, γ+1, h]: depth k-1's output at valid[k-1]-1 (set by the last keep; the pass does not
        # move it, so no copy is needed: a view for one row, one gather for more)
        carry = self.carry[slot_l[0]: slot_l[0] + 1] if single else self.carry[sl]
        h = self.hid.shape[-1]
        for k in range(1, g + 1):
            start = starts[k - 1]
            n = [L_l[i] - 1 - start[i] for i in range(B)]
            N = max(n)
            self._draft_positions += N
            if single:
                s0, b0 = slot_l[0], start[0]
                if k == 1:  # trunk hidden at b0..L-2
                    H = self.hid[s0: s0 + 1, b0: b0 + N]
                elif b0 >= prev_start[0]:  # depth k-1's output at the same positions
                    H = prev_out[:, b0 - prev_start[0]: b0 - prev_start[0] + N]
                else:  # one position earlier: depth k-1's carry, then its output
                    H = torch.cat([carry[:, k - 1: k], prev_out], dim=1)
                ids = self.tok[s0: s0 + 1, b0 + k: b0 + k + N]
            else:
                # one host-built index tensor per depth: [hidden rows | token ids | last row | d_k's place | tail rows]
                if k == 1:  # trunk hidden at s (flat index into hid)
                    h_idx = [slot_l[i] * cl + min(start[i] + j, cl - 1) for i in range(B) for j in range(N)]
                else:  # depth k-1's output at s: its carry (offset 0) or this round's output (offset >= 1)
                    w = prev_N + 1
                    h_idx = [i * w + min(start[i] - prev_start[i] + 1 + j, prev_N) for i in range(B) for j in range(N)]
                t_idx = [slot_l[i] * cl + min(start[i] + j + k, cl - 1) for i in range(B) for j in range(N)]
                last = [i * N + n[i] - 1 for i in range(B)]
                tok_dst = [slot_l[i] * cl + L_l[i] + k - 1 for i in range(B)]  # d_k's scratch place in tok
                # the output at L-1-k..L-2 (index n-k..n-1; clamped where the pass started later, which
                # _keep_draft_entries never reads): the last committed position, then the draft-fed ones
                tail = [i * N + max(n[i] - k + t, 0) for i in range(B) for t in range(k)]
                idx = torch.tensor(h_idx + t_idx + last + tok_dst + tail, dtype=torch.long, device=dev)
                h_i, t_i, last_i, tok_i, tail_i = idx.split([B * N, B * N, B, B, len(tail)])
                if k == 1:
                    H = self.hid.view(-1, h).index_select(0, h_i).view(B, N, h)
                else:
                    P = torch.cat([carry[:, k - 1: k], prev_out], dim=1).view(-1, h)
                    H = P.index_select(0, h_i).view(B, N, h)
                ids = self.tok.view(-1).index_select(0, t_i).view(B, N)
            b = make_batch_index(slot_l, start, n, dev, N=N)
            out = self.model.mtp_step(k - 1, H, ids, self.mtp_caches[k - 1], b)
            if single:
                h_last = out[:, n[0] - 1]
                lo = n[0] - k  # the output at L-1-k..L-2 (left-padded where the pass started later)
                tail = out[:, lo: n[0]] if lo >= 0 else F.pad(out[:, : n[0]], (0, 0, -lo, 0))
            else:
                flat = out.view(-1, h)
                tail = flat.index_select(0, tail_i).view(B, k, h)
                h_last = flat.index_select(0, last_i)
            if self.draft_ids is None:
                zk = self.model.logits(h_last)
                if proc is not None:  # not needed for exactness (any q is), but raises acceptance
                    prior = torch.stack(d_cols, dim=1) if d_cols else torch.zeros(B, 0, dtype=torch.long, device=dev)
                    zk = proc.apply(zk, prior)
                qk = process_logits(zk, st, self.sampling_dtype)
            else:  # the map's N rows of the LM head only; q is 0 off the map
                qk = reduced_draft_probs(h_last, self._draft_head(), self.draft_ids, self.model.config.vocab_size,
                                         st, self.sampling_dtype)
            q_rows.append(qk)
            if self.spec.verify == "rejection" and not st.all_greedy:
                d = sample_with_uniform(qk, u[:, k - 1])
                if st.any_greedy:
                    d = torch.where((st.temperature <= 0).to(dev), qk.argmax(-1), d)
            else:
                d = qk.argmax(-1)
            d_cols.append(d)
            # d_k goes to ``tok`` after the committed tokens: read back as ids by depth k+1 and the verify
            if single:
                self.tok[s0, L_l[0] + k - 1: L_l[0] + k].copy_(d)
            else:
                self.tok.view(-1).index_copy_(0, tok_i, d)
            prev_out, prev_start, prev_N = out, start, N
            self._draft_tails.append((tail, start))
        return torch.stack(d_cols, dim=1), torch.stack(q_rows, dim=1)

    def _keep_draft_entries(self, slot_l: list[int], L_l: list[int], m_l: list[int], g: int) -> None:
        """After a verify that accepted m_i drafts in row i: depth k's entries up to position
        p = L-k-1+min(m_i, k-1) read only committed tokens (x_{L-1} and the accepted drafts), so
        they are exact. Set valid[k] to p+1 and ``carry[k]`` to the draft pass's output at p (the
        tail entry min(m_i, k-1)), for every depth the pass ran. The pass covers p: it starts at
        most at max(L-k-1, 0), where the last keep (or a prefill) left valid[k]; only a row of at
        most k tokens has p < 0 (no output there; valid[k] stays 0). Carry rows are strided by
        the engine's γ, not the round's. One row: a copy per depth; more: one copy for every depth
        and row, from the depths' tails side by side, by one host-built index (source rows, then carry rows)."""
        tails, self._draft_tails = self._draft_tails, [None]  # used once: not kept across rounds
        h = self.carry.shape[-1]
        carry = self.carry.view(-1, h)
        B = len(slot_l)
        src, dst, base = [], [], 0  # tail rows (all depths' [B * k] rows in turn) -> carry rows
        local = []  # the same tail rows, as (depth, row within that depth's tail)
        for k in range(1, g + 1):
            start = tails[k][1]
            for i, s in enumerate(slot_l):
                j = min(m_l[i], k - 1)
                p = L_l[i] - k - 1 + j  # the last exact position
                self.valid[s][k] = max(p + 1, 0)
                if p >= max(start[i], 0):
                    src.append(base + i * k + j)
                    dst.append(s * (self.gamma + 1) + k)
                    local.append((k, i * k + j))
            base += B * k
        if not src:
            return
        flat = [None] + [tails[k][0].reshape(-1, h) for k in range(1, g + 1)]
        if B == 1:  # one row: a slice copy per depth (its carry rows s·(γ+1)+k)
            for (k, row), d in zip(local, dst):
                carry[d].copy_(flat[k][row])
            return
        idx = torch.tensor(src + dst, dtype=torch.long, device=self.device)
        every = torch.cat(flat[1:]) if g > 1 else flat[1]
        carry.index_copy_(0, idx[len(src):], every.index_select(0, idx[: len(src)]))

    def _draft_head(self) -> Tensor:
        """LM-head rows of the draft token map [N, h], sliced once and again only after the
        weights change (an in-place update bumps the parameter's version counter)."""
        m = self.model
        w = m.embed_tokens.weight if m.lm_head is None else m.lm_head.weight
        key = (w.data_ptr(), w._version, w.dtype, w.device)
        if key != self._draft_head_key:
            self._draft_head_rows = w.detach().index_select(0, self.draft_ids).contiguous()
            self._draft_head_key = key
        return self._draft_head_rows

    def _commit(self, r: Request, tokens: list[int], logits_rows: Tensor) -> None:
        lp = top = fixed = None
        if r.return_logprob:
            lsm = self._log_probs(r, logits_rows[: len(tokens)])
            lp = lsm.gather(-1, torch.tensor(tokens, device=lsm.device)[:, None]).squeeze(-1).tolist()
            top = self._top(lsm, r.top_logprobs_num) if r.top_logprobs_num else None
            fixed = self._fixed(lsm, r.token_ids_logprob) if r.token_ids_logprob is not None else None
        for j, tok in enumerate(tokens):
            r.tokens.append(tok)
            r.output_ids.append(tok)
            if top is not None:
                r.output_top_logprobs.append(top[j])
            if fixed is not None:
                r.output_token_ids_logprobs.append(fixed[j])
            if r.counts is not None:
                r.counts[tok] += 1
            if lp is not None:
                r.output_logprobs.append(lp[j])
            self.total_generated += 1
            if self._stops_at_token(r, tok) or len(r.output_ids) >= r.params.max_new_tokens:
                # drop anything drafted past the stop
                break

    def _stops_at_token(self, r: Request, tok: int) -> bool:
        if tok in r.params.stop_token_ids:
            return True
        return (not r.params.ignore_eos) and self.eos_id is not None and tok == self.eos_id

    def _check_done(self, r: Request) -> None:
        if not r.finished:
            self._publish(r, self._done_reason(r))

    def _publish(self, r: Request, reason: Optional[dict]) -> None:
        """Release a finished request, else tell its listener about progress. Its waiter (another
        thread) reads the request as soon as this runs, so every counter must be final before."""
        if reason is not None:
            self._release(r, reason)
        else:
            self._notify(r)

    def _done_reason(self, r: Request) -> Optional[dict]:
        """Why ``r`` is finished (trimming its output at a stop string or regex), or None."""
        last = r.output_ids[-1] if r.output_ids else None
        if last is not None and self._stops_at_token(r, last):
            return {"type": "stop", "matched": last}
        matched = self._trim_at_stop_string(r) if r.params.stop and self.tokenizer is not None else None
        if matched is None and r.params.stop_regex and self.tokenizer is not None:
            matched = self._trim_at_stop_regex(r)
            if isinstance(matched, dict):
                return matched
        if matched is not None:
            return {"type": "stop", "matched": matched}
        if len(r.output_ids) >= r.params.max_new_tokens or len(r.tokens) + self.gamma + 1 >= self.max_len:
            return {"type": "length", "length": len(r.output_ids)}
        return None

    def _trim_at_stop_string(self, r: Request) -> Optional[str]:
        """The stop string the output contains (output trimmed to the shortest token prefix that
        contains it), or None."""
        text = self.tokenizer.decode(r.output_ids)
        for s in r.params.stop:
            if s in text:
                for n in range(1, len(r.output_ids) + 1):
                    if s in self.tokenizer.decode(r.output_ids[:n]):
                        self._truncate(r, n)
                        break
                return s
        return None

    STOP_REGEX_BUDGET_S = 0.05  # per request and step: a pathological pattern aborts its request alone

    def _trim_at_stop_regex(self, r: Request):
        """The first stop_regex pattern that the decoded output matches (SGLang reports the pattern
        as ``matched``), with the output trimmed to the shortest token prefix that matches; None if
        none matches; a dict abort reason if the search ran past its time budget."""
        deadline = time.monotonic() + self.STOP_REGEX_BUDGET_S

        def search(pat: str, text: str) -> bool:
            return regex.search(pat, text, timeout=max(deadline - time.monotonic(), 1e-4)) is not None

        try:  # every prefix ending in a token new since the last check (an end-anchored pattern can
            # match after a draft accepted mid-step only), shortest first, as plain decoding would stop
            for n in range(r.stop_regex_checked + 1, len(r.output_ids) + 1):
                text = self.tokenizer.decode(r.output_ids[:n])
                for pat in r.params.stop_regex:
                    if search(pat, text):
                        self._truncate(r, n)
                        return pat
            r.stop_regex_checked = len(r.output_ids)
        except TimeoutError:
            return {"type": "abort", "message": "stop_regex search exceeded its time budget",
                    "status_code": 400, "err_type": "BadRequestError"}
        return None

    @staticmethod
    def _truncate(r: Request, n: int) -> None:
        for xs in (r.output_ids, r.output_logprobs, r.output_top_logprobs, r.output_token_ids_logprobs):
            del xs[n:]

    def _release(self, r: Request, reason: dict) -> None:
        if r in self.running:
            self.running.remove(r)
            self._spec_version += 1  # other rows: the horizon (a median) and the catch-up (a max) move
        if r.slot >= 0:
            self.free_slots.append(r.slot)
            r.slot = -1
        self._finish(r, reason)

    def _finish(self, r: Request, reason: dict) -> None:
        r.finish_reason = reason
        self._notify(r)
        r.done.set()

    @staticmethod
    def _notify(r: Request) -> None:
        """Progress callback (streaming); a vanished listener must never break the engine."""
        if r.on_update is not None:
            try:
                r.on_update(r)
            except Exception:
                r.on_update = None

    # ------------------------------------------------------------------ control
    def retract_all(self) -> int:
        """Move running requests back to the queue (their KV is dropped; output is kept and
        re-prefilled), e.g. before a weight update so that no KV from old weights is reused."""
        with self.lock:
            n = len(self.running)
            for r in reversed(self.running):
                r.retractions += 1
                self.free_slots.append(r.slot)
                r.slot = -1
                self.waiting.appendleft(r)
            self.running = []
            return n

    def update_weights(self, tensors: dict[str, Tensor], version: Optional[str] = None) -> list[str]:
        """Load HF-named tensors (trunk and MTP) between steps."""
        with self.lock:
            loaded = self.model.load_hf_state_dict(tensors, strict=False)
            if version is not None:
                self.set_weight_version(str(version))
            return loaded

    def set_weight_version(self, version: str) -> None:
        """Change the version label; in-flight requests with output record where the old one ended
        (SGLang's weight-version spans)."""
        with self.lock:
            for r in list(self.running) + list(self.waiting):
                if r.output_ids:
                    r.weight_events.append((self.weight_version, len(r.output_ids)))
            self.weight_version = version

    @staticmethod
    def weight_version_spans(r: Request, current: str) -> list[dict]:
        """``[{version, start, end}]`` over the output tokens, as SGLang's meta_info weight_versions."""
        n = len(r.output_ids)
        spans: list[dict] = []
        for version, end in list(r.weight_events) + [(current, n)]:
            end = min(end, n)
            if spans and end <= spans[-1]["end"]:
                continue
            if spans and spans[-1]["version"] == version:
                spans[-1]["end"] = end
                continue
            spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
        return [sp for sp in spans if sp["start"] < n or sp["start"] == 0]

    def stats(self) -> dict:
        ver = self.total_verify_ct
        g = self.gamma
        reached = self.total_reached_per_depth
        return {
            "spec_verify_ct": ver,
            # tokens emitted by verify steps / verify steps (the prefill's token is not a verify token)
            "avg_spec_accept_length": self.total_verify_tokens / ver if ver else 0.0,
            # accepted / drafts that could still be emitted
            "spec_accept_rate": self.total_accepted_drafts / max(self.total_proposed_drafts, 1),
            "spec_accepted_drafts": self.total_accepted_drafts,
            "spec_proposed_drafts": self.total_proposed_drafts,
            "spec_accepted_per_depth": list(self.total_accepted_per_depth),
            "spec_reached_per_depth": list(reached),
            "spec_alpha_per_depth": [a / r if r else 0.0 for a, r in zip(self.total_accepted_per_depth, reached)],
            "spec_gamma_max": g,
            "spec_gamma_last": self.last_gamma if g else 0,
            "spec_gamma_hist": list(self.gamma_hist),
            "spec_plain_steps": self.total_plain_steps,
            "spec_draft_vocab_size": int(self.draft_ids.numel()) if self.draft_ids is not None else None,
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "total_generated_tokens": self.total_generated,
        }

    def reset_stats(self) -> None:
        """Zero the cumulative counters (a benchmark's warm-up must not count); the adaptive-γ
        cost and acceptance estimates are kept, as a server keeps what it measured."""
        self.total_verify_ct = self.total_generated = self.total_accepted_drafts = self.total_proposed_drafts = 0
        self.total_verify_tokens = self.total_plain_steps = 0
        self.total_accepted_per_depth = [0] * self.gamma
        self.total_reached_per_depth = [0] * self.gamma
        self.gamma_hist = [0] * (self.gamma + 1)  # rounds run at each γ


def step_counts(gamma: int, num_accepted: int, emitted: int, tokens_left: int,
                stop_at: Optional[int]) -> tuple[int, int, int]:
    """Acceptance counters of one verify step: (proposed, accepted, reached depths).

    ``num_accepted`` drafts were accepted by the verifier, ``emitted`` tokens were committed
    (fewer when the request ended inside the step), ``tokens_left`` could still be emitted before
    the step, ``stop_at`` is the 1-based index of an accepted draft that is a stop token (None if
    none). Proposed = drafts that could still be emitted: not past the length limit, not past an
    accepted stop. Depth k is reached when drafts 1..k-1 were accepted and draft k was proposed."""
    proposed = min(gamma, tokens_left)
    if stop_at is not None:
        proposed = min(proposed, stop_at)
    accepted = min(num_accepted, emitted, proposed)
    reached = min(proposed, accepted + 1)
    return proposed, accepted, reached


def _pad(rows: list[list[int]], device=None) -> Tensor:
    N = max(1, max(len(r) for r in rows))
    out = torch.zeros(len(rows), N, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out.to(device)
