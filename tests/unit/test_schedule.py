"""AF-Pipe generator and validator, without any process group."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from disagmoe.config import ParallelConfig
from disagmoe.distributed.layout import Layout
from disagmoe.presets import MODEL_PRESETS
from disagmoe.schedule.afpipe import build_afpipe, build_afpipe_rank
from disagmoe.schedule.ir import Instr, Msg, Op, Schedule
from disagmoe.schedule.semantics import RankProgram, cap_gates, consumer, producer
from disagmoe.schedule.validate import ScheduleError, validate


def layout(p: int, m: int, n: int, layers: int = 4, dense: int = 0, experts: int = 8) -> Layout:
    model = dataclasses.replace(
        MODEL_PRESETS["tiny"], num_layers=layers, num_dense_layers=dense, num_experts=experts
    )
    return Layout.build(model, ParallelConfig(groups=p, attn_workers=m, expert_workers=n))


CONFIGS = [
    (p, m, n, layers, slots, cap, dense)
    for p, m, n, layers, slots, cap, dense in itertools.product(
        [1, 2, 4], [1, 2, 3], [1, 2, 4], [4, 8], [1, 3, 6], [0, 1, 2], [0, 1]
    )
    if layers % p == 0 and layers - dense >= p  # every expert group holds a MoE layer
]


@pytest.mark.parametrize("order", ["breadth", "depth", "steady"])
def test_validator_accepts_every_generated_schedule(order: str) -> None:
    assert len(CONFIGS) > 300
    for p, m, n, layers, slots, cap, dense in random.Random(0).sample(CONFIGS, 150):
        sched = build_afpipe(layout(p, m, n, layers, dense), slots, cap, order)
        peak = validate(sched)
        assert 1 <= peak <= (cap or slots), (p, m, n, layers, slots, cap, dense)


def _forward_lane(sched: Schedule, rank: int) -> list[tuple[int, int]]:
    return [(i.layer, i.slot) for i in sched.ranks[rank] if i.is_compute and i.op == Op.FWD]


def test_breadth_runs_every_slot_of_a_layer_first_depth_runs_a_slot_ahead() -> None:
    lay = layout(1, 1, 1, layers=4)
    breadth = _forward_lane(build_afpipe(lay, 4, order="breadth"), 0)
    assert breadth[:4] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert breadth == sorted(breadth)  # layer-major
    depth = _forward_lane(build_afpipe(lay, 4, order="depth"), 0)
    assert depth.index((1, 0)) < depth.index((0, 3))  # slot 0 reaches layer 1 first
    with pytest.raises(ValueError, match="schedule.order"):
        build_afpipe(lay, 4, order="sideways")


@pytest.mark.parametrize("p,m,n", [(1, 2, 2), (2, 1, 1), (2, 2, 2), (4, 1, 2)])
def test_every_task_once_forward_before_backward(p: int, m: int, n: int) -> None:
    lay = layout(p, m, n, layers=8, dense=1)
    sched = build_afpipe(lay, 4)
    for rank, instrs in enumerate(sched.ranks):
        role = lay.role(rank)
        computes = [i for i in instrs if i.is_compute]
        expected_layers = lay.layers_of(rank)
        copies = 1
        assert len(computes) == 2 * 4 * len(expected_layers) * copies
        seen_forward = set()
        for instr in computes:
            assert instr.comp == role.comp
            assert instr.layer in expected_layers
            key = (instr.layer, instr.slot)
            if instr.op == Op.FWD:
                seen_forward.add(key)
            else:
                assert key in seen_forward
        assert instrs[-2:] == (Instr(Op.SYNC), Instr(Op.STEP))


def test_messages_go_where_the_design_says() -> None:
    lay = layout(2, 2, 2, layers=4)
    sched = build_afpipe(lay, 2)
    sends = [i.msg for instrs in sched.ranks for i in instrs if i.op == Op.SEND and i.msg]
    for msg in sends:
        src, dst = lay.role(msg.src), lay.role(msg.dst)
        if msg.kind == "dispatch":  # A(l) -> F(l), same group
            assert (src.comp, dst.comp) == ("A", "F") and src.group == dst.group == msg.layer % 2
        if msg.kind == "combine":  # F(l) -> A(l+1): straight to the next layer's attention
            assert (src.comp, dst.comp) == ("F", "A") and dst.group == (msg.layer + 1) % 2
        if msg.kind == "act":  # residual hop A(g, r) -> A(g+1, r)
            assert src.index == dst.index and dst.group == (msg.layer + 1) % 2
        assert producer(msg)[1] == src.comp and consumer(msg)[1] == dst.comp
    kinds = {m.kind for m in sends}
    assert kinds == {"act", "dispatch", "combine", "grad_act", "grad_combine", "grad_dispatch"}
    # every A replica sends each F shard exactly one dispatch per (layer, slot): M2N
    dispatch = [(m.layer, m.slot, m.src, m.dst) for m in sends if m.kind == "dispatch"]
    assert len(dispatch) == len(set(dispatch)) == 4 * 2 * 2 * 2


def test_p1_keeps_the_residual_local() -> None:
    sched = build_afpipe(layout(1, 2, 2), 2)
    kinds = {i.msg.kind for instrs in sched.ranks for i in instrs if i.msg}
    assert "act" not in kinds and "grad_act" not in kinds


def _swap_first_two_receives(sched: Schedule, rank: int) -> Schedule:
    instrs = list(sched.ranks[rank])
    idx = [k for k, i in enumerate(instrs) if i.op == Op.RECV]
    a, b = idx[0], next(k for k in idx[1:] if instrs[k].msg.src == instrs[idx[0]].msg.src)  # type: ignore[union-attr]
    instrs[a], instrs[b] = instrs[b], instrs[a]
    ranks = list(sched.ranks)
    ranks[rank] = tuple(instrs)
    return dataclasses.replace(sched, ranks=tuple(ranks))


def test_validator_rejects_reordered_channel() -> None:
    sched = build_afpipe(layout(2, 1, 1), 3)
    with pytest.raises(ScheduleError, match="different orders"):
        validate(_swap_first_two_receives(sched, 1))


def test_validator_rejects_missing_receive() -> None:
    sched = build_afpipe(layout(2, 1, 1), 2)
    ranks = list(sched.ranks)
    ranks[1] = tuple(i for i in ranks[1] if not (i.op == Op.RECV and i.msg and i.msg.slot == 1))
    with pytest.raises(ScheduleError, match="no matching RECV"):
        validate(dataclasses.replace(sched, ranks=tuple(ranks)))


def test_validator_detects_deadlock() -> None:
    """Rank 0 asks for layer 2's forward before layer 0's: layer 2 needs layer 1's output,
    which needs layer 0's, which now waits behind layer 2 on the same lane."""
    sched = build_afpipe(layout(2, 1, 1), 1)
    ranks = list(sched.ranks)
    instrs = list(ranks[0])
    a = instrs.index(Instr(Op.FWD, "A", 0, 0))
    b = instrs.index(Instr(Op.FWD, "A", 2, 0))
    instrs[a], instrs[b] = instrs[b], instrs[a]
    ranks[0] = tuple(instrs)
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(dataclasses.replace(sched, ranks=tuple(ranks)))


