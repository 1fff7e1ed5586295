"""The wire format of a message on a channel of `Topology.build` (on CPU its header and
payload groups are both gloo): inline tensors (headers sent at their used length into
receive buffers of the largest size), payloads, empty tensors, dtypes,
identity checks, a payload that never follows its header (two ranks, one spawn)."""

from __future__ import annotations

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
            w for k, m in enumerate(messages) for w in send_message(m, 1, channel, (k, 0, 0, 0, 0))
        ]
        works += send_message([torch.ones(2)], 1, channel, (9, 9, 9, 9, 9))
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


def test_messages_arrive_whole_and_in_order() -> None:
    receiver = run_ranks(_exchange, 2)[1]
    assert receiver[:6] == [f"message {k} ok" for k in range(6)]
    assert receiver[6] == "protocol error (9, 9, 9, 9, 9)"
    assert receiver[7] == (
        "receiving 7: its header arrived, its payload did not complete within 1 s"
    ), receiver
