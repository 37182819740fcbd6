"""The machine a run measures on: its identity as a campaign names it, its CPU model and
its load, which a real model's figures name beside them."""

from __future__ import annotations

import glob
import os
import socket
from collections.abc import Mapping

from cache_family.schemas.host_identity import HostIdentity

_CPUINFO_MAX_BYTES = 1024 * 1024


def load_average() -> tuple[float, float, float] | None:
    """The 1, 5 and 15-minute load averages, rounded to what a reader compares; None where
    the platform keeps none."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return None
    return (round(one, 2), round(five, 2), round(fifteen, 2))


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The first ``model name`` /proc/cpuinfo gives (bounded read); None where it has none."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as info:
            text = info.read(_CPUINFO_MAX_BYTES)
    except OSError:
        return None
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == "model name" and value.strip():
            return " ".join(value.split())[:200]
    return None


# What a scheduler that starts the run (the campaign's Ray task) says about its node.
NODE_ID_ENV = "CACHE_FAMILY_NODE_ID"
NODE_LABELS_ENV = "CACHE_FAMILY_NODE_LABELS"  # k=v,k=v
_NVIDIA_GPUS = "/proc/driver/nvidia/gpus/*/information"


def observe_host(environ: Mapping[str, str], gpu_info: str = _NVIDIA_GPUS) -> HostIdentity:
    """This machine as a campaign names it: hostname, the scheduler's node id and labels,
    the GPUs its NVIDIA driver lists (read from ``/proc``, no tool is run), the CPU count."""
    labels: dict[str, str] = {}
    for item in environ.get(NODE_LABELS_ENV, "").split(","):
        name, sep, value = item.partition("=")
        if sep and name.strip():
            labels[name.strip()] = value.strip()
    gpus: list[str] = []
    for path in sorted(glob.glob(gpu_info)):
        try:
            with open(path, encoding="utf-8", errors="replace") as info:
                text = info.read(65536)
        except OSError:
            continue
        model = next(
            (ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("Model:")), ""
        )
        gpus.append(model or "GPU (model not given)")
    return HostIdentity(
        hostname=socket.gethostname(),
        node_id=environ.get(NODE_ID_ENV) or None,
        labels=labels,
        gpus=tuple(gpus),
        cpu_count=os.cpu_count(),
        cpu_model=cpu_model(),
    )
