"""Run several runtimes side by side on one (emulated) cluster and collect their numbers.

Every runtime trains the same model on the same global batch with the same number of
workers (`nodes * ranks_per_node`), started exactly as a multi-node job is:

    ip netns exec dmoe-<pid>-n<k> python -m torch.distributed.run --nnodes N --node-rank k
        --nproc-per-node R --rdzv-backend c10d --rdzv-endpoint <node 0>:29500
        --local-addr <node k> -m disagmoe.train <train flags>

(c10d assigns node ranks in the order of the nodes' addresses, which are zero-padded so
that node k gets node rank k; node k holds ranks kR .. kR+R-1.) A row of the bench is an
`Entry`: a runtime and, for `disagg`, one split (`splits`: the planner's, or the even
m = n) and one placement (`placements`: node-aware or packed), each with
`--ranks-per-node R`; with `recomputes`, every runtime once per recompute mode. Rows are
labelled `disagg`, `disagg (even, packed)`, `ep-1f1b (recompute full)`, ... (defaults
left out). Repetitions are interleaved (rep 1 of every row, then rep 2, ...) so that slow
drifts of the machine hit all rows alike; the first `warmup` steps of every run are
excluded.
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

from ..config import PLACEMENTS, RECOMPUTE, ParallelConfig
from ..config_io import load_toml
from ..distributed.layout import Layout
from ..presets import model_preset
from ..simulator.bound import Bound
from ..simulator.links import LinkModel
from .analysis import (
    TCP_EFFICIENCY,
    Breakdown,
    emulated_network,
    predict,
    trace_bound,
    trace_breakdown,
)
from .netns import EmulatedCluster, LoopbackCluster

RDZV_PORT = 29500
SPLITS = ("planner", "even")  # disagg: the planner's (or the given) split; m = n


@dataclass(frozen=True)
class Entry:
    """One row of the bench: a runtime and the variant it runs in."""

    runtime: str
    placement: str = "node-aware"  # disagg only
    split: str = "planner"  # disagg only: "planner" (or given) | "even"
    recompute: str = ""  # "" = the config's; else train.recompute for this row
    chunks: int = -1  # disagg only: -1 = the config's; else schedule.exchange_chunks (0: auto)

    @property
    def label(self) -> str:
        """`disagg`, `disagg (packed)`, `disagg (even, packed, chunks 2, recompute full)`, ..."""
        quals = [self.split] if self.split != "planner" else []
        quals += [self.placement] if self.placement != "node-aware" else []
        quals += [f"chunks {self.chunks or 'auto'}"] if self.chunks >= 0 else []
        quals += [f"recompute {self.recompute}"] if self.recompute else []
        return f"{self.runtime} ({', '.join(quals)})" if quals else self.runtime

    @property
    def slug(self) -> str:
        """The row as a directory name: `disagg (even, packed)` -> `disagg-even-packed`."""
        return self.label.replace(" (", "-").replace(", ", "-").replace(" ", "-").rstrip(")")

    @classmethod
    def parse(cls, label: str) -> Entry:
        """`Entry.label` read back."""
        runtime, _, rest = label.partition(" (")
        entry = cls(runtime)
        for q in filter(None, rest.rstrip(")").split(", ")):
            if q in PLACEMENTS:
                entry = dataclasses.replace(entry, placement=q)
            elif q in SPLITS:
                entry = dataclasses.replace(entry, split=q)
            elif q.startswith("recompute ") and q.split()[1] in RECOMPUTE:
                entry = dataclasses.replace(entry, recompute=q.split()[1])
            elif q.startswith("chunks ") and (q.split()[1].isdigit() or q == "chunks auto"):
                count = q.split()[1]
                entry = dataclasses.replace(entry, chunks=0 if count == "auto" else int(count))
            else:
                raise ValueError(f"bench row {label!r}: unknown qualifier {q!r}")
        return entry


@dataclass(frozen=True)
class BenchSpec:
    """One benchmark: the cluster, the workload, and the layouts of the runtimes."""

    runtimes: tuple[str, ...]
    nodes: int
    ranks_per_node: int
    nic_gbps: float
    model: str
    seq_len: int
    global_batch_size: int
    micro_batch_size: int
    steps: int
    warmup: int
    repeats: int
    groups: int
    attn_workers: int
    expert_workers: int
    pp: int
    ep: int
    out_dir: Path
    overrides: tuple[str, ...] = ()
    disagg_overrides: tuple[str, ...] = ()
    timeout_s: float = 300.0
    loopback: bool = False
    mtu: int = 9000
    compute: str = "real"  # "real" | "emulated" (calibrated waits, see bench.emulation)
    time_scale: float = 1.0  # emulated: waits and transfers run this many times slower
    costs_path: str = ""  # emulated: the costs JSON every rank loads
    # disagg: NIC rate of an attention / expert worker, in units of nic_gbps, with
    # m * a + n * f = m + n (the EP runs' total NIC bandwidth); EP runs: 1 everywhere
    nic_split: tuple[float, float] = (1.0, 1.0)
    split_note: str = ""
    placements: tuple[str, ...] = ("node-aware",)  # disagg: one run per placement
    splits: tuple[str, ...] = ("planner",)  # disagg: one run per split (SPLITS)
    recomputes: tuple[str, ...] = ()  # every runtime once per mode; () = the config's
    exchange_chunks: tuple[int, ...] = ()  # disagg: one run per count (0: auto); () = config's

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def entries(self) -> tuple[str, ...]:
        """The rows of the bench (`Entry.label`): every runtime, `disagg` once per split,
        placement and exchange chunk count, everything once per recompute mode."""
        out: list[str] = []
        for runtime in self.runtimes:
            variants = [Entry(runtime)]
            if runtime == "disagg":
                variants = [
                    Entry(runtime, p, s, chunks=c)
                    for s in self.splits
                    for p in self.placements
                    for c in (self.exchange_chunks or (-1,))
                ]
            out += [
                dataclasses.replace(v, recompute=r).label
                for v in variants
                for r in (self.recomputes or ("",))
            ]
        return tuple(out)

    def split_of(self, entry: str) -> tuple[int, int, int]:
        """(p, m, n) of a `disagg` row: the planner's (or given) split, or the even one."""
        if Entry.parse(entry).split == "even":
            return even_split(self.world)
        return self.groups, self.attn_workers, self.expert_workers

    def layout(self, entry: str) -> Layout:
        """The disaggregated layout of a `disagg` row (its split and placement, this
        cluster's R)."""
        e = Entry.parse(entry)
        assert e.runtime == "disagg", entry
        p, m, n = self.split_of(entry)
        parallel = ParallelConfig(groups=p, attn_workers=m, expert_workers=n, placement=e.placement)
        return Layout.build(
            model_preset(self.model), parallel, self.world, ranks_per_node=self.ranks_per_node
        )

    def worker_gbps(self, entry: str) -> list[float]:
        """NIC Gbit/s of every rank in this row's run (disagg node-aware with the planner's
        split: the NIC split, which pools a node's NICs for its A and F workers; packed
        and even rows get even NICs, as in the simulator)."""
        e = Entry.parse(entry)
        if (
            e.runtime != "disagg"
            or e.placement != "node-aware"
            or e.split != "planner"
            or self.nic_split == (1.0, 1.0)
        ):
            return [self.nic_gbps] * self.world
        a, f = self.nic_split
        layout = self.layout(entry)
        return [self.nic_gbps * (a if layout.role(r).comp == "A" else f) for r in range(self.world)]

    def node_mbit(self, entry: str) -> list[float]:
        """Each node's tbf rate (Mbit/s): its ranks' NICs, slowed by the time scale."""
        rates = self.worker_gbps(entry)
        R = self.ranks_per_node
        return [sum(rates[k * R : (k + 1) * R]) * 1000 / self.time_scale for k in range(self.nodes)]

    def cluster_overrides(self) -> list[str]:
        """`cluster.*` settings that describe this emulated cluster as a run sees it in real
        time (`emulated_network`: one NIC per node shared by its ranks, TCP's efficiency,
        slowed by the time scale like the compute waits), so that a disagg run's schedule
        choice (`schedule.order = auto`, `exchange_chunks = 0`, run costs) prices its links
        with the cluster it runs on; its compute it prices with the costs file."""
        net = emulated_network(self.nic_gbps, self.ranks_per_node, self.loopback)
        scale = 1.0 if self.loopback else self.time_scale  # loopback is not slowed
        return [
            "cluster.name=emulated",
            f"cluster.gpus_per_node={net.gpus_per_node}",
            f"cluster.nics_per_node={net.nics_per_node}",
            f"cluster.nic_gbps={net.nic_bytes_per_s / scale / 1e9!r}",
            f"cluster.nvlink_gbps={net.nvlink_bytes_per_s / 1e9!r}",
            "cluster.bw_efficiency=1.0",
            f"cluster.latency_us={net.latency_s * 1e6!r}",
        ]

    def layout_flags(self, entry: str) -> list[str]:
        e = Entry.parse(entry)
        if e.runtime == "disagg":
            p, m, n = self.split_of(entry)
            return ["--groups", str(p), "--attn-workers", str(m), "--expert-workers", str(n),
                    "--placement", e.placement,
                    "--ranks-per-node", str(self.ranks_per_node)]  # fmt: skip
        ep = self.ep or self.world // self.pp
        return ["--pp", str(self.pp), "--ep", str(ep), "--world-size", str(self.world)]

    def train_flags(self, entry: str, run_dir: Path) -> list[str]:
        e = Entry.parse(entry)
        runtime = e.runtime
        flags = [
            "--runtime", runtime, "--model", self.model, "--seq-len", str(self.seq_len),
            "--global-batch-size", str(self.global_batch_size),
            "--micro-batch-size", str(self.micro_batch_size), "--steps", str(self.steps),
            "--threads-per-rank", "1", "--no-progress", "--run-dir", str(run_dir),
            "--device", "cpu",  # an emulated CPU cluster (gloo over veth), GPU or not
            "--comm-timeout", str(max(self.timeout_s / 2, 30.0)),
            *self.layout_flags(entry),
        ]  # fmt: skip
        if self.costs_path:
            flags += ["--set", f"train.emulate_compute={self.costs_path}"]
            if runtime == "disagg":  # what its schedule choice prices links with
                flags += [x for item in self.cluster_overrides() for x in ("--set", item)]
        extra = self.disagg_overrides if runtime == "disagg" else ()
        for item in (*self.overrides, *extra):
            flags += ["--set", item]
        if e.recompute:  # after the overrides: the row's mode wins
            flags += ["--set", f"train.recompute={e.recompute}"]
        if e.chunks >= 0:  # likewise the row's exchange chunks
            flags += ["--set", f"schedule.exchange_chunks={e.chunks}"]
        return flags


