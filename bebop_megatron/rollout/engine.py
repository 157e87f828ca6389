"""Embedded generation engine: continuous batching, optional MTP speculative decoding.

State of a running request with committed tokens x_0..x_{L-1} (prompt + output):
  * the trunk's KV cache holds positions 0..L-2 (x_{L-1}, the newest token, is not processed yet);
  * MTP depth k (1-based) holds positions 0..L-1-k: position s was computed from the depth-(k-1)
    hidden at s and the embedding of x_{s+k} (megatron-core's MTP layer, run causally), and
    ``carry[k]`` keeps depth k's output at its last position.

A speculative round:
  1. draft: d_1 from depth 1's carry (position L-2, token x_{L-1}); depth k ≥ 2 runs its k-1
     positions L-k..L-2 whose token lies beyond x_{L-1}, feeding the drafts d_1..d_{k-1} — so
     when the earlier drafts are accepted, q_k is exactly the distribution MTP training saw;
     these entries are scratch (overwritten later);
  2. verify: one trunk forward over [x_{L-1}, d_1..d_γ] gives p at γ+1 positions; drafts are
     accepted by rejection sampling (or target_only / greedy) and one more token is drawn;
  3. commit the accepted tokens and extend each MTP depth over its newly complete positions with
     the real tokens (depth k reuses depth k-1's outputs, starting from its carry).
Without speculation a round is one trunk forward over [x_{L-1}].
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

from bebop_megatron.rollout.modeling import CausalLMWithMTP, KVCache, make_batch_index
from bebop_megatron.rollout.sampling import SamplingTensors, draft_tokens, process_logits, sample_rows, verify_chain


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


@dataclass
class SpecConfig:
    algorithm: str = "none"  # none | mtp
    num_draft_tokens: int = 3  # γ
    verify: str = "rejection"  # rejection | target_only (temperature 0 always verifies greedily)

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
    proposed: int = 0
    accepted: int = 0
    created: float = field(default_factory=time.time)
    done: threading.Event = field(default_factory=threading.Event)
    on_update: Optional[Callable[["Request"], None]] = None
    aborted: bool = False
    # GrowMTP: per verify step, the MTP position t (x_{t+1} was the newest committed token), the
    # drafts accepted, and the verifier's target distribution per depth as top-k ids/probs
    spec_record_topk: int = 0
    spec_records: list[dict] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Engine:
    def __init__(self, model: CausalLMWithMTP, tokenizer=None, spec: Optional[SpecConfig] = None,
                 max_running: int = 32, max_len: int = 2048, weight_version: str = "default"):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.spec = spec or SpecConfig()
        self.spec.validate(model)
        self.max_running = max_running
        self.max_len = max_len
        self.weight_version = weight_version
        self.gamma = self.spec.num_draft_tokens if self.spec.algorithm == "mtp" else 0
        self.trunk_cache = model.new_cache(max_running, max_len + self.gamma + 2, "trunk")
        self.mtp_caches: list[KVCache] = [model.new_cache(max_running, max_len + self.gamma + 2, "mtp")
                                          for _ in range(self.gamma)]
        self.free_slots = list(range(max_running))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.lock = threading.RLock()
        self._rid = itertools.count()
        self.eos_id = model.config.eos_token_id
        if self.eos_id is None and tokenizer is not None:
            self.eos_id = getattr(tokenizer, "eos_token_id", None) or getattr(tokenizer, "eos_id", None)
        # cumulative stats (SGLang's /get_server_info internal_states)
        self.total_verify_ct = 0
        self.total_generated = 0
        self.total_accepted_drafts = 0
        self.total_proposed_drafts = 0

    # ------------------------------------------------------------------ requests
    def add_request(self, input_ids: list[int], params: SamplingParams, rid: Optional[str] = None,
                    return_logprob: bool = False, on_update=None, spec_record_topk: int = 0) -> Request:
        params.validate()
        if not isinstance(spec_record_topk, int) or spec_record_topk < 0 or spec_record_topk > 64:
            raise RequestError(f"spec_record_topk must be an integer in [0, 64], got {spec_record_topk!r}")
        if not input_ids:
            raise RequestError("empty prompt: input_ids must hold at least one token")
        V = self.model.config.vocab_size
        bad = [t for t in input_ids if not isinstance(t, int) or t < 0 or t >= V]
        if bad:
            raise RequestError(f"token ids out of range [0, {V}): {bad[:5]}")
        if len(input_ids) + params.max_new_tokens > self.max_len:
            raise RequestError(f"prompt ({len(input_ids)}) + max_new_tokens ({params.max_new_tokens}) "
                               f"exceeds the context length {self.max_len}")
        req = Request(rid=rid or f"req-{next(self._rid)}", input_ids=list(input_ids), params=params,
                      return_logprob=return_logprob, on_update=on_update, spec_record_topk=spec_record_topk)
        g = torch.Generator()
        g.manual_seed(params.seed if params.seed is not None else torch.randint(0, 2**62, ()).item())
        req.generator = g
        with self.lock:
            if params.max_new_tokens == 0:
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
    def step(self) -> None:
        """One scheduling round: reap aborts, admit + prefill new requests, decode the rest."""
        with self.lock:
            for req in list(self.waiting):
                if req.aborted:
                    self.waiting.remove(req)
                    self._finish(req, {"type": "abort", "message": "aborted"})
            for req in list(self.running):
                if req.aborted:
                    self._release(req, {"type": "abort", "message": "aborted"})
            decoding = list(self.running)
            admitted = []
            while self.waiting and self.free_slots:
                req = self.waiting.popleft()
                req.slot = self.free_slots.pop()
                admitted.append(req)
            if admitted:
                self.running.extend(admitted)
                self._prefill(admitted)
            if decoding:
                if self.gamma:
                    self._speculative_round(decoding)
                else:
                    self._plain_round(decoding)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 return_logprob: bool = False) -> list[Request]:
        """Blocking convenience: run the loop until all given prompts finish."""
        plist = params if isinstance(params, list) else [SamplingParams(**vars(params)) for _ in prompts]
        reqs = [self.add_request(p, sp, return_logprob=return_logprob) for p, sp in zip(prompts, plist)]
        while not all(r.finished for r in reqs):
            self.step()
        return reqs

    # ------------------------------------------------------------------ internals
    def _sampling(self, reqs: list[Request]) -> SamplingTensors:
        return SamplingTensors.build([r.params for r in reqs])

    def _prefill(self, reqs: list[Request]) -> None:
        for r in reqs:
            r.tokens = list(r.input_ids) + list(r.output_ids)  # retracted requests keep their output
            r.carry = [None] * (self.gamma + 1)
            r.accepted_per_depth = r.accepted_per_depth or [0] * self.gamma
        ctx = [r.tokens for r in reqs]
        b = make_batch_index([r.slot for r in reqs], [0] * len(reqs), [len(c) for c in ctx], "cpu")
        ids = _pad(ctx)
        normed, mtp_in = self.model.trunk(ids, self.trunk_cache, b)
        lens = torch.tensor([len(c) for c in ctx])
        last = normed[torch.arange(len(reqs)), lens - 1]
        logits = self.model.logits(last)
        # sample x_L from the prompt's last position; then the state is "trunk holds 0..L-2"
        new_tokens = self._sample(reqs, logits)
        alive, hid = [], []
        for i, r in enumerate(reqs):
            self._commit(r, [int(new_tokens[i])], [logits[i]])
            self._check_done(r)
            if not r.finished:
                alive.append(r)
                hid.append(mtp_in[i, : lens[i]])
        if self.gamma and alive:
            self._extend_mtp(alive, hid, old_len=[0] * len(alive))

    def _sample(self, reqs: list[Request], logits: Tensor) -> Tensor:
        probs = process_logits(logits, self._sampling(reqs))
        return sample_rows(probs, [r.generator for r in reqs])

    def _plain_round(self, reqs: list[Request]) -> None:
        L = [len(r.tokens) for r in reqs]
        b = make_batch_index([r.slot for r in reqs], [n - 1 for n in L], [1] * len(reqs), "cpu")
        ids = torch.tensor([[r.tokens[-1]] for r in reqs])
        normed, _ = self.model.trunk(ids, self.trunk_cache, b)
        logits = self.model.logits(normed[:, 0])
        toks = self._sample(reqs, logits)
        for i, r in enumerate(reqs):
            self._commit(r, [int(toks[i])], [logits[i]])
            self._check_done(r)

    def _speculative_round(self, reqs: list[Request]) -> None:
        g = self.gamma
        B = len(reqs)
        st = self._sampling(reqs)
        greedy = st.temperature <= 0
        mode = self.spec.verify
        gens = [r.generator for r in reqs]
        # ---- 1. draft
        drafts, q = self._draft(reqs, st)
        # ---- 2. verify
        L = [len(r.tokens) for r in reqs]
        b = make_batch_index([r.slot for r in reqs], [n - 1 for n in L], [g + 1] * B, "cpu")
        ids = torch.cat([torch.tensor([[r.tokens[-1]] for r in reqs]), drafts], dim=1)
        normed, mtp_in = self.model.trunk(ids, self.trunk_cache, b)
        logits = self.model.logits(normed)  # [B, γ+1, V]
        p = process_logits(logits.reshape(B * (g + 1), -1), st.expand(g + 1)).view(B, g + 1, -1)
        num_acc = torch.zeros(B, dtype=torch.long)
        nxt = torch.zeros(B, dtype=torch.long)
        for sel_mode, sel in (("greedy", greedy), (mode, ~greedy)):
            idx = sel.nonzero(as_tuple=True)[0]
            if len(idx) == 0:
                continue
            res = verify_chain(p[idx], q[idx], drafts[idx], sel_mode, [gens[i] for i in idx.tolist()])
            num_acc[idx], nxt[idx] = res.num_accepted, res.next_token
        # ---- 3. commit + extend
        hid, old_len, alive = [], [], []
        for i, r in enumerate(reqs):
            m = int(num_acc[i])
            emitted = drafts[i, :m].tolist() + [int(nxt[i])]
            before = len(r.tokens)
            self._commit(r, emitted, [logits[i, j] for j in range(m + 1)])
            # drafts past a stop token or the length limit are discarded, not accepted
            m = min(m, len(r.tokens) - before)
            if r.spec_record_topk:
                k = min(r.spec_record_topk, p.shape[-1])
                top = p[i, :g].topk(k, dim=-1)
                r.spec_records.append({"pos": L[i] - 2, "accepted": m, "topk_ids": top.indices.tolist(),
                                       "topk_probs": [[round(x, 6) for x in row] for row in top.values.tolist()]})
            r.verify_ct += 1
            r.proposed += g
            r.accepted += m
            for j in range(m):
                r.accepted_per_depth[j] += 1
            self.total_verify_ct += 1
            self.total_proposed_drafts += g
            self.total_accepted_drafts += m
            self._check_done(r)
            if not r.finished:
                hid.append(mtp_in[i, : len(r.tokens) - before])
                old_len.append(before)
                alive.append(r)
        if alive:
            self._extend_mtp(alive, hid, old_len)

    def _draft(self, reqs: list[Request], st: SamplingTensors) -> tuple[Tensor, Tensor]:
        """γ drafts per request and the processed draft distributions q [B, γ, V] they came from.
        Depth k's draft comes from its output at position L-2."""
        g, B = self.gamma, len(reqs)
        greedy = st.temperature <= 0
        mode = self.spec.verify
        gens = [r.generator for r in reqs]
        drafts = torch.zeros(B, g, dtype=torch.long)
        q_rows = []
        scratch = [r.carry[1].new_zeros(0, r.carry[1].shape[-1]) for r in reqs]  # depth-1 scratch: none
        for k in range(1, g + 1):
            if k == 1:
                h_last = torch.stack([r.carry[1] for r in reqs])
            else:
                rows_h, rows_ids, starts, counts = [], [], [], []
                for i, r in enumerate(reqs):
                    L = len(r.tokens)
                    start = max(0, L - k)  # scratch positions start..L-2 of depth k
                    n = (L - 1) - start
                    parts = ([r.carry[k - 1].unsqueeze(0)] if L - k >= 0 else []) + [scratch[i]]
                    rows_h.append(torch.cat(parts)[-n:])
                    rows_ids.append(drafts[i, : k - 1].tolist()[-n:])  # x_{s+k} are drafts here
                    starts.append(start)
                    counts.append(n)
                b = make_batch_index([r.slot for r in reqs], starts, counts, "cpu")
                out = self.model.mtp_step(k - 1, _pad_h(rows_h), _pad(rows_ids), self.mtp_caches[k - 1], b)
                scratch = [out[i, : counts[i]] for i in range(B)]
                h_last = torch.stack([out[i, counts[i] - 1] for i in range(B)])
            q = process_logits(self.model.logits(h_last), st)
            q_rows.append(q)
            drafts[:, k - 1] = torch.where(greedy, q.argmax(-1), draft_tokens(q, mode, gens))
        return drafts, torch.stack(q_rows, dim=1)

    def _extend_mtp(self, reqs: list[Request], trunk_hidden: list[Tensor], old_len: list[int]) -> None:
        """After tokens were committed (old_len -> len(tokens) per request), extend every MTP depth
        over its newly complete positions with the real tokens.

        Depth k covers [max(0, old-k), max(0, L-k)) (depth 1: the trunk's new positions
        [max(0, old-1), L-1), whose hidden states are ``trunk_hidden``); depth k's inputs are depth
        k-1's outputs at those positions: its new outputs, preceded by its previous carry.
        """
        old_carry = [list(r.carry) for r in reqs]
        prev = trunk_hidden
        prev_start = [max(0, o - 1) for o in old_len]
        for k in range(1, self.gamma + 1):
            rows_h, rows_ids, starts, counts = [], [], [], []
            for i, r in enumerate(reqs):
                L = len(r.tokens)
                start, end = max(0, old_len[i] - k), max(0, L - k)
                avail, a0 = prev[i], prev_start[i]
                if start < a0:  # the first needed input is depth k-1's previous last output
                    avail = torch.cat([old_carry[i][k - 1].unsqueeze(0), avail])
                    a0 -= 1
                rows_h.append(avail[start - a0: end - a0])
                rows_ids.append(r.tokens[start + k: end + k])
                starts.append(start)
                counts.append(end - start)
            active = [i for i, n in enumerate(counts) if n > 0]
            new_prev = [torch.zeros(0, self.model.config.hidden_size) for _ in reqs]
            if active:
                b = make_batch_index([reqs[i].slot for i in active], [starts[i] for i in active],
                                     [counts[i] for i in active], "cpu")
                out = self.model.mtp_step(k - 1, _pad_h([rows_h[i] for i in active]),
                                          _pad([rows_ids[i] for i in active]), self.mtp_caches[k - 1], b)
                for j, i in enumerate(active):
                    new_prev[i] = out[j, : counts[i]]
                    reqs[i].carry[k] = new_prev[i][-1]
            prev, prev_start = new_prev, starts

    def _commit(self, r: Request, tokens: list[int], logits_rows: list[Tensor]) -> None:
        lp = None
        if r.return_logprob:
            t = r.params.temperature if r.params.temperature > 0 else 1.0
            lp = [torch.log_softmax(row.double() / t, -1)[tok].item() for row, tok in zip(logits_rows, tokens)]
        for j, tok in enumerate(tokens):
            r.tokens.append(tok)
            r.output_ids.append(tok)
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
        if r.finished:
            return
        last = r.output_ids[-1] if r.output_ids else None
        if last is not None and self._stops_at_token(r, last):
            self._release(r, {"type": "stop", "matched": last})
            return
        matched = self._trim_at_stop_string(r) if r.params.stop and self.tokenizer is not None else None
        if matched is not None:
            self._release(r, {"type": "stop", "matched": matched})
        elif len(r.output_ids) >= r.params.max_new_tokens:
            self._release(r, {"type": "length", "length": len(r.output_ids)})
        elif len(r.tokens) + self.gamma + 1 >= self.max_len:
            self._release(r, {"type": "length", "length": len(r.output_ids)})
        else:
            self._notify(r)

    def _trim_at_stop_string(self, r: Request) -> Optional[str]:
        """The stop string the output contains (output trimmed to the shortest token prefix that
        contains it), or None."""
        text = self.tokenizer.decode(r.output_ids)
        for s in r.params.stop:
            if s in text:
                for n in range(1, len(r.output_ids) + 1):
                    if s in self.tokenizer.decode(r.output_ids[:n]):
                        del r.output_ids[n:]
                        del r.output_logprobs[n:]
                        break
                return s
        return None

    def _release(self, r: Request, reason: dict) -> None:
        if r in self.running:
            self.running.remove(r)
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
                self.weight_version = str(version)
            return loaded

    def stats(self) -> dict:
        ver = max(self.total_verify_ct, 1)
        return {
            "spec_verify_ct": self.total_verify_ct,
            "avg_spec_accept_length": (self.total_accepted_drafts + self.total_verify_ct) / ver
            if self.total_verify_ct else 0.0,
            "spec_accept_rate": self.total_accepted_drafts / max(self.total_proposed_drafts, 1),
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "total_generated_tokens": self.total_generated,
        }


def _pad(rows: list[list[int]]) -> Tensor:
    N = max(1, max(len(r) for r in rows))
    out = torch.zeros(len(rows), N, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def _pad_h(rows: list[Tensor]) -> Tensor:
    N = max(1, max(r.shape[0] for r in rows))
    h = rows[0].shape[-1]
    out = torch.zeros(len(rows), N, h, dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out
