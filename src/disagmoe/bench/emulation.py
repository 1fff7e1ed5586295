"""Calibration of emulated compute: this machine's real attention and expert durations for
a model, as the four linear models (`costs.compute.ComputeCosts`) that emulated compute
(`models.emulated`) waits for.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from ..costs.compute import ComputeCosts, Linear
from ..device import device_name, is_accelerator, synchronize
from ..models import MoETransformer, flatten_routing
from ..models.emulated import EmulatedAttentionBlock, EmulatedExperts
from ..presets import model_preset
from .spec import BenchSpec


def calibrate(
    model: MoETransformer, *, seq_len: int, micro_batch_size: int, repeats: int = 8
) -> ComputeCosts:
    """Measure this machine's real attention and expert durations for `model` on the device
    its parameters live on (on the CPU with 1 thread; on an accelerator synchronised
    around every timed call).

    Times forward and forward+backward of the first four MoE layers' `AttentionBlock`
    at two token counts (one micro-batch and half of one) and of their `Experts` at
    two assignment counts, cycling through the layers as a runtime does, and fits
    `fixed + per_row * rows` through the two medians.
    """
    emulated = (EmulatedAttentionBlock, EmulatedExperts)
    assert not any(isinstance(m, emulated) for m in model.modules()), "calibrate a real model"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = model.cfg
        layers = [l for l in range(cfg.num_layers) if cfg.is_moe_layer(l)][:4]
        if not layers:
            raise ValueError("calibrate: the model has no MoE layer")
        # micro-batch shapes (B, S): a whole one, and half of one (fewer sequences if it
        # has several, else a shorter sequence)
        shapes = [(micro_batch_size, seq_len)]
        shapes.append(
            (micro_batch_size // 2, seq_len) if micro_batch_size > 1 else (1, max(seq_len // 2, 1))
        )
        sizes = (shapes[0][0] * shapes[0][1], shapes[1][0] * shapes[1][1])
        gen = torch.Generator().manual_seed(0)
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device

        def attn_times(shape: tuple[int, int]) -> tuple[float, float]:
            x = torch.randn(*shape, cfg.dim, generator=gen, dtype=dtype).to(device)
            cos, sin = model.rope(shape[1], x)

            def call(l: int) -> Callable[[], None]:
                out = model.decoder_layer(l).attn_block(x.detach().requires_grad_(), cos, sin)
                assert out.u_TH is not None and out.routing is not None
                outs = [out.residual_BSH, out.u_TH, out.routing.weights_TK]
                return lambda: torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])

            return _fwd_bwd_medians(call, layers, repeats, device)

        def expert_times(tokens: int) -> tuple[float, float, int]:
            u = torch.randn(tokens, cfg.dim, generator=gen, dtype=dtype).to(device)
            block = model.decoder_layer(layers[0]).attn_block
            assert block.router is not None
            with torch.no_grad():
                plan = flatten_routing(block.router(u))

            def call(l: int) -> Callable[[], None]:
                experts = model.decoder_layer(l).experts
                assert experts is not None
                y = experts(u.detach().requires_grad_(), plan)
                return lambda: y.backward(torch.ones_like(y))

            return (*_fwd_bwd_medians(call, layers, repeats, device), plan.rows_A.numel())

        a_big, a_small = attn_times(shapes[0]), attn_times(shapes[1])
        e_big, e_small = expert_times(sizes[0]), expert_times(sizes[1])
        return ComputeCosts(
            attn_fwd=_fit(sizes, (a_big[0], a_small[0])),
            attn_bwd=_fit(sizes, (a_big[1], a_small[1])),
            expert_fwd=_fit((e_big[2], e_small[2]), (e_big[0], e_small[0])),
            expert_bwd=_fit((e_big[2], e_small[2]), (e_big[1], e_small[1])),
            note=(
                f"measured: model {cfg.name}, {micro_batch_size}x{seq_len} tokens, "
                f"{device_name(device) if is_accelerator(device) else '1 thread'}, {dtype}"
            ).replace("torch.", ""),
        )
    finally:
        model.zero_grad(set_to_none=True)
        torch.set_num_threads(threads)


_WARMUP = 4  # passes over the layers before timing (allocator and caches settle)


def _fwd_bwd_medians(
    call: Callable[[int], Callable[[], None]],
    layers: list[int],
    repeats: int,
    device: torch.device,
) -> tuple[float, float]:
    """Median forward and backward seconds of `call(layer)` (runs the forward, returns the
    backward), cycling through `layers` `repeats` times after `_WARMUP` untimed passes."""
    fwd, both = [], []
    for rep in range(repeats + _WARMUP):
        for l in layers:
            synchronize(device)
            t0 = time.perf_counter()
            backward = call(l)
            synchronize(device)
            t1 = time.perf_counter()
            backward()
            synchronize(device)
            t2 = time.perf_counter()
            if rep >= _WARMUP:
                fwd.append(t1 - t0)
                both.append(t2 - t0)
    return statistics.median(fwd), statistics.median(both) - statistics.median(fwd)


def _fit(rows: tuple[int, int], secs: tuple[float, float]) -> Linear:
    """The line through two (rows, seconds) points, clamped to be non-negative."""
    (r1, r2), (s1, s2) = rows, secs
    if r1 == r2:
        return Linear(0.0, s1 / max(r1, 1))
    per_row = max((s1 - s2) / (r1 - r2), 0.0)
    return Linear(max(s1 - per_row * r1, 0.0), per_row)


def measure_compute(spec: BenchSpec, log: Any, what: str) -> ComputeCosts:
    """This machine's attention and expert durations for the bench's model (`calibrate`)."""
    from ..models import build_model

    model = build_model(model_preset(spec.model), seed=0, dtype=torch.float32)
    costs = calibrate(model, seq_len=spec.seq_len, micro_batch_size=spec.micro_batch_size)
    if log:
        log(
            f"bench: compute per micro-batch and layer (measured here, {what}): "
            f"{calibration_text(spec, costs)}"
        )
    return costs


def calibration_text(spec: BenchSpec, costs: ComputeCosts) -> str:
    """One micro-batch's attention and expert durations per layer, forward / backward, as
    `costs` (unscaled) gives them for the bench's model and micro-batch."""
    tokens = spec.seq_len * spec.micro_batch_size
    assignments = tokens * model_preset(spec.model).top_k
    return (
        f"attention {1e3 * costs.attn_fwd(tokens):.2f} / {1e3 * costs.attn_bwd(tokens):.2f} ms "
        f"fwd/bwd, experts {1e3 * costs.expert_fwd(assignments):.2f} / "
        f"{1e3 * costs.expert_bwd(assignments):.2f} ms"
    )


def prepare_emulation(spec: BenchSpec, log: Any) -> BenchSpec:
    """Measure this machine's compute once; every rank then waits those durations x scale."""
    costs = measure_compute(spec, log, f"emulated {spec.time_scale:g}x slower")
    spec.out_dir.mkdir(parents=True, exist_ok=True)
    path = (spec.out_dir / "compute_costs.json").resolve()
    path.write_text(costs.scaled(spec.time_scale).to_json())
    return dataclasses.replace(spec, costs_path=str(path))
