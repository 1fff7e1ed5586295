"""Schedule instructions: the data that the executor runs, the validator checks,
the simulator replays and the trace/plot tools draw.

A `Schedule` holds one instruction list per rank. Instructions are:

* `FWD` / `BWD` — compute the forward / backward of component `comp` ("A" or
  "F") of `layer` for micro-batch `slot` (on an A rank, `layer == L` is the
  final norm + LM head + loss);
* `SEND` / `RECV` — move one named message `Msg` between two ranks;
* `SYNC` — all-reduce gradients among this rank's data-parallel replicas;
* `STEP` — clip gradients and take the optimizer step.

Expert-parallel baselines (`disagmoe.baselines`) add two ops:

* `A2A` — one all-to-all of an EP group: `comp` names the phase ("dispatch",
  "combine", "grad_combine", "grad_dispatch"), `group` the member ranks; a
  member blocks until every member reaches the same (comp, layer, slot);
* `W` — the weight-gradient part of a backward split into input (`BWD`) and
  weight (`W`) halves (zero-bubble / DualPipeV schedules).

Exchange chunks (`Schedule.meta["exchange_chunks"]` = c > 1, AF-Pipe only): each
micro-batch's exchange with each expert shard is split into c chunks of its rows
(`chunk_rows`): the four exchange messages carry `Msg.chunk` 0..c-1 and the F shard's
FWD/BWD of (layer, slot) is c computes `Instr.chunk` 0..c-1, one per chunk, so the
shard computes chunk k while chunk k+1 is still on the wire and chunk k-1's combine
leaves. Attention computes and `act`/`grad_act` are never chunked (`chunk` -1): an
A compute produces or consumes every chunk of its exchange. Unchunked schedules have
`chunk` -1 everywhere.

Two more facts of the baselines are data too: `Instr.pair` marks the
instructions of one overlapped forward/backward pair (DualPipeV's
`OVERLAP_F_B`), and `Schedule.meta["a2a_chunks"]` says into how many chunks
ep-overlap splits each expert compute and the all-to-alls around it. Every baseline runs
on PyTorch's pipeline runtime (`_PipelineScheduleRuntime`), which posts a receive when its
plan issues the sender's compute (`_add_send_recv`), ahead of need.

Every message kind declares itself in `MESSAGE_KINDS`: its channel, the compute
that produces it, the compute that consumes it, and what it carries. Each
instruction runs on a lane: compute on "fwd", "bwd" or — a W, the weight gradients a
split backward deferred — "wgt", messages on the channel
of their kind ("fwd" for activations, "bwd" for gradients), SYNC and STEP on
"sync". Per (sender, receiver, channel) messages are FIFO: the order of SENDs
in the sender's list equals the order of RECVs in the receiver's.

How a list executes is `Schedule.execution`, whose rules live in
`schedule.semantics`: "lanes" (AF-Pipe, `runtime.executor`) or "in-order" (the
EP baselines, run by PyTorch's pipelining runtime one instruction at a time).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from ..train_config import MESSAGE_KIND_NAMES


class Op(StrEnum):
    FWD = "F"
    BWD = "B"
    SEND = "SEND"
    RECV = "RECV"
    SYNC = "SYNC"
    STEP = "STEP"
    A2A = "A2A"
    WGT = "W"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """The compute at one end of a message: `op` of `comp` at `msg.layer + layer_offset`."""

    op: Op
    comp: str
    layer_offset: int


@dataclass(frozen=True, slots=True)
class MessageKind:
    """What a message of this kind carries, who produces it and who consumes it.

    `schedule.semantics` derives every rule about messages from this table (which
    compute posts a SEND, which compute waits for a RECV, the lane and channel), so
    adding a kind is one entry here plus the worker code that fills and reads its payload.
    """

    name: str
    channel: str  # "fwd" (activations) or "bwd" (gradients): a stream of its own
    producer: Endpoint  # on msg.src
    consumer: Endpoint  # on msg.dst
    payload: str


# The messages of one layer l (docs/design.md §2.2); payload layouts in runtime/stages.py.
MESSAGE_KINDS: dict[str, MessageKind] = {
    k.name: k
    for k in (
        MessageKind(
            "act", "fwd", Endpoint(Op.FWD, "A", 0), Endpoint(Op.FWD, "A", 1),
            "A(l) -> A(l+1): residual_BSH; on MoE layers also the per-shard token counts "
            "and every shard's token ids",
        ),
        MessageKind(
            "dispatch", "fwd", Endpoint(Op.FWD, "A", 0), Endpoint(Op.FWD, "F", 0),
            "A(l) -> F(l): tokens routed to the shard, their rows, local expert ids, weights",
        ),
        MessageKind(
            "combine", "fwd", Endpoint(Op.FWD, "F", 0), Endpoint(Op.FWD, "A", 1),
            "F(l) -> A(l+1): the weighted expert outputs of the dispatched rows",
        ),
        MessageKind(
            "grad_act", "bwd", Endpoint(Op.BWD, "A", 1), Endpoint(Op.BWD, "A", 0),
            "A(l+1) -> A(l): gradient of act's residual",
        ),
        MessageKind(
            "grad_combine", "bwd", Endpoint(Op.BWD, "A", 1), Endpoint(Op.BWD, "F", 0),
            "A(l+1) -> F(l): gradient of combine",
        ),
        MessageKind(
            "grad_dispatch", "bwd", Endpoint(Op.BWD, "F", 0), Endpoint(Op.BWD, "A", 0),
            "F(l) -> A(l): gradient of the dispatched tokens and of their weights",
        ),
    )
}  # fmt: skip
FORWARD_KINDS = tuple(k for k, v in MESSAGE_KINDS.items() if v.channel == "fwd")
BACKWARD_KINDS = tuple(k for k, v in MESSAGE_KINDS.items() if v.channel == "bwd")
assert FORWARD_KINDS + BACKWARD_KINDS == MESSAGE_KIND_NAMES, "train_config.MESSAGE_KIND_NAMES"
A2A_PHASES = ("dispatch", "combine", "grad_combine", "grad_dispatch")  # `comp` of an A2A


EXCHANGE_KINDS = A2A_PHASES  # the messages that exchange chunks split (module doc)


def chunk_rows(rows: int, chunks: int, chunk: int) -> tuple[int, int]:
    """[start, end) of chunk `chunk` of `rows` rows split into `chunks` contiguous parts
    whose sizes differ by at most one (`chunk` -1: every row). The attention replica and
    the expert shard both split a shard's rows of a micro-batch by this rule."""
    if chunk < 0:
        return 0, rows
    return chunk * rows // chunks, (chunk + 1) * rows // chunks


