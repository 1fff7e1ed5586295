"""The check that each private torch API `disagmoe.torch_private` wraps still fits this
torch: `PRIVATE_APIS` (name, wrapper, the parameters or attributes we rely on, or a cheap
probe) and `check_private_apis()`, run by tests/unit/test_torch_private.py on every torch
upgrade."""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import torch
from torch import nn

from . import (
    _BACKWARD,
    _PIPELINE_STAGE,
    _RUNTIME,
    _SCHEDULES,
    _STAGE,
    SOURCE,
    STAGE_HOOKS,
    TORCH_PINNED,
    _backward_module,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class PrivateApi:
    """One private torch API and what our code relies on about it.

    `name`: the dotted path; without `probe` the check imports and reads it. `params`: the
    leading parameter names (after `self`) our calls rely on. `probe`: instead of reading
    `name`, a cheap call that returns a problem or None. `wrapper`: where it is wrapped.
    """

    name: str
    wrapper: str
    params: tuple[str, ...] | None = None
    probe: Callable[[], str | None] | None = None


def _resolve(path: str) -> Any:
    """The object at dotted `path`: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def _leading_params(fn: Any, expected: tuple[str, ...]) -> str | None:
    names = [n for n in inspect.signature(fn).parameters if n != "self"]
    if names[: len(expected)] == list(expected):
        return None
    return f"takes ({', '.join(names)}), we pass ({', '.join(expected)})"


def _sets_attribute(cls_path: str, attr: str) -> str | None:
    """None when a method of the class at `cls_path` (or of a torch base) assigns
    `self.<attr>`, read from torch's source: constructing a schedule needs a process group."""
    cls = _resolve(cls_path)
    for klass in cls.__mro__:
        if not klass.__module__.startswith("torch."):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and node.attr == attr
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                return None
    return f"is no longer set by {cls.__name__} or its bases"


def _probe_grouped_mm() -> str | None:
    x = torch.ones(4, 8, dtype=torch.bfloat16)
    w = torch.ones(2, 8, 8, dtype=torch.bfloat16)
    y = torch._grouped_mm(x, w, offs=torch.tensor([1, 4], dtype=torch.int32))
    ok = y.shape == (4, 8) and bool((y == 8).all())
    return None if ok else f"gives {tuple(y.shape)} (not all 8s) for [4, 8] x [2, 8, 8]"


def _probe_storage_use_count() -> str | None:
    storage = torch.UntypedStorage(16)
    alone = torch._C._storage_Use_Count(storage._cdata)
    view = torch.empty(0).set_(storage, 0, (4,), ())
    held = torch._C._storage_Use_Count(storage._cdata)
    del view
    return None if (alone, held) == (1, 2) else f"counts {alone}, {held} (expected 1, 2)"


def _probe_engine_reaches() -> str | None:
    from . import engine_reaches

    seen: list[tuple[bool, bool]] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return x * w

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
            seen.append(tuple(engine_reaches(n) for n, _ in ctx.next_functions))  # type: ignore[arg-type]
            return g, g

    x0, w = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    x = x0 * 1.0
    Probe.apply(x, w).sum().backward(retain_graph=True)
    out = Probe.apply(x, w).sum()
    torch.autograd.grad(out, [x0], retain_graph=True)
    torch.autograd.grad(out, [w])
    want = [(True, True), (True, False), (False, True)]
    return None if seen == want else f"reached (whole, to x, to w) {seen}, want {want}"


def _probe_cdata() -> str | None:
    return None if isinstance(torch.UntypedStorage(1)._cdata, int) else "is not an int"


def _probe_base() -> str | None:
    t = torch.zeros(2)
    return None if t._base is None and t[:1]._base is t else "no longer gives a view's base"


def _probe_parameters() -> str | None:
    lin = nn.Linear(2, 2)
    registry = lin._parameters
    if set(registry) != {"weight", "bias"}:
        return f"holds {sorted(registry)}, not ['bias', 'weight']"
    new = nn.Parameter(torch.zeros(2, 2))
    registry["weight"] = new
    return None if lin.weight is new else "is no longer the registry Module reads"


def _probe_param_groups() -> str | None:
    x = torch.ones(2, 2, requires_grad=True)
    w = nn.Parameter(torch.ones(2, 2))
    y = (x @ w).relu() @ w
    backward = _backward_module()
    node = backward._get_grad_fn_or_grad_acc
    reverse = backward.construct_reverse_graph([node(y)])
    groups = backward.get_param_groups([node(x)], [node(w)], reverse)
    missing = {"params", "intermediates"} - set(groups[0]) if groups else {"(any group)"}
    return f"gives groups without {sorted(missing)}" if missing else None


def _probe_action() -> str | None:
    expected = ("stage_index", "computation_type", "microbatch_index", "sub_actions")
    got = tuple(_resolve(f"{_SCHEDULES}._Action")._fields)
    return None if got[:4] == expected else f"has fields {got}, we build {expected}"


def _probe_context() -> str | None:
    cls = _resolve(f"{_SCHEDULES}._PipelineContext")
    got = {f.name for f in fields(cls)} if is_dataclass(cls) else set()
    missing = {"schedule_ref", "arg_mbs", "kwarg_mbs", "target_mbs"} - got
    return f"has no fields {sorted(missing)}" if missing else None


def _probe_kind(name: str, value: str) -> Callable[[], str | None]:
    def probe() -> str | None:
        got = _resolve(f"{_SCHEDULES}.{name}").value
        return None if got == value else f"has value {got!r}, we read it as {value!r}"

    return probe


def _stage_hook(name: str, params: tuple[str, ...]) -> PrivateApi:
    return PrivateApi(name=f"{_PIPELINE_STAGE}.{name}", wrapper="STAGE_HOOKS", params=params)


def _runtime_attr(attr: str, wrapper: str) -> PrivateApi:
    return PrivateApi(
        name=f"{_RUNTIME}.{attr}", wrapper=wrapper, probe=lambda: _sets_attribute(_RUNTIME, attr)
    )


PRIVATE_APIS: tuple[PrivateApi, ...] = (
    PrivateApi(name="torch._grouped_mm", wrapper="grouped_mm", probe=_probe_grouped_mm),
    PrivateApi(
        name="torch._C._storage_Use_Count",
        wrapper="storage_use_count",
        probe=_probe_storage_use_count,
    ),
    PrivateApi(name="torch.UntypedStorage._cdata", wrapper="storage_use_count", probe=_probe_cdata),
    PrivateApi(name="torch.Tensor._base", wrapper="view_base", probe=_probe_base),
    PrivateApi(
        name="torch._C._will_engine_execute_node",
        wrapper="engine_reaches",
        probe=_probe_engine_reaches,
    ),
    PrivateApi(
        name="torch.nn.Module._parameters", wrapper="module_parameters", probe=_probe_parameters
    ),
    PrivateApi(
        name=f"{_BACKWARD}._get_grad_fn_or_grad_acc", wrapper="grad_fn_or_grad_acc", params=("t",)
    ),
    PrivateApi(
        name=f"{_BACKWARD}.construct_reverse_graph",
        wrapper="construct_reverse_graph",
        params=("roots",),
    ),
    PrivateApi(
        name=f"{_BACKWARD}.get_param_groups",
        wrapper="get_param_groups",
        params=("inputs", "params", "reverse_edges_dict"),
    ),
    PrivateApi(
        name=f"{_BACKWARD}.get_param_groups (group keys)",
        wrapper="get_param_groups",
        probe=_probe_param_groups,
    ),
    PrivateApi(
        name=f"{_BACKWARD}.stage_backward_weight",
        wrapper="stage_backward_weight",
        params=("weights", "param_groups"),
    ),
    PrivateApi(name=f"{_SCHEDULES}._Action", wrapper="Action", probe=_probe_action),
    PrivateApi(
        name=f"{_SCHEDULES}._PipelineContext", wrapper="PipelineContext", probe=_probe_context
    ),
    PrivateApi(name=f"{_SCHEDULES}._PipelineSchedule", wrapper="PipelineSchedule"),
    PrivateApi(name=f"{_STAGE}._PipelineStageBase", wrapper="PipelineStageBase"),
    PrivateApi(name=f"{_SCHEDULES}.FORWARD", wrapper="FORWARD", probe=_probe_kind("FORWARD", "F")),
    PrivateApi(
        name=f"{_SCHEDULES}.FULL_BACKWARD",
        wrapper="FULL_BACKWARD",
        probe=_probe_kind("FULL_BACKWARD", "B"),
    ),
    PrivateApi(name=f"{_SCHEDULES}.OVERLAP_F_B", wrapper="OVERLAP_F_B"),
    PrivateApi(name=f"{_SCHEDULES}._wait_batch_p2p", wrapper="wait_batch_p2p", params=("work",)),
    PrivateApi(
        name=f"{_SCHEDULES}._CustomFunctionProtocol.__call__",
        wrapper="PipelineScheduleRuntime",
        params=("action", "ctx"),
    ),
    PrivateApi(
        name=f"{_RUNTIME}.register_custom_function",
        wrapper="PipelineScheduleRuntime",
        params=("computation_type", "custom_function"),
    ),
    PrivateApi(
        name=f"{_RUNTIME}._maybe_compute_loss",
        wrapper="compute_loss",
        params=("stage", "output", "target_mbs", "mb_index"),
    ),
    PrivateApi(
        name=f"{_RUNTIME}._maybe_get_loss", wrapper="get_loss", params=("stage", "mb_index")
    ),
    PrivateApi(
        name=f"{_RUNTIME}._prepare_schedule_with_comms",
        wrapper="prepare_schedule_with_comms",
        params=("actions",),
    ),
    _runtime_attr("_stages", "schedule_stages"),
    _runtime_attr("_n_microbatches", "schedule_num_microbatches"),
    _runtime_attr("fwd_recv_ops", "PipelineScheduleRuntime"),
    _runtime_attr("bwd_recv_ops", "PipelineScheduleRuntime"),
    _runtime_attr("backward_counter", "PipelineScheduleRuntime"),
    _runtime_attr("pipeline_order_with_comms", "receives_at_start"),
    *(_stage_hook(name, params) for name, params in STAGE_HOOKS.items()),
    _stage_hook("set_local_fwd_input", ("prev_stage_outputs", "mb_index")),
    _stage_hook("set_local_bwd_input", ("next_stage_bwd_outputs", "mb_index")),
    _stage_hook("get_local_bwd_output", ("mb_index",)),
)


def _problem(api: PrivateApi) -> str | None:
    """What is wrong with `api` in this torch, or None."""
    try:
        if api.probe is not None:
            return api.probe()
        obj = _resolve(api.name)
        if api.params is not None:
            if not callable(obj):
                return "is no longer callable"
            return _leading_params(obj, api.params)
        return None
    except (ImportError, AttributeError) as err:
        # gone itself, or something its check reads (named then)
        return (
            "is gone" if api.name.split(" ")[0].split(".")[-1] in str(err) else f"is gone ({err})"
        )
    except Exception as err:  # a probe that fails is a problem to report, not a crash
        return f"fails its check: {type(err).__name__}: {err}"


def check_private_apis(names: Iterable[str] | None = None) -> list[str]:
    """The problems of this torch with the private APIs we use (`PRIVATE_APIS`, or those
    named in `names`), one line each naming the API, both torch versions and the wrapper
    to fix; empty when all is well."""
    wanted: Sequence[PrivateApi] = PRIVATE_APIS
    if names is not None:
        chosen = set(names)
        unknown = chosen - {a.name for a in PRIVATE_APIS}
        if unknown:
            raise ValueError(f"not in PRIVATE_APIS: {sorted(unknown)}")
        wanted = [a for a in PRIVATE_APIS if a.name in chosen]
    problems = []
    for api in wanted:
        what = _problem(api)
        if what is not None:
            problems.append(
                f"torch {torch.__version__}: {api.name} {what} (pinned {TORCH_PINNED}); "
                f"see {SOURCE} ({api.wrapper})"
            )
    return problems
