"""What an instruction list means when it runs: the one definition of the rules.

The executor (`runtime.executor`), the validator's deadlock replay
(`schedule.validate`) and the simulator's replay (`simulator.replay`) all read a
rank's list through `RankProgram` and ask it the same questions, so they cannot
disagree about when an instruction may run.

Execution "lanes" (AF-Pipe; `Schedule.execution == "lanes"`):

* **Lanes.** A rank runs its FWD instructions in list order on the "fwd" lane and
  its BWD instructions in list order on the "bwd" lane, concurrently. SYNC and
  STEP run in list order on the "sync" lane once every compute and message of the
  rank is done.
* **Messages.** Each message kind's producer and consumer are declared in
  `schedule.ir.MESSAGE_KINDS`. A SEND is posted by its producing compute right
  after that compute ends (in list order among the SENDs of that compute). A RECV
  is taken by the receive lane of its (sender, channel) stream, in list order
  (FIFO per stream), and handed to its consuming compute.
* **Readiness.** A compute may start when (1) every message it consumes has
  arrived, and (2) every local dependency is done:
  - a backward waits for its own forward;
  - a message whose producer runs on the consumer's own rank is a local hand-over
    (no SEND/RECV): the consumer waits for that producer (e.g. the residual
    `act` from A(l) to A(l+1) when p = 1);
  - in-flight cap: the forward of the rank's first layer for slot s waits for that
    layer's backward of slot s - `max_in_flight`.

Execution "in-order" (the EP baselines, as PyTorch's pipelining runtime runs them):
one lane per rank in list order; a RECV blocks the lane until its message arrived,
an A2A until every member of its group reached it (`simulator.baseline_replay`).
The analytic EP model (`simulator.ep`) also prices what the lists mark as data:
the instructions of an overlapped pair (`Instr.pair`) run their forward half on
the "fwd" lane and their backward half on the "bwd" lane from the same start, and
the pair's SENDs leave when both halves are done; with `meta["a2a_chunks"]` = c
an expert compute and its two all-to-alls run as c pipelined chunks; a BWD whose
task also has a W on the rank computes input gradients only.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Container
from dataclasses import dataclass, field

from .ir import MESSAGE_KINDS, Endpoint, Instr, Msg, Op, Schedule

TaskKey = tuple[str, str, int, int]  # (op value, comp, layer, slot) of a compute: `Instr.task`
EXECUTIONS = ("lanes", "in-order")
COMPUTE_LANES = ("fwd", "bwd")


def _task(end: Endpoint, layer: int, slot: int) -> TaskKey:
    return (end.op.value, end.comp, layer + end.layer_offset, slot)


def producer(msg: Msg) -> TaskKey:
    """The compute on `msg.src` that produces `msg` (it posts the SEND when it ends)."""
    return _task(MESSAGE_KINDS[msg.kind].producer, msg.layer, msg.slot)


def consumer(msg: Msg) -> TaskKey:
    """The compute on `msg.dst` that consumes `msg` (it waits for the RECV)."""
    return _task(MESSAGE_KINDS[msg.kind].consumer, msg.layer, msg.slot)


def endpoints(msg: Msg) -> tuple[Endpoint, Endpoint]:
    """(producer, consumer) endpoints of the message's kind, relative to `msg.layer`."""
    kind = MESSAGE_KINDS[msg.kind]
    return kind.producer, kind.consumer


