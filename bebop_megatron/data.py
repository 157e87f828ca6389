"""Token data for MTP / LM training: a built-in character tokenizer, synthetic verifiable text,
JSONL loading, and a resumable, DP-sharded batch stream of fixed-length windows.

Nothing here downloads anything: the synthetic generator ships with the package, and a
Hugging Face tokenizer is only ever loaded from a local folder.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import torch


class DataError(ValueError):
    """Bad input data; the message names the file and line."""


class CharTokenizer:
    """Character-level tokenizer over a fixed alphabet (ids 0 = pad, 1 = eos)."""

    ALPHABET = " 0123456789+-*/=;:,.?!()[]<>abcdefghijklmnopqrstuvwxyz"
    pad_id = 0
    eos_id = 1

    def __init__(self) -> None:
        self._stoi = {c: i + 2 for i, c in enumerate(self.ALPHABET)}
        self._itos = {i: c for c, i in self._stoi.items()}

    @property
    def vocab_size(self) -> int:
        return len(self.ALPHABET) + 2

    def encode(self, text: str) -> list[int]:
        text = text.lower()
        unknown = sorted({c for c in text if c not in self._stoi})
        if unknown:
            raise DataError(f"characters not in the char tokenizer alphabet: {unknown!r}")
        return [self._stoi[c] for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self._itos.get(int(i), "") for i in ids if int(i) not in (self.pad_id, self.eos_id))


def load_tokenizer(spec: str):
    """``char`` or a local Hugging Face tokenizer folder (never fetched from a hub)."""
    if spec == "char":
        return CharTokenizer()
    path = Path(spec)
    if not path.is_dir():
        raise DataError(f"tokenizer {spec!r} is neither 'char' nor a local tokenizer folder")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


# ----------------------------------------------------------------------- synthetic


def synthetic_problem(rng: random.Random, task: str = "mixed") -> tuple[str, str]:
    """One verifiable (prompt, answer) pair: arithmetic, sorting or counting (``task``: one of them,
    ``mixed`` for all three, or a comma list such as ``counting,sorting``), or ``worked`` (multi-term
    addition with every partial sum written out: long answers of varied length, for rollout-bound
    RL jobs; not part of ``mixed``)."""
    return synthetic_problem_of_kind(rng, task)[1:]


def synthetic_problem_of_kind(rng: random.Random, task: str = "mixed") -> tuple[str, str, str]:
    """(family, prompt, answer): :func:`synthetic_problem` with the family it drew (for per-family
    metrics); the same random draws, so the same problems."""
    if task == "mixed":
        kind = rng.choice(["arithmetic", "sorting", "counting"])
    elif "," in task:
        kind = rng.choice([k.strip() for k in task.split(",")])
    else:
        kind = task
    if kind == "arithmetic":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice("+-*")
        val = a + b if op == "+" else a - b if op == "-" else a * b
        return kind, f"{a}{op}{b}=", str(val)
    if kind == "sorting":
        xs = [rng.randint(0, 9) for _ in range(rng.randint(3, 6))]
        return kind, "sort " + " ".join(map(str, xs)) + ":", " ".join(map(str, sorted(xs)))
    if kind == "worked":
        # worked multi-term addition: the answer shows every partial sum, so its length (about 20 to 90
        # characters) varies with the number of terms; a rollout batch gets a long tail (issue #12)
        terms = [rng.randint(10, 99) for _ in range(rng.randint(3, 9))]
        steps, acc = [], terms[0]
        for t in terms[1:]:
            steps.append(f"{acc}+{t}={acc + t}")
            acc += t
        return kind, "add " + " ".join(map(str, terms)) + ":", ",".join(steps)
    if kind == "counting":
        letters = "".join(rng.choice("abc") for _ in range(rng.randint(3, 8)))
        target = rng.choice("abc")
        return kind, f"count {target} in {letters}:", str(letters.count(target))
    raise DataError(f"unknown synthetic task {kind!r}")


def synthetic_documents(n: int, seed: int, task: str = "mixed") -> list[str]:
    """Documents of several solved problems, e.g. ``12+7=19; sort 3 1 2:1 2 3;``."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        parts = [p + a + ";" for p, a in (synthetic_problem(rng, task) for _ in range(rng.randint(2, 5)))]
        docs.append(" ".join(parts))
    return docs


# --------------------------------------------------------------------------- JSONL


def iter_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line; DataError naming file and line otherwise."""
    with Path(path).open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON: {e}") from e
            if not isinstance(rec, dict):
                raise DataError(f"{path}:{lineno}: expected an object")
            yield lineno, rec


def load_jsonl_tokens(path: str | Path, tokenizer, text_key: str = "text", vocab_size: Optional[int] = None) -> list[list[int]]:
    """Each line: ``{"input_ids": [...]}`` or ``{text_key: "..."}``. EOS is appended per document
    (``eos_id``: a tokenizer without one is refused, since packed documents would run together)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"data file not found: {path}")
    docs: list[list[int]] = []
    eos = eos_id(tokenizer)
    for lineno, rec in iter_jsonl(path):
        if "input_ids" in rec:
            ids = rec["input_ids"]
            if not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids):
                raise DataError(f"{path}:{lineno}: input_ids must be a list of non-negative ints")
        elif text_key in rec:
            if not isinstance(rec[text_key], str):
                raise DataError(f"{path}:{lineno}: '{text_key}' must be a string")
            try:
                ids = list(tokenizer.encode(rec[text_key]))
            except DataError as e:
                raise DataError(f"{path}:{lineno}: {e}") from e
        else:
            raise DataError(f"{path}:{lineno}: needs 'input_ids' or '{text_key}'")
        if vocab_size is not None and ids and max(ids) >= vocab_size:
            raise DataError(f"{path}:{lineno}: token id {max(ids)} >= vocab_size {vocab_size}")
        docs.append(ids + [eos])
    if not docs:
        raise DataError(f"{path}: no documents")
    return docs


