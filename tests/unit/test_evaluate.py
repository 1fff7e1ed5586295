"""Evaluation (training/evaluate.py) without spawning: flags, which batches, when, what is
measured, and that it changes nothing about training (reference trainer, float64)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from disagmoe.cli import main
from disagmoe.config import ParallelConfig, RunConfig, TrainConfig
from disagmoe.data import TokenBatches
from disagmoe.training.evaluate import EvalSet, eval_batch_count, evaluate, should_evaluate
from disagmoe.training.reference import ReferenceTrainer, run_reference


def eval_file(path: Path, num_tokens: int = 17 * 4 * 3 + 5, seed: int = 1) -> str:
    """Tokens for 3 global batches of 4 x (16 + 1) and 5 left over."""
    rng = np.random.default_rng(seed)
    np.save(path, rng.integers(0, 256, num_tokens).astype(np.int64))
    return str(path)


def cfg_with(tmp_path: Path, **train: object) -> RunConfig:
    base = TrainConfig(
        dtype="float64",
        steps=4,
        seq_len=16,
        global_batch_size=4,
        micro_batch_size=2,
        progress=False,
        run_dir=str(tmp_path / "run"),
    )
    train_cfg = dataclasses.replace(base, **train)  # type: ignore[arg-type]
    return RunConfig(parallel=ParallelConfig(threads_per_rank=1), train=train_cfg)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--eval-every", "5"], "--eval-every needs --eval-data"),
        (["--eval-batches", "2"], "--eval-batches needs --eval-data"),
        (["--eval-data", "x.npy", "--eval-every", "-1"], "train.eval_every (--eval-every) must"),
        (["--eval-data", "x.npy", "--eval-batches", "-3"], "train.eval_batches (--eval-batches)"),
        (["--eval-data", "nope/val"], "data file 'nope/val' does not exist (train.eval_data / "),
    ],
)
def test_bad_flags_are_one_line(
    argv: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--runtime", "reference", "--steps", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("disagmoe: error: ") and match in err and err.count("\n") == 1, err


def test_too_many_batches_and_vocab_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = eval_file(tmp_path / "val.npy")
    common = ["train", "--runtime", "reference", "--steps", "1", "--seq-len", "16"]
    common += ["--global-batch-size", "4", "--eval-data", data]
    assert main([*common, "--eval-batches", "4"]) == 2
    assert "--eval-batches 4, but the eval data" in capsys.readouterr().err
    prefix = tmp_path / "corpus"  # prepare-data output of another tokenizer
    np.arange(200, dtype=np.uint16).tofile(f"{prefix}.bin")
    Path(f"{prefix}.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 22}))
    assert main([*common[:-1], str(prefix)]) == 2
    err = capsys.readouterr().err
    assert "was tokenized with vocab size 22" in err and err.count("\n") == 1


def test_batches_are_the_first_in_file_order(tmp_path: Path) -> None:
    tokens = np.load(eval_file(tmp_path / "val.npy"))
    batches = TokenBatches(tokens, seq_len=16, global_batch_size=4, seed=0, vocab_size=256)
    assert batches.num_batches == 3  # the 5 tokens left over make no sample
    for k in range(3):
        want = tokens[k * 68 : (k + 1) * 68].reshape(4, 17)
        assert torch.equal(batches.ordered_batch(k), torch.from_numpy(want))
    train = TrainConfig(eval_data="val.npy", eval_batches=2)
    assert eval_batch_count(train, 3) == 2
    assert eval_batch_count(dataclasses.replace(train, eval_batches=0), 3) == 3
    with pytest.raises(ValueError, match="holds 3 global batches"):
        eval_batch_count(dataclasses.replace(train, eval_batches=4), 3)


def test_when_to_evaluate() -> None:
    train = TrainConfig(steps=12, eval_data="v.npy", eval_every=5)
    assert [t for t in range(1, 13) if should_evaluate(train, t)] == [5, 10, 12]
    assert [
        t for t in range(1, 13) if should_evaluate(dataclasses.replace(train, eval_every=0), t)
    ] == [12]
    assert not any(should_evaluate(TrainConfig(steps=12), t) for t in range(1, 13))


def test_eval_loss_is_the_mean_token_cross_entropy(tmp_path: Path) -> None:
    cfg = cfg_with(tmp_path, eval_data=eval_file(tmp_path / "val.npy"), eval_batches=2)
    trainer = ReferenceTrainer(cfg)
    got = evaluate(trainer, 0)
    model = trainer.model
    with torch.no_grad():
        batch = torch.cat([trainer.eval_set.batch(k) for k in range(2)])  # type: ignore[union-attr]
        logits, _ = model(batch[:, :-1])
        want = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    assert got["eval_loss"] == pytest.approx(float(want), rel=1e-12)
    assert got["eval_ppl"] == pytest.approx(math.exp(float(want)), rel=1e-12)
    assert all(p.grad is None for p in model.parameters())  # no gradient, no optimizer state
    assert not trainer.optimizer.state


def test_evaluation_leaves_training_and_resume_unchanged(tmp_path: Path) -> None:
    data = eval_file(tmp_path / "val.npy")
    for name in "abc":
        (tmp_path / name).mkdir()
    plain = run_reference(cfg_with(tmp_path / "a"), tmp_path / "a")
    cfg = cfg_with(tmp_path / "b", eval_data=data, eval_every=2, checkpoint_every=2)
    evaluated = run_reference(cfg, tmp_path / "b")
    assert [r["loss"] for r in evaluated] == [r["loss"] for r in plain]  # exact
    assert [r["step"] for r in evaluated if "eval_loss" in r] == [2, 4]
    lines = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    keys = {"eval_loss", "eval_ppl", "eval_time_s"}
    assert [keys & r.keys() for r in lines] == [set(), keys] * 2
    # interrupted after step 2, resumed: step 4's evaluation is the uninterrupted run's
    first = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=2))
    run_reference(first, tmp_path / "c")
    resumed = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume="latest"))
    again = run_reference(resumed, tmp_path / "c")
    assert [r["step"] for r in again] == [3, 4]
    assert again[-1]["eval_loss"] == evaluated[-1]["eval_loss"]
    assert EvalSet.build(cfg_with(tmp_path), feeds_data=True) is None
