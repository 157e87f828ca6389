"""The MTP phase's rollout documents: the frozen trunk's own answers to the RL training prompts.

Heads trained on the SFT data alone learn contexts the RL job never verifies: the SFT answers are
right, while the policy's sampled answers carry its own errors, and speculative rollouts draft after
those. EAGLE and SpecForge regenerate their draft-training data with the target model for the same
reason. With ``mtp.rollout_share`` = s > 0 the MTP phase trains on a mixture: a share s of its tokens
are the trunk's answers to the RL training prompts (``build_prompts``: ``rl.task`` or
``rl.prompts_path``), sampled as the RL job samples them (``rl.temperature``, ``rl.top_p``,
``rl.max_new_tokens``, ``rl.stop``, its prompt order), the rest from ``data``.

The trunk is frozen in the MTP phase, so the documents are sampled once, before it. Global rank 0
decides whether ``<phase dir>/rollout_data.json`` holds them for these settings and this trunk; if
not, it gathers the trunk's weights (``policy_buckets_on_rank0``: every TP shard and PP stage, as
the RL weight sync does), samples with the embedded engine on the training device (plain decoding),
and writes the file. Every rank then gets rank 0's documents by broadcast, so DP replicas train on
the same data whatever their hardware. An in-process memo serves a benchmark's several head
trainings on one trunk.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from bebop_megatron.config import Config, ConfigError

log = logging.getLogger("bebop.rollout_data")

CHUNK = 256  # prompts per engine batch
_MEMO: dict = {}  # (meta as JSON) -> documents


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _stamp(path: Optional[str | Path]) -> Optional[list]:
    """(path, size, mtime) of a file or checkpoint folder: it changes when the thing is rewritten."""
    if path is None:
        return None
    p = Path(path)
    try:
        st = p.stat()
    except OSError:
        return [str(p), None, None]
    return [str(p), st.st_size if p.is_file() else None, st.st_mtime_ns]


def rollout_meta(cfg: Config, trunk: Optional[Path], token_budget: int) -> dict:
    """What the documents depend on: a cache holding other values is sampled again."""
    r = cfg.rl
    return {"trunk": _stamp(trunk), "tokens": int(token_budget), "seed": cfg.train.seed,
            "tokenizer": cfg.data.tokenizer, "task": r.task, "prompts_path": _stamp(r.prompts_path),
            "reward": r.reward, "eval_prompts": r.eval_prompts, "temperature": r.temperature,
            "top_p": r.top_p, "max_new_tokens": r.max_new_tokens, "stop": list(r.stop)}


def check_rollout_settings(cfg: Config) -> None:
    """Before any work (the trunk phase may run first): the RL prompts load and fit, and the
    experts can be gathered on one rank."""
    if not cfg.mtp.rollout_share:
        return
    if cfg.model.moe and cfg.parallel.expert_model_parallel_size > 1:
        raise ConfigError("mtp.rollout_share needs expert_model_parallel_size 1 (each rank holds only its own "
                          "experts; the in-process engine needs them all)")
    from bebop_megatron.data import load_tokenizer
    from bebop_megatron.rl.rollout import build_prompts

    train, _ = build_prompts(cfg, load_tokenizer(cfg.data.tokenizer))  # DataError: file, line, what
    if not train:
        raise ConfigError("mtp.rollout_share: the RL prompts leave none for training (rl.prompts_path holds too "
                          "few next to rl.eval_prompts)")


@torch.no_grad()
def sample_rollout_documents(cfg: Config, buckets: list[dict], token_budget: int,
                             device: torch.device, dtype: torch.dtype) -> list[list[int]]:
    """Prompt + sampled answer token lists until they hold ``token_budget`` tokens (each counted
    with the EOS the mix appends). ``buckets``: the trunk's HF-named weights."""
    from bebop_megatron.data import eos_id, load_tokenizer
    from bebop_megatron.rl.rollout import PromptSource, build_prompts, split_stops
    from bebop_megatron.rl.weight_sync import rollout_model_for
    from bebop_megatron.rollout.engine import Engine, SamplingParams, SpecConfig

    r = cfg.rl
    tok = load_tokenizer(cfg.data.tokenizer)
    eos = eos_id(tok)
    em = rollout_model_for(cfg, dtype=dtype).to(device)
    for b in buckets:
        em.load_hf_state_dict(b, strict=False)
    train, _ = build_prompts(cfg, tok)
    order = PromptSource(train, cfg.train.seed)
    stop_ids, stop_strs = split_stops(tok, r.stop)  # as the RL rollout manager sends them
    ids_of = [list(tok.encode(p.text)) for p in train]
    longest = max(len(x) for x in ids_of)
    eng = Engine(em, tok, SpecConfig("none"), max_running=64, max_len=longest + r.max_new_tokens + 2)
    docs: list[list[int]] = []
    total, chunk = 0, 0
    while total < token_budget:
        idx = order.indices_for_step(chunk, CHUNK)  # the RL job's own per-epoch prompt order
        params = [SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                 stop=list(stop_strs), stop_token_ids=list(stop_ids), no_stop_trim=True,
                                 seed=cfg.train.seed * 1_000_003 + chunk * CHUNK + j) for j in range(len(idx))]
        for i, req in zip(idx, eng.generate([ids_of[i] for i in idx], params)):
            out = list(req.output_ids)
            if out and out[-1] == eos:  # the mix appends the document's EOS
                out.pop()
            doc = ids_of[i] + out
            docs.append(doc)
            total += len(doc) + 1
            if total >= token_budget:
                break
        chunk += 1
    return docs