@dataclass
class RankProgram:
    """One rank's instruction list compiled for "lanes" execution (see the module doc)."""

    rank: int
    cap: int  # max_in_flight
    lanes: dict[str, list[tuple[int, Instr]]]  # "fwd"/"bwd" -> (list index, compute) in order
    inputs: dict[TaskKey, list[Msg]]  # messages each compute consumes
    outputs: dict[TaskKey, list[Msg]]  # messages each compute produces, in posting order
    streams: dict[tuple[int, str], list[Msg]]  # (src, channel) -> incoming messages, FIFO
    finals: list[tuple[int, Instr]]  # SYNC / STEP in list order
    first_layer: int  # lowest layer of the rank's forwards (-1 without any)
    local: dict[TaskKey, list[TaskKey]] = field(default_factory=dict)  # local dependencies

    @classmethod
    def build(cls, schedule: Schedule, rank: int) -> RankProgram:
        if schedule.execution != "lanes":
            raise ValueError(
                f"schedule {schedule.name!r} runs {schedule.execution!r}, not on lanes"
            )
        instrs = schedule.ranks[rank]
        lanes: dict[str, list[tuple[int, Instr]]] = {lane: [] for lane in COMPUTE_LANES}
        inputs: dict[TaskKey, list[Msg]] = defaultdict(list)
        outputs: dict[TaskKey, list[Msg]] = defaultdict(list)
        streams: dict[tuple[int, str], list[Msg]] = defaultdict(list)
        finals: list[tuple[int, Instr]] = []
        for index, ins in enumerate(instrs):
            if ins.op in (Op.FWD, Op.BWD):
                lanes[ins.lane].append((index, ins))
            elif ins.op == Op.SEND and ins.msg is not None:
                outputs[producer(ins.msg)].append(ins.msg)
            elif ins.op == Op.RECV and ins.msg is not None:
                inputs[consumer(ins.msg)].append(ins.msg)
                streams[(ins.msg.src, ins.msg.channel)].append(ins.msg)
            elif ins.op in (Op.SYNC, Op.STEP):
                finals.append((index, ins))
            else:
                raise ValueError(f"rank {rank}: {ins} has no meaning on lanes")
        forwards = [ins.layer for _, ins in lanes["fwd"]]
        prog = cls(
            rank=rank,
            cap=schedule.max_in_flight,
            lanes=lanes,
            inputs=inputs,
            outputs=outputs,
            streams=streams,
            finals=finals,
            first_layer=min(forwards) if forwards else -1,
        )
        prog.local = prog._local_dependencies()
        return prog

    def _local_dependencies(self) -> dict[TaskKey, list[TaskKey]]:
        tasks = {ins.task for lane in self.lanes.values() for _, ins in lane}
        handovers = [
            (kind.producer, kind.consumer)
            for kind in MESSAGE_KINDS.values()
            if kind.producer.comp == kind.consumer.comp
        ]
        local: dict[TaskKey, list[TaskKey]] = {}
        for lane in self.lanes.values():
            for _, ins in lane:
                op, comp, layer, slot = ins.task
                deps: list[TaskKey] = []
                if ins.op == Op.BWD:
                    deps.append((Op.FWD.value, comp, layer, slot))
                elif layer == self.first_layer and slot >= self.cap:
                    deps.append((Op.BWD.value, comp, layer, slot - self.cap))
                for prod, cons in handovers:
                    if (cons.op.value, cons.comp) == (op, comp):
                        source = _task(prod, layer - cons.layer_offset, slot)
                        if source in tasks:
                            deps.append(source)
                local[ins.task] = deps
        return local

    def computes(self) -> list[tuple[int, Instr]]:
        """Every compute of the rank, in list order."""
        return sorted(self.lanes["fwd"] + self.lanes["bwd"], key=lambda item: item[0])

    def waiting_for(
        self, instr: Instr, done: Container[TaskKey], arrived: Callable[[Msg], bool]
    ) -> tuple[list[Msg], list[TaskKey]]:
        """(messages not yet arrived, local dependencies not yet done) of a compute."""
        key = instr.task
        msgs = [m for m in self.inputs.get(key, ()) if not arrived(m)]
        tasks = [t for t in self.local.get(key, ()) if t not in done]
        return msgs, tasks

    def ready(self, instr: Instr, done: Container[TaskKey], arrived: Callable[[Msg], bool]) -> bool:
        """Whether a compute may start (the readiness rule of the module doc)."""
        key = instr.task
        return all(arrived(m) for m in self.inputs.get(key, ())) and all(
            t in done for t in self.local.get(key, ())
        )


def compile_ranks(schedule: Schedule) -> list[RankProgram]:
    """`RankProgram` of every rank of a "lanes" schedule."""
    return [RankProgram.build(schedule, rank) for rank in range(schedule.num_ranks)]
