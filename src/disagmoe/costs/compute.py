"""Measured compute of one layer: four linear models, `fixed + per_row * rows` seconds.

The attention block forward and backward per token, the experts of one worker forward
and backward per (token, expert) assignment (`ComputeCosts`), as `disagmoe bench
--compute emulated`'s calibration (`bench.emulation.calibrate`) and
`benchmarks/gpu_check.py` write them (`compute_costs.json`). Emulated compute waits for
them (`models.emulated`); the simulator prices a layout with them (`simulator.measured`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Linear:
    """`fixed + per_row * rows` seconds."""

    fixed: float
    per_row: float

    def __call__(self, rows: int) -> float:
        return max(self.fixed + self.per_row * rows, 0.0)

    def scaled(self, factor: float) -> Linear:
        return Linear(self.fixed * factor, self.per_row * factor)


@dataclass(frozen=True)
class ComputeCosts:
    """Forward and backward durations of the two emulated units."""

    attn_fwd: Linear  # one layer's A component, per token
    attn_bwd: Linear
    expert_fwd: Linear  # one layer's experts on one worker, per (token, expert) assignment
    expert_bwd: Linear
    note: str = ""  # where the numbers come from

    def scaled(self, factor: float) -> ComputeCosts:
        return ComputeCosts(
            self.attn_fwd.scaled(factor),
            self.attn_bwd.scaled(factor),
            self.expert_fwd.scaled(factor),
            self.expert_bwd.scaled(factor),
            f"{self.note} x{factor:g}" if factor != 1 else self.note,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @staticmethod
    def load(path: str | Path) -> ComputeCosts:
        """Read a costs file; a clear ValueError if it is missing or malformed."""
        try:
            raw = json.loads(Path(path).read_text())
            units = {
                k: Linear(float(raw[k]["fixed"]), float(raw[k]["per_row"]))
                for k in ("attn_fwd", "attn_bwd", "expert_fwd", "expert_bwd")
            }
        except FileNotFoundError:
            raise ValueError(f"compute costs file {str(path)!r} does not exist") from None
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(
                f"compute costs file {str(path)!r} is not a costs JSON "
                f"(attn_fwd/attn_bwd/expert_fwd/expert_bwd with fixed and per_row): {err}"
            ) from None
        for name, unit in units.items():
            if not all(math.isfinite(v) and v >= 0 for v in (unit.fixed, unit.per_row)):
                raise ValueError(
                    f"compute costs file {str(path)!r}: {name} must be finite and >= 0"
                )
        return ComputeCosts(**units, note=str(raw.get("note", "")))
