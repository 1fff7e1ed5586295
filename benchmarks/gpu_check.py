"""The check a maintainer runs on a GPU machine before trusting the CUDA path.

    python benchmarks/gpu_check.py --device cuda --model qwen3-30b-a3b --layers 2 \\
        --seq-len 4096 --micro-batch-size 1 --out benchmarks/results/gpu_check

Three parts, one table each, all in OUT/gpu_check.json:

1. **training**: the reference trainer on the device in mixed precision (`--dtype
   bfloat16`: autocast, float32 master weights) for `--steps` steps on the built-in
   corpus; every loss must be finite, the last below the first, the master weights
   float32 and on the device;
2. **expert kernel**: one MoE layer's `Experts` (forward and the input gradient) on the
   device against the same module on the CPU in float32, for float32 and bf16 autocast
   on the device (relative max errors; float32 must agree to `FP32_TOL`);
3. **per-op timings** at the given shapes (a preset's real widths; `--layers` cuts the
   depth so that one device holds the model): attention block and experts, forward
   and backward, medians of `--repeats` synchronised calls (`bench.emulation.calibrate`,
   pure bf16 modules on an accelerator, float32 on the CPU), written as
   OUT/compute_costs.json — the `ComputeCosts` format (`simulator.measured`), which
   `disagmoe bench --compute emulated`, `disagmoe simulate --costs-file` and `disagmoe plan
   --costs-file` read.

Runs end to end on the CPU too (`--device cpu`, tiny shapes: tests/e2e/test_gpu_check.py);
exit code 1 when a check fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from disagmoe.bench.emulation import calibrate
from disagmoe.config import DEVICES, ModelConfig, ParallelConfig, RunConfig, TrainConfig
from disagmoe.device import HOST, device_name, resolve_device, synchronize
from disagmoe.models import build_model, flatten_routing
from disagmoe.presets import model_preset
from disagmoe.training.precision import Precision
from disagmoe.training.reference import ReferenceTrainer

FP32_TOL = 1e-4  # device vs CPU float32: different GEMM kernels, same math


def _model(args: argparse.Namespace) -> ModelConfig:
    model = model_preset(args.model)
    if args.layers:
        dense = min(model.num_dense_layers, args.layers - 1)
        model = dataclasses.replace(model, num_layers=args.layers, num_dense_layers=dense)
    return model


def check_training(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    cfg = RunConfig(
        model=_model(args),
        parallel=ParallelConfig(runtime="reference", device=args.device),
        train=TrainConfig(
            dtype="bfloat16",
            steps=args.steps,
            seq_len=args.seq_len,
            global_batch_size=2 * args.micro_batch_size,
            micro_batch_size=args.micro_batch_size,
            progress=False,
        ),
    )
    trainer = ReferenceTrainer(cfg)
    losses = [trainer.step(step).loss for step in range(args.steps)]
    params = [p for _, p in trainer.named_params]
    ok = (
        all(math.isfinite(x) for x in losses)
        and losses[-1] < losses[0]
        and all(p.dtype == torch.float32 and p.device.type == device.type for p in params)
    )
    return {"losses": losses, "ok": ok}


def check_expert_kernel(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    model = build_model(_model(args), seed=0, dtype=torch.float32)
    layer = next(l for l in range(model.cfg.num_layers) if model.cfg.is_moe_layer(l))
    block, experts = model.decoder_layer(layer).attn_block, model.decoder_layer(layer).experts
    assert block.router is not None and experts is not None
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(args.seq_len * args.micro_batch_size, model.cfg.dim, generator=gen)
    with torch.no_grad():
        plan = flatten_routing(block.router(u))

    def run(on: torch.device, precision: Precision) -> tuple[torch.Tensor, torch.Tensor]:
        module = experts.to(on)
        x = u.to(on).clone().requires_grad_()  # a leaf of its own (its .grad is fresh)
        moved = dataclasses.replace(
            plan, **{f.name: getattr(plan, f.name).to(on) for f in dataclasses.fields(plan)}
        )
        with precision.autocast():
            y = module(x, moved)
        y.float().pow(2).sum().backward()
        assert x.grad is not None
        return y.detach().float().to(HOST), x.grad.float().to(HOST)

    fp32 = TrainConfig(dtype="float32")
    want_y, want_g = run(HOST, Precision.for_run(fp32, HOST))
    out: dict[str, Any] = {"rows": u.shape[0], "assignments": int(plan.rows_A.numel())}
    for name, train in (("float32", fp32), ("bf16_autocast", TrainConfig(dtype="bfloat16"))):
        y, g = run(device, Precision.for_run(train, device))
        out[name] = {
            "y_rel_err": float((y - want_y).abs().max() / want_y.abs().max()),
            "grad_rel_err": float((g - want_g).abs().max() / want_g.abs().max()),
        }
    experts.to(HOST)
    out["ok"] = max(out["float32"]["y_rel_err"], out["float32"]["grad_rel_err"]) < FP32_TOL
    return out


def measure_costs(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    dtype = torch.float32 if device == HOST else torch.bfloat16
    model = build_model(_model(args), seed=0, dtype=dtype).to(device)
    costs = calibrate(
        model, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size, repeats=args.repeats
    )
    synchronize(device)
    tokens = args.seq_len * args.micro_batch_size
    pairs = tokens * model.cfg.top_k
    (args.out / "compute_costs.json").write_text(costs.to_json() + "\n")
    return {
        "note": costs.note,
        "tokens": tokens,
        "assignments": pairs,
        "attn_fwd_ms": 1e3 * costs.attn_fwd(tokens),
        "attn_bwd_ms": 1e3 * costs.attn_bwd(tokens),
        "experts_fwd_ms": 1e3 * costs.expert_fwd(pairs),
        "experts_bwd_ms": 1e3 * costs.expert_bwd(pairs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", choices=DEVICES, help="auto: CUDA if any")
    parser.add_argument("--model", default="tiny", help="a model preset")
    parser.add_argument("--layers", type=int, default=2, help="cut the preset to N layers")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="training steps")
    parser.add_argument("--repeats", type=int, default=8, help="timed calls per op")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_check"))
    args = parser.parse_args(argv)
    try:
        device = resolve_device(args.device)
    except ValueError as err:
        print(f"gpu_check: error: {err}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "device": device_name(device),
        "args": {k: str(v) for k, v in vars(args).items()},
        "training": check_training(args, device),
        "expert_kernel": check_expert_kernel(args, device),
        "timings": measure_costs(args, device),
    }
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
    train, kernel, times = report["training"], report["expert_kernel"], report["timings"]
    print(f"device: {report['device']}; model {args.model}, {args.layers} layers")
    print(f"{'check':<34} {'result':>40}")
    losses = train["losses"]
    print(f"{'training bf16 (loss first -> last)':<34} {losses[0]:>19.4f} -> {losses[-1]:<10.4f}")
    for name in ("float32", "bf16_autocast"):
        errs = kernel[name]
        print(
            f"{'experts ' + name + ' vs CPU (y / dx)':<34} "
            f"{errs['y_rel_err']:>19.2e} / {errs['grad_rel_err']:<10.2e}"
        )
    for op, rows in (("attn", "tokens"), ("experts", "assignments")):
        for way in ("fwd", "bwd"):
            label = f"{op}_{way} (ms, {times[rows]} {rows})"
            print(f"{label:<34} {times[f'{op}_{way}_ms']:>19.3f}")
    ok = train["ok"] and kernel["ok"]
    print(f"{'all checks':<34} {'ok' if ok else 'FAILED':>19}; written to {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
