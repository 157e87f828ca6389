"""The MTP phase's rollout documents: the frozen trunk's own answers to the RL training prompts.

Heads trained on the SFT data alone learn contexts the RL job never verifies: the SFT answers are
right, while the policy's sampled answers carry its own errors, and speculative rollouts draft after
those. EAGLE and SpecForge regenerate their draft-training data with the target model for the same
reason. With ``mtp.rollout_share`` = s > 0 the MTP phase trains on a mixture: a share s of its tokens
are the trunk's answers to the RL training prompts (``build_prompts``: ``rl.task`` or
``rl.prompts_path``), sampled as the RL job samples them (``rl.temperature``, ``rl.top_p``,
``rl.max_new_tokens``, ``rl.stop``) by the embedded engine with plain decoding, the rest from
``data``. The trunk is frozen in the MTP phase, so the documents are sampled once, before it, and
kept in ``<phase dir>/rollout_data.json``: a resume reads them back (and an in-process memo serves
a benchmark's several head trainings on one trunk).
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


def rollout_meta(cfg: Config, trunk: Optional[Path], token_budget: int) -> dict:
    """What the documents depend on: a cache holding other values is sampled again."""
    r = cfg.rl
    return {"trunk": str(trunk) if trunk is not None else None, "tokens": int(token_budget),
            "seed": cfg.train.seed, "task": r.task, "prompts_path": r.prompts_path,
            "temperature": r.temperature, "top_p": r.top_p, "max_new_tokens": r.max_new_tokens,
            "stop": list(r.stop)}


def check_layout(cfg: Config) -> None:
    """Before any work: the documents are sampled in-process, from the whole trunk on each rank."""
    if not cfg.mtp.rollout_share:
        return
    if cfg.parallel.pipeline_model_parallel_size > 1:
        raise ConfigError("mtp.rollout_share samples with the whole trunk on one rank: it needs "
                          "pipeline_model_parallel_size 1 (or sample the answers with `bebop serve`, give them "
                          "in data.path and set mtp.rollout_share=0)")
    if cfg.model.moe and cfg.parallel.expert_model_parallel_size > 1:
        raise ConfigError("mtp.rollout_share needs expert_model_parallel_size 1 (each rank holds only its own "
                          "experts; the in-process engine needs them all)")


@torch.no_grad()
def sample_rollout_documents(cfg: Config, model, token_budget: int) -> list[list[int]]:
    """Prompt + sampled answer token lists, on this rank, until they hold ``token_budget`` tokens.

    ``model`` is the megatron model holding the trunk; every rank of its TP group must call this
    (the HF export gathers the shards), and each gets the same documents (seeded sampling)."""
    from megatron.core import parallel_state

    from bebop_megatron.convert.hf_megatron import iter_hf_buckets
    from bebop_megatron.convert.layout import Shapes
    from bebop_megatron.data import load_tokenizer
    from bebop_megatron.rl.rollout import PromptSource, build_prompts
    from bebop_megatron.rl.weight_sync import rollout_model_for
    from bebop_megatron.rollout.engine import Engine, SamplingParams, SpecConfig

    r = cfg.rl
    tok = load_tokenizer(cfg.data.tokenizer)
    em = rollout_model_for(cfg)
    shapes = Shapes.from_config(cfg, parallel_state.get_tensor_model_parallel_world_size(), "deepseek")
    for bucket in iter_hf_buckets(model, shapes, 256 << 20):
        em.load_hf_state_dict(bucket, strict=False)
    train, _ = build_prompts(cfg, tok)
    order = PromptSource(train, cfg.train.seed)
    stop_ids, stop_strs = [], []
    for s in r.stop:  # single-token stops as ids, as the RL rollout manager sends them
        enc = list(tok.encode(s))
        (stop_ids.append(enc[0]) if len(enc) == 1 else stop_strs.append(s))
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
            doc = ids_of[i] + list(req.output_ids)
            docs.append(doc)
            total += len(doc) + 1  # + the EOS the packing appends
            if total >= token_budget:
                break
        chunk += 1
    return docs


def rollout_documents(cfg: Config, model, token_budget: int, cache: Path,
                      trunk: Optional[Path] = None) -> list[list[int]]:
    """The documents for this phase: from ``cache`` (or the in-process memo) when they were sampled
    with the same settings, else sampled (every rank, see ``sample_rollout_documents``) and written
    by the logging rank."""
    meta = rollout_meta(cfg, trunk, token_budget)
    key = json.dumps(meta, sort_keys=True)
    if trunk is not None and key in _MEMO:
        return _MEMO[key]
    docs = None
    if cache.exists():
        try:
            saved = json.loads(cache.read_text())
            old = saved.get("meta") or {}
            # a resume does not know the trunk's path (its weights come from the MTP checkpoint, trained
            # from that trunk and frozen): every other setting must match
            if old == meta or (trunk is None and {**old, "trunk": None} == meta):
                docs = saved["docs"]
        except (OSError, ValueError, KeyError):
            docs = None  # unreadable: sample again
    if docs is None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.info("sampling the trunk's answers to the RL prompts for the MTP phase (%d tokens, %s)",
                     token_budget, "mtp.rollout_share")
        docs = sample_rollout_documents(cfg, model, token_budget)
        if not dist.is_initialized() or dist.get_rank() == 0:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(".tmp")
            tmp.write_text(json.dumps({"meta": meta, "docs": docs}))
            os.replace(tmp, cache)
        n_tok = sum(len(d) for d in docs)
        log.info("sampled %d rollout documents (%d tokens) from the trunk for the MTP phase", len(docs), n_tok)
    if dist.is_initialized():
        dist.barrier()
    if trunk is not None:
        _MEMO[key] = docs
    return docs
