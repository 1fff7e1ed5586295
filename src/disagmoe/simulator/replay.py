"""Lower an AF-Pipe `Schedule` (the executor's instruction lists) to a simulator `Program`.

The semantics are the executor's, read from the same `schedule.semantics.RankProgram`:

* per rank a "fwd" and a "bwd" compute lane run their FWD / BWD instructions in
  list order; a compute waits for its input messages and its local dependencies
  (`RankProgram.local`: its own forward, local hand-overs, the in-flight cap);
* each SEND is posted when the producing compute ends; per (sender, receiver,
  channel) stream messages move in FIFO order (the receive thread takes one at
  a time), so a message also waits for the previous one of its stream;
* SYNC (gradient all-reduce over the attention replicas) starts once every
  compute and message of the rank is done; STEP follows it;
* with `MessageOverheads` (a host runtime): after a compute its lane spends
  `post_s` per outgoing message before its next instruction (the sends leave
  after that), and a message reaches its consumer only after the receiver's
  stream thread has spent `receive_s(bytes)` on it, FIFO per stream.

Symmetry reduction (`Replicas`): all m attention replicas of a group and all n
expert shards run identical lists with identical costs, so a schedule generated
for one replica and one shard per group (`Layout(m=1, n=1)`) is replayed with
each message standing for its whole bundle: the representative A sends n
dispatches (out) and the representative F receives m (in), split between NIC and
NVLink by where the real peers sit. `tests/unit/test_simulator.py` checks that
the reduced and the full replay agree.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ..distributed.layout import Layout
from ..runtime.observe import message_label
from ..schedule.ir import Instr, Msg, Op, Schedule, compute_event_name
from ..schedule.semantics import TaskKey, compile_ranks, consumer, producer
from .costs import InstrCosts, MessageOverheads, Workload
from .engine import COMPUTE, DELAY, Program
from .network import Network, Ports


@dataclass(frozen=True)
class Replicas:
    """The real layout behind a schedule generated for `Layout(m=1, n=1)`."""

    full: Layout
    _local: dict[tuple[str, int, str, int], float] = field(default_factory=dict, repr=False)

    def real_rank(self, reduced_rank: int) -> int:
        group, pos = divmod(reduced_rank, 2)
        if pos == 0:
            return self.full.attn_rank(group, 0)
        return self.full.expert_rank(group, 0)

    def peers(self, rank_role: str, group: int) -> list[int]:
        return (
            self.full.attn_replicas(group) if rank_role == "A" else self.full.expert_shards(group)
        )

    def local_fraction(self, net: Network, src: tuple[str, int], dst: tuple[str, int]) -> float:
        """Mean over the real workers of role `src` (comp, group) of the share of their
        `dst` peers on the same node (A -> A pairs replica r with replica r)."""
        key = (*src, *dst)
        if key not in self._local:
            a_side, b_side = self.peers(*src), self.peers(*dst)
            if src[0] == dst[0]:
                pairs = list(zip(a_side, b_side, strict=True))
            else:
                pairs = [(a, b) for a in a_side for b in b_side]
            nodes = [(net.node_of(a), net.node_of(b)) for a, b in pairs]
            self._local[key] = sum(1 for a, b in nodes if a == b) / len(nodes)
        return self._local[key]


def _category(comp: str) -> str:
    return "attn" if comp == "A" else "ffn"


def lower_schedule(
    schedule: Schedule,
    layout: Layout,
    costs: InstrCosts,
    workload: Workload,
    net: Network,
    *,
    replicas: Replicas | None = None,
    sync: bool = True,
    step_s: float = 0.0,
    grad_bytes: int = 2,
    overheads: MessageOverheads | None = None,
) -> Program:
    """Program of one optimizer step of `schedule` (for `layout`, or `replicas.full` if reduced)."""
    full = replicas.full if replicas else layout
    over = overheads if overheads is not None and overheads.any else None
    programs = compile_ranks(schedule)
    post_op: dict[tuple[int, TaskKey], int] = {}

    def real(rank: int) -> int:
        return replicas.real_rank(rank) if replicas else rank

    prog = Program(num_ranks=schedule.num_ranks, latency_s=net.latency_s)
    prog.multiplicity = [
        (full.attn_workers if layout.role(r).comp == "A" else full.expert_workers)
        if replicas
        else 1
        for r in range(schedule.num_ranks)
    ]
    ports = Ports(prog, net)
    task_op: dict[tuple[int, TaskKey], int] = {}
    lane_ops: dict[tuple[int, str], list[int]] = defaultdict(list)
    rank_ops: dict[int, list[int]] = defaultdict(list)
    for rp in programs:
        rank = rp.rank
        for index, ins in rp.computes():
            lane = lane_ops[(rank, ins.lane)]
            op = prog.add(
                COMPUTE,
                rank,
                ins.lane,
                costs.compute_s(ins.op, ins.comp, ins.layer),
                _category(ins.comp),
                compute_event_name(ins.op.value, ins.comp, ins.layer, ins.slot),
                [lane[-1]] if lane else [],
                {"layer": ins.layer, "slot": ins.slot, "step": 0, "index": index},
            )
            task_op[(rank, ins.task)] = op
            lane.append(op)
            rank_ops[rank].append(op)
            count = len(rp.outputs.get(ins.task, ()))
            if over is not None and count:
                post = prog.add(
                    DELAY,
                    rank,
                    ins.lane,
                    count * over.post_s,
                    "comm",
                    f"post {count} send(s) l{ins.layer} s{ins.slot}",
                    [op],
                    {"layer": ins.layer, "slot": ins.slot, "step": 0},
                )
                post_op[(rank, ins.task)] = post
                lane.append(post)
                rank_ops[rank].append(post)
        for _, ins in rp.computes():
            prog.deps[task_op[(rank, ins.task)]] += [task_op[(rank, t)] for t in rp.local[ins.task]]
    stream_last: dict[tuple[int, int, str], int] = {}
    recv_last: dict[tuple[int, int, str], int] = {}
    load_cache: dict[tuple[str, bool, int, int], list[tuple[int, float]]] = {}
    for rank, instrs in enumerate(schedule.ranks):
        for ins in instrs:
            if ins.op != Op.SEND or ins.msg is None:
                continue
            msg = ins.msg
            source = (rank, producer(msg))
            deps = [post_op.get(source, task_op[source])]
            stream = (msg.src, msg.dst, msg.channel)
            if stream in stream_last:
                deps.append(stream_last[stream])
            key = (msg.kind, workload.model.is_moe_layer(msg.layer), msg.src, msg.dst)
            if key not in load_cache:
                load_cache[key] = _loads(msg, layout, full, workload, net, ports, replicas)
            loads = load_cache[key]
            xop = prog.add_xfer(
                msg.src,
                msg.dst,
                loads,
                message_label(msg.kind, msg.layer, msg.slot),
                deps,
                {
                    "kind": msg.kind,
                    "layer": msg.layer,
                    "slot": msg.slot,
                    "step": 0,
                    "src": real(msg.src),
                    "dst": real(msg.dst),
                },
            )
            stream_last[stream] = xop
            rank_ops[msg.src].append(xop)
            rank_ops[msg.dst].append(xop)
            ready = xop
            if over is not None:
                nbytes = workload.message_bytes(msg.kind, msg.layer, full.expert_workers)
                ready = prog.add(
                    DELAY,
                    msg.dst,
                    "recv",
                    over.receive_s(nbytes),
                    "comm",
                    f"take {msg.kind} l{msg.layer} s{msg.slot}",
                    [xop, recv_last.get(stream, -1)],
                    {"layer": msg.layer, "slot": msg.slot, "step": 0},
                )
                recv_last[stream] = ready
                rank_ops[msg.dst].append(ready)
            prog.deps[task_op[(msg.dst, consumer(msg))]].append(ready)
    if sync:
        _add_sync(prog, layout, full, workload, ports, rank_ops, step_s, grad_bytes)
    return prog


def _loads(
    msg: Msg,
    layout: Layout,
    full: Layout,
    workload: Workload,
    net: Network,
    ports: Ports,
    replicas: Replicas | None,
) -> list[tuple[int, float]]:
    nbytes = workload.message_bytes(msg.kind, msg.layer, full.expert_workers)
    if replicas is None:
        return ports.message(msg.src, msg.dst, nbytes)
    src, dst = layout.role(msg.src), layout.role(msg.dst)
    a, b = (src.comp, src.group), (dst.comp, dst.group)
    fan_out = len(replicas.peers(*b)) if src.comp != dst.comp else 1
    fan_in = len(replicas.peers(*a)) if src.comp != dst.comp else 1
    return ports.bundle(
        replicas.real_rank(msg.src),
        replicas.real_rank(msg.dst),
        nbytes * fan_out,
        nbytes * fan_in,
        replicas.local_fraction(net, a, b),
        replicas.local_fraction(net, b, a),
    )


def _add_sync(
    prog: Program,
    layout: Layout,
    full: Layout,
    workload: Workload,
    ports: Ports,
    rank_ops: dict[int, list[int]],
    step_s: float,
    grad_bytes: int,
) -> None:
    """SYNC: ring all-reduce of the A gradients over the m replicas; expert grads need none."""
    for rank in range(prog.num_ranks):
        role = layout.role(rank)
        group = role.group
        seconds = 0.0
        if role.comp == "A":
            params = sum(
                workload.attn_param_count(l) for l in full.layers_of(full.attn_rank(group, 0))
            )
            seconds = ports.allreduce_s(full.attn_replicas(group), params * grad_bytes)
        sync = prog.add(
            DELAY, rank, "sync", seconds, "comm", "SYNC grads", rank_ops[rank], {"step": 0}
        )
        prog.add(DELAY, rank, "sync", step_s, "other", "STEP", [sync], {"step": 0})


def instr_count(schedule: Schedule) -> int:
    return sum(len(r) for r in schedule.ranks)


def compute_instrs(schedule: Schedule, rank: int) -> list[Instr]:
    return [i for i in schedule.ranks[rank] if i.is_compute]
