"""The host's own Prometheus totals beside the client's sums, as the run report shows them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from cache_family.report.render import cell
from cache_family.schemas.server_metrics import ServerMetricsVerdict

#: What the table's columns mean, said once above it.
SERVER_METRICS_NOTE: Final = (
    "The server's own totals come from its Prometheus counters (`/metrics`), read before and "
    "after each interval; the client's sums add up the figures the server reported on each "
    'request of the same interval. Agreement is exact token for token; "incomparable" when '
    "a request reached the server without reporting its figures, or one side counts none. A "
    "server without metrics says so: nothing is guessed."
)


def _figure(value: int | None) -> str:
    return "n/a" if value is None else f"{value:,}"


def _agreement(verdict: ServerMetricsVerdict) -> str:
    if verdict.status != "read":
        detail = verdict.refusal_code or verdict.reason or ""
        return f"{verdict.status}" + (f" ({detail})" if detail else "")
    text: str = verdict.agreement or "n/a"
    if verdict.disagreeing:
        text += ": " + ", ".join(name.replace("_", " ") for name in verdict.disagreeing)
    return text


def server_metrics_table(
    intervals: Sequence[tuple[str, str, ServerMetricsVerdict]], interval_title: str
) -> list[str]:
    """One line per (who, interval, verdict): the server's prompt, cached and generated
    tokens beside the client's sums; no table without intervals."""
    if not intervals:
        return []
    lines = [
        f"| Arm | {interval_title} | Server | Server's prompt tokens | Client's sum "
        "| Server's cached tokens | Client's sum | Server's generated tokens | Client's sum "
        "| Server vs client |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for who, interval, verdict in intervals:
        server, client = verdict.server, verdict.client
        lines.append(
            "| "
            + " | ".join(
                [
                    cell(who),
                    cell(interval),
                    cell(server.server) if server is not None else "none",
                    _figure(server.prompt_tokens if server else None),
                    _figure(client.prompt_tokens if client else None),
                    _figure(server.cached_tokens if server else None),
                    _figure(client.cached_tokens if client else None),
                    _figure(server.predicted_tokens if server else None),
                    _figure(client.predicted_tokens if client else None),
                    cell(_agreement(verdict)),
                ]
            )
            + " |"
        )
    return lines
