"""Stage 3's profile = the simulator: a plan is scored by replaying one step of its schedule.

`SimulatorProfile(planner, costs=None)` turns a `Plan` into the arguments of
`simulator.simulate_disagg` — the same code as `disagmoe simulate` — and returns the
simulated seconds per step:

* p groups, m attention replicas and n expert shards per group (uneven shards and
  replica slot counts as the runtime runs them);
* the plan's micro-batches: `Plan.micro_batches` counts group micro-batches of m*b
  sequences, the simulator counts the global batch in per-replica micro-batches of b,
  so it gets `micro_batches * m` (every replica runs `micro_batches` slots), or, planned
  for a run's batch (`PlanOptions.global_batch`), exactly that batch's global_batch / b;
* the in-flight cap (`max_in_flight`), the recompute mode, node-aware placement and the
  planner's NIC split M_a : M_f of the group's NIC bandwidth (`simulator.placement`);
* the symmetry-reduced replay (one replica per class, one shard per group; exact for
  AF-Pipe, `simulator.symmetry`), so a step costs the same to simulate at 8 or 1024 GPUs.

`costs`: analytic FLOP costs at the cluster's peak * mfu (default) or any
`simulator.costs.InstrCosts`, e.g. a `TableCosts` of measured per-op seconds.
Results are cached by `plan_key`, so a point the search revisits is simulated once.
A schedule the validator rejects scores +inf (never chosen).

`plan_with_profile` is stages 1-3 under the profile `PlanOptions.profile` names:
"auto" uses the simulator up to `AUTO_SIMULATOR_MAX_GPUS` GPUs and the analytic formula
above (docs/planner.md "Profile = simulator" has the timings behind the threshold).
"""

from __future__ import annotations

import dataclasses
import math

from disagmoe.config import split_backward_flag
from disagmoe.planner.plan import AnalyticProfile, Plan, Planner, Profile, score
from disagmoe.planner.search import even_load_replicas, refine_plan
from disagmoe.planner.seed import batch_in_flight, seed_plans
from disagmoe.simulator import ScheduleRejected, SimResult, simulate_disagg
from disagmoe.simulator.costs import InstrCosts

# "auto" switches to the analytic profile above this many GPUs.
AUTO_SIMULATOR_MAX_GPUS = 1024
# Seeds (one per p and recompute mode) the simulator scores: those within this factor of
# the best seed's analytic seconds per sequence (the two profiles disagree by up to ~30%
# between p's, so the band is wide) ...
SEED_BAND = 1.5
# ... and with at most this many micro-batches per step: a high p needs many (p = 16 of a
# 48-layer model: 104) and their replay (~8 s each) would dominate planning. Seeds above it
# are simulated only when no other seed is left.
SEED_MAX_MICRO_BATCHES = 64

# Stage 4 (`grow_micro_batches`): at most this many micro-batches per replica; short of
# the bubble target, the fewest within this share of the best seconds per sequence.
MAX_MICRO_BATCHES_PER_REPLICA = 16
MIN_DOUBLING_GAIN = 0.025

# the options' order and chunks are fixed
PlanKey = tuple[int, int, int, int, int, int, str, int, int]


def plan_key(plan: Plan) -> PlanKey:
    """What the simulated step depends on: p, m, n, M_a, M_f, cap, recompute, micro-batches,
    recomputed layers."""
    return (
        plan.groups,
        plan.attn_gpus_per_group,
        plan.ffn_gpus_per_group,
        plan.attn_nics_per_group,
        plan.ffn_nics_per_group,
        plan.in_flight,
        plan.recompute,
        plan.micro_batches,
        plan.recompute_layers,
    )


