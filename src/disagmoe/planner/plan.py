"""The `Plan`, the `Planner` that checks and prices one, and the analytic pipeline profile
(stages 1-2 over groups / recompute choices: `planner.seed`); the options in
`planner.options`.

A plan fixes, for W GPUs of a cluster:
* p groups (p divides the layer count and W), v = L/p virtual stages per group;
* per group m attention GPUs (data-parallel replicas), n FFN GPUs (expert shards) and the
  group's NIC share N_g = M_tot/(2p) split into M_a + M_f;
* the number of micro-batches per step and how many may be in flight (memory-limited).

Units: `micro_batch_size` b counts sequences per attention replica, so a *group micro-batch*
is m*b sequences (the design's b is this m*b). Stage times are for one layer of one group
micro-batch; in the full model they cover forward + backward, in `roofline_only` the forward.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import disagmoe.costs.costmodel as cm
import disagmoe.costs.runtime_memory as rm
from disagmoe.config import (
    ClusterConfig,
    ModelConfig,
)
from disagmoe.costs import flops
from disagmoe.planner.milp import SplitProblem
from disagmoe.planner.options import PlanOptions

from ..training.budget import GPU_PRECISION, most_in_flight

Profile = Callable[["Plan"], float]  # seconds per training step of the plan


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """An allocation. Counts named `attn_gpus` etc. are totals over all groups."""

    model: str
    cluster: str
    gpus: int
    nics: int
    seq_len: int
    micro_batch_size: int
    loss_chunk_tokens: int  # train.loss_chunk_tokens priced (PlanOptions'; 0: unchunked head)
    groups: int
    virtual_stages: int
    micro_batches: int
    in_flight: int
    recompute: str
    attn_gpus_per_group: int
    ffn_gpus_per_group: int
    attn_nics_per_group: int
    ffn_nics_per_group: int
    t_attn_compute_s: float
    t_attn_comm_s: float
    t_ffn_compute_s: float
    t_ffn_comm_s: float
    i_attn: float  # FLOP per exchanged byte of the cost model in use
    i_ffn: float
    ridge: float  # FLOP per byte where a GPU with its NIC share turns compute-bound
    mem_attn_gib: float
    mem_ffn_gib: float
    mem_cap_gib: float
    binding: str  # the term that sets this plan's stage time
    memory_binding: str  # "" or what caps the in-flight micro-batches
    roofline_only: bool
    solver: str
    stage: str  # "milp" (stages 1-2), "search" (stage 3) or "batch" (stage 4's micro-batches)
    step_time_s: float  # the profile's seconds per step
    stage1_gap: float = 0.0  # tau / Stage 1 optimum - 1 (<= PlanOptions.epsilon from stage 2)
    profile: str = "analytic"  # what scored step_time_s: "analytic" or "simulator"
    schedule: str = ""  # the AF-Pipe order and exchange chunks the simulator replayed
    global_batch: int = 0  # PlanOptions.global_batch: the sequences a step trains (0: all slots)
    # train.recompute_layers with recompute full: only each group's first K layers (0: all)
    recompute_layers: int = 0

    @property
    def attn_gpus(self) -> int:
        return self.groups * self.attn_gpus_per_group

    @property
    def ffn_gpus(self) -> int:
        return self.groups * self.ffn_gpus_per_group

    @property
    def attn_nics(self) -> int:
        return self.groups * self.attn_nics_per_group

    @property
    def ffn_nics(self) -> int:
        return self.groups * self.ffn_nics_per_group

    @property
    def t_attn_s(self) -> float:
        return max(self.t_attn_compute_s, self.t_attn_comm_s)

    @property
    def t_ffn_s(self) -> float:
        return max(self.t_ffn_compute_s, self.t_ffn_comm_s)

    @property
    def t_stage_s(self) -> float:
        return max(self.t_attn_s, self.t_ffn_s)

    @property
    def recompute_label(self) -> str:
        """The recompute as `plan` and `train --plan auto` print it."""
        if self.recompute_layers:
            return f"{self.recompute} on {self.recompute_layers} layer(s) per group"
        return self.recompute

    @property
    def sequences_per_step(self) -> int:
        return (
            self.global_batch
            or self.micro_batches * self.attn_gpus_per_group * self.micro_batch_size
        )

    @property
    def simulated_step_s(self) -> float | None:
        """The simulator's seconds per step when it scored this plan, else None."""
        return self.step_time_s if self.profile == "simulator" else None

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["simulated_step_s"] = self.simulated_step_s
        for name in ("attn_gpus", "ffn_gpus", "attn_nics", "ffn_nics", "t_attn_s", "t_ffn_s",
                     "t_stage_s", "sequences_per_step"):  # fmt: skip
            out[name] = getattr(self, name)
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class Planner:
    """Everything a plan is computed from; `evaluate` turns choices into a checked `Plan`."""

    model: ModelConfig
    cluster: ClusterConfig
    gpus: int
    seq_len: int
    micro_batch_size: int
    options: PlanOptions = dataclasses.field(default_factory=PlanOptions)

    def __post_init__(self) -> None:
        if self.gpus < 2:
            raise ValueError(
                f"--gpus must be >= 2 (one attention and one FFN GPU), got {self.gpus}"
            )
        if self.seq_len < 1 or self.micro_batch_size < 1:
            raise ValueError("--seq-len and --micro-batch-size must be >= 1")
        if self.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"--seq-len {self.seq_len} exceeds {self.model.name}'s max_seq_len "
                f"({self.model.max_seq_len})"
            )
        if self.options.global_batch % self.micro_batch_size:
            raise ValueError(
                f"the global batch ({self.options.global_batch} sequences) must be a multiple "
                f"of --micro-batch-size ({self.micro_batch_size})"
            )

    @property
    def total_nics(self) -> int:
        return self.gpus * self.cluster.nics_per_node // self.cluster.gpus_per_node

    @property
    def cap_bytes(self) -> float:
        """The memory budget per GPU: the cluster preset's, all of it, as `train` takes it on
        GPU (`training.budget.default_memory_gib` with `train.memory_gib` 0)."""
        return self.cluster.gpu_mem_gib * cm.GIB

    def group_candidates(self) -> list[int]:
        if self.options.roofline_only:
            return [1]
        if self.options.groups:
            p = self.options.groups
            if self.model.num_layers % p or self.gpus % p:
                raise ValueError(
                    f"groups: p={p} must divide num_layers ({self.model.num_layers}) and "
                    f"--gpus ({self.gpus})"
                )
            return [p]
        layers = self.model.num_layers
        return [p for p in range(1, layers + 1) if layers % p == 0 and self.gpus % p == 0]

    def micro_batches(self, groups: int, m: int = 0) -> int:
        """Micro-batches per replica: the user's count; with a global batch, what each of
        the `m` replicas runs of it; else the smallest >= the ring length with bubble <=
        bubble_target."""
        if self.options.micro_batches:
            return self.options.micro_batches
        if self.options.global_batch:
            if m < 1:
                raise ValueError("a global batch is shared by the m replicas: give m >= 1")
            return -(-self.options.global_batch // (m * self.micro_batch_size))
        v = self.model.num_layers // groups
        need = (2 * groups - 1) / (v * self.options.bubble_target)
        return max(ring_length(groups), math.ceil(need - 1e-9))

    def units(self, groups: int, recompute: str) -> cm.UnitTimes:
        return cm.unit_times(
            self.model, self.cluster, self.seq_len, roofline_only=self.options.roofline_only,
            groups=groups, recompute=recompute,
        )  # fmt: skip

    def attn_memory(
        self, groups: int, in_flight: int, recompute: str, shards: int = 0, layers: int = 0
    ) -> cm.MemoryBreakdown:
        """The worst attention replica by the runtime's model (`costs.runtime_memory`, in
        `GPU_PRECISION`) for `shards` expert shards per group (0, n not known: the bound
        of n = E, every token's top-k experts on k shards); `layers`:
        `train.recompute_layers`."""
        return rm.attn_replica_memory(
            self.model, groups=groups, shards=shards, seq_len=self.seq_len,
            micro_batch_size=self.micro_batch_size, in_flight=in_flight, recompute=recompute,
            prec=GPU_PRECISION, split_backward=self.deferred(recompute),
            loss_chunk_tokens=self.options.loss_chunk_tokens, recompute_layers=layers,
        )  # fmt: skip

    def ffn_memory(
        self, groups: int, m: int, in_flight: int, recompute: str, layers: int = 0
    ) -> cm.MemoryBreakdown:
        """The worst expert shard by the runtime's model for m replicas per group."""
        return rm.ffn_shard_memory(
            self.model, groups=groups, replicas=m, shards=self.gpus // groups - m,
            seq_len=self.seq_len, micro_batch_size=self.micro_batch_size, in_flight=in_flight,
            recompute=recompute, prec=GPU_PRECISION, split_backward=self.deferred(recompute),
            recompute_layers=layers,
        )  # fmt: skip

    def deferred(self, recompute: str) -> bool:
        """Whether the memory leaves room for deferred weight gradients: as `train` counts
        them, wherever the run may split its backwards (`schedule.split_backward` not off;
        a run that recomputes keeps them whole, `RunConfig.split_backward_blocker`)."""
        return self.options.split_backward != "off" and recompute == "none"

    def ffn_terms(self, groups: int, in_flight: int, recompute: str) -> tuple[float, float]:
        """(A, B) with (A + B*m)/n >= `ffn_memory` for every split m + n = W/p, n <= E.

        With W_g = W/p, n_hi = min(W_g - 1, E) and s the states of one expert on every
        MoE layer of the group: the shard's ceil(E/n) experts hold at most (E - 1 + n)*s/n,
        and n = W_g - m, so A = (E - 1 + W_g)*s and B gains -s. Activations (and deferred
        gradients) of m replicas are m/n times those of n shards' worth of pairs and rows;
        a token's rows (`runtime_memory.shards_per_token`) grow with n, so n_hi's bound
        them: B gains n_hi * K * one replica's micro-batch on a shard of n_hi.
        """
        model, per = self.model, self.gpus // groups
        n_hi = max(1, min(per - 1, model.num_experts))
        moe = cm.group_moe_layers(model, groups)
        one_expert = moe * flops.expert_params(model, 1) * GPU_PRECISION.state
        tokens = self.seq_len * self.micro_batch_size
        act = rm.ffn_act_bytes(model, recompute, GPU_PRECISION, tokens=tokens, shards=n_hi)
        per_replica = in_flight * moe * n_hi * act
        if self.deferred(recompute):
            deferred = rm.ffn_deferred_bytes(model, GPU_PRECISION, tokens=tokens, shards=n_hi)
            per_replica += moe * n_hi * deferred
        return float((model.num_experts - 1 + per) * one_expert), float(per_replica - one_expert)

    def problem(self, groups: int, in_flight: int, recompute: str) -> SplitProblem:
        u = self.units(groups, recompute)
        full = not self.options.roofline_only
        ffn_mem = None
        if full:
            a, b = self.ffn_terms(groups, in_flight, recompute)
            ffn_mem = (a, b, self.cap_bytes)
        return SplitProblem(
            gpus=self.gpus // groups,
            nics=self.total_nics // (2 * groups),
            attn_gpu=u.attn_gpu,
            ffn_gpu=u.ffn_gpu,
            attn_nic=u.attn_nic,
            ffn_nic=u.ffn_nic,
            nics_per_gpu=self.cluster.nics_per_node / self.cluster.gpus_per_node if full else None,
            max_ffn_gpus=self.model.num_experts if full else None,
            max_attn_gpus=self.options.global_batch // self.micro_batch_size or None,
            ffn_mem=ffn_mem,
        )

    def max_in_flight_attn(self, groups: int, recompute: str) -> int:
        """Most micro-batches in flight whose activations fit on the worst attention replica
        of any split (`attn_memory` with n unknown); < 1 when not one does."""
        return most_in_flight([self.attn_memory(groups, 1, recompute)], self.cap_bytes, sys.maxsize)

    def max_in_flight(self, groups: int, m: int, recompute: str, layers: int = 0) -> int:
        """Most micro-batches in flight that fit on both roles of the split with m replicas
        per group: `training.budget.in_flight_cap`'s rule without a slot limit; < 1 when not
        one does. `layers`: `train.recompute_layers`."""
        one = self.worker_memory(groups, m, 1, recompute, layers)
        return most_in_flight(one, self.cap_bytes, sys.maxsize)

    def fewest_layers(self, groups: int, m: int, in_flight: int) -> int:
        """The fewest first layers per group that, recomputed in full, let `in_flight`
        micro-batches fit (`train.recompute_layers`); 0 when only every layer (or none)
        would."""
        per_group = self.model.num_layers // groups
        fits = (
            k for k in range(1, per_group) if self.max_in_flight(groups, m, "full", k) >= in_flight
        )
        return next(fits, 0)

    def worker_memory(
        self, groups: int, m: int, in_flight: int, recompute: str, layers: int = 0
    ) -> tuple[cm.MemoryBreakdown, cm.MemoryBreakdown]:
        """(worst attention replica, worst expert shard) of the split with m replicas per
        group, by the runtime's model: what `train` predicts for that layout on a GPU
        (`layers`: `train.recompute_layers`)."""
        n = self.gpus // groups - m
        return (
            self.attn_memory(groups, in_flight, recompute, shards=n, layers=layers),
            self.ffn_memory(groups, m, in_flight, recompute, layers),
        )

    def evaluate(
        self,
        *,
        groups: int,
        m: int,
        attn_nics: int,
        in_flight: int,
        recompute: str,
        profile: Profile | None = None,
        binding: str = "",
        memory_binding: str = "",
        solver: str = "",
        stage: str = "milp",
        micro_batches: int = 0,
        recompute_layers: int = 0,
    ) -> Plan | None:
        """A checked plan, or None if a hard constraint is violated. `micro_batches` per
        replica (0: `self.micro_batches(groups, m)`); `recompute_layers` counts in the
        memory only (analytic times: every layer's; the simulator profile prices it)."""
        prob = self.problem(groups, in_flight, recompute)
        n, mf = prob.gpus - m, prob.nics - attn_nics
        if not _split_allowed(prob, m, n, attn_nics, mf):
            return None
        micro_batches = micro_batches or self.micro_batches(groups, m)
        if self.options.global_batch:  # a replica holds at most its share of the batch
            in_flight = min(in_flight, micro_batches)
        attn_mem, ffn_mem = self.worker_memory(groups, m, in_flight, recompute, recompute_layers)
        mem_a, mem_f = attn_mem.total, ffn_mem.total
        if not self.options.roofline_only and max(mem_a, mem_f) > self.cap_bytes * (1 + 1e-12):
            return None
        u = self.units(groups, recompute)
        costs = (
            cm.paper_costs(self.model, self.seq_len)
            if self.options.roofline_only
            else cm.detailed_costs(self.model, self.seq_len, groups)
        )
        seqs = m * self.micro_batch_size  # one group micro-batch
        plan = Plan(
            model=self.model.name,
            cluster=self.cluster.name,
            gpus=self.gpus,
            nics=self.total_nics,
            seq_len=self.seq_len,
            micro_batch_size=self.micro_batch_size,
            loss_chunk_tokens=self.options.loss_chunk_tokens,
            groups=groups,
            virtual_stages=self.model.num_layers // groups,
            micro_batches=micro_batches,
            in_flight=in_flight,
            recompute=recompute,
            attn_gpus_per_group=m,
            ffn_gpus_per_group=n,
            attn_nics_per_group=attn_nics,
            ffn_nics_per_group=mf,
            t_attn_compute_s=seqs * u.attn_gpu / m,
            t_attn_comm_s=seqs * u.attn_nic / attn_nics,
            t_ffn_compute_s=seqs * u.ffn_gpu / n,
            t_ffn_comm_s=seqs * u.ffn_nic / mf,
            i_attn=costs.i_attn,
            i_ffn=costs.i_ffn,
            ridge=cm.ridge_point(self.cluster, achievable=not self.options.roofline_only),
            mem_attn_gib=mem_a / cm.GIB,
            mem_ffn_gib=mem_f / cm.GIB,
            mem_cap_gib=self.cap_bytes / cm.GIB,
            binding=binding or prob_binding(prob, m, n, attn_nics, mf),
            memory_binding=memory_binding,
            roofline_only=self.options.roofline_only,
            solver=solver or self.options.solver,
            stage=stage,
            step_time_s=0.0,
            global_batch=self.options.global_batch,
            recompute_layers=recompute_layers,
        )
        prof = profile or AnalyticProfile(self)
        return dataclasses.replace(plan, step_time_s=prof(plan))


def _split_allowed(prob: SplitProblem, m: int, n: int, ma: int, mf: int) -> bool:
    """The split's counts within the problem's bounds: every role and NIC share at least
    one, n at most the experts, m at most the run's micro-batches (a replica without one
    would idle), each role's NICs at most its GPUs' share."""
    if min(m, n, ma, mf) < 1:
        return False
    if prob.max_ffn_gpus is not None and n > prob.max_ffn_gpus:
        return False
    if prob.max_attn_gpus is not None and m > prob.max_attn_gpus:
        return False
    r = prob.nics_per_gpu
    return r is None or (ma <= r * m + 1e-9 and mf <= r * n + 1e-9)


def prob_binding(prob: SplitProblem, m: int, n: int, ma: int, mf: int) -> str:
    terms = prob.terms(m, n, ma, mf)
    names = ("attention compute", "attention NICs", "FFN compute", "FFN NICs")
    return names[max(range(4), key=lambda i: terms[i])]


def score(plan: Plan, seconds: float) -> float:
    """What stage 3 and the choice of p minimise: profile seconds per sequence trained."""
    return seconds / plan.sequences_per_step


class AnalyticProfile:
    """A stand-in for a measured run: the AF-Pipe pipeline model of docs/design.md §2.3.

    Beyond the MILP's roofline it models (so stage 3 has something to find):
    * optionally (`dedup=True`) dispatch de-duplication: a token goes once to each F-worker
      holding >= 1 of its top-k experts, so wire bytes scale by E[distinct workers]/k under
      uniform routing. Off by default: it rewards tiny FFN groups (n=2 -> 4x less traffic for
      k=8) whose traffic would really stay inside a node on NVLink, which this model omits;
      the design's V (k copies per token) is the conservative bound;
    * per-message latency: each stage an A-replica exchanges with n F-workers and an F-worker
      with m replicas, forward and backward (2 * peers * cluster.latency_us);
    * the ring A0 -> F0 -> A1 -> ... -> F(p-1) has R = 2p compute components (the exchanges
      overlap on their own lane); with K < R micro-batches in flight (memory) it runs R/K
      slower;
    * step = (R/K) * N * v * T + (2p - 1) * T + T_M2N  (fill/drain of 2p components; the
      design's (2L-1) * max(T_a, T_f) + T_M2N when v = 1).
    """

    def __init__(self, planner: Planner, *, dedup: bool = False) -> None:
        self.planner = planner
        self.dedup = dedup

    def __call__(self, plan: Plan) -> float:
        pl = self.planner
        model, cluster = pl.model, pl.cluster
        m, n = plan.attn_gpus_per_group, plan.ffn_gpus_per_group
        u = pl.units(plan.groups, plan.recompute)
        dedup = (
            cm.distinct_worker_fraction(model.num_experts, model.top_k, n) if self.dedup else 1.0
        )
        if pl.options.roofline_only:
            attn_nic, ffn_nic = u.attn_nic * dedup, u.ffn_nic * dedup
        else:
            c = cm.detailed_costs(model, pl.seq_len, plan.groups)
            attn_nic = 2.0 * (c.dispatch_bytes * dedup + c.hop_bytes) / u.bytes_per_s
            ffn_nic = 2.0 * c.dispatch_bytes * dedup / u.bytes_per_s
        seqs = m * pl.micro_batch_size
        lat = 2.0 * cluster.latency_us * 1e-6
        comm_a = seqs * attn_nic / plan.attn_nics_per_group
        t_a = max(seqs * u.attn_gpu / m, comm_a) + lat * n
        t_f = max(seqs * u.ffn_gpu / n, seqs * ffn_nic / plan.ffn_nics_per_group) + lat * m
        t = max(t_a, t_f)
        slow = max(1.0, ring_length(plan.groups) / plan.in_flight)
        return (
            slow * plan.micro_batches * plan.virtual_stages * t + (2 * plan.groups - 1) * t + comm_a
        )


def ring_length(groups: int) -> int:
    """Micro-batches in flight that keep all 2p compute components of the ring busy."""
    return 2 * groups
