"""AF-Pipe: the disaggregated attention/FFN pipeline of docs/design.md §2.3 as data.

Micro-batch slot s passes the ring A0 -> F0 -> A1 -> F1 -> ... (layer l on
group l mod p) and ends with the loss on A-group 0 ("layer" L), then runs the
ring backwards. Every A replica r carries its own micro-batch of each slot;
each F shard serves all m replicas of a slot in one grouped GEMM (M2N in,
N2M out). The combine goes straight to the next layer's A worker; the
residual hops A(l) -> A(l+1) in the same stage (a local hand-over when p = 1).

With M micro-batches per step and m not dividing M, the last slot s = ceil(M/m) - 1
is run only by replicas 0 .. M - s*m - 1 (`Layout.replicas_of_slot`): the other
replicas have no instruction of that slot, and the F shards expect its dispatches
(and send its combines) only from and to the replicas that have it.

`max_in_flight` caps how many slots' worth of layers a rank holds activations for: the
forward of a rank's k-th lowest layer for slot s waits for the backward (W where split)
of its (k+1)-th highest of slot s - max_in_flight (the rule of `schedule.semantics`,
which the generator's task graph mirrors so that the order it emits can run).

`exchange_chunks` = c > 1 splits each micro-batch's exchange with each shard into c
chunks (`schedule.ir`): the shard's FWD and BWD of (layer, slot) become c computes, one
per chunk, each consuming and producing that chunk's messages, so a shard computes one
chunk while the next is on the wire. The generator prices a chunk at 1/c of the compute
and of the message.

`split_backward=True` defers weight gradients (`schedule.semantics`, "Deferred weight
gradients"): every backward is a BWD that computes what the next stage waits for (input
gradients) and a W after it that computes the weights' gradients, with no message; a W
runs when nothing else is ready on its lane (`orders.weight_priority`), so the weight
GEMMs fill the gaps a slot's chain leaves (the forward-to-backward turn, the LM head's
block), and the in-flight cap holds a slot's layer until its W ran. The generator prices a W at
`costs.compute_s(Op.WGT, ...)` and its BWD at the rest of the backward.

`forward_only=True` gives the forward-only schedule of evaluation: the same forwards and
forward messages, no backward, no SYNC or STEP, and no in-flight cap (a forward-only list
keeps nothing: `schedule.semantics`).

`order` says which ready compute runs first ("breadth", "depth" or "steady":
`schedule.orders`) and `costs` what the list schedule that orders each lane is timed
with: `orders.NOMINAL` by default (forward 1, backward 2, message latency 0.5), or the
run's (`orders.ScheduleCosts`, priced by `simulator.choose`), given for the
`reduced_layout`: a schedule with costs is always generated on it and every rank's list
expanded from its representative's (`build_afpipe_rank`), so the global and the
rank-local lists are one computation. Breadth on the default bench: docs/bench.md
(0.99 vs 1.36 s/step for depth); choosing between orders: `simulator.choose`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..distributed.layout import Layout
from .graph import Task, TaskGraph, emit_schedule, list_schedule
from .ir import Instr, Op, Schedule
from .orders import (
    NOMINAL,
    ScheduleCosts,
    check_chunks,
    check_order,
    priority,
    weight_priority,
)
from .semantics import cap_gates


def micro_batch_count(layout: Layout, num_slots: int, num_micro_batches: int = 0) -> int:
    """The step's micro-batch count M (0: every replica runs `num_slots`, M = num_slots*m);
    a given M must need exactly `num_slots` slots, ceil(M / m)."""
    if not num_micro_batches:
        return num_slots * layout.attn_workers
    if layout.slots_of_replica(0, num_micro_batches) != num_slots or (
        num_micro_batches < layout.attn_workers
    ):
        raise ValueError(
            f"{num_micro_batches} micro-batches on {layout.attn_workers} attention replicas "
            f"need ceil(M/m) slots, not {num_slots}, and at least one per replica"
        )
    return num_micro_batches


def build_afpipe_graph(
    layout: Layout,
    num_slots: int,
    max_in_flight: int,
    order: str = "breadth",
    *,
    num_micro_batches: int = 0,
    forward_only: bool = False,
    costs: ScheduleCosts = NOMINAL,
    exchange_chunks: int = 1,
    split_backward: bool = False,
) -> TaskGraph:
    """The task graph of one AF-Pipe step (module doc): its computes, the messages and local
    dependencies between them, the in-flight cap's gates and the ports each message holds."""
    check_order(order)
    split = split_backward and not forward_only
    check_chunks(exchange_chunks)
    num_micro = micro_batch_count(layout, num_slots, num_micro_batches)
    tasks = _Tasks(
        layout,
        tuple(layout.replicas_of_slot(s, num_micro) for s in range(num_slots)),
        range(exchange_chunks) if exchange_chunks > 1 else range(-1, 0),
    )
    cap = num_slots if forward_only else max_in_flight or num_slots  # forward-only: no cap
    g = TaskGraph()
    share = 1.0 / exchange_chunks
    _add_computes(g, tasks, order, costs, share, forward_only=forward_only, split=split)
    _add_dataflow(g, tasks, forward_only=forward_only)
    _add_cap_gates(g, tasks, cap, held=Op.WGT if split else Op.BWD)
    _add_ports(g, costs, share)
    return g


