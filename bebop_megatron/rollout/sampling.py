"""Sampling-parameter processing and speculative chain verification for γ MTP drafts.

Verification modes (all lossless: the emitted tokens are distributed exactly as sampling from
the target p token by token):

* ``rejection`` (default, the Bebop recipe): drafts are *sampled* from q (q processed with the
  same temperature/top-k/top-p/min-p as p); draft j is accepted with probability
  min(1, p_j(x)/q_j(x)); at the first rejection the next token is drawn from
  norm(max(0, p_j - q_j)) and the chain stops; if all γ are accepted a bonus token is drawn from
  p_{γ+1}. Acceptance per draft is Σ_v min(p, q) = 1 - TV(p, q).
* ``target_only`` (SGLang without rejection sampling): the draft is argmax q, accepted with
  probability p(x); on rejection the next token is drawn from p with x removed. Acceptance is
  p(argmax q), which falls as the policy's entropy rises.
* ``greedy`` (temperature 0): accept while the draft equals argmax p; bit-identical to argmax
  decoding given the same logits.

Randomness is per request: every row draws its uniforms from its own ``torch.Generator``, so a
request's tokens do not depend on what else is in the batch.

Reduced-vocabulary drafts (FR-Spec, SGLang's ``--speculative-token-map``): the draft
distribution is computed over a token map of N ids only (``reduced_draft_probs``: the N rows of
the LM head, then the same processing) and scattered onto the full vocabulary, zero off the map;
``reduced_draft_probs_reference`` is the float64 pure-torch reference (full-vocab logits, off-map
logits set to -inf). Verification is unchanged: any draft law q works, the residual
max(0, p - q) is p itself off the map (see bebop_megatron/rollout/engine.py).

Two precisions: the float64 reference (``process_logits(..., dtype=torch.float64)``, uniforms
drawn per call from the generators) and the float32 fast path the engine uses (softmax, inverse
CDF and the acceptance test in float32, all uniforms of a round given as one tensor drawn with
one call per request: ``round_uniforms``). Both are exact samplers of the target law up to
their floating-point rounding; the statistical tests run on both.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from bebop_megatron.rollout.modeling import _arange  # the cached per-device arange the batch index uses

VERIFY_MODES = ("rejection", "target_only", "greedy")


@dataclass
class SamplingTensors:
    """Per-row sampling parameters as tensors (temperature 0 means greedy), with host-side flags.

    The flags (vLLM's SamplingMetadata idiom: ``all_greedy``, ``no_top_p``...) are read off the
    request parameters once per round, so ``process_logits`` skips the stages no row uses without
    asking the device (each ``bool(t.any())`` is an op and, on an accelerator, a sync)."""

    temperature: Tensor  # [B] float
    top_k: Tensor  # [B] long, <= 0: off
    top_p: Tensor  # [B] float in (0, 1]
    min_p: Tensor  # [B] float in [0, 1)
    any_greedy: bool = True  # host flags; the defaults (every stage on) are always correct
    all_greedy: bool = False
    all_unit_temperature: bool = False
    any_top_k: bool = True
    any_top_p: bool = True
    any_min_p: bool = True

    @classmethod
    def build(cls, params: Sequence, device=None) -> "SamplingTensors":
        temp = [float(p.temperature) for p in params]
        top_k, top_p, min_p = [int(p.top_k) for p in params], [float(p.top_p) for p in params], \
            [float(p.min_p) for p in params]
        return cls(
            temperature=torch.tensor(temp, dtype=torch.float64, device=device),
            top_k=torch.tensor(top_k, dtype=torch.long, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float64, device=device),
            min_p=torch.tensor(min_p, dtype=torch.float64, device=device),
            any_greedy=any(t <= 0 for t in temp), all_greedy=bool(temp) and all(t <= 0 for t in temp),
            all_unit_temperature=all(t == 1.0 or t <= 0 for t in temp),
            any_top_k=any(k > 0 for k in top_k), any_top_p=any(x < 1 for x in top_p),
            any_min_p=any(x > 0 for x in min_p))

    def expand(self, n: int) -> "SamplingTensors":
        """Repeat each row n times (row-major), for [B, n, V] flattened to [B*n, V]. Only the
        fields of stages some row uses are expanded: the others are never read."""
        used = {"temperature": self.any_greedy or not self.all_unit_temperature, "top_k": self.any_top_k,
                "top_p": self.any_top_p, "min_p": self.any_min_p}
        return replace(self, **{f: getattr(self, f).repeat_interleave(n) for f, on in used.items() if on})


def process_logits(logits: Tensor, st: SamplingTensors, dtype=torch.float64) -> Tensor:
    """Logits [B, V] -> sampling distribution [B, V] (``dtype``: float64 reference, float32 fast), per-row params.

    Temperature scales, then top-k, top-p (smallest set with mass >= top_p, the top token always
    kept) and min-p (keep p >= min_p * max p) truncate; rows with temperature 0 become one-hot
    on the argmax (ties: lowest id, as torch.argmax). Stages no row uses are skipped (host flags).
    """
    if st.all_greedy:
        return torch.zeros(logits.shape, dtype=dtype, device=logits.device).scatter_(
            -1, logits.argmax(-1, keepdim=True), 1.0)
    z = logits.to(dtype)
    greedy = st.temperature <= 0 if st.any_greedy else None
    if not st.all_unit_temperature:
        t = st.temperature if greedy is None else torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
        z = z / t.to(device=z.device, dtype=dtype).unsqueeze(-1)
    V = z.shape[-1]
    truncated = False
    if st.any_top_k:
        top_k = st.top_k.to(z.device)
        k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
        if bool((k < V).any()):
            kth = torch.sort(z, dim=-1, descending=True).values.gather(-1, (k - 1).unsqueeze(-1))
            z = z.masked_fill(z < kth, float("-inf"))
    probs = torch.softmax(z, dim=-1)
    if st.any_top_p:
        sp, idx = torch.sort(probs, dim=-1, descending=True)
        cum_before = sp.cumsum(-1) - sp
        drop_sorted = cum_before >= st.top_p.to(device=z.device, dtype=dtype).unsqueeze(-1)
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        truncated = True
    if st.any_min_p:
        thresh = probs.max(-1, keepdim=True).values * st.min_p.to(device=z.device, dtype=dtype).unsqueeze(-1)
        probs = probs.masked_fill(probs < thresh, 0.0)
        truncated = True
    if truncated:
        probs = probs / probs.sum(-1, keepdim=True)
    if greedy is not None:
        onehot = torch.zeros_like(probs).scatter(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy.to(z.device).unsqueeze(-1), onehot, probs)
    return probs


def load_token_map(token_map, vocab_size: int) -> Tensor:
    """Token ids a reduced-vocabulary draft may propose, as a sorted, deduplicated long tensor.

    ``token_map``: a sequence or 1-D tensor of ids, or a path to a ``.pt`` file holding one (the
    format of SGLang's ``--speculative-token-map`` / FR-Spec's frequency maps) or a ``.json``
    list. Sorting keeps the inverse CDF over the map in id order (argmax ties: lowest id)."""
    if isinstance(token_map, (str, bytes)) or hasattr(token_map, "__fspath__"):
        import json
        from pathlib import Path

        path = Path(token_map)
        if not path.exists():
            raise ValueError(f"token map {path}: no such file")
        if path.suffix == ".json":
            token_map = json.loads(path.read_text())
        else:
            token_map = torch.load(path, map_location="cpu", weights_only=True)
    ids = torch.as_tensor(token_map)
    if ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"token map must be a non-empty 1-D list of integer ids, got shape {tuple(ids.shape)} "
                         f"dtype {ids.dtype}")
    ids = torch.unique(ids.long())  # sorted
    if int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
        raise ValueError(f"token map ids must lie in [0, {vocab_size}), got {int(ids[0])}..{int(ids[-1])}")
    return ids


def reduced_draft_probs(hidden: Tensor, head_rows: Tensor, ids: Tensor, vocab_size: int, st: "SamplingTensors",
                        dtype=torch.float32) -> Tensor:
    """Draft distribution over the token map only, on the full vocabulary [B, V] (0 off the map).

    ``head_rows`` = LM head weight rows ``ids`` [N, h] (prepared once): the logits cost N rows,
    not V; temperature / top-k / top-p / min-p act on the map's logits."""
    small = process_logits(F.linear(hidden, head_rows), st, dtype)  # [B, N]
    return small.new_zeros(small.shape[0], vocab_size).index_copy_(1, ids.to(small.device), small)


def reduced_draft_probs_reference(hidden: Tensor, head_weight: Tensor, ids: Tensor, st: "SamplingTensors") -> Tensor:
    """float64 reference of ``reduced_draft_probs``: full-vocab logits, -inf off the map."""
    logits = F.linear(hidden.double(), head_weight.double())
    keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    keep[ids.to(logits.device)] = True
    return process_logits(logits.masked_fill(~keep, float("-inf")), st, torch.float64)


def sample_rows(probs: Tensor, generators: Sequence[Optional[torch.Generator]]) -> Tensor:
    """One token per row by inverse CDF with a float64 uniform from the row's generator."""
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators]).to(probs.device)
    return _inverse_cdf(probs, u)


