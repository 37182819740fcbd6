"""The campaign journal written as the campaign goes (``actors/campaign/journal.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cache_family.actors.campaign.journal import CampaignJournal, journal_sealed
from cache_family.errors import Refused
from cache_family.schemas.campaign import (
    CAMPAIGN_JOURNAL,
    CampaignOpened,
    CampaignResumed,
    RowArrived,
    read_campaign,
)

OPENED = CampaignOpened(
    campaign_id="campaign-x", prepared_sha256="a" * 64, catalog_sha256="b" * 64,
    plan_keys=("k/none/16", "k/none/32"),
)  # fmt: skip


def arrival(key: str) -> RowArrived:
    return RowArrived(
        row_index=0, row_key=key, row_dir=f"rows/{key}", journal_head="c" * 64,
        files_sha256="d" * 64, files=3, size=10, how="object-store",
    )  # fmt: skip


def test_every_append_is_on_disk_and_a_torn_tail_is_cut_off_when_continued(
    tmp_path: Path,
) -> None:
    journal = CampaignJournal.create(str(tmp_path), OPENED)
    journal.append(arrival("k/none/16"))
    journal.close()
    whole = (tmp_path / CAMPAIGN_JOURNAL).read_bytes()
    assert [type(line.record) for line in read_campaign(whole).lines] == [
        CampaignOpened, RowArrived,
    ]  # fmt: skip
    assert journal_sealed(str(tmp_path)) is False
    # A kill cut the next write short.
    with open(tmp_path / CAMPAIGN_JOURNAL, "ab") as handle:
        handle.write(b'{"seq":3,"mono_ns":1,"wal')
    continued = CampaignJournal.continued(str(tmp_path))
    assert continued.opened == OPENED
    continued.append(CampaignResumed(kept=("k/none/16",), rerun=("k/none/32",)))
    continued.append(arrival("k/none/32"))
    head = continued.seal("completed")
    continued.close()
    data = (tmp_path / CAMPAIGN_JOURNAL).read_bytes()
    assert data.startswith(whole)
    read = read_campaign(data)
    assert read.problem is None and read.line_sha256s[-1] == head
    assert journal_sealed(str(tmp_path)) is True


def test_a_journal_whose_chain_is_broken_is_not_continued(tmp_path: Path) -> None:
    journal = CampaignJournal.create(str(tmp_path), OPENED)
    journal.append(arrival("k/none/16"))
    journal.close()
    path = tmp_path / CAMPAIGN_JOURNAL
    path.write_bytes(path.read_bytes().replace(b"campaign-x", b"campaign-y"))
    with pytest.raises(Refused) as caught:
        CampaignJournal.continued(str(tmp_path))
    assert caught.value.refusals[0].code == "campaign.journal.chain_broken"
