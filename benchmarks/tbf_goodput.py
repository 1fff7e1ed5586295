"""TCP goodput through the emulated cluster's NICs, against the rate the bench assumes.

    sudo .venv/bin/python benchmarks/tbf_goodput.py [--setting MBIT:QUEUE_KB ...]
        [--seconds 8] [--json PATH]

The bench's link model (`bench.analysis.emulated_network`, and the trace bound) takes a
node's goodput as `TCP_EFFICIENCY` (0.94) x its tbf rate, shared max-min fairly by every
flow in flight. This measures what TCP really gets through the same namespaces and token
buckets (`bench.netns.EmulatedCluster`, the bench's MTU and queue: `QUEUE_KB` beyond the
bucket, at every rate), per setting (`--setting`; by default the bench's NIC rates at 8
and 16 workers) and one pattern at a time:

* `1 flow`: node 0 -> node 1, one connection;
* `4 flows`: node 0 -> node 1, four connections at once (a NIC shared by several streams);
* `all to all`: 4 nodes, every node sending to every other at once (12 flows; each NIC
  carries 3 out and 3 in, as AF-Pipe's exchange does);
* `on/off`: node 0 -> node 1, 64 KiB bursts with 2 ms pauses (a stream that goes idle
  between messages, as per-layer exchanges do);
* `all to all on/off`: the all-to-all's 12 flows as 64 KiB bursts with 2 ms pauses.

Prints per pattern the goodput per sending NIC (bytes received, from the first byte's
arrival to the last's at the receivers, over the sending nodes) over the tbf rate, and
the packets the token buckets dropped; `--json PATH` writes `{"rows": [{mbit, queue_kb,
pattern, flows, goodput_ratio, drops}]}`. Needs root (network namespaces), like `disagmoe bench`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from results_io import write_json

from disagmoe.bench.analysis import TCP_EFFICIENCY
from disagmoe.bench.netns import QUEUE_KB, EmulatedCluster, available

PORT = 47000

# A receiver: accepts `n` connections on PORT and counts their bytes until they close;
# prints the bytes and the wall-clock times of the first and the last.
RECEIVER = r"""
import socket, sys, threading, time
n = int(sys.argv[1]); total = [0]; first = [float("inf")]; last = [0.0]
lock = threading.Lock()
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", PORT)); srv.listen(64)
print("ready", flush=True)
def take(c):
    got, t0, t1 = 0, None, 0.0
    while True:
        b = c.recv(1 << 20)
        if not b:
            break
        t1 = time.time()
        if t0 is None:
            t0 = t1
        got += len(b)
    with lock:
        total[0] += got
        if t0 is not None:
            first[0] = min(first[0], t0); last[0] = max(last[0], t1)
threads = []
for _ in range(n):
    c, _ = srv.accept()
    t = threading.Thread(target=take, args=(c,)); t.start(); threads.append(t)
for t in threads:
    t.join()