# ---------------------------------------------------------------------- batching


@dataclass
class Batch:
    tokens: torch.Tensor  # [b, s]
    labels: torch.Tensor  # [b, s]
    loss_mask: torch.Tensor  # [b, s] float
    position_ids: torch.Tensor  # [b, s]


class TokenWindows:
    """Fixed ``seq_length + 1`` windows over the concatenated token stream (GPT-style).

    Sample order is a seeded permutation per epoch, so sample ``i`` is a pure function of
    (seed, i): resuming from ``consumed_samples`` replays exactly the same data.
    """

    def __init__(self, docs: list[list[int]], seq_length: int, seed: int):
        stream = np.fromiter((t for d in docs for t in d), dtype=np.int64)
        n = (len(stream) - 1) // seq_length
        if n < 1:
            raise DataError(f"not enough tokens ({len(stream)}) for one window of {seq_length + 1}")
        self.stream, self.seq_length, self.seed, self.num_windows = stream, seq_length, seed, n
        self._perm_epoch, self._perm = -1, None

    def __len__(self) -> int:
        return self.num_windows

    def window(self, sample_index: int) -> np.ndarray:
        epoch, i = divmod(sample_index, self.num_windows)
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng(self.seed + epoch).permutation(self.num_windows)
            self._perm_epoch = epoch
        start = int(self._perm[i]) * self.seq_length
        return self.stream[start : start + self.seq_length + 1]

    def batch(self, sample_indices: Sequence[int]) -> Batch:
        w = torch.from_numpy(np.stack([self.window(i) for i in sample_indices]))
        s = self.seq_length
        return Batch(
            tokens=w[:, :-1].contiguous(),
            labels=w[:, 1:].contiguous(),
            loss_mask=torch.ones(len(sample_indices), s),
            position_ids=torch.arange(s).expand(len(sample_indices), s).contiguous(),
        )


def microbatches_for_step(
    data: TokenWindows, consumed_samples: int, global_batch_size: int, micro_batch_size: int,
    dp_rank: int, dp_size: int,
) -> Iterator[Batch]:
    """This DP rank's micro-batches of the global batch that starts at ``consumed_samples``."""
    per_rank = global_batch_size // dp_size
    start = consumed_samples + dp_rank * per_rank
    for m in range(per_rank // micro_batch_size):
        lo = start + m * micro_batch_size
        yield data.batch(range(lo, lo + micro_batch_size))


def eos_id(tokenizer) -> int:
    """The end-of-document id: the char tokenizer's ``eos_id``, a Hugging Face tokenizer's ``eos_token_id``."""
    eos = getattr(tokenizer, "eos_id", None)
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise DataError("the tokenizer has no EOS id (eos_id / eos_token_id): documents need one")
    return int(eos)


def load_documents(cfg, vocab_size: int) -> list[list[int]]:
    """Token documents (EOS appended) from ``data.path`` (JSONL) or the shipped synthetic generator."""
    d = cfg.data
    tok = load_tokenizer(d.tokenizer)
    if d.path:
        docs = load_jsonl_tokens(d.path, tok, d.text_key, vocab_size)
    else:
        docs = []
        for text in synthetic_documents(d.synthetic_samples, cfg.train.seed, d.synthetic_task):
            docs.append(list(tok.encode(text)) + [eos_id(tok)])
    if max(max(x) for x in docs) >= vocab_size:
        raise DataError(f"tokenizer produces ids >= model.vocab_size {vocab_size}")
    return docs


def mix_documents(docs: list[list[int]], extra: list[list[int]], share: float, eos: int) -> list[list[int]]:
    """About (1 - share) of ``docs``' tokens, taken evenly through them (not a prefix: a sorted
    file keeps every part), with ``extra`` (EOS appended) spread evenly among them: the same number
    of tokens, so the same windows per epoch, ``share`` of them from ``extra`` (``mtp.rollout_share``)."""
    keep, owed, taken = [], 0.0, 0
    for x in docs:
        owed += (1.0 - share) * len(x)
        if taken < owed:  # behind (1 - share) of the tokens seen so far: keep this one
            keep.append(x)
            taken += len(x)
    extra = [list(x) + [eos] for x in extra]
    out, i, j, a, b = [], 0, 0, 0, 0  # a, b: tokens taken from keep / extra so far
    while i < len(keep) or j < len(extra):
        # take from whichever side is further behind its share of the tokens taken so far
        if j >= len(extra) or (i < len(keep) and a * share <= b * (1.0 - share)):
            out.append(keep[i]); a += len(keep[i]); i += 1
        else:
            out.append(extra[j]); b += len(extra[j]); j += 1
    return out


def build_dataset(cfg, vocab_size: int, docs: Optional[list[list[int]]] = None) -> TokenWindows:
    """Windows over ``docs`` (default: ``load_documents``)."""
    if docs is None:
        docs = load_documents(cfg, vocab_size)
    return TokenWindows(docs, cfg.data.seq_length, cfg.train.seed)