@dataclass(frozen=True, slots=True)
class _Tasks:
    """The tasks of one step by (layer, slot, replica r or shard j, chunk k): layer l runs on
    group l mod p."""

    layout: Layout
    replicas: tuple[int, ...]  # per slot: how many replicas run it
    chunks: range  # the exchange's chunks (range(-1, 0): one, unchunked)

    @property
    def num_slots(self) -> int:
        return len(self.replicas)

    def fa(self, l: int, s: int, r: int) -> Task:
        return Task(Op.FWD, "A", l, s, self.layout.attn_rank(self.layout.group_of(l), r))

    def ba(self, l: int, s: int, r: int) -> Task:
        return Task(Op.BWD, "A", l, s, self.layout.attn_rank(self.layout.group_of(l), r))

    def ff(self, l: int, s: int, j: int, k: int) -> Task:
        return Task(Op.FWD, "F", l, s, self.layout.expert_rank(self.layout.group_of(l), j), k)

    def bf(self, l: int, s: int, j: int, k: int) -> Task:
        return Task(Op.BWD, "F", l, s, self.layout.expert_rank(self.layout.group_of(l), j), k)


def _add_computes(
    g: TaskGraph,
    t: _Tasks,
    order: str,
    costs: ScheduleCosts,
    share: float,
    *,
    forward_only: bool,
    split: bool,
) -> None:
    """Every compute, priced by `costs` (a chunk's at its `share`; with `split` a BWD at the
    rest of the backward and a W after it) with its `order` priority."""

    def add(task: Task) -> None:
        part = share if task.chunk >= 0 else 1.0
        seconds = costs.compute_s(task.op, task.comp, task.layer)
        deferred = split and task.op == Op.BWD  # input gradients here, the rest in a W
        weights = costs.compute_s(Op.WGT, task.comp, task.layer) if deferred else 0.0
        g.add(
            task,
            max(0.0, seconds - weights) * part,
            (*priority(order, task.op, task.layer, task.slot), task.chunk),
        )
        if deferred:  # added after its BWD: listed after it, even at equal times
            w = replace(task, op=Op.WGT)
            g.add(w, weights * part, (*weight_priority(task.layer, task.slot), task.chunk))
            g.local_deps[w].append(task)

    layout = t.layout
    for s in range(t.num_slots):
        for l in range(layout.num_layers + 1):
            for r in range(t.replicas[s]):
                add(t.fa(l, s, r))
                if not forward_only:
                    add(t.ba(l, s, r))
            if l in layout.moe_layers:
                for k in t.chunks:
                    for j in range(layout.expert_workers):
                        add(t.ff(l, s, j, k))
                        if not forward_only:
                            add(t.bf(l, s, j, k))


def _add_dataflow(g: TaskGraph, t: _Tasks, *, forward_only: bool) -> None:
    """The messages of every slot (or local dependencies where both ends share a rank) and
    each backward's dependency on its forward."""
    layout, n = t.layout, t.layout.expert_workers
    fa, ba, ff, bf, chunks = t.fa, t.ba, t.ff, t.bf, t.chunks
    for s in range(t.num_slots):
        for l in range(layout.num_layers + 1):
            moe = l in layout.moe_layers
            prev_moe = l - 1 in layout.moe_layers
            for r in range(t.replicas[s]):
                if l > 0:
                    g.message(fa(l - 1, s, r), fa(l, s, r), "act", l - 1)
                    if prev_moe:
                        for k in chunks:
                            for j in range(n):
                                g.message(ff(l - 1, s, j, k), fa(l, s, r), "combine", l - 1)
                if moe:
                    for k in chunks:
                        for j in range(n):
                            g.message(fa(l, s, r), ff(l, s, j, k), "dispatch", l)
                if forward_only:
                    continue
                g.local_deps[ba(l, s, r)].append(fa(l, s, r))
                if l > 0:
                    g.message(ba(l, s, r), ba(l - 1, s, r), "grad_act", l - 1)
                    if prev_moe:
                        for k in chunks:
                            for j in range(n):
                                g.message(ba(l, s, r), bf(l - 1, s, j, k), "grad_combine", l - 1)
                if moe:
                    for k in chunks:
                        for j in range(n):
                            g.message(bf(l, s, j, k), ba(l, s, r), "grad_dispatch", l)
            if moe and not forward_only:
                for k in chunks:
                    for j in range(n):
                        g.local_deps[bf(l, s, j, k)].append(ff(l, s, j, k))


