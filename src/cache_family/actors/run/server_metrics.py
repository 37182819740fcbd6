"""A host's ``/metrics`` read before and after each rung and workload point, and journaled.

The read is bounded (``EXPOSITION_MAX_BYTES``, ``READ_SECONDS``) and never ends the cell: a
host without metrics journals ``none``, an unusable exposition ``refused`` with its code.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

import msgspec
import trio

from cache_family.errors import Refused
from cache_family.schemas.journal import Record, ServerMetricsRead
from cache_family.schemas.server_metrics import (
    METRICS_NONE,
    METRICS_READ,
    METRICS_REFUSED,
    TokenSums,
)
from cache_family.states.server_metrics import (
    EXPOSITION_MAX_BYTES,
    Counters,
    counter_deltas,
    parse_counters,
    refused,
)
from cache_family.system.http import HttpError, LoopbackHttp

#: The longest one read of ``/metrics`` may take (llama-server answers it between decodes).
READ_SECONDS: Final = 10.0


@dataclass(frozen=True, slots=True)
class Exposition:
    """One read's counters and its size in bytes."""

    counters: Counters
    size: int


@dataclass(frozen=True, slots=True)
class NoMetrics:
    """The host serves no metrics (``none``), or its exposition was refused."""

    status: str
    reason: str
    refusal_code: str | None = None


Reading = Exposition | NoMetrics


async def read_exposition(http: LoopbackHttp, url: str, deadline: float = math.inf) -> Reading:
    """``url``'s counters, read within ``READ_SECONDS`` (and ``deadline``) and
    ``EXPOSITION_MAX_BYTES``; 404 and 501 (llama-server without ``--metrics``) are ``none``."""
    budget = max(0.0, min(READ_SECONDS, deadline - trio.current_time()))
    try:
        with trio.fail_after(budget):
            async with http.request("GET", url) as response:
                if response.status_code in (404, 501):
                    return NoMetrics(METRICS_NONE, f"the host answered {response.status_code}")
                if response.status_code != 200:
                    raise refused(
                        "server_metrics.unreachable", f"/metrics answered {response.status_code}"
                    )
                body = bytearray()
                async for chunk in response.chunks():
                    body += chunk
                    if len(body) > EXPOSITION_MAX_BYTES:
                        raise refused(
                            "server_metrics.oversized",
                            f"the exposition ran past {EXPOSITION_MAX_BYTES} bytes (not read on)",
                        )
        data = bytes(body)
        return Exposition(parse_counters(data), len(data))
    except trio.TooSlowError:
        # The cell's own deadline may leave less than the read's cap.
        code, reason = "server_metrics.timeout", f"no whole answer within {budget:.3g} s"
    except HttpError as exc:
        code, reason = "server_metrics.unreachable", str(exc)
    except Refused as exc:
        code, reason = exc.codes[0], exc.refusals[0].message
    return NoMetrics(METRICS_REFUSED, reason, code)


@dataclass(frozen=True, slots=True)
class MetricsWatch:
    """A cell's reads of its host's metrics: ``path`` None when its kind serves none."""

    cell_id: str
    base_url: str
    path: str | None
    http: LoopbackHttp
    journal: Callable[[Record], Awaitable[object]]
    deadline: float = math.inf

    async def before(self) -> Reading:
        """The read that opens an interval (nothing is sent for a host without metrics)."""
        if self.path is None:
            return NoMetrics(METRICS_NONE, "this host kind serves no /metrics")
        return await read_exposition(self.http, self.base_url + self.path, self.deadline)

    async def after(
        self, before: Reading, scope: str, index: int, client: TokenSums | None
    ) -> Reading:
        """Read again, journal the interval's counter deltas beside ``client`` (the client's
        sums of the same requests' figures; None: not kept), and return the new read."""
        after = before
        if isinstance(before, Exposition) and self.path is not None:
            after = await read_exposition(self.http, self.base_url + self.path, self.deadline)
        await self.journal(self.record(before, after, scope, index, client))
        return after

    def record(
        self, before: Reading, after: Reading, scope: str, index: int, client: TokenSums | None
    ) -> ServerMetricsRead:
        """The interval's record: the deltas, or why there are none."""
        blank = ServerMetricsRead(
            cell_id=self.cell_id,
            scope=scope,
            index=index,
            status=METRICS_NONE,
            path=self.path,
            client=client,
        )
        failed = before if isinstance(before, NoMetrics) else after
        if isinstance(failed, NoMetrics):
            return msgspec.structs.replace(
                blank, status=failed.status, reason=failed.reason, refusal_code=failed.refusal_code
            )
        assert isinstance(before, Exposition) and isinstance(after, Exposition)
        sized = msgspec.structs.replace(blank, before_bytes=before.size, after_bytes=after.size)
        try:
            deltas = counter_deltas(before.counters, after.counters)
        except Refused as exc:
            return msgspec.structs.replace(
                sized,
                status=METRICS_REFUSED,
                reason=exc.refusals[0].message,
                refusal_code=exc.codes[0],
            )
        return msgspec.structs.replace(sized, status=METRICS_READ, counters=deltas)
