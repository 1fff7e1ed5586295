"""A link that dies or stalls under a running step, on the emulated cluster (bench.netns).

    sudo PYTHONPATH=src .venv/bin/python benchmarks/link_faults.py [--comm-timeout 10]
        [--stall-s 3] [--scenarios clean,stall,down,restart] [--tries 5]
        [--link-back-s 0,2,20] [--json PATH]

Two nodes (network namespaces on a bridge, `bench.netns.EmulatedCluster`), two ranks each,
started as a multi-node job is (one `torchrun` agent per node, as `disagmoe bench` does):
the default disagg layout, node-aware (node 0: A r0, F j0; node 1: A r1, F j1), float64,
`--steps 8 --checkpoint-every 4`. A fault starts once `latest` names step 4 and step 5's
record is in metrics.jsonl, so within step 6 or 7 (after the last checkpoint, before the
next save):

* `clean`: no fault; the losses every other scenario is compared with;
* `stall`: node 1's NIC throttled to 10 kbit/s both ways for `--stall-s` seconds (shorter
  than the timeout), then back to full rate: the run must finish, no rank reporting;
* `down`: node 1's link down (its bridge port) and left down, `torchrun --max-restarts 0`:
  every rank's report, when it came (seconds after the fault), whether it names a peer on
  the other node and an instruction, and when the job ended;
* `restart`: the same fault with `--max-restarts 1`; the link comes back (a flapping link)
  `--link-back-s` seconds after every rank reported or was stopped, the agents restart
  their workers, and the job resumes from the last checkpoint: its losses must be
  `clean`'s. `--tries` runs per value of `--link-back-s`. When the link comes back
  decides what node 1's agent, cut off from the rendezvous host on node 0, sees first:
  its own workers' failure (it counts a restart), or node 0 already waiting in the next
  rendezvous round (it restarts its workers as a membership change, without counting one:
  its ranks' `TORCHELASTIC_RESTART_COUNT` stays 0 while node 0's is 1). The agents log at
  INFO; each row records every agent's restart counts and membership restarts.

Prints one row per run, a line per `--link-back-s` value with the restarts that resumed
with the clean losses, and writes `{"rows": [...], "restarts": [...]}` to `--json`
(default benchmarks/results/link_faults.json). Needs root (network namespaces and tc),
like `disagmoe bench`; cleans up its namespaces on every exit path.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from disagmoe.bench.netns import EmulatedCluster, available, kill_all
from disagmoe.bench.runner import start_agents

NODES, RANKS_PER_NODE = 2, 2
FULL_MBIT = 10_000.0
STALL_MBIT = 0.01  # 10 kbit/s: a stalled link, not a dead one
RDZV_PORT = 29500
CHECKPOINT_EVERY = 4
GRACE_S = 15.0  # after node 0's agent exits, the others' time to follow before they are stopped
SCENARIOS = ("clean", "stall", "down", "restart")
# restart: the link back this long after every rank reported (before node 0's agent is in
# the next rendezvous round, after it, and long after: node 1 missed its heartbeats)
LINK_BACK_S = (0.0, 2.0, 20.0)
REPORT = re.compile(r"disagmoe: error: rank (\d+) failed: (?:(\w+): )?(.*)")
PEER = re.compile(r"(?:from|to) rank (\d+)|(\d+)->(\d+)")
INSTRUCTION = re.compile(r"instruction \d+")
AGENT_COUNT = re.compile(r"restart_count=(\d+)")  # an agent's log of each rendezvous round
RESUMED = "resumed from"  # rank 0's line once it loaded a checkpoint (training.loop)
MEMBERSHIP = "new nodes from group_rank"  # an agent restarting healthy workers for a rejoin
SRC = str(Path(__file__).resolve().parent.parent / "src")


@dataclass
class Report:
    rank: int
    after_s: float  # seconds after the fault
    error: str  # the exception's type
    peers: list[int]  # the other ranks it names (senders, receivers of missing messages)
    across_link: bool  # one of them on the other node
    names_instruction: bool
    line: str


@dataclass
class Outcome:
    scenario: str
    exit_codes: list[int]
    wall_s: float
    fault_at_step: int | None = None  # the step in progress when the fault came
    detected_s: float | None = None  # first report, after the fault
    ended_s: float | None = None  # node 0's agent (the rendezvous host) exited, after the fault
    resumed_s: float | None = None  # restart: rank 0 loaded the checkpoint, after the fault
    node_ended_s: list[float | None] = field(default_factory=list)  # each agent's exit
    reports: list[Report] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    max_step_s: float = 0.0
    resumed: str = ""
    losses_equal_clean: bool | None = None  # within float64 rounding (1e-10 relative)
    losses_exact: bool | None = None  # bit for bit
    error: str = ""  # the scenario did not end by itself
    try_index: int = 0
    link_back_s: float | None = None  # restart: the link came back this long after the reports
    agent_restarts: list[list[int]] = field(default_factory=list)  # per node, per round
    membership_restarts: list[int] = field(default_factory=list)  # per node

    @property
    def ok(self) -> bool:
        return not self.error and all(c == 0 for c in self.exit_codes)


def _flags(run_dir: Path, steps: int, comm_timeout: float) -> list[str]:
    return [
        "--dtype", "float64", "--no-progress", "--steps", str(steps), "--checkpoint-every",
        str(CHECKPOINT_EVERY), "--comm-timeout", f"{comm_timeout:g}", "--run-dir", str(run_dir),
        "--seq-len", "32",
    ]  # fmt: skip


def launch(
    cluster: EmulatedCluster, run_dir: Path, flags: list[str], max_restarts: int
) -> list[subprocess.Popen[Any]]:
    """One torchrun agent per node, as `bench.runner.launch` starts them."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": cluster.iface,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "LOGLEVEL": "INFO",  # torchrun's agents: each rendezvous round and restart
        "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]),
    }
    rdzv_id = f"faults-{uuid.uuid4().hex[:8]}"
    rdzv = f"{cluster.addr(0)}:{RDZV_PORT}"
    return start_agents(
        cluster, NODES, RANKS_PER_NODE, rdzv, rdzv_id, flags, run_dir, env, max_restarts
    )