print(total[0], first[0], last[0], flush=True)
""".replace("PORT", str(PORT))

# A sender: one connection per destination; from `start_at` (wall clock) sends for
# `seconds` (bursts with pauses if `pause_ms` > 0), then closes.
SENDER = r"""
import socket, sys, threading, time
seconds, burst, pause_ms = float(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
start_at, dests = float(sys.argv[4]), sys.argv[5:]
buf = b"x" * burst
def send(addr):
    s = socket.create_connection((addr, PORT))
    time.sleep(max(start_at - time.time(), 0.0))  # every sender of a pattern starts at once
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        s.sendall(buf)
        if pause_ms > 0:
            time.sleep(pause_ms / 1e3)
    s.close()
threads = [threading.Thread(target=send, args=(d,)) for d in dests]
for t in threads: t.start()
for t in threads: t.join()
""".replace("PORT", str(PORT))


def _measure(
    cluster: EmulatedCluster,
    flows: dict[int, list[int]],
    seconds: float,
    burst: float = 1 << 20,
    pause_ms: float = 0.0,
) -> float:
    """Goodput per sending NIC / tbf rate: `flows` = {sender node: [receiver nodes]}."""
    incoming: dict[int, int] = {}
    for dsts in flows.values():
        for d in dsts:
            incoming[d] = incoming.get(d, 0) + 1
    receivers = {}
    for node, n in incoming.items():
        argv = cluster.wrap(node, [sys.executable, "-c", RECEIVER, str(n)])
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        cluster.track(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        receivers[node] = proc
    senders = []
    start_at = time.time() + 3.0  # after every sender process has started
    for node, dsts in flows.items():
        args = [str(seconds), str(int(burst)), str(pause_ms), str(start_at)]
        args += [cluster.addr(d) for d in dsts]
        sender = subprocess.Popen(cluster.wrap(node, [sys.executable, "-c", SENDER, *args]))
        cluster.track(sender)
        senders.append(sender)
    for sender in senders:
        sender.wait(timeout=seconds + 60)
    got, first, last = 0, float("inf"), 0.0
    for proc in receivers.values():
        out, _ = proc.communicate(timeout=60)
        nbytes, t0, t1 = out.strip().splitlines()[-1].split()
        got, first, last = got + int(nbytes), min(first, float(t0)), max(last, float(t1))
    rate = cluster.node_mbit[0] * 1e6 / 8
    return got / (last - first) / len(flows) / rate


PATTERNS: list[tuple[str, dict[int, list[int]], dict[str, float]]] = [
    ("1 flow", {0: [1]}, {}),
    ("4 flows", {0: [1, 1, 1, 1]}, {}),
    ("all to all", {k: [d for d in range(4) if d != k] for k in range(4)}, {}),
    ("on/off", {0: [1]}, {"burst": 64 << 10, "pause_ms": 2.0}),
    ("all to all on/off", {k: [d for d in range(4) if d != k] for k in range(4)},
     {"burst": 64 << 10, "pause_ms": 2.0}),
]  # fmt: skip


# (Mbit/s per node of wall clock, queue kB): the bench's NICs at 8 workers and 0.4 / 0.1
# Gbit/s (2 ranks per node, time scale 32), and at 16 workers and 0.4 Gbit/s (64), with
# the bench's queue (QUEUE_KB)
BENCH_SETTINGS = ((25.0, QUEUE_KB), (6.25, QUEUE_KB), (12.5, QUEUE_KB))


def _setting(text: str) -> tuple[float, float]:
    try:
        mbit, queue_kb = (float(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MBIT:QUEUE_KB, got {text!r}") from None
    return mbit, queue_kb


def _run_setting(mbit: float, queue_kb: float, seconds: float) -> list[dict]:
    wall_ms = queue_kb * 8 / mbit
    print(
        f"tbf {mbit:g} Mbit/s per node, queue {queue_kb:g} kB ({wall_ms:.0f} ms at the rate); "
        f"the bench assumes {TCP_EFFICIENCY:.2f}"
    )
    print(f"{'pattern':18s} {'flows':>5s} {'goodput / rate':>15s} {'tbf drops':>10s}")
    rows = []
    with EmulatedCluster([mbit] * 4, queue_bytes=int(queue_kb * 1000)) as cluster:
        for name, flows, kw in PATTERNS:
            before = cluster.drops()
            ratio = _measure(cluster, flows, seconds, **kw)
            drops = cluster.drops() - before
            count = sum(len(d) for d in flows.values())
            rows.append(
                {"mbit": mbit, "queue_kb": queue_kb, "pattern": name, "flows": count,
                 "goodput_ratio": round(ratio, 3), "drops": drops}
            )  # fmt: skip
            print(f"{name:18s} {count:5d} {ratio:15.3f} {drops:10d}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--setting", type=_setting, action="append", metavar="MBIT:QUEUE_KB",
        help="a tbf rate per node (Mbit/s of wall clock) and queue (kB beyond the bucket); "
        "repeatable; by default the bench's three NIC settings with its queue"
    )  # fmt: skip
    parser.add_argument("--seconds", type=float, default=8.0, help="per pattern")
    parser.add_argument("--json", default="", help="write the rows to this JSON file")
    args = parser.parse_args()
    why = available()
    if why:
        print(f"tbf_goodput: needs network namespaces: {why}", file=sys.stderr)
        return 2
    rows = []
    for mbit, queue_kb in args.setting or BENCH_SETTINGS:
        rows += _run_setting(mbit, queue_kb, args.seconds)
    if args.json:
        write_json(args.json, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
