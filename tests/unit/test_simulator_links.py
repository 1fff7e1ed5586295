"""Link sharing (`simulator.links`): closed forms of max-min fair sharing, the FIFO model's
head-of-line blocking, bundles against the real messages they stand for, the bound."""

from __future__ import annotations

import pytest

from disagmoe.simulator.bound import program_bound
from disagmoe.simulator.engine import COMPUTE, DeadlockError, Program, Timeline, run_program
from disagmoe.simulator.links import LinkModel

BW = 2e9  # bytes/s of every port
B = 1e9  # bytes of one message
T = B / BW  # one message alone: 0.5 s
LAT = 1e-3


class Net:
    """A program whose ranks each have one out and one in port of `BW`."""

    def __init__(self, ranks: int) -> None:
        self.prog = Program(num_ranks=ranks, latency_s=LAT)
        self.out = [self.prog.add_port(f"out{r}", BW) for r in range(ranks)]
        self.into = [self.prog.add_port(f"in{r}", BW) for r in range(ranks)]

    def send(self, src: int, dst: int, nbytes: float = B, deps: list[int] | None = None) -> int:
        loads = [(self.out[src], nbytes), (self.into[dst], nbytes)]
        return self.prog.add_xfer(src, dst, loads, f"{src}->{dst}", deps or [])

    def run(self, link_model: LinkModel = "fair") -> Timeline:
        timeline = run_program(self.prog, link_model=link_model)
        assert timeline.makespan >= program_bound(self.prog).seconds * (1 - 1e-12)
        return timeline


@pytest.mark.parametrize("link_model", ["fair", "fifo"])
def test_one_message_alone_takes_bytes_over_bandwidth_plus_latency(link_model: LinkModel) -> None:
    net = Net(2)
    op = net.send(0, 1)
    assert net.run(link_model).end[op] == pytest.approx(T + LAT, rel=1e-12)


def test_one_sender_to_two_receivers_share_its_egress() -> None:
    """Both leave port out0 at BW/2 each: both arrive at 2 B / BW (FIFO: T and 2T)."""
    net = Net(3)
    ops = [net.send(0, 1), net.send(0, 2)]
    fair = net.run()
    assert [fair.end[op] for op in ops] == pytest.approx([2 * T + LAT] * 2, rel=1e-12)
    fifo = net.run("fifo")
    assert [fifo.end[op] for op in ops] == pytest.approx([T + LAT, 2 * T + LAT], rel=1e-12)


@pytest.mark.parametrize("senders", [2, 3, 5])
def test_n_senders_into_one_receiver_take_n_bytes_over_bandwidth(senders: int) -> None:
    net = Net(senders + 1)
    ops = [net.send(s, senders) for s in range(senders)]
    timeline = net.run()
    assert [timeline.end[op] for op in ops] == pytest.approx([senders * T + LAT] * senders)


def test_full_duplex_directions_do_not_slow_each_other() -> None:
    net = Net(2)
    ops = [net.send(0, 1), net.send(1, 0)]
    timeline = net.run()
    assert [timeline.end[op] for op in ops] == pytest.approx([T + LAT] * 2, rel=1e-12)


def test_fifo_blocks_at_the_head_of_the_line_and_fair_sharing_does_not() -> None:
    """0 -> 1, then 2 -> 1 and 2 -> 3, all ready at 0 in that order.

    FIFO: 2 -> 1 waits for port in1 (busy with 0 -> 1 until T), so 2 -> 3 waits for port
    out2 behind it although out2 and in3 idle over [0, T]: ends T, 2T, 3T. Fair: in1 and
    out2 each carry two messages, every message moves at BW/2 from 0, all end at 2T."""
    net = Net(4)
    ops = [net.send(0, 1), net.send(2, 1), net.send(2, 3)]
    fifo = net.run("fifo")
    assert [fifo.end[op] for op in ops] == pytest.approx([T + LAT, 2 * T + LAT, 3 * T + LAT])
    assert fifo.xfer_begin[ops[2]] == pytest.approx(2 * T)
    fair = net.run()
    assert [fair.end[op] for op in ops] == pytest.approx([2 * T + LAT] * 3, rel=1e-12)
    assert fair.xfer_begin[ops[2]] == 0.0


