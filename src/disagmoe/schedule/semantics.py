"""What an instruction list means when it runs: the one definition of the rules.

The executor (`runtime.executor`), the validator's deadlock replay
(`schedule.validate`) and the simulator's lowering (`simulator.lower`) all read a
rank's list through `RankProgram` ("lanes") or `InOrderProgram` ("in-order") and
ask it the same questions, so they cannot disagree about when an instruction may run.

Execution "lanes" (AF-Pipe; `Schedule.execution == "lanes"`):

* **Lanes.** A rank runs its FWD instructions in list order on the "fwd" lane, its
  BWD instructions in list order on the "bwd" lane and its W instructions (deferred
  weight gradients, below) in list order on the "wgt" lane, concurrently. The "wgt"
  lane is a background lane: its computes take the device only while neither other
  lane computes (a low-priority stream; `runtime.streams`). SYNC and STEP run in list
  order on the "sync" lane once every compute and message of the rank is done.
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
  - a W waits for the BWD of its own task;
  - in-flight cap, layer by layer: with the rank's layers l_0 < ... < l_{K-1}, the
    forward of l_k for slot s waits for the release of l_{max(0, K-2-k)} of slot
    s - `max_in_flight` (`cap_gates`; of the same exchange chunk), where a
    layer's release is its backward — its W where the list has one: a slot's
    activations of a layer are kept until that layer's weight gradients are computed.
    Slot s takes its k+1 lowest layers only once the older slot has let go of its k+2
    highest (releases run top-down: the backward chain, and Ws in that order, as the
    generator lists them), so while both hold layers they hold at most K-1 between them,
    one layer less than a slot — the slack for a first layer larger than the others
    (embedding, dense FFN) and a head whose logits the memory model counts apart — and
    the rank at most `max_in_flight` slots' worth ("In-flight cap, layer by layer" in
    docs/design-notes.md). The new slot's forward starts once the old one's backward has
    passed two layers, not when it has ended. With K <= 2 this is the rule per slot: the
    forward of the lowest layer waits for the release of the lowest. A rank's slots are
    0 .. S_r - 1 (an attention replica without the last, partial slot of an uneven step
    has one fewer than the others), so slot s - `max_in_flight` is always one of its own.

* **Deferred weight gradients.** A BWD whose task also has a W (`Op.WGT`, same comp,
  layer, slot and chunk) on the rank computes what its outgoing messages carry — the
  input gradients (kind "I", `compute_kind`) — and keeps the rest of its backward for
  the W, which runs on the "wgt" lane in list order and produces no message
  (`afpipe.build_afpipe(split_backward=True)`; `runtime.stages`). A BWD without a W is
  the whole backward.
* **Exchange chunks.** With `meta["exchange_chunks"]` = c > 1 (`schedule.ir`) a
  message of an exchange kind is produced or consumed on the F side by the compute of
  its own chunk (`Msg.chunk`) and on the A side by the one unchunked compute; nothing
  else changes (chunk k of a shard's FWD and BWD are computes of their own).
* **Streams.** Per (sender, receiver, channel) a receive lane takes one message at
  a time, so a message moves only after the previous one of its stream arrived.
* **Forward-only lists.** A list with forwards and no backward (evaluation:
  `afpipe.build_afpipe(forward_only=True)`; no SYNC or STEP either, the validator checks)
  is forward-only (`RankProgram.forward_only`): its forwards keep nothing for a backward
  (the executor runs them without autograd, the worker stashes nothing), so the in-flight
  cap does not apply.

Execution "in-order" (the EP baselines, as PyTorch's pipelining runtime runs them;
`InOrderProgram`):

* **One lane.** A rank runs its list in order on one lane ("compute"). A RECV blocks
  the lane: the next compute or A2A after it waits for the message. A SEND is posted
  when the compute or A2A before it ends and does not block. A2A blocks until every
  member of its group reached the same (phase, layer, slot) all-to-all.
* **Overlapped pairs.** The instructions of one pair (`Instr.pair`, DualPipeV's F&B)
  run their forward half on the "fwd" lane and their backward half (a W too) on the "bwd" lane
  from the same start; each half's SEND leaves when its half is done, a backward's that
  goes to the rank its forward also sends to when both are (the runtime keeps the list's
  order on that connection: `baselines.fb_overlap`); the list continues when both halves
  are done.
* **Chunked all-to-all.** With `meta["a2a_chunks"]` = c > 1 (ep-overlap) an A2A, the
  expert compute after it and the A2A after that run as c pipelined chunks:
  dispatch chunks on the "send" lane, compute chunks on the compute lane, combine
  chunks on the "recv" lane.
* **Split backward.** A BWD whose task also has a W on the rank computes input
  gradients only (kind "I"); the W computes the weight gradients.
* **Streams.** A receiver takes a peer's messages in list order (one stream per
  (sender, receiver): the pipeline's process group has one connection per pair of
  ranks, a byte stream), so a message moves only after the previous one of its stream
  arrived.

Both executions: SYNC and STEP run after every compute and message of the rank.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field

from .ir import MESSAGE_KINDS, Endpoint, Instr, Msg, Op, Schedule

TaskKey = tuple[str, str, int, int, int]  # (op value, comp, layer, slot, chunk): `Instr.task`
EXECUTIONS = ("lanes", "in-order")
COMPUTE_LANES = ("fwd", "bwd", "wgt")
BACKGROUND_LANES = ("wgt",)  # computes that yield the device to the other lanes' (module doc)
PAIR_LANES = ("fwd", "bwd")  # the halves of an in-order overlapped pair


def _task(end: Endpoint, layer: int, slot: int, chunk: int = -1) -> TaskKey:
    """The compute at `end` of a message of (layer, slot, chunk): chunked on the F side only."""
    return (
        end.op.value,
        end.comp,
        layer + end.layer_offset,
        slot,
        chunk if end.comp == "F" else -1,
    )


def producer(msg: Msg) -> TaskKey:
    """The compute on `msg.src` that produces `msg` (it posts the SEND when it ends)."""
    return _task(MESSAGE_KINDS[msg.kind].producer, msg.layer, msg.slot, msg.chunk)


def consumer(msg: Msg) -> TaskKey:
    """The compute on `msg.dst` that consumes `msg` (it waits for the RECV)."""
    return _task(MESSAGE_KINDS[msg.kind].consumer, msg.layer, msg.slot, msg.chunk)


def consumer_lane(msg: Msg) -> str:
    """The compute lane ("fwd" / "bwd") whose instruction consumes `msg` (a W consumes
    none)."""
    return Instr(MESSAGE_KINDS[msg.kind].consumer.op).lane


def cap_gates(layers: Sequence[int]) -> dict[int, int]:
    """Per layer of a rank (`layers` ascending), the layer whose release of slot s - cap its
    forward of slot s waits for under the in-flight cap: the k-th lowest waits for the
    (k+1)-th highest, the two highest for the lowest (module doc). The generator's task
    graph (`afpipe.build_afpipe_graph`) and `RankProgram` both take it from here."""
    return {layer: layers[max(0, len(layers) - 2 - k)] for k, layer in enumerate(layers)}


@dataclass
class RankProgram:
    """One rank's instruction list compiled for "lanes" execution (see the module doc)."""

    rank: int
    cap: int  # max_in_flight
    lanes: dict[str, list[tuple[int, Instr]]]  # COMPUTE_LANES -> (list index, compute) in order
    inputs: dict[TaskKey, list[Msg]]  # messages each compute consumes
    outputs: dict[TaskKey, list[Msg]]  # messages each compute produces, in posting order
    streams: dict[tuple[int, str], list[Msg]]  # (src, channel) -> incoming messages, FIFO
    finals: list[tuple[int, Instr]]  # SYNC / STEP in list order
    layers: tuple[int, ...]  # the layers of the rank's forwards, ascending
    forward_only: bool = False  # forwards and no backward: see "Forward-only lists"
    local: dict[TaskKey, list[TaskKey]] = field(default_factory=dict)  # local dependencies
    # (comp, layer, slot) of the backwards whose weight gradients a W computes
    split: set[tuple[str, int, int]] = field(default_factory=set)

    @staticmethod
    def stream(msg: Msg) -> tuple[int, int, str]:
        """The FIFO stream of a message: (sender, receiver, channel)."""
        return (msg.src, msg.dst, msg.channel)

    @classmethod
    def build(cls, schedule: Schedule, rank: int) -> RankProgram:
        """`rank`'s program of a whole "lanes" schedule."""
        if schedule.execution != "lanes":
            raise ValueError(
                f"schedule {schedule.name!r} runs {schedule.execution!r}, not on lanes"
            )
        return cls.compile(rank, schedule.ranks[rank], schedule.max_in_flight)

    @classmethod
    def compile(cls, rank: int, instrs: Sequence[Instr], max_in_flight: int) -> RankProgram:
        """The program of one rank's "lanes" list (e.g. built alone, `build_afpipe_rank`)."""
        lanes: dict[str, list[tuple[int, Instr]]] = {lane: [] for lane in COMPUTE_LANES}
        inputs: dict[TaskKey, list[Msg]] = defaultdict(list)
        outputs: dict[TaskKey, list[Msg]] = defaultdict(list)
        streams: dict[tuple[int, str], list[Msg]] = defaultdict(list)
        finals: list[tuple[int, Instr]] = []
        for index, ins in enumerate(instrs):
            if ins.op in (Op.FWD, Op.BWD, Op.WGT):
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
        forwards = sorted({ins.layer for _, ins in lanes["fwd"]})
        prog = cls(
            rank=rank,
            cap=max_in_flight,
            lanes=lanes,
            inputs=inputs,
            outputs=outputs,
            streams=streams,
            finals=finals,
            layers=tuple(forwards),
            forward_only=bool(forwards) and not lanes["bwd"],
            split={(i.comp, i.layer, i.slot) for _, i in lanes["wgt"]},
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
        gates = cap_gates(self.layers)
        for lane in self.lanes.values():
            for _, ins in lane:
                op, comp, layer, slot, chunk = ins.task
                deps: list[TaskKey] = []
                if ins.op == Op.BWD:
                    deps.append((Op.FWD.value, comp, layer, slot, chunk))
                elif ins.op == Op.WGT:
                    deps.append((Op.BWD.value, comp, layer, slot, chunk))
                elif not self.forward_only and slot >= self.cap:
                    old, gate = slot - self.cap, gates[layer]
                    held = Op.WGT if (comp, gate, old) in self.split else Op.BWD
                    deps.append((held.value, comp, gate, old, chunk))
                for prod, cons in handovers:
                    if (cons.op.value, cons.comp) == (op, comp):
                        source = _task(prod, layer - cons.layer_offset, slot)
                        if source in tasks:
                            deps.append(source)
                local[ins.task] = deps
        return local

    @property
    def running_lanes(self) -> tuple[str, ...]:
        """The compute lanes an executor runs: "fwd" and "bwd" always, "wgt" when the list
        has a W."""
        return tuple(
            lane for lane, items in self.lanes.items() if items or lane not in BACKGROUND_LANES
        )

    def releases(self, instr: Instr) -> bool:
        """Whether `instr` is the compute after which the rank keeps nothing more of its slot
        at its layer (in-flight accounting): that layer's BWD, or its W where the list has
        one."""
        if self.forward_only or instr.op == Op.FWD:
            return False
        split = (instr.comp, instr.layer, instr.slot) in self.split
        return instr.op == (Op.WGT if split else Op.BWD)

    def computes(self) -> list[tuple[int, Instr]]:
        """Every compute of the rank, in list order."""
        return sorted(
            (item for lane in self.lanes.values() for item in lane), key=lambda item: item[0]
        )

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


_COMPUTE_OPS = (Op.FWD, Op.BWD, Op.WGT)


def compute_kind(instr: Instr, split: Container[tuple[str, int, int]] = ()) -> str:
    """What a compute computes: "F" forward, "B" full backward, "I" input gradients only
    (a BWD whose (comp, layer, slot) is in `split`: the tasks that also have a W), "W"."""
    if instr.op is Op.FWD:
        return "F"
    if instr.op is Op.WGT:
        return "W"
    return "I" if (instr.comp, instr.layer, instr.slot) in split else "B"


@dataclass(frozen=True, slots=True)
class Chunked:
    """An expert compute between two all-to-alls, run as `chunks` pipelined chunks."""

    dispatch: Instr  # the A2A before the compute ("dispatch" or "grad_combine")
    compute: Instr
    combine: Instr  # the A2A after it ("combine" or "grad_dispatch")
    chunks: int


@dataclass(slots=True)
class Task:
    """What a lane of an in-order rank runs next: a compute, an A2A or a chunked group."""

    work: Instr | Chunked
    kind: str  # `compute_kind` of the compute ("" for an A2A)
    waits: list[Msg] = field(default_factory=list)  # RECVs right before it
    posts: list[Msg] = field(default_factory=list)  # SENDs right after it: posted when it ends


@dataclass(slots=True)
class Segment:
    """Instructions of an in-order list that start together: a plain stretch (one lane,
    "compute") or an overlapped pair ("fwd" and "bwd" lanes, joined when both are done)."""

    lanes: list[tuple[str, list[Task]]]
    # a pair's SENDs posted at the join: a backward's to the rank its forward sends to too
    posts: list[Msg] = field(default_factory=list)

    @property
    def is_pair(self) -> bool:
        return len(self.lanes) > 1


@dataclass
class InOrderProgram:
    """One rank's instruction list compiled for "in-order" execution (see the module doc)."""

    rank: int
    segments: list[Segment]
    finals: list[Instr]  # SYNC / STEP in list order

    @staticmethod
    def stream(msg: Msg) -> tuple[int, int, str]:
        """The FIFO stream of a message: (sender, receiver, "")."""
        return (msg.src, msg.dst, "")

    @classmethod
    def build(cls, schedule: Schedule, rank: int) -> InOrderProgram:
        if schedule.execution != "in-order":
            raise ValueError(
                f"schedule {schedule.name!r} runs {schedule.execution!r}, not in order"
            )
        chunks = int(schedule.meta.get("a2a_chunks", 1))
        instrs = schedule.ranks[rank]
        split = {(i.comp, i.layer, i.slot) for i in instrs if i.op is Op.WGT}
        prog = cls(rank, [], [i for i in instrs if i.op is Op.SYNC or i.op is Op.STEP])
        poster: Task | Segment | None = None  # what a SEND right now would follow
        waits: list[Msg] = []  # RECVs not yet followed by a compute or A2A
        body = [i for i in instrs if i.op is not Op.SYNC and i.op is not Op.STEP]
        bounds = [k for k in range(1, len(body)) if body[k].pair != body[k - 1].pair]
        for start, end in zip([0, *bounds], [*bounds, len(body)], strict=True):
            run = body[start:end]
            if run[0].pair < 0:
                seg = Segment([("compute", [])])
                poster = prog._tasks(run, seg.lanes[0][1], chunks, split, waits, poster)
            else:
                seg = Segment([(lane, []) for lane in PAIR_LANES])
                for lane, tasks in seg.lanes:
                    half = [i for i in run if (i.lane if i.op is not Op.WGT else "bwd") == lane]
                    prog._tasks(half, tasks, chunks, split, waits, None)
                _join_same_rank_sends(seg)
                poster = seg
            prog.segments.append(seg)
        if waits:
            raise ValueError(f"rank {rank}: RECV {waits[0]} is followed by no compute")
        return prog

    def _tasks(
        self,
        run: list[Instr],
        tasks: list[Task],
        chunks: int,
        split: set[tuple[str, int, int]],
        waits: list[Msg],
        poster: Task | Segment | None,
    ) -> Task | Segment | None:
        """Append the tasks of consecutive instructions of one lane; return what a SEND
        after them follows (the last task)."""
        recv, send, a2a = Op.RECV, Op.SEND, Op.A2A  # local names: enum lookups are slow
        k = 0
        while k < len(run):
            ins = run[k]
            op = ins.op
            if op is recv and ins.msg is not None:
                waits.append(ins.msg)
                k += 1
                continue
            if op is send and ins.msg is not None:
                if poster is None:
                    raise ValueError(f"rank {self.rank}: SEND {ins.msg} follows no compute")
                poster.posts.append(ins.msg)
                k += 1
                continue
            if op is a2a and chunks > 1:
                group = run[k : k + 3]
                if len(group) < 3 or not group[1].is_compute or group[2].op is not a2a:
                    raise ValueError(f"rank {self.rank}: chunked {ins} needs compute, A2A")
                kind = compute_kind(group[1], split)
                tasks.append(Task(Chunked(ins, group[1], group[2], chunks), kind, waits[:], []))
                k += 2
            elif op is a2a:
                tasks.append(Task(ins, "", waits[:], []))
            elif op in _COMPUTE_OPS:
                tasks.append(Task(ins, compute_kind(ins, split), waits[:], []))
            else:
                raise ValueError(f"rank {self.rank}: {ins} has no meaning in order")
            waits.clear()
            poster = tasks[-1]
            k += 1
        return poster


def _join_same_rank_sends(pair: Segment) -> None:
    """Move the backward half's SENDs to a rank the forward half also sends to onto the
    pair's join (module doc, "Overlapped pairs")."""
    lanes = dict(pair.lanes)
    forward_to = {m.dst for task in lanes["fwd"] for m in task.posts}
    for task in lanes["bwd"]:
        pair.posts += [m for m in task.posts if m.dst in forward_to]
        task.posts[:] = [m for m in task.posts if m.dst not in forward_to]


CompiledRank = RankProgram | InOrderProgram


def compile_program(schedule: Schedule, rank: int) -> CompiledRank:
    """The compiled list of one rank, for the schedule's execution."""
    if schedule.execution == "in-order":
        return InOrderProgram.build(schedule, rank)
    return RankProgram.build(schedule, rank)
