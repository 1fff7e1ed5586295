"""`disagmoe prepare-data`: tokenize text files into a memory-mappable token file.

Input files are `.jsonl` (one JSON object per line, the document in `--text-key`,
default `text`) or plain text (each file is one document). Every document is encoded
with a Hugging Face tokenizer from a local path (`tokenizer.json`, or a directory that
holds one), without the tokenizer's own special tokens, and followed by the EOS token.
Output, for `--out PREFIX`:

* `PREFIX.bin`  — the token ids back to back, uint16 if the vocabulary fits, else uint32;
* `PREFIX.idx`  — `.npy` int64 document offsets: document i is `[idx[i], idx[i+1])`,
  its EOS included (`len(idx) = documents + 1`);
* `PREFIX.json` — tokenizer path, vocab size, dtype, EOS id, token and document counts.

`disagmoe train --data PREFIX` reads it (`disagmoe.data.find_prepared`). Documents are
encoded in batches and written as they come: memory does not grow with the input.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

BATCH_DOCUMENTS = 1024  # documents encoded (in parallel, by `tokenizers`) per write


def load_tokenizer(path: str) -> tuple[Any, Path]:
    """A `tokenizers.Tokenizer` from `tokenizer.json` or a directory holding one."""
    from tokenizers import Tokenizer

    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise ValueError(
            f"no tokenizer at {path!r}: give a tokenizer.json file or a directory with one "
            "(a Hugging Face model or tokenizer directory)"
        )
    try:
        return Tokenizer.from_file(str(file)), file
    except Exception as err:  # tokenizers raises its own exception type
        raise ValueError(f"{str(file)!r} is not a Hugging Face tokenizer.json ({err})") from None


def eos_token_id(tokenizer: Any, tokenizer_file: Path, eos: str) -> int:
    """The id of `eos`, or of the `eos_token` in `tokenizer_config.json` beside the file."""
    if not eos:
        config = tokenizer_file.parent / "tokenizer_config.json"
        if config.is_file():
            value = json.loads(config.read_text()).get("eos_token") or ""
            eos = value.get("content", "") if isinstance(value, dict) else str(value)
    if not eos:
        raise ValueError(
            f"the tokenizer at {str(tokenizer_file)!r} names no EOS token (no eos_token in a "
            "tokenizer_config.json beside it); pass --eos TOKEN"
        )
    token_id = tokenizer.token_to_id(eos)
    if token_id is None:
        raise ValueError(f"EOS token {eos!r} is not in the tokenizer's vocabulary; check --eos")
    return int(token_id)


def read_documents(files: list[str], text_key: str) -> Iterator[str]:
    """Documents in order: a `.jsonl` line's `text_key`, or a whole text file."""
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"input file {name!r} does not exist")
        if path.suffix.lower() not in (".jsonl", ".json"):
            yield path.read_text(encoding="utf-8")
            continue
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{name} line {number} is not JSON ({err.msg})") from None
                if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
                    raise ValueError(
                        f"{name} line {number} has no string field {text_key!r}; "
                        "pass --text-key KEY"
                    )
                yield record[text_key]


def _batches(docs: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def prepare_data(
    tokenizer_path: str, inputs: list[str], out: str, *, text_key: str = "text", eos: str = ""
) -> dict[str, Any]:
    """Tokenize `inputs` into `out`.bin / .idx / .json; returns the metadata written."""
    tokenizer, tokenizer_file = load_tokenizer(tokenizer_path)
    eos_id = eos_token_id(tokenizer, tokenizer_file, eos)
    vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
    dtype = np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    offsets = [0]
    with open(out + ".bin.tmp", "wb") as bin_file:  # renamed once every document is in
        for batch in _batches(read_documents(inputs, text_key), BATCH_DOCUMENTS):
            for encoding in tokenizer.encode_batch(batch, add_special_tokens=False):
                ids = np.asarray([*encoding.ids, eos_id], dtype=dtype)
                bin_file.write(ids.tobytes())
                offsets.append(offsets[-1] + len(ids))
    Path(out + ".bin.tmp").replace(out + ".bin")
    with open(out + ".idx", "wb") as idx_file:
        np.save(idx_file, np.asarray(offsets, dtype=np.int64))
    meta = {
        "tokenizer": str(tokenizer_file.resolve()),
        "vocab_size": vocab_size,
        "dtype": dtype.name,
        "eos_id": eos_id,
        "num_tokens": offsets[-1],
        "num_documents": len(offsets) - 1,
        "inputs": [str(Path(name).resolve()) for name in inputs],
    }
    Path(out + ".json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def read_offsets(prefix: str) -> np.ndarray:
    """The document offsets of `prefix`.idx (memory-mapped)."""
    return np.load(prefix + ".idx", mmap_mode="r", allow_pickle=False)


def add_prepare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", required=True, metavar="DIR_OR_FILE",
                   help="tokenizer.json, or a directory holding one (a HF model dir)")  # fmt: skip
    p.add_argument("--input", required=True, nargs="+", metavar="FILE",
                   help=".jsonl (one document per line) or text files (one document each)")  # fmt: skip
    p.add_argument("--out", required=True, metavar="PREFIX",
                   help="writes PREFIX.bin, PREFIX.idx and PREFIX.json")  # fmt: skip
    p.add_argument("--text-key", default="text", help="jsonl: the document's field")
    p.add_argument("--eos", default="", metavar="TOKEN",
                   help="end-of-document token (default: eos_token of tokenizer_config.json)")  # fmt: skip


def run_prepare(args: argparse.Namespace) -> int:
    meta = prepare_data(args.tokenizer, args.input, args.out, text_key=args.text_key, eos=args.eos)
    print(
        f"prepare-data: {meta['num_documents']} documents, {meta['num_tokens']} tokens "
        f"({meta['dtype']}, vocab {meta['vocab_size']}, EOS {meta['eos_id']}) -> "
        f"{args.out}.bin / .idx / .json"
    )
    return 0