def test_max_min_gives_a_flow_the_bandwidth_its_bottlenecked_peers_leave() -> None:
    """0, 2, 3 -> 1 (in1 splits three ways: BW/3 each) and 0 -> 4: out0 carries 0 -> 1 at
    BW/3, so 0 -> 4 gets the other 2 BW/3 and ends at 1.5 T; in1 stays the bottleneck of
    the others (they end at 3T, not earlier: 0 -> 1 gains nothing from out0's release)."""
    net = Net(5)
    to_one = [net.send(s, 1) for s in (0, 2, 3)]
    side = net.send(0, 4)
    timeline = net.run()
    assert timeline.end[side] == pytest.approx(1.5 * T + LAT, rel=1e-12)
    assert [timeline.end[op] for op in to_one] == pytest.approx([3 * T + LAT] * 3, rel=1e-12)


def test_a_message_that_starts_later_slows_the_one_in_flight() -> None:
    """0 -> 1 alone for T/2 (half its bytes), then 2 -> 1 joins: the rest of each at BW/2.
    The first ends at T/2 + T = 1.5 T; the second has B/2 left then and ends at 2 T."""
    net = Net(3)
    first = net.send(0, 1)
    wait = net.prog.add(COMPUTE, 2, "fwd", T / 2, "attn", "wait", [])
    second = net.send(2, 1, deps=[wait])
    timeline = net.run()
    assert timeline.end[first] == pytest.approx(1.5 * T + LAT, rel=1e-12)
    assert timeline.end[second] == pytest.approx(2 * T + LAT, rel=1e-12)


def test_ports_of_different_speed_and_load_share_by_progress() -> None:
    """Message X loads a slow NIC (BW) and a fast NVLink (4 BW) with B each: alone it takes
    B / BW, held by the NIC, and moves only BW over the NVLink; message Y on the NVLink
    alone gets the remaining 3 BW (max-min: the NIC froze X first) and ends at T / 3."""
    prog = Program(num_ranks=2, latency_s=0.0)
    nic, nvl = prog.add_port("nic_out0", BW), prog.add_port("nvl_out0", 4 * BW)
    x = prog.add_xfer(0, 1, [(nic, B), (nvl, B)], "x", [])
    y = prog.add_xfer(0, 1, [(nvl, B)], "y", [])
    timeline = run_program(prog)
    assert timeline.end[x] == pytest.approx(T, rel=1e-12)
    assert timeline.end[y] == pytest.approx(T / 3, rel=1e-12)


def test_a_bundle_shares_a_port_as_the_real_messages_it_stands_for() -> None:
    """A bundle of 3 real messages of B (3B on out0, `unit` B) beside one plain 3B message:
    4 real flows at BW/4 each; the bundle's flows end at 4T, the plain message has moved B
    by then and moves its other 2B alone: 6T. The same as the 4 messages sent one by one."""
    bundled = Program(num_ranks=2, latency_s=0.0)
    out = bundled.add_port("out0", BW)
    bundle = bundled.add_xfer(0, 1, [(out, 3 * B)], "bundle", [], unit=B)
    plain = bundled.add_xfer(0, 1, [(out, 3 * B)], "plain", [])
    timeline = run_program(bundled)
    assert (timeline.end[bundle], timeline.end[plain]) == pytest.approx((4 * T, 6 * T))

    full = Program(num_ranks=2, latency_s=0.0)
    out = full.add_port("out0", BW)
    singles = [full.add_xfer(0, 1, [(out, B)], f"m{k}", []) for k in range(3)]
    plain = full.add_xfer(0, 1, [(out, 3 * B)], "plain", [])
    timeline = run_program(full)
    assert [timeline.end[op] for op in singles] == pytest.approx([4 * T] * 3)
    assert timeline.end[plain] == pytest.approx(6 * T)


