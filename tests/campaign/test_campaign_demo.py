"""``./bootstrap demo --hosts N``: the demo's campaign steps (the whole demo is test_demo's)."""

from __future__ import annotations

from cache_family.oracles import demo


def test_hosts_adds_a_local_campaign_of_the_full_rows_then_its_replay() -> None:
    steps, wrote = demo.campaign_steps("/o", 3)
    campaign, replay = steps
    assert campaign.argv[-9:] == (
        "campaign", "--input", "/o/full-input/cache-family-input.json",
        "--output", "/o/campaign", "--ray", "local", "--hosts", "3",
    )  # fmt: skip
    assert campaign.needs == ("/o/full-input/cache-family-input.json",)
    assert replay.argv[-2:] == ("replay", "/o/campaign")
    assert wrote == ("Wrote campaign report: /o/campaign/campaign-report.md",)


def test_the_demo_parser_takes_hosts() -> None:
    assert demo._parser().parse_args(["--hosts", "3"]).hosts == 3
    assert demo._parser().parse_args([]).hosts is None
