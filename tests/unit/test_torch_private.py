"""`disagmoe.torch_private`: each private torch API we use still fits this torch, the check
reports one that does not, and no other module of the package touches torch internals."""

from __future__ import annotations

import ast
import datetime
import importlib
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
from disagmoe.torch_private import check as tpc

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


@pytest.mark.parametrize("name", [api.name for api in tpc.PRIVATE_APIS])
def test_private_api_fits_this_torch(name: str) -> None:
    problems = tpc.check_private_apis([name])
    assert not problems, "\n".join(problems)


def test_every_api_names_a_wrapper() -> None:
    missing = [a.name for a in tpc.PRIVATE_APIS if not hasattr(tp, a.wrapper)]
    assert not missing, f"PRIVATE_APIS entries whose wrapper is not in torch_private: {missing}"
    assert len({a.name for a in tpc.PRIVATE_APIS}) == len(tpc.PRIVATE_APIS)


# --- the check can fail ------------------------------------------------------------


def test_check_reports_an_api_that_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch, "_grouped_mm")
    assert not tp.has_grouped_mm()
    problems = tpc.check_private_apis()
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"torch {torch.__version__}: torch._grouped_mm is gone")
    assert f"(pinned {tp.TORCH_PINNED}); see src/disagmoe/torch_private/" in problems[0]


def test_check_reports_renamed_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    def renamed(self: object, stage: object, microbatch: int) -> None: ...

    monkeypatch.setattr(tp.PipelineSchedule, "_maybe_get_loss", renamed)  # where it is defined
    assert tpc.check_private_apis() == [
        f"torch {torch.__version__}: {RUNTIME}._maybe_get_loss takes (stage, microbatch), "
        f"we pass (stage, mb_index) (pinned {tp.TORCH_PINNED}); "
        "see src/disagmoe/torch_private/ (get_loss)"
    ]


def test_check_reports_a_changed_result(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch._C, "_storage_Use_Count", lambda cdata: 7)
    (problem,) = tpc.check_private_apis()
    assert "torch._C._storage_Use_Count counts 7, 7 (expected 1, 2)" in problem


def test_check_reports_an_attribute_no_longer_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tpc, "PRIVATE_APIS", (tpc._runtime_attr("_stages_v2", "schedule_stages"),))
    (problem,) = tpc.check_private_apis()
    assert "_PipelineScheduleRuntime._stages_v2 is no longer set by _PipelineScheduleRuntime" in (
        problem
    )


def test_check_refuses_an_unknown_name() -> None:
    with pytest.raises(ValueError, match="not in PRIVATE_APIS"):
        tpc.check_private_apis(["torch._no_such_api"])


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
    assert "0F1" in [str(a) for a in sched.pipeline_order_with_comms[0]]


def test_receives_at_start_posts_every_receive_first_in_its_order() -> None:
    """Every receive goes to the front of its rank's list, the receives in their order;
    sends and computations keep theirs."""
    names = ["1F2", "1SEND_F2", "1RECV_B1", "1SEND_F3", "1RECV_F4", "1B1", "1SEND_B1", "1F3",
             "1RECV_F5", "1F4"]  # fmt: skip
    sched = tp.PipelineScheduleRuntime.__new__(tp.PipelineScheduleRuntime)
    parse = importlib.import_module("torch.distributed.pipelining.schedules")._Action.from_str
    sched.pipeline_order_with_comms = {0: [parse(n) for n in names]}
    tp.receives_at_start(sched)
    got = [str(a) for a in sched.pipeline_order_with_comms[0]]
    assert got == ["1RECV_B1", "1RECV_F4", "1RECV_F5", "1F2", "1SEND_F2", "1SEND_F3", "1B1",
                   "1SEND_B1", "1F3", "1F4"]  # fmt: skip


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
    shadowed = {f for f in fields if tpc._sets_attribute(tp._PIPELINE_STAGE, f) is None}
    assert not shadowed, f"TracedStage's fields {sorted(shadowed)} are PipelineStage's too"


# --- no private torch outside torch_private ------------------------------------------


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


WRAPPED = {
    part
    for api in tpc.PRIVATE_APIS
    for part in api.name.split(" ")[0].split(".")
    if _is_private(part)
}


