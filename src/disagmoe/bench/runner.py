"""Run several runtimes side by side on one (emulated) cluster and collect their numbers.

Every runtime trains the same model on the same global batch with the same number of
workers (`nodes * ranks_per_node`), started exactly as a multi-node job is:

    ip netns exec dmoe-<pid>-n<k> python -m torch.distributed.run --nnodes N --node-rank k
        --nproc-per-node R --rdzv-backend c10d --rdzv-endpoint <node 0>:29500
        --local-addr <node k> -m disagmoe.train <train flags>

(c10d assigns node ranks in the order of the nodes' addresses, which are zero-padded so
that node k gets node rank k; node k holds ranks kR .. kR+R-1.) The rows and their flags
are `bench.spec`'s `Entry` and `BenchSpec`. Repetitions are interleaved (rep 1 of every
row, then rep 2, ...) so that slow drifts of the machine hit all rows alike; the first
`warmup` steps of every run are excluded.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import CHUNKED_RUNTIMES, WARMUP_RUNTIMES, RunConfig
from ..config_io import load_toml
from ..simulator.bound import Bound
from ..simulator.links import LinkModel
from .analysis import (
    TCP_EFFICIENCY,
    Breakdown,
    Replay,
    emulated_network,
    predict,
    trace_breakdown,
)
from .bound import trace_bound
from .netns import EmulatedCluster, LoopbackCluster
from .spec import BenchSpec, Entry

RDZV_PORT = 29500


@dataclass
class RunOutcome:
    """One launch of one bench row (a runtime, or disagg with one placement)."""

    runtime: str  # the row (`BenchSpec.entries`)
    repeat: int
    run_dir: Path
    ok: bool
    error: str = ""
    wall_s: float = 0.0
    step_times: dict[int, float] = field(default_factory=dict)  # trace step -> seconds
    drops: int = 0  # packets the NICs' token buckets dropped during the run


Cluster = EmulatedCluster | LoopbackCluster


def start_agents(
    cluster: Cluster,
    nodes: int,
    per_node: int,
    rdzv: str,
    rdzv_id: str,
    train_flags: list[str],
    run_dir: Path,
    env: dict[str, str],
    max_restarts: int = 0,
) -> list[subprocess.Popen[bytes]]:
    """One torchrun agent per node (`disagmoe.train` with `train_flags`), each inside its
    node's namespace, logging to `run_dir/node<k>.log`, tracked by the cluster.

    The agents do not share their rendezvous store with the workers
    (`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`): each rendezvous round, the attempt's rank 0
    hosts a store of its own at a port its agent chose for that round, so that workers
    restarted after a failure never read a dead attempt's addresses
    (`disagmoe.train._init_process_group`)."""
    env = {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    started = []
    for k in range(nodes):
        argv = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
            "--node-rank", str(k), "--nproc-per-node", str(per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv,
            "--rdzv-id", rdzv_id, "--rdzv-conf", f"is_host={int(k == 0)},join_timeout=60",
            "--local-addr", cluster.addr(k), "--max-restarts", str(max_restarts),
            "--monitor-interval", "0.2", "-m", "disagmoe.train", *train_flags,
        ]  # fmt: skip
        log = (run_dir / f"node{k}.log").open("w")
        proc = subprocess.Popen(
            cluster.wrap(k, argv), stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip
        log.close()
        cluster.track(proc)
        started.append(proc)
    return started


def launch(cluster: Cluster, spec: BenchSpec, entry: str, run_dir: Path) -> tuple[bool, str]:
    """Start one torchrun agent per node, wait for all; (ok, error line)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": cluster.iface,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    rdzv = f"{cluster.addr(0)}:{RDZV_PORT}"
    nodes = spec.nodes
    per_node = spec.ranks_per_node
    if isinstance(cluster, LoopbackCluster):  # one host: one agent with every rank
        from ..device import free_port

        rdzv = f"127.0.0.1:{free_port()}"
        nodes, per_node = 1, spec.world
    rdzv_id = f"bench-{uuid.uuid4().hex[:8]}"
    started = start_agents(
        cluster, nodes, per_node, rdzv, rdzv_id, spec.train_flags(entry, run_dir), run_dir, env
    )
    deadline = time.monotonic() + spec.timeout_s
    failed = ""
    while any(p.poll() is None for p in started):
        bad = [k for k, p in enumerate(started) if p.poll() not in (None, 0)]
        if bad:
            failed = f"node {bad[0]} exited with code {started[bad[0]].returncode}"
            break
        if time.monotonic() > deadline:
            failed = f"timed out after {spec.timeout_s:.0f} s"
            break
        time.sleep(0.2)
    if not failed:
        bad = [k for k, p in enumerate(started) if p.returncode != 0]
        failed = f"node {bad[0]} exited with code {started[bad[0]].returncode}" if bad else ""
    if failed:
        from .netns import kill_all

        kill_all(started)
        return False, f"{failed}: {_error_line(run_dir)}"
    return True, ""


