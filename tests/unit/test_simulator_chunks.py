"""Exchange chunks in the simulator: a chunked expert compute and its messages priced at
their share, pipelined as a closed form says; the bound unchanged; auto picks the chunk
count deterministically; the simulate flag and the schedule command show it."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import pytest

from disagmoe.config import ModelConfig, ParallelConfig, RunConfig, ScheduleConfig, TrainConfig
from disagmoe.costs.compute import ComputeCosts, Linear
from disagmoe.distributed.layout import Layout
from disagmoe.presets import CLUSTER_PRESETS, MODEL_PRESETS
from disagmoe.schedule.afpipe import build_afpipe
from disagmoe.schedule.ir import Op
from disagmoe.simulate_cli import add_simulate_arguments, simulate_from_args
from disagmoe.simulator import Network, Workload, simulate_disagg, simulate_schedule
from disagmoe.simulator.choose import CHUNK_CANDIDATES, run_choice, run_order
from disagmoe.simulator.costs import MessageOverheads
from disagmoe.simulator.measured import MeasuredCosts

ONE_MOE = ModelConfig(num_layers=1)  # layer 0 (MoE) and the head, layer 1


@dataclass(frozen=True)
class FixedCosts:
    attn: float
    experts: float

    def compute_s(self, op: Op, comp: str, layer: int) -> float:
        return self.attn if comp == "A" else self.experts


def _one_slot(chunks: int, overheads: MessageOverheads | None = None) -> tuple[float, float, float]:
    """(step, dispatch seconds, combine seconds) of one forward-only slot of ONE_MOE, A and F
    on nodes of their own (one GPU per node), no latency: A0, then the dispatch / expert /
    combine pipeline of `chunks` chunks, then the head."""
    layout = Layout.build(ONE_MOE, ParallelConfig(groups=1, attn_workers=1, expert_workers=1))
    rate = 2e3  # bytes/s: dispatch ~4.7 s, combine ~4.1 s beside the 4 s expert compute
    net = Network(
        gpus_per_node=1, nics_per_node=1, nic_bytes_per_s=rate, nvlink_bytes_per_s=rate,
        latency_s=0.0,
    )  # fmt: skip
    workload = Workload(ONE_MOE, 64, 1)
    schedule = build_afpipe(layout, 1, forward_only=True, exchange_chunks=chunks)
    result = simulate_schedule(
        schedule, layout, FixedCosts(1.0, 4.0), workload, net, sync=False, share_compute=False,
        overheads=overheads,
    )  # fmt: skip
    d = workload.message_bytes("dispatch", 0, 1) / rate
    c = workload.message_bytes("combine", 0, 1) / rate
    return result.step_time_s, d, c


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_chunked_exchange_pipelines_as_a_flow_shop(chunks: int) -> None:
    """Dispatch, expert compute and combine of c equal chunks are a three-stage flow shop
    on separate resources (A's NIC out / F's NIC in, F's GPU, F's NIC out / A's NIC in):
    makespan = (D + F + C) / c + (c - 1) * max(D, F, C) / c, between A0 and the head."""
    step, d, c = _one_slot(chunks)
    f = 4.0
    assert max(d, c) > f / 2  # the links matter, so overlap shows
    expected = 1.0 + (d + f + c) / chunks + (chunks - 1) * max(d, f, c) / chunks + 1.0
    assert step == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_message_overheads_are_paid_per_chunk_message(chunks: int) -> None:
    """A host runtime pays its receive cost per message, chunk messages included: each
    chunk's dispatch and combine take `recv_s` on their receiver's stream, two more stages
    of the flow shop (`recv_s` each, not divided by c)."""
    recv = 0.5
    step, d, c = _one_slot(chunks, MessageOverheads(recv_s=recv))
    stages = (d / chunks, recv, 4.0 / chunks, c / chunks, recv)
    expected = 1.0 + sum(stages) + (chunks - 1) * max(stages) + 1.0
    assert step == pytest.approx(expected, rel=1e-9)


GPT_KW = dict(
    groups=1, attn_workers=32, expert_workers=32, seq_len=8192, micro_batch_size=1,
    num_micro_batches=64, max_in_flight=2,
)  # fmt: skip


def test_bound_counts_the_same_compute_and_bytes_at_any_chunk_count() -> None:
    """The analytic model prices a chunk at its share of the rows and bytes, so the step's
    total compute and traffic, and with them the bound, do not move with c."""
    model, cluster = MODEL_PRESETS["small"], CLUSTER_PRESETS["h800"]
    kw = dict(groups=1, attn_workers=4, expert_workers=4, seq_len=4096, micro_batch_size=1,
              num_micro_batches=16)  # fmt: skip
    results = {c: simulate_disagg(model, cluster, exchange_chunks=c, **kw) for c in (1, 2, 4)}
    base = results[1].bound
    assert base is not None and base.seconds > 0
    for c, r in results.items():
        assert r.config["exchange_chunks"] == c
        assert r.bound is not None
        assert r.bound.seconds == pytest.approx(base.seconds, rel=1e-9)
        assert r.bound.compute_s == pytest.approx(base.compute_s, rel=1e-9)
        assert r.bound.network_s == pytest.approx(base.network_s, rel=1e-9)
        assert r.breakdown["ffn"] == pytest.approx(results[1].breakdown["ffn"], rel=1e-9)


def test_reduced_replay_equals_full_replay_with_chunks() -> None:
    """Without the gradient buckets, whose ring's hops leave a node for some replicas and
    not others (test_simulator.py, `test_reduced_replay_equals_full_replay_under_fair_links`)."""
    model, cluster = MODEL_PRESETS["small"], CLUSTER_PRESETS["h800"]
    kw = dict(groups=1, attn_workers=8, expert_workers=8, seq_len=4096, micro_batch_size=1,
              num_micro_batches=16, exchange_chunks=2, overlap_sync=False)  # fmt: skip
    full = simulate_disagg(model, cluster, reduce=False, **kw)
    reduced = simulate_disagg(model, cluster, reduce=True, **kw)
    assert reduced.config["reduced"] and not full.config["reduced"]
    assert reduced.step_time_s == pytest.approx(full.step_time_s, rel=1e-9)


def test_measured_costs_pay_their_fixed_cost_per_chunk() -> None:
    units = ComputeCosts(Linear(0.0, 1e-6), Linear(0.0, 2e-6), Linear(0.01, 1e-6),
                         Linear(0.02, 2e-6))  # fmt: skip
    costs = MeasuredCosts(units).bound_to(Workload(MODEL_PRESETS["small"], 1024, 1), 2, 2, "none")
    whole = costs.compute_s(Op.FWD, "F", 1)
    assert costs.chunk_s(Op.FWD, "F", 1, 4) == pytest.approx((whole - 0.01) / 4 + 0.01, rel=1e-3)


def _cfg(order: str, chunks: int) -> RunConfig:
    return RunConfig(
        model=MODEL_PRESETS["small"],
        schedule=ScheduleConfig(order=order, exchange_chunks=chunks),
        parallel=ParallelConfig(groups=1, attn_workers=2, expert_workers=2),
        train=TrainConfig(seq_len=512, global_batch_size=8, micro_batch_size=1),
    )


def test_auto_picks_the_chunk_count_deterministically() -> None:
    cfg = _cfg("auto", 0)
    layout = Layout.build(cfg.model, cfg.parallel)
    run_choice.cache_clear()
    first, _ = run_choice(cfg, layout, 4, 0)
    run_choice.cache_clear()
    again, _ = run_choice(cfg, layout, 4, 0)
    assert first == again
    tried = {k for _, _, k, _, _ in first.steps}
    assert tried == set(CHUNK_CANDIDATES) and len(first.steps) == 6 * len(CHUNK_CANDIDATES)
    best = min(t for _, _, _, t, _ in first.steps)
    assert first.step_s == best
    # ties go to the fewest chunks: the chosen count is the smallest reaching the best step
    assert first.exchange_chunks == min(k for _, _, k, t, _ in first.steps if t == best)
    order, _, chunks, split = run_order(cfg, layout, 4, 0)
    assert (order, chunks, split) == (first.order, first.exchange_chunks, False)
    # an explicit count is taken as given, without a replay; auto (0) is the default
    assert run_order(_cfg("breadth", 2), layout, 4, 0) == ("breadth", None, 2, False)
    assert ScheduleConfig().exchange_chunks == 0
    # an explicit order with chunks 0: the chunk count is chosen for that order alone
    fixed, _ = run_choice(_cfg("depth", 0), layout, 4, 0)
    assert {(o, c) for o, c, _, _, _ in fixed.steps} == {("depth", False)}
    assert fixed.order == "depth" and fixed.exchange_chunks in CHUNK_CANDIDATES


def test_config_takes_zero_as_auto_and_rejects_negatives() -> None:
    assert ScheduleConfig(exchange_chunks=0).exchange_chunks == 0
    with pytest.raises(ValueError, match="0 \\(auto picks\\)"):
        ScheduleConfig(exchange_chunks=-1)


def _args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_simulate_arguments(parser)
    return parser.parse_args(
        ["--model", "small", "--nodes", "1", "--seq-len", "1024", "--groups", "1",
         "--attn-workers", "4", "--expert-workers", "4", "--micro-batches", "8", *extra]
    )  # fmt: skip


def test_simulate_flag_and_json() -> None:
    whole = ("--split-backward", "off")
    plain = json.loads(simulate_from_args(_args("--exchange-chunks", "1", *whole)).to_json())
    assert plain["config"]["exchange_chunks"] == 1
    two = json.loads(simulate_from_args(_args("--exchange-chunks", "2", *whole)).to_json())
    assert two["config"]["exchange_chunks"] == 2
    assert two["bound_s"] == pytest.approx(plain["bound_s"], rel=1e-9)
    assert two["step_time_s"] != plain["step_time_s"]
    for bad in (["--exchange-chunks", "-1"], ["--exchange-chunks", "99"]):
        with pytest.raises(ValueError, match="exchange-chunks"):
            simulate_from_args(_args(*bad))


def test_simulate_picks_chunks_and_split_by_default() -> None:
    """`simulate`'s own defaults (`--exchange-chunks 0 --split-backward auto`): whole and
    split backwards each at the cap its memory admits, every chunk count replayed on the
    layout it runs, the fastest kept; an order given (here breadth, not simulate's auto) is
    the only one replayed."""
    breadth = ("--order", "breadth")
    auto = simulate_from_args(_args(*breadth)).to_dict()
    cfg = auto["config"]
    assert cfg["chunks_choice"] == "auto" and cfg["order"] == "breadth"
    assert {(s[0], s[1]) for s in cfg["auto_steps"]} == {("breadth", False)}
    steps = {s[2]: s[3] for s in cfg["auto_steps"]}
    assert set(steps) == set(CHUNK_CANDIDATES)
    search = cfg["recompute_search"]
    assert list(search) == ["none", "none, split backward"]  # no recompute fits: no full
    whole, split = (
        simulate_from_args(_args("--split-backward", w, *breadth)) for w in ("off", "on")
    )
    assert search == {
        "none": pytest.approx(whole.step_time_s, abs=1e-6),
        "none, split backward": pytest.approx(split.step_time_s, abs=1e-6),
    }
    assert auto["step_time_s"] == min(whole.step_time_s, split.step_time_s)
    assert cfg["split_backward"] == (split.step_time_s < whole.step_time_s)
    ordered = simulate_from_args(_args()).config  # simulate's own --order auto as well
    assert ordered["chunks_choice"] == "auto" and len(ordered["order_search"]) == 6
    assert set(CHUNK_CANDIDATES) <= {s[2] for s in ordered["auto_steps"]}
    fixed = _args("--exchange-chunks", "1", "--split-backward", "off", "--runtime", "ep-1f1b")
    with pytest.raises(ValueError, match="--runtime disagg"):  # AF-Pipe's flags, given
        simulate_from_args(fixed)
    ep = _args("--runtime", "ep-1f1b", "--pp", "1", "--ep", "8")
    assert simulate_from_args(ep).runtime == "ep-1f1b"  # simulate's defaults pass for EP


def test_schedule_command_shows_the_chunks(capsys: pytest.CaptureFixture[str]) -> None:
    from disagmoe.cli import main

    assert main(["schedule", "--exchange-chunks", "2"]) == 0
    out = capsys.readouterr().out
    assert "FF l1 s0 c1" in out and "dispatch[l1,s0,c1]" in out
    assert "# order breadth, 2 exchange chunks: predicted optimizer step" in out
    assert main(["schedule", "--set", "schedule.exchange_chunks=0"]) == 0
    out = capsys.readouterr().out
    assert "# auto candidates (ms): breadth " in out and "breadth c4 " in out
