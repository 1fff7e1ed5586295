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

Each instruction runs on a lane: compute on "fwd" or "bwd", messages on the
channel of their kind ("fwd" for activations, "bwd" for gradients), SYNC and
STEP on "sync". Per (sender, receiver, channel) messages are FIFO: the order
of SENDs in the sender's list equals the order of RECVs in the receiver's.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field
from enum import StrEnum


class Op(StrEnum):
    FWD = "F"
    BWD = "B"
    SEND = "SEND"
    RECV = "RECV"
    SYNC = "SYNC"
    STEP = "STEP"
    A2A = "A2A"
    WGT = "W"


# Message kinds of one layer l (see DESIGN.md §2.2):
#   act           A(l) -> A(l+1)   residual stream (+ dispatch token ids)
#   dispatch      A(l) -> F(l)     tokens routed to the shard, local expert ids, weights
#   combine       F(l) -> A(l+1)   weighted expert outputs of those tokens
#   grad_act      A(l+1) -> A(l)   gradient of act
#   grad_combine  A(l+1) -> F(l)   gradient of combine
#   grad_dispatch F(l) -> A(l)     gradient of the dispatched tokens and weights
FORWARD_KINDS = ("act", "dispatch", "combine")
BACKWARD_KINDS = ("grad_act", "grad_combine", "grad_dispatch")
A2A_PHASES = FORWARD_KINDS[1:] + BACKWARD_KINDS[1:]  # `comp` of an A2A instruction


@dataclass(frozen=True, slots=True, order=True)
class Msg:
    kind: str
    layer: int
    slot: int
    src: int
    dst: int

    @property
    def channel(self) -> str:
        return "fwd" if self.kind in FORWARD_KINDS else "bwd"

    def __str__(self) -> str:
        return f"{self.kind}[l{self.layer},s{self.slot}] {self.src}->{self.dst}"


@dataclass(frozen=True, slots=True)
class Instr:
    op: Op
    comp: str = ""
    layer: int = -1
    slot: int = -1
    msg: Msg | None = None
    group: tuple[int, ...] = ()  # member ranks of an A2A

    @property
    def lane(self) -> str:
        if self.op == Op.FWD:
            return "fwd"
        if self.op in (Op.BWD, Op.WGT):
            return "bwd"
        if self.op == Op.A2A:
            return "fwd" if self.comp in FORWARD_KINDS else "bwd"
        if self.msg is not None:
            return self.msg.channel
        return "sync"

    @property
    def is_compute(self) -> bool:
        return self.op in (Op.FWD, Op.BWD, Op.WGT)

    @property
    def task(self) -> tuple[str, str, int, int]:
        """(op, comp, layer, slot) of a compute instruction."""
        return (self.op.value, self.comp, self.layer, self.slot)

    def __str__(self) -> str:
        if self.msg is not None:
            return f"{self.op.value} {self.msg}"
        if self.op == Op.A2A:
            return f"A2A {self.comp} l{self.layer} s{self.slot} {list(self.group)}"
        if self.is_compute:
            return f"{self.op.value}{self.comp} l{self.layer} s{self.slot}"
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

    def to_text(self) -> str:
        lines = [
            f"# schedule {self.name}: {self.num_ranks} ranks, {self.num_slots} slots, "
            f"max_in_flight={self.max_in_flight}"
        ]
        for rank, instrs in enumerate(self.ranks):
            lines.append(f"rank {rank} {self.roles[rank]}:")
            lines.extend(f"  {k:4d} [{i.lane:4s}] {i}" for k, i in enumerate(instrs))
        return "\n".join(lines) + "\n"

    def to_csv(self) -> str:
        buf = io.StringIO()
        writer = csv.writer(buf)
        writer.writerow(
            ["rank", "role", "index", "lane", "op", "comp", "layer", "slot", "kind", "src", "dst"]
        )
        for rank, instrs in enumerate(self.ranks):
            for k, i in enumerate(instrs):
                m = i.msg
                writer.writerow(
                    [
                        rank,
                        self.roles[rank],
                        k,
                        i.lane,
                        i.op.value,
                        i.comp,
                        m.layer if m else i.layer,
                        m.slot if m else i.slot,
                        m.kind if m else "",
                        m.src if m else "",
                        m.dst if m else "",
                    ]
                )
        return buf.getvalue()
