"""The host's own Prometheus totals beside the client's sums, as the run report shows them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from cache_family.report.render import cell
from cache_family.schemas.server_metrics import ServerMetricsVerdict

#: What the table's columns mean, said once above it.
SERVER_METRICS_NOTE: Final = (
    "Each token figure is the server's own total, then the client's sum (server / client): "
    "the server's from its Prometheus counters (`/metrics`), read before and after each "
    "interval; the client's adds up the figures the server reported on each request of the "
    'same interval. Agreement is exact token for token; "incomparable" when '
    "a request reached the server without reporting its figures, or one side counts none. A "
    "server without metrics says so: nothing is guessed."
)


def _pair(server: int | None, client: int | None) -> str:
    """The server's figure, then the client's sum: one short cell (rows stay one line)."""
    return " / ".join("n/a" if v is None else f"{v:,}" for v in (server, client))


def _agreement(verdict: ServerMetricsVerdict) -> str:
    if verdict.status == "refused" and verdict.refusal_code:
        return f"refused ({verdict.refusal_code.removeprefix('server_metrics.')})"
    if verdict.status != "read":
        return verdict.status
    text: str = verdict.agreement or "n/a"
    if verdict.disagreeing:
        text += ": " + ", ".join(name.removesuffix("_tokens") for name in verdict.disagreeing)
    return text


def server_metrics_table(
    intervals: Sequence[tuple[str, str, ServerMetricsVerdict]], interval_title: str
) -> list[str]:
    """One line per (who, interval, verdict): the server's prompt, cached and generated
    tokens beside the client's sums, then why any interval has none; no table without
    intervals."""
    if not intervals:
        return []
    lines = [
        f"| Arm | {interval_title} | Server | Prompt tok | Cached tok | Generated tok "
        "| Server vs client |",
        "| --- | ---: | --- | ---: | ---: | ---: | --- |",
    ]
    reasons: dict[str, list[str]] = {}
    for who, interval, verdict in intervals:
        server, client = verdict.server, verdict.client
        if verdict.status != "read" and verdict.reason:
            names = reasons.setdefault(f"{_agreement(verdict)}: {verdict.reason}", [])
            if who not in names:
                names.append(who)
        lines.append(
            "| "
            + " | ".join(
                [
                    cell(who),
                    cell(interval),
                    cell(server.server) if server is not None else "none",
                    _pair(
                        server.prompt_tokens if server else None,
                        client.prompt_tokens if client else None,
                    ),
                    _pair(
                        server.cached_tokens if server else None,
                        client.cached_tokens if client else None,
                    ),
                    _pair(
                        server.predicted_tokens if server else None,
                        client.predicted_tokens if client else None,
                    ),
                    cell(_agreement(verdict)),
                ]
            )
            + " |"
        )
    if reasons:
        lines.append("")
        lines += [
            f"- {cell(reason)} ({', '.join(map(cell, who))})" for reason, who in reasons.items()
        ]
    return lines
