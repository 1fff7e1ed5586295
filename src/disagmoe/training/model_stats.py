"""What the model did in one training step, for metrics.jsonl: routing and achieved FLOP/s.

Routing, per MoE layer (in layer order), over the whole global batch:

* `load_imbalance` — `max_e c_e / mean_e c_e`, where `c_e` counts the (token, expert)
  assignments of expert e (1.0: perfectly even; E/k, the most: every token on the same
  k experts);
* `router_entropy` — the entropy (nats) of the router's softmax over all E experts, averaged
  over the tokens (`log E` for a uniform router, 0 for a one-hot one);
* `expert_tokens`  — the counts `c_e` themselves, a list of E integers per MoE layer, only
  with `train.log_expert_tokens` (Qwen3-MoE's 48 x 128 would be ~25 KB a step).

How they are gathered: each router records into its `models.moe.RoutingStats` while the
loop has `StepStats.recording` on (a training step; not recompute reruns, not evaluation),
on its own device, with no host read until the step is over. Then every rank writes one
float64 row per MoE layer — counts, entropy sum, tokens — zeros for layers it does not
hold, into the tail of the loop's per-step statistics tensor, and the loop's one
all-reduce sums them: replicas (disagg's m attention replicas, the baselines' data
parallel ranks) route disjoint micro-batches, so the sum is the global batch's. Counts
stay exact in float64 (integers below 2**53).

FLOP/s: `flops.train_step_flops` of the global batch with the measured assignments of
each layer (equal to tokens x top_k: the router is dropless), forward + backward without
activation recompute (the MFU convention), divided by the step's wall time:
`flops_per_s` for the job, `flops_per_s_per_worker` (the job's / world size) and `mfu`
(the job's / (world size x `cluster.peak_tflops`)). `mfu` is null on CPU: the cluster
preset's peak is a GPU's, and a ratio against it would mean nothing there.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..config import RunConfig
from ..costs.flops import train_step_flops
from ..device import is_accelerator
from ..models import Router

_ROUTER_NAME = re.compile(r"(?:.*\.)?layers\.(\d+)\.attn_block\.router")


class StepStats:
    """The routers of one rank's modules, and the step records made from their sums."""

    def __init__(self, cfg: RunConfig, modules: Iterable[nn.Module]) -> None:
        self.cfg = cfg
        model = cfg.model
        self.moe_layers = [l for l in range(model.num_layers) if model.is_moe_layer(l)]
        self.num_experts = model.num_experts
        self.width = self.num_experts + 2  # counts, entropy sum, tokens
        self.routers: dict[int, Router] = {}
        self.on_gpu = False
        for module in modules:
            for name, sub in module.named_modules():
                if isinstance(sub, Router):
                    match = _ROUTER_NAME.fullmatch(name)
                    assert match is not None, f"a router outside layers.L.attn_block: {name}"
                    self.routers[int(match.group(1))] = sub
            self.on_gpu |= any(is_accelerator(p.device) for p in module.parameters())

    @property
    def size(self) -> int:
        """Float64 entries this adds to the per-step all-reduce."""
        return len(self.moe_layers) * self.width

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Routers record while inside (sums from zero): wrap the training step only."""
        for router in self.routers.values():
            router.stats.reset()
            router.stats.recording = True
        try:
            yield
        finally:
            for router in self.routers.values():
                router.stats.recording = False

    def fill(self, out: torch.Tensor) -> None:
        """Write this rank's sums into `out` (`size` float64 zeros): one host read in all."""
        assert out.shape == (self.size,) and out.dtype == torch.float64, out.shape
        rows, parts = [], []
        for i, layer in enumerate(self.moe_layers):
            stats = self.routers[layer].stats if layer in self.routers else None
            if stats is None or stats.counts_E is None or stats.entropy_sum is None:
                continue
            rows.append(i)
            tokens = torch.full(
                (1,), float(stats.num_tokens), dtype=torch.float64, device=stats.counts_E.device
            )
            parts.append(torch.cat([stats.counts_E.double(), stats.entropy_sum.view(1), tokens]))
        if parts:
            view = out.view(len(self.moe_layers), self.width)
            view[rows] = torch.stack(parts).to(out.device)

    def record(self, totals: torch.Tensor, step_time_s: float, world: int) -> dict[str, Any]:
        """The metrics.jsonl fields of a step from the world's sums of `fill` (`totals`).

        A layer that recorded no token (emulated compute: `models.emulated` routes without
        the router) has null imbalance and entropy, and counts top_k per token for FLOPs.
        """
        train, model = self.cfg.train, self.cfg.model
        rows = totals.view(len(self.moe_layers), self.width).tolist()
        nominal = float(train.seq_len * train.global_batch_size * model.top_k)
        imbalance: list[float | None] = []
        entropy: list[float | None] = []
        pairs: list[float] = []
        for row in rows:
            counts, entropy_sum, tokens = row[: self.num_experts], row[-2], row[-1]
            mean = sum(counts) / self.num_experts
            seen = tokens > 0 and mean > 0
            imbalance.append(max(counts) / mean if seen else None)
            entropy.append(entropy_sum / tokens if seen else None)
            pairs.append(float(sum(counts)) if seen else nominal)
        out: dict[str, Any] = {"load_imbalance": imbalance, "router_entropy": entropy}
        if train.log_expert_tokens:
            out["expert_tokens"] = [[int(c) for c in row[: self.num_experts]] for row in rows]
        flops = train_step_flops(model, train.seq_len, train.global_batch_size, pairs)
        flops_per_s = flops / step_time_s if step_time_s > 0 else 0.0
        out["model_flops"] = flops
        out["flops_per_s"] = flops_per_s
        out["flops_per_s_per_worker"] = flops_per_s / world
        peak = world * self.cfg.cluster.peak_tflops * 1e12
        out["mfu"] = flops_per_s / peak if self.on_gpu else None
        return out