def private_torch_uses(source: str, filename: str = "<src>") -> list[str]:
    """Where `source` touches torch internals (line: what): an import from a private torch
    module or of a private name, an underscore attribute on a name imported from torch,
    getattr/hasattr of one, or any `x.<name>` of a private name torch_private wraps
    (`sched._stages`: what an object of torch's is cannot be read from the source)."""
    tree = ast.parse(source, filename=filename)
    from_torch: set[str] = set()
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    from_torch.add((alias.asname or alias.name).split(".")[0])
                    if any(map(_is_private, alias.name.split("."))):
                        found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            assert node.module is not None
            if any(map(_is_private, node.module.split("."))):
                found.append(f"{node.lineno}: from {node.module} import ...")
            for alias in node.names:
                from_torch.add(alias.asname or alias.name)
                if _is_private(alias.name):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute | ast.Call | ast.Subscript):
                root = root.func if isinstance(root, ast.Call) else root.value
            if node.attr in WRAPPED or (isinstance(root, ast.Name) and root.id in from_torch):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _is_private(node.args[1].value)
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in from_torch
        ):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(set(found), key=lambda f: (int(f.split(":")[0]), f))


def test_the_guard_finds_private_uses() -> None:
    source = textwrap.dedent(
        """
        import torch
        import torch.distributed.pipelining._backward as b
        from torch import nn as n
        from torch.distributed.pipelining.schedules import _Action, Schedule1F1B
        from torch.distributed.pipelining._backward import stage_backward_weight
        y = torch._grouped_mm(x, w)
        z = torch._C._storage_Use_Count(s)
        k = n.Module._parameters
        m = sched._stages
        ok = hasattr(torch, "_grouped_mm")
        fine = (torch.zeros(1), self._cache, torch.__version__, Schedule1F1B)
        """
    )
    assert private_torch_uses(source) == [
        "3: import torch.distributed.pipelining._backward",
        "5: from torch.distributed.pipelining.schedules import _Action",
        "6: from torch.distributed.pipelining._backward import ...",
        "7: torch._grouped_mm",
        "8: torch._C",
        "8: torch._C._storage_Use_Count",
        "9: n.Module._parameters",
        "10: sched._stages",
        "11: hasattr(torch, '_grouped_mm')",
    ]


def test_only_torch_private_touches_torch_internals() -> None:
    found = [
        f"{path.relative_to(PACKAGE_DIR.parent)}:{use}"
        for path in sorted(PACKAGE_DIR.rglob("*.py"))
        if "torch_private" not in path.parts
        for use in private_torch_uses(path.read_text(), str(path))
    ]
    assert not found, (
        "private torch APIs outside disagmoe/torch_private/ (wrap them there, with a "
        "PRIVATE_APIS entry):\n" + "\n".join(found)
    )


def _package_classes() -> list[type]:
    """Every class defined in a module of the package (all modules imported)."""
    classes = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        module = importlib.import_module(name)
        classes += [c for c in vars(module).values() if inspect.isclass(c) and c.__module__ == name]
    return classes


def private_overrides(classes: list[type]) -> list[str]:
    """The private names (not ones torch makes for every subclass, like a Function's
    `_backward_cls`) that a class among `classes` defines over its torch bases'."""
    found = []
    for cls in classes:
        bases = [b for b in cls.__mro__[1:] if b.__module__.split(".")[0] == "torch"]
        if not bases:
            continue
        made_by_torch = set(vars(type("Probe", (bases[0],), {})))
        found += [
            f"{cls.__module__}.{cls.__qualname__}.{name}"
            for name in vars(cls)
            if _is_private(name)
            and name not in made_by_torch
            and any(name in vars(b) for b in bases)
        ]
    return found


def test_the_override_guard_finds_an_override() -> None:
    class Overrides(nn.Module):
        def _apply(self, fn: object, recurse: bool = True) -> nn.Module:
            return self

    class Plain(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
            return x

    assert private_overrides([Overrides, Plain]) == [f"{__name__}.{Overrides.__qualname__}._apply"]


def test_no_class_overrides_a_private_torch_name() -> None:
    """A subclass of a torch class (a stage, a schedule, an autograd Function, a Module)
    defines no private name its torch bases have: overriding one couples us to torch's
    internals where no check sees it (STAGE_HOOKS lists the public ones we override)."""
    found = private_overrides(_package_classes())
    assert not found, f"overrides of private torch names (wrap them in torch_private): {found}"
