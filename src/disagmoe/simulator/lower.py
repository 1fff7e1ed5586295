"""Lower any `Schedule` (AF-Pipe "lanes" or EP "in-order") to a simulator `Program`.

What an instruction means comes from `schedule.semantics` (`RankProgram`,
`InOrderProgram`); this module only turns each rank's compiled list into timed
operations, through one path for both executions:

* computes on their lanes, in list order ("fwd"/"bwd"/"wgt" on lanes; "compute", or
  a pair's "fwd"/"bwd", in order), costing `Pricing.compute_s(instr, kind)`; lanes
  programs add their local dependencies (own forward, hand-overs, in-flight cap), and
  their "wgt" computes run in the background (`Program.background`);
* all-to-alls cost `Pricing.a2a_s`; when several members of the group are simulated
  they meet first (a barrier), a representative standing for its group does not;
  chunked groups run as the semantics split them;
* with `MessageOverheads` a lane spends `post_s` per message after the op that posts
  it, and the receiver's stream spends `receive_s(bytes)` on each message (FIFO); an
  exchange chunk (`schedule.ir`) is a message of its own, so a chunked schedule pays
  these per chunk;
* a message moves over the network's ports (`Symmetry.loads`: one message or the
  bundle a representative stands for, whose real messages share ports as flows of their
  own, `simulator.links`; arrival = transfer end + latency) or, without
  a network, arrives `latency_s` after it is posted; a message waits for the
  previous one of its stream;
* a message leaves when posted: the EP runtimes post receives ahead of need (PyTorch's
  pipeline runtime, `schedule.ir`), and AF-Pipe posts a payload's receive once its header
  is in, on a process group per channel and direction;
* SYNC (`Pricing.sync_s`) and STEP (`step_s`) after every op of the rank; with
  `Pricing.bucket_s` an A rank's all-reduce runs as the buckets of `schedule.sync`
  instead, on its "sync" lane one after another, each once its issuing BWD has ended,
  and SYNC (the wait for them) ends after every op and bucket. On an in-order (EP) rank
  a bucket is a collective on the rank's network (`engine.A2A`): it shares it with the
  all-to-alls in flight beside it, as the runtime's bucket all-reduces and the
  backward's all-to-alls share the NIC. On a lanes (AF-Pipe) rank with
  `Pricing.bucket_ring` it is the rank's share of the ring (`ring_bucket`): a message
  of 2(k-1)/k of the bucket's bytes out to the next member and in from the previous
  one, on the ports its exchange messages use, so the two share them fairly; it ends
  on every simulated member when the slowest member's hop has (a ring runs in lockstep).

`Symmetry` says which real workers a simulated rank stands for
(`simulator.symmetry`); the identity when every rank is simulated.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from ..schedule.ir import Instr, Msg, Op, Schedule, compute_event_name
from ..schedule.semantics import (
    BACKGROUND_LANES,
    Chunked,
    InOrderProgram,
    RankProgram,
    Task,
    TaskKey,
    compile_program,
    compute_kind,
)
from ..schedule.sync import sync_buckets
from ..trace import message_event_name, message_label
from .costs import MessageOverheads
from .engine import A2A, COMPUTE, DELAY, Program
from .network import Network, Ports
from .symmetry import Symmetry


@dataclass(frozen=True)
class Pricing:
    """How one step is priced: the parameters of the one lowering (see the module doc)."""

    compute_s: Callable[[Instr, str], float]  # a compute of a kind (`semantics.compute_kind`)
    message_bytes: Callable[[Msg], float]  # one message (one real pair of a bundle)
    net: Network | None = None  # messages over its ports; None: latency only
    latency_s: float = 0.0  # per message when `net` is None
    # Seconds of an all-to-all on, and of SYNC of, a real rank (a simulated rank's `Symmetry.real`)
    a2a_s: Callable[[int, Instr], float] | None = None
    sync_s: Callable[[int], float] | None = None  # None: no SYNC, no STEP
    # Seconds of the all-reduce of A layer l's bucket on a real rank (`schedule.sync`);
    # None: SYNC all-reduces everything after the rank's last op
    bucket_s: Callable[[int, int], float] | None = None
    # The ring of A layer l's bucket on a real rank: (its members' real ranks in ring
    # order, the bucket's bytes). With a `net`, a lanes rank's buckets move as ring hops
    # over its ports and share them with its messages; None: `bucket_s` on the rank's network
    bucket_ring: Callable[[int, int], tuple[tuple[int, ...], float]] | None = None
    # With buckets: what SYNC still all-reduces after the rank's last op (None: nothing)
    sync_rest_s: Callable[[int], float] | None = None
    step_s: float = 0.0
    overheads: MessageOverheads | None = None
    # Seconds of a compute on a real rank, overriding `compute_s` where it gives a number
    # (a replay of measured instructions: `bench.analysis.predict_disagg`); lanes only
    rank_compute_s: Callable[[int, Instr], float | None] | None = None
    # Seconds of one of c chunks of a compute (ep-overlap's expert chunks, `Chunked`);
    # None: `compute_s` / c (no part of a call is paid once per call)
    chunk_s: Callable[[Instr, str, int], float] | None = None

    def compute_on(self, real_rank: int, ins: Instr, kind: str) -> float:
        """`compute_s`, unless `rank_compute_s` prices this compute of this rank."""
        if self.rank_compute_s is not None:
            seconds = self.rank_compute_s(real_rank, ins)
            if seconds is not None:
                return seconds
        return self.compute_s(ins, kind)

    @property
    def message_latency_s(self) -> float:
        return self.net.latency_s if self.net is not None else self.latency_s


def _category(comp: str) -> str:
    return "attn" if comp == "A" else "ffn"


class _Lowering:
    """State of one lowering: the program, where each message leaves and who waits for it."""

    def __init__(self, schedule: Schedule, pricing: Pricing, symmetry: Symmetry) -> None:
        self.schedule, self.pricing, self.symmetry = schedule, pricing, symmetry
        self.prog = Program(num_ranks=schedule.num_ranks, latency_s=pricing.message_latency_s)
        self.prog.multiplicity = [symmetry.count(r) for r in range(schedule.num_ranks)]
        self.ports = Ports(self.prog, pricing.net) if pricing.net is not None else None
        self.over = pricing.overheads if pricing.overheads and pricing.overheads.any else None
        self.source: dict[Msg, int] = {}  # the op whose end posts a message
        self.needs: dict[Msg, int] = {}  # the op that waits for a message
        self.barriers: dict[tuple[str, int, int, tuple[int, ...]], int] = {}
        self.meets: dict[tuple[int, ...], bool] = {}  # A2A group -> do its members meet?
        self.task_ops: dict[int, dict[TaskKey, int]] = {}  # rank -> task -> op
        self.programs: dict[int, RankProgram] = {}
        # (ring, layer) -> (hop, end) ops of its simulated members (`ring_bucket`)
        self.rings: dict[tuple[tuple[int, ...], int], list[tuple[int, int]]] = defaultdict(list)
        # in-order (EP) rank -> A layer -> the op after which its weight gradients are final
        self.final_grads: dict[int, dict[int, int]] = {}

    def post(self, rank: int, lane: str, after: int, msgs: list[Msg], args: dict) -> int:
        """Post `msgs` when op `after` ends (plus the lane's posting overhead); the lane's last op."""
        if self.over is not None and msgs:
            label = f"post {len(msgs)} send(s) l{args.get('layer', -1)} s{args.get('slot', -1)}"
            work = len(msgs) * self.over.post_s
            after = self.prog.add(DELAY, rank, lane, work, "comm", label, [after], args)
        for msg in msgs:
            self.source[msg] = after
        return after

    # -- lanes (AF-Pipe) ---------------------------------------------------------------

    def lanes(self, rp: RankProgram) -> None:
        prog, rank, compute_on = self.prog, rp.rank, self.pricing.compute_on
        real = self.symmetry.real(rank)
        task_op: dict[TaskKey, int] = {}
        lane_last: dict[str, int] = {}
        for index, ins in rp.computes():
            args = {"layer": ins.layer, "slot": ins.slot, "step": 0, "index": index}
            if ins.chunk >= 0:
                args["chunk"] = ins.chunk
            op = prog.add(
                COMPUTE,
                rank,
                ins.lane,
                compute_on(real, ins, compute_kind(ins, rp.split)),
                _category(ins.comp),
                compute_event_name(ins.op.value, ins.comp, ins.layer, ins.slot, ins.chunk),
                [lane_last.get(ins.lane, -1)],
                args,
            )
            task_op[ins.task] = op
            if ins.lane in BACKGROUND_LANES:
                prog.background.add(op)
            for msg in rp.inputs.get(ins.task, ()):
                self.needs[msg] = op
            sends = rp.outputs.get(ins.task, [])
            post_args = {"layer": ins.layer, "slot": ins.slot, "step": 0}
            lane_last[ins.lane] = self.post(rank, ins.lane, op, sends, post_args)
        for _, ins in rp.computes():
            prog.deps[task_op[ins.task]] += [task_op[t] for t in rp.local[ins.task]]
        self.task_ops[rank], self.programs[rank] = task_op, rp

    # -- in order (EP) -----------------------------------------------------------------

    def in_order(self, ip: InOrderProgram) -> None:
        rank = ip.rank
        lane_last: dict[str, int] = {}

        def op(
            kind: int, lane: str, work: float, cat: str, label: str, deps: list[int],
            stream: str = "",
        ) -> int:  # fmt: skip
            key = stream or lane  # the in-order stream it queues on (its trace lane by default)
            new = self.prog.add(
                kind, rank, lane, work, cat, label, [lane_last.get(key, -1), *deps], {"step": 0}
            )
            lane_last[key] = new
            return new

        prev = -1
        for seg in ip.segments:
            ends = []
            for lane, tasks in seg.lanes:
                last = prev
                for task in tasks:
                    first = len(self.prog)
                    last = self.task(rank, lane, task, last, op)
                    work = task.work
                    if task.kind in ("B", "W") and isinstance(work, Instr) and work.comp == "A":
                        self.final_grads.setdefault(rank, {})[work.layer] = last
                    for msg in task.waits:
                        self.needs[msg] = first
                    last = self.post(rank, lane, last, task.posts, {"step": 0})
                ends.append(last)
            if seg.is_pair:
                prev = self.prog.add(
                    DELAY, rank, "bwd", 0.0, "other", "F&B done", ends, {"step": 0}
                )
                prev = self.post(rank, "bwd", prev, seg.posts, {"step": 0})
            else:
                prev = ends[0]

    def task(self, rank: int, lane: str, task: Task, last: int, op: Callable[..., int]) -> int:
        """Ops of one task after op `last`; returns its last op."""
        work = task.work
        if isinstance(work, Chunked):
            return self.chunked(
                rank, lane, work, task.kind, self.meet(rank, work.dispatch, last), op
            )
        tag = f"l{work.layer} s{work.slot}"
        if work.op is Op.A2A:
            seconds = self.a2a_s(rank, work)
            return op(
                A2A, lane, seconds, "comm", f"a2a {work.comp} {tag}", [self.meet(rank, work, last)]
            )
        label = compute_event_name(work.op.value, work.comp, work.layer, work.slot)
        seconds = self.pricing.compute_s(work, task.kind)
        return op(COMPUTE, lane, seconds, _category(work.comp), label, [last])

    def chunked(
        self, rank: int, lane: str, group: Chunked, kind: str, last: int, op: Callable[..., int]
    ) -> int:
        """Chunk n: dispatch on "send", compute on `lane`, combine on "recv"; then a join.
        The all-to-alls queue per compute lane: the halves of an F&B pair each post and
        wait for their own (one thread each in the runtime), side by side on the rank's
        network, neither behind the other's."""
        c, ins = group.chunks, group.compute
        tag = f"l{ins.layer} s{ins.slot}"
        dispatch = self.a2a_s(rank, group.dispatch) / c
        combine = self.a2a_s(rank, group.combine) / c
        chunk_s = self.pricing.chunk_s
        compute = chunk_s(ins, kind, c) if chunk_s else self.pricing.compute_s(ins, kind) / c
        ends = []
        for n in range(c):
            label = f"a2a {group.dispatch.comp} {tag} c{n}"
            d = op(A2A, "send", dispatch, "comm", label, [last], stream=f"send {lane}")
            e = op(COMPUTE, lane, compute, "ffn", f"experts {tag}", [d])
            label = f"a2a {group.combine.comp}"
            ends.append(op(A2A, "recv", combine, "comm", label, [e], stream=f"recv {lane}"))
        return op(DELAY, lane, 0.0, "other", f"join {tag}", ends)

    def a2a_s(self, rank: int, ins: Instr) -> float:
        if self.pricing.a2a_s is None:
            raise ValueError("the schedule has all-to-alls: give their price (a2a_s)")
        return self.pricing.a2a_s(self.symmetry.real(rank), ins)

    def meet(self, rank: int, ins: Instr, last: int) -> int:
        """The op after which an all-to-all may start: `last`, or the barrier of its group
        when more than one member is simulated."""
        if ins.group not in self.meets:
            simulated = [r for r in ins.group if self.symmetry.simulated(r) >= 0]
            self.meets[ins.group] = len(simulated) > 1
        if not self.meets[ins.group]:
            return last
        key = (ins.comp, ins.layer, ins.slot, ins.group)
        if key not in self.barriers:
            label = f"meet {ins.comp} l{ins.layer} s{ins.slot}"
            self.barriers[key] = self.prog.add(DELAY, rank, "compute", 0.0, "comm", label, [])
        if last >= 0:
            self.prog.deps[self.barriers[key]].append(last)
        return self.barriers[key]

    # -- messages, SYNC, STEP ----------------------------------------------------------

    def messages(self, stream_of: Callable[[Msg], tuple[int, int, str]]) -> None:
        """Every SEND, in the senders' list order, from its source op to the op that needs it,
        after the previous message of its stream (`schedule.semantics`, "Streams")."""
        prog, pricing, over = self.prog, self.pricing, self.over
        ports = self.ports
        stream_last: dict[tuple[int, int, str], int] = {}
        recv_last: dict[tuple[int, int, str], int] = {}
        load_cache: dict[tuple[str, int, int, int, int], tuple[list[tuple[int, float]], float]] = {}
        for instrs in self.schedule.ranks:
            for ins in instrs:
                if ins.op != Op.SEND or ins.msg is None:
                    continue
                msg = ins.msg
                deps = [self.source[msg]]
                stream = stream_of(msg)
                if stream in stream_last:
                    deps.append(stream_last[stream])
                args = {"kind": msg.kind, "layer": msg.layer, "slot": msg.slot, "step": 0}
                if msg.chunk >= 0:
                    args["chunk"] = msg.chunk
                if ports is not None:
                    key = (msg.kind, msg.layer, msg.src, msg.dst, msg.chunk)
                    if key not in load_cache:
                        nbytes = pricing.message_bytes(msg)
                        load_cache[key] = (self.symmetry.loads(msg, nbytes, ports), nbytes)
                    loads, unit = load_cache[key]
                    real = {"src": self.symmetry.real(msg.src), "dst": self.symmetry.real(msg.dst)}
                    label = message_label(msg.kind, msg.layer, msg.slot, msg.chunk)
                    xop = prog.add_xfer(
                        msg.src, msg.dst, loads, label, deps, args | real, unit=unit
                    )
                else:
                    name = message_event_name("send", str(msg))
                    xop = prog.add(
                        DELAY, msg.src, "send", pricing.latency_s, "comm", name, deps, args
                    )
                stream_last[stream] = xop
                ready = xop
                if over is not None:
                    ready = prog.add(
                        DELAY,
                        msg.dst,
                        "recv",
                        over.receive_s(pricing.message_bytes(msg)),
                        "comm",
                        f"take {message_label(msg.kind, msg.layer, msg.slot, msg.chunk)}",
                        [xop, recv_last.get(stream, -1)],
                        {"layer": msg.layer, "slot": msg.slot, "step": 0},
                    )
                    recv_last[stream] = ready
                if msg not in self.needs:
                    raise ValueError(f"SEND of {msg} has no matching RECV")
                prog.deps[self.needs.pop(msg)].append(ready)
        for msg in self.needs:
            raise ValueError(f"RECV of {msg} has no matching SEND")

    def sync(self) -> None:
        """SYNC after every op of the rank (and its buckets), then STEP."""
        sync_s = self.pricing.sync_s
        if sync_s is None:
            return
        prog = self.prog
        mine: dict[int, list[int]] = defaultdict(list)
        for op, rank in enumerate(prog.rank):
            mine[rank].append(op)
        for rank in range(prog.num_ranks):
            real = self.symmetry.real(rank)
            buckets = self.buckets(rank, real)
            rest = self.pricing.sync_rest_s
            seconds = (rest(real) if rest else 0.0) if buckets else sync_s(real)
            done = prog.add(
                DELAY,
                rank,
                "sync",
                seconds,
                "comm",
                "SYNC grads",
                mine[rank] + buckets,
                {"step": 0},
            )
            prog.add(DELAY, rank, "sync", self.pricing.step_s, "other", "STEP", [done], {"step": 0})
        self.couple_rings()

    def buckets(self, rank: int, real: int) -> list[int]:
        """The all-reduce ops of a rank's buckets (`schedule.sync`; on an in-order EP rank
        one per A layer, issued as `baselines.grad_buckets` does), one after another on
        its "sync" lane, sharing its network with its all-to-alls; none without
        `Pricing.bucket_s` or on a rank without A backward."""
        bucket_s, rp = self.pricing.bucket_s, self.programs.get(rank)
        if bucket_s is None:
            return []
        if rp is not None:
            issues = [(b.layer, self.task_ops[rank][b.after]) for b in sync_buckets(rp)]
        else:  # in order (EP): each layer once its last B (or W) has run, last layer first
            final = self.final_grads.get(rank, {})
            issues = [(layer, final[layer]) for layer in sorted(final, reverse=True)]
        ops: list[int] = []
        for layer, issue in issues:
            after = [issue, *ops[-1:]]
            args = {"layer": layer, "step": 0}
            if rp is not None and self.pricing.bucket_ring is not None and self.ports:
                ops.append(self.ring_bucket(rank, layer, after, args))
                continue
            seconds = bucket_s(real, layer)
            ops.append(
                self.prog.add(
                    A2A, rank, "sync", seconds, "comm", f"allreduce l{layer}", after, args
                )
            )
        return ops

    def ring_bucket(self, rank: int, layer: int, after: list[int], args: dict) -> int:
        """A lanes rank's all-reduce of one bucket as its share of the ring: 2(k-1)/k of the
        bytes out to the next member and in from the previous one, the part that leaves its
        node (`Network.ring_nic_fraction`) on the NIC ports its messages use (so the two
        share them) and the rest over NVLink, then the ring's other 2(k-1)-1 hops'
        latency. A representative's hop is priced as its member's whose node sends most
        of its hop over NICs: the ring runs at its slowest member's pace."""
        assert self.pricing.bucket_ring is not None and self.ports is not None
        members = self.symmetry.members[rank]
        ring, nbytes = self.pricing.bucket_ring(members[0], layer)
        k = len(ring)
        net = self.ports.net
        remote = max(net.ring_nic_fraction(ring, m) for m in members)
        own = any(len(m) > 1 for m in self.symmetry.members)
        hop = 2.0 * (k - 1) / k * nbytes if k > 1 else 0.0
        loads = self.ports.ring_hop(members[0], hop, 1.0 - remote, 1.0 - remote, own=own)
        label = f"allreduce l{layer}"
        # one real flow per channel: the NIC's share, and each node-mate's over NVLink
        unit = hop * remote if remote > 0 else hop
        xop = self.prog.add_xfer(rank, rank, loads, label, after, dict(args), unit=unit)
        rest = max(2 * (k - 1) - 1, 0) * self.ports.net.latency_s
        done = self.prog.add(DELAY, rank, "sync", rest, "comm", label, [xop], args)
        self.rings[(ring, layer)].append((xop, done))
        return done

    def couple_rings(self) -> None:
        """A ring all-reduce runs in lockstep: it ends on every simulated member when the
        slowest member's hop has moved its bytes."""
        for hops in self.rings.values():
            for _, done in hops:
                self.prog.deps[done].extend(xop for xop, _ in hops)


def lower(schedule: Schedule, pricing: Pricing, symmetry: Symmetry | None = None) -> Program:
    """Program of one optimizer step of `schedule` (see the module doc)."""
    symmetry = symmetry or Symmetry.identity(schedule.num_ranks)
    assert symmetry.num_ranks == schedule.num_ranks, "one symmetry class per simulated rank"
    low = _Lowering(schedule, pricing, symmetry)
    stream_of = RankProgram.stream
    for rank in range(schedule.num_ranks):
        compiled = compile_program(schedule, rank)
        if isinstance(compiled, InOrderProgram):
            low.in_order(compiled)
            stream_of = InOrderProgram.stream
        else:
            low.lanes(compiled)
    low.messages(stream_of)
    low.sync()
    return low.prog