def _records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written
            break
    return out


def _latest(run_dir: Path) -> str:
    path = run_dir / "checkpoints" / "latest"
    return path.read_text().strip() if path.exists() else ""


def _scan_reports(run_dir: Path, seen: dict[int, Report], fault_t: float) -> None:
    for log in sorted(run_dir.glob("node*.log")):
        for line in log.read_text(errors="replace").splitlines():
            match = REPORT.search(line)
            if match is None or int(match.group(1)) in seen:
                continue
            rank, error, text = int(match.group(1)), match.group(2) or "", match.group(3)
            named = {int(g) for m in PEER.finditer(text) for g in m.groups() if g} - {rank}
            seen[rank] = Report(
                rank,
                round(time.monotonic() - fault_t, 2),
                error,
                sorted(named),
                any(r // RANKS_PER_NODE != rank // RANKS_PER_NODE for r in named),
                bool(INSTRUCTION.search(text)),
                line.strip()[:400],
            )


def run_scenario(
    cluster: EmulatedCluster,
    scenario: str,
    out_dir: Path,
    *,
    steps: int,
    comm_timeout: float,
    stall_s: float,
    timeout_s: float,
    grace_s: float = GRACE_S,
    link_back_s: float = 0.0,
    try_index: int = 0,
) -> Outcome:
    name = f"restart-{link_back_s:g}s-{try_index}" if scenario == "restart" else scenario
    run_dir = out_dir / name
    restarts = 1 if scenario == "restart" else 0
    t0 = time.monotonic()
    procs = launch(cluster, run_dir, _flags(run_dir, steps, comm_timeout), restarts)
    fault_t: float | None = None
    restored = False
    gone_t: float | None = None  # every worker reported or was stopped
    reports: dict[int, Report] = {}
    outcome = Outcome(scenario, [], 0.0, try_index=try_index)
    if scenario == "restart":
        outcome.link_back_s = link_back_s
    try:
        ended: list[float | None] = [None] * NODES
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            for k, proc in enumerate(procs):
                if ended[k] is None and proc.poll() is not None and fault_t is not None:
                    ended[k] = round(now - fault_t, 2)
            if ended[0] is not None and now - fault_t - ended[0] > grace_s:  # type: ignore[operator]
                break  # an agent cut off from the rendezvous host waits for it: stop it
            if now - t0 > timeout_s:
                outcome.error = f"still running after {timeout_s:.0f} s: stopped"
                break
            if scenario != "clean" and fault_t is None:
                records = _records(run_dir)
                if (
                    _latest(run_dir) == f"step-{CHECKPOINT_EVERY:08d}"
                    and len(records) > CHECKPOINT_EVERY
                ):
                    fault_t = time.monotonic()
                    outcome.fault_at_step = len(records) + 1
                    if scenario == "stall":
                        cluster.set_rates([FULL_MBIT, STALL_MBIT])
                    else:
                        cluster.set_link(1, up=False)
            if fault_t is not None:
                _scan_reports(run_dir, reports, fault_t)
                if outcome.detected_s is None and reports:
                    outcome.detected_s = min(r.after_s for r in reports.values())
                if restored and outcome.resumed_s is None and RESUMED in _log(run_dir, 0):
                    outcome.resumed_s = round(now - fault_t, 2)
                if scenario == "stall" and not restored and now - fault_t >= stall_s:
                    cluster.set_rates([FULL_MBIT] * NODES)
                    restored = True
                if scenario == "restart" and gone_t is None and _workers_gone(run_dir, reports):
                    gone_t = now
                if not restored and gone_t is not None and now - gone_t >= link_back_s:
                    cluster.set_link(1, up=True)
                    restored = True
            time.sleep(0.05)
        if fault_t is not None:
            for k, proc in enumerate(procs):
                if ended[k] is None and proc.poll() is not None:
                    ended[k] = round(time.monotonic() - fault_t, 2)
            outcome.ended_s, outcome.node_ended_s = ended[0], ended
            _scan_reports(run_dir, reports, fault_t)
    finally:
        kill_all(list(procs))  # (it empties the list it is given)
        if scenario in ("down", "restart") and fault_t is not None:
            cluster.set_link(1, up=True)
        if scenario == "stall":
            cluster.set_rates([FULL_MBIT] * NODES)
    outcome.exit_codes = [p.returncode for p in procs]  # -15 / -9: stopped after GRACE_S
    outcome.wall_s = round(time.monotonic() - t0, 2)
    outcome.reports = sorted(reports.values(), key=lambda r: r.rank)
    records = _records(run_dir)
    outcome.losses = [r["loss"] for r in records]
    outcome.max_step_s = round(max((r["step_time_s"] for r in records), default=0.0), 3)
    logs = "".join(p.read_text(errors="replace") for p in sorted(run_dir.glob("node*.log")))
    resumed = re.search(RESUMED + r" (\S+) at step (\d+)", logs)
    outcome.resumed = f"{Path(resumed.group(1)).name} at step {resumed.group(2)}" if resumed else ""
    for log in sorted(run_dir.glob("node*.log")):
        text = log.read_text(errors="replace")
        outcome.agent_restarts.append([int(m) for m in AGENT_COUNT.findall(text)])
        outcome.membership_restarts.append(text.count(MEMBERSHIP))
    return outcome


def _log(run_dir: Path, node: int) -> str:
    path = run_dir / f"node{node}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def _workers_gone(run_dir: Path, reports: dict[int, Report]) -> bool:
    """Every rank reported, or its node's agent stopped its workers to restart them."""
    if len(reports) == NODES * RANKS_PER_NODE:
        return True
    logs = [p.read_text(errors="replace") for p in sorted(run_dir.glob("node*.log"))]
    stopping = [("Stopping worker group" in text or "[1/1] Restarting" in text) for text in logs]
    return len(logs) == NODES and all(stopping)


def _same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-10 * abs(y) for x, y in zip(a, b, strict=True))


