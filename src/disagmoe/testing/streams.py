"""A two-rank schedule that is one stream of messages, for exercising the executor's message
path alone (`benchmarks/exchange_overhead.py`, `tests/distributed/test_exchange.py`)."""

from __future__ import annotations

from ..schedule.ir import Instr, Msg, Op, Schedule


def one_stream_schedule(count: int, name: str = "exchange") -> Schedule:
    """A(g0,r0) -> F(g0,j0): one `dispatch` message per layer 0..count-1, each sent by an
    attention compute of that layer and consumed by the expert compute of that layer."""
    sender: list[Instr] = []
    receiver: list[Instr] = []
    for layer in range(count):
        msg = Msg("dispatch", layer, 0, 0, 1)
        sender += [Instr(Op.FWD, "A", layer, 0), Instr(Op.SEND, msg=msg)]
        receiver += [Instr(Op.RECV, msg=msg), Instr(Op.FWD, "F", layer, 0)]
    return Schedule(
        name=name,
        num_ranks=2,
        num_slots=1,
        max_in_flight=1,
        roles=("A(g0,r0)", "F(g0,j0)"),
        ranks=(tuple(sender), tuple(receiver)),
    )
