"""Reference trainer: loss falls on the built-in corpus; run outputs are written."""

from __future__ import annotations

import json
from pathlib import Path

from disagmoe.config import RunConfig, replace_section
from disagmoe.training.objective import lr_at
from disagmoe.training.observe import prepare_run_dir
from disagmoe.training.reference import ReferenceTrainer, run_reference


def test_loss_decreases_and_run_dir_is_complete(tmp_path: Path) -> None:
    cfg = replace_section(
        RunConfig(), "train", steps=25, run_dir=str(tmp_path / "run"), progress=False
    )
    records = run_reference(cfg, prepare_run_dir(cfg))
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0] - 1.5, losses
    run = tmp_path / "run"
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 25
    first = json.loads(lines[0])
    assert {"step", "loss", "lr", "tokens_per_s", "elapsed_s"} <= first.keys()
    assert "[train]" in (run / "config.toml").read_text()
    trace = json.loads((run / "trace.json").read_text())
    assert any(e.get("ph") == "X" and e["cat"] == "fwd" for e in trace["traceEvents"])


def test_micro_batching_does_not_change_the_gradient() -> None:
    # CE only: the balance loss is per micro-batch by definition (see training/objective.py).
    cfg = replace_section(RunConfig(), "model", aux_loss_coef=0.0)
    base = replace_section(cfg, "train", dtype="float64", global_batch_size=4, micro_batch_size=4)
    split = replace_section(base, "train", micro_batch_size=1)
    a = ReferenceTrainer(base).step(0, capture_grads=True)
    b = ReferenceTrainer(split).step(0, capture_grads=True)
    assert abs(a.ce_loss - b.ce_loss) < 1e-12
    for name, grad in a.grads.items():
        assert (grad - b.grads[name]).abs().max() < 1e-12 * max(grad.abs().max().item(), 1.0), name


def test_aux_loss_coefficient_zero_disables_it() -> None:
    cfg = replace_section(RunConfig(), "model", aux_loss_coef=0.0)
    assert ReferenceTrainer(cfg).step(0).aux_loss == 0.0
    assert ReferenceTrainer(RunConfig()).step(0).aux_loss > 0.0


def test_lr_schedule() -> None:
    cfg = replace_section(
        RunConfig(),
        "train",
        lr=1.0,
        warmup_steps=2,
        lr_schedule="cosine",
        steps=12,
        min_lr=0.1,
    )
    t = cfg.train
    assert lr_at(t, 0) == 0.5 and lr_at(t, 1) == 1.0
    assert abs(lr_at(t, 12) - 0.1) < 1e-12 and lr_at(t, 7) < 1.0