def run(
    scenarios: list[str],
    *,
    steps: int,
    comm_timeout: float,
    stall_s: float,
    timeout_s: float,
    out: str = "",
    grace_s: float = GRACE_S,
    tries: int = 1,
    link_back_s: tuple[float, ...] = (0.0,),
) -> list[Outcome]:
    """The scenarios on one emulated cluster, `clean` first whenever another needs it;
    `restart` `tries` times for each `link_back_s`."""
    if reason := available():
        raise SystemExit(f"link_faults.py needs network namespaces: {reason}")
    wanted = list(scenarios)
    if "clean" not in wanted and any(s in wanted for s in ("stall", "restart")):
        wanted.insert(0, "clean")
    runs = [
        (scenario, back, k)
        for scenario in wanted
        for back in (link_back_s if scenario == "restart" else (0.0,))
        for k in range(tries if scenario == "restart" else 1)
    ]
    outcomes: list[Outcome] = []
    with (
        EmulatedCluster([FULL_MBIT] * NODES) as cluster,
        tempfile.TemporaryDirectory(prefix="link-faults-") as tmp,
    ):
        if out:
            tmp = out
        for scenario, back, k in runs:
            what = (
                f"{scenario}, link back {back:g} s, try {k + 1}"
                if scenario == "restart"
                else scenario
            )
            print(f"link_faults: {what} ...", file=sys.stderr, flush=True)
            outcomes.append(
                run_scenario(
                    cluster,
                    scenario,
                    Path(tmp),
                    steps=steps,
                    comm_timeout=comm_timeout,
                    stall_s=stall_s,
                    timeout_s=timeout_s,
                    grace_s=grace_s,
                    link_back_s=back,
                    try_index=k,
                )
            )
    clean = next((o for o in outcomes if o.scenario == "clean"), None)
    for o in outcomes:
        if clean is not None and o is not clean and o.ok and o.scenario != "down":
            o.losses_equal_clean = _same(o.losses, clean.losses)
            o.losses_exact = o.losses == clean.losses
    return [o for o in outcomes if o.scenario in scenarios]


