"""Shared machinery: run a distributed trainer on spawned gloo ranks and compare it
with the single-process reference trainer, step by step (losses, every gradient, and the
routing statistics of metrics.jsonl: tokens per expert exact, router entropy to 1e-10;
with eval data, also the eval loss of an evaluation between the first two steps)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from disagmoe.config import RunConfig, ScheduleConfig, replace_section
from disagmoe.testing.spawn import run_ranks
from disagmoe.training.model_stats import StepStats
from disagmoe.training.reference import ReferenceTrainer


def collapse_routing(named_params: Any) -> None:
    """Zero every router: uniform probabilities, so top-k picks the same k experts for
    every token of the first step — all other experts get no token at all."""
    import torch

    with torch.no_grad():
        for name, param in named_params:
            if name.endswith("router.weight"):
                param.zero_()


def recorded_step(trainer: Any, cfg: RunConfig, step: int) -> tuple[Any, dict[str, Any]]:
    """One step of `trainer` with its routers recording, as `training.loop` runs it; the
    routing fields of the step's record (`expert_tokens` included), reduced over the world."""
    import torch.distributed as dist

    stats = StepStats(
        replace_section(cfg, "train", log_expert_tokens=True), trainer.local_modules()
    )
    with stats.recording():
        result = trainer.step(step, capture_grads=True)
    sums = torch.zeros(stats.size, dtype=torch.float64)
    stats.fill(sums)
    world = 1
    if dist.is_initialized():
        dist.all_reduce(sums)
        world = dist.get_world_size()
    record = stats.record(sums, 1.0, world)
    return result, {k: record[k] for k in ("expert_tokens", "load_imbalance", "router_entropy")}


def assert_same_routing(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    """Tokens per expert equal (exact integers), entropy per layer to 1e-10 relative."""
    assert got["expert_tokens"] == want["expert_tokens"], f"{what}: expert_tokens differ"
    assert got["load_imbalance"] == want["load_imbalance"], f"{what}: load_imbalance differs"
    assert all(sum(row) > 0 for row in want["expert_tokens"]), f"{what}: nothing routed"
    for layer, (g, w) in enumerate(zip(got["router_entropy"], want["router_entropy"], strict=True)):
        assert abs(g - w) <= 1e-10 * abs(w), f"{what}: router_entropy of MoE layer {layer}"


def trainer_steps(
    cfg: RunConfig, steps: int, trainer_path: str, prepare: bool = False
) -> dict[str, Any]:
    """Runs inside each rank: `steps` steps of the trainer class at `module:Class`."""
    import importlib

    from disagmoe.runtime.disagg import DisaggTrainer
    from disagmoe.simulator.choose import run_order

    module, name = trainer_path.split(":")
    cls = getattr(importlib.import_module(module), name)
    # AF-Pipe: `schedule.order = auto` chosen as `disagmoe train` chooses it
    trainer = cls(cfg, run_order) if issubclass(cls, DisaggTrainer) else cls(cfg)
    if prepare:
        collapse_routing(trainer.named_params)
    out = _steps(trainer, cfg, steps)
    chunks = cfg.schedule.exchange_chunks
    if chunks > 1:  # the run's exchange was chunked: every chunk's compute ran and was traced
        events = trainer.tracer.step_events(steps - 1)
        names = {e["name"] for e in events}
        assert any(name.endswith(f" c{chunks - 1}") for name in names), sorted(names)[:20]
        for e in events:  # a chunk's compute says which in its args, as the simulator's
            if e["cat"] in ("fwd", "bwd") and " c" in e["name"]:
                assert e["args"]["chunk"] == int(e["name"].rsplit(" c", 1)[1]), e
    if cfg.schedule.split_backward == "on":  # every BWD's weight gradients ran in a W
        events = trainer.tracer.step_events(steps - 1)
        backs = sorted(e["name"][1:] for e in events if e["name"].startswith("B"))
        weights = sorted(e["name"][1:] for e in events if e["name"].startswith("W"))
        assert backs and backs == weights, (backs[:5], weights[:5])
    shard = getattr(trainer, "expert_shard", None)
    report = getattr(trainer, "report", None)  # what a checking trainer recorded
    return {
        "steps": out,
        "shard": shard() if callable(shard) else None,
        "report": report() if callable(report) else None,
    }


def without_recompute(cfg: RunConfig) -> RunConfig:
    """`cfg` for the ground truth: the reference trainer saves every activation."""
    import dataclasses

    train = dataclasses.replace(cfg.train, recompute="none", recompute_layers=0)
    return dataclasses.replace(cfg, train=train)


def recomputing(cfg: RunConfig, mode: str, layers: int = 0) -> RunConfig:
    """`cfg` with activation recompute `mode` (`train.recompute`) on each worker's first
    `layers` layers (`train.recompute_layers`; 0: all)."""
    import dataclasses

    train = dataclasses.replace(cfg.train, recompute=mode, recompute_layers=layers)
    return dataclasses.replace(cfg, train=train)


_REFERENCE: dict[tuple[RunConfig, int, bool], list[dict[str, Any]]] = {}  # the latest 8


def reference_steps(cfg: RunConfig, steps: int, prepare: bool = False) -> list[dict[str, Any]]:
    """The reference trainer's steps for `cfg`, always without recompute. The latest 8 are
    kept by config up to its schedule section, which the reference does not read: a test's
    variants of one config in order, cap or chunks compute it once (read the outputs only)."""
    key = (dataclasses.replace(without_recompute(cfg), schedule=ScheduleConfig()), steps, prepare)
    if key not in _REFERENCE:
        ref = ReferenceTrainer(without_recompute(cfg))
        if prepare:
            collapse_routing(ref.named_params)
        _REFERENCE[key] = _steps(ref, cfg, steps)
        while len(_REFERENCE) > 8:
            del _REFERENCE[next(iter(_REFERENCE))]
    return _REFERENCE[key]


def _steps(trainer: Any, cfg: RunConfig, steps: int) -> list[dict[str, Any]]:
    """`steps` steps with their losses and gradients; with eval data, the first step's
    record also holds the `eval_loss` of an evaluation right after it (forward only: the
    later steps must not notice)."""
    from disagmoe.training.evaluate import evaluate

    out = []
    for step in range(steps):
        result, routing = recorded_step(trainer, cfg, step)
        out.append({"loss": result.loss, "grads": result.grads, "routing": routing})
        if step == 0 and cfg.train.eval_data:
            out[-1]["eval_loss"] = evaluate(trainer, step)["eval_loss"]
            worker = getattr(trainer, "worker", None)  # disagg: nothing kept for a backward
            assert worker is None or not (worker.stash or getattr(worker, "local", None))
    return out


def chunked(cfg: RunConfig, chunks: int) -> RunConfig:
    """`cfg` with `schedule.exchange_chunks` = `chunks` (AF-Pipe's chunked exchange)."""
    import dataclasses

    schedule = dataclasses.replace(cfg.schedule, exchange_chunks=chunks)
    return dataclasses.replace(cfg, schedule=schedule)


def loss_chunked(cfg: RunConfig, tokens: int) -> RunConfig:
    """`cfg` with the loss head over chunks of `tokens` tokens (`train.loss_chunk_tokens`;
    0: the unchunked head, logits kept for the backward)."""
    import dataclasses

    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, loss_chunk_tokens=tokens))


