"""The command line: listing, compatibility spelling and usage refusals (exit 2, no traceback)."""

from __future__ import annotations

import pytest

from cache_family.cli import build_parser, main, normalize_argv


def test_help_lists_every_built_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    listing = capsys.readouterr().out
    for command in ("validate", "zoo", "prepare-full", "prepare-use-cases", "run", "replay"):
        assert command in listing
    assert "prepare-worker" not in listing


def test_the_worker_is_not_offered_as_a_choice(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["no-such-command"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "cli.usage" in err
    assert "prepare-worker" not in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("spelled", "native"),
    [
        (
            ["automation", "cache-family-run", "prepare-full", "--input", "/a", "--output", "/b"],
            ["prepare-full", "--input", "/a", "--output", "/b"],
        ),
        (
            ["automation", "cache-family-run", "--input", "/a", "--output", "/b"],
            ["run", "--input", "/a", "--output", "/b"],
        ),
        (["validate", "--input", "/a"], ["validate", "--input", "/a"]),
    ],
)
def test_operator_guide_spelling_maps_to_the_native_commands(
    spelled: list[str], native: list[str]
) -> None:
    assert normalize_argv(spelled) == native


def test_a_single_valued_option_given_twice_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as done:
        main(["validate", "--input", "/a.json", "--input", "/b.json"])
    assert done.value.code == 2
    assert "--input given more than once" in capsys.readouterr().err


def test_a_path_with_a_control_character_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as done:
        main(["run", "--input", "/a\nb.json", "--output", "/tmp/x"])
    assert done.value.code == 2
    assert "control character" in capsys.readouterr().err


def test_no_command_prints_help_and_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_parser_builds_without_touching_the_filesystem() -> None:
    assert build_parser().prog == "cache-family"
