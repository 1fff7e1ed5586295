"""Training data: token streams cut into fixed-length samples, batched deterministically.

Sources (`train.data`):
* empty — the built-in corpus (generated English-like text, byte-level tokens),
* `PREFIX` or `PREFIX.bin` with `PREFIX.json` beside it — written by `disagmoe
  prepare-data` (`disagmoe.data_prep`): tokens of the dtype and vocabulary the JSON names,
* `*.txt` — UTF-8 text, byte-level tokens (vocab >= 256),
* `*.npy` — a 1-D integer token array,
* `*.bin` — raw tokens of `train.data_dtype` (uint16 or uint32).

Token files (`.bin`, `.npy`) are memory-mapped, never read whole: a batch copies only
its own samples. A stream is cut into consecutive non-overlapping samples of
`seq_len + 1` tokens (input = first `seq_len`, target = last `seq_len`). Each epoch
visits the samples in a pseudo-random permutation keyed by `seed` and the epoch
(`permuted_index`, O(1) memory); step t takes the next
`global_batch_size` samples, so the data position is the step (a checkpoint's step
resumes it), and every runtime splits a global batch into micro-batches the same way
(consecutive chunks of `micro_batch_size`).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

_SUBJECTS = [
    "the router",
    "an expert",
    "the attention layer",
    "a worker",
    "the pipeline",
    "the planner",
    "every token",
    "the scheduler",
    "a micro-batch",
    "the network",
]
_VERBS = [
    "sends",
    "receives",
    "computes",
    "waits for",
    "overlaps",
    "balances",
    "routes",
    "splits",
    "gathers",
    "measures",
]
_OBJECTS = [
    "the hidden states",
    "a gradient",
    "its experts",
    "the next layer",
    "the residual",
    "eight tokens",
    "the combine message",
    "the dispatch counts",
    "the loss",
    "a trace",
]
_TAILS = [
    "before the backward pass",
    "while the link is busy",
    "in the same stage",
    "on the other group",
    "without an all-to-all",
    "at every step",
    "as the plan says",
    "when the bandwidth is low",
]


def builtin_corpus(num_sentences: int = 12000, seed: int = 1234) -> str:
    """A deterministic, learnable corpus: short sentences from a small grammar."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_sentences):
        sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        if rng.random() < 0.5:
            sentence += " " + rng.choice(_TAILS)
        out.append(sentence.capitalize() + ".")
    return " ".join(out) + "\n"


# A model's vocabulary may be a tokenizer's padded (Qwen3: 151669 -> 151936, GPT-2: 50257 ->
# 50304); padding of more than this many ids, or an eighth of the vocabulary, means
# another tokenizer (e.g. 256 bytes for a 150k-token model).
VOCAB_PADDING_SLACK = 1024


def _vocab_fits(data_vocab: int, model_vocab: int) -> bool:
    return 0 <= model_vocab - data_vocab < max(min(VOCAB_PADDING_SLACK, model_vocab // 8), 1)


@dataclass(frozen=True)
class PreparedData:
    """`PREFIX.bin` with the metadata `disagmoe prepare-data` wrote to `PREFIX.json`."""

    bin_path: Path
    meta: dict[str, Any]

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def check_vocab(self, model_vocab_size: int) -> None:
        """Refuse data tokenized for another vocabulary than the model's (one line)."""
        v = self.vocab_size
        if not _vocab_fits(v, model_vocab_size):
            raise ValueError(
                f"data {str(self.bin_path)!r} was tokenized with vocab size {v} "
                f"({self.meta.get('tokenizer', '?')}), but model.vocab_size is "
                f"{model_vocab_size}; prepare the data with the model's tokenizer"
            )


def find_prepared(path: str) -> PreparedData | None:
    """`PREFIX` or `PREFIX.bin` of `disagmoe prepare-data` output, or None for other files."""
    prefix = path[: -len(".bin")] if path.endswith(".bin") else path
    bin_path, meta_path = Path(prefix + ".bin"), Path(prefix + ".json")
    if not (bin_path.is_file() and meta_path.is_file()):
        return None
    try:
        meta = json.loads(meta_path.read_text())
        dtype, vocab = meta["dtype"], int(meta["vocab_size"])
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"{str(meta_path)!r} is not `disagmoe prepare-data` metadata ({err}); "
            "run prepare-data again"
        ) from None
    if dtype not in ("uint16", "uint32") or vocab < 1:
        raise ValueError(f"{str(meta_path)!r} has dtype {dtype!r} / vocab {vocab}; run again")
    return PreparedData(bin_path, meta)


def _memmap_bin(p: Path, data_dtype: str) -> np.ndarray:
    itemsize = np.dtype(data_dtype).itemsize
    size = p.stat().st_size
    if size % itemsize:
        raise ValueError(
            f"data file {str(p)!r} has {size} bytes, not a multiple of {data_dtype} "
            f"({itemsize} bytes); set train.data_dtype to the file's token type"
        )
    if size == 0:
        return np.zeros(0, dtype=data_dtype)
    return np.memmap(p, dtype=data_dtype, mode="r")


def load_tokens(path: str, data_dtype: str = "uint16", *, flag: str = "--data") -> np.ndarray:
    """The token stream (memory-mapped for token files); ValueError with the fix on bad input
    (`flag`: the option that named `path`, `--data` or `--eval-data`)."""
    if not path:
        return np.frombuffer(builtin_corpus().encode("utf-8"), dtype=np.uint8)
    prepared = find_prepared(path)
    if prepared is not None:
        return _memmap_bin(prepared.bin_path, prepared.meta["dtype"])
    p = Path(path)
    if not p.is_file():
        raise ValueError(
            f"data file {path!r} does not exist (train.{flag[2:].replace('-', '_')} / {flag}: "
            "a prepare-data PREFIX, .bin, .npy or .txt)"
        )
    suffix = p.suffix.lower()
    if suffix == ".npy":
        try:
            arr = np.load(p, mmap_mode="r", allow_pickle=False)
        except ValueError as err:
            raise ValueError(f"data file {path!r} is not a plain .npy array: {err}") from None
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(
                f"data file {path!r} must hold a 1-D integer token array, "
                f"got shape {arr.shape} dtype {arr.dtype}"
            )
        if arr.size and arr.min() < 0:
            raise ValueError(f"data file {path!r} holds negative token ids")
        return arr
    if suffix == ".bin":
        return _memmap_bin(p, data_dtype)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"data file {path!r} is not UTF-8 text ({err.reason}); use .npy or .bin for "
            "token arrays"
        ) from None
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def max_token(tokens: np.ndarray, chunk: int = 1 << 24) -> int:
    """The largest id, read a chunk at a time (a memory map is never copied whole)."""
    return max((int(tokens[i : i + chunk].max()) for i in range(0, len(tokens), chunk)), default=-1)


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well-mixed 64-bit function of `x`."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def permuted_index(index: int, n: int, key: int, rounds: int = 4) -> int:
    """Position `index` of a pseudo-random permutation of `range(n)` chosen by `key`.

    A balanced Feistel network on the smallest even-bit domain holding `n` (at most 4n)
    is a bijection there; "cycle walking" (apply it again until the value is < n) makes
    it one of `range(n)`. O(1) memory, where a stored permutation of a 1 GB token file's
    samples would take tens of MB per rank.
    """
    assert 0 <= index < n, (index, n)
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    x = index
    while True:
        left, right = x >> half, x & mask
        for r in range(rounds):
            left, right = right, left ^ (_mix(key * 0x1000193 + r * 0x3C6EF372 + right) & mask)
        x = (left << half) | right
        if x < n:
            return x


