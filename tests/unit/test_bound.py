"""The step-time lower bound: closed forms on small programs, and never above a simulated step."""

from __future__ import annotations

import pytest

from disagmoe.presets import CLUSTER_PRESETS, MODEL_PRESETS
from disagmoe.simulator import simulate_disagg, simulate_ep
from disagmoe.simulator.bound import program_bound, worker_bound
from disagmoe.simulator.engine import A2A, COMPUTE, DELAY, Program, run_program


def _two_ranks() -> Program:
    """Rank 0 computes 3 s, sends 8 GB over a 4 GB/s port pair to rank 1, which computes 1 s;
    rank 1 also runs a 0.5 s all-to-all; both then run a 0.25 s optimizer step."""
    prog = Program(num_ranks=2)
    out, inn = prog.add_port("nic_out0", 4e9), prog.add_port("nic_in1", 4e9)
    c0 = prog.add(COMPUTE, 0, "fwd", 3.0, "attn", "f", [])
    x = prog.add_xfer(0, 1, [(out, 8e9), (inn, 8e9)], "dispatch", [c0])
    c1 = prog.add(COMPUTE, 1, "fwd", 1.0, "ffn", "e", [x])
    a = prog.add(A2A, 1, "send", 0.5, "comm", "a2a", [c1])
    for rank, last in ((0, x), (1, a)):
        prog.add(DELAY, rank, "sync", 0.25, "other", "STEP", [last])
    return prog


def test_bound_of_a_small_program_is_its_closed_form() -> None:
    prog = _two_ranks()
    bound = program_bound(prog, names=["A", "F"])
    # rank 0: max(3 s compute, 2 s on its port) + 0.25 s; rank 1: max(1 s, 2 s port) + 0.25 s
    assert bound.seconds == pytest.approx(3.25)
    assert (bound.binding, bound.worker) == ("compute", "A")
    assert run_program(prog).makespan >= bound.seconds
    # a slower link makes the network bind, on either end of it
    prog.ports[0].bytes_per_s = 1e9
    bound = program_bound(prog)
    assert bound.seconds == pytest.approx(8.25)
    assert bound.binding == "network"
    assert run_program(prog).makespan >= bound.seconds


def test_cores_pool_and_serial_terms() -> None:
    # two ranks of 3 s compute on one shared core need 6 s; the pool term says so
    assert program_bound(_two_ranks(), cores=1).seconds == pytest.approx(4.0 + 0.25)
    b = worker_bound({0: 1.0}, {0: 0.5}, {0: 2.0})
    assert (b.seconds, b.binding) == (3.0, "serial")


@pytest.mark.parametrize("runtime", ["disagg", "ep-1f1b", "ep-overlap"])
def test_simulated_step_never_beats_its_bound(runtime: str) -> None:
    model, cluster = MODEL_PRESETS["small"], CLUSTER_PRESETS["h800"]
    common = dict(seq_len=2048, micro_batch_size=1, num_micro_batches=8)
    if runtime == "disagg":
        result = simulate_disagg(
            model, cluster, groups=2, attn_workers=2, expert_workers=2, **common
        )
    else:
        result = simulate_ep(runtime, model, cluster, gpus=8, pp=2, ep=4, **common)
    bound = result.bound
    assert bound is not None and bound.seconds > 0
    assert bound.seconds <= result.step_time_s * (1 + 1e-9)
    out = result.to_dict()
    assert out["bound_s"] == bound.seconds and out["binding"] in ("compute", "network", "serial")


def _ev(pid: int, cat: str, name: str, ts: float, dur: float, **args: object) -> dict:
    return {"ph": "X", "pid": pid, "cat": cat, "name": name, "ts": ts, "dur": dur,
            "args": {"step": 0, **args}}  # fmt: skip