def test_cycles_still_deadlock_and_unknown_models_are_refused() -> None:
    net = Net(2)
    a = net.send(0, 1)
    b = net.send(1, 0, deps=[a])
    net.prog.deps[a].append(b)
    with pytest.raises(DeadlockError):
        run_program(net.prog)
    with pytest.raises(ValueError, match="link model"):
        run_program(Net(1).prog, link_model="tcp")  # type: ignore[arg-type]


def _reference_max_min(
    flows: dict[int, list[tuple[int, float]]], capacity: list[float]
) -> dict[int, float]:
    """Byte rate per real flow of every message (one global progressive filling)."""
    level: dict[int, float] = {}
    used = [0.0] * len(capacity)
    while len(level) < len(flows):
        open_ = [op for op in flows if op not in level]
        fills = []
        for p in range(len(capacity)):
            weight = sum(c for op in open_ for q, c in flows[op] if q == p)
            fills.append((capacity[p] - used[p]) / weight if weight else float("inf"))
        best = min(range(len(capacity)), key=fills.__getitem__)
        t = fills[best]
        for op in open_:
            if any(q == best for q, _ in flows[op]):
                level[op] = t
                for q, c in flows[op]:
                    used[q] += t * c
    return level


def _reference_ends(
    ready: list[float], loads: list[list[tuple[int, float]]], capacity: list[float]
) -> list[float]:
    """Finish times of messages ready at `ready` (unit = largest load), recomputing every
    rate from scratch at every event: the definition the incremental model must match."""
    left = {k: 1.0 for k in range(len(ready))}
    unit = [max(b for _, b in ls) for ls in loads]
    ends = [0.0] * len(ready)
    now, active = 0.0, set()
    while left:
        active |= {k for k in left if ready[k] <= now}
        flows = {k: [(p, b / unit[k]) for p, b in loads[k]] for k in active}
        rate = {k: lv / unit[k] for k, lv in _reference_max_min(flows, capacity).items()}
        nxt = min([ready[k] for k in left if k not in active] + [float("inf")])
        done = min([now + left[k] / rate[k] for k in active] + [float("inf")])
        step = min(nxt, done) - now
        for k in list(active):
            left[k] -= step * rate[k]
            if left[k] <= 1e-12:
                ends[k] = now + step
                del left[k]
                active.discard(k)
        now += step
    return ends


@pytest.mark.parametrize("seed", range(6))
def test_incremental_sharing_equals_global_recomputation(seed: int) -> None:
    """Random messages (1-3 ports each, uneven bytes, staggered ready times) on ports of
    different speeds: the engine's incremental, once-per-instant refilling gives the same
    finish times as recomputing every rate globally at every event."""
    import random

    rng = random.Random(seed)
    capacity = [rng.choice([1.0, 2.0, 4.0]) * BW for _ in range(6)]
    prog = Program(num_ranks=1, latency_s=0.0)
    ports = [prog.add_port(f"p{k}", c) for k, c in enumerate(capacity)]
    ready, loads, ops = [], [], []
    for k in range(14):
        ls = [(p, rng.choice([0.5, 1.0, 2.0]) * B) for p in rng.sample(ports, rng.randint(1, 3))]
        at = rng.choice([0.0, 0.0, T / 2, T, 1.7 * T])
        wait = prog.add(COMPUTE, 0, "fwd", at, "attn", f"wait{k}", [])
        ops.append(prog.add_xfer(0, 0, ls, f"m{k}", [wait]))
        ready.append(at)
        loads.append(ls)
    got = run_program(prog, share_compute=False)
    want = _reference_ends(ready, loads, capacity)
    assert [got.end[op] for op in ops] == pytest.approx(want, rel=1e-9)
