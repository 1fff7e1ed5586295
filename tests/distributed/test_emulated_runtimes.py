"""Emulated compute reaches the modules each distributed runtime runs — including the expert
shards, which are sliced from the full model after it is built — and nothing else.

One step per runtime with `train.emulate_compute`: the attention blocks and experts that
ran were emulated (no gradient reaches their parameters), the embedding and head were not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from disagmoe.config import ModelConfig, ParallelConfig, RunConfig, TrainConfig
from disagmoe.costs.compute import ComputeCosts, Linear
from disagmoe.testing.spawn import run_ranks


def _cfg(parallel: ParallelConfig, costs: str) -> RunConfig:
    return RunConfig(
        model=ModelConfig(),
        parallel=parallel,
        train=TrainConfig(
            seq_len=16, global_batch_size=4, micro_batch_size=2, progress=False,
            emulate_compute=costs,
        ),
    )  # fmt: skip


def _one_step(cfgs: list[RunConfig]) -> list[dict[str, Any]]:
    from disagmoe.baselines import TRAINERS
    from disagmoe.runtime.disagg import DisaggTrainer
    from disagmoe.simulator.choose import run_order

    out = []
    for cfg in cfgs:
        runtime = cfg.parallel.runtime
        trainer = DisaggTrainer(cfg, run_order) if runtime == "disagg" else TRAINERS[runtime](cfg)
        trainer.step(0)
        grads: dict[str, float] = {}
        for name, p in trainer.named_params:
            assert p.grad is not None
            grads[name] = float(p.grad.abs().sum())
        out.append(grads)
    return out


def test_every_runtime_emulates_the_modules_it_runs(tmp_path: Path) -> None:
    costs = tmp_path / "costs.json"
    unit = Linear(1e-4, 0.0)
    costs.write_text(ComputeCosts(unit, unit, unit, unit).to_json())
    cfgs = [
        _cfg(ParallelConfig(groups=1, attn_workers=1, expert_workers=1), str(costs)),
        _cfg(ParallelConfig(runtime="ep-1f1b", pp=1, ep=2), str(costs)),
        _cfg(ParallelConfig(runtime="ep-overlap", pp=1, ep=2), str(costs)),
    ]
    per_rank = run_ranks(_one_step, 2, cfgs)
    for k, cfg in enumerate(cfgs):
        grads = {name: g for rank in per_rank for name, g in rank[k].items()}
        emulated = [n for n in grads if ".attn_block." in n or ".experts." in n]
        assert any(".experts." in n for n in emulated), cfg.parallel.runtime
        assert all(grads[n] == 0.0 for n in emulated), cfg.parallel.runtime
        assert grads["lm_head.weight"] > 0.0, cfg.parallel.runtime
