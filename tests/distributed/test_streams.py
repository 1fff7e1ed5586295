"""The executor's lanes on streams (`runtime.streams`), checked on CPU with a fake stream
backend that logs every call: each lane thread runs on its own stream, a consumer adopts a
received payload and waits on its producer's event before its compute, compute spans are
timed by events resolved once the step is done; and with no backend (the CPU) no stream or
event of the accelerator is ever created. Two gloo ranks, one spawn."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from disagmoe.distributed.exchange import INLINE_BYTES
from disagmoe.schedule.ir import Instr, Msg, Op, Schedule
from disagmoe.testing.spawn import run_ranks

DISPATCH = Msg("dispatch", 0, 0, 0, 1)
GRAD = Msg("grad_dispatch", 0, 0, 1, 0)
BIG = 2 * INLINE_BYTES // 8  # float64 elements: more than a header carries inline


def _schedule() -> Schedule:
    """A(l0) forward sends a payload to F(l0); F's backward (on the other lane, after its
    forward) sends a gradient back to A's backward."""
    return Schedule(
        name="streams",
        num_ranks=2,
        num_slots=1,
        max_in_flight=1,
        roles=("A(g0,r0)", "F(g0,j0)"),
        ranks=(
            (Instr(Op.FWD, "A", 0, 0), Instr(Op.SEND, msg=DISPATCH),
             Instr(Op.RECV, msg=GRAD), Instr(Op.BWD, "A", 0, 0)),
            (Instr(Op.RECV, msg=DISPATCH), Instr(Op.FWD, "F", 0, 0),
             Instr(Op.BWD, "F", 0, 0), Instr(Op.SEND, msg=GRAD)),
        ),
    )  # fmt: skip


class _Worker:
    """Sends a fresh payload per output; keeps one tensor from each forward for its backward."""

    def __init__(self) -> None:
        self.stash: dict[tuple[int, int], torch.Tensor] = {}
        self.seen: dict[str, list[int]] = {}  # compute -> data_ptr of the payloads it got

    def forward(
        self,
        layer: int,
        slot: int,
        received: dict[Msg, list[torch.Tensor]],
        outgoing: list[Msg],
        *,
        keep: bool = True,
        chunk: int = -1,
    ) -> dict[Msg, list[torch.Tensor]]:
        self.seen[f"F{layer}"] = [t.data_ptr() for p in received.values() for t in p]
        self.stash[(layer, slot)] = torch.zeros(BIG, dtype=torch.float64)
        return {m: [torch.ones(BIG, dtype=torch.float64)] for m in outgoing}

    def backward(
        self,
        layer: int,
        slot: int,
        received: dict[Msg, list[torch.Tensor]],
        outgoing: list[Msg],
        *,
        chunk: int = -1,
        defer: bool = False,
    ) -> dict[Msg, list[torch.Tensor]]:
        self.seen[f"B{layer}"] = [t.data_ptr() for p in received.values() for t in p]
        self.stash.pop((layer, slot))
        return {m: [torch.full((BIG,), 2.0, dtype=torch.float64)] for m in outgoing}

    def kept(self, layer: int, slot: int, *, chunk: int = -1) -> list[torch.Tensor]:
        return [self.stash[(layer, slot)]]

    def sync(self, step: int) -> int:
        return 0

    def optimizer_step(self, step: int) -> int:
        return 0


