"""AF-Pipe: the disaggregated attention/FFN pipeline of docs/design.md §2.3 as data.

Micro-batch slot s passes the ring A0 -> F0 -> A1 -> F1 -> ... (layer l on
group l mod p) and ends with the loss on A-group 0 ("layer" L), then runs the
ring backwards. Every A replica r carries its own micro-batch of each slot;
each F shard serves all m replicas of a slot in one grouped GEMM (M2N in,
N2M out). The combine goes straight to the next layer's A worker; the
residual hops A(l) -> A(l+1) in the same stage (a local hand-over when p = 1).

`max_in_flight` caps how many slots a rank holds activations for: the forward
of a rank's first stage for slot s waits for that stage's backward of slot
s - max_in_flight (the rule of `schedule.semantics`, which the generator's task
graph mirrors so that the order it emits can run).

`order` says which ready compute a lane prefers:

* "breadth" (default) — the lowest layer (forward) / highest layer (backward), then
  the lowest slot: every slot of a layer goes before the next layer, so a layer's
  messages of all slots are on the wire while the next ones compute, and the links
  stay busy back to back (docs/bench.md: 0.99 vs 1.36 s/step on the default bench).
* "depth" — the lowest slot, then the layer: a slot runs ahead through the layers
  and its backward starts early (forward and backward lanes overlap).
"""

from __future__ import annotations

from dataclasses import replace

from ..config import SCHEDULE_ORDERS
from ..distributed.layout import Layout
from .graph import Task, TaskGraph, emit_schedule, list_schedule
from .ir import Instr, Msg, Op, Schedule

# Nominal costs used only to order each lane (the executor follows the order,
# not the times): forward 1, backward 2, loss head 1, message latency 0.5.
_FWD_COST, _BWD_COST, _LATENCY = 1.0, 2.0, 0.5


def build_afpipe_graph(
    layout: Layout, num_slots: int, max_in_flight: int, order: str = "breadth"
) -> TaskGraph:
    if order not in SCHEDULE_ORDERS:
        raise ValueError(
            f"schedule.order must be one of {', '.join(SCHEDULE_ORDERS)}, got {order!r}"
        )
    p, m, n, L = layout.groups, layout.attn_workers, layout.expert_workers, layout.num_layers
    cap = max_in_flight or num_slots
    g = TaskGraph()

    def fwd_key(l: int, s: int) -> tuple[int, int]:
        return (l, s) if order == "breadth" else (s, l)

    def bwd_key(l: int, s: int) -> tuple[int, int]:
        return (-l, s) if order == "breadth" else (s, -l)

    def fa(l: int, s: int, r: int) -> Task:
        return Task(Op.FWD, "A", l, s, layout.attn_rank(l % p, r))

    def ba(l: int, s: int, r: int) -> Task:
        return Task(Op.BWD, "A", l, s, layout.attn_rank(l % p, r))

    def ff(l: int, s: int, j: int) -> Task:
        return Task(Op.FWD, "F", l, s, layout.expert_rank(l % p, j))

    def bf(l: int, s: int, j: int) -> Task:
        return Task(Op.BWD, "F", l, s, layout.expert_rank(l % p, j))

    for s in range(num_slots):
        for l in range(L + 1):
            for r in range(m):
                g.add(fa(l, s, r), _FWD_COST, fwd_key(l, s))
                g.add(ba(l, s, r), _BWD_COST, bwd_key(l, s))
            if l in layout.moe_layers:
                for j in range(n):
                    g.add(ff(l, s, j), _FWD_COST, fwd_key(l, s))
                    g.add(bf(l, s, j), _BWD_COST, bwd_key(l, s))

    for s in range(num_slots):
        for l in range(L + 1):
            moe = l in layout.moe_layers
            prev_moe = l - 1 in layout.moe_layers
            for r in range(m):
                g.local_deps[ba(l, s, r)].append(fa(l, s, r))
                if l > 0:
                    g.message(fa(l - 1, s, r), fa(l, s, r), "act", l - 1)
                    g.message(ba(l, s, r), ba(l - 1, s, r), "grad_act", l - 1)
                    if prev_moe:
                        for j in range(n):
                            g.message(ff(l - 1, s, j), fa(l, s, r), "combine", l - 1)
                            g.message(ba(l, s, r), bf(l - 1, s, j), "grad_combine", l - 1)
                if moe:
                    for j in range(n):
                        g.message(fa(l, s, r), ff(l, s, j), "dispatch", l)
                        g.message(bf(l, s, j), ba(l, s, r), "grad_dispatch", l)
            if moe:
                for j in range(n):
                    g.local_deps[bf(l, s, j)].append(ff(l, s, j))

    # In-flight cap: a rank's first stage of slot s waits for its backward of slot s - cap.
    for rank in range(layout.world_size):
        layers = layout.layers_of(rank)
        if not layers or cap >= num_slots:
            continue
        role = layout.role(rank)
        first = layers[0]
        for s in range(cap, num_slots):
            if role.comp == "A":
                g.local_deps[fa(first, s, role.index)].append(ba(first, s - cap, role.index))
            else:
                g.local_deps[ff(first, s, role.index)].append(bf(first, s - cap, role.index))
    return g