def splitting(cfg: RunConfig) -> RunConfig:
    """`cfg` with `schedule.split_backward` on (every backward's weight gradients in a W)."""
    import dataclasses

    schedule = dataclasses.replace(cfg.schedule, split_backward="on")
    return dataclasses.replace(cfg, schedule=schedule)


def evaluating(cfg: RunConfig, eval_data: str, eval_batches: int = 2) -> RunConfig:
    """`cfg` with an eval set: the first `eval_batches` global batches of `eval_data`."""
    import dataclasses

    train = dataclasses.replace(cfg.train, eval_data=eval_data, eval_batches=eval_batches)
    return dataclasses.replace(cfg, train=train)


TRAINER = "disagmoe.runtime.disagg:DisaggTrainer"


@dataclasses.dataclass(frozen=True)
class Case:
    """A config the spawned ranks train: with the trainer class at `module:Class`, and
    with every router starting at zero if `prepare` (`collapse_routing`)."""

    cfg: RunConfig
    trainer: str = TRAINER
    prepare: bool = False


def spawn_cases(cases: list[Case], world: int, steps: int) -> list[list[dict[str, Any]]]:
    """Every case on one spawn of `world` ranks, one after the other: per case, each rank's
    output (`trainer_steps`)."""
    results = run_ranks(_run_many, world, cases, steps)
    return [[rank_out[k] for rank_out in results] for k in range(len(cases))]


def rel_errors(case: Case, rank_outs: list[dict[str, Any]], steps: int) -> tuple[float, float, int]:
    """(max loss rel err, max grad rel err, #params compared) of one case's rank outputs
    against the reference trainer."""
    cfg = case.cfg
    ref = reference_steps(cfg, steps, case.prepare)
    loss_err = grad_err = 0.0
    names: set[str] = set()
    for step in range(steps):
        ref_loss = ref[step]["loss"]
        for rank_out in rank_outs:
            got = rank_out["steps"][step]
            loss_err = max(loss_err, abs(got["loss"] - ref_loss) / abs(ref_loss))
            assert_same_routing(got["routing"], ref[step]["routing"], f"{cfg.parallel} step {step}")
            if "eval_loss" in ref[step]:  # an eval loss error counts as a loss error
                want = ref[step]["eval_loss"]
                loss_err = max(loss_err, abs(got["eval_loss"] - want) / abs(want))
            shard = rank_out["shard"]
            for name, grad in got["grads"].items():
                expected = ref[step]["grads"][name]
                if shard is not None and name.endswith(("experts.gate_up", "experts.down")):
                    lo, hi = shard
                    expected = expected[lo:hi]
                assert grad.shape == expected.shape, name
                scale = expected.abs().max().item() or 1.0
                grad_err = max(grad_err, (grad - expected).abs().max().item() / scale)
                names.add(name)
    missing = set(ref[0]["grads"]) - names
    assert not missing, f"parameters without a distributed gradient: {sorted(missing)[:5]}"
    return loss_err, grad_err, len(names)


def max_rel_errors(
    cfgs: list[RunConfig], world: int, steps: int, trainer_path: str, prepare: bool = False
) -> list[tuple[float, float, int]]:
    """For each config, on one spawn: (max loss rel err, max grad rel err, #params compared).

    With `prepare`, every router starts at zero (`collapse_routing`)."""
    cases = [Case(cfg, trainer_path, prepare) for cfg in cfgs]
    outs = spawn_cases(cases, world, steps)
    return [rel_errors(case, out, steps) for case, out in zip(cases, outs, strict=True)]


def _run_many(cases: list[Case], steps: int) -> list[dict[str, Any]]:
    import torch.distributed as dist

    out = []
    for case in cases:
        out.append(trainer_steps(case.cfg, steps, case.trainer, case.prepare))
        dist.barrier()
    return out


def float64(cfg: RunConfig) -> RunConfig:
    import dataclasses

    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, dtype="float64"))


torch.set_default_dtype(torch.float32)
