"""The flags of `disagmoe simulate` (`simulate_cli` runs them)."""

from __future__ import annotations

import argparse

from .config import MULTI_WORKER_RUNTIMES, RECOMPUTE
from .config_io import add_config_flag
from .flags import add_renamed_flag
from .planner.cli import add_cluster_arguments
from .simulator.links import LINK_MODELS

# simulate's own defaults of schedule.split_backward and schedule.order (auto; train's
# are off and breadth)
SIM_SPLIT_BACKWARD = "auto"
SIM_ORDER = "auto"
# micro-batches per GPU in `simulate`'s default global batch (`--micro-batches 0`)
SIM_MICRO_BATCHES_PER_GPU = 8


def default_micro_batches(gpus: int) -> int:
    """`simulate`'s global batch without `--micro-batches`: 8 per GPU, one global batch for
    every runtime and every plan `simulate` compares, so that their steps carry the same
    tokens."""
    return SIM_MICRO_BATCHES_PER_GPU * gpus


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `disagmoe simulate`; those of config fields as the fields declare them
    (`config_io.add_config_flag`), with the simulator's own default where it chooses.
    Long because it is a flat list of flags in `--help` order, which splitting would only
    scatter."""
    parser.add_argument("--model", default="qwen3-30b-a3b", help="model preset name")
    add_config_flag(parser, "parallel.runtime", choices=MULTI_WORKER_RUNTIMES)
    add_cluster_arguments(parser, ("mfu",))
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the cluster preset")
    add_config_flag(parser, "train.seq_len", default=8192)
    add_config_flag(parser, "train.micro_batch_size", default=1)
    add_config_flag(parser, "train.loss_chunk_tokens")
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=0,
        help="micro-batches in the global batch (0: 8 per GPU, the same for every runtime)",
    )
    auto = "0: the planner's split"
    add_config_flag(parser, "parallel.groups", default=0, note=auto)
    add_config_flag(parser, "parallel.attn_workers", default=0, note=auto)
    add_config_flag(parser, "parallel.expert_workers", default=0, note=auto)
    add_config_flag(
        parser,
        "schedule.max_in_flight",
        note="simulate: 0, the most that fit the cluster's GPU memory by the runtime's "
        "memory model (train's cap), or fewer where the simulated step is faster; a cap "
        "that does not fit is refused",
    )
    add_config_flag(
        parser, "train.recompute", default="auto", choices=("auto", *RECOMPUTE),
        note="simulate: auto, the planner's choice (disagg with its split); none unless only "
        "full fits the GPU (disagg with --attn-workers/--expert-workers, ep-* with --pp / --ep); "
        "each mode in the ep-* layout search",
    )  # fmt: skip
    add_config_flag(
        parser, "train.recompute_layers",
        note="simulate: with --recompute full; --recompute auto also tries, on the plan without "
        "recompute (disagg) and each ep-* layout, full recompute of the fewest first layers "
        "that hold more micro-batches in flight (disagg) or that fit (ep-*)",
    )  # fmt: skip
    add_config_flag(parser, "schedule.order", default=SIM_ORDER,
                    note=f"simulate: {SIM_ORDER}, picked on the plan it keeps")  # fmt: skip
    add_config_flag(parser, "schedule.costs")
    # picked on the planned layout by default, as the ep-* search picks --overlap-chunks
    add_config_flag(parser, "schedule.exchange_chunks")
    add_config_flag(parser, "schedule.split_backward", default=SIM_SPLIT_BACKWARD,
                    note=f"simulate: {SIM_SPLIT_BACKWARD}, picked on the layout it runs")  # fmt: skip
    add_config_flag(parser, "parallel.overlap_grad_sync")
    add_config_flag(parser, "parallel.placement", note="see docs/simulator.md")
    parser.add_argument(
        "--nic-split",
        choices=("planner", "even"),
        default="planner",
        help="disagg: NIC bandwidth of A vs F workers: the planner's M_a:M_f (with "
        "node-aware placement) or one fair share per GPU",
    )
    add_config_flag(parser, "parallel.pp", default=0, note="0: auto")
    add_config_flag(parser, "parallel.ep", default=0, note="0: auto")
    add_config_flag(parser, "parallel.virtual_stages")
    add_renamed_flag(parser, "--chunks", "--virtual-stages", "ep-interleaved: stages per rank")
    add_config_flag(parser, "parallel.overlap_chunks", default=0,
                    note="0: the layout search tries 1, 2, 4 and 8 (a layout given: 2)")  # fmt: skip
    add_config_flag(parser, "parallel.pipeline_warmup", default=-1,
                    note="-1: the layout search tries 0, pp and every forward first "
                    "(a layout given: 0)")  # fmt: skip
    parser.add_argument(
        "--reduce",
        choices=("auto", "on", "off"),
        default="auto",
        help="disagg: replay one replica and one shard per group with bundled "
        "messages (auto: for large schedules)",
    )
    parser.add_argument(
        "--link-model",
        choices=LINK_MODELS,
        default="fair",
        help="how messages share a port: max-min fair among all in flight (as TCP / NCCL "
        "do) or one at a time in readiness order (fifo, for comparison)",
    )
    add_config_flag(
        parser,
        "schedule.costs_file",
        note="simulate: the whole disagg replay's (simulator.measured)",
    )
    add_renamed_flag(parser, "--costs", "--costs-file", "a compute_costs.json")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--trace", default="", help="write a Chrome trace of the step here")
