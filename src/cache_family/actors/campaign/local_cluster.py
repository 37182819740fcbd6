"""``campaign --ray local``: a Ray cluster of labelled test hosts on this machine that share
nothing but a private bridge: each node in its own network namespace with its own work
directory, joined to the head over a bridge inside the driver's namespace, which has no link
to the machine's own interfaces (no default route, no NAT).

Ray's services have no authentication: nothing but the cluster itself may reach it. ``local-
cluster.json`` (each namespace's interfaces, routes, sockets and holder by pid, create time and
inode) is written as soon as each namespace exists, so a resume after a driver killed outright
can end what it left; shutdown ends every process of every namespace but the driver.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Final

import psutil

from cache_family.actors.campaign.row_return import NODE_WORK_DIR_ENV
from cache_family.errors import Refused
from cache_family.system.libc import libc
from cache_family.system.process_group import end_processes
from cache_family.system.publish import replace_atomically

CLONE_NEWNET: Final = 0x40000000
_SIOCGIFFLAGS: Final = 0x8913
_SIOCSIFFLAGS: Final = 0x8914
_IFF_UP: Final = 0x1
# The placement label every local node carries: cf.host=host-0, host-1, ...
HOST_LABEL: Final = "cf.host"
BRIDGE: Final = "cf-br0"
SUBNET: Final = "10.213.0"
HEAD_ADDRESS: Final = f"{SUBNET}.1"
HEAD_PORT: Final = 6379
LOCAL_CLUSTER_EVIDENCE: Final = "local-cluster.json"
# How long the cluster's processes get to end on SIGTERM before they are killed.
STOP_GRACE_SECONDS: Final = 10.0
CREATE_TIME_SLACK_SECONDS: Final = 1.0
# Where ip(8) and nsenter(1) are found, whatever PATH the driver was given.
SYSTEM_PATH: Final = "/usr/sbin:/usr/bin:/sbin:/bin"
_TCP_STATES: Final = {"01": "ESTABLISHED", "0A": "LISTEN"}


def _bring_up_loopback() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(probe, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(probe, _SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | _IFF_UP))


def enter_loopback_namespace() -> int:
    """Move this process into a new network namespace with only ``lo``, brought up; the
    namespace's inode."""
    if libc().unshare(CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise Refused.one(
            "campaign.local.no_namespace",
            "$.ray",
            f"cannot make a loopback-only network namespace: {os.strerror(errno)}",
            "run `--ray local` as root (or with CAP_SYS_ADMIN), or start a cluster yourself "
            "and give its address",
        )
    _bring_up_loopback()
    return netns_of(os.getpid())


def _new_namespace() -> None:  # pragma: no cover - runs in the child before its exec
    if libc().unshare(CLONE_NEWNET) != 0:
        os._exit(70)


def netns_of(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


# --- what a namespace holds (read through /proc of a process inside it) ----------------------


def interfaces(pid: int | str = "self") -> list[str]:
    """The network interfaces of ``pid``'s namespace."""
    with open(f"/proc/{pid}/net/dev", encoding="ascii") as dev:
        return [line.split(":", 1)[0].strip() for line in dev.readlines()[2:]]


def tcp_endpoints(pid: int | str = "self") -> list[tuple[str, str]]:
    """(local, remote) address of every TCP socket of ``pid``'s namespace."""
    return [(s["local"].rsplit(":", 1)[0], s["remote"].rsplit(":", 1)[0]) for s in sockets(pid)]


def sockets(pid: int | str = "self") -> list[dict[str, str]]:
    """Every TCP socket of ``pid``'s namespace: local and remote ``address:port``, state."""
    found: list[dict[str, str]] = []
    for name, decode in (("tcp", _ipv4), ("tcp6", _ipv6)):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{name}", encoding="ascii") as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                found.append(
                    {
                        "local": decode(parts[1]),
                        "remote": decode(parts[2]),
                        "state": _TCP_STATES.get(parts[3], parts[3]),
                    }
                )
    return found


def routes(pid: int | str = "self") -> list[str]:
    """The IPv4 routes of ``pid``'s namespace as ``DESTINATION/BITS dev IFACE`` (a default
    route would read ``0.0.0.0/0``)."""
    found = []
    with open(f"/proc/{pid}/net/route", encoding="ascii") as table:
        for line in table.readlines()[1:]:
            iface, destination, _gateway, _flags, *_rest, mask = line.split()[:8]
            bits = bin(int(mask, 16)).count("1")
            address = socket.inet_ntop(socket.AF_INET, bytes.fromhex(destination)[::-1])
            found.append(f"{address}/{bits} dev {iface}")
    return found


def _ipv4(text: str) -> str:
    address, port = text.split(":", 1)
    host = socket.inet_ntop(socket.AF_INET, bytes.fromhex(address)[::-1])
    return f"{host}:{int(port, 16)}"


def _ipv6(text: str) -> str:
    address, port = text.split(":", 1)
    raw = bytes.fromhex(address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return f"{socket.inet_ntop(socket.AF_INET6, words)}:{int(port, 16)}"


def namespace_report(pid: int | str) -> dict[str, object]:
    return {
        "interfaces": interfaces(pid),
        "routes": routes(pid),
        "listening": sorted({s["local"] for s in sockets(pid) if s["state"] == "LISTEN"}),
        "tcp": sockets(pid),
    }


# --- ending every process of some namespaces --------------------------------------------------


def processes_in(namespaces: set[int], since: float = 0.0) -> list[psutil.Process]:
    """Every process (but this one) inside one of ``namespaces`` started at ``since`` or later."""
    found = []
    for process in psutil.process_iter():
        if process.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error, OSError):
            if netns_of(process.pid) in namespaces and process.create_time() >= since:
                found.append(process)
    return found


def end_namespaces(
    namespaces: set[int], since: float = 0.0, grace: float = STOP_GRACE_SECONDS
) -> int:
    """SIGTERM every process of the namespaces, wait out the grace, SIGKILL what is left and
    wait for it; the namespaces end with their last process. How many there were."""
    found = processes_in(namespaces, since)
    end_processes(found, grace=grace, kill_wait=grace)
    return len(found)


# --- the cluster ------------------------------------------------------------------------------


@dataclass
class TestHost:
    """One node: its namespace (kept by a ``sleep`` that lives as long as the cluster), its
    address on the bridge and its own work directory."""

    label: str
    address: str
    work_dir: str
    holder: subprocess.Popen[bytes]
    netns: int
    started_at: float


def _run(*argv: str, env: Mapping[str, str] | None = None) -> None:
    done = subprocess.run(
        list(argv), env=dict(env) if env is not None else {"PATH": SYSTEM_PATH},
        stdin=subprocess.DEVNULL, capture_output=True, timeout=120, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise Refused.one(
            "campaign.local.host_start",
            "$.ray",
            f"{' '.join(argv[:4])} ... failed: {done.stderr.decode(errors='replace')[-800:]}",
            "run `--ray local` as root on a machine with ip(8), or start a cluster yourself",
        )


def _in(host: TestHost, *argv: str, env: Mapping[str, str] | None = None) -> None:
    _run(
        shutil.which("nsenter", path=SYSTEM_PATH) or "nsenter",
        f"--net=/proc/{host.holder.pid}/ns/net",
        "--",
        *argv,
        env=env,
    )


@dataclass
class LocalCluster:
    """A head (no CPUs: rows never run on it) in the driver's namespace and ``hosts`` nodes of
    one CPU each, each in its own namespace, labelled ``cf.host=host-I`` and holding one
    ``cf.row`` slot (one row per node at a time)."""

    session_dir: str
    hosts: int
    # The namespace the driver made for itself (``enter_loopback_namespace``): the head's.
    parent_netns: int
    # Where the evidence goes, written as soon as a namespace exists (a later resume ends
    # what a killed driver left through it).
    evidence_path: str = ""
    address: str = ""
    node_ip_address: str = HEAD_ADDRESS
    link: str = ""
    work_root: str = ""
    parent: subprocess.Popen[bytes] | None = None
    members: list[TestHost] = field(default_factory=list)
    # psutil's create times are in clock ticks and may read a little before time.time() did.
    started_at: float = field(default_factory=lambda: time.time() - CREATE_TIME_SLACK_SECONDS)

    def _environ(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "RAY_TMPDIR": self.link, **extra}

    def start(self, stopped: Callable[[], bool] = lambda: False) -> None:
        """The bridge and the head, then each node; a stop asked for meanwhile (``stopped()``,
        a signal) is acted on at the next of these steps: nothing more is started, and what
        was is ended as the block ends."""
        if netns_of(os.getpid()) != self.parent_netns:
            raise Refused.one(
                "campaign.local.no_namespace",
                "$.ray",
                "the driver is not inside the namespace it made for the cluster",
                "enter the loopback-only namespace before starting the cluster",
            )
        if not all(shutil.which(tool, path=SYSTEM_PATH) for tool in ("ip", "nsenter")):
            raise Refused.one(
                "campaign.local.host_start",
                "$.ray",
                "ip(8) and nsenter(1) are needed to make the test hosts' namespaces",
                "install iproute2 and util-linux, or start a cluster yourself",
            )
        os.makedirs(os.path.join(self.session_dir, "ray"), exist_ok=True)
        self.link = os.path.join(tempfile.mkdtemp(prefix="cf-ray-", dir="/tmp"), "r")
        os.symlink(self.session_dir, self.link)
        self.work_root = tempfile.mkdtemp(prefix="cf-hosts-", dir="/tmp")
        # Keeps the driver's namespace findable while anything of the cluster lives.
        self.parent = subprocess.Popen(
            ["sleep", "infinity"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True,
            env={"PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        self.record()
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "addr", "add", f"{HEAD_ADDRESS}/24", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        _run(
            self._ray(), "start", "--head", "--node-ip-address", HEAD_ADDRESS,
            "--port", str(HEAD_PORT), "--num-cpus", "0", "--temp-dir", self.link,
            "--include-dashboard=false", "--disable-usage-stats",
            env=self._environ(),
        )  # fmt: skip
        for index in range(self.hosts):
            if stopped():
                return
            self._add_host(index)
            self.record()
        if stopped():
            return
        self.address = f"{HEAD_ADDRESS}:{HEAD_PORT}"

    def _ray(self) -> str:
        return os.path.join(os.path.dirname(sys.executable), "ray")

    def _add_host(self, index: int) -> None:
        work = os.path.join(self.work_root, f"host-{index}")
        os.mkdir(work, 0o700)
        holder = subprocess.Popen(
            ["sleep", "infinity"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True,
            env={"PATH": "/usr/bin:/bin"}, preexec_fn=_new_namespace,
        )  # fmt: skip
        host = TestHost(
            label=f"host-{index}",
            address=f"{SUBNET}.{10 + index}",
            work_dir=work,
            holder=holder,
            netns=netns_of(holder.pid),
            started_at=time.time() - CREATE_TIME_SLACK_SECONDS,
        )
        self.members.append(host)
        inside, outside = f"cf-h{index}", f"cf-b{index}"
        _run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
        _run("ip", "link", "set", outside, "master", BRIDGE)
        _run("ip", "link", "set", outside, "up")
        _run("ip", "link", "set", inside, "netns", str(holder.pid))
        _in(host, "ip", "link", "set", "lo", "up")
        _in(host, "ip", "addr", "add", f"{host.address}/24", "dev", inside)
        _in(host, "ip", "link", "set", inside, "up")
        _in(
            host, self._ray(), "start", "--address", f"{HEAD_ADDRESS}:{HEAD_PORT}",
            "--node-ip-address", host.address, "--num-cpus", "1",
            "--resources", json.dumps({"cf.row": 1}), "--labels", f"{HOST_LABEL}={host.label}",
            "--disable-usage-stats",
            env=self._environ(**{NODE_WORK_DIR_ENV: work}),
        )  # fmt: skip

    def remove_node(self, index: int) -> None:
        """End one node as a lost host ends: every process of its namespace killed at once
        (tests of ``host.lost``)."""
        host = self.members[index]
        for process in processes_in({host.netns}, host.started_at):
            if process.pid != host.holder.pid:
                with contextlib.suppress(psutil.Error):
                    process.kill()

    def namespaces(self) -> set[int]:
        return {self.parent_netns, *(host.netns for host in self.members)}

    def evidence(self) -> dict[str, object]:
        """Each namespace's interfaces, routes, listening endpoints and TCP sockets, and what
        a later resume needs to end what a killed driver left (the holders)."""
        holders = [self.parent] if self.parent is not None else []
        return {
            "hosts": self.hosts,
            "bridge": BRIDGE,
            "subnet": f"{SUBNET}.0/24",
            "started_at": self.started_at,
            "work_root": self.work_root,
            "session_link": self.link,
            "head": {"address": HEAD_ADDRESS, "port": HEAD_PORT, **namespace_report("self")},
            "nodes": [
                {
                    "label": host.label,
                    "address": host.address,
                    "work_dir": host.work_dir,
                    "netns": host.netns,
                    **namespace_report(host.holder.pid),
                }
                for host in self.members
                if host.holder.poll() is None
            ],
            "holders": [
                {
                    "pid": p.pid,
                    "create_time": psutil.Process(p.pid).create_time(),
                    "netns": netns_of(p.pid),
                }
                for p in [*holders, *(h.holder for h in self.members)]
                if p.poll() is None
            ],
        }

    def record(self, **extra: object) -> None:
        if self.evidence_path:
            data = json.dumps({**self.evidence(), **extra}, indent=2) + "\n"
            replace_atomically(self.evidence_path, data.encode("utf-8"))

    def shutdown(self) -> int:
        """End every process of every namespace of the cluster (the head's, but this one),
        then remove the work directories; how many processes were ended."""
        ended = end_namespaces(self.namespaces(), self.started_at)
        for popen in [self.parent, *(h.holder for h in self.members)]:
            if popen is not None:
                with contextlib.suppress(OSError):
                    popen.kill()
                popen.wait()
        self.parent = None
        shutil.rmtree(self.work_root, ignore_errors=True)
        if self.link:
            _remove_link(self.link)
        return ended


def end_left_cluster(evidence_path: str) -> int:
    """End what a killed driver's cluster left running (from its evidence file): every
    process of each namespace whose holder is still the one recorded. How many."""
    try:
        with open(evidence_path, encoding="utf-8") as handle:
            evidence = json.load(handle)
    except (OSError, ValueError):
        return 0
    namespaces: set[int] = set()
    for holder in evidence.get("holders", []):
        with contextlib.suppress(psutil.Error, OSError, KeyError, TypeError):
            process = psutil.Process(int(holder["pid"]))
            if process.create_time() == holder["create_time"] and (
                netns_of(process.pid) == holder["netns"]
            ):
                namespaces.add(int(holder["netns"]))
    ended = end_namespaces(namespaces, float(evidence.get("started_at", 0.0)))
    work_root = evidence.get("work_root")
    if isinstance(work_root, str) and os.path.basename(work_root).startswith("cf-hosts-"):
        shutil.rmtree(work_root, ignore_errors=True)
    link = evidence.get("session_link")
    if isinstance(link, str) and os.path.basename(os.path.dirname(link)).startswith("cf-ray-"):
        _remove_link(link)
    return ended


def _remove_link(link: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(link)
        os.rmdir(os.path.dirname(link))


@contextlib.contextmanager
def local_cluster(
    session_dir: str,
    hosts: int,
    parent_netns: int,
    stopped: Callable[[], bool] = lambda: False,
    evidence_path: str = "",
) -> Iterator[LocalCluster]:
    """The started cluster (its ``address`` empty when ``stopped()`` cut its start short)."""
    cluster = LocalCluster(
        session_dir=session_dir, hosts=hosts, parent_netns=parent_netns,
        evidence_path=evidence_path,
    )  # fmt: skip
    try:
        cluster.start(stopped)
        yield cluster
    finally:
        cluster.shutdown()