def _error_line(run_dir: Path) -> str:
    """The most telling line of the nodes' logs (the raised error, if any)."""
    for log in sorted(run_dir.glob("node*.log")):
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines()]
        for line in reversed(lines):
            if line.startswith(("RuntimeError", "ValueError", "torch.", "disagmoe")) or (
                "Error" in line.split(":")[0]
            ):
                return line[:300]
    return "see node*.log in the run dir"


def read_steps(run_dir: Path, warmup: int) -> dict[int, float]:
    """{trace step index: step seconds} of the measured steps (after the warm-up)."""
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    return {r["step"] - 1: r["step_time_s"] for r in records if r["step"] > warmup}


def run_all(spec: BenchSpec, cluster: Cluster, log: Any = None) -> list[RunOutcome]:
    """Every row `repeats` times, interleaved; failures are recorded, not raised."""
    outcomes = []
    for rep in range(spec.repeats):
        for runtime in spec.entries:
            run_dir = spec.out_dir / f"{Entry.parse(runtime).slug}-r{rep}"
            t0 = time.perf_counter()
            if log:
                log(f"bench: {runtime} (repeat {rep + 1}/{spec.repeats}) -> {run_dir}")
            cluster.set_rates(spec.node_mbit(runtime))
            before = cluster.drops()
            ok, error = launch(cluster, spec, runtime, run_dir)
            out = RunOutcome(runtime, rep, run_dir, ok, error, time.perf_counter() - t0)
            out.drops = cluster.drops() - before
            if ok:
                out.step_times = read_steps(run_dir, spec.warmup)
            elif log:
                log(f"bench: {runtime} failed: {error}")
            outcomes.append(out)
    return outcomes


@dataclass
class RuntimeResult:
    """The numbers of one runtime over all its measured steps and repetitions."""

    runtime: str
    ok: bool
    error: str
    layout: str
    step_time_s: float = 0.0
    step_time_spread_s: tuple[float, float] = (0.0, 0.0)  # min, max of per-repeat medians
    tokens_per_s: float = 0.0
    ratio_vs_ep_1f1b: float | None = None
    breakdown: Breakdown | None = None
    predicted_step_s: float = 0.0
    prediction_error: float = 0.0
    bound: Bound | None = None  # the step-time lower bound from the run's trace
    fill_bound: Bound | None = None  # the same with its pipeline's fill and drain
    nic_drops: int = 0  # packets the NICs' token buckets dropped, all repetitions
    run_dirs: list[str] = field(default_factory=list)

    @property
    def step_over_bound(self) -> float | None:
        if not self.ok or self.bound is None or self.bound.seconds <= 0:
            return None
        return self.step_time_s / self.bound.seconds

    @property
    def step_over_fill_bound(self) -> float | None:
        if not self.ok or self.fill_bound is None or self.fill_bound.seconds <= 0:
            return None
        return self.step_time_s / self.fill_bound.seconds

    def to_dict(self) -> dict[str, Any]:
        b = self.breakdown
        return {
            "runtime": self.runtime,
            "ok": self.ok,
            "error": self.error,
            "layout": self.layout,
            "tokens_per_s": self.tokens_per_s,
            "ratio_vs_ep_1f1b": self.ratio_vs_ep_1f1b,
            "step_time_s": self.step_time_s,
            "step_time_spread_s": list(self.step_time_spread_s),
            "compute_s": b.compute_s if b else None,
            "comm_s": b.comm_s if b else None,
            "exposed_comm_s": b.exposed_comm_s if b else None,
            "exposed_comm_share": b.exposed_comm_s / self.step_time_s if b and self.ok else None,
            "bubble_s": b.bubble_s if b else None,
            "predicted_step_s": self.predicted_step_s if self.ok else None,
            "prediction_error": self.prediction_error if self.ok else None,
            "bound_s": self.bound.seconds if self.ok and self.bound else None,
            "step_over_bound": self.step_over_bound,
            "binding": self.bound.describe() if self.ok and self.bound else None,
            "fill_bound_s": self.fill_bound.seconds if self.ok and self.fill_bound else None,
            "step_over_fill_bound": self.step_over_fill_bound,
            "nic_drops": self.nic_drops,
            "run_dirs": self.run_dirs,
        }


