"""An emulated bandwidth-limited cluster on one Linux machine: network namespaces + `tc tbf`.

Topology (everything lives in namespaces this process creates; the root namespace and
the machine's own interfaces are never touched):

    dmoe-<pid>-hub:   bridge `br0` with ports v0 .. v{N-1}
    dmoe-<pid>-n<k>:  `eth0` (veth peer of hub's `v<k>`), address 10.213.1.<100+k>/24, `lo`

* a "node" is one namespace; its ranks talk to each other over the namespace's local
  route (loopback speed: the "NVLink" of the node) and to other nodes over `eth0`;
* the node's NIC is rate-limited in both directions with a token bucket filter: egress on
  its `eth0`, ingress as egress of the hub's `v<k>` towards it (full duplex, like a NIC);
* commands run in a node with `ip netns exec` (see `EmulatedCluster.wrap`), gloo bound to
  `eth0` with GLOO_SOCKET_IFNAME.

Cleanup runs on every exit path: `close()` from the context manager's `__exit__`
(normal exit and exceptions), SIGINT / SIGTERM handlers (which then raise
KeyboardInterrupt / SystemExit), and `atexit`. It first kills the process groups started
in the nodes, then deletes the namespaces (which removes their veths and qdiscs).

Without root (or without `ip`/`tc`), `available()` says why and callers fall back to
plain loopback (`LoopbackCluster`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from types import FrameType, TracebackType
from typing import Any

SUBNET = "10.213.1"
HOST_BASE = 100  # node k is 10.213.1.<100+k>: three digits, so addresses sort as node order
MAX_NODES = 100
PREFIX = "dmoe-"
_STALE = re.compile(r"^dmoe-(\d+)-")


def available() -> str:
    """Empty string if namespaces can be created here, else why not."""
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "not root (network namespaces and tc need CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) not found"
    return ""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {result.stderr.strip()}")
    return result


def list_namespaces(prefix: str = PREFIX) -> list[str]:
    """Network namespaces whose name starts with `prefix`."""
    if shutil.which("ip") is None:
        return []
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def reap_stale() -> list[str]:
    """Delete namespaces `dmoe-<pid>-*` left by a bench process that no longer exists."""
    removed = []
    for name in list_namespaces():
        match = _STALE.match(name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            _run("ip", "netns", "delete", name, check=False)
            removed.append(name)
    return removed


QUEUE_MS = 5.0  # a link's queue, in time at its rate, unless given in bytes
QUEUE_KB = 500.0  # the bench's queue: 5 ms at 0.8 Gbit/s (two ranks at 0.4), in any time scale
MTU = 9000


def tbf_args(
    mbit: float, queue_ms: float = QUEUE_MS, mtu: int = MTU, queue_bytes: int = 0
) -> list[str]:
    """`tc` arguments of a token bucket at `mbit` Mbit/s: ~1 ms of burst, a short queue.

    The queue is kept short (a switch port's, not a 100 ms home router's): gloo's small
    control messages (and TCP acks) of one stream share a direction with another stream's
    bulk data, and a deep FIFO would delay them by its whole length. It holds `queue_bytes`
    beyond the bucket where given (a switch port's buffer is bytes, whatever the rate),
    else `queue_ms` at the rate. The bucket holds at least two frames of `mtu` bytes.
    """
    rate_bytes = mbit * 1e6 / 8
    burst = max(int(rate_bytes * 1e-3), 16 * 1024, 2 * mtu)
    queue = ["limit", str(queue_bytes + burst)] if queue_bytes > 0 else ["latency", f"{queue_ms}ms"]
    return ["tbf", "rate", f"{mbit:.3f}mbit", "burst", str(burst), *queue]


@dataclass
class EmulatedCluster:
    """`num_nodes` namespaces on a bridge; node k's NIC limited to `node_mbit[k]` Mbit/s."""

    node_mbit: list[float]
    mtu: int = MTU  # jumbo frames: a sixth of the packets (and kernel CPU) of 1500
    queue_ms: float = QUEUE_MS
    queue_bytes: int = 0  # > 0: every NIC's queue in bytes, whatever its rate (`tbf_args`)
    name: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    kind: str = "netns"
    _procs: list[subprocess.Popen[Any]] = field(default_factory=list, repr=False)
    _created: list[str] = field(default_factory=list, repr=False)
    _old_handlers: dict[int, Any] = field(default_factory=dict, repr=False)
    _closed: bool = False

    @property
    def num_nodes(self) -> int:
        return len(self.node_mbit)

    @property
    def hub(self) -> str:
        return f"{self.name}-hub"

    def node(self, k: int) -> str:
        return f"{self.name}-n{k}"

    def addr(self, k: int) -> str:
        return f"{SUBNET}.{HOST_BASE + k}"

    @property
    def iface(self) -> str:
        return "eth0"

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> EmulatedCluster:
        self._install_handlers()
        atexit.register(self.close)
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _create(self) -> None:
        if not 1 <= self.num_nodes <= MAX_NODES:
            raise ValueError(f"--nodes must be in [1, {MAX_NODES}], got {self.num_nodes}")
        reap_stale()
        hub = self.hub
        self._add_ns(hub)
        _run("ip", "-n", hub, "link", "set", "lo", "up")
        _run("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", hub, "link", "set", "br0", "up")
        for k, mbit in enumerate(self.node_mbit):
            ns = self.node(k)
            self._add_ns(ns)
            port = f"v{k}"
            _run("ip", "-n", hub, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                 "netns", ns)  # fmt: skip
            _run("ip", "-n", hub, "link", "set", port, "mtu", str(self.mtu))
            _run("ip", "-n", ns, "link", "set", "eth0", "mtu", str(self.mtu))
            _run("ip", "-n", hub, "link", "set", port, "master", "br0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.addr(k)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            # egress of the node (its NIC sending) and egress of the hub port (NIC receiving)
            tbf = tbf_args(mbit, self.queue_ms, self.mtu, self.queue_bytes)
            _run("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", *tbf)
            _run("tc", "-n", hub, "qdisc", "add", "dev", port, "root", *tbf)

    def set_rates(self, node_mbit: list[float]) -> None:
        """Change the nodes' NIC rates in place (both directions), e.g. between runtimes."""
        if len(node_mbit) != self.num_nodes:
            raise ValueError(f"{len(node_mbit)} rates for {self.num_nodes} nodes")
        for k, (old, new) in enumerate(zip(self.node_mbit, node_mbit, strict=True)):
            if abs(old - new) < 1e-9:
                continue
            tbf = tbf_args(new, self.queue_ms, self.mtu, self.queue_bytes)
            _run("tc", "-n", self.node(k), "qdisc", "change", "dev", "eth0", "root", *tbf)
            _run("tc", "-n", self.hub, "qdisc", "change", "dev", f"v{k}", "root", *tbf)
        self.node_mbit = list(node_mbit)

    def set_link(self, k: int, up: bool) -> None:
        """Take node k's link down (its hub port: nothing in or out of the node) or up
        again; the qdiscs and addresses stay (fault tests: a cable pulled, a switch port
        lost)."""
        _run("ip", "-n", self.hub, "link", "set", f"v{k}", "up" if up else "down")

    def _add_ns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._created.append(name)

    def wrap(self, node: int, argv: list[str]) -> list[str]:
        """`argv` run inside node `node`'s namespace."""
        return ["ip", "netns", "exec", self.node(node), *argv]

    def track(self, proc: subprocess.Popen[Any]) -> None:
        """Kill this process group on cleanup (start it with `start_new_session=True`)."""
        self._procs.append(proc)

    def drops(self) -> int:
        """Packets the cluster's token buckets have dropped so far (`tc -s qdisc show`)."""
        total = 0
        for ns in self._created:
            out = _run("tc", "-s", "-n", ns, "qdisc", "show", check=False).stdout
            total += sum(int(n) for n in re.findall(r"dropped (\d+)", out))
        return total

    def qdiscs(self) -> list[str]:
        """`tc qdisc show` lines of every namespace of this cluster (for reports and tests)."""
        lines = []
        for ns in self._created:
            out = _run("tc", "-n", ns, "qdisc", "show", check=False).stdout
            lines += [f"{ns}: {line}" for line in out.splitlines() if "tbf" in line]
        return lines

    def close(self) -> None:
        """Kill started process groups, delete the namespaces; idempotent."""
        if self._closed:
            return
        self._closed = True
        kill_all(self._procs)
        for ns in reversed(self._created):
            _run("ip", "netns", "delete", ns, check=False)
        self._created.clear()
        self._restore_handlers()
        atexit.unregister(self.close)

    # ------------------------------------------------------------------ signals

    def _install_handlers(self) -> None:
        def on_signal(signum: int, frame: FrameType | None) -> None:
            self.close()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)

        for sig in (signal.SIGINT, signal.SIGTERM):
            # outside the main thread this raises ValueError: __exit__ and atexit remain
            with contextlib.suppress(ValueError):
                self._old_handlers[sig] = signal.signal(sig, on_signal)

    def _restore_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            with contextlib.suppress(ValueError):
                signal.signal(sig, handler)
        self._old_handlers.clear()


@dataclass
class LoopbackCluster:
    """Fallback without root: every rank on the host's loopback, no rate limit."""

    num_nodes: int
    reason: str
    kind: str = "loopback"
    _procs: list[subprocess.Popen[Any]] = field(default_factory=list, repr=False)

    @property
    def iface(self) -> str:
        return "lo"

    def addr(self, k: int) -> str:
        return "127.0.0.1"

    def wrap(self, node: int, argv: list[str]) -> list[str]:
        return argv

    def track(self, proc: subprocess.Popen[Any]) -> None:
        self._procs.append(proc)

    def qdiscs(self) -> list[str]:
        return []

    def drops(self) -> int:
        """Nothing is rate-limited, so nothing is dropped."""
        return 0

    def set_rates(self, node_mbit: list[float]) -> None:
        """Nothing to limit on loopback."""

    def __enter__(self) -> LoopbackCluster:
        atexit.register(self.close)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        kill_all(self._procs)
        atexit.unregister(self.close)


def kill_all(procs: list[subprocess.Popen[Any]], grace_s: float = 3.0) -> None:
    """SIGTERM each process group still alive, then SIGKILL after `grace_s`."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in alive:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(deadline - time.monotonic(), 0.01))
    for p in procs:  # also stragglers of exited leaders (their group may live on)
        _signal_group(p, signal.SIGKILL)
        if p.poll() is None:
            p.wait()
    procs.clear()


def _signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
