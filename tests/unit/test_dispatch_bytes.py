"""The EP dispatch's byte layout (`baselines.moe.pack_pieces` / `unpack_pieces`): floats
and int64s of every peer in one buffer come back bit for bit, whatever the float type and
however odd the piece sizes (the int pieces then start at offsets that are not multiples
of 8)."""

from __future__ import annotations

import pytest
import torch

from disagmoe.baselines.moe import pack_pieces, unpack_pieces


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_pieces_round_trip_at_odd_offsets(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    f_counts, i_counts = [3, 0, 5, 1], [2, 4, 0, 6]
    floats = [torch.randn(n, generator=g).to(dtype) for n in f_counts]
    ints = [torch.randint(-(2**40), 2**40, (n,), generator=g) for n in i_counts]
    buf, sizes = pack_pieces(floats, ints)
    fe = floats[0].element_size()
    assert sizes == [f * fe + 8 * i for f, i in zip(f_counts, i_counts, strict=True)]
    assert buf.dtype == torch.uint8 and buf.numel() == sum(sizes)
    got_f, got_i = unpack_pieces(buf, f_counts, i_counts, dtype)
    for want, got in zip(floats, got_f, strict=True):
        assert got.dtype == dtype and torch.equal(got, want)
    for want, got in zip(ints, got_i, strict=True):
        assert got.dtype == torch.int64 and torch.equal(got, want)


def test_float_pieces_are_views_of_the_received_bytes() -> None:
    floats, ints = [torch.ones(3), torch.ones(2)], [torch.arange(1), torch.arange(2)]
    buf, _ = pack_pieces(floats, ints)
    got_f, _ = unpack_pieces(buf, [3, 2], [1, 2], torch.float32)
    assert all(f.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() for f in got_f)
