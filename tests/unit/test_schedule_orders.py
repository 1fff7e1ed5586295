"""AF-Pipe orders and the run's costs as generator inputs (schedule.orders, simulator.choose).

Every order, nominal or ordered with a run's costs, validates over random layouts and
its rank-local lists equal the global ones; with a slow link the costed order differs
from the nominal one and simulates faster; `auto` picks the shortest candidate, the
same on every call; "steady" under a cap interleaves forwards and backwards.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from disagmoe.config import ClusterConfig
from disagmoe.distributed.layout import Layout
from disagmoe.presets import MODEL_PRESETS
from disagmoe.schedule.afpipe import build_afpipe, build_afpipe_rank
from disagmoe.schedule.ir import Op
from disagmoe.schedule.orders import GENERATED_ORDERS, PortLoads, ScheduleCosts, priority
from disagmoe.schedule.validate import validate
from disagmoe.simulator import AnalyticCosts, Network, Workload
from disagmoe.simulator.choose import CANDIDATES, choose_order, schedule_costs
from disagmoe.simulator.disagg import simulate_disagg

from .test_schedule import CONFIGS, layout

SLOW = ClusterConfig(
    name="slow", gpus_per_node=1, nics_per_node=1, nic_gbps=0.05 / 8, nvlink_gbps=1.5,
    peak_tflops=0.02, gpu_mem_gib=8.0, mfu=0.5, bw_efficiency=0.94, latency_us=100.0,
)  # fmt: skip


def run_costs(lay: Layout, micro: int) -> tuple[AnalyticCosts, Workload, Network, ScheduleCosts]:
    model = dataclasses.replace(
        MODEL_PRESETS["tiny"],
        num_layers=lay.num_layers,
        num_dense_layers=min(lay.moe_layers),
    )
    workload = Workload(model, 128, 2)
    costs = AnalyticCosts.for_cluster(workload, SLOW, lay.attn_workers, lay.expert_workers)
    net = Network.from_cluster(SLOW)
    return costs, workload, net, schedule_costs(lay, micro, costs, workload, net)


@pytest.mark.parametrize("order", GENERATED_ORDERS)
def test_every_order_validates_nominal_and_costed_and_rank_lists_match(order: str) -> None:
    for p, m, n, layers, slots, cap, dense in random.Random(7).sample(CONFIGS, 25):
        lay = layout(p, m, n, layers, dense)
        priced = run_costs(lay, slots * m)[3]
        for costs in (None, priced):
            sched = build_afpipe(lay, slots, cap, order, costs=costs)
            assert 1 <= validate(sched) <= (cap or slots), (p, m, n, layers, slots, cap)
            for rank in range(lay.world_size):
                local = build_afpipe_rank(lay, rank, slots, cap, order, costs=costs)
                assert local == sched.ranks[rank], (order, p, m, n, slots, cap, rank)


def test_uneven_micro_batches_costed_orders_validate() -> None:
    lay = layout(2, 3, 2)
    priced = run_costs(lay, 7)[3]
    for order in GENERATED_ORDERS:
        sched = build_afpipe(lay, 3, 2, order, num_micro_batches=7, costs=priced)
        assert 1 <= validate(sched) <= 2
        assert (
            build_afpipe_rank(lay, 4, 3, 2, order, num_micro_batches=7, costs=priced)
            == (sched.ranks[4])
        )


def test_slow_link_costed_order_differs_and_simulates_faster() -> None:
    model = MODEL_PRESETS["tiny"]
    kw = dict(groups=2, attn_workers=2, expert_workers=1, seq_len=128, micro_batch_size=2)
    nominal = simulate_disagg(model, SLOW, num_micro_batches=16, order="depth", **kw)  # type: ignore[arg-type]
    costed = simulate_disagg(
        model,
        SLOW,
        num_micro_batches=16,
        order="depth",
        costed=True,
        **kw,  # type: ignore[arg-type]
    )
    assert costed.step_time_s < 0.9 * nominal.step_time_s
    lay = layout(2, 2, 1, model.num_layers)
    priced = run_costs(lay, 16)[3]
    assert (
        build_afpipe(lay, 8, 0, "depth", costs=priced).ranks
        != build_afpipe(lay, 8, 0, "depth").ranks
    )


def test_auto_picks_the_shortest_candidate_deterministically() -> None:
    lay = layout(2, 2, 1, MODEL_PRESETS["tiny"].num_layers)
    costs, workload, net, _ = run_costs(lay, 16)
    first, _ = choose_order(lay, 8, 2, 16, costs, workload, net)
    again, _ = choose_order(lay, 8, 2, 16, costs, workload, net)
    assert (first.order, first.costed, first.steps) == (again.order, again.costed, again.steps)
    assert [(o, c) for o, c, k, _, _ in first.steps] == list(CANDIDATES)
    assert {k for _, _, k, _, _ in first.steps} == {1} and first.exchange_chunks == 1
    assert first.step_s == min(t for _, _, _, t, _ in first.steps) and first.bound_s > 0
    auto = simulate_disagg(
        MODEL_PRESETS["tiny"], SLOW, groups=2, attn_workers=2, expert_workers=1, seq_len=128,
        micro_batch_size=2, num_micro_batches=16, max_in_flight=2, order="auto", reduce=True,
    )  # fmt: skip
    assert auto.config["order"] == first.order and auto.config["costed"] == first.costed
    assert auto.step_time_s == pytest.approx(first.step_s)


def test_steady_prefers_backward_and_interleaves_under_a_cap() -> None:
    assert priority("steady", Op.BWD, 3, 5) < priority("steady", Op.FWD, 0, 0)
    assert priority("breadth", Op.FWD, 3, 5) < priority("breadth", Op.BWD, 3, 0)
    lay = layout(1, 1, 1)
    sched = build_afpipe(lay, 6, 2, "steady")
    assert validate(sched) <= 2
    computes = [i for i in sched.ranks[lay.attn_rank(0, 0)] if i.op in (Op.FWD, Op.BWD)]
    last_fwd = max(k for k, i in enumerate(computes) if i.op == Op.FWD)
    first_bwd = min(k for k, i in enumerate(computes) if i.op == Op.BWD)
    assert first_bwd < last_fwd  # a backward runs before the last forward: 1F1B, not GPipe


def test_schedule_command_prints_the_order_and_its_predicted_step(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from disagmoe.cli import main

    assert (
        main(["schedule", "--set", "schedule.order=auto", "--set", "schedule.max_in_flight=2"]) == 0
    )
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("# order "))
    assert "predicted optimizer step" in line and "bound" in line and "step/bound" in line
    assert "# auto candidates (ms): breadth " in out and "steady+costs" in out
    assert main(["schedule", "--set", "schedule.order=steady", "--set", "schedule.costs=run"]) == 0
    out = capsys.readouterr().out
    assert "# order steady (run costs): predicted optimizer step" in out


def test_any_costs_give_valid_lists() -> None:
    """Property: random compute seconds, random port loads (ports shared between a
    rank's messages), shared or separate compute lanes — every order validates and the
    rank-local lists still equal the global ones."""
    rng = random.Random(3)
    for p, m, n, layers, slots, cap, dense in rng.sample(CONFIGS, 20):
        lay = layout(p, m, n, layers, dense)
        salt = rng.random()

        def compute_s(op: Op, comp: str, layer: int, salt: float = salt) -> float:
            return random.Random(f"{salt} {op.value} {comp} {layer}").uniform(0.1, 3.0)

        def ports(kind: str, layer: int, src: int, dst: int, salt: float = salt) -> PortLoads:
            r = random.Random(f"{salt} {kind} {layer} {src} {dst}")
            return ((f"out{src}", r.uniform(0.0, 2.0)), (f"in{dst}", r.uniform(0.0, 2.0)))

        for shared in (True, False):
            costs = ScheduleCosts(compute_s, ports, rng.uniform(0.0, 1.0), shared_compute=shared)
            for order in GENERATED_ORDERS:
                sched = build_afpipe(lay, slots, cap, order, costs=costs)
                assert 1 <= validate(sched) <= (cap or slots), (p, m, n, slots, cap, order)
                rank = rng.randrange(lay.world_size)
                assert (
                    build_afpipe_rank(lay, rank, slots, cap, order, costs=costs)
                    == (sched.ranks[rank])
                )


def test_planner_options_take_an_order() -> None:
    from disagmoe.planner.plan import PlanOptions

    assert PlanOptions(order="auto").order == "auto"
    with pytest.raises(ValueError, match="order must be one of"):
        PlanOptions(order="sideways")


def test_config_orders_are_the_generated_ones_and_auto() -> None:
    from disagmoe.config import SCHEDULE_ORDERS

    assert (*GENERATED_ORDERS, "auto") == SCHEDULE_ORDERS


_CHOICE = """
from disagmoe.config import ParallelConfig, RunConfig, ScheduleConfig, TrainConfig
from disagmoe.distributed.layout import Layout
from disagmoe.presets import MODEL_PRESETS
from disagmoe.simulator.choose import run_choice
cfg = RunConfig(model=MODEL_PRESETS["tiny"], schedule=ScheduleConfig(order="auto"),
                parallel=ParallelConfig(groups=2, attn_workers=2, expert_workers=1),
                train=TrainConfig(seq_len=32, global_batch_size=16, micro_batch_size=2))
layout = Layout.build(cfg.model, cfg.parallel)
print(repr(run_choice(cfg, layout, 4, 2)[0]))
"""


def test_auto_is_the_same_in_every_process() -> None:
    """Ranks are processes with their own string-hash seeds: the choice must not depend
    on one (two interpreters with different PYTHONHASHSEED print the same choice)."""
    import os
    import subprocess
    import sys

    outs = {
        subprocess.run(
            [sys.executable, "-c", _CHOICE],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1 and "OrderChoice(" in outs.pop()