def test_in_flight_cap_bounds_peak() -> None:
    lay = layout(1, 1, 2, layers=4)
    uncapped = validate(build_afpipe(lay, 6))
    capped = validate(build_afpipe(lay, 6, max_in_flight=2))
    assert capped <= 2 < uncapped


@pytest.mark.parametrize("split", [False, True])
def test_in_flight_cap_pairs_each_layer_with_the_older_slots_mirror_layer(split: bool) -> None:
    """`schedule.semantics`, "in-flight cap, layer by layer": on every rank (A with the head,
    F with 2 exchange chunks, p = 2) the forward of the k-th lowest layer of slot s waits
    for the release (BWD, or W where split) of the (k+1)-th highest (or the lowest) of
    slot s - cap, chunk by chunk; and the generator's lists let a new slot start before
    the older one's backward reached its lowest layer."""
    lay = layout(2, 1, 2, layers=6)
    cap = 1
    sched = build_afpipe(lay, 3, cap, "steady", exchange_chunks=2, split_backward=split)
    assert validate(sched) <= cap
    held = "W" if split else "B"
    for rank in range(lay.world_size):
        prog = RankProgram.build(sched, rank)
        layers = lay.layers_of(rank)
        assert list(prog.layers) == layers
        for _, ins in prog.lanes["fwd"]:
            gate = layers[max(0, len(layers) - 2 - layers.index(ins.layer))]
            assert cap_gates(prog.layers)[ins.layer] == gate
            caps = [t for t in prog.local[ins.task] if t[3] != ins.slot]
            want = [(held, ins.comp, gate, ins.slot - cap, ins.chunk)] if ins.slot >= cap else []
            assert caps == want, (rank, ins, caps)
    a0 = lay.attn_rank(0, 0)  # layers 0, 2, 4 and the head (6)
    order = [str(i) for i in sched.ranks[a0] if i.is_compute]
    assert order.index("FA l0 s1") < order.index(f"{held}A l0 s0")