def _add_cap_gates(g: TaskGraph, t: _Tasks, cap: int, *, held: Op) -> None:
    """In-flight cap, layer by layer (`semantics.cap_gates`): the forward of a rank's layer of
    slot s waits for the release (`held`: the BWD, or the W where split) of its gate layer
    of slot s - cap."""
    layout, num_slots = t.layout, t.num_slots
    for rank in range(layout.world_size):
        layers = layout.layers_of(rank)
        if not layers or cap >= num_slots:
            continue
        role = layout.role(rank)
        for layer, gate in cap_gates(layers).items():
            for s in range(cap, num_slots):
                if role.comp == "A" and role.index < t.replicas[s]:
                    g.local_deps[t.fa(layer, s, role.index)].append(
                        replace(t.ba(gate, s - cap, role.index), op=held)
                    )
                elif role.comp == "F":
                    for k in t.chunks:
                        g.local_deps[t.ff(layer, s, role.index, k)].append(
                            replace(t.bf(gate, s - cap, role.index, k), op=held)
                        )


def _add_ports(g: TaskGraph, costs: ScheduleCosts, share: float) -> None:
    """The ports each message holds and for how long (`costs.message_ports`; a chunk's at its
    `share`)."""
    for msgs in g.outputs.values():
        for msg in msgs:
            loads = costs.message_ports(msg.kind, msg.layer, msg.src, msg.dst)
            if loads and msg.chunk >= 0:
                loads = tuple((port, seconds * share) for port, seconds in loads)
            if loads:
                g.ports[msg] = loads


def build_afpipe(
    layout: Layout,
    num_slots: int,
    max_in_flight: int = 0,
    order: str = "breadth",
    *,
    num_micro_batches: int = 0,
    forward_only: bool = False,
    costs: ScheduleCosts | None = None,
    exchange_chunks: int = 1,
    split_backward: bool = False,
) -> Schedule:
    """AF-Pipe schedule for one optimizer step of `num_slots` micro-batch slots (with
    `forward_only`, for one evaluation batch: forwards only, no cap, named "afpipe-forward").

    `num_micro_batches` (M, 0: num_slots*m): with M < num_slots*m the last slot is run
    by `layout.replicas_of_slot` replicas only. `costs` (None: `orders.NOMINAL`): what
    the lanes are ordered against, given for `reduced_layout(layout)` (module doc)."""
    if num_slots < 1:
        raise ValueError("AF-Pipe needs at least one micro-batch slot per attention replica")
    num_micro = micro_batch_count(layout, num_slots, num_micro_batches)
    cap = num_slots if forward_only else max_in_flight or num_slots
    meta: dict[str, int | str] = {
        "groups": layout.groups,
        "attn_workers": layout.attn_workers,
        "expert_workers": layout.expert_workers,
        "num_layers": layout.num_layers,
        "num_micro_batches": num_micro,
        "order": order,
    }
    if exchange_chunks > 1:
        meta["exchange_chunks"] = exchange_chunks
    if split_backward and not forward_only:
        meta["split_backward"] = 1
    if costs is not None:
        meta["costs"] = costs.name
        if reduced_layout(layout, num_micro)[0] != layout:
            rep = _representative(
                layout, num_micro, num_slots, max_in_flight, order, forward_only, costs,
                exchange_chunks, split_backward,
            )  # fmt: skip
            ranks = tuple(_expand(layout, num_micro, rep, r) for r in range(layout.world_size))
            roles = tuple(str(layout.role(r)) for r in range(layout.world_size))
            return replace(rep, num_ranks=layout.world_size, roles=roles, ranks=ranks, meta=meta)
    priced = costs or NOMINAL
    graph = build_afpipe_graph(
        layout,
        num_slots,
        max_in_flight,
        order,
        num_micro_batches=num_micro,
        forward_only=forward_only,
        costs=priced,
        exchange_chunks=exchange_chunks,
        split_backward=split_backward,
    )
    shared = priced.shared_compute or order == "steady"
    timeline = list_schedule(graph, priced.latency_s, shared_compute=shared)
    return emit_schedule(
        graph,
        timeline,
        name="afpipe-forward" if forward_only else "afpipe",
        num_ranks=layout.world_size,
        num_slots=num_slots,
        max_in_flight=cap,
        roles=tuple(str(layout.role(r)) for r in range(layout.world_size)),
        meta=meta,
        sync=not forward_only,
    )