def round_uniforms(generators: Sequence[Optional[torch.Generator]], n: int, dtype=torch.float32,
                   device=None) -> Tensor:
    """All the uniforms a request needs for one round, [B, n]: one draw per request."""
    if len(generators) == 1:
        u = torch.rand(n, generator=generators[0], dtype=torch.float64)[None]
    else:
        u = torch.stack([torch.rand(n, generator=g, dtype=torch.float64) for g in generators])
    # u > 0, as ``sample_with_uniform`` needs (rand can return 0.0, with probability 2^-53)
    return u.to(device=device, dtype=dtype).clamp_min_(torch.finfo(dtype).tiny)


def sample_with_uniform(probs: Tensor, u: Tensor) -> Tensor:
    """One token per row by inverse CDF with the given uniforms [B] in [0, 1], in probs' dtype
    (the fast path: 4 ops on CPU, so it runs at a fraction of ``_inverse_cdf``'s cost).

    The token is the number of CDF entries *below* v = u·total. On CPU it is never a
    zero-probability id: with cdf[j-1] < v <= cdf[j], cdf[j] > cdf[j-1], and a sequential float
    cumsum stays exactly flat over zeros; v <= total because u <= 1, so j <= V-1; v > 0 because
    ``round_uniforms`` keeps u >= the smallest normal float (u = 0 would pick id 0 whatever its
    mass). An accelerator's parallel scan sums in other orders (CUB's scan for a single row can
    step inside a run of zeros), so there a zero-mass pick falls back to the argmax, as
    ``_inverse_cdf`` does. Rows of ``probs`` need not be normalised (the verify's residual is not)."""
    cdf = probs.cumsum(-1)
    # entries below v: searchsorted's left insertion point (one op where a compare and a sum are two)
    tok = torch.searchsorted(cdf, u.to(cdf.dtype).unsqueeze(-1) * cdf[:, -1:]).squeeze(-1)
    if probs.device.type != "cpu":
        tok = torch.where(probs.gather(-1, tok.unsqueeze(-1)).squeeze(-1) > 0, tok, probs.argmax(-1))
    return tok