def test_trace_bound_counts_cross_node_bytes_per_direction() -> None:
    """Ranks 0, 1 on node 0 and 2, 3 on node 1 (1 MB/s NICs). Node 0 sends 3 MB to node 1
    (a message, an all-to-all split and a pipeline p2p) and 1 MB within itself; rank 2's
    4 s of compute include a 1 s blocking all-to-all wait; its STEP takes 0.5 s."""
    from disagmoe.bench.bound import trace_bound

    events = [
        _ev(0, "send", "send dispatch", 0, 10, dst=2, bytes=1e6),
        _ev(0, "send", "send dispatch", 0, 10, dst=1, bytes=1e6),  # inside node 0
        _ev(1, "send", "a2a", 0, 10, peers=[0, 1, 2, 3], peer_bytes=[5, 0, 1e6, 0]),
        _ev(1, "send", "send act", 0, 10, peers=[3], peer_bytes=[1e6]),
        _ev(2, "fwd", "FA l0 s0", 0, 4e6),
        _ev(2, "send", "a2a", 1e6, 1e6, blocking=True, peers=[2, 3], peer_bytes=[0, 0]),
        _ev(2, "sync", "STEP", 4e6, 0.5e6),
    ]
    bound = trace_bound(events, {0: 10.0}, lambda r: r // 2, [1e6, 1e6])
    # node 0 egress = node 1 ingress = 3 MB + 5 B at 1 MB/s; rank 2: 3 s compute + 0.5 s
    assert bound.network_s == pytest.approx(3.0, rel=1e-5)
    assert bound.seconds == pytest.approx(3.0 + 0.5, rel=1e-5)
    assert (bound.binding, bound.worker) == ("compute", "rank 2")
    # a gradient all-reduce over ranks 0 and 2 (ring): each sends 2 (g-1)/g * 2 MB = 2 MB
    events += [_ev(r, "sync", "SYNC grads", 5e6, 1e3, bytes=2e6, peers=[0, 2]) for r in (0, 2)]
    bound = trace_bound(events, {0: 10.0}, lambda r: r // 2, [1e6, 1e6])
    assert bound.seconds == pytest.approx(5.0 + 0.5, rel=1e-5)
    assert bound.binding == "network"


def test_trace_bound_and_tail_with_the_all_reduce_in_buckets() -> None:
    """The overlapped all-reduce (`runtime.grad_sync`): per-layer bucket events on the sync
    lane carry the bytes (the SYNC event none) and count as one flat all-reduce of their
    sum would."""
    from disagmoe.bench.bound import trace_bound

    flat = [_ev(r, "sync", "SYNC grads", 5e6, 1e3, bytes=2e6, peers=[0, 2]) for r in (0, 2)]
    buckets = [
        _ev(r, "sync", f"allreduce l{l}", 1e6 * l, 0.9e6, layer=l, bytes=b, peers=[0, 2])
        for r in (0, 2)
        for l, b in ((1, 1.5e6), (0, 0.5e6))
    ] + [_ev(r, "sync", "SYNC grads", 5e6, 1e3, bytes=0) for r in (0, 2)]
    steps = {0: 10.0}
    a = trace_bound(flat, steps, lambda r: r // 2, [1e6, 1e6])
    b = trace_bound(buckets, steps, lambda r: r // 2, [1e6, 1e6])
    assert a.network_s == pytest.approx(2.0) and b.network_s == pytest.approx(a.network_s)


def test_trace_bound_takes_the_least_step_and_adds_a_pipelines_fill() -> None:
    """A 3-stage pipeline, one rank each, two micro-batches: forwards of 1, 2, 3 s and
    backwards (B) of 2, 4, 6 s on stages 0, 1, 2 (the second micro-batch's forward on
    stage 1 slower: the fill takes each stage's least). STEP is 0.5 s on the last rank to
    finish (rank 0) and 3 s on rank 2, which waits in it. Rank 2's first stage is 2: its
    compute (18 s) waits for stages 0 and 1 to forward one micro-batch (3 s) and is
    followed by their input gradients (6 s)."""
    from disagmoe.bench.bound import pipeline_fill, trace_bound

    events = []
    for stage, (f, b) in enumerate(((1, 2), (2, 4), (3, 6))):
        t = 0.0  # one after another on the rank
        for what, mb, s in (("F", 0, f), ("F", 1, f), ("B", 0, b), ("B", 1, b)):
            s *= 1.5 if (what, stage, mb) == ("F", 1, 1) else 1.0
            cat = "fwd" if what == "F" else "bwd"
            events.append(_ev(stage, cat, f"{what} s{stage} mb{mb}", t, s * 1e6,
                              stage=stage, micro_batch=mb))  # fmt: skip
            t += s * 1e6
    events += [_ev(0, "sync", "STEP", 30e6, 0.5e6), _ev(2, "sync", "STEP", 30e6, 3e6)]
    events += [_ev(1, "sync", "STEP", 30e6, 2e6)]
    assert pipeline_fill(events) == {0: (0.0, 0.0), 1: (1.0, 2.0), 2: (3.0, 6.0)}
    steps, node = {0: 40.0}, (lambda r: 0)
    plain = trace_bound(events, steps, node, [1e9])
    # rank 2: 2 * (3 + 6) s compute + the least STEP, 0.5 s (not its own 3 s)
    assert plain.seconds == pytest.approx(18.5) and plain.worker == "rank 2"
    filled = trace_bound(events, steps, node, [1e9], fill=True)
    assert filled.seconds == pytest.approx(3.0 + 18.0 + 6.0)  # the drain outlasts STEP
    # a weight gradient (W) is not on the drain's path; an input gradient (I) is
    split = [e for e in events if not (e["pid"] == 0 and e["cat"] == "bwd")]
    for mb in (0, 1):  # one after another
        t = (9 + 2 * mb) * 1e6
        split.append(_ev(0, "bwd", f"I s0 mb{mb}", t, 0.5e6, stage=0, micro_batch=mb))
        split.append(_ev(0, "bwd", f"W s0 mb{mb}", t + 0.5e6, 1.5e6, stage=0, micro_batch=mb))
    assert pipeline_fill(split)[2] == (3.0, 4.5)


def test_the_fill_counts_each_hand_over_between_nodes() -> None:
    """The fill of a 3-stage pipeline (one stage per rank and node) waits for each
    hand-over as one message alone on the sending node's NIC: activations of 1 and 2 MB
    at 1 MB/s forward, input gradients of 1 MB back. Inside one node they cost nothing."""
    from disagmoe.bench.bound import pipeline_fill, trace_bound

    events = []
    for stage, (f, b) in enumerate(((1, 2), (2, 4), (3, 6))):
        events.append(_ev(stage, "fwd", f"F s{stage} mb0", 0.0, f * 1e6, stage=stage))
        events.append(_ev(stage, "bwd", f"B s{stage} mb0", 50e6, b * 1e6, stage=stage))
    sends = (("act", 0, 1, 1e6), ("act", 1, 2, 2e6), ("grad", 2, 1, 1e6), ("grad", 1, 0, 1e6))
    for kind, stage, dst, nbytes in sends:
        events.append(_ev(stage, "send", f"send {kind} s{stage} mb0", 10e6, 1e3, stage=stage,
                          bytes=nbytes, peers=[dst], peer_bytes=[nbytes]))  # fmt: skip
    apart = trace_bound(events, {0: 99.0}, lambda r: r, [1e6] * 3, fill=True)
    together = trace_bound(events, {0: 99.0}, lambda r: 0, [1e6], fill=True)
    # rank 2: head 1 + 1 + 2 + 2, compute 3 + 6, tail 2 + 1 + 4 + 1
    # (node 0's NIC says the same: its activation leaves after 1 s, takes 1 s, and the
    # rest of the micro-batch takes 21 s after it)
    assert apart.seconds == pytest.approx(6.0 + 9.0 + 8.0)
    assert together.seconds == pytest.approx(3.0 + 9.0 + 6.0)
    assert pipeline_fill(events)[2] == (3.0, 6.0)  # no hop given: transfers left out


def test_the_fill_keeps_a_nic_idle_before_its_first_hand_over_and_after_its_last() -> None:
    """3 stages, one per node (1 MB/s NICs), two micro-batches: forwards of 1 s and
    backwards of 2 s per stage, activations of 10 MB, input gradients of 1 MB. Node 0's
    NIC sends 20 MB, from the end of the first forward (1 s) on; after the second
    activation arrives, stage 1 forwards, sends it on (10 s), stage 2 forwards, and all
    three run the backward with its two hand-overs (9 s): 1 + 20 + 20 = 41 s, where the
    busiest NIC direction alone says 22 s (node 1: 20 + 2 MB out). Each set of a NIC's
    kinds of traffic fits in their windows: node 1 sends activations (from 12 s, 9 s after
    the last) and gradients (from 28 s, 2 s after): the activations alone say 41 s."""
    from disagmoe.bench.bound import _network_fills, hand_over_windows, trace_bound

    events = []
    for stage in range(3):
        for mb in (0, 1):
            events.append(_ev(stage, "fwd", f"F s{stage} mb{mb}", mb * 1e6, 1e6, stage=stage))
            events.append(_ev(stage, "bwd", f"B s{stage} mb{mb}", 60e6 + mb * 2e6, 2e6,
                              stage=stage))  # fmt: skip
            sends = [("act", stage + 1, 10e6)] if stage < 2 else []
            sends += [("grad", stage - 1, 1e6)] if stage > 0 else []
            for kind, dst, nbytes in sends:
                events.append(_ev(stage, "send", f"send {kind} s{stage} mb{mb}", 30e6, 1e3,
                                  stage=stage, peers=[dst], peer_bytes=[nbytes]))  # fmt: skip
    node, rates = (lambda r: r), [1e6] * 3
    hop = lambda e: sum(e["args"]["peer_bytes"]) / 1e6  # noqa: E731
    windows = hand_over_windows(events, hop)
    assert windows["act", 0] == pytest.approx((1.0, 1 + 10 + 1 + 6 + 2))
    assert windows["act", 1] == pytest.approx((1 + 10 + 1, 1 + 6 + 2))
    assert windows["grad", 2] == pytest.approx((3 + 20 + 2, 1 + 2 + 2))
    assert windows["grad", 1] == pytest.approx((3 + 20 + 4 + 1, 2.0))
    nic = _network_fills(events, node, hop, rates)
    assert nic[0, "out"] == pytest.approx(1 + 20 + 20)
    assert nic[0, "in"] == pytest.approx(28 + 2 + 2)
    assert nic[1, "out"] == pytest.approx(12 + 20 + 9)  # both kinds: 12 + 22 + 2
    plain = trace_bound(events, {0: 99.0}, node, rates)
    assert plain.seconds == pytest.approx(22.0) and plain.binding == "network"
    filled = trace_bound(events, {0: 99.0}, node, rates, fill=True)
    assert filled.seconds == pytest.approx(41.0) and filled.worker == "rank 0"
    # an all-to-all beside the hand-overs can start and end anywhere: with it the NIC has
    # no idle time, without it the hand-overs keep their windows
    events.append(_ev(0, "send", "send dispatch", 0, 10, peers=[1], peer_bytes=[30e6]))
    assert _network_fills(events, node, hop, rates)[0, "out"] == pytest.approx(50.0)


def test_the_fill_bound_waits_for_the_buckets_the_final_backward_completes() -> None:
    """Data-parallel replicas of one stage, on different nodes (1 MB/s NICs), each with a
    3 s forward and backward, all-reduce per-layer buckets over the pair (a ring of two:
    each sends the bucket once). Layer 1's bucket may overlap the backward; layer 0's, the
    embedding's and layer 0's expert shard's (2 MB) start only when it ends. A weight
    gradient of another stage (W s1) need not precede them."""
    from disagmoe.bench.bound import last_buckets, trace_bound

    def replica(rank: int, peer: int) -> list[dict]:
        out = [_ev(rank, "fwd", "F s0 mb0", 0, 1e6, stage=0),
               _ev(rank, "bwd", "B s0 mb0", 1e6, 2e6, stage=0)]  # fmt: skip
        for name, nbytes in (("l1", 0.0), ("l0", 1e6), ("embed", 0.5e6), ("l0 experts", 0.5e6)):
            out.append(_ev(rank, "sync", f"allreduce s0 {name}", 3e6, 1e3, bytes=nbytes,
                           peers=sorted((rank, peer))))  # fmt: skip
        return [*out, _ev(rank, "sync", "STEP", 6e6, 0.5e6)]

    events = replica(0, 1) + replica(1, 0) + [_ev(0, "bwd", "W s1 mb0", 3e6, 1e6, stage=1)]
    last, stage = last_buckets([e for e in events if e["pid"] == 0])
    assert stage == 0 and sorted(e["name"] for e in last) == [
        "allreduce s0 embed", "allreduce s0 l0", "allreduce s0 l0 experts"]  # fmt: skip
    apart = {0: 9.0}, (lambda r: r), [1e6, 1e6]
    assert trace_bound(events, *apart).seconds == pytest.approx(4.0 + 0.5)  # rank 0's W
    # rank 0: 3 s before its last buckets, then 2 MB at 1 MB/s, then STEP
    assert trace_bound(events, *apart, fill=True).seconds == pytest.approx(3.0 + 2.0 + 0.5)
    # two replicas on each of two nodes: a node's NIC carries both ranks' last buckets
    four = replica(0, 2) + replica(2, 0) + replica(1, 3) + replica(3, 1)
    paired = trace_bound(four, {0: 9.0}, lambda r: r // 2, [1e6, 1e6], fill=True)
    assert paired.seconds == pytest.approx(3.0 + 4.0 + 0.5)
    # AF-Pipe's attention replicas: no stage; layer 0's bucket holds the embedding
    af = [_ev(0, "sync", f"allreduce l{l}", 0, 1, bytes=1, peers=[0, 1]) for l in (2, 1, 0)]
    assert [e["name"] for e in last_buckets(af)[0]] == ["allreduce l0"]


def test_the_fill_bound_starts_a_stages_buckets_with_its_last_backward() -> None:
    """One stage, no pipeline above it (`pp 1`), two micro-batches of a 1 s forward and a
    2 s backward on each of two replicas on different nodes (1 MB/s NICs). Every bucket of
    the stage is final only in the last backward (the one that ran alone), which cannot
    start before the other three computations have run (4 s: the first backward and the
    second forward take turns on the device): the 3 MB bucket of layer 1 and the 0.5 MB of
    layer 0 need 3.5 s of the NIC from then on, more than the 0.5 s of layer 0's bucket
    after every computation (`last_buckets`)."""
    from disagmoe.bench.bound import trace_bound

    def replica(rank: int, peer: int) -> list[dict]:
        out = [_ev(rank, "fwd", "F s0 mb0", 0, 1e6, stage=0),
               _ev(rank, "fwd", "F s0 mb1", 1e6, 2e6, stage=0),
               _ev(rank, "bwd", "B s0 mb0", 1e6, 3e6, stage=0),
               _ev(rank, "bwd", "B s0 mb1", 4e6, 2e6, stage=0)]  # fmt: skip
        for name, nbytes in (("l1", 3e6), ("l0", 0.5e6)):
            out.append(_ev(rank, "sync", f"allreduce s0 {name}", 4e6, 1e3, bytes=nbytes,
                           peers=sorted((rank, peer))))  # fmt: skip
        return [*out, _ev(rank, "sync", "STEP", 9e6, 0.5e6)]

    events = replica(0, 1) + replica(1, 0)
    apart = {0: 10.0}, (lambda r: r), [1e6, 1e6]
    # compute 6 s (the pair's 3 s span holds both halves), less the last backward (2 s)
    assert trace_bound(events, *apart, fill=True).seconds == pytest.approx(4.0 + 3.5 + 0.5)


def test_the_fill_counts_only_what_a_computation_ran_alone() -> None:
    """Two computations of one rank in flight at once take turns on its device, so each
    span holds some of the other's work: a stage's forward is the least of its runs with
    the device to themselves, or where it has none, the least of its time alone. Stage 0's
    forwards of 2 s each, the second beside a 3 s backward for its last 1.5 s: 2 s (the
    first ran alone); stage 1 forwards only beside a backward (its span 4 s, 2.5 s of it
    alone); each backward runs 1.5 s of its 3 s alone."""
    from disagmoe.bench.bound import pipeline_fill

    events = [
        _ev(0, "fwd", "F s0 mb0", 10e6, 2e6, stage=0),
        _ev(0, "fwd", "F s0 mb1", 0.0, 2e6, stage=0),
        _ev(0, "bwd", "B s0 mb0", 0.5e6, 3e6, stage=0),
        _ev(1, "fwd", "F s1 mb0", 0.0, 4e6, stage=1),
        _ev(1, "bwd", "B s1 mb0", 2.5e6, 3e6, stage=1),
        _ev(2, "fwd", "F s2 mb0", 20e6, 1e6, stage=2),
    ]
    # forwards: stage 0 2 s (alone), stage 1 2.5 s; backwards 1.5 s each
    assert pipeline_fill(events)[2] == pytest.approx((2.0 + 2.5, 1.5 + 1.5))


def test_the_last_buckets_wait_for_the_last_stage_and_the_drain_below_it() -> None:
    """3 stages, one rank each, on one node; forwards of 1 s and backwards of 2 s, two
    micro-batches. Stage 0's replica is on another node (1 MB/s NICs): its layer 0 bucket
    (1 MB) is final when its last backward ends, its layer 1 bucket (3 MB) once that
    backward has started. The last stage cannot start before 2 s (the fill) and computes
    6 s, then its last micro-batch's gradient goes down through stage 1 (2 s): stage 0's
    last backward runs from 10 s to 12 s at the earliest. So 12 + 1 s for layer 0's
    bucket, 10 + 4 s for both, then STEP (0.5 s): 14.5 s, where each rank's own work and
    fill say 12 s (the last stage: 2 + 6 + 4)."""
    from disagmoe.bench.bound import drains_from_above, trace_bound

    events = []
    for stage in range(3):
        t = 0.0
        for what, mb, s in (("F", 0, 1), ("F", 1, 1), ("B", 0, 2), ("B", 1, 2)):
            cat = "fwd" if what == "F" else "bwd"
            events.append(_ev(stage, cat, f"{what} s{stage} mb{mb}", t, s * 1e6, stage=stage))
            t += s * 1e6
            if what == "F" and stage < 2:
                events.append(_ev(stage, "send", f"send act s{stage} mb{mb}", t, 1e3,
                                  stage=stage, peers=[stage + 1], peer_bytes=[1e3]))  # fmt: skip
        events.append(_ev(stage, "sync", "STEP", 20e6, 0.5e6))
    for layer, nbytes in ((1, 3e6), (0, 1e6)):
        events.append(_ev(0, "sync", f"allreduce s0 l{layer}", 6e6, 1e3, bytes=nbytes,
                          peers=[0, 3]))  # fmt: skip
    node, rates = (lambda r: int(r == 3)), [1e6, 1e6]
    by_rank = {r: [e for e in events if e["pid"] == r] for r in range(3)}
    assert drains_from_above(events, by_rank) == {0: (10.0, 12.0), 1: (8.0, 10.0)}
    assert trace_bound(events, {0: 99.0}, node, rates, fill=True).seconds == pytest.approx(14.5)
    # a stage whose activations go to two ranks is no one pipeline (AF-Pipe's dispatch)
    events.append(_ev(0, "send", "send act s0 mb0", 1e6, 1e3, stage=0, peers=[4],
                      peer_bytes=[1e3]))  # fmt: skip
    assert 0 not in drains_from_above(events, by_rank)


def test_an_af_pipe_run_has_a_pipelines_fill() -> None:
    """AF-Pipe's layers as a pipeline: attention of layer l is stage 2l, its experts 2l + 1.
    An expert worker (rank 1, nodes of one rank, 1 MB/s) cannot start before layer 0's
    attention (1 s) and its dispatch (1 MB: 1 s), and after its last backward the gradient
    goes back (1 s) and attention's backward runs (2 s)."""
    from disagmoe.bench.bound import pipeline_fill, trace_bound
    from disagmoe.bench.stage_view import stage_view

    events = [
        _ev(0, "fwd", "FA l0 s0", 0.0, 1e6, layer=0, slot=0),
        _ev(0, "send", "send dispatch l0 s0", 1e6, 1e3, dst=1, bytes=1e6),
        _ev(1, "fwd", "FF l0 s0", 2e6, 1e6, layer=0, slot=0),
        _ev(1, "send", "send combine l0 s0", 3e6, 1e3, dst=0, bytes=1e6),
        _ev(0, "fwd", "FA l1 s0", 4e6, 1e6, layer=1, slot=0),
        _ev(0, "bwd", "BA l1 s0", 5e6, 2e6, layer=1, slot=0),
        _ev(0, "send", "send grad_combine l0 s0", 7e6, 1e3, dst=1, bytes=1e6),
        _ev(1, "bwd", "BF l0 s0", 8e6, 2e6, layer=0, slot=0),
        _ev(1, "send", "send grad_dispatch l0 s0", 10e6, 1e3, dst=0, bytes=1e6),
        _ev(0, "bwd", "BA l0 s0", 11e6, 2e6, layer=0, slot=0),
    ]
    staged = stage_view(events)
    assert [e["name"] for e in staged][:4] == ["F s0 mb0", "send act s0 mb0", "F s1 mb0",
                                               "send act s1 mb0"]  # fmt: skip
    assert {e["name"] for e in staged if e["pid"] == 0 and e["cat"] == "send"} == {
        "send act s0 mb0", "send grad s2 mb0"}  # fmt: skip
    assert pipeline_fill(staged, lambda e: e["args"]["bytes"] / 1e6)[1] == (2.0, 3.0)
    node = lambda r: r  # noqa: E731
    plain = trace_bound(events, {0: 99.0}, node, [1e6, 1e6])
    filled = trace_bound(events, {0: 99.0}, node, [1e6, 1e6], fill=True)
    assert plain.seconds == pytest.approx(6.0)  # rank 0: 1 + 1 + 2 + 2 s of compute
    # rank 1's 3 s, filled, is 8 s; node 0's NIC says more: its dispatch leaves after
    # layer 0's attention (1 s), takes 1 s, and the rest of its micro-batch takes 11 s
    # after it: the whole chain of one micro-batch, 13 s
    assert filled.seconds == pytest.approx(1.0 + 1.0 + 11.0)
