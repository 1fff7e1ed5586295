"""Optional dependencies (`disagmoe.extras`): TensorBoard logging and matplotlib figures.

Without an extra, the command that needs it fails in one line naming the pip command,
before any work (or rank) starts; training never needs matplotlib. With TensorBoard
installed (the `dev` extra), `--tensorboard` writes the metrics' scalars as events.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from disagmoe.cli import main
from disagmoe.config import RunConfig, replace_section
from disagmoe.training.observe import prepare_run_dir
from disagmoe.training.reference import run_reference
from disagmoe.training.tensorboard import TensorBoardLog

TRAIN = ["train", "--runtime", "reference", "--steps", "1", "--seq-len", "16", "--no-progress"]


def _without(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    for module in modules:  # None in sys.modules: `import module` raises ImportError
        monkeypatch.setitem(sys.modules, module, None)


def test_tensorboard_missing_is_one_line_before_any_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _without(monkeypatch, "tensorboard", "torch.utils.tensorboard")
    run = tmp_path / "run"
    assert main([*TRAIN, "--tensorboard", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert err == (
        "disagmoe: error: --tensorboard needs the tensorboard package: "
        "pip install 'disagmoe[tensorboard]'\n"
    )
    assert not run.exists()  # refused before the run dir (and any rank)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["plan", "--model", "mixtral-8x7b", "--gpus", "64", "--plot", "x.png"], "--plot"),
        (["bench", "--plots", "figs", "--loopback"], "--plots"),
    ],
)
def test_matplotlib_missing_fails_the_drawing_commands_up_front(
    argv: list[str],
    flag: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _without(monkeypatch, "matplotlib")
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    want = f"disagmoe: error: {flag} needs the matplotlib package: pip install 'disagmoe[plots]'\n"
    assert capsys.readouterr().err == want
    assert list(tmp_path.iterdir()) == []  # no figure, no bench run started


def test_training_never_imports_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _without(monkeypatch, "matplotlib", "tensorboard", "torch.utils.tensorboard")
    assert main([*TRAIN, "--run-dir", str(tmp_path / "run")]) == 0
    assert "reference: 1 steps" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        "config.toml",
        "metrics.jsonl",
        "run.json",
        "trace.json",
    ]


def test_tensorboard_events_hold_the_metrics(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = replace_section(
        RunConfig(),
        "train",
        steps=2,
        seq_len=16,
        global_batch_size=4,
        progress=False,
        tensorboard=True,
        run_dir=str(tmp_path),
    )
    run_reference(cfg, prepare_run_dir(cfg))
    extra = TensorBoardLog(cfg, tmp_path / "eval-only")  # an eval field, as a run logs it
    extra.log({"step": 2, "eval_loss": 4.5, "loss": 5.0, "busy_s": [0.1]})
    extra.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    per_layer = {f"{k}/layer{l}" for k in ("load_imbalance", "router_entropy") for l in range(4)}
    want = {"train/loss", "train/ce_loss", "train/aux_loss", "train/lr", "train/grad_norm"}
    assert want | {"train/tokens_per_s", "train/flops_per_s"} | per_layer <= tags
    assert not any("busy" in t or "expert_tokens" in t or "mfu" in t for t in tags)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert loss == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in rows]
    imbalance = events.Scalars("load_imbalance/layer3")[-1].value
    assert imbalance == pytest.approx(rows[-1]["load_imbalance"][3], rel=1e-6)
    evals = EventAccumulator(str(tmp_path / "eval-only" / "tensorboard"))
    evals.Reload()
    assert set(evals.Tags()["scalars"]) == {"eval/loss", "train/loss"}
