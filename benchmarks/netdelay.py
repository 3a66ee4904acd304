"""Added latency in user space, for kernels without netem: hold every packet a network namespace
receives for a fixed time, then let it go (needs root, iptables-legacy, libnetfilter-queue and the
NetfilterQueue package: `apt-get install iptables libnetfilter-queue-dev; pip install NetfilterQueue`).

    ip netns exec NS iptables-legacy -A INPUT -i eth0 -j NFQUEUE --queue-num 0 --queue-bypass
    ip netns exec NS python benchmarks/netdelay.py --delay-ms 25     # prints "ready", runs until killed

netns.Swarm(delay_ms=...) does both for every namespace it builds, so a packet between two of its
namespaces is delayed once, on its way in: the round-trip time between them is 2 x delay_ms.
On the way in, not out: a sender's own packets held below TCP count against its TCP small-queue
budget (~1 ms of data), which throttled a 100 Mbit link to 1.8 Mbit/s at 25 ms; a received packet
belongs to no sending socket. Measured here: UDP ping-pong 50.6 ms at delay_ms 25; one TCP stream
20 MiB at ~78 Mbit/s over the 100 Mbit tbf link (slow start included).
Packets leave in the order they came (one fixed delay), only their verdict is late: the kernel
keeps the packet, this process sees its metadata only. --queue-bypass: while nobody listens
(before "ready", after the process is gone), packets pass undelayed instead of being dropped.
"""

from __future__ import annotations

import argparse
import collections
import select
import signal
import socket
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--delay-ms", type=float, required=True, help="how long each packet is held")
    ap.add_argument("--queue", type=int, default=0, help="the NFQUEUE number of the iptables rule")
    a = ap.parse_args()
    from netfilterqueue import COPY_META, NetfilterQueue

    delay = a.delay_ms / 1000
    held: collections.deque = collections.deque()  # (release time, packet), in arrival order

    def hold(pkt) -> None:
        held.append((time.monotonic() + delay, pkt))

    nfq = NetfilterQueue()
    # metadata only (no payload copy); a queue long enough for everything in flight at 100 Mbit
    nfq.bind(a.queue, hold, max_len=65536, mode=COPY_META, range=0, sock_len=8 << 20)
    sock = socket.fromfd(nfq.get_fd(), socket.AF_UNIX, socket.SOCK_STREAM)  # only for select()
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    print("ready", flush=True)
    try:
        while not stop:
            timeout = max(0.0, held[0][0] - time.monotonic()) if held else 0.5
            if select.select([sock], [], [], timeout)[0]:
                nfq.run(block=False)
            now = time.monotonic()
            while held and held[0][0] <= now:
                held.popleft()[1].accept()
    except KeyboardInterrupt:
        pass
    finally:
        while held:  # nothing is left hanging
            held.popleft()[1].accept()
        nfq.unbind()
        sys.stdout.flush()


if __name__ == "__main__":
    main()