def even_split(world: int) -> tuple[int, int, int]:
    """The even disaggregated split of `world` workers: p = 1, m = n = world / 2."""
    if world % 2:
        raise ValueError(f"an even split needs an even worker count, got {world}")
    return 1, world // 2, world // 2


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


Cluster = EmulatedCluster | LoopbackCluster


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
        from ..testing.spawn import free_port

        rdzv = f"127.0.0.1:{free_port()}"
        nodes, per_node = 1, spec.world
    rdzv_id = f"bench-{uuid.uuid4().hex[:8]}"
    started = []
    for k in range(nodes):
        argv = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
            "--node-rank", str(k), "--nproc-per-node", str(per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv,
            "--rdzv-id", rdzv_id, "--rdzv-conf", f"is_host={int(k == 0)},join_timeout=60",
            "--local-addr", cluster.addr(k), "--max-restarts", "0", "--monitor-interval", "0.2",
            "-m", "disagmoe.train", *spec.train_flags(entry, run_dir),
        ]  # fmt: skip
        log = (run_dir / f"node{k}.log").open("w")
        proc = subprocess.Popen(
            cluster.wrap(k, argv), stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip
        log.close()
        cluster.track(proc)
        started.append(proc)
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
            ok, error = launch(cluster, spec, runtime, run_dir)
            out = RunOutcome(runtime, rep, run_dir, ok, error, time.perf_counter() - t0)
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
    run_dirs: list[str] = field(default_factory=list)

    @property
    def step_over_bound(self) -> float | None:
        if not self.ok or self.bound is None or self.bound.seconds <= 0:
            return None
        return self.step_time_s / self.bound.seconds

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
            "run_dirs": self.run_dirs,
        }


