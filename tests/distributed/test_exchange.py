"""The wire format of a message on a channel of `Topology.build` (on CPU its header and
payload groups are both gloo): inline tensors (headers sent at their used length into
receive buffers of the largest size), payloads, empty tensors, dtypes,
identity checks, a payload that never follows its header; and who takes a stream's headers
in the executor, its receive lane or its consuming lane (two ranks, one spawn)."""

from __future__ import annotations

import pytest
import torch

from disagmoe.testing.spawn import run_ranks


def _messages() -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(3000, 16, generator=gen, dtype=torch.float64)  # > inline capacity
    return [
        [torch.randn(4, 3, generator=gen), torch.arange(5)],  # all inline
        [big, torch.arange(7), torch.zeros(0, 16)],  # payload + inline + empty
        [torch.zeros(0, 16, dtype=torch.float64), torch.zeros(0, dtype=torch.int64)],  # nothing
        [big.to(torch.bfloat16), torch.tensor([True, False]), torch.ones(3, dtype=torch.int32)],
        [big[:, :8], torch.tensor(2.5)],  # a non-contiguous payload and a 0-dim tensor
        [big[:1000, :8].to(torch.float32), big[:4, :3]],  # 32 KB + non-contiguous, inline
    ]


def _exchange() -> list[str]:
    import torch.distributed as dist

    from disagmoe.config import ParallelConfig
    from disagmoe.device import HOST_BACKEND, payload_backend, resolve_device
    from disagmoe.distributed.exchange import (
        META_WORDS,
        CommTimeout,
        ProtocolError,
        Receiver,
        encode_header,
        send_message,
    )
    from disagmoe.distributed.layout import Layout
    from disagmoe.distributed.topology import Topology
    from disagmoe.presets import MODEL_PRESETS

    device = resolve_device("cpu")
    layout = Layout.build(
        MODEL_PRESETS["tiny"], ParallelConfig(attn_workers=1, expert_workers=1, device="cpu")
    )
    topo = Topology.build(layout, device=device, payload_backend=payload_backend(device))
    channel = topo.stream(0, 1, "fwd")
    assert dist.get_backend(channel.header) == HOST_BACKEND == dist.get_backend(channel.payload)
    messages = _messages()
    if dist.get_rank() == 0:
        works = [
            w
            for k, m in enumerate(messages)
            for w in send_message(m, 1, channel, (k, 0, 0, 0, 0))[0]
        ]
        small, nbytes = send_message([torch.ones(2)], 1, channel, (9, 9, 9, 9, 9))
        assert nbytes == META_WORDS * 8 + 8  # what travels: the fields, then the inline tensor
        works += small
        header, payloads = encode_header(messages[1], (7, 0, 0, 0, 0))  # its payload never follows
        assert payloads
        works.append(channel.header.send([header], 1, 0))
        for w in works:
            w.wait()
        dist.barrier()  # stay up until the receiver gave up on the payload
        return []
    rx = Receiver(
        0, channel, window=2, device=topo.device
    )  # fewer posted ahead than messages: reposting works
    rx.start(len(messages) + 2)
    checks = []
    for k, sent in enumerate(messages):
        got = rx.next(30, "test", expect=(k, 0, 0, 0, 0)).wait(30, "test")
        assert len(got) == len(sent)
        for a, b in zip(got, sent, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (k, a, b)
            assert a.untyped_storage().nbytes() == a.nbytes  # no header buffer behind it
        checks.append(f"message {k} ok")
    try:
        rx.next(30, "test", expect=(5, 0, 0, 0, 0))
    except ProtocolError as err:
        checks.append(f"protocol error {err.got}")
    incoming = rx.next(30, "test", expect=(7, 0, 0, 0, 0))
    try:
        incoming.wait(1.0, lambda: "receiving 7")
    except CommTimeout as err:
        checks.append(str(err))
    dist.barrier()
    return checks


# The stream's messages (one per layer): all inline, or with a payload (> 64 KiB).
TURN_SIZES = (16, 16, 16, 20000, 20000, 16, 16)


def _turns() -> list[tuple[int, int, str]]:
    """Rank 0 sends one `dispatch` per layer, of TURN_SIZES floats, to rank 1 for two steps;
    rank 1's computes check what arrived. Returns, on rank 1, (step, layer, the thread that
    took the header) per message."""
    import threading

    import torch.distributed as dist

    from disagmoe.config import ModelConfig, ParallelConfig
    from disagmoe.distributed.layout import Layout
    from disagmoe.distributed.topology import Topology
    from disagmoe.runtime.executor import Executor
    from disagmoe.schedule.semantics import RankProgram
    from disagmoe.testing.streams import one_stream_schedule
    from disagmoe.trace import Tracer

    def payload(layer: int, step: int) -> list[torch.Tensor]:
        n = TURN_SIZES[layer]
        return [torch.arange(n, dtype=torch.float64) * (step + 1) + layer, torch.arange(4)]

    taken: list[tuple[int, int, str]] = []

    class Worker:
        step = 0

        def forward(self, layer, slot, received, outgoing, *, keep=True, chunk=-1):  # type: ignore[no-untyped-def]
            for tensors in received.values():
                expect = payload(layer, self.step)
                assert all(torch.equal(a, b) for a, b in zip(tensors, expect, strict=True))
            return {m: payload(layer, self.step) for m in outgoing}

        def sync(self, step: int) -> int:
            return 0

        def optimizer_step(self, step: int) -> int:
            self.step += 1
            return 0

    class Recording(Executor):
        def _take_header(self, st, msg, receiver, timeout_s):  # type: ignore[no-untyped-def]
            taken.append((st.step, msg.layer, threading.current_thread().name))
            return super()._take_header(st, msg, receiver, timeout_s)

    schedule = one_stream_schedule(len(TURN_SIZES), "turns")
    rank = dist.get_rank()
    layout = Layout.build(
        ModelConfig(num_layers=1, num_experts=2), ParallelConfig(attn_workers=1, expert_workers=1)
    )
    worker = Worker()
    executor = Recording(
        RankProgram.build(schedule, rank), schedule.roles[rank], Topology.build(layout),
        worker, worker, Tracer(rank, schedule.roles[rank]), timeout_s=60,
    )  # fmt: skip
    for step in range(2):
        executor.run_step(step)
        worker.optimizer_step(step)
    return taken


def _exchange_and_turns() -> tuple[list[str], list[tuple[int, int, str]]]:
    return _exchange(), _turns()


@pytest.fixture(scope="module")
def received() -> tuple[list[str], list[tuple[int, int, str]]]:
    """What rank 1 saw, of both parts (one spawn)."""
    return run_ranks(_exchange_and_turns, 2)[1]


def test_messages_arrive_whole_and_in_order(
    received: tuple[list[str], list[tuple[int, int, str]]],
) -> None:
    receiver = received[0]
    assert receiver[:6] == [f"message {k} ok" for k in range(6)]
    assert receiver[6] == "protocol error (9, 9, 9, 9, 9)"
    assert receiver[7] == (
        "receiving 7: its header arrived, its payload did not complete within 1 s"
    ), receiver


def test_stream_turns(received: tuple[list[str], list[tuple[int, int, str]]]) -> None:
    """Each step the receive lane takes the first header; after a message without a payload
    the consuming lane ("fwd") takes the stream's headers itself, and a message with a
    payload hands them back to the receive lane ("recv0fwd"), which keeps them for the rest
    of the step: the stream carries both kinds."""
    taken = received[1]
    lanes = ["recv0fwd", "fwd", "fwd", "fwd", "recv0fwd", "recv0fwd", "recv0fwd"]
    assert taken == [(step, layer, lanes[layer]) for step in range(2) for layer in range(7)]