@dataclass(frozen=True, slots=True, order=True)
class Msg:
    kind: str
    layer: int
    slot: int
    src: int
    dst: int
    chunk: int = -1  # exchange chunk (module doc); -1: not chunked

    @property
    def channel(self) -> str:
        return MESSAGE_KINDS[self.kind].channel

    def __str__(self) -> str:
        where = f"l{self.layer},s{self.slot}" + (f",c{self.chunk}" if self.chunk >= 0 else "")
        return f"{self.kind}[{where}] {self.src}->{self.dst}"


def compute_event_name(op: str, comp: str, layer: int, slot: int, chunk: int = -1) -> str:
    """A compute instruction's text, also its trace event's name: "FA l3 s1" ("FF l3 s1 c0"
    for exchange chunk 0 of an expert compute)."""
    return f"{op}{comp} l{layer} s{slot}" + (f" c{chunk}" if chunk >= 0 else "")


@dataclass(frozen=True, slots=True)
class Instr:
    op: Op
    comp: str = ""
    layer: int = -1
    slot: int = -1
    msg: Msg | None = None
    group: tuple[int, ...] = ()  # member ranks of an A2A
    pair: int = -1  # DualPipeV: id of the overlapped F&B pair this belongs to (-1: none)
    chunk: int = -1  # exchange chunk of an F compute (module doc); -1: not chunked

    @property
    def lane(self) -> str:
        if self.op == Op.FWD:
            return "fwd"
        if self.op == Op.BWD:
            return "bwd"
        if self.op == Op.WGT:
            return "wgt"
        if self.op == Op.A2A:
            return MESSAGE_KINDS[self.comp].channel
        if self.msg is not None:
            return self.msg.channel
        return "sync"

    @property
    def is_compute(self) -> bool:
        return self.op in (Op.FWD, Op.BWD, Op.WGT)

    @property
    def task(self) -> tuple[str, str, int, int, int]:
        """(op, comp, layer, slot, chunk) of a compute instruction."""
        return (self.op.value, self.comp, self.layer, self.slot, self.chunk)

    def __str__(self) -> str:
        if self.msg is not None:
            return f"{self.op.value} {self.msg}"
        if self.op == Op.A2A:
            return f"A2A {self.comp} l{self.layer} s{self.slot} {list(self.group)}"
        if self.is_compute:
            return compute_event_name(self.op.value, self.comp, self.layer, self.slot, self.chunk)
        return self.op.value


@dataclass(frozen=True)
class Schedule:
    """Per-rank instruction lists plus what the executor needs to interpret them."""

    name: str
    num_ranks: int
    num_slots: int
    max_in_flight: int  # micro-batch slots a rank may hold activations for
    roles: tuple[str, ...]  # human-readable role per rank, e.g. "A(g0,r1)"
    ranks: tuple[tuple[Instr, ...], ...]
    meta: dict[str, int | str] = field(default_factory=dict)
    execution: str = "lanes"  # "lanes" or "in-order" (see schedule.semantics)

    def to_text(self) -> str:
        header = (
            f"# schedule {self.name}: {self.num_ranks} ranks, {self.num_slots} slots, "
            f"max_in_flight={self.max_in_flight}"
        )
        return lists_text(header, self.entries())

    def to_csv(self) -> str:
        return lists_csv(self.entries())

    def entries(self) -> Iterator[tuple[int, str, Sequence[Instr]]]:
        """(rank, role, instruction list) of every rank."""
        return ((r, self.roles[r], instrs) for r, instrs in enumerate(self.ranks))


def lists_text(header: str, entries: Iterable[tuple[int, str, Sequence[Instr]]]) -> str:
    """Instruction lists as text: a header line, then per rank its role and numbered list."""
    lines = [header]
    for rank, role, instrs in entries:
        lines.append(f"rank {rank} {role}:")
        lines.extend(f"  {k:4d} [{i.lane:4s}] {i}" for k, i in enumerate(instrs))
    return "\n".join(lines) + "\n"


def lists_csv(entries: Iterable[tuple[int, str, Sequence[Instr]]]) -> str:
    """Instruction lists as CSV, one row per instruction."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(
        [
            "rank",
            "role",
            "index",
            "lane",
            "op",
            "comp",
            "layer",
            "slot",
            "kind",
            "src",
            "dst",
            "chunk",
        ]
    )
    for rank, role, instrs in entries:
        for k, i in enumerate(instrs):
            m = i.msg
            writer.writerow(
                [
                    rank,
                    role,
                    k,
                    i.lane,
                    i.op.value,
                    i.comp,
                    m.layer if m else i.layer,
                    m.slot if m else i.slot,
                    m.kind if m else "",
                    m.src if m else "",
                    m.dst if m else "",
                    m.chunk if m else i.chunk,
                ]
            )
    return buf.getvalue()