def _schedule_facts(run_dir: Path) -> dict[str, Any]:
    """The schedule a disagg run executed (its run.json: what `auto` picked), or {}."""
    try:
        return json.loads((run_dir / "run.json").read_text()).get("schedule") or {}
    except (OSError, ValueError):
        return {}


def _schedule_note(run_dir: Path) -> str:
    """ " order O exchange-chunks C" of a disagg run (`_schedule_facts`), or ""."""
    facts = _schedule_facts(run_dir)
    if not facts:
        return ""
    return f" order {facts['order']} exchange-chunks {facts['exchange_chunks']}"


def ran_schedule(cfg: RunConfig, run_dir: Path) -> RunConfig:
    """`cfg` with the AF-Pipe schedule its run executed (run.json: what `auto` picked at the
    run's start), so that a replay builds the same lists instead of choosing again with
    today's simulator (a different chunk count would price computes the trace lacks)."""
    facts = _schedule_facts(run_dir)
    if not facts:
        return cfg
    schedule = dataclasses.replace(
        cfg.schedule,
        order=facts["order"],
        exchange_chunks=int(facts["exchange_chunks"]),
        split_backward="on" if facts["split_backward"] else "off",
        max_in_flight=int(facts.get("max_in_flight", cfg.schedule.max_in_flight)),
    )
    return dataclasses.replace(cfg, schedule=schedule)


# what an EP row's layout column names, read from the run's resolved config (`[parallel]`)
_EP_LAYOUT_FIELDS = {
    "virtual_stages": ("ep-interleaved",),
    "overlap_chunks": CHUNKED_RUNTIMES,
    "pipeline_warmup": WARMUP_RUNTIMES,
}


def _override_note(run_dir: Path, label: str) -> str:
    """ " pipeline-warmup W" and the like: the layout fields of an EP run that its bench
    label (`BenchSpec.layout_flags`) does not name, as the run resolved them (a `--set`
    override), from its config.toml; a zero warm-up is not named."""
    try:
        parallel = load_toml(str(run_dir / "config.toml")).parallel
    except (OSError, ValueError):
        return ""
    note = ""
    for name, runtimes in _EP_LAYOUT_FIELDS.items():
        flag, value = name.replace("_", "-"), getattr(parallel, name)
        if parallel.runtime in runtimes and flag not in label.split() and value:
            note += f" {flag} {value}"
    return note