def _inverse_cdf(probs: Tensor, u: Tensor, exact: bool = True) -> Tensor:
    cdf = (probs.double() if exact else probs).cumsum(-1)
    x = torch.searchsorted(cdf, (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    x = x.clamp(max=probs.shape[-1] - 1)
    # never return a zero-probability id (u*total can land on a flat cdf segment's end)
    bad = probs.gather(-1, x.unsqueeze(-1)).squeeze(-1) <= 0
    return torch.where(bad, probs.argmax(-1), x)


def draft_tokens(draft_probs: Tensor, mode: str, generators) -> Tensor:
    """Draft token for one depth, rows [B, V]: sampled from q (rejection) or argmax q."""
    if mode == "rejection":
        return sample_rows(draft_probs, generators)
    return draft_probs.argmax(-1)


@dataclass
class VerifyResult:
    num_accepted: Tensor  # [B] accepted drafts, 0..γ
    next_token: Tensor  # [B] the resampled / bonus token emitted after the accepted drafts
    host_num_accepted: Optional[list] = None  # num_accepted as host ints, where the path has them

    def emitted(self, drafts: Tensor) -> list[list[int]]:
        """Per row: accepted drafts followed by the next token."""
        out = []
        for b in range(drafts.shape[0]):
            m = int(self.num_accepted[b])
            out.append(drafts[b, :m].tolist() + [int(self.next_token[b])])
        return out


def verify_chain(
    target_probs: Tensor,
    draft_probs: Tensor,
    drafts: Tensor,
    mode: str,
    generators: Optional[Sequence[Optional[torch.Generator]]] = None,
    uniforms: Optional[Tensor] = None,
) -> VerifyResult:
    """Verify γ chained drafts per row.

    Args:
        target_probs: [B, γ+1, V] processed target distributions at the γ+1 verified positions
            (row j verifies draft j; row γ gives the bonus token).
        draft_probs: [B, γ, V] processed draft distributions the drafts came from.
        drafts: [B, γ] draft tokens.
        mode: rejection | target_only | greedy.
        generators: one per row (None: the global generator); the float64 reference path.
        uniforms: [B, γ+1] instead of generators: the fast path, computed in target_probs' dtype
            (u[:, j] tests draft j, u[:, γ] draws the next token). Greedy needs neither.
    """
    if mode not in VERIFY_MODES:
        raise ValueError(f"unknown verification mode {mode!r}; one of {VERIFY_MODES}")
    B, g1, V = target_probs.shape
    gamma = g1 - 1
    fast = uniforms is not None
    if fast and mode == "rejection" and gamma > 0:
        return _verify_rejection_fast(target_probs, draft_probs, drafts, uniforms.to(target_probs.device))
    p = target_probs if fast else target_probs.double()
    qd = (draft_probs if fast else draft_probs.double()) if draft_probs is not None else None
    p_at = p[:, :gamma].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # [B, γ]
    if mode == "greedy":
        accept = drafts == p[:, :gamma].argmax(-1)
    else:
        if fast:
            u = uniforms[:, :gamma].to(device=p.device, dtype=p.dtype)
        else:
            u = torch.stack([torch.rand(gamma, generator=g, dtype=torch.float64) for g in generators]).to(p.device)
        if mode == "rejection":
            q_at = qd.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
            tiny = torch.finfo(p.dtype).tiny
            ratio = torch.where(q_at > 0, p_at / q_at.clamp_min(tiny), torch.zeros_like(p_at))
            accept = u < ratio.clamp(max=1.0)
        else:  # target_only: draft is argmax q, accepted with probability p(x)
            accept = u < p_at
    num_accepted = accept.long().cumprod(-1).sum(-1)  # leading accepted drafts

    rows = torch.arange(B, device=p.device)
    stop = num_accepted.clamp(max=gamma)  # row of p used for the next token
    p_next = p[rows, stop]  # [B, V]
    if mode == "greedy":
        return VerifyResult(num_accepted, p_next.argmax(-1))
    rejected = num_accepted < gamma
    if mode == "rejection":
        if gamma > 0:
            q_stop = qd[rows, stop.clamp(max=gamma - 1)] * rejected.unsqueeze(-1).to(p.dtype)
            residual = (p_next - q_stop).clamp_min(0.0)
        else:
            residual = p_next
    else:
        residual = p_next
        if gamma > 0:
            x = drafts[rows, stop.clamp(max=gamma - 1)]
            residual = p_next.scatter(-1, x.unsqueeze(-1), torch.where(
                rejected, torch.zeros_like(p_next[:, 0]), p_next.gather(-1, x.unsqueeze(-1)).squeeze(-1)).unsqueeze(-1))
    # rows with all drafts accepted draw the bonus from p; an empty residual (p == q up to
    # rounding) falls back to p, which is then the exact conditional anyway
    empty = residual.sum(-1) <= _empty_residual_mass(p.dtype)
    dist = torch.where((rejected & ~empty).unsqueeze(-1), residual, p_next)
    if fast:
        next_token = sample_with_uniform(dist, uniforms[:, gamma].to(p.device))
    else:
        next_token = sample_rows(dist, generators)
    return VerifyResult(num_accepted, next_token)


def _empty_residual_mass(dtype) -> float:
    """Residual mass at or below which max(0, p - q) counts as empty (p == q up to rounding)."""
    return 1e-12 if dtype == torch.float64 else 1e-6


def _verify_rejection_fast(p: Tensor, q: Tensor, drafts: Tensor, u: Tensor) -> VerifyResult:
    """``verify_chain``'s rejection mode on the fast path, in half its ops (the engine's every round).

    Draft j is accepted when u_j·q_j(x) < p_j(x), i.e. with probability min(1, p/q) (a draft
    sampled from q has q > 0, a greedy row's one-hot q has q = 1, so no division and no guard).
    The next token comes from row ``num_accepted`` of [max(0, p_1 - q_1) .. max(0, p_γ - q_γ), p_{γ+1}]:
    the residual at the first rejection, or the bonus distribution when all γ pass; an empty
    residual (p == q up to rounding) falls back to p there, as in the reference."""
    B, g1, V = p.shape
    gamma = g1 - 1
    dk = drafts.unsqueeze(-1)
    p_at = p[:, :gamma].gather(-1, dk).squeeze(-1)
    q_at = q.gather(-1, dk).squeeze(-1)
    accept = u[:, :gamma].to(p.dtype) * q_at < p_at
    if B == 1:
        return _next_token_one_row(p[0], q[0], accept[0].tolist(), u[0, gamma: gamma + 1])
    num_accepted = accept.cumprod(-1).sum(-1)  # leading accepted drafts, [B] long
    rows = _arange(B, p.device)
    p_next = p[rows, num_accepted]
    q_next = torch.cat([q, q.new_zeros(B, 1, V)], dim=1)[rows, num_accepted]  # 0 after all γ accepted
    residual = (p_next - q_next).clamp_min_(0.0)
    empty = residual.sum(-1, keepdim=True) <= _empty_residual_mass(p.dtype)
    dist = torch.where(empty, p_next, residual)
    return VerifyResult(num_accepted, sample_with_uniform(dist, u[:, gamma]))


def _next_token_one_row(p: Tensor, q: Tensor, accept: list, u: Tensor) -> VerifyResult:
    """The rest of ``_verify_rejection_fast`` for one row, from its accept tests on the host (the
    engine reads the count there anyway): the residual row is a view, picked by a host integer,
    not a gather, and an empty residual is a host test. The same arithmetic as the batched path,
    so the same tokens for the same uniforms; one row is what batch 1 and the long tail run."""
    m = next((j for j, a in enumerate(accept) if not a), len(accept))
    dist = p[m]
    if m < len(accept):  # rejected at draft m+1: its residual, unless empty (p == q up to rounding)
        residual = (dist - q[m]).clamp_min_(0.0)
        if float(residual.sum()) > _empty_residual_mass(p.dtype):
            dist = residual
    nxt = sample_with_uniform(dist[None], u)
    return VerifyResult(torch.tensor([m], device=p.device), nxt, [m])


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """(1 - α^{γ+1}) / (1 - α): tokens per verify step with i.i.d. per-draft acceptance α."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


@dataclass
class LogitProcessors:
    """SGLang's logit processors for a batch, applied to raw target logits before temperature.

    Order as SGLang's overlap/speculative path: the additive penalties (``frequency_penalty`` x
    count, ``presence_penalty`` x [count > 0], ``min_new_tokens``' -inf on the stop tokens while
    fewer outputs exist), then ``repetition_penalty`` (logits of tokens already in the output:
    positive divided, negative multiplied), then ``logit_bias``. Counts are over OUTPUT tokens
    only, as SGLang's penalizers (which cumulate output ids only) do.

    ``apply(logits, prev)`` evaluates the processors at a position that follows ``prev`` [B, j]
    extra tokens after the committed output (speculative verify position j: the drafts accepted
    before it count), so that verification sees the exact law of plain decoding."""

    counts: Optional[Tensor]  # [B, V] output-token counts (None: no count-based penalty)
    freq: Optional[Tensor]  # [B]
    pres: Optional[Tensor]  # [B]
    rep: Optional[Tensor]  # [B]
    min_left: Optional[Tensor]  # [B] min_new_tokens - len(output) (None: off)
    stop_mask: Optional[Tensor]  # [B, V] bool: tokens masked while min_left > 0
    bias: Optional[Tensor]  # [B, V]

    @staticmethod
    def needed(params) -> bool:
        return bool(params.frequency_penalty or params.presence_penalty or params.repetition_penalty != 1.0
                    or params.min_new_tokens or params.logit_bias)

    @staticmethod
    def uses_counts(params) -> bool:
        return bool(params.frequency_penalty or params.presence_penalty or params.repetition_penalty != 1.0)

    @classmethod
    def build(cls, reqs: Sequence, vocab_size: int, eos_id: Optional[int], device=None) -> Optional["LogitProcessors"]:
        """From requests with ``params``, ``output_ids`` and ``counts`` ([V] or None); None when
        every request is neutral (the plain path pays nothing)."""
        ps = [r.params for r in reqs]
        if not any(cls.needed(p) for p in ps):
            return None
        B, V = len(reqs), vocab_size
        f32 = dict(dtype=torch.float32, device=device)
        counts = freq = pres = rep = min_left = stop_mask = bias = None
        if any(cls.uses_counts(p) for p in ps):
            zero = torch.zeros(V, **f32)
            counts = torch.stack([r.counts if r.counts is not None else zero for r in reqs])
            freq = torch.tensor([float(p.frequency_penalty) for p in ps], **f32)
            pres = torch.tensor([float(p.presence_penalty) for p in ps], **f32)
            rep = torch.tensor([float(p.repetition_penalty) for p in ps], **f32)
        if any(p.min_new_tokens for p in ps):
            min_left = torch.tensor([p.min_new_tokens - len(r.output_ids) for p, r in zip(ps, reqs)], device=device)
            stop_mask = torch.zeros(B, V, dtype=torch.bool, device=device)
            for i, p in enumerate(ps):
                if p.min_new_tokens:
                    ids = [t for t in list(p.stop_token_ids) + ([eos_id] if eos_id is not None else []) if t < V]
                    stop_mask[i, ids] = True
        if any(p.logit_bias for p in ps):
            bias = torch.zeros(B, V, **f32)
            for i, p in enumerate(ps):
                for t, b in (p.logit_bias or {}).items():
                    bias[i, int(t)] = float(b)
        return cls(counts, freq, pres, rep, min_left, stop_mask, bias)

    def apply(self, logits: Tensor, prev: Optional[Tensor] = None) -> Tensor:
        """Processed copy of ``logits`` [B, V] at the position after ``prev`` [B, j] extra tokens."""
        z = logits.clone()
        j = 0 if prev is None else prev.shape[1]
        if self.counts is not None:
            c = self.counts.to(z.dtype)
            if j:
                c = c.scatter_add(1, prev, torch.ones(prev.shape, dtype=z.dtype, device=z.device))
            seen = c > 0
            z = z - self.freq.to(z.dtype)[:, None] * c - self.pres.to(z.dtype)[:, None] * seen.to(z.dtype)
        if self.min_left is not None:
            mask = self.stop_mask & (self.min_left > j)[:, None]
            mask &= ~mask.all(-1, keepdim=True)  # never mask a whole row
            z = z.masked_fill(mask, float("-inf"))
        if self.counts is not None:
            r = self.rep.to(z.dtype)[:, None]
            z = torch.where(seen, torch.where(z < 0, z * r, z / r), z)
        if self.bias is not None:
            z = z + self.bias.to(z.dtype)
        return z
