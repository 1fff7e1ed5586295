"""The forward-only AF-Pipe schedule of evaluation: generated, validated, compiled and
simulated like the training one (schedule/afpipe.py, semantics.py, validate.py)."""

from __future__ import annotations

import dataclasses

import pytest

from disagmoe.schedule.afpipe import build_afpipe, build_afpipe_rank
from disagmoe.schedule.ir import BACKWARD_KINDS, Instr, Op
from disagmoe.schedule.semantics import compile_ranks
from disagmoe.schedule.validate import ScheduleError, validate
from disagmoe.simulator import Network, Workload, simulate_schedule
from tests.unit.test_schedule import layout
from tests.unit.test_simulator import TINY, StageCosts, _layout


@pytest.mark.parametrize(
    ("p", "m", "n", "slots", "cap", "micro"),
    [(1, 2, 2, 4, 1, 0), (2, 1, 1, 3, 2, 0), (2, 2, 1, 3, 1, 5), (4, 1, 2, 2, 0, 0)],
)
def test_forward_only_is_the_training_forward(
    p: int, m: int, n: int, slots: int, cap: int, micro: int
) -> None:
    lay = layout(p, m, n, layers=4, dense=1 if p < 4 else 0)
    train = build_afpipe(lay, slots, cap, num_micro_batches=micro)
    fwd = build_afpipe(lay, slots, cap, forward_only=True, num_micro_batches=micro)
    assert fwd.name == "afpipe-forward" and fwd.max_in_flight == slots  # the cap cannot bind
    assert validate(fwd) == 0  # nothing is held in flight
    for rank, (a, b) in enumerate(zip(train.ranks, fwd.ranks, strict=True)):

        def forward_part(instrs: tuple[Instr, ...]) -> set[Instr]:
            return {
                i
                for i in instrs
                if i.op == Op.FWD or (i.msg is not None and i.msg.kind not in BACKWARD_KINDS)
            }

        assert set(b) == forward_part(a), rank
        assert not any(i.op in (Op.BWD, Op.SYNC, Op.STEP) for i in b)
        assert (
            build_afpipe_rank(lay, rank, slots, cap, forward_only=True, num_micro_batches=micro)
            == b
        )
    for prog in compile_ranks(fwd):
        assert prog.forward_only and not prog.finals
        assert not any(dep[0] == Op.BWD.value for deps in prog.local.values() for dep in deps)
    assert not any(prog.forward_only for prog in compile_ranks(train))


def test_validator_rejects_half_forward_only_lists() -> None:
    lay = layout(1, 2, 2)
    fwd = build_afpipe(lay, 2, forward_only=True)
    with_sync = dataclasses.replace(fwd, ranks=((*fwd.ranks[0], Instr(Op.SYNC)), *fwd.ranks[1:]))
    with pytest.raises(ScheduleError, match="rank 0: forward-only schedule has SYNC"):
        validate(with_sync)
    train = build_afpipe(lay, 2)
    no_bwd = tuple(i for i in train.ranks[1] if i.op != Op.BWD)
    mixed = dataclasses.replace(train, ranks=(train.ranks[0], no_bwd, *train.ranks[2:]))
    with pytest.raises(ScheduleError, match="rank 1: forwards and backwards differ"):
        validate(mixed)


def test_simulator_replays_the_forward_chain() -> None:
    """One slot, p = 2, L = 4: 2L+1 forward stages and 2L hops, nothing backward."""
    lay = _layout(TINY, 2)
    net = Network.single_node(1e30, 0.25, lay.world_size)  # bytes are free
    result = simulate_schedule(
        build_afpipe(lay, 1, forward_only=True),
        lay,
        StageCosts(1.0, 2.0, 4, head=1.0),
        Workload(TINY, 8, 1),
        net,
        sync=False,
    )
    assert result.step_time_s == pytest.approx(9 * 1.0 + 8 * 0.25)


def test_schedule_command_prints_it(capsys: pytest.CaptureFixture[str]) -> None:
    from disagmoe.cli import main

    assert main(["schedule", "--forward-only"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# schedule afpipe-forward: 4 ranks") and "peak in-flight 0" in out
    assert " B" not in out and "SYNC" not in out and "STEP" not in out
    assert main(["schedule", "--forward-only", "--rank", "1", "--validate"]) == 0
    out = capsys.readouterr().out
    assert "afpipe-forward: rank 1 of 4, built alone" in out and "equals its slice" in out