class _FakeBackend:
    """A stream backend that logs (call, thread, ...) in call order; events are numbered,
    and 1 ms of "device time" passes between consecutive events."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self._ids = itertools.count()
        self._current = threading.local()

    def _thread(self) -> str:
        return threading.current_thread().name

    def new_stream(self, background: bool = False) -> str:
        return f"{'background' if background else 'stream'}{next(self._ids)}"

    @contextmanager
    def use(self, stream: str) -> Iterator[None]:
        self.log.append(("use", self._thread(), stream))
        self._current.stream = stream
        yield

    def record(self, stream: str | None) -> tuple[str, int]:
        on: str = stream if stream is not None else getattr(self._current, "stream", "default")
        event = (on, next(self._ids))
        self.log.append(("record", self._thread(), on, event))
        return event

    def wait(self, stream: str | None, event: tuple[str, int]) -> None:
        self.log.append(("wait", self._thread(), stream, event))

    def record_stream(self, tensor: torch.Tensor, stream: str) -> None:
        self.log.append(("record_stream", self._thread(), stream, tensor.data_ptr()))

    def synchronize(self, event: tuple[str, int]) -> None:
        self.log.append(("synchronize", self._thread(), event))

    def elapsed_ms(self, start: tuple[str, int], end: tuple[str, int]) -> float:
        return float(end[1] - start[1])

    def holds(self, tensor: torch.Tensor) -> bool:
        return tensor.numel() >= BIG  # the payloads and the kept tensor play device tensors


def _run() -> dict[str, Any]:
    import torch.distributed as dist

    from disagmoe.config import ModelConfig, ParallelConfig
    from disagmoe.distributed.layout import Layout
    from disagmoe.distributed.topology import Topology
    from disagmoe.runtime.executor import Executor
    from disagmoe.runtime.streams import LaneStreams
    from disagmoe.schedule.semantics import RankProgram
    from disagmoe.trace import Tracer

    rank = dist.get_rank()
    schedule = _schedule()
    program = RankProgram.build(schedule, rank)
    layout = Layout.build(
        ModelConfig(num_layers=1, num_experts=2), ParallelConfig(attn_workers=1, expert_workers=1)
    )
    topo = Topology.build(layout)
    lanes = [*program.running_lanes, *(f"recv{src}{channel}" for src, channel in program.streams)]
    backend = _FakeBackend()
    worker = _Worker()
    tracer = Tracer(rank, schedule.roles[rank])
    faked = Executor(
        program, schedule.roles[rank], topo, worker, worker, tracer,
        timeout_s=30, streams=LaneStreams(backend, lanes),
    )  # fmt: skip
    faked.run_step(0)
    faked_seen = dict(worker.seen)

    def no_accelerator(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("an accelerator stream or event was created on the CPU")

    for name in ("Stream", "Event", "stream", "synchronize"):
        setattr(torch.cuda, name, no_accelerator)
    cpu_worker = _Worker()
    cpu_tracer = Tracer(rank, schedule.roles[rank])
    cpu = Executor(
        program, schedule.roles[rank], Topology.build(layout), cpu_worker, cpu_worker,
        cpu_tracer, timeout_s=30,
    )  # fmt: skip
    cpu.run_step(0)
    return {
        "streams": faked.streams.streams,
        "log": backend.log,
        "seen": faked_seen,
        "spans": [
            (e["name"], e["cat"], e["dur"])
            for e in tracer.step_events(0)
            if e["cat"] in ("fwd", "bwd")
        ],
        "cpu_active": cpu.streams.active,
        "cpu_spans": sorted(
            e["name"] for e in cpu_tracer.step_events(0) if e["cat"] in ("fwd", "bwd")
        ),
    }


def _index(log: list[tuple[Any, ...]], entry: tuple[Any, ...]) -> int:
    return log.index(entry)


def test_lanes_run_on_their_streams_and_hand_over_through_events() -> None:
    results = run_ranks(_run, 2)
    for rank, res in enumerate(results):
        streams, log = res["streams"], res["log"]
        # every lane thread made its own stream current, once, for its whole life
        uses = {thread: stream for call, thread, stream, *_ in log if call == "use"}
        assert uses == streams and len(set(streams.values())) == len(streams), (rank, uses)
        assert sum(1 for e in log if e[0] == "use") == len(streams)
        fwd, bwd = streams["fwd"], streams["bwd"]
        # each compute is timed by two events on its lane's stream, queued from its thread
        stamps = {
            lane: [e for e in log if e[0] == "record" and e[1] == lane] for lane in ("fwd", "bwd")
        }
        assert [e[2] for e in stamps["fwd"]] == [fwd, fwd]
        assert [e[2] for e in stamps["bwd"]] == [bwd, bwd]
        fwd_end = stamps["fwd"][1][3]  # the forward's end event: what the backward waits on
        bwd_start = _index(log, stamps["bwd"][0])
        assert _index(log, ("wait", "bwd", bwd, fwd_end)) < bwd_start
        # the received payload is adopted by its consumer's stream before the compute;
        # what the forward kept is adopted by the backward's stream before the backward
        consumer, stream, first = (
            ("fwd", fwd, stamps["fwd"][0]) if rank else ("bwd", bwd, stamps["bwd"][0])
        )
        (ptr,) = res["seen"]["F0" if rank else "B0"]
        assert _index(log, ("record_stream", consumer, stream, ptr)) < _index(log, first)
        adopted = [e for e in log[:bwd_start] if e[0] == "record_stream" and e[2] == bwd]
        assert len(adopted) == (1 if rank else 2)  # the kept tensor (and A's gradient)
        # spans come from the events: 1 ms of fake device time per event in between
        durations = {lane: 1000.0 * (s[1][3][1] - s[0][3][1]) for lane, s in stamps.items()}
        assert sorted((cat, dur) for _, cat, dur in res["spans"]) == sorted(durations.items())
        # the lanes start after what the main thread queued (the previous optimizer step),
        # and the main thread's stream (SYNC, STEP) waits for every lane's at the end
        main = [e for e in log if e[1] == "MainThread"]
        origin = main[0][3]
        assert main[0][:3] == ("record", "MainThread", "default")
        starts = main[1 : 1 + len(streams)]
        assert sorted(e[2] for e in starts) == sorted(streams.values())
        assert all(e[0] == "wait" and e[3] == origin for e in starts)
        joins = [e for e in log if e[:3] == ("wait", "MainThread", None)]
        ends = {e[3]: e[2] for e in log if e[0] == "record" and e[1] == "MainThread"}
        assert sorted(ends[e[3]] for e in joins) == sorted(streams.values())
        assert _index(log, joins[0]) > max(_index(log, s[1]) for s in stamps.values())
        # the host waits for events only on the main thread: at the step's start and end
        waits = [e for e in log if e[0] == "synchronize"]
        assert waits and all(e[1] == "MainThread" for e in waits)
        assert _index(log, waits[1]) > max(_index(log, s[1]) for s in stamps.values())
        # on the CPU: no backend, nothing of the accelerator touched, spans on the wall clock
        assert res["cpu_active"] is False
        assert res["cpu_spans"] == (["BF l0 s0", "FF l0 s0"] if rank else ["BA l0 s0", "FA l0 s0"])
