"""What a bench runs: its rows (`Entry`) and the cluster, workload and layouts they share
(`BenchSpec`), down to each row's `disagmoe train` flags.

A row is a runtime and, for `disagg`, one split (`splits`: the planner's, or the even
m = n), one placement (`placements`: node-aware or packed) and one exchange chunk count
(`exchange_chunks`), each with `--ranks-per-node R`; with `recomputes`, every runtime
once per recompute mode. Rows are labelled `disagg`, `disagg (even, packed)`,
`ep-1f1b (recompute full)`, ... (defaults left out). `bench.runner` launches them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..config import PLACEMENTS, RECOMPUTE, ParallelConfig
from ..distributed.layout import Layout
from ..presets import model_preset
from .analysis import emulated_network

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
    nic_gbps: float  # Gbit/s per worker (`--nic-gbit`; the JSON reports keep this key)
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
    queue_kb: float = 500.0  # the NICs' tbf queue, kB (bytes are not time-scaled)
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
    # ep-* rows: (runtime, pp, ep, virtual stages, pipeline warm-up) each runs
    # (`bench.ep_layouts`: the simulator's best; a report from before the warm-up has no
    # fifth entry: 0); a runtime not listed runs `pp` / `ep`
    ep_layouts: tuple[tuple[str, int, int, int, int], ...] = ()
    # (runtime, expert compute chunks) of the chunked runtimes (`config.CHUNKED_RUNTIMES`)
    # with their searched layouts; a runtime not listed runs the config's
    ep_chunks: tuple[tuple[str, int], ...] = ()

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
        for runtime, pp, ep, v, *warmup in self.ep_layouts:
            if runtime == e.runtime:
                extra = ["--virtual-stages", str(v)] if runtime == "ep-interleaved" else []
                for chunked, k in self.ep_chunks:
                    if chunked == runtime and k:
                        extra = ["--overlap-chunks", str(k)]
                if warmup and warmup[0]:
                    extra += ["--pipeline-warmup", str(warmup[0])]
                return ["--pp", str(pp), "--ep", str(ep), *extra, "--world-size", str(self.world)]
        pp = self.pp or 1
        ep = self.ep or self.world // pp
        return ["--pp", str(pp), "--ep", str(ep), "--world-size", str(self.world)]

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
