"""Which machine ran a run of some rows: journaled in ``rows_selected``, merged into a campaign.

Observed by the run itself on the host that runs it (``actors/run/selection.py``); a scheduler
that knows more (a Ray node id and labels) hands it to the run through the environment.
"""

from __future__ import annotations

import msgspec


class HostIdentity(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    hostname: str
    # The scheduler's name for the node (a Ray node id), None outside one.
    node_id: str | None = None
    # The node's placement labels (Ray labels), as the scheduler gave them.
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    # One description per GPU the host's driver lists (model names), empty without one.
    gpus: tuple[str, ...] = ()
    cpu_count: int | None = None
    # The CPU's model name as /proc/cpuinfo gives it; None where it names none.
    cpu_model: str | None = None
