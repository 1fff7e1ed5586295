"""Deferred weight gradients (`schedule.split_backward`): the lists, their rules, their prices,
the choice, the configuration, and the two-part backward (`runtime.wgrad`) against a whole
one. The runtime's exactness on real ranks: tests/distributed/test_disagg.py."""

from __future__ import annotations

import dataclasses
import os
import random
import sys
import threading

import pytest
import torch
from torch import nn

from disagmoe.config import RunConfig, ScheduleConfig, TrainConfig
from disagmoe.presets import MODEL_PRESETS
from disagmoe.runtime.lanes import BACKGROUND_NICE, Lane, StepState
from disagmoe.runtime.wgrad import backward_inputs, backward_weights
from disagmoe.schedule.afpipe import build_afpipe, build_afpipe_rank
from disagmoe.schedule.ir import Instr, Op, Schedule
from disagmoe.schedule.semantics import RankProgram, compute_kind
from disagmoe.schedule.sync import sync_buckets
from disagmoe.schedule.validate import ScheduleError, validate
from disagmoe.simulator.choose import choose_order, run_split_candidates
from disagmoe.simulator.disagg import simulate_disagg
from disagmoe.simulator.engine import COMPUTE
from disagmoe.simulator.replay import simulate_schedule

from .test_schedule import CONFIGS, layout
from .test_schedule_orders import SLOW, run_costs


@pytest.mark.parametrize("order", ["breadth", "depth", "steady"])
def test_split_lists_validate_pair_every_backward_and_match_rank_lists(order: str) -> None:
    for p, m, n, layers, slots, cap, dense in random.Random(3).sample(CONFIGS, 20):
        lay = layout(p, m, n, layers, dense)
        priced = run_costs(lay, slots * m)[3]
        for costs, chunks in ((None, 1), (priced, 2)):
            sched = build_afpipe(
                lay, slots, cap, order, costs=costs, exchange_chunks=chunks, split_backward=True
            )
            assert sched.meta["split_backward"] == 1
            assert 1 <= validate(sched) <= (cap or slots), (p, m, n, layers, slots, cap)
            for rank, instrs in enumerate(sched.ranks):
                backs = [i.task[1:] for i in instrs if i.op == Op.BWD]
                weights = [i.task[1:] for i in instrs if i.op == Op.WGT]
                assert sorted(backs) == sorted(weights), (rank, backs[:3], weights[:3])
                local = build_afpipe_rank(
                    lay, rank, slots, cap, order, costs=costs, exchange_chunks=chunks,
                    split_backward=True,
                )  # fmt: skip
                assert local == instrs, (order, p, m, n, slots, cap, rank)


def _one_rank(instrs: list[Instr]) -> Schedule:
    return Schedule("t", 1, 2, 2, ("A(g0,r0)",), (tuple(instrs),))


def test_the_validator_wants_a_w_after_its_backward_and_once() -> None:
    f, b, w = (Instr(op, "A", 0, 0) for op in (Op.FWD, Op.BWD, Op.WGT))
    validate(_one_rank([f, b, w]))
    with pytest.raises(ScheduleError, match="comes before its backward"):
        validate(_one_rank([f, w, b]))
    with pytest.raises(ScheduleError, match="appears twice"):
        validate(_one_rank([f, b, w, w]))


def test_a_slot_is_held_until_its_w_and_buckets_wait_for_the_ws() -> None:
    lay = layout(1, 1, 1, 2)
    sched = build_afpipe(lay, 3, 1, "steady", split_backward=True)
    prog = RankProgram.build(sched, lay.attn_rank(0, 0))
    # the cap, layer by layer: the forward of the rank's k-th lowest layer (0, 1, 2 = head)
    # of slot 1 waits for slot 0's W of its (k+1)-th highest (or its lowest), not the BWD
    for layer, gate in ((0, 1), (1, 0), (2, 0)):
        deps = prog.local[("F", "A", layer, 1, -1)]
        assert ("W", "A", gate, 0, -1) in deps and ("B", "A", gate, 0, -1) not in deps
    assert all(b.after[0] == "W" for b in sync_buckets(prog))
    bwd = next(ins for _, ins in prog.lanes["bwd"] if ins.op == Op.BWD)
    assert compute_kind(bwd, prog.split) == "I"
    whole = RankProgram.build(build_afpipe(lay, 3, 1, "steady"), lay.attn_rank(0, 0))
    assert compute_kind(bwd, whole.split) == "B" and not whole.split