def summarize(
    spec: BenchSpec,
    outcomes: list[RunOutcome],
    link_model: LinkModel = "fair",
    replay: Replay = "own",
    overheads: bool = False,
) -> list[RuntimeResult]:
    """Pool each runtime's measured steps; breakdown and prediction (`link_model`,
    `simulator.links`; `replay` and `overheads`: `bench.analysis.predict_disagg`) from
    its traces."""
    results = []
    k = spec.time_scale  # wall times are k x the emulated cluster's; results are divided by k
    net = emulated_network(spec.nic_gbps / k, spec.ranks_per_node, spec.loopback)
    tokens = spec.global_batch_size * spec.seq_len
    for runtime in spec.entries:
        mine = [o for o in outcomes if o.runtime == runtime]
        layout = " ".join(spec.layout_flags(runtime)).replace("--", "")
        res = RuntimeResult(runtime, False, "", layout, run_dirs=[str(o.run_dir) for o in mine])
        good = [o for o in mine if o.ok and o.step_times]
        if not good:
            res.error = next((o.error for o in mine if o.error), "no measured steps")
            results.append(res)
            continue
        res.ok = True
        res.nic_drops = sum(o.drops for o in mine)
        res.layout += _schedule_note(good[0].run_dir) + _override_note(good[0].run_dir, layout)
        times = [t / k for o in good for t in o.step_times.values()]
        res.step_time_s = statistics.median(times)
        medians = [statistics.median(o.step_times.values()) / k for o in good]
        res.step_time_spread_s = (min(medians), max(medians))
        res.tokens_per_s = tokens / res.step_time_s
        parts, predictions, bounds, fills = [], [], [], []
        node_of, node_rates = _nic_pools(spec, runtime)
        rates = spec.worker_gbps(runtime)
        run_net = net
        if len(set(rates)) > 1:  # the NIC split, as the simulator's per-rank NIC rates
            rank_net = emulated_network(
                spec.nic_gbps / k, spec.ranks_per_node, spec.loopback, per_rank=True
            )
            per_gbps = rank_net.nic_bytes_per_s / (spec.nic_gbps / k)
            run_net = dataclasses.replace(
                rank_net, nic_share=tuple(g / k * per_gbps for g in rates)
            )
        for o in good:
            events = _events(o.run_dir, set(o.step_times))
            parts.append(trace_breakdown(events, o.step_times))
            bounds.append(trace_bound(events, o.step_times, node_of, node_rates))
            fills.append(trace_bound(events, o.step_times, node_of, node_rates, fill=True))
            cfg = ran_schedule(load_toml(o.run_dir / "config.toml"), o.run_dir)
            predictions.append(
                predict(cfg, spec.world, events, run_net, link_model, replay, overheads)
            )
        res.breakdown = Breakdown(
            *(
                statistics.fmean(getattr(p, f) for p in parts) / k
                for f in Breakdown.__dataclass_fields__
            )
        )
        res.predicted_step_s = statistics.median(predictions) / k
        res.bound, res.fill_bound = _median_bound(bounds, k), _median_bound(fills, k)
        res.prediction_error = res.predicted_step_s / res.step_time_s - 1.0
        results.append(res)
    by_label = {r.runtime: r for r in results if r.ok}
    for r in results:  # against ep-1f1b in the row's recompute mode
        mode = Entry.parse(r.runtime).recompute
        base = by_label.get(Entry("ep-1f1b", recompute=mode).label)
        if base is not None and r.ok:
            r.ratio_vs_ep_1f1b = r.tokens_per_s / base.tokens_per_s
    return results


def _median_bound(bounds: list[Bound], k: float) -> Bound:
    """The median of the repetitions' bounds, in the emulated cluster's seconds (/ k)."""
    mid = sorted(bounds, key=lambda b: b.seconds)[(len(bounds) - 1) // 2]
    return dataclasses.replace(
        mid,
        seconds=mid.seconds / k,
        compute_s=mid.compute_s / k,
        network_s=mid.network_s / k,
        serial_s=mid.serial_s / k,
    )


def _nic_pools(spec: BenchSpec, runtime: str) -> tuple[Callable[[int], int], list[float]]:
    """Node of each rank and each node's NIC goodput (bytes/s, wall clock) as the bench
    emulates them: ranks fill nodes in rank order; a node's tbf rate carries its ranks."""
    if spec.loopback:  # no NIC: every rank on one host
        return (lambda rank: 0), [math.inf]
    rates = [mbit * 1e6 / 8 * TCP_EFFICIENCY for mbit in spec.node_mbit(runtime)]
    return (lambda rank: rank // spec.ranks_per_node), rates


def _events(run_dir: Path, steps: set[int]) -> list[dict[str, Any]]:
    data = json.loads((run_dir / "trace.json").read_text())
    return [
        e
        for e in data["traceEvents"]
        if e.get("ph") == "X" and e.get("args", {}).get("step") in steps
    ]
