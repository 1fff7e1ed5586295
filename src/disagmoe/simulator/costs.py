"""Cost models: seconds per compute instruction and bytes per message.

Shapes (one micro-batch = b sequences of S tokens, N = b*S tokens, H = model dim,
q / kv = query / key-value widths, k = top-k, E experts, D_e expert width):

* FLOPs: `disagmoe.costs.flops` (the planner's formulas), per layer: the attention block
  of a dense or MoE layer, the LM head (layer L), the embedding 0; routed experts
  per (token, expert) pair, a shard of n getting `N*k/n` pairs per attention
  replica (balanced routing); backward = 2x forward for GEMMs, 2.5x for the
  attention core, 3x for a chunked loss head's GEMM (`Workload.loss_chunk_tokens`);
* messages (runtime/stages.py): a shard receives each token at most once, so an
  A replica sends shard j `u = N*(1 - C(E - E/n, k)/C(E, k))` distinct tokens
  (`act_bytes*H` each) plus `N*k/n` (weight, row, expert id) triples; combine
  and grad_dispatch move the same rows back; act / grad_act carry the residual
  `N*H` plus the per-shard token ids.

`AnalyticCosts` turns FLOPs into seconds with `peak * mfu`; `TableCosts` looks
instructions up in a table of measured times keyed by (op, comp, layer) or
(op, comp, layer kind).

Exchange chunks (`schedule.ir`, c > 1): an expert compute of one chunk is priced at its
share of the rows, `chunk_compute_s`: the whole (op, F, layer) compute / c — the ideal,
since neither the analytic model nor a table has a per-GEMM fixed cost — unless the cost
model prices a chunk itself (`ChunkCosts.chunk_s`: `simulator.measured` charges its
measured fixed cost per chunk). An exchange message of a chunk carries 1/c of the bytes
(`chunk_bytes`), so the step's compute and bytes, and with them `simulator.bound`, do
not change with c under the analytic model. `MessageOverheads` are the per-message software costs
of a host runtime (posting a send, receiving and decoding the payload, waking
the waiting lane), zero for the nominal GPU clusters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from ..config import LOSS_CHUNK_TOKENS, ClusterConfig, ModelConfig, RunConfig, TrainConfig
from ..costs import flops
from ..schedule.ir import Op

LAYER_KINDS = ("embed", "dense", "moe", "head")


@dataclass(frozen=True, slots=True)
class Workload:
    """One micro-batch of a model: FLOPs and message sizes (see the module docstring)."""

    model: ModelConfig
    seq_len: int
    micro_batch_size: int
    act_bytes: int = 2  # bf16 activations on the wire
    index_bytes: int = 4  # int32 token ids / rows / expert ids
    loss_chunk_tokens: int = (
        LOSS_CHUNK_TOKENS  # train.loss_chunk_tokens: > 0, the head's backward reruns it
    )

    def __post_init__(self) -> None:
        if self.seq_len < 1 or self.micro_batch_size < 1:
            raise ValueError("seq_len and micro_batch_size must be >= 1")

    @classmethod
    def of_run(cls, cfg: RunConfig) -> Workload:
        """The micro-batch a run of `cfg` moves: activations in its compute dtype, token ids,
        rows and expert ids as int64 (what `runtime.stages` puts on the wire); its loss head's
        chunks."""
        return cls.of_train(cfg.model, cfg.train)

    @classmethod
    def of_train(cls, model: ModelConfig, t: TrainConfig) -> Workload:
        """`of_run` for a model and a `[train]` table (what the EP layout search is given)."""
        act = {"float64": 8, "float32": 4}.get(t.dtype, 2)
        return cls(model, t.seq_len, t.micro_batch_size, act, 8, t.loss_chunk_tokens)

    @property
    def tokens(self) -> int:
        return self.seq_len * self.micro_batch_size

    def layer_kind(self, comp: str, layer: int) -> str:
        """`embed` (layer 0), `dense`, `moe` or `head` (layer L: final norm + LM head + loss)."""
        if comp == "F":
            return "moe"
        if layer == self.model.num_layers:
            return "head"
        if layer == 0:
            return "embed"
        return "moe" if self.model.is_moe_layer(layer) else "dense"

    def attn_flops(self, layer: int) -> tuple[float, float]:
        """(GEMM FLOPs, attention-core FLOPs) of the A component of `layer`, forward."""
        c = self.model
        if layer == c.num_layers:
            return flops.lm_head_flops(c, float(self.tokens)), 0.0
        moe = 1.0 if c.is_moe_layer(layer) else 0.0
        return flops.attn_flops(c, self.seq_len, self.micro_batch_size, moe=moe, dense=1.0 - moe)

    def experts_per_shard(self, shards: int) -> int:
        """Experts of the largest of `shards` shards, ceil(E/n) (`Layout.expert_range`): with
        uneven shards every shard is priced as the largest, the one a slot waits for."""
        return -(-self.model.num_experts // shards)

    def pairs_per_shard(self, shards: int) -> float:
        """Expected (token, expert) pairs one replica's micro-batch sends to one shard."""
        per = self.experts_per_shard(shards)
        return self.tokens * self.model.top_k * per / self.model.num_experts

    def tokens_per_shard(self, shards: int) -> float:
        """Expected distinct tokens one replica's micro-batch sends to one shard."""
        e, k = self.model.num_experts, self.model.top_k
        per = self.experts_per_shard(shards)
        miss = math.comb(e - per, k) / math.comb(e, k) if e - per >= k else 0.0
        return self.tokens * (1.0 - miss)

    def message_bytes(self, kind: str, layer: int, shards: int) -> float:
        """Bytes of one message of `kind` (one A replica <-> one F shard, or A -> A)."""
        h, a, i = self.model.dim, self.act_bytes, self.index_bytes
        moe = self.model.is_moe_layer(layer)
        u, pairs = self.tokens_per_shard(shards), self.pairs_per_shard(shards)
        if kind == "act":
            return self.tokens * h * a + (shards * u * i if moe else 0.0)
        if kind == "grad_act":
            return float(self.tokens * h * a)
        if kind == "dispatch":
            return u * h * a + pairs * (a + 2 * i)
        if kind in ("combine", "grad_combine"):
            return u * h * a
        if kind == "grad_dispatch":
            return u * h * a + pairs * a
        raise ValueError(f"unknown message kind {kind!r}")

    def a2a_bytes_per_peer(self, ep: int) -> float:
        """EP all-to-all: bytes one rank sends each of its ep peers, as the ep-* runtimes
        send them (`baselines.moe`): one copy of a token per peer that holds any of its
        experts. The mean of a layer's four exchanges — dispatch (rows, combine weights,
        the assignment ints), combine, and their gradients (rows; rows and weights) — since
        the simulator prices every all-to-all of a layer alike.
        """
        h, a, i = self.model.dim, self.act_bytes, self.index_bytes
        u, pairs = self.tokens_per_shard(ep), self.pairs_per_shard(ep)
        return u * h * a + pairs * (2 * a + 2 * i) / 4

    def attn_param_count(self, layer: int) -> int:
        """Parameters of the A component of `layer` (layer L: final norm + LM head; layer 0
        also holds the embedding unless it is tied to the LM head)."""
        c = self.model
        if layer == c.num_layers:
            return c.vocab_size * c.dim + c.dim
        params = flops.attn_params(c, layer)
        if layer == 0 and not c.tie_embeddings:
            params += c.vocab_size * c.dim
        return params

    def expert_param_count(self) -> int:
        """Routed-expert parameters of one MoE layer."""
        return flops.expert_params(self.model)