def test_ws_run_on_their_own_background_lane_in_list_order() -> None:
    lay = layout(1, 2, 2, 3)
    sched = build_afpipe(lay, 3, 2, "breadth", split_backward=True)
    for rank, instrs in enumerate(sched.ranks):
        prog = RankProgram.build(sched, rank)
        assert all(ins.op == Op.WGT for _, ins in prog.lanes["wgt"])
        assert not any(ins.op == Op.WGT for _, ins in prog.lanes["bwd"])
        assert [ins for _, ins in prog.lanes["wgt"]] == [i for i in instrs if i.op == Op.WGT]
        assert {(i.comp, i.layer, i.slot) for i in instrs if i.op == Op.WGT} == prog.split
    # every W is a background compute of the replay, and no other compute is
    result = simulate_schedule(sched, lay, *run_costs(lay, 6)[:3])
    assert result.program is not None
    prog_ = result.program
    computes = [op for op, kind in enumerate(prog_.kind) if kind == COMPUTE]
    assert prog_.background == {op for op in computes if prog_.lane[op] == "wgt"}
    assert prog_.background and all(prog_.label[op].startswith("W") for op in prog_.background)


def test_overlapped_sync_wants_every_attention_backward_split_or_none() -> None:
    lay = layout(1, 1, 1, 2)
    sched = build_afpipe(lay, 2, 0, "breadth", split_backward=True)
    rank = lay.attn_rank(0, 0)
    instrs = sched.ranks[rank]
    drop = next(i for i in instrs if i.op == Op.WGT and i.comp == "A")
    partial = tuple(i for i in instrs if i is not drop)
    with pytest.raises(ValueError, match="needs all or none"):
        sync_buckets(RankProgram.compile(rank, partial, 0))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values")
def test_a_background_lane_thread_yields_the_cpu() -> None:
    """The "wgt" lane's thread runs at a higher nice value than its process's other threads."""
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: list[int] = []

    def body(st: StepState) -> None:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    lane = Lane("wgt", body, background=True)
    st = StepState(0, ("wgt",))
    lane.inbox.put(st)
    lane.inbox.put(None)
    lane.thread.join(10)
    assert seen == [min(19, before + BACKGROUND_NICE)] and not st.errors
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # its own only


def test_a_split_backward_costs_what_the_whole_one_costs() -> None:
    """The replay prices a BWD with a W at the rest of the backward: the same compute in
    all, on every rank (and attention layer 0's whole backward in its W)."""
    lay = layout(1, 2, 2, 4)
    costs, workload, net, _ = run_costs(lay, 8)
    busy = {}
    for split in (False, True):
        sched = build_afpipe(lay, 4, 0, "breadth", split_backward=split)
        result = simulate_schedule(sched, lay, costs, workload, net)
        busy[split] = sorted(round(w["busy_s"], 9) for w in result.workers)
    assert busy[True] == busy[False]
    assert costs.compute_s(Op.WGT, "A", 0) == costs.compute_s(Op.BWD, "A", 0)
    assert 0 < costs.compute_s(Op.WGT, "A", 1) < costs.compute_s(Op.BWD, "A", 1) / 2
    assert costs.compute_s(Op.WGT, "F", 1) == costs.compute_s(Op.FWD, "F", 1)


def test_auto_tries_both_and_the_simulator_takes_none_as_auto() -> None:
    lay = layout(1, 2, 2, 4)
    costs, workload, net, _ = run_costs(lay, 8)
    choice, _ = choose_order(lay, 4, 2, 8, costs, workload, net, splits=(False, True))
    assert {s[4] for s in choice.steps} == {False, True}
    assert choice.step_s == min(s[3] for s in choice.steps)
    model = dataclasses.replace(MODEL_PRESETS["tiny"], num_layers=4, num_dense_layers=0)
    auto = simulate_disagg(
        model, SLOW, groups=1, attn_workers=2, expert_workers=2, seq_len=128,
        micro_batch_size=2, num_micro_batches=8, max_in_flight=2, split_backward=None,
    )  # fmt: skip
    assert auto.config["split_choice"] == "auto"
    assert auto.config["split_backward"] == any(
        s[4] and s[3] == auto.step_time_s for s in auto.config["auto_steps"]
    )