class TokenBatches:
    """Deterministic global batches of `[global_batch_size, seq_len + 1]` token samples.

    `tokens` may be a memory map: a batch reads only its samples. `ids_checked`: the
    caller knows every id is below `vocab_size` (prepared data), so the stream is not
    scanned.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        seq_len: int,
        global_batch_size: int,
        seed: int,
        vocab_size: int,
        ids_checked: bool = False,
    ) -> None:
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.num_samples = len(tokens) // (seq_len + 1)
        if self.num_samples < global_batch_size:
            raise ValueError(
                f"the data holds {len(tokens)} tokens = {self.num_samples} samples of "
                f"seq_len+1={seq_len + 1}, fewer than one global batch ({global_batch_size}); "
                "use more data or a smaller train.seq_len / train.global_batch_size"
            )
        if not ids_checked and (top := max_token(tokens)) >= vocab_size:
            raise ValueError(
                f"the data has token id {top} >= model.vocab_size ({vocab_size}); "
                "raise model.vocab_size or check train.data_dtype"
            )
        self.tokens = tokens

    def sample(self, index: int) -> np.ndarray:
        """Sample `index` of the stream (in file order): `seq_len + 1` tokens."""
        width = self.seq_len + 1
        return self.tokens[index * width : (index + 1) * width]

    @property
    def num_batches(self) -> int:
        """Whole global batches in the stream, in file order (`ordered_batch`)."""
        return self.num_samples // self.global_batch_size

    def ordered_batch(self, index: int) -> torch.Tensor:
        """Samples [G, S+1] (int64) of global batch `index` in file order, no shuffle: samples
        `index*G .. index*G + G - 1` (evaluation: the same batches every time)."""
        assert 0 <= index < self.num_batches, (index, self.num_batches)
        start = index * self.global_batch_size
        width = self.seq_len + 1
        rows = self.tokens[start * width : (start + self.global_batch_size) * width]
        return torch.from_numpy(
            np.asarray(rows).reshape(self.global_batch_size, width).astype(np.int64)
        )

    def global_batch(self, step: int) -> torch.Tensor:
        """Samples [G, S+1] (int64) for optimizer step `step` (0-based)."""
        start = step * self.global_batch_size
        rows = []
        for pos in range(start, start + self.global_batch_size):
            epoch, index = divmod(pos, self.num_samples)
            key = self.seed * 1_000_003 + epoch
            rows.append(self.sample(permuted_index(index, self.num_samples, key)))
        return torch.from_numpy(np.stack(rows).astype(np.int64))


def split_micro_batches(batch: torch.Tensor, micro_batch_size: int) -> list[torch.Tensor]:
    """Consecutive chunks of `micro_batch_size` samples — the same for every runtime."""
    return list(batch.split(micro_batch_size))


def inputs_targets(
    samples: torch.Tensor, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, next-token targets) of a batch of sequences, on `device` (default: where
    `samples` are): one copy of the samples, then two views made contiguous there."""
    if device is not None:
        samples = samples.to(device, non_blocking=True)
    return samples[:, :-1].contiguous(), samples[:, 1:].contiguous()


def build_batches(
    data: str,
    data_dtype: str,
    *,
    seq_len: int,
    global_batch_size: int,
    seed: int,
    vocab_size: int,
    flag: str = "--data",
) -> TokenBatches:
    """The run's batches; prepared data must match the model's vocabulary (`check_vocab`)."""
    prepared = find_prepared(data) if data else None
    if prepared is not None:
        prepared.check_vocab(vocab_size)
    return TokenBatches(
        load_tokens(data, data_dtype, flag=flag),
        seq_len=seq_len,
        global_batch_size=global_batch_size,
        seed=seed,
        vocab_size=vocab_size,
        ids_checked=prepared is not None,
    )
