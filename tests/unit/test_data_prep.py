"""`disagmoe prepare-data` and reading its output: round trips, EOS, memmap, vocab checks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from disagmoe.command import resolve_train_config, train_parser
from disagmoe.config import RunConfig, replace_section
from disagmoe.data import _vocab_fits, build_batches, find_prepared, load_tokens
from disagmoe.data_prep import prepare_data, read_offsets
from disagmoe.testing.tokenizer import build_tiny_tokenizer
from disagmoe.training.setup import build_data

DOCS = ["the router sends a token", "an expert computes its output", "the attention layer waits"]


def write_jsonl(path: Path, docs: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


@pytest.fixture
def tok(tmp_path: Path) -> Path:
    return build_tiny_tokenizer(tmp_path / "tok")


def test_round_trip_with_eos_after_every_document(tmp_path: Path, tok: Path) -> None:
    text = tmp_path / "extra.txt"
    text.write_text("the expert waits")
    meta = prepare_data(
        str(tok), [str(write_jsonl(tmp_path / "d.jsonl", DOCS)), str(text)], str(tmp_path / "c")
    )
    tokenizer = Tokenizer.from_file(str(tok / "tokenizer.json"))
    eos = tokenizer.token_to_id("<eos>")
    tokens = load_tokens(str(tmp_path / "c"))
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    offsets = read_offsets(str(tmp_path / "c"))
    assert offsets[0] == 0 and offsets[-1] == len(tokens) == meta["num_tokens"]
    assert len(offsets) == 5 == meta["num_documents"] + 1
    for i, doc in enumerate([*DOCS, "the expert waits"]):
        ids = tokens[offsets[i] : offsets[i + 1]].tolist()
        assert ids[-1] == eos and eos not in ids[:-1]
        assert tokenizer.decode(ids[:-1]) == doc
    assert meta["vocab_size"] == tokenizer.get_vocab_size() and meta["eos_id"] == eos
    assert json.loads((tmp_path / "c.json").read_text()) == meta
    # PREFIX.bin names the same data
    assert np.array_equal(load_tokens(str(tmp_path / "c.bin")), tokens)


def test_large_vocabularies_are_written_as_uint32(tmp_path: Path) -> None:
    tok = build_tiny_tokenizer(tmp_path / "big", extra_words=70000)
    meta = prepare_data(
        str(tok), [str(write_jsonl(tmp_path / "d.jsonl", ["w69999 w3"]))], str(tmp_path / "c")
    )
    assert meta["dtype"] == "uint32" and meta["vocab_size"] > 1 << 16
    assert load_tokens(str(tmp_path / "c")).max() >= 1 << 16


def test_batches_come_from_the_memory_map(tmp_path: Path, tok: Path) -> None:
    prepare_data(str(tok), [str(write_jsonl(tmp_path / "d.jsonl", DOCS * 20))], str(tmp_path / "c"))
    tokens = np.asarray(load_tokens(str(tmp_path / "c")))
    vocab = json.loads((tmp_path / "c.json").read_text())["vocab_size"]
    batches = build_batches(
        str(tmp_path / "c"), "uint16", seq_len=7, global_batch_size=4, seed=3, vocab_size=vocab
    )
    assert isinstance(batches.tokens, np.memmap)
    samples = {tuple(tokens[i * 8 : (i + 1) * 8]) for i in range(len(tokens) // 8)}
    batch = batches.global_batch(2)
    assert batch.shape == (4, 8) and all(tuple(row.tolist()) in samples for row in batch)


def test_vocab_mismatch_is_refused(tmp_path: Path, tok: Path) -> None:
    prepare_data(str(tok), [str(write_jsonl(tmp_path / "d.jsonl", DOCS * 5))], str(tmp_path / "c"))
    vocab = find_prepared(str(tmp_path / "c")).vocab_size  # type: ignore[union-attr]
    kwargs = dict(seq_len=4, global_batch_size=2, seed=0)
    build_batches(str(tmp_path / "c"), "uint16", vocab_size=vocab + 2, **kwargs)  # padded: ok
    assert _vocab_fits(151669, 151936) and _vocab_fits(50257, 50304)  # Qwen3, GPT-2 padding
    assert not _vocab_fits(256, 151936) and not _vocab_fits(151937, 151936)
    with pytest.raises(ValueError, match=f"tokenized with vocab size {vocab}.*model.vocab_size"):
        build_batches(str(tmp_path / "c"), "uint16", vocab_size=vocab - 1, **kwargs)
    with pytest.raises(ValueError, match="prepare the data with the model's tokenizer"):
        build_batches(str(tmp_path / "c"), "uint16", vocab_size=256, **kwargs)  # bytes


def test_input_errors_are_one_line(tmp_path: Path, tok: Path) -> None:
    jsonl = write_jsonl(tmp_path / "d.jsonl", DOCS, key="body")
    with pytest.raises(ValueError, match="no tokenizer at"):
        prepare_data(str(tmp_path / "none"), [str(jsonl)], str(tmp_path / "c"))
    with pytest.raises(ValueError, match=r"line 1 has no string field 'text'; pass --text-key"):
        prepare_data(str(tok), [str(jsonl)], str(tmp_path / "c"))
    assert not (tmp_path / "c.bin").exists() and not (tmp_path / "c.json").exists()
    prepare_data(str(tok), [str(jsonl)], str(tmp_path / "c"), text_key="body")
    with pytest.raises(ValueError, match="does not exist"):
        prepare_data(str(tok), [str(tmp_path / "missing.jsonl")], str(tmp_path / "c"))
    (tok / "tokenizer_config.json").unlink()
    with pytest.raises(ValueError, match="names no EOS token.*--eos TOKEN"):
        prepare_data(str(tok), [str(jsonl)], str(tmp_path / "c"), text_key="body")
    with pytest.raises(ValueError, match="'</s>' is not in the tokenizer's vocabulary"):
        prepare_data(str(tok), [str(jsonl)], str(tmp_path / "c"), text_key="body", eos="</s>")


def test_hf_checkpoints_refuse_byte_data_unless_allowed() -> None:
    def data_of(**train: object) -> None:
        build_data(replace_section(RunConfig(), "train", init_from_hf="hf", **train))

    with pytest.raises(ValueError, match="--init-from-hf with byte tokens.*--allow-byte-data"):
        data_of()
    with pytest.raises(ValueError, match="--init-from-hf with byte tokens"):
        data_of(data="book.txt")
    with pytest.raises(ValueError, match="'corpus' does not exist"):  # past the byte check
        data_of(data="corpus")
    data_of(allow_byte_data=True)
    args = train_parser().parse_args(["--allow-byte-data"])
    assert resolve_train_config(args).train.allow_byte_data
