"""The command line: listing, compatibility spelling and usage refusals (exit 2, no traceback)."""

from __future__ import annotations

import argparse

import pytest

from cache_family.cli import _worker_parser, build_parser, main, normalize_argv


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


PREPARE = ["prepare-full", "--input", "/ops/op.json", "--output", "/tmp/prepared"]


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["run", "--input", "/a\nb.json", "--output", "/tmp/x"], "cli.path.bad_char"),
        (["validate", "--input", "/ops/op.json/"], "cli.path.trailing_slash"),
        (["run", "--input", "/ops/in.json/", "--output", "/tmp/x"], "cli.path.trailing_slash"),
        (["validate", "--input", "/ops/\u202enosj.json"], "cli.path.format_char"),
        (["run", "--input", "/a.json", "--output", "/tmp/x\u200b"], "cli.path.format_char"),
        (["replay", "/runs/\ufeffr1"], "cli.path.format_char"),
        (["validate", "--input", "/ops/op\udcff.json"], "cli.path.not_utf8"),
        # "" was read as the current directory (a directory "" even became "/").
        (["validate", "--input", ""], "cli.path.empty"),
        (["report", "--input", "", "--output", "/tmp/r.md"], "cli.path.empty"),
        (["run", "--input", "/a.json", "--output", ""], "cli.path.empty"),
        (["report-run", ""], "cli.path.empty"),
        # --workloads (and --use-case-corpus) pass the checks --input passes.
        ([*PREPARE, "--workloads", "/w/\x1b]0;pwned\x07w.json"], "cli.path.bad_char"),
        ([*PREPARE, "--workloads", "/w/workloads.json/"], "cli.path.trailing_slash"),
        ([*PREPARE, "--use-case-corpus", "/c/\u202enosj.json"], "cli.path.format_char"),
    ],
)
def test_a_path_argument_is_refused_with_its_own_code(
    capsys: pytest.CaptureFixture[str], argv: list[str], code: str
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("refused: ")]
    assert line.startswith(f"refused: {code} at ")
    assert "(hint: " in line
    assert "Traceback" not in err
    assert "\x1b" not in err and "\x07" not in err  # a path is shown escaped, never raw


def test_a_trailing_slash_on_a_directory_is_dropped() -> None:
    args = build_parser().parse_args(["run", "--input", "/a.json", "--output", "/tmp/out/"])
    assert args.output == "/tmp/out"
    args = build_parser().parse_args(["replay", "/runs/r1//"])
    assert args.run_dir == "/runs/r1"


@pytest.mark.parametrize(
    ("argv", "where"),
    [
        (["validate"], "argv"),
        (["validate", "--input"], "--input"),
        (["validate", "--input", "/a.json", "--bogus"], "argv"),
        (["prepare-full", "--input", "/a.json", "--output", "/o", "--llama-repeats"],
         "--llama-repeats"),
        (["zoo", "build", "--cache-root", "/z", "--seed", "x"], "--seed"),
        (["no-such-command"], "COMMAND"),
    ],
)  # fmt: skip
def test_usage_errors_are_refusal_lines_like_every_other_refusal(
    capsys: pytest.CaptureFixture[str], argv: list[str], where: str
) -> None:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("refused: ")]
    assert line.startswith(f"refused: cli.usage at {where}: ")
    assert line.endswith("--help`)")
    assert "error:" not in err


def test_no_command_prints_help_and_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_parser_builds_without_touching_the_filesystem() -> None:
    assert build_parser().prog == "cache-family"


def _every_parser(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                found += _every_parser(child)
    return found


def test_no_parser_accepts_abbreviated_options() -> None:
    parsers = [*_every_parser(build_parser()), _worker_parser()]
    assert len(parsers) >= 8
    assert [p.prog for p in parsers if p.allow_abbrev] == []


@pytest.mark.parametrize(
    ("argv", "abbreviated"),
    [
        (["validate", "--inp", "/a.json"], "--inp"),
        (["validate", "--input", "/a.json", "--js"], "--js"),
        (["prepare-full", "--input", "/a.json", "--output", "/o", "--prefix", "3"], "--prefix"),
        (["prepare-use-cases", "--input", "/a.json", "--output", "/o", "--llama-rep", "3"],
         "--llama-rep"),
        (["run", "--in", "/p.json", "--output", "/o"], "--in"),
        (["replay", "/runs/r1", "--re"], "--re"),
        (["zoo", "build", "--cache", "/z"], "--cache"),
        (["prepare-worker", "--inp", "/r.json", "--output", "/o"], "--inp"),
    ],
)  # fmt: skip
def test_an_abbreviated_option_is_refused_in_every_command(
    capsys: pytest.CaptureFixture[str], argv: list[str], abbreviated: str
) -> None:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "refused: cli.usage at " in err
    assert abbreviated in err