def test_text_and_csv_dumps() -> None:
    sched = build_afpipe(layout(2, 1, 1), 2)
    text = sched.to_text()
    assert "rank 1 F(g0,j0):" in text and "SEND combine[l0,s0] 1->2" in text
    rows = sched.to_csv().strip().splitlines()
    assert rows[0].startswith("rank,role,index,lane,op")
    assert len(rows) == 1 + sum(len(r) for r in sched.ranks)


def test_layout_errors() -> None:
    model = MODEL_PRESETS["tiny"]
    with pytest.raises(ValueError, match="divisible by parallel.groups"):
        Layout.build(model, ParallelConfig(groups=3))
    with pytest.raises(ValueError, match="a shard would hold no expert"):
        Layout.build(model, ParallelConfig(expert_workers=model.num_experts + 1))
    with pytest.raises(ValueError, match="world size is 3"):
        Layout.build(model, ParallelConfig(), world_size=3)


@pytest.mark.parametrize("order", ["breadth", "depth", "steady"])
def test_rank_local_lists_equal_slices_of_the_global_schedule(order: str) -> None:
    for p, m, n, layers, slots, cap, dense in random.Random(1).sample(CONFIGS, 40):
        lay = layout(p, m, n, layers, dense)
        full = build_afpipe(lay, slots, cap, order)
        for rank in range(lay.world_size):
            local = build_afpipe_rank(lay, rank, slots, cap, order)
            assert local == full.ranks[rank], (p, m, n, layers, slots, cap, dense, rank)


# (p, m, n, layers, micro-batches, cap, dense): m does not divide the micro-batches.
UNEVEN = [
    (1, 3, 3, 4, 8, 0, 0),
    (1, 2, 3, 4, 3, 1, 0),
    (2, 3, 2, 4, 7, 2, 0),
    (2, 2, 3, 4, 5, 0, 1),
    (4, 3, 1, 8, 4, 1, 0),
]


