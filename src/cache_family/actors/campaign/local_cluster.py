"""``campaign --ray local``: a Ray cluster of labelled nodes on this machine, on loopback only."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import socket
import struct
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

from cache_family.errors import Refused

CLONE_NEWNET: Final = 0x40000000
_SIOCGIFFLAGS: Final = 0x8913
_SIOCSIFFLAGS: Final = 0x8914
_IFF_UP: Final = 0x1
# The placement label every local node carries: cf.host=host-0, host-1, ...
HOST_LABEL: Final = "cf.host"


def enter_loopback_namespace() -> None:
    """Move this process into a new network namespace with only ``lo``, brought up."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise Refused.one(
            "campaign.local.no_namespace",
            "$.ray",
            f"cannot make a loopback-only network namespace: {os.strerror(errno)}",
            "run `--ray local` as root (or with CAP_SYS_ADMIN), or start a cluster yourself "
            "and give its address",
        )
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(probe, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(probe, _SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | _IFF_UP))


def interfaces() -> list[str]:
    """The network interfaces this process sees (its namespace's)."""
    with open("/proc/self/net/dev", encoding="ascii") as dev:
        return [line.split(":", 1)[0].strip() for line in dev.readlines()[2:]]


def tcp_endpoints() -> list[tuple[str, str]]:
    """(local, remote) address of every TCP socket of this process's namespace (IPv4 and
    IPv6 as /proc lists them, the address part only)."""
    found: list[tuple[str, str]] = []
    for name, decode in (("tcp", _ipv4), ("tcp6", _ipv6)):
        with contextlib.suppress(OSError), open(f"/proc/self/net/{name}", encoding="ascii") as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                found.append((decode(parts[1]), decode(parts[2])))
    return found


def _ipv4(text: str) -> str:
    address = text.split(":", 1)[0]
    return socket.inet_ntop(socket.AF_INET, bytes.fromhex(address)[::-1])


def _ipv6(text: str) -> str:
    raw = bytes.fromhex(text.split(":", 1)[0])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


@dataclass
class LocalCluster:
    """A head (no CPUs: rows never run on it) and ``hosts`` nodes of one CPU each, labelled
    ``cf.host=host-I`` and holding one ``cf.row`` slot (one row per node at a time)."""

    session_dir: str
    hosts: int
    address: str = ""
    link: str = ""
    _cluster: Any = None
    nodes: list[Any] = field(default_factory=list)

    def start(self, stopped: Callable[[], bool] = lambda: False) -> None:
        """Start the head, then each node, then wait for them; a stop asked for meanwhile
        (``stopped()``, a signal) is acted on at the next of these steps: nothing more is
        started, and what was is shut down as the block ends."""
        from ray.cluster_utils import Cluster

        os.makedirs(os.path.join(self.session_dir, "ray"), exist_ok=True)
        self.link = os.path.join(tempfile.mkdtemp(prefix="cf-ray-", dir="/tmp"), "r")
        os.symlink(self.session_dir, self.link)
        os.environ["RAY_TMPDIR"] = self.link
        self._cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 0, "temp_dir": self.link, "include_dashboard": False},
        )
        for index in range(self.hosts):
            if stopped():
                return
            self.nodes.append(
                self._cluster.add_node(
                    num_cpus=1,
                    resources={"cf.row": 1},
                    labels={HOST_LABEL: f"host-{index}"},
                )
            )
        if stopped():
            return
        self._cluster.wait_for_nodes()
        self.address = self._cluster.address

    def remove_node(self, index: int) -> None:
        """End one node as a lost host would end (tests of ``host.lost``)."""
        self._cluster.remove_node(self.nodes[index], allow_graceful=False)

    def shutdown(self) -> None:
        if self._cluster is not None:
            with contextlib.suppress(Exception):
                self._cluster.shutdown()
            self._cluster = None
        if self.link:
            with contextlib.suppress(OSError):
                os.unlink(self.link)
                os.rmdir(os.path.dirname(self.link))


@contextlib.contextmanager
def local_cluster(
    session_dir: str, hosts: int, stopped: Callable[[], bool] = lambda: False
) -> Iterator[LocalCluster]:
    """The started cluster (its ``address`` empty when ``stopped()`` cut its start short)."""
    cluster = LocalCluster(session_dir=session_dir, hosts=hosts)
    try:
        cluster.start(stopped)
        yield cluster
    finally:
        cluster.shutdown()