def test_the_simulator_splits_no_backward_the_runtime_cannot() -> None:
    """Under recompute a run keeps its backwards whole: the replay refuses `on` and `auto`
    tries whole backwards only (so the planner never credits a split it cannot run)."""
    model = dataclasses.replace(MODEL_PRESETS["tiny"], num_layers=4, num_dense_layers=0)
    kw = dict(
        groups=1, attn_workers=2, expert_workers=2, seq_len=128, micro_batch_size=2,
        num_micro_batches=8, max_in_flight=2, recompute="full",
    )  # fmt: skip
    with pytest.raises(ValueError, match="cannot run with recompute full"):
        simulate_disagg(model, SLOW, split_backward=True, **kw)  # type: ignore[arg-type]
    auto = simulate_disagg(model, SLOW, split_backward=None, **kw)  # type: ignore[arg-type]
    assert not auto.config["split_backward"]
    assert not any(step[4] for step in auto.config["auto_steps"])


def test_config_refuses_a_split_it_cannot_run_and_auto_keeps_it_whole() -> None:
    on = ScheduleConfig(split_backward="on")
    with pytest.raises(ValueError, match="split_backward = on cannot run with train.recompute"):
        RunConfig(schedule=on, train=TrainConfig(recompute="attn"))
    with pytest.raises(ValueError, match="train.emulate_compute"):
        RunConfig(schedule=on, train=TrainConfig(emulate_compute="costs.json"))
    with pytest.raises(ValueError, match="split_backward must be one of off, on, auto"):
        ScheduleConfig(split_backward="yes")
    auto = ScheduleConfig(split_backward="auto")
    assert run_split_candidates(RunConfig(schedule=auto)) == (False, True)
    recomputing = RunConfig(schedule=auto, train=TrainConfig(recompute="full"))
    assert run_split_candidates(recomputing) == (False,)
    assert run_split_candidates(RunConfig()) == (False,)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 12)
        self.down = nn.Linear(12, 6, bias=False)
        self.norm = nn.LayerNorm(6)
        self.unused = nn.Linear(6, 6)  # in no graph: its gradient stays None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.silu(self.up(self.norm(x))))


def _grads(split: bool, with_input: bool) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
    torch.manual_seed(0)
    block = _Block().double()
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=with_input)
    y = block(x)
    loss = (y**2).sum()
    g = torch.randn_like(y)
    params = list(block.parameters())
    if split:
        deferred = backward_inputs([y, loss], [g, torch.ones_like(loss)], [x], params)
        assert all(p.grad is None for p in params)  # nothing but the input's gradient yet
        backward_weights(deferred)
    else:
        torch.autograd.backward([y, loss], [g, torch.ones_like(loss)])
    return [p.grad for p in params], x.grad


@pytest.mark.parametrize("with_input", [True, False])
def test_the_two_parts_give_the_whole_backwards_gradients(with_input: bool) -> None:
    """Input gradients first, weight gradients later: the values of one whole backward
    (float64, equal to the last bit); without an input, all of it is the second part."""
    whole, x_whole = _grads(False, with_input)
    split, x_split = _grads(True, with_input)
    assert (x_whole is None) == (x_split is None) == (not with_input)
    if x_whole is not None and x_split is not None:
        assert torch.equal(x_whole, x_split)
    for a, b in zip(whole, split, strict=True):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert torch.equal(a, b)
    assert whole[-1] is None  # the unused layer


def test_a_split_is_not_always_shorter_and_auto_then_keeps_backwards_whole() -> None:
    """On a network-bound step (the slow link, breadth, no in-flight cap) deferring weight
    gradients moves compute, not the binding links, and the replay is longer: auto keeps it
    whole."""
    model = dataclasses.replace(MODEL_PRESETS["tiny"], num_layers=4, num_dense_layers=0)
    kw = dict(
        groups=1, attn_workers=2, expert_workers=2, seq_len=128, micro_batch_size=2,
        num_micro_batches=8, max_in_flight=0, order="breadth",
    )  # fmt: skip
    whole = simulate_disagg(model, SLOW, **kw)  # type: ignore[arg-type]
    split = simulate_disagg(model, SLOW, split_backward=True, **kw)  # type: ignore[arg-type]
    assert split.config["split_backward"] and not whole.config["split_backward"]
    assert split.bound is not None and whole.bound is not None
    assert split.bound.seconds == pytest.approx(whole.bound.seconds, rel=1e-12)  # same work
    assert split.step_time_s > whole.step_time_s
    auto = simulate_disagg(model, SLOW, split_backward=None, **kw)  # type: ignore[arg-type]
    assert not auto.config["split_backward"]
    assert auto.step_time_s == pytest.approx(whole.step_time_s)