def build_afpipe(
    layout: Layout, num_slots: int, max_in_flight: int = 0, order: str = "breadth"
) -> Schedule:
    """AF-Pipe schedule for one optimizer step of `num_slots` micro-batch slots."""
    if num_slots < 1:
        raise ValueError("AF-Pipe needs at least one micro-batch slot per attention replica")
    graph = build_afpipe_graph(layout, num_slots, max_in_flight, order)
    timeline = list_schedule(graph, _LATENCY)
    return emit_schedule(
        graph,
        timeline,
        name="afpipe",
        num_ranks=layout.world_size,
        num_slots=num_slots,
        max_in_flight=max_in_flight or num_slots,
        roles=tuple(str(layout.role(r)) for r in range(layout.world_size)),
        meta={
            "groups": layout.groups,
            "attn_workers": layout.attn_workers,
            "expert_workers": layout.expert_workers,
            "num_layers": layout.num_layers,
            "order": order,
        },
    )


def build_afpipe_rank(
    layout: Layout, rank: int, num_slots: int, max_in_flight: int = 0, order: str = "breadth"
) -> tuple[Instr, ...]:
    """`rank`'s AF-Pipe list without building the whole world's schedule.

    All m replicas of an A-group run the same list, and so do all n shards of an
    F-group (the generator's costs do not depend on m or n), so the list of one
    replica and one shard per group (`Layout` with m = n = 1, 2p ranks A0, F0, A1, ...)
    is built and `rank`'s list expanded from its representative (peers are found through
    `layout`, so any placement works): a message to or from the other
    component stands for one message per peer of that group (replicas r or shards j
    in order); a message to the same component goes to the peer with the same index.
    Time and memory: the reduced schedule plus `rank`'s own instructions, whatever m
    and n are. Tests check the result equals `build_afpipe(layout, ...).ranks[rank]`.
    """
    reduced = replace(layout, attn_workers=1, expert_workers=1, placement="packed")
    rep = build_afpipe(reduced, num_slots, max_in_flight, order)
    role = layout.role(rank)
    rep_rank = (
        reduced.attn_rank(role.group, 0) if role.comp == "A" else reduced.expert_rank(role.group, 0)
    )

    def real_peers(other: int) -> list[int]:
        peer = reduced.role(other)
        if peer.comp == role.comp:
            return [_rank_of(layout, peer.comp, peer.group, role.index)]
        count = layout.attn_workers if peer.comp == "A" else layout.expert_workers
        return [_rank_of(layout, peer.comp, peer.group, i) for i in range(count)]

    peers = {r: real_peers(r) for r in range(reduced.world_size)}
    out: list[Instr] = []
    for ins in rep.ranks[rep_rank]:
        m = ins.msg
        if m is None:
            out.append(ins)
        elif ins.op == Op.SEND:
            out += [Instr(ins.op, msg=Msg(m.kind, m.layer, m.slot, rank, d)) for d in peers[m.dst]]
        else:
            out += [Instr(ins.op, msg=Msg(m.kind, m.layer, m.slot, s, rank)) for s in peers[m.src]]
    return tuple(out)


def _rank_of(layout: Layout, comp: str, group: int, index: int) -> int:
    return layout.attn_rank(group, index) if comp == "A" else layout.expert_rank(group, index)
