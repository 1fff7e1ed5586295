"""`lr_at`: the shape of each learning-rate schedule, and its flags / TOML keys."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from disagmoe.command import resolve_train_config, train_parser
from disagmoe.config import RunConfig, TrainConfig, replace_section
from disagmoe.config_io import from_dict, load_toml
from disagmoe.training.objective import lr_at


def schedule(**train: object) -> list[float]:
    t = replace_section(RunConfig(), "train", **train).train
    return [lr_at(t, step) for step in range(t.steps)]


def test_constant_after_linear_warmup() -> None:
    lrs = schedule(lr=1.0, warmup_steps=4, steps=10, lr_schedule="constant")
    assert lrs == [0.25, 0.5, 0.75, 1.0] + [1.0] * 6


def test_cosine_falls_monotonically_to_min_lr() -> None:
    t = replace_section(
        RunConfig(), "train", lr=1.0, min_lr=0.1, warmup_steps=2, steps=12, lr_schedule="cosine"
    ).train
    lrs = [lr_at(t, s) for s in range(13)]
    assert lrs[:3] == [0.5, 1.0, 1.0]
    assert all(a > b for a, b in itertools.pairwise(lrs[2:]))
    assert lrs[7] == pytest.approx(0.55)  # half way: the mean of lr and min_lr
    assert lrs[12] == pytest.approx(0.1) and lr_at(t, 50) == pytest.approx(0.1)


def test_wsd_is_stable_then_decays_linearly_to_min_lr_on_the_last_step() -> None:
    # 2 warmup steps, 10 after; decay_fraction 0.4 -> the last 4 steps decay
    lrs = schedule(
        lr=1.0, min_lr=0.2, warmup_steps=2, steps=12, lr_schedule="wsd", decay_fraction=0.4
    )
    assert lrs[:8] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert lrs[8:] == pytest.approx([0.8, 0.6, 0.4, 0.2])


def test_wsd_decays_at_least_one_step() -> None:
    lrs = schedule(lr=1.0, min_lr=0.0, steps=5, lr_schedule="wsd", decay_fraction=0.01)
    assert lrs == [1.0, 1.0, 1.0, 1.0, 0.0]


def test_schedule_flags_and_their_checks() -> None:
    args = train_parser().parse_args(
        [
            *("--lr-schedule", "wsd", "--warmup-steps", "3", "--min-lr", "1e-4"),
            *("--decay-fraction", "0.1", "--weight-decay", "0", "--grad-clip", "0.5"),
        ]
    )
    t = resolve_train_config(args).train
    assert (t.lr_schedule, t.warmup_steps, t.min_lr) == ("wsd", 3, 1e-4)
    assert (t.decay_fraction, t.weight_decay, t.grad_clip) == (0.1, 0.0, 0.5)
    with pytest.raises(ValueError, match=r"train.min_lr \(0.5\) must be in \[0, train.lr"):
        TrainConfig(lr=0.1, min_lr=0.5)
    with pytest.raises(ValueError, match="train.decay_fraction must be in"):
        TrainConfig(decay_fraction=0.0)
    with pytest.raises(ValueError, match="lr_schedule must be one of constant, cosine, wsd"):
        TrainConfig(lr_schedule="linear")


def test_toml_keys_and_the_min_lr_ratio_migration(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[train]\nlr_schedule = "wsd"\nlr = 0.02\nmin_lr_ratio = 0.1\n')
    t = load_toml(path).train
    assert t.lr_schedule == "wsd" and math.isclose(t.min_lr, 0.002)
    # without lr in the same table: the config's lr so far
    assert math.isclose(from_dict({"train": {"min_lr_ratio": 0.5}}).train.min_lr, 1.5e-3)
    with pytest.raises(ValueError, match="not both"):
        from_dict({"train": {"min_lr_ratio": 0.5, "min_lr": 0.0}})


def test_clipping_runs_on_the_device_and_only_above_the_limit() -> None:
    """`clip_gradients` returns the norm as a tensor (no host read) and scales only when
    the norm exceeds the limit; a NaN norm leaves the gradients as they are."""
    import torch

    from disagmoe.training.objective import clip_gradients

    def params(*grads: list[float]) -> list[torch.nn.Parameter]:
        out = []
        for g in grads:
            p = torch.nn.Parameter(torch.zeros(len(g)))
            p.grad = torch.tensor(g)
            out.append(p)
        return out

    big = params([3.0, 4.0], [0.0])
    norm = clip_gradients(big, [True, True], 1.0)
    assert isinstance(norm, torch.Tensor) and float(norm) == 5.0
    assert big[0].grad is not None and torch.allclose(big[0].grad, torch.tensor([0.6, 0.8]))
    small = params([0.3, 0.4])
    assert float(clip_gradients(small, [True], 1.0)) == pytest.approx(0.5)
    assert small[0].grad is not None and small[0].grad.tolist() == pytest.approx([0.3, 0.4])
    bad = params([math.nan, 1.0])
    assert math.isnan(float(clip_gradients(bad, [True], 1.0)))
    assert bad[0].grad is not None and bad[0].grad[1] == 1.0
