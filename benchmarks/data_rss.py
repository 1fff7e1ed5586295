"""Memory of `--data PREFIX` against the token file's size: memory-mapped, O(1) shuffling.

    .venv/bin/python benchmarks/data_rss.py [--json PATH] [--sizes-gib 0.0625 1 4] [--steps 50]

For each size, in a fresh process: a sparse token file of that size (uint16 zeros, no
disk used) with a `prepare-data` metadata JSON beside it, then `data.build_batches` and
`--steps` global batches of 64 x 65 tokens. Prints the process's anonymous RSS (heap: what
would grow if the file were read or a permutation of its samples stored) and file-backed
RSS (page-cache pages of the samples read, bounded by steps x batch, not by the file)
before and after. `--json PATH` writes `{"rows": [{gib, samples, anon_mib, file_mib}]}`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import json, sys
from disagmoe.data import build_batches
prefix, size, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with open(prefix + ".bin", "wb") as f:
    f.truncate(size)
json.dump({"dtype": "uint16", "vocab_size": 256, "tokenizer": "-"}, open(prefix + ".json", "w"))
def rss():
    f = dict(l.split(":") for l in open("/proc/self/status") if l.startswith("Rss"))
    return [int(f[k].split()[0]) / 1024 for k in ("RssAnon", "RssFile")]
before = rss()
batches = build_batches(prefix, "uint16", seq_len=64, global_batch_size=64, seed=0, vocab_size=256)
for step in range(steps):
    batches.global_batch(step)
print(json.dumps({"samples": batches.num_samples, "before": before, "after": rss()}))
"""


def measure(gib: float, steps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(Path(tmp) / "t"), str(int(gib * 2**30)), str(steps)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    r = json.loads(out)
    return {"gib": gib, "samples": r["samples"], "anon_mib": r["after"][0],
            "anon_before_mib": r["before"][0], "file_mib": r["after"][1]}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes-gib", type=float, nargs="+", default=[0.0625, 1.0, 4.0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--json", default="")
    args = p.parse_args()
    rows = [measure(g, args.steps) for g in args.sizes_gib]
    print(f"{'file GiB':>9} {'samples':>10} {'anon MiB':>15} {'file-backed MiB':>16}")
    for r in rows:
        anon = f"{r['anon_before_mib']:.0f} -> {r['anon_mib']:.0f}"
        print(f"{r['gib']:>9.4g} {r['samples']:>10} {anon:>15} {r['file_mib']:>16.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