@pytest.mark.parametrize("order", ["breadth", "depth", "steady"])
def test_uneven_micro_batches_schedule_is_valid_and_replicas_run_their_slots(order: str) -> None:
    for p, m, n, layers, micro, cap, dense in UNEVEN:
        lay = layout(p, m, n, layers, dense)
        slots = -(-micro // m)
        sched = build_afpipe(lay, slots, cap, order, num_micro_batches=micro)
        assert 1 <= validate(sched) <= (cap or slots)
        for r in range(m):
            fwd = {i.slot for i in sched.ranks[lay.attn_rank(0, r)] if i.op == Op.FWD}
            assert fwd == set(range(lay.slots_of_replica(r, micro))), (p, m, n, micro, r)
        # an F shard's last-slot forward takes a dispatch from exactly the replicas that have it
        last = slots - 1
        dispatches = {
            i.msg.src
            for i in sched.ranks[lay.expert_rank(0, 0)]
            if i.op == Op.RECV
            and i.msg is not None
            and i.msg.kind == "dispatch"
            and i.msg.slot == last
        }
        have = lay.replicas_of_slot(last, micro)
        assert dispatches == {lay.attn_rank(0, r) for r in range(have)}, (p, m, n, micro)


def test_uneven_micro_batches_rejects_wrong_slot_count() -> None:
    with pytest.raises(ValueError, match="need ceil"):
        build_afpipe(layout(1, 3, 1), 2, num_micro_batches=8)


@pytest.mark.parametrize("order", ["breadth", "depth", "steady"])
def test_rank_local_lists_equal_slices_of_an_uneven_global_schedule(order: str) -> None:
    for p, m, n, layers, micro, cap, dense in UNEVEN:
        lay = layout(p, m, n, layers, dense)
        slots = -(-micro // m)
        full = build_afpipe(lay, slots, cap, order, num_micro_batches=micro)
        for rank in range(lay.world_size):
            local = build_afpipe_rank(lay, rank, slots, cap, order, num_micro_batches=micro)
            assert local == full.ranks[rank], (p, m, n, layers, micro, cap, dense, rank)


def test_validator_rejects_uneven_schedule_missing_a_replicas_dispatch() -> None:
    lay = layout(1, 3, 2)
    sched = build_afpipe(lay, 3, num_micro_batches=8)
    # replica 2 has no slot 2: a RECV of its dispatch on a shard has no SEND
    shard = lay.expert_rank(0, 0)
    ghost = Instr(Op.RECV, msg=Msg("dispatch", 0, 2, lay.attn_rank(0, 2), shard))
    ranks = list(sched.ranks)
    ranks[shard] = (ghost, *ranks[shard])
    with pytest.raises(ScheduleError, match="has no matching SEND"):
        validate(dataclasses.replace(sched, ranks=tuple(ranks)))


@pytest.mark.parametrize(("experts", "shards"), [(8, 3), (8, 8), (8, 1), (7, 2), (60, 9)])
def test_expert_ownership_is_contiguous_and_near_even(experts: int, shards: int) -> None:
    lay = layout(1, 1, shards, experts=experts)
    ranges = lay.expert_ranges()
    assert [e for r in ranges for e in r] == list(range(experts))
    sizes = [len(r) for r in ranges]
    assert sizes == sorted(sizes, reverse=True)  # the first E mod n shards hold one more
    assert set(sizes) <= {experts // shards, -(-experts // shards)}
    assert sum(1 for x in sizes if x > experts // shards) == experts % shards
    for j, r in enumerate(ranges):
        assert lay.expert_range(j) == r
        assert all(lay.expert_owner(e) == j for e in r)
    if (experts, shards) == (8, 3):
        assert ranges == (range(0, 3), range(3, 6), range(6, 8))


def test_micro_batches_of_replicas() -> None:
    lay = layout(1, 3, 1)
    # M = 8 on m = 3: replica r runs micro-batches r, r+3, ...: 3, 3, 2 slots
    assert [lay.slots_of_replica(r, 8) for r in range(3)] == [3, 3, 2]
    assert [lay.replicas_of_slot(s, 8) for s in range(3)] == [3, 3, 2]
    got = sorted(lay.micro_batch(r, s) for r in range(3) for s in range(lay.slots_of_replica(r, 8)))
    assert got == list(range(8))