def _schedule_note(run_dir: Path) -> str:
    """ " order O exchange-chunks C" of a disagg run (its run.json: what `auto` picked), or ""."""
    try:
        facts = json.loads((run_dir / "run.json").read_text()).get("schedule") or {}
    except (OSError, ValueError):
        return ""
    if not facts:
        return ""
    return f" order {facts['order']} exchange-chunks {facts['exchange_chunks']}"


def summarize(
    spec: BenchSpec, outcomes: list[RunOutcome], link_model: LinkModel = "fair"
) -> list[RuntimeResult]:
    """Pool each runtime's measured steps; breakdown and prediction (`link_model`,
    `simulator.links`) from its traces."""
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
        res.layout += _schedule_note(good[0].run_dir)
        times = [t / k for o in good for t in o.step_times.values()]
        res.step_time_s = statistics.median(times)
        medians = [statistics.median(o.step_times.values()) / k for o in good]
        res.step_time_spread_s = (min(medians), max(medians))
        res.tokens_per_s = tokens / res.step_time_s
        parts, predictions, bounds = [], [], []
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
            cfg = load_toml(o.run_dir / "config.toml")
            predictions.append(predict(cfg, spec.world, events, run_net, link_model))
        res.breakdown = Breakdown(
            *(
                statistics.fmean(getattr(p, f) for p in parts) / k
                for f in Breakdown.__dataclass_fields__
            )
        )
        res.predicted_step_s = statistics.median(predictions) / k
        mid = sorted(bounds, key=lambda b: b.seconds)[(len(bounds) - 1) // 2]
        res.bound = dataclasses.replace(
            mid,
            seconds=mid.seconds / k,
            compute_s=mid.compute_s / k,
            network_s=mid.network_s / k,
            serial_s=mid.serial_s / k,
        )
        res.prediction_error = res.predicted_step_s / res.step_time_s - 1.0
        results.append(res)
    by_label = {r.runtime: r for r in results if r.ok}
    for r in results:  # against ep-1f1b in the row's recompute mode
        mode = Entry.parse(r.runtime).recompute
        base = by_label.get(Entry("ep-1f1b", recompute=mode).label)
        if base is not None and r.ok:
            r.ratio_vs_ep_1f1b = r.tokens_per_s / base.tokens_per_s
    return results


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
