"""Bandwidth-limited links between network namespaces, for benchmarks (needs root).

    with Swarm(n=4, rate="100mbit") as sw:
        subprocess.Popen(sw.exec_prefix(0) + ["python", ...])   # runs inside node 0's namespace
        sw.addr(1)                                               # node 1's address, e.g. 10.77.0.2
    Swarm(n=4, up="20mbit", down="100mbit", delay_ms=20)         # a home link: slow upload

Topology: one namespace per node plus one "switch" namespace holding a bridge. Each node has a
veth pair to the bridge; both ends carry a tbf, so a node's upload and download are each limited,
like a home link: its own end's rate is its upload (`up`), the switch end's its download (`down`);
both are `rate` unless given. `delay_ms` adds latency on top (the kernel here has no netem):
every packet a node's namespace receives is held that long in user space (benchmarks/netdelay.py,
NFQUEUE), so the round trip between two nodes is 2 x delay_ms. Safety rules:
  * addresses exist only inside namespaces created here (10.77.0.0/24, no address on the bridge);
  * no default route anywhere: traffic cannot leave the namespaces;
  * nothing here sends a packet; the root namespace never gets an address on these links;
  * everything is deleted on exit, also on Ctrl-C and SIGTERM (close() is idempotent).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import FrameType

HERE = Path(__file__).resolve().parent


class NetnsUnavailable(RuntimeError):
    """Not root, or the kernel/tools refuse namespaces, veth or tbf."""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _in(ns: str, *cmd: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, *cmd], check=True, capture_output=True, text=True)


class Swarm:
    """N namespaces joined through a bridge by rate-limited veth links."""

    def __init__(
        self,
        n: int,
        rate: str = "100mbit",
        subnet: str = "10.77.0",
        delay_ms: float = 0.0,
        up: str | None = None,
        down: str | None = None,
    ):
        if os.geteuid() != 0:
            raise NetnsUnavailable(
                "network namespaces need root (run with sudo); skipping the bandwidth-limited section"
            )
        self.n, self.rate, self.subnet, self.delay_ms = n, rate, subnet, delay_ms
        self.up, self.down = up or rate, down or rate  # per node: its upload, its download
        tag = f"{os.getpid() % 100000}"
        self.sw = f"drb{tag}sw"
        self.nodes = [f"drb{tag}n{i}" for i in range(n)]
        self.ifname = "eth0"  # inside each node namespace
        self._created: list[str] = []
        self._delayers: list[subprocess.Popen] = []
        self._old_term = None

    # --- lifecycle -----------------------------------------------------------------------------

    def __enter__(self) -> Swarm:
        self._old_term = signal.signal(signal.SIGTERM, self._on_term)
        try:
            self._build()
        except subprocess.CalledProcessError as e:
            self.close()
            raise NetnsUnavailable(f"could not build namespaces: {' '.join(e.cmd)}: {e.stderr.strip()}") from None
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _on_term(self, signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt  # unwinds through every finally, which deletes the namespaces

    def _build(self) -> None:
        for ns in [self.sw, *self.nodes]:
            _ip("netns", "add", ns)
            self._created.append(ns)
            _in(ns, "ip", "link", "set", "lo", "up")
        _in(self.sw, "ip", "link", "add", "br0", "type", "bridge")
        _in(self.sw, "ip", "link", "set", "br0", "up")
        for i, ns in enumerate(self.nodes):
            port = f"p{i}"
            # create the pair directly inside the two namespaces: it never exists in the root one
            _ip("link", "add", self.ifname, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.sw)
            _in(ns, "ip", "addr", "add", f"{self.addr(i)}/24", "dev", self.ifname)
            _in(ns, "ip", "link", "set", self.ifname, "up")
            _in(self.sw, "ip", "link", "set", port, "master", "br0")
            _in(self.sw, "ip", "link", "set", port, "up")
            for where, dev, rate in ((ns, self.ifname, self.up), (self.sw, port, self.down)):
                _in(
                    where,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    "256kb",
                    "latency",
                    "100ms",
                )
            if self.delay_ms:
                self._delay(ns)

    def _delay(self, ns: str) -> None:
        """Hold every packet `ns` receives for delay_ms (benchmarks/netdelay.py)."""
        try:
            import netfilterqueue  # noqa: F401
        except ImportError:
            raise NetnsUnavailable(
                "added latency needs the NetfilterQueue package (apt-get install libnetfilter-queue-dev iptables; "
                "pip install -e '.[netdelay]')"
            ) from None
        p = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, str(HERE / "netdelay.py"), "--delay-ms", str(self.delay_ms)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._delayers.append(p)
        if p.stdout.readline().strip() != "ready":
            raise NetnsUnavailable(f"netdelay.py in {ns} did not start: {p.stderr.read().strip()[-300:]}")
        # only once the delayer listens; --queue-bypass: should it die, packets pass instead of dropping
        _in(
            ns,
            "iptables-legacy",
            "-A",
            "INPUT",
            "-i",
            self.ifname,
            "-j",
            "NFQUEUE",
            "--queue-num",
            "0",
            "--queue-bypass",
        )

    def close(self) -> None:
        """Stop the delayers, delete every namespace created (their veth pairs, bridge and iptables
        rules go with them)."""
        for p in self._delayers:
            if p.poll() is None:
                p.terminate()
        for p in self._delayers:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._delayers.clear()
        while self._created:
            ns = self._created.pop()
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None

    # --- use -----------------------------------------------------------------------------------

    def addr(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def exec_prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.nodes[i]]

    def tx_bytes(self, i: int) -> int:
        """Bytes node i's interface has sent so far (the kernel's counter: every header included)."""
        out = subprocess.run(
            [*self.exec_prefix(i), "cat", f"/sys/class/net/{self.ifname}/statistics/tx_bytes"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        return int(out)
