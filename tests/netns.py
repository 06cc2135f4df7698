"""Nodes of a cluster on one machine: Linux network namespaces joined by veth links.

    with Cluster(2, rate="50mbit") as nodes:
        proc = nodes.popen(0, ["python", "-m", "http.server"], env=nodes.env(0))
        nodes.address(0)  # '10.77.<k>.1', reachable from node 1 only through the link

Each node is a namespace with its own loopback and one interface on a private /24. Two nodes
are joined by one veth pair, end to end; more nodes each plug a veth into a bridge that lives in
a namespace of its own (the "switch"). Nothing is made in the host's own namespace, so deleting
the namespaces removes every interface, address and qdisc with them, and the subnet cannot clash
with the host's routes. A `rate` shapes each node's sending side with tbf (this kernel has no
netem, fq or fq_codel).

Everything is removed on close, on exit (atexit), on SIGTERM and SIGINT while a cluster is open,
and leftovers of a dead process (names carry the pid) are removed when the next cluster starts.
Needs root; it raises rather than skipping when it cannot make a namespace.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Sequence

PREFIX = "dragon-ns"  # namespaces: f"{PREFIX}-{pid}-c{count}-n{node}" (-sw: the switch)
_NAME = re.compile(rf"^{PREFIX}-(\d+)-")
_open: list[Cluster] = []


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *args] if ns is None else ["ip", "netns", "exec", ns, "ip", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")


def namespaces() -> list[str]:
    """Every namespace on the machine (names only)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is as gone as a dead process: its namespaces have no owner left
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _kill_inside(ns: str) -> None:
    """SIGKILL every process still inside namespace `ns` (all started by the cluster that owns
    it), else the namespace outlives `ip netns del` for as long as they run."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    for pid in map(int, out.split()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _delete(ns: str) -> None:
    _kill_inside(ns)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def remove_leftovers() -> list[str]:
    """Delete namespaces of this harness whose owning process is gone (a killed test run).
    A live owner's (a parallel session's) are left alone. Returns the names removed."""
    gone = [ns for ns in namespaces() if (m := _NAME.match(ns)) and not alive(int(m[1]))]
    for ns in gone:
        _delete(ns)
    return gone


class Cluster:
    """`n` nodes (network namespaces) on a private subnet, node i at 10.77.<k>.(i + 1)."""

    def __init__(
        self,
        n: int = 2,
        rate: str | None = None,
        burst: str = "128kb",
        latency: str = "200ms",
        tag: str = "",
    ) -> None:
        if n < 1:
            raise ValueError(f"a cluster of {n} nodes")
        self.n, self.rate, self.burst, self.latency = n, rate, burst, latency
        pid = os.getpid()
        # names unique per process (pid) and per cluster (a counter) so parallel sessions and
        # successive clusters of one session never share a namespace or an interface name
        Cluster._count = getattr(Cluster, "_count", 0) + 1
        uid = f"{pid}-c{Cluster._count}{tag}"
        self.names = [f"{PREFIX}-{uid}-n{i}" for i in range(n)]
        self.switch = f"{PREFIX}-{uid}-sw" if n > 2 else None
        # interface names are at most 15 characters: "dv" + pid + counter + node
        self.ifnames = [f"dv{pid % 10**7}c{Cluster._count % 100}n{i}" for i in range(n)]
        self.subnet = f"10.77.{pid % 250}"  # isolated anyway: a second session may share it
        self.procs: list[subprocess.Popen] = []
        self._up = False

    # -- life cycle ------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        """Make the namespaces and links. On any failure, remove what was made and raise."""
        remove_leftovers()
        _open.append(self)
        _install_handlers()
        self._up = True
        try:
            self._build()
        except BaseException:
            self.down()
            raise

    def _build(self) -> None:
        for ns in [*self.names, *([self.switch] if self.switch else [])]:
            _ip("netns", "add", ns)
            _ip("link", "set", "lo", "up", ns=ns)
        if self.switch is None and self.n == 2:  # one cable, end to end
            a, b = self.ifnames
            _ip("link", "add", a, "netns", self.names[0], "type", "veth",
                "peer", "name", b, "netns", self.names[1])
        elif self.switch is not None:  # a cable from each node to the switch's bridge
            _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
            _ip("link", "set", "br0", "up", ns=self.switch)
            for i, name in enumerate(self.names):
                port = f"p{i}"
                _ip("link", "add", self.ifnames[i], "netns", name, "type", "veth",
                    "peer", "name", port, "netns", self.switch)
                _ip("link", "set", port, "master", "br0", ns=self.switch)
                _ip("link", "set", port, "up", ns=self.switch)
        for i, name in enumerate(self.names):
            if self.n == 1:  # a lone node still gets an interface to bind to
                _ip("link", "add", self.ifnames[i], "type", "dummy", ns=name)
            _ip("addr", "add", f"{self.address(i)}/24", "dev", self.ifnames[i], ns=name)
            _ip("link", "set", self.ifnames[i], "up", ns=name)
            if self.rate:
                self.shape(i, self.rate)

    def shape(self, node: int, rate: str | None) -> None:
        """Limit what `node` sends to `rate` (tc syntax: "50mbit"); None removes the limit."""
        ns, dev = self.names[node], self.ifnames[node]
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                       capture_output=True)  # none there yet is fine
        if rate:
            cmd = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                   "rate", rate, "burst", self.burst, "latency", self.latency]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")

    def down(self) -> None:
        """Stop every process this cluster started and delete its namespaces (idempotent)."""
        if not self._up:
            return
        self._up = False
        for proc in self.procs:
            if proc.poll() is None:
                try:  # the whole session: launchers leave ranks behind if only they are killed
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for ns in [*self.names, *([self.switch] if self.switch else [])]:
            _delete(ns)
        if self in _open:
            _open.remove(self)

    # -- using the nodes -------------------------------------------------------------------

    def address(self, node: int) -> str:
        return f"{self.subnet}.{node + 1}"

    def env(self, node: int, base: dict | None = None, **extra: str) -> dict:
        """`base` (default os.environ) for a process of `node`: gloo binds to the node's
        interface (else it picks by hostname, which every namespace shares with the host) and
        MASTER_ADDR is node 0's address."""
        env = dict(os.environ if base is None else base)
        env.update(GLOO_SOCKET_IFNAME=self.ifnames[node], MASTER_ADDR=self.address(0), **extra)
        return env

    def popen(self, node: int, cmd: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start `cmd` inside `node` (its own session, so down() can end the whole tree)."""
        if not self._up:
            raise RuntimeError("the cluster is not up")
        full = ["ip", "netns", "exec", self.names[node], *map(str, cmd)]
        proc = subprocess.Popen(full, start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, node: int, cmd: Sequence[str], timeout: float = 60, **kwargs
            ) -> subprocess.CompletedProcess:
        """Run `cmd` inside `node` to completion (output captured as text)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(["ip", "netns", "exec", self.names[node], *map(str, cmd)],
                              timeout=timeout, **kwargs)

    def lose(self, node: int) -> None:
        """Lose `node` as a crashed machine is lost: every process inside it SIGKILLed (their
        connections close as the kernel reaps them)."""
        _kill_inside(self.names[node])

    def tx_bytes(self, node: int) -> int:
        """Bytes `node` has sent on its link (the interface's counter, read inside the node:
        /sys shows the namespace's own interfaces only to a process inside it)."""
        path = f"/sys/class/net/{self.ifnames[node]}/statistics/tx_bytes"
        return int(self.run(node, ["cat", path], check=True).stdout)


def wait_all(procs: Sequence[subprocess.Popen], timeout: float) -> list[int]:
    """Wait for every process (their return codes), killing the rest 10 s after one fails or
    when the time is up: a job whose peer died would otherwise wait out its collective timeout.
    Give the processes files, not pipes, for their output: nothing reads pipes meanwhile."""
    deadline = time.monotonic() + timeout
    while any(proc.poll() is None for proc in procs):
        if any(proc.returncode for proc in procs):
            deadline = min(deadline, time.monotonic() + 10)
        if time.monotonic() > deadline:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        time.sleep(0.1)
    return [proc.returncode for proc in procs]


def _cleanup_all() -> None:
    for cluster in list(_open):
        cluster.down()


_handled = False


def _install_handlers() -> None:
    """atexit, plus SIGTERM turned into an exit where nobody else handles it, so a killed test
    run still deletes its namespaces (SIGINT already raises KeyboardInterrupt, which unwinds
    through the context manager)."""
    global _handled
    if _handled:
        return
    _handled = True
    atexit.register(_cleanup_all)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        def stop(signum: int, frame: object) -> None:
            _cleanup_all()
            raise SystemExit(128 + signum)

        try:
            signal.signal(signal.SIGTERM, stop)
        except ValueError:  # not the main thread: atexit and the next start's sweep remain
            pass
