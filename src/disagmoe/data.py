"""Training data: token streams cut into fixed-length samples, batched deterministically.

Sources (`train.data`):
* empty — the built-in corpus (generated English-like text, byte-level tokens),
* `*.txt` — UTF-8 text, byte-level tokens (vocab >= 256),
* `*.npy` — a 1-D integer token array,
* `*.bin` — raw tokens of `train.data_dtype` (uint16 or uint32).

A stream is cut into consecutive non-overlapping samples of `seq_len + 1`
tokens (input = first `seq_len`, target = last `seq_len`). Each epoch visits
the samples in a permutation drawn from `seed + epoch`; step t takes the next
`global_batch_size` samples, and every runtime splits a global batch into
micro-batches the same way (consecutive chunks of `micro_batch_size`).
"""

from __future__ import annotations

import random
from pathlib import Path

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


def load_tokens(path: str, data_dtype: str = "uint16") -> np.ndarray:
    """Read a token stream as int64; raise ValueError with the fix on bad input."""
    if not path:
        return np.frombuffer(builtin_corpus().encode("utf-8"), dtype=np.uint8).astype(np.int64)
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"data file {path!r} does not exist (train.data / --data)")
    suffix = p.suffix.lower()
    if suffix == ".npy":
        try:
            arr = np.load(p, allow_pickle=False)
        except ValueError as err:
            raise ValueError(f"data file {path!r} is not a plain .npy array: {err}") from None
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(
                f"data file {path!r} must hold a 1-D integer token array, "
                f"got shape {arr.shape} dtype {arr.dtype}"
            )
        tokens = arr.astype(np.int64)
    elif suffix == ".bin":
        raw = p.read_bytes()
        itemsize = np.dtype(data_dtype).itemsize
        if len(raw) % itemsize:
            raise ValueError(
                f"data file {path!r} has {len(raw)} bytes, not a multiple of {data_dtype} "
                f"({itemsize} bytes); set train.data_dtype to the file's token type"
            )
        tokens = np.frombuffer(raw, dtype=data_dtype).astype(np.int64)
    else:
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(
                f"data file {path!r} is not UTF-8 text ({err.reason}); use .npy or .bin for "
                "token arrays"
            ) from None
        tokens = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
    if tokens.size and tokens.min() < 0:
        raise ValueError(f"data file {path!r} holds negative token ids")
    return tokens


class TokenBatches:
    """Deterministic global batches of `[global_batch_size, seq_len + 1]` token samples."""

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        seq_len: int,
        global_batch_size: int,
        seed: int,
        vocab_size: int,
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
        if tokens.size and int(tokens.max()) >= vocab_size:
            raise ValueError(
                f"the data has token id {int(tokens.max())} >= model.vocab_size ({vocab_size}); "
                "raise model.vocab_size or check train.data_dtype"
            )
        usable = self.num_samples * (seq_len + 1)
        self.samples = torch.from_numpy(np.ascontiguousarray(tokens[:usable])).view(
            self.num_samples, seq_len + 1
        )
        self._orders: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders = {epoch: torch.randperm(self.num_samples, generator=gen)}
        return self._orders[epoch]

    def global_batch(self, step: int) -> torch.Tensor:
        """Samples [G, S+1] for optimizer step `step` (0-based)."""
        start = step * self.global_batch_size
        ids = []
        for pos in range(start, start + self.global_batch_size):
            epoch, index = divmod(pos, self.num_samples)
            ids.append(int(self._order(epoch)[index]))
        return self.samples[ids]


def split_micro_batches(batch: torch.Tensor, micro_batch_size: int) -> list[torch.Tensor]:
    """Consecutive chunks of `micro_batch_size` samples — the same for every runtime."""
    return list(batch.split(micro_batch_size))


def inputs_targets(samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return samples[:, :-1].contiguous(), samples[:, 1:].contiguous()


def build_batches(
    data: str, data_dtype: str, *, seq_len: int, global_batch_size: int, seed: int, vocab_size: int
) -> TokenBatches:
    return TokenBatches(
        load_tokens(data, data_dtype),
        seq_len=seq_len,
        global_batch_size=global_batch_size,
        seed=seed,
        vocab_size=vocab_size,
    )