def _cached(cache: Path, meta: dict, resuming: bool) -> Optional[list[list[int]]]:
    if not cache.exists():
        return None
    try:
        saved = json.loads(cache.read_text())
        old, docs = saved["meta"], saved["docs"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # unreadable: sample again
    # a resume does not know the trunk (its weights come from the MTP checkpoint, trained from that
    # trunk and frozen): every other setting must match
    if old == meta or (resuming and {**old, "trunk": None} == {**meta, "trunk": None}):
        return docs
    return None


def _write(cache: Path, meta: dict, docs: list[list[int]]) -> None:
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps({"meta": meta, "docs": docs}))
    os.replace(tmp, cache)


def rollout_documents(cfg: Config, model, token_budget: int, cache: Path, trunk: Optional[Path] = None,
                      resuming: bool = False) -> list[list[int]]:
    """The documents for this phase, the same on every rank (a collective: every rank calls it).

    ``model`` holds the trunk's weights (loaded from ``trunk``, or from the MTP checkpoint on a
    resume: ``resuming``)."""
    meta = rollout_meta(cfg, trunk, token_budget)
    key = json.dumps(meta, sort_keys=True)
    docs = _MEMO.get(key) if trunk is not None else None
    read = False  # rank 0 read them from ``cache``
    if docs is None and _rank() == 0:
        docs = _cached(cache, meta, resuming)
        read = docs is not None
    need = [docs is None]
    if dist.is_initialized():
        dist.broadcast_object_list(need, src=0)  # rank 0's decision: sample, or its documents below
    if need[0]:
        from bebop_megatron.rl.trainer import policy_buckets_on_rank0

        buckets = policy_buckets_on_rank0(model, cfg, 256 << 20)  # a collective over the TP / PP groups
        if _rank() == 0:
            p = next(model.parameters())
            log.info("sampling the trunk's answers to the RL prompts for the MTP phase (mtp.rollout_share: "
                     "%d tokens)", token_budget)
            docs = sample_rollout_documents(cfg, buckets, token_budget, p.device, p.dtype)
            log.info("sampled %d rollout documents (%d tokens)", len(docs), sum(len(d) for d in docs))
        buckets = None
    if _rank() == 0 and not read:
        _write(cache, meta, docs)  # also after a memo hit: each run folder holds its data
    if dist.is_initialized():
        box = [docs]
        dist.broadcast_object_list(box, src=0)
        docs = box[0]
    if trunk is not None:
        _MEMO[key] = docs
    return docs
