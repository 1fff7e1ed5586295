"""`disagmoe.torch_private`: each private torch API we use still fits this torch, and the
check reports one that does not."""

from __future__ import annotations

import ast
import datetime
import inspect
import re
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

import disagmoe
from disagmoe import torch_private as tp
from disagmoe.baselines.stage import TracedStage

PACKAGE_DIR = Path(disagmoe.__file__).parent
PYPROJECT = PACKAGE_DIR.parents[1] / "pyproject.toml"
RUNTIME = "torch.distributed.pipelining.schedules._PipelineScheduleRuntime"


def test_pinned_version_is_pyprojects() -> None:
    pin = re.search(r'"torch==([^"]+)"', PYPROJECT.read_text())
    assert pin is not None, f"no torch== pin in {PYPROJECT}"
    assert pin.group(1) == tp.TORCH_PINNED, (
        f"pyproject pins torch {pin.group(1)}, torch_private.TORCH_PINNED says "
        f"{tp.TORCH_PINNED}: check the wrappers against the new version and update it"
    )


@pytest.mark.parametrize("name", [api.name for api in tp.PRIVATE_APIS])
def test_private_api_fits_this_torch(name: str) -> None:
    problems = tp.check_private_apis([name])
    assert not problems, "\n".join(problems)


def test_every_api_names_a_wrapper() -> None:
    missing = [a.name for a in tp.PRIVATE_APIS if not hasattr(tp, a.wrapper)]
    assert not missing, f"PRIVATE_APIS entries whose wrapper is not in torch_private: {missing}"
    assert len({a.name for a in tp.PRIVATE_APIS}) == len(tp.PRIVATE_APIS)


# --- the check can fail ------------------------------------------------------------


def test_check_reports_an_api_that_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch, "_grouped_mm")
    assert not tp.has_grouped_mm()
    problems = tp.check_private_apis()
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"torch {torch.__version__}: torch._grouped_mm is gone")
    assert f"(pinned {tp.TORCH_PINNED}); see src/disagmoe/torch_private.py" in problems[0]


def test_check_reports_renamed_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    def renamed(self: object, stage: object, microbatch: int) -> None: ...

    monkeypatch.setattr(tp.PipelineSchedule, "_maybe_get_loss", renamed)  # where it is defined
    assert tp.check_private_apis() == [
        f"torch {torch.__version__}: {RUNTIME}._maybe_get_loss takes (stage, microbatch), "
        f"we pass (stage, mb_index) (pinned {tp.TORCH_PINNED}); "
        "see src/disagmoe/torch_private.py (get_loss)"
    ]


def test_check_reports_a_changed_result(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch._C, "_storage_Use_Count", lambda cdata: 7)
    (problem,) = tp.check_private_apis()
    assert "torch._C._storage_Use_Count counts 7, 7 (expected 1, 2)" in problem


def test_check_reports_an_attribute_no_longer_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tp, "PRIVATE_APIS", (tp._runtime_attr("_stages_v2", "schedule_stages"),))
    (problem,) = tp.check_private_apis()
    assert "_PipelineScheduleRuntime._stages_v2 is no longer set by _PipelineScheduleRuntime" in (
        problem
    )


def test_check_refuses_an_unknown_name() -> None:
    with pytest.raises(ValueError, match="not in PRIVATE_APIS"):
        tp.check_private_apis(["torch._no_such_api"])


# --- what constructed objects hold ---------------------------------------------------


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    assert not dist.is_initialized()
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(30)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_runtime_schedule_holds_what_we_read(one_rank_group: None) -> None:
    x = torch.zeros(2, 4)
    stage = PipelineStage(nn.Linear(4, 4), 0, 1, torch.device("cpu"), input_args=x, output_args=x)
    sched = tp.PipelineScheduleRuntime([stage], 3, loss_fn=lambda y, t: y.sum())
    assert tp.schedule_stages(sched) == [stage]
    assert tp.schedule_num_microbatches(sched) == 3
    assert sched.fwd_recv_ops == {} and sched.bwd_recv_ops == {}
    assert sched.backward_counter[0] == 0
    assert tp.get_loss(sched, stage, 0) is None  # no loss kept yet
    tp.compute_loss(sched, stage, torch.ones(2, 4), [None] * 3, 0)
    assert tp.get_loss(sched, stage, 0).item() == 8.0
    fwd = [tp.Action(0, tp.FORWARD, mb) for mb in range(3)]
    tp.prepare_schedule_with_comms(
        sched, {0: [*fwd, *(a._replace(computation_type=tp.FULL_BACKWARD) for a in fwd)]}
    )


def test_traced_stage_overrides_only_checked_hooks() -> None:
    """A stage method TracedStage overrides is in `STAGE_HOOKS` (so its parameters are
    checked); anything else it defines does not shadow a name PipelineStage has."""
    own = {n for n in vars(TracedStage) if not n.endswith("__") and n != "_abc_impl"}  # ABC's
    overridden = {n for n in own if hasattr(PipelineStage, n)}
    assert overridden <= set(tp.STAGE_HOOKS), (
        f"TracedStage overrides {sorted(overridden - set(tp.STAGE_HOOKS))}: add them to "
        "torch_private.STAGE_HOOKS with the parameters the runtime passes"
    )
    init = ast.parse(textwrap.dedent(inspect.getsource(TracedStage.__init__)))
    fields = {
        n.attr
        for n in ast.walk(init)
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
    }
    shadowed = {f for f in fields if tp._sets_attribute(tp._PIPELINE_STAGE, f) is None}
    assert not shadowed, f"TracedStage's fields {sorted(shadowed)} are PipelineStage's too"
