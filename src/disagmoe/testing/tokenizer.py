"""A tiny Hugging Face tokenizer built offline (tests and docs examples)."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = [
    "the",
    "router",
    "sends",
    "a",
    "token",
    "to",
    "an",
    "expert",
    "and",
    "the",
    "expert",
    "computes",
    "its",
    "output",
    "while",
    "the",
    "attention",
    "layer",
    "waits",
    "for",
    "the",
    "next",
    "micro",
    "batch",
]


def build_tiny_tokenizer(out_dir: Path, *, extra_words: int = 0) -> Path:
    """A word-level tokenizer over `WORDS` (+ `extra_words` filler words) with `<unk>` and
    `<eos>`, saved as `out_dir/tokenizer.json` with a `tokenizer_config.json` naming
    `<eos>`; returns `out_dir`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words = [*WORDS, *(f"w{i}" for i in range(extra_words))]
    trainer = trainers.WordLevelTrainer(
        vocab_size=len(words) + 2, special_tokens=["<unk>", "<eos>"]
    )
    tokenizer.train_from_iterator([" ".join(words)], trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return out_dir