class SimulatorProfile:
    """`profile(plan) -> seconds per step` by simulating one step of the plan (module doc)."""

    def __init__(self, planner: Planner, costs: InstrCosts | None = None) -> None:
        self.planner = planner
        self.costs = costs
        self.cache: dict[PlanKey, SimResult | None] = {}

    def result(self, plan: Plan) -> SimResult | None:
        """The simulated step of `plan` (cached), or None if the validator rejected it."""
        key = plan_key(plan)
        if key not in self.cache:
            self.cache[key] = self._simulate(plan)
        return self.cache[key]

    def _simulate(self, plan: Plan) -> SimResult | None:
        pl = self.planner
        m = plan.attn_gpus_per_group
        try:
            return simulate_disagg(
                pl.model,
                pl.cluster,
                groups=plan.groups,
                attn_workers=m,
                expert_workers=plan.ffn_gpus_per_group,
                seq_len=pl.seq_len,
                micro_batch_size=pl.micro_batch_size,
                num_micro_batches=(
                    pl.options.global_batch // pl.micro_batch_size or plan.micro_batches * m
                ),
                max_in_flight=plan.in_flight,
                reduce=True,
                costs=self.costs,
                placement="node-aware",
                nic_split=(plan.attn_nics_per_group, plan.ffn_nics_per_group),
                recompute=plan.recompute,
                recompute_layers=plan.recompute_layers,
                order=pl.options.order,
                exchange_chunks=pl.options.exchange_chunks,
                loss_chunk_tokens=pl.options.loss_chunk_tokens,
                # a recomputing run keeps its backwards whole (the runtime's rule)
                split_backward=(
                    split_backward_flag(pl.options.split_backward)
                    if plan.recompute == "none"
                    else False
                ),
            )
        except ScheduleRejected:
            return None

    def __call__(self, plan: Plan) -> float:
        result = self.result(plan)
        return math.inf if result is None else result.step_time_s


def resolve_profile(planner: Planner) -> str:
    """ "analytic" or "simulator" for `planner.options.profile` (auto: by GPU count)."""
    opts = planner.options
    if opts.profile != "auto":
        return opts.profile
    if opts.roofline_only or planner.gpus > AUTO_SIMULATOR_MAX_GPUS:
        return "analytic"
    return "simulator"


def plan_with_profile(planner: Planner, costs: InstrCosts | None = None) -> Plan:
    """Stages 1-3 scored by the profile the options name; the plan records which.

    With the simulator, stages 1-2 still pick each (p, recompute) seed's split and
    in-flight count with the analytic profile (the MILP's band and the memory trade-off);
    the simulator then scores the seeds within `SEED_BAND` of the best analytic one and of
    at most `SEED_MAX_MICRO_BATCHES` micro-batches, the best of them is Stage 3's start,
    and every Stage-3 candidate is simulated. p stays the seed's. Stage 4
    (`grow_micro_batches`) then sets the micro-batches, unless the options fix them.
    """
    name = resolve_profile(planner)
    analytic = AnalyticProfile(planner)
    seeds = seed_plans(planner, analytic)
    opts = planner.options
    if name == "analytic":
        prof: Profile = analytic
        seed = min(seeds, key=lambda plan: score(plan, plan.step_time_s))
    else:
        prof = SimulatorProfile(planner, costs)
        best = min(score(plan, plan.step_time_s) for plan in seeds)
        near = [plan for plan in seeds if score(plan, plan.step_time_s) <= SEED_BAND * best]
        small = [plan for plan in near if plan.micro_batches <= SEED_MAX_MICRO_BATCHES]
        scored = [
            dataclasses.replace(plan, step_time_s=prof(plan))
            for plan in _with_even_shards(planner, small or near)
        ]
        seed = min(scored, key=lambda plan: score(plan, plan.step_time_s))
    if not (opts.roofline_only or opts.search_moves == 0):
        seed = refine_plan(planner, seed, prof).best
    fixed_batch = opts.micro_batches or opts.global_batch
    if isinstance(prof, SimulatorProfile) and opts.batch_stage and not fixed_batch:
        seed = grow_micro_batches(planner, seed, prof)
    if isinstance(prof, SimulatorProfile) and opts.layers_stage:
        seed = recompute_first_layers(planner, seed, prof)
    return _recorded(planner, name, seed)


