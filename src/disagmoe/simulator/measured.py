"""Measured per-op costs for the simulator: the bench's calibration file, priced per layout.

The file (`compute_costs.json`, written by `disagmoe bench --compute emulated`'s
calibration and by `benchmarks/gpu_check.py`) holds four linear models of one layer,
`fixed + per_row * rows` seconds: the attention block forward and backward per token,
the experts of one worker forward and backward per (token, expert) assignment
(`ComputeCosts`). The runtime's emulated compute sleeps for them (`models.emulated`);
here `MeasuredCosts` turns them into the simulator's `InstrCosts` for a given layout:

* A of a MoE layer: `attn_fwd(tokens)`, `attn_bwd(tokens)` for the micro-batch's tokens;
* A of a dense layer, of layer 0 (embedding) and of layer L (final norm, LM head, loss):
  the MoE layer's time scaled by its forward FLOPs over a MoE layer's attention block
  (`disagmoe.costs.flops`; the file measures only the MoE layer's block);
* F: `expert_fwd(pairs)`, `expert_bwd(pairs)` with `pairs` = the (token, expert)
  assignments one shard receives from the m replicas' micro-batch (`Workload`);
* activation recompute adds one forward to each backward (`full`), or the attention
  core's FLOP share of the attention forward (`attn`);
* an exchange chunk of an F compute (`schedule.ir`; `MeasuredCosts.chunk_s`): the linear
  model at the chunk's share of the pairs, so each of the c chunks pays the measured
  fixed cost — a chunked step costs `(c - 1) * fixed` more per expert compute than the
  unchunked one.

`MeasuredCosts.bound_to(workload, m, n, recompute)` gives the costs of one layout, so one
file serves every plan the planner scores (`disagmoe plan --costs-file`, `simulate --costs-file`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..costs import flops
from ..costs.compute import ComputeCosts
from ..schedule.ir import Op
from .costs import Workload, weight_grad_s


@dataclass(frozen=True, slots=True)
class MeasuredCosts:
    """`InstrCosts` from a `ComputeCosts` file for one layout (module doc)."""

    units: ComputeCosts
    workload: Workload | None = None  # None until `bound_to` (the simulator binds it)
    attn_workers: int = 1
    expert_workers: int = 1
    recompute: str = "none"
    recomputed: frozenset[int] | None = None  # the layers `recompute` covers (None: all)

    @classmethod
    def load(cls, path: str | Path) -> MeasuredCosts:
        return cls(ComputeCosts.load(path))

    def bound_to(
        self,
        workload: Workload,
        attn_workers: int,
        expert_workers: int,
        recompute: str,
        recomputed: frozenset[int] | None = None,
    ) -> MeasuredCosts:
        flops.backward_factors(recompute)  # validates the mode
        return dataclasses.replace(
            self, workload=workload, attn_workers=attn_workers,
            expert_workers=expert_workers, recompute=recompute, recomputed=recomputed,
        )  # fmt: skip

    def mode(self, layer: int) -> str:
        """The recompute mode of `layer` (`flops.layer_recompute`)."""
        return flops.layer_recompute(self.recompute, self.recomputed, layer)

    def _attn_fwd_bwd(self, layer: int) -> tuple[float, float]:
        w = self.workload
        assert w is not None, "MeasuredCosts.bound_to first"
        fwd, bwd = self.units.attn_fwd(w.tokens), self.units.attn_bwd(w.tokens)
        gemm, core = w.attn_flops(layer)
        if w.layer_kind("A", layer) != "moe":
            ref_gemm, ref_core = flops.attn_flops(
                w.model, w.seq_len, w.micro_batch_size, moe=1.0, dense=0.0
            )
            scale = (gemm + core) / (ref_gemm + ref_core)
            fwd, bwd = fwd * scale, bwd * scale
        mode = self.mode(layer)
        if mode == "full":
            bwd += fwd
        elif mode == "attn" and gemm + core > 0:
            bwd += fwd * core / (gemm + core)
        return fwd, bwd

    def compute_s(self, op: Op, comp: str, layer: int) -> float:
        return self._compute_s(op, comp, layer, 1)

    def chunk_s(self, op: Op, comp: str, layer: int, chunks: int) -> float:
        """One of `chunks` exchange chunks of an F compute: its share of the pairs, priced
        with the measured fixed cost (module doc)."""
        return self._compute_s(op, comp, layer, chunks)

    def _compute_s(self, op: Op, comp: str, layer: int, chunks: int) -> float:
        w = self.workload
        assert w is not None, "MeasuredCosts.bound_to first"
        if op == Op.WGT:  # the weight-gradient part of the backward (`costs.weight_grad_s`)
            if comp == "F":  # one chunk's forward GEMMs, its fixed cost included
                fwd, bwd = (self._compute_s(o, comp, layer, chunks) for o in (Op.FWD, Op.BWD))
                return min(fwd, bwd)
            return weight_grad_s(self, w, comp, layer) / chunks
        if comp == "A":
            fwd, bwd = self._attn_fwd_bwd(layer)
            return (fwd if op == Op.FWD else bwd) / chunks
        pairs = round(self.attn_workers * w.pairs_per_shard(self.expert_workers) / chunks)
        fwd = self.units.expert_fwd(pairs)
        if op == Op.FWD:
            return fwd
        return self.units.expert_bwd(pairs) + (fwd if self.mode(layer) == "full" else 0.0)