def restart_summary(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    """Per `link_back_s`: tries, how many resumed from a checkpoint with the clean losses,
    and in how many an agent restarted healthy workers as a membership change."""
    out = []
    for back in sorted({o.link_back_s for o in outcomes if o.link_back_s is not None}):
        mine = [o for o in outcomes if o.scenario == "restart" and o.link_back_s == back]
        out.append(
            {
                "link_back_s": back,
                "tries": len(mine),
                "resumed_equal_clean": sum(
                    1 for o in mine if o.ok and o.resumed and o.losses_equal_clean
                ),
                "membership_restart_tries": sum(1 for o in mine if any(o.membership_restarts)),
            }
        )
    return out


def _agents(o: Outcome) -> str:
    """Each agent's restart count in its last round, `m` when it restarted healthy workers
    for a rejoining node (a membership change, not counted): "1,0m"."""
    return ",".join(
        f"{counts[-1] if counts else '-'}{'m' if m else ''}"
        for counts, m in zip(o.agent_restarts, o.membership_restarts, strict=True)
    )


def _row(o: Outcome) -> str:
    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    reported = len(o.reports)
    peers = sum(1 for r in o.reports if r.across_link)
    same = {None: "-", True: "yes", False: "NO"}[o.losses_equal_clean]
    return (
        f"{o.scenario:8s} {num(o.link_back_s):>4s} {','.join(map(str, o.exit_codes)):>6s} "
        f"{num(o.detected_s):>8s} {num(o.resumed_s):>7s} {num(o.ended_s):>6s} {reported:>7d} "
        f"{peers:>6d} "
        f"{o.max_step_s:>8.2f} {_agents(o):>7s} {o.resumed or '-':>23s} {same:>6s}"
    )


HEADER = (
    "scenario back  exits detected resumed  ended reports across max step  agents"
    "            resumed from losses=clean"
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--comm-timeout", type=float, default=10.0)
    p.add_argument("--stall-s", type=float, default=3.0)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--tries", type=int, default=5, help="runs of `restart` per --link-back-s")
    p.add_argument(
        "--link-back-s",
        default=",".join(f"{b:g}" for b in LINK_BACK_S),
        help="restart: seconds after every rank reported until the link is back (list)",
    )
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per scenario")
    p.add_argument("--json", default="benchmarks/results/link_faults.json")
    p.add_argument("--out", default="", help="keep the run dirs here (default: a temp dir)")
    args = p.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    if unknown := set(scenarios) - set(SCENARIOS):
        p.error(f"unknown scenarios {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    outcomes = run(
        scenarios, steps=args.steps, comm_timeout=args.comm_timeout, stall_s=args.stall_s,
        timeout_s=args.timeout, out=args.out, tries=args.tries,
        link_back_s=tuple(float(b) for b in args.link_back_s.split(",") if b),
    )  # fmt: skip
    restarts = restart_summary(outcomes)
    print(
        f"2 nodes x 2 ranks (disagg, node-aware), --comm-timeout {args.comm_timeout:g}, "
        f"stall {args.stall_s:g} s at {STALL_MBIT * 1000:g} kbit/s; seconds after the fault"
    )
    print(HEADER)
    for o in outcomes:
        print(_row(o))
    for r in restarts:
        print(
            f"restart, link back {r['link_back_s']:g} s after the reports: "
            f"{r['resumed_equal_clean']}/{r['tries']} resumed with the clean losses "
            f"({r['membership_restart_tries']} with a membership restart)"
        )
    if args.json:
        from results_io import write_json

        write_json(
            args.json,
            {
                "comm_timeout_s": args.comm_timeout,
                "stall_s": args.stall_s,
                "stall_kbit_s": STALL_MBIT * 1000,
                "steps": args.steps,
                "rows": [{**asdict(o), "ok": o.ok} for o in outcomes],
                "restarts": restarts,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
