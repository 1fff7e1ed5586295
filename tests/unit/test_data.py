"""Data: samples of seq_len+1 consecutive tokens, deterministic batches, bad files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from disagmoe.data import (
    TokenBatches,
    builtin_corpus,
    inputs_targets,
    load_tokens,
    permuted_index,
    split_micro_batches,
)


def test_samples_are_consecutive_and_non_overlapping() -> None:
    tokens = np.arange(100, dtype=np.int64)
    batches = TokenBatches(tokens, seq_len=9, global_batch_size=2, seed=0, vocab_size=100)
    assert batches.num_samples == 10
    seen = []
    for step in range(5):
        for sample in batches.global_batch(step):
            start = int(sample[0])
            assert start % 10 == 0
            assert torch.equal(sample, torch.arange(start, start + 10))
            seen.append(start)
    assert sorted(seen) == list(range(0, 100, 10))  # one epoch visits each sample once


def test_inputs_targets_shift() -> None:
    sample = torch.arange(6).view(1, 6)
    x, y = inputs_targets(sample)
    assert x.tolist() == [[0, 1, 2, 3, 4]] and y.tolist() == [[1, 2, 3, 4, 5]]


def test_order_depends_on_seed_only() -> None:
    tokens = np.arange(1000) % 50
    a = TokenBatches(tokens, seq_len=9, global_batch_size=4, seed=1, vocab_size=50)
    b = TokenBatches(tokens, seq_len=9, global_batch_size=4, seed=1, vocab_size=50)
    c = TokenBatches(tokens, seq_len=9, global_batch_size=4, seed=2, vocab_size=50)
    assert torch.equal(a.global_batch(3), b.global_batch(3))
    assert not torch.equal(a.global_batch(3), c.global_batch(3))
    mbs = split_micro_batches(a.global_batch(0), 2)
    assert len(mbs) == 2 and torch.equal(torch.cat(mbs), a.global_batch(0))


def test_file_formats(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("héllo")
    assert load_tokens(str(tmp_path / "t.txt")).tolist() == list("héllo".encode())
    np.save(tmp_path / "t.npy", np.array([3, 1, 2], dtype=np.int32))
    assert load_tokens(str(tmp_path / "t.npy")).tolist() == [3, 1, 2]
    np.array([7, 65535], dtype=np.uint16).tofile(tmp_path / "t.bin")
    assert load_tokens(str(tmp_path / "t.bin"), "uint16").tolist() == [7, 65535]
    np.array([70000], dtype=np.uint32).tofile(tmp_path / "u.bin")
    assert load_tokens(str(tmp_path / "u.bin"), "uint32").tolist() == [70000]


def test_bad_data(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_tokens(str(tmp_path / "none.txt"))
    (tmp_path / "odd.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(ValueError, match="not a multiple of uint16"):
        load_tokens(str(tmp_path / "odd.bin"), "uint16")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="not UTF-8"):
        load_tokens(str(tmp_path / "bin.txt"))
    with pytest.raises(ValueError, match="fewer than one global batch"):
        TokenBatches(np.arange(10), seq_len=9, global_batch_size=2, seed=0, vocab_size=10)
    with pytest.raises(ValueError, match="model.vocab_size"):
        TokenBatches(np.arange(100), seq_len=9, global_batch_size=2, seed=0, vocab_size=50)


def test_builtin_corpus_is_deterministic_text() -> None:
    text = builtin_corpus()
    assert text == builtin_corpus() and len(text) > 100_000 and text.isascii()


def test_permuted_index_is_a_keyed_bijection() -> None:
    for n in (1, 2, 3, 10, 64, 65, 1000, 4097):
        for key in (0, 7):
            assert sorted(permuted_index(i, n, key) for i in range(n)) == list(range(n))
    first = [permuted_index(i, 1000, 0) for i in range(1000)]
    assert first != [permuted_index(i, 1000, 1) for i in range(1000)]
    assert first != list(range(1000))
    # a few calls on a huge range need no memory proportional to it
    assert 0 <= permuted_index(123, 10**12, 5) < 10**12