def recompute_first_layers(planner: Planner, plan: Plan, prof: SimulatorProfile) -> Plan:
    """Stage 5, with recompute auto: `plan`, or its split with each group recomputing only
    its first layers in full (`train.recompute_layers`: the fewest that let the slots in
    flight fit, `Planner.fewest_layers`) where that replays faster: the plan without
    recompute at more slots than its memory holds, climbing from its cap to its
    micro-batches; the plan with full recompute at its cap and below. Each direction stops
    after two caps in a row that are not faster, or, climbing, where only every layer
    would fit. `simulate` runs the same search on its plans, in each order it replays
    (`simulate_cli._some_layers_recomputed`)."""
    if planner.options.recompute != "auto" or plan.recompute_layers:
        return plan  # a mode given is planned as given (as `simulate` keeps it)
    if plan.recompute == "none":
        caps = range(plan.in_flight + 1, plan.micro_batches + 1)
    elif plan.recompute == "full":
        caps = range(plan.in_flight, 0, -1)
    else:
        return plan
    best, misses = plan, 0
    for cap in caps:
        layers = planner.fewest_layers(plan.groups, plan.attn_gpus_per_group, cap)
        if not layers:  # only every layer fits: at more slots none will, at fewer some may
            if caps.step > 0:
                break
            continue
        cand = planner.evaluate(
            groups=plan.groups, m=plan.attn_gpus_per_group, attn_nics=plan.attn_nics_per_group,
            in_flight=cap, recompute="full", recompute_layers=layers, profile=prof,
            memory_binding=f"full recompute of {layers} layer(s) per group: {cap} in flight",
            solver=plan.solver, stage="layers", micro_batches=plan.micro_batches,
        )  # fmt: skip
        if cand is not None and score(cand, cand.step_time_s) < score(best, best.step_time_s):
            best, misses = cand, 0
        else:
            misses += 1
            if misses == 2:
                break
    return best


def _with_even_shards(planner: Planner, seeds: list[Plan]) -> list[Plan]:
    """`seeds` and, for each, its split with shards as even as its busiest shard's expert
    count allows (`search.even_load_replicas`): the MILP sizes n by a continuous share of
    the experts, while a shard's work is its whole experts', so n a little off a divisor
    of E leaves the busiest shard with twice the others' load. Scored by the simulator
    before the search starts, so the choice of p sees each p's even split."""
    out: list[Plan] = []
    for plan in seeds:
        out.append(plan)
        for m in even_load_replicas(planner, plan):
            if m == plan.attn_gpus_per_group or m < 1:
                continue
            if planner.options.global_batch:
                held, binding = batch_in_flight(planner, plan.groups, m, plan.recompute)
            else:
                held, binding = plan.in_flight, plan.memory_binding
            variant = planner.evaluate(
                groups=plan.groups, m=m, attn_nics=plan.attn_nics_per_group,
                in_flight=held, recompute=plan.recompute,
                memory_binding=binding, solver=plan.solver, stage="search",
            )  # fmt: skip
            if variant is not None:
                out.append(variant)
    return out


def _recorded(planner: Planner, name: str, plan: Plan) -> Plan:
    """`plan` with the profile that scored it and the schedule it replayed."""
    opts = planner.options
    replayed = f"{opts.order}, exchange chunks {opts.exchange_chunks or 'auto'}" + (
        f", split backward {opts.split_backward}" if opts.split_backward != "off" else ""
    )
    return dataclasses.replace(plan, profile=name, schedule=replayed if name == "simulator" else "")


def step_over_bound(prof: SimulatorProfile, plan: Plan) -> float:
    """The plan's replayed step over its bound (`simulator.bound`); inf if rejected."""
    result = prof.result(plan)
    if result is None or result.bound is None or result.bound.seconds <= 0:
        return math.inf
    return result.step_time_s / result.bound.seconds


