"""Schedule simulator: replays the executor's instruction lists with a cost model.

* `simulate_disagg` / `simulate_schedule` — AF-Pipe (`schedule.afpipe`), validated first;
* `simulate_ep` — the expert-parallel baselines (1F1B, interleaved, DualPipeV, overlap),
  one representative per pipeline rank; `simulate_baseline_schedule` — their lists
  with every rank and given costs (host calibration);
* all of them lower through `simulator.lower` (one path, `schedule.semantics`' rules);
* `AnalyticCosts` (FLOPs at peak * mfu) or `TableCosts` (measured medians);
* results: step time, tokens/s, per-worker busy time, breakdown, Chrome trace.
"""

from .costs import AnalyticCosts, MessageOverheads, TableCosts, Workload
from .disagg import ScheduleRejected, simulate_disagg, simulate_schedule
from .ep import simulate_baseline_schedule, simulate_ep
from .network import Network
from .report import BREAKDOWN_KEYS, SimResult

__all__ = [
    "BREAKDOWN_KEYS",
    "AnalyticCosts",
    "MessageOverheads",
    "Network",
    "ScheduleRejected",
    "SimResult",
    "TableCosts",
    "Workload",
    "simulate_baseline_schedule",
    "simulate_disagg",
    "simulate_ep",
    "simulate_schedule",
]
