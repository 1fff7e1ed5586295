"""Host buffers of the message exchange that are reused: send headers (`HeaderPool`) and
received payloads (`ReceiveBuffers`); no process group."""

from __future__ import annotations

import torch

from disagmoe.distributed.exchange import (
    REUSE_MIN_BYTES,
    HeaderPool,
    ReceiveBuffers,
    decode_header,
    encode_header,
)


def test_a_reused_header_carries_only_the_new_message() -> None:
    pool = HeaderPool()
    buf = pool.take()
    first = [torch.arange(100, dtype=torch.float64), torch.ones(3, 2, dtype=torch.bfloat16)]
    encode_header(first, (1, 2, 3, 4, 0), buf)
    pool.give(buf)
    again = pool.take()
    assert again is buf
    second = [torch.tensor([True, False]), torch.arange(6).reshape(2, 3)[:, 1]]  # non-contiguous
    header, payloads = encode_header(second, (5, 6, 7, 8, 0), again)
    ident, specs = decode_header(header)
    assert ident == (5, 6, 7, 8, 0) and payloads == []
    assert specs == [(torch.bool, True, (2,)), (torch.int64, True, (2,))]
    pos = 64 * 8
    assert header[pos : pos + 2].view(torch.bool).tolist() == [True, False]
    assert header[pos + 8 : pos + 24].view(torch.int64).tolist() == [1, 4]


def test_receive_buffer_is_reused_only_once_nothing_holds_it() -> None:
    buffers = ReceiveBuffers(keep_bytes=4 * REUSE_MIN_BYTES)
    shape = (REUSE_MIN_BYTES // 8,)
    a = buffers.empty(shape, torch.float64)
    view = a[10:]
    ptr = a.data_ptr()
    del a
    b = buffers.empty(shape, torch.float64)  # `view` still holds the first storage
    assert b.data_ptr() != ptr
    del view
    c = buffers.empty(shape, torch.float64)
    assert c.data_ptr() == ptr and c.shape == shape and c.dtype == torch.float64
    d = buffers.empty((2, REUSE_MIN_BYTES // 8), torch.float32)  # another size: fresh
    assert d.data_ptr() not in (ptr, b.data_ptr()) and d.shape == (2, REUSE_MIN_BYTES // 8)


def test_receive_buffers_keep_at_most_their_budget_and_no_small_ones() -> None:
    buffers = ReceiveBuffers(keep_bytes=2 * REUSE_MIN_BYTES)
    big = (REUSE_MIN_BYTES,)  # uint8: REUSE_MIN_BYTES bytes each
    held = [buffers.empty(big, torch.uint8) for _ in range(3)]
    assert buffers.kept == 2 * REUSE_MIN_BYTES  # the third was not kept
    kept = [t.data_ptr() for t in held[:2]]
    held.clear()
    again = [buffers.empty(big, torch.uint8) for _ in range(3)]
    assert [t.data_ptr() for t in again[:2]] == kept
    small = buffers.empty((16,), torch.uint8)
    assert buffers.kept == 2 * REUSE_MIN_BYTES and small.numel() == 16


def test_a_held_receive_buffer_does_not_stand_in_front_of_the_free_ones() -> None:
    """A buffer held long (an activation kept for its backward) goes to the back of the
    queue: the requests behind it get the free buffers, none of them a fresh one, and the
    held one only once it is free."""
    buffers = ReceiveBuffers(keep_bytes=8 * REUSE_MIN_BYTES)
    shape = (2, REUSE_MIN_BYTES // 16)
    first = [buffers.empty(shape, torch.float64) for _ in range(6)]
    ptrs = [t.data_ptr() for t in first]
    held = first[0]
    first.clear()
    for _ in range(3):  # three rounds of five messages, each consumed before the next round
        again = [buffers.empty(shape, torch.float64) for _ in range(5)]
        assert sorted(t.data_ptr() for t in again) == sorted(ptrs[1:])
        assert all(t.shape == shape and t.is_contiguous() for t in again)
        again.clear()
    assert held.data_ptr() == ptrs[0]
    del held
    got = [buffers.empty(shape, torch.float64) for _ in range(6)]
    assert sorted(t.data_ptr() for t in got) == sorted(ptrs)  # the held one too, now free


def test_a_free_receive_buffer_behind_many_held_ones_is_found() -> None:
    """Many activations held at once (a slot's forward messages until its backward): the
    free buffers behind them are still reused, not replaced by fresh ones."""
    buffers = ReceiveBuffers(keep_bytes=8 * REUSE_MIN_BYTES)
    shape = (REUSE_MIN_BYTES // 8,)
    first = [buffers.empty(shape, torch.float64) for _ in range(8)]
    ptrs = [t.data_ptr() for t in first]
    held = first[:6]
    first.clear()
    again = [buffers.empty(shape, torch.float64) for _ in range(2)]
    assert sorted(t.data_ptr() for t in again) == sorted(ptrs[6:])
    fresh = buffers.empty(shape, torch.float64)  # every kept one is held now
    assert fresh.data_ptr() not in ptrs and len(held) == 6