def grow_micro_batches(planner: Planner, plan: Plan, prof: SimulatorProfile) -> Plan:
    """Stage 4: the plan's layout with as many micro-batches per replica as its bubble needs.

    The ring formula behind `Planner.micro_batches` counts the fill of 2p - 1 stages; a
    replayed step also pays each micro-batch's whole forward-head-backward chain at its
    start and end (docs/simulator.md), which two slots per replica cannot hide. So the
    plan's count is doubled up to `MAX_MICRO_BATCHES_PER_REPLICA`, each count with the
    in-flight cap (from the plan's to what memory admits) that replays fastest, and the
    pick is the smallest count whose replayed step is within 1 + `bubble_target` of its
    bound (`simulator.bound`); if none is, the smallest within `MIN_DOUBLING_GAIN` of the
    best seconds per sequence of them all. The global batch grows with the count:
    `--micro-batches` fixes it instead.
    """
    target = 1.0 + planner.options.bubble_target
    if step_over_bound(prof, plan) <= target:
        return plan
    options = [plan]
    micro = plan.micro_batches * 2
    while micro <= MAX_MICRO_BATCHES_PER_REPLICA:
        top = min(
            micro, planner.max_in_flight(plan.groups, plan.attn_gpus_per_group, plan.recompute)
        )
        cands = [_with_micro_batches(planner, plan, prof, micro, cap)
                 for cap in range(plan.in_flight, top + 1)]  # the FFN memory may admit fewer  # fmt: skip
        feasible = [c for c in cands if c is not None]
        if not feasible:
            break
        options.append(min(feasible, key=lambda c: score(c, c.step_time_s)))
        micro *= 2
    within = [c for c in options if step_over_bound(prof, c) <= target]
    if within:
        return within[0]
    fastest = min(score(c, c.step_time_s) for c in options)
    return next(c for c in options if score(c, c.step_time_s) <= fastest / (1 - MIN_DOUBLING_GAIN))


def grid(lo: int, hi: int, points: int) -> list[int]:
    """All of lo..hi when `points` is 0 or covers them, else `points` evenly spaced ones."""
    if hi < lo:
        return []
    if points <= 0 or hi - lo + 1 <= points:
        return list(range(lo, hi + 1))
    if points == 1:
        return [lo]
    return sorted({lo + round(i * (hi - lo) / (points - 1)) for i in range(points)})


def sweep_plans(
    planner: Planner,
    groups: int,
    profile: Profile,
    *,
    m_points: int = 0,
    nic_points: int = 0,
    caps: str = "all",
) -> list[Plan]:
    """Every feasible plan of Stage 3's space at p = `groups`, scored by `profile`.

    The space: m = 1..G/p-1 (n <= E), M_a = 1..M_g-1, recompute none/full (or the fixed
    mode), in-flight cap 1..min(micro-batches, what memory admits). `m_points` /
    `nic_points` > 0 take that many evenly spaced values instead of all; `caps`="pow2"
    takes the powers of two and the largest cap instead of all.
    """
    opts = planner.options
    modes = ["none", "full"] if opts.recompute == "auto" else [opts.recompute]
    prob = planner.problem(groups, 1, modes[0])
    out: list[Plan] = []
    for mode in modes:
        most = planner.max_in_flight_attn(groups, mode)
        for m in grid(1, prob.gpus - 1, m_points):
            top = min(planner.micro_batches(groups, m), most)
            ks = list(range(1, top + 1))
            if caps == "pow2" and top >= 1:
                ks = sorted({k for k in ks if k & (k - 1) == 0} | {top})
            for ma in grid(1, prob.nics - 1, nic_points):
                for k in ks:
                    plan = planner.evaluate(
                        groups=groups, m=m, attn_nics=ma, in_flight=k, recompute=mode,
                        profile=profile, stage="sweep",
                    )  # fmt: skip
                    if plan is not None:
                        out.append(plan)
    return out


def _with_micro_batches(
    planner: Planner, plan: Plan, prof: SimulatorProfile, micro: int, cap: int
) -> Plan | None:
    """`plan`'s layout with `micro` micro-batches per replica and `cap` in flight, checked."""
    return planner.evaluate(
        groups=plan.groups, m=plan.attn_gpus_per_group, attn_nics=plan.attn_nics_per_group,
        in_flight=cap, recompute=plan.recompute, profile=prof, stage="batch",
        micro_batches=micro,
        memory_binding=f"in-flight {cap} of {micro} (memory)" if cap < micro else "",
    )  # fmt: skip