class InstrCosts(Protocol):
    """Seconds of one compute instruction of the AF-Pipe IR on its rank."""

    def compute_s(self, op: Op, comp: str, layer: int) -> float: ...


class ChunkCosts(Protocol):
    """A cost model that prices one of `chunks` exchange chunks of an F compute itself."""

    def chunk_s(self, op: Op, comp: str, layer: int, chunks: int) -> float: ...


def chunk_compute_s(costs: InstrCosts, op: Op, comp: str, layer: int, chunks: int) -> float:
    """Seconds of one of `chunks` exchange chunks of (op, comp, layer): the model's own
    `chunk_s` where it has one, else its share of the rows, the whole compute / chunks."""
    own = getattr(costs, "chunk_s", None)
    if own is not None:
        return float(own(op, comp, layer, chunks))
    return costs.compute_s(op, comp, layer) / chunks


def chunk_bytes(nbytes: float, chunks: int) -> float:
    """Bytes of one of `chunks` exchange chunks of a message of `nbytes` (its rows' share)."""
    return nbytes / chunks


def weight_grad_s(costs: InstrCosts, workload: Workload, comp: str, layer: int) -> float:
    """Seconds of the weight-gradient part of (comp, layer)'s backward under `costs`: the
    forward's GEMM share of its forward seconds (an expert compute is all GEMM; attention's
    GEMM share by FLOPs, `Workload.attn_flops`), never more than the backward; attention
    layer 0's whole backward (its BWD sends nothing, so all of it is deferred)."""
    backward = costs.compute_s(Op.BWD, comp, layer)
    if comp == "A" and layer == 0:
        return backward
    forward = costs.compute_s(Op.FWD, comp, layer)
    if comp == "A":
        gemm, core = workload.attn_flops(layer)
        forward *= gemm / (gemm + core) if gemm + core > 0 else 0.0
    return min(forward, backward)