def replica_classes(layout: Layout, num_micro_batches: int) -> tuple[range, ...]:
    """Replicas that run identical lists: all m when m divides the M micro-batches, else
    (replicas that run the last slot, replicas that do not)."""
    m = layout.attn_workers
    num_slots = layout.slots_of_replica(0, num_micro_batches)
    last = layout.replicas_of_slot(num_slots - 1, num_micro_batches)
    return (range(m),) if last == m else (range(last), range(last, m))


def reduced_layout(layout: Layout, num_micro_batches: int) -> tuple[Layout, int]:
    """(layout, M) of the AF-Pipe step with one replica per `replica_classes` class and one
    shard per group: the schedule whose lists every real rank's list expands from."""
    classes = len(replica_classes(layout, num_micro_batches))
    num_slots = layout.slots_of_replica(0, num_micro_batches)
    reduced = replace(layout, attn_workers=classes, expert_workers=1, placement="packed")
    return reduced, num_slots * classes - (classes - 1)


def build_afpipe_rank(
    layout: Layout,
    rank: int,
    num_slots: int,
    max_in_flight: int = 0,
    order: str = "breadth",
    *,
    num_micro_batches: int = 0,
    forward_only: bool = False,
    costs: ScheduleCosts | None = None,
    exchange_chunks: int = 1,
    split_backward: bool = False,
) -> tuple[Instr, ...]:
    """`rank`'s AF-Pipe list without building the whole world's schedule.

    All replicas of a class (`replica_classes`: every replica when m divides the
    micro-batches, else those with and those without the last slot) of an A-group run
    the same list, and so do all n shards of an F-group (the nominal costs depend on
    neither m nor n, nor on a shard's expert count; given `costs` are those of the reduced
    layout), so the list of one replica per class
    and one shard per group (`reduced_layout`) is built and `rank`'s list expanded from
    its representative (peers are found through `layout`, so any placement works): a message
    to or from the other component stands for one message
    per peer of that group (replicas r of the class, or shards j, in order); a message
    to the same component goes to the peer with the same index.
    Time and memory: the reduced schedule plus `rank`'s own instructions, whatever m
    and n are. Tests check the result equals `build_afpipe(layout, ...).ranks[rank]`.
    """
    num_micro = micro_batch_count(layout, num_slots, num_micro_batches)
    rep = _representative(
        layout, num_micro, num_slots, max_in_flight, order, forward_only, costs,
        exchange_chunks, split_backward,
    )  # fmt: skip
    return _expand(layout, num_micro, rep, rank)


def _representative(
    layout: Layout,
    num_micro: int,
    num_slots: int,
    max_in_flight: int,
    order: str,
    forward_only: bool,
    costs: ScheduleCosts | None,
    exchange_chunks: int = 1,
    split_backward: bool = False,
) -> Schedule:
    """The schedule of `reduced_layout(layout)`: one replica per class, one shard per group."""
    reduced, reduced_micro = reduced_layout(layout, num_micro)
    return build_afpipe(
        reduced,
        num_slots,
        max_in_flight,
        order,
        num_micro_batches=reduced_micro,
        forward_only=forward_only,
        costs=costs,
        exchange_chunks=exchange_chunks,
        split_backward=split_backward,
    )


def _expand(layout: Layout, num_micro: int, rep: Schedule, rank: int) -> tuple[Instr, ...]:
    """`rank`'s list from its representative's in `rep`, the `reduced_layout` schedule."""
    classes = replica_classes(layout, num_micro)
    reduced, _ = reduced_layout(layout, num_micro)
    role = layout.role(rank)
    if role.comp == "A":
        cls = next(c for c, members in enumerate(classes) if role.index in members)
        rep_rank = reduced.attn_rank(role.group, cls)
    else:
        rep_rank = reduced.expert_rank(role.group, 0)

    def real_peers(other: int) -> list[int]:
        peer = reduced.role(other)
        if peer.comp == role.comp:
            return [_rank_of(layout, peer.comp, peer.group, role.index)]
        members = classes[peer.index] if peer.comp == "A" else range(layout.expert_workers)
        return [_rank_of(layout, peer.comp, peer.group, i) for i in members]

    peers = {r: real_peers(r) for r in range(reduced.world_size)}
    out: list[Instr] = []
    for ins in rep.ranks[rep_rank]:
        m = ins.msg
        if m is None:
            out.append(ins)
        elif ins.op == Op.SEND:
            out += [Instr(ins.op, msg=replace(m, src=rank, dst=d)) for d in peers[m.dst]]
        else:
            out += [Instr(ins.op, msg=replace(m, src=s, dst=rank)) for s in peers[m.src]]
    return tuple(out)


def _rank_of(layout: Layout, comp: str, group: int, index: int) -> int:
    return layout.attn_rank(group, index) if comp == "A" else layout.expert_rank(group, index)
