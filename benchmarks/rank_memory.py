"""Host memory of one rank's weights: parameter bytes it materialises and the peak RSS of a
process that builds that rank's modules, for qwen3-30b-a3b shapes with layers cut down.

    PYTHONPATH=src .venv/bin/python benchmarks/rank_memory.py [--layers 2] [--full] [--json PATH]

Rows (AF-Pipe, p = 1): an attention replica (embedding, every layer's attention block and
router, final norm, LM head) and an expert shard at n = 8 and n = 32 (E/n experts of every
MoE layer), each built by `runtime.stages.build_worker` in a fresh subprocess whose peak
RSS (`ru_maxrss`) is reported; `imports` is a process that only imports and builds the meta
model (the fixed cost in every row). `full model` is what every rank materialised before
rank-local weights: counted on the meta device, built only with `--full`. `GB @48` counts
the same rank's parameters at the preset's 48 layers (meta device, nothing materialised).
Prints a table; writes JSON with a `rows` list.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys
import time

import torch
from results_io import write_json

from disagmoe.config import ModelConfig, ParallelConfig, RunConfig, TrainConfig
from disagmoe.distributed.layout import Layout
from disagmoe.models import build_meta_model
from disagmoe.presets import model_preset
from disagmoe.runtime.stages import AttnWorker, ExpertWorker, build_worker
from disagmoe.training.objective import LossScale
from disagmoe.training.setup import build_initial_model

ROLES = {  # role -> (label, expert shards n; 0: not an AF-Pipe rank)
    "imports": ("imports + meta model", 0),
    "A": ("A replica (embed, head)", 8),
    "F8": ("F shard, n = 8", 8),
    "F32": ("F shard, n = 32", 32),
    "full": ("full model", 0),
}
GB = 1e9


def run_config(layers: int, n: int, dtype: str) -> RunConfig:
    model = dataclasses.replace(model_preset("qwen3-30b-a3b"), num_layers=layers)
    return RunConfig(
        model=model,
        parallel=ParallelConfig(groups=1, attn_workers=1, expert_workers=max(n, 1)),
        train=TrainConfig(dtype=dtype, seq_len=16, global_batch_size=8, micro_batch_size=2),
    )


def rank_of(role: str, layout: Layout) -> int:
    return layout.attn_rank(0, 0) if role == "A" else layout.expert_rank(0, 0)


def meta_bytes(role: str, model: ModelConfig, n: int, element_size: int) -> int:
    """Parameter bytes `role` holds, counted on the meta device."""
    meta = build_meta_model(model)
    if role == "full":
        params = list(meta.parameters())
    else:
        layout = Layout.build(model, ParallelConfig(groups=1, attn_workers=1, expert_workers=n))
        rank = rank_of(role, layout)
        worker = (
            AttnWorker(meta, layout, rank, LossScale.for_run(model, TrainConfig()))
            if role == "A"
            else ExpertWorker(meta, layout, rank)
        )
        params = [p for _, p in worker.named_parameters()]
    return sum(p.numel() for p in params) * element_size


def child(role: str, layers: int, dtype: str) -> None:
    """Build `role`'s modules in this process; print its parameter bytes, peak RSS, time."""
    torch.set_num_threads(1)
    cfg = run_config(layers, ROLES[role][1], dtype)
    t0 = time.perf_counter()
    params: list[torch.Tensor]
    if role == "imports":
        params = [p for p in build_meta_model(cfg.model).parameters() if not p.is_meta]
    elif role == "full":
        params = list(build_initial_model(cfg).parameters())
    else:
        layout = Layout.build(cfg.model, cfg.parallel)
        scale = LossScale.for_run(cfg.model, cfg.train)
        worker = build_worker(cfg, layout, rank_of(role, layout), scale)
        params = [p for _, p in worker.named_parameters()]
    seconds = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    nbytes = sum(p.numel() * p.element_size() for p in params)
    print(json.dumps({"param_bytes": nbytes, "peak_rss_bytes": rss, "build_s": seconds}))


def measure(role: str, layers: int, dtype: str) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", role, "--layers", str(layers), "--dtype", dtype]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=2, help="layers of qwen3-30b-a3b kept")
    parser.add_argument("--dtype", default="float32", help="train.dtype of the run")
    parser.add_argument("--full", action="store_true", help="also build the full model")
    parser.add_argument("--json", default="", help="write the rows to this JSON file")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.layers, args.dtype)
        return 0
    element_size = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    full_model = model_preset("qwen3-30b-a3b")
    cut = dataclasses.replace(full_model, num_layers=args.layers)
    print(f"qwen3-30b-a3b, {args.layers} of {full_model.num_layers} layers, {args.dtype}")
    header = ("rank", "param GB", "peak RSS GB", "RSS-imports", "build s", "GB @48")
    print(f"{header[0]:26s}" + "".join(f"{h:>12s}" for h in header[1:]))
    rows: list[dict[str, object]] = []
    base = 0.0
    for role, (label, n) in ROLES.items():
        row: dict[str, object] = {"rank": label, "role": role, "layers": args.layers}
        row |= {"dtype": args.dtype, "n": n or None}
        if role != "imports":
            row["param_bytes_48_layers"] = meta_bytes(role, full_model, n, element_size)
        if role != "full" or args.full:
            row.update(measure(role, args.layers, args.dtype))
        else:
            row["param_bytes"] = meta_bytes(role, cut, n, element_size)
        if role == "imports":
            base = float(row["peak_rss_bytes"])  # type: ignore[arg-type]
        rows.append(row)
        rss = row.get("peak_rss_bytes")
        cells = [
            row.get("param_bytes"),
            rss,
            None if rss is None else float(rss) - base,  # type: ignore[arg-type]
            None,
            row.get("param_bytes_48_layers"),
        ]
        text = [f"{float(c) / GB:12.2f}" if c is not None else f"{'-':>12s}" for c in cells]  # type: ignore[arg-type]
        secs = row.get("build_s")
        text[3] = f"{'-':>12s}" if secs is None else f"{float(secs):12.2f}"  # type: ignore[arg-type]
        print(f"{label:26s}" + "".join(text))
    if args.json:
        write_json(args.json, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
