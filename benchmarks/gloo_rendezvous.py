"""Does a gloo send move its bytes before the receiver posts the matching receive?

    .venv/bin/python benchmarks/gloo_rendezvous.py [--mib 64] [--delays 0,0.3] [--json PATH]

Two ranks (`testing.spawn.run_ranks`, gloo on loopback, one thread each). For each delay
the sender posts an `isend` of `--mib` MiB and waits for it; the receiver sleeps the delay,
then posts the `irecv` and times it to completion. If gloo moved the bytes ahead (an eager
protocol), a receive posted late would complete at once; if it waits for the receive (a
rendezvous), every receive takes about the transfer time after it is posted, and the
sender's wait lasts the delay plus that. Prints a table; `--json PATH` writes `{"rows":
[{delay_s, recv_after_post_ms, send_wait_ms}]}`. Why it matters: the runtime posts a
payload's receive when its header arrives (`distributed.exchange`), so under a rendezvous
every payload pays that delay before its bytes move.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from results_io import write_json

from disagmoe.testing.spawn import run_ranks


def _measure(mib: int, delays: list[float]) -> list[dict[str, float]]:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    t = torch.ones(mib * (1 << 20) // 4)
    rows = []
    for delay in delays:
        dist.barrier()
        if rank == 0:
            t0 = time.perf_counter()
            work = dist.isend(t, 1)
            assert work is not None
            work.wait()
            rows.append({"delay_s": delay, "send_wait_ms": 1e3 * (time.perf_counter() - t0)})
        else:
            time.sleep(delay)
            r = torch.empty_like(t)
            t0 = time.perf_counter()
            work = dist.irecv(r, 0)
            assert work is not None
            work.wait()
            rows.append({"delay_s": delay, "recv_after_post_ms": 1e3 * (time.perf_counter() - t0)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=64, help="message size in MiB")
    parser.add_argument("--delays", default="0,0.3", help="receiver delays, seconds")
    parser.add_argument("--json", default="", help="write the rows here")
    args = parser.parse_args()
    delays = [float(d) for d in args.delays.split(",")]
    sender, receiver = run_ranks(_measure, 2, args.mib, delays)
    rows = [{**s, **r} for s, r in zip(sender, receiver, strict=True)]
    print(f"{'delay s':>8s} {'recv after post ms':>19s} {'send wait ms':>13s}  ({args.mib} MiB)")
    for row in rows:
        print(
            f"{row['delay_s']:8.2f} {row['recv_after_post_ms']:19.1f} {row['send_wait_ms']:13.1f}"
        )
    if args.json:
        write_json(args.json, {"mib": args.mib, "rows": rows})


if __name__ == "__main__":
    main()
