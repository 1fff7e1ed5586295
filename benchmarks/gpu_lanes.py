"""Can a worker's forward and backward lanes overlap on one GPU? Measured, not assumed.

    python benchmarks/gpu_lanes.py --model qwen3-30b-a3b --seq-len 8192 \\
        --out benchmarks/results/gpu_lanes.json

The executor (`runtime.executor`) runs a worker's forward and backward computes on two
threads, each with a stream of its own (`runtime.streams`). Autograd, though, queues each
backward kernel on the stream its forward op ran on, so a backward issued from the
backward lane still lands on the forward lane's stream. This script runs the attention
block of one MoE layer (a preset's real widths, bf16) three ways and times them with
events:

* **serial**: forward of micro-batch 2 after backward of micro-batch 1, one stream;
* **lane streams** (the executor today): micro-batch 1's forward ran on the "fwd" stream;
  its backward is issued from a second thread whose current stream is "bwd", while the
  first thread runs micro-batch 2's forward on "fwd";
* **micro-batch streams**: micro-batch 1's forward ran on a stream of its own, so its
  backward runs there, beside micro-batch 2's forward on another.

For each: the wall time of the pair, the overlap it got (`(fwd + bwd - pair) /
min(fwd, bwd)`, 0 = serial, 1 = the shorter fully hidden), the input gradient against
the serial one (must be equal: concurrency changes no arithmetic), and from a profiler
trace the streams the backward's kernels ran on. One device; `--device cpu` runs the same
code with no streams (a dry run of the script: every overlap is 0 there).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from disagmoe.config import DEVICES
from disagmoe.device import device_name, resolve_device, synchronize
from disagmoe.models import build_model
from disagmoe.presets import model_preset


def _block(args: argparse.Namespace, device: torch.device) -> tuple[Any, Callable[..., Any]]:
    cfg = model_preset(args.model)
    cfg = dataclasses.replace(cfg, num_layers=2, num_dense_layers=min(cfg.num_dense_layers, 1))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(cfg, seed=0, dtype=dtype).to(device)
    layer = next(l for l in range(cfg.num_layers) if cfg.is_moe_layer(l))
    block = model.decoder_layer(layer).attn_block
    cos, sin = model.rope(args.seq_len, torch.empty(0, dtype=dtype, device=device))

    def forward(x: torch.Tensor) -> list[torch.Tensor]:
        out = block(x, cos, sin)
        return [out.residual_BSH, out.u_TH, out.routing.weights_TK]

    return cfg, forward


class _Clock:
    """Wall time of work queued on several streams: events on the device, else the host."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def stream(self) -> Any:
        return torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def on(self, stream: Any) -> Any:
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    def now(self) -> Any:
        synchronize(self.device)
        return time.perf_counter()

    def since(self, t0: Any) -> float:
        synchronize(self.device)
        return time.perf_counter() - t0


def _run(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    cfg, forward = _block(args, device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(1, args.seq_len, cfg.dim, generator=gen, dtype=dtype) for _ in range(2)]
    xs = [x.to(device) for x in xs]
    clock = _Clock(device)
    s_fwd, s_bwd, s_other = clock.stream(), clock.stream(), clock.stream()

    def fwd(x: torch.Tensor, stream: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with clock.on(stream):
            leaf = x.detach().requires_grad_()
            return leaf, forward(leaf)

    def bwd(outs: list[torch.Tensor], stream: Any) -> None:
        with clock.on(stream):
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])

    def pair(f_stream: Any, b_stream: Any, mb1_stream: Any, threads: bool) -> tuple[float, Any]:
        """mb1's forward on `mb1_stream` (untimed), then mb2's forward on `f_stream` and
        mb1's backward issued with `b_stream` current: the wall time of the two, and
        mb1's input gradient."""
        leaf1, outs1 = fwd(xs[0], mb1_stream)
        t0 = clock.now()
        if threads:
            worker = threading.Thread(target=bwd, args=(outs1, b_stream))
            worker.start()
            fwd(xs[1], f_stream)
            worker.join()
        else:
            bwd(outs1, b_stream)
            fwd(xs[1], f_stream)
        return clock.since(t0), leaf1.grad

    def alone(kind: str) -> float:
        _, outs = fwd(xs[0], s_fwd)
        t0 = clock.now()
        if kind == "fwd":
            fwd(xs[1], s_fwd)
        else:
            bwd(outs, s_fwd)
        return clock.since(t0)

    ways = {
        "serial": (s_fwd, s_fwd, s_fwd, False),
        "lane_streams": (s_fwd, s_bwd, s_fwd, True),
        "micro_batch_streams": (s_fwd, s_other, s_other, True),
    }
    for _ in range(2):  # warm-up: kernels, allocator, autotuning
        for way in ways.values():
            pair(*way)
    fwd_s = statistics.median(alone("fwd") for _ in range(args.repeats))
    bwd_s = statistics.median(alone("bwd") for _ in range(args.repeats))
    _, want = pair(*ways["serial"])
    out: dict[str, Any] = {"fwd_ms": 1e3 * fwd_s, "bwd_ms": 1e3 * bwd_s, "ways": {}}
    for name, way in ways.items():
        times, same = [], True
        for _ in range(args.repeats):
            t, grad = pair(*way)
            times.append(t)
            same = same and bool(torch.equal(grad, want))
        wall = statistics.median(times)
        out["ways"][name] = {
            "pair_ms": 1e3 * wall,
            "overlap": (fwd_s + bwd_s - wall) / min(fwd_s, bwd_s),
            "grad_equal_to_serial": same,
            "backward_streams": _backward_streams(pair, way, device),
        }
    return out


def _backward_streams(pair: Callable[..., Any], way: tuple[Any, ...], device: torch.device) -> Any:
    """Kernels per stream id while the pair runs (profiler trace): which stream ran what."""
    if device.type != "cuda":
        return None
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        pair(*way)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    counts: dict[str, int] = {}
    for ev in events:
        if ev.get("cat") == "kernel":
            stream = str(ev.get("args", {}).get("stream", "?"))
            counts[stream] = counts.get(stream, 0) + 1
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", choices=DEVICES, help="auto: CUDA if any")
    parser.add_argument("--model", default="qwen3-30b-a3b", help="a model preset")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_lanes.json"))
    args = parser.parse_args(argv)
    try:
        device = resolve_device(args.device)
    except ValueError as err:
        print(f"gpu_lanes: error: {err}", file=sys.stderr)
        return 2
    result = {"device": device_name(device), "args": {k: str(v) for k, v in vars(args).items()}}
    result.update(_run(args, device))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"device: {result['device']}; {args.model} attention block, {args.seq_len} tokens")
    print(f"fwd alone {result['fwd_ms']:.3f} ms, bwd alone {result['bwd_ms']:.3f} ms")
    print(f"{'way':<22} {'pair ms':>9} {'overlap':>8} {'grad = serial':>14}  kernels per stream")
    for name, row in result["ways"].items():
        print(
            f"{name:<22} {row['pair_ms']:>9.3f} {row['overlap']:>8.2f} "
            f"{row['grad_equal_to_serial']!s:>14}  {row['backward_streams']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
