"""Emulated compute: the model's heavy math replaced by calibrated waits.

`emulate_compute(module, costs)` turns every `AttentionBlock` and `Experts` under
`module` into `EmulatedAttentionBlock` / `EmulatedExperts`: they do not compute;
each sleeps for its cost-model duration in forward and in backward and returns
tensors of the right shapes (the attention output is its input; routing is uniformly
random top-k; expert outputs are their inputs). Everything else is real: the
runtimes' code, the messages and their sizes, the optimizer. A sleeping lane holds
no CPU and releases the GIL, as a GPU kernel would, so many workers fit on a few
cores and what is measured is the runtime's overlap of compute and communication,
not the CPU's arithmetic. Losses and gradients are meaningless.

One device per worker: a worker process has one `DEVICE`, and its waits take turns on it
(a lock), as kernels of one GPU share its compute units; communication overlaps freely.
An AF-Pipe worker's forward and backward lanes may both be inside a computation, but
never both inside a calibrated wait. The time a lane waits for the device is added to its
thread's device waits (`runtime.observe.add_device_wait`): the executor traces it with
the computation (`device_wait_us`), whose own seconds are its span less that wait.

Durations are `fixed + per_row * rows` seconds (rows: tokens for attention,
(token, expert) assignments for experts), usually measured on this machine with
`calibrate` and multiplied by a time scale (see `disagmoe bench --compute emulated`).
A runtime applies the swap to the modules it runs when `train.emulate_compute`
names a costs file (`runtime.setup.apply_variants`).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..device import device_name, is_accelerator, synchronize
from ..models import (
    Assignments,
    AttentionBlock,
    AttnOutput,
    Experts,
    MoETransformer,
    Routing,
    flatten_routing,
)
from ..runtime.observe import add_device_wait
from ..simulator.measured import ComputeCosts, Linear


@dataclass
class Device:
    """The one accelerator of a worker process: emulated computations hold it in turn."""

    lock: threading.Lock = field(default_factory=threading.Lock)

    def occupy(self, seconds: float) -> None:
        """Hold the device for `seconds` (sleeping: no CPU, the GIL released); the time
        spent waiting for it first is this thread's device wait."""
        if seconds <= 0.0:
            return
        if not self.lock.acquire(blocking=False):
            t0 = time.perf_counter()
            self.lock.acquire()
            add_device_wait((time.perf_counter() - t0) * 1e6)
        try:
            time.sleep(seconds)
        finally:
            self.lock.release()


DEVICE = Device()  # this process's worker (one worker per process, as torchrun starts them)


class _Wait(torch.autograd.Function):
    """Identity that holds the device `fwd_s` in forward and `bwd_s` in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd_s: float, bwd_s: float) -> torch.Tensor:  # type: ignore[override]
        ctx.bwd_s = bwd_s
        DEVICE.occupy(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        DEVICE.occupy(ctx.bwd_s)
        return grad, None, None


def wait(x: torch.Tensor, fwd_s: float, bwd_s: float) -> torch.Tensor:
    """`x`, after `fwd_s` seconds; its gradient passes back after `bwd_s` seconds."""
    return _Wait.apply(x, fwd_s, bwd_s)  # type: ignore[no-any-return]


def random_top_k(
    rows: int, num_experts: int, top_k: int, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniformly random distinct top-k experts per row, equal weights tied to `like`.

    The weights depend on `like` (times zero) so that they have a gradient path,
    as the router's weights do.
    """
    indices = torch.rand(rows, num_experts).topk(top_k, dim=-1).indices
    weights = torch.full((rows, top_k), 1.0 / top_k, dtype=like.dtype)
    weights = weights + like.reshape(rows, -1)[:, :1] * 0.0
    return indices, weights


class EmulatedAttentionBlock(AttentionBlock):
    """An `AttentionBlock` that waits instead of computing (made by `emulate_compute`).

    Its output is its input after `costs.attn_fwd(T)` seconds, with uniformly random
    top-k routing on MoE layers; gradients flow back to the input after
    `costs.attn_bwd(T)` seconds. Its parameters stay, unused (their gradients are
    zero-filled by the runtime).
    """

    costs: ComputeCosts
    recompute: str = "none"

    def forward(
        self, x_BSH: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor
    ) -> AttnOutput:
        T = x_BSH.shape[0] * x_BSH.shape[1]
        fwd = self.costs.attn_fwd(T)
        h = wait(x_BSH, fwd, self.costs.attn_bwd(T) + (fwd if self.recompute == "full" else 0.0))
        if self.router is None:
            return AttnOutput(residual_BSH=h, u_TH=None, routing=None, aux=None)
        u_TH = h.reshape(T, h.shape[-1])
        indices, weights = random_top_k(T, self.num_experts, self.router.top_k, u_TH)
        probs = torch.zeros(T, self.num_experts, dtype=h.dtype)
        routing = Routing(indices_TK=indices, weights_TK=weights, probs_TE=probs)
        return AttnOutput(residual_BSH=h, u_TH=u_TH, routing=routing, aux=h.sum() * 0.0)


class EmulatedExperts(Experts):
    """`Experts` that wait instead of computing (made by `emulate_compute`): the output is
    the input after `costs.expert_fwd(A)` seconds for A assignments; the combine
    weights keep a gradient path, as the real combine's do."""

    costs: ComputeCosts
    recompute: str = "none"

    def forward(self, x_RH: torch.Tensor, plan: Assignments) -> torch.Tensor:
        A = plan.rows_A.numel()
        fwd = self.costs.expert_fwd(A)
        y = wait(x_RH, fwd, self.costs.expert_bwd(A) + (fwd if self.recompute == "full" else 0.0))
        return y + plan.weights_A.sum() * 0.0


def emulate_compute(module: nn.Module, costs: ComputeCosts, recompute: str = "none") -> None:
    """Make every `AttentionBlock` and `Experts` under `module` (itself included) wait
    `costs` instead of computing. With `recompute` "full" each backward also waits the
    forward's duration (the forward a real run reruns, `models.recompute`); the calibrated
    costs do not separate the attention core, so "attn" is not emulated.

    In place: each such module changes class to its emulated variant (as FSDP2's
    `fully_shard` does), so it stays the same object with the same parameters and
    submodules — parameter names, optimizer state and checkpoints are unchanged, and
    every holder of a reference (the model, a worker's parts) sees the swap. Modules
    built later from these (e.g. `Experts.narrow`) are real again: swap the modules a
    worker runs once it has built them.
    """
    for sub in module.modules():
        if isinstance(sub, AttentionBlock):
            sub.__class__ = EmulatedAttentionBlock
        elif isinstance(sub, Experts):
            sub.__class__ = EmulatedExperts
        if isinstance(sub, EmulatedAttentionBlock | EmulatedExperts):
            sub.costs = costs
            sub.recompute = recompute


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