@dataclass(frozen=True, slots=True)
class AnalyticCosts:
    """FLOPs / (peak * mfu). `attn_workers` / `expert_workers` set the F shard's load;
    `recompute` (none | attn | full, `train.recompute`) adds to every backward one forward
    of what it recomputes (`flops.backward_factors`), on the layers of `recomputed` only
    where given (`train.recompute_layers`, `costmodel.group_recomputed`)."""

    workload: Workload
    flops_per_s: float
    attn_workers: int = 1
    expert_workers: int = 1
    recompute: str = "none"
    recomputed: frozenset[int] | None = None

    @classmethod
    def for_cluster(
        cls,
        workload: Workload,
        cluster: ClusterConfig,
        attn_workers: int = 1,
        expert_workers: int = 1,
        recompute: str = "none",
        recomputed: frozenset[int] | None = None,
    ) -> AnalyticCosts:
        rate = cluster.peak_tflops * 1e12 * cluster.mfu
        return cls(workload, rate, attn_workers, expert_workers, recompute, recomputed)

    def mode(self, layer: int) -> str:
        """The recompute mode of `layer` (`flops.layer_recompute`)."""
        return flops.layer_recompute(self.recompute, self.recomputed, layer)

    def attn_s(self, op: Op, layer: int) -> float:
        gemm, core = self.workload.attn_flops(layer)
        if op == Op.BWD:
            gemm_factor, core_factor = flops.backward_factors(self.mode(layer))
            if layer == self.workload.model.num_layers:
                gemm_factor += flops.head_backward_extra(self.workload.loss_chunk_tokens)
            gemm, core = gemm_factor * gemm, core_factor * core
        return (gemm + core) / self.flops_per_s

    def expert_s(self, op: Op, pairs: float, layer: int = -1) -> float:
        """`pairs` of a MoE layer's experts (`layer` -1: any, at the run's mode)."""
        mode = self.recompute if layer < 0 else self.mode(layer)
        factor = flops.backward_factors(mode)[0] if op == Op.BWD else 1.0
        return flops.expert_flops(self.workload.model, pairs) * factor / self.flops_per_s

    def compute_s(self, op: Op, comp: str, layer: int) -> float:
        if op == Op.WGT:  # the weight-gradient part of the backward
            return weight_grad_s(self, self.workload, comp, layer)
        if comp == "A":
            return self.attn_s(op, layer)
        pairs = self.attn_workers * self.workload.pairs_per_shard(self.expert_workers)
        return self.expert_s(op, pairs, layer)


@dataclass(frozen=True, slots=True)
class TableCosts:
    """Measured seconds per (op "F"/"B", comp "A"/"F", layer kind), e.g. means of a trace.

    `layers` (keyed by (op, comp, layer index)) takes precedence where it has an entry.
    """

    workload: Workload
    table: dict[tuple[str, str, str], float]
    layers: dict[tuple[str, str, int], float] = field(default_factory=dict)

    def compute_s(self, op: Op, comp: str, layer: int) -> float:
        exact = self.layers.get((op.value, comp, layer))
        if exact is not None:
            return exact
        key = (op.value, comp, self.workload.layer_kind(comp, layer))
        if key not in self.table:
            raise ValueError(
                f"cost table has no entry for {key}; measured keys: {sorted(self.table)}"
            )
        return self.table[key]


@dataclass(frozen=True, slots=True)
class MessageOverheads:
    """Per-message software costs of a runtime on a host (fit from a real trace).

    * `post_s`: the producing lane encodes the header, flattens the payload and
      posts the `isend`s before it may start its next instruction;
    * `recv_s + recv_s_per_byte * bytes`: the receiver's stream thread takes the
      payload off the wire and decodes it (one message at a time per stream);
    * `handoff_s`: from the message in the mailbox to the waiting lane running.
    """

    post_s: float = 0.0
    recv_s: float = 0.0
    recv_s_per_byte: float = 0.0
    handoff_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.post_s, self.recv_s, self.recv_s_per_byte, self.handoff_s) < 0:
            raise ValueError("message overheads must be >= 0")

    @property
    def any(self) -> bool:
        return max(self.post_s, self.recv_s, self.recv_s_per_byte, self.handoff_s) > 0

    def receive_s(self, nbytes: float) -> float:
        return self.recv_s + self.recv_s_per_byte * nbytes + self.handoff_s
