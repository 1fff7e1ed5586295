"""Optional TensorBoard logging (`train.tensorboard`, `disagmoe train --tensorboard`).

Rank 0 writes the scalars of every metrics.jsonl record as event files under
`RUN_DIR/tensorboard/` (`torch.utils.tensorboard.SummaryWriter`), at the record's step:

* `train/<field>` — every number of the record: loss, ce_loss, aux_loss, lr, grad_norm,
  tokens_per_s, step_time_s, flops_per_s, mfu (on GPU) ...;
* `eval/<name>`   — a field `eval_<name>` (eval_loss, when the run evaluates);
* `load_imbalance/layer<L>`, `router_entropy/layer<L>` — one curve per MoE layer L.

Per-rank lists (busy_s, idle_s), memory and expert_tokens stay in metrics.jsonl only.
A resumed run purges the events after its checkpoint's step, as metrics.jsonl is cut.

TensorBoard is an extra, not a dependency: `pip install 'disagmoe[tensorboard]'`;
`require_tensorboard` turns its absence into one error line before any rank starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..extras import require_extra

PER_LAYER = ("load_imbalance", "router_entropy")


def require_tensorboard() -> None:
    """ValueError (one line, the install command) if TensorBoard cannot be imported."""
    require_extra("torch.utils.tensorboard", "tensorboard", "--tensorboard")


class TensorBoardLog:
    """Writes each step record's scalars to `run_dir/tensorboard` (see the module doc)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, start_step: int = 0) -> None:
        require_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        model = cfg.model
        self.moe_layers = [l for l in range(model.num_layers) if model.is_moe_layer(l)]
        self.path = run_dir / "tensorboard"
        # resumed: drop events of steps after the checkpoint (the first new step is start+1)
        self._writer = SummaryWriter(
            str(self.path), purge_step=start_step + 1 if start_step else None
        )

    def log(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        for key, value in record.items():
            if key == "step":
                continue
            if key in PER_LAYER and isinstance(value, list):
                for layer, x in zip(self.moe_layers, value, strict=True):
                    if x is not None:
                        self._writer.add_scalar(f"{key}/layer{layer}", x, step)
            elif isinstance(value, int | float) and not isinstance(value, bool):
                name = f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"
                self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def open_tensorboard(cfg: RunConfig, run_dir: Path, start_step: int) -> TensorBoardLog | None:
    """The run's TensorBoard log, or None without `train.tensorboard`."""
    return TensorBoardLog(cfg, run_dir, start_step) if cfg.train.tensorboard else None
