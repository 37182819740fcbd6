"""Command line: argument parsing and exit codes only; the work lives in the layers.

Exit codes: 0 success, 1 a run or comparison that finished with a negative verdict,
2 input refused (nothing written), 3 refused during work (observations kept),
130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, NoReturn

from cache_family import __version__
from cache_family.console.refusals import print_refusals, print_refusals_json
from cache_family.errors import Refusal, Refused
from cache_family.exit_codes import ExitCode
from cache_family.schemas.text import UnsafeCharacter, unsafe_character
from cache_family.system import interrupts

if TYPE_CHECKING:
    from cache_family.console.progress import Mode


# The operator guide's compatibility spelling: `cache-family automation cache-family-run <sub>`.
_COMPAT_PREFIX = ("automation",)
_COMPAT_RUN = "cache-family-run"
_COMPAT_REPORT = "cache-family-report"


_USAGE = "cli.usage"


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are refusal lines like every other refusal, exit 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # exit_on_error=False hands argparse's ArgumentError to parse_known_args below,
        # which still knows which argument it was about.
        kwargs.setdefault("exit_on_error", False)
        # `--prefix 3` must not quietly mean --prefix-tokens: a misspelt option is refused.
        # Subparsers are built with this class too (parser_class), so it holds for each.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        try:
            return super().parse_known_args(args, namespace)
        except argparse.ArgumentError as err:
            self.refuse(err.argument_name or "argv", err.message)

    def error(self, message: str) -> NoReturn:
        self.refuse("argv", message)

    def refuse(self, where: str, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        hint = f"run `{self.prog} --help`"
        print(f"refused: {Refusal(_USAGE, where, message, hint).line()}", file=sys.stderr)
        raise SystemExit(ExitCode.REFUSED)


class _Once(argparse.Action):
    """A single-valued option given twice is a usage error, not a silent "last one wins"."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        if getattr(namespace, self.dest, None) is not None:
            message = f"{option_string} given more than once"
            if isinstance(parser, _Parser):
                parser.refuse(option_string or self.dest, message)
            parser.error(message)
        setattr(namespace, self.dest, values)


_UNSAFE_PATH: Final[dict[UnsafeCharacter, tuple[str, str, str]]] = {
    "not-utf8": (
        "cli.path.not_utf8",
        "is not valid UTF-8",
        "rename the file or directory to a UTF-8 name",
    ),
    "control": (
        "cli.path.bad_char",
        "contains a control character",
        "remove control characters from the path",
    ),
    "format": (
        "cli.path.format_char",
        "contains an invisible format character",
        "retype the path: it holds a character such as a right-to-left override "
        "or a zero-width space",
    ),
}


def _path_refusal(where: str, value: str, *, is_file: bool) -> Refusal | None:
    """Why a command-line path is refused, if it is.

    A path is journaled, printed and written into JSON: a control character, an invisible
    format character (a right-to-left override shows another name than the one opened) or
    bytes that are not UTF-8 would make those lie or fail. A trailing slash on a file names
    something that can only be a directory.
    """
    shown = ascii(value)
    if not value:  # "" would be read as the current directory
        return Refusal("cli.path.empty", where, "the path is empty", "give a path")
    kind = unsafe_character(value)
    if kind is not None:
        code, what, hint = _UNSAFE_PATH[kind]
        return Refusal(code, where, f"path {shown} {what}", hint)
    if is_file and len(value) > 1 and value.endswith("/"):
        return Refusal(
            "cli.path.trailing_slash",
            where,
            f"file path {shown} ends with a slash",
            "name the file without a trailing slash",
        )
    return None


def _file_path(where: str) -> Callable[[str], str]:
    def check(value: str) -> str:
        refusal = _path_refusal(where, value, is_file=True)
        if refusal is not None:
            raise Refused((refusal,))
        return value

    return check


def _dir_path(where: str) -> Callable[[str], str]:
    """A directory path; trailing slashes are dropped so the recorded name is canonical."""

    def check(value: str) -> str:
        refusal = _path_refusal(where, value, is_file=False)
        if refusal is not None:
            raise Refused((refusal,))
        return value.rstrip("/") or "/"

    return check


def _print_refusals(refused: Refused, as_json: bool = False) -> None:
    if as_json:
        print_refusals_json(refused.refusals, sys.stdout)
    else:
        print_refusals(refused.refusals, sys.stderr)


def _cmd_validate(args: argparse.Namespace) -> int:
    from cache_family.schemas.bounded import MIB, read_bounded
    from cache_family.schemas.operator import validate_operator_document

    try:
        raw = read_bounded(str(Path(args.input).absolute()), MIB, what="operator input")
        validate_operator_document(raw.data)
    except Refused as refused:
        _print_refusals(refused, args.json)
        if not args.json:
            from cache_family.console.refusals import say_failed

            say_failed(
                sys.stderr,
                "validate",
                f"{len(refused.refusals)} refusal(s) above",
                args.input,
                "fix each one as its hint says (README: 'Operator input reference'), then "
                "validate again",
            )
        return ExitCode.REFUSED
    if args.json:
        print(json.dumps({"valid": True, "sha256": raw.sha256, "refusals": []}, indent=2))
    else:
        print(f"valid: {args.input} (sha256 {raw.sha256})")
    return ExitCode.OK


def _cmd_zoo_build(args: argparse.Namespace) -> int:
    from cache_family.oracles.zoo import build_zoo

    result = build_zoo(Path(args.cache_root).absolute(), seed=args.seed, progress=sys.stderr)
    print(result.summary())
    return ExitCode.OK


# Plan overrides of prepare-full / prepare-use-cases; preparation refuses repeats.
_PREPARE_OVERRIDES = (
    ("--use-case-corpus", "ABS"),
    ("--workloads", "ABS"),
    ("--prefix-tokens", "N"),
    ("--runtime-lane-count", "N"),
    ("--llama-parallel", "N"),
    ("--llama-repeats", "N"),
    ("--cache-hit-repeats", "N"),
    ("--native-output-tokens", "N"),
)


def _cmd_prepare(args: argparse.Namespace) -> int:
    from cache_family.console.preparation import prepare_command

    overrides = [
        item
        for flag, _ in _PREPARE_OVERRIDES
        for value in getattr(args, flag[2:].replace("-", "_"))
        for item in (flag, value)
    ]
    return prepare_command(args.command, args.input, args.output, overrides)


def _cmd_prepare_worker(args: argparse.Namespace) -> int:
    from cache_family.console.preparation import worker_command

    return worker_command(args.input, args.output)


def _cmd_run(args: argparse.Namespace) -> int:
    # Before the run's first side effect, and until the process exits: no SIGINT/SIGTERM
    # reaches Python's defaults (143, a KeyboardInterrupt); each ends in 130 with a matrix.
    interrupts.hold_until_exit()
    parser: _Parser = args.parser
    if args.resume is not None:
        if args.input is not None or args.output is not None:
            parser.refuse("--resume", "--resume continues a run: give no --input or --output")
        if args.rows is not None or args.shard is not None or args.dry_run:
            parser.refuse("--resume", "a resumed run keeps the rows it was started with")
        from cache_family.console.commands import resume_command

        return resume_command(args.resume, sign_key=args.sign_key, mode=_progress_mode(args))
    if args.dry_run:
        if args.input is None:
            parser.refuse("--dry-run", "--dry-run lists the rows of --input PREPARED_JSON")
        from cache_family.actors.run.selection import dry_run_keys

        try:
            keys = dry_run_keys(args.input, args.rows, args.shard, os.environ)
        except Refused as refused:
            _print_refusals(refused)
            _say_refused(args, refused)
            return ExitCode.REFUSED
        for key in keys:
            print(key)
        return ExitCode.OK
    if args.input is None or args.output is None:
        parser.refuse("--input", "give --input and --output (or --resume RUN_DIR)")
    from cache_family.console.commands import run_command

    select = None
    if args.rows is not None or args.shard is not None:
        from cache_family.actors.run.selection import selector

        select = selector(args.rows, args.shard, os.environ)
    return run_command(
        args.input, args.output, sign_key=args.sign_key, mode=_progress_mode(args), select=select
    )


def _progress_mode(args: argparse.Namespace) -> Mode:
    from cache_family.console.progress import choose_mode

    return choose_mode(sys.stderr, quiet=args.quiet, json_events=args.json_events)


def _add_progress_options(command: argparse.ArgumentParser) -> None:
    """--quiet and --json-events (exclusive); without them a terminal gets a live display
    and anything else plain lines, on stderr."""
    shown = command.add_mutually_exclusive_group()
    shown.add_argument(
        "--quiet",
        action="store_true",
        help="no progress on stderr; failures and the result lines are still printed",
    )
    shown.add_argument(
        "--json-events",
        action="store_true",
        help="progress as JSON lines on stdout (event, row, arm, state, rung, rungs, "
        "elapsed_s, budget_left_s), ending with run_finished; failures still on stderr",
    )


def _cmd_merge(args: argparse.Namespace) -> int:
    from cache_family.actors.campaign.merge import merge_campaign

    try:
        outcome = merge_campaign(args.output, args.shard_dirs, placement_file=args.placement)
    except Refused as refused:
        _print_refusals(refused)
        _say_refused(args, refused)
        return ExitCode.REFUSED
    print(f"{outcome.status}: {outcome.matrix_path}")
    print(f"campaign journal head: {outcome.head}")
    return ExitCode.COMPLETED if outcome.status == "completed" else ExitCode.NOT_COMPLETED


def _cmd_campaign(args: argparse.Namespace) -> int:
    from cache_family.actors.campaign.ray_driver import campaign_main

    parser: _Parser = args.parser
    if args.hosts < 1 or args.hosts > 64:
        parser.refuse("--hosts", "--hosts is a whole number from 1 to 64")
    if args.resume is not None:
        if args.input is not None or args.output is not None or args.placement is not None:
            parser.refuse("--resume", "--resume continues a campaign: give no --input, "
                          "--output or --placement")  # fmt: skip
    elif args.input is None or args.output is None:
        parser.refuse("--input", "give --input and --output (or --resume CAMPAIGN)")
    try:
        code, _ = campaign_main(
            args.input,
            str(args.resume or args.output),
            args.ray,
            args.placement,
            args.hosts,
            resume=args.resume is not None,
            row_return=args.row_return,
        )
    except Refused as refused:
        _print_refusals(refused)
        _say_refused(args, refused)
        return ExitCode.REFUSED
    return code


def _replay_campaign(campaign_dir: str, expect_head: str | None) -> int:
    from cache_family.actors.campaign.audit import replay_campaign

    report = replay_campaign(campaign_dir, expect_head=expect_head)
    for line in report.lines:
        print(line)
    return report.exit_code


def _cmd_replay(args: argparse.Namespace) -> int:
    from cache_family.actors.audit.head_signature import HEAD_PATTERN
    from cache_family.actors.audit.replay import HeadCheck
    from cache_family.console.commands import replay_command
    from cache_family.console.refusals import say_failed

    parser: _Parser = args.parser
    if args.expect_head is not None and not HEAD_PATTERN.fullmatch(args.expect_head):
        parser.refuse("--expect-head", "give the 64 lowercase hex digits the run printed")
    if (Path(args.run_dir) / "campaign-journal.jsonl").is_file():
        return _replay_campaign(args.run_dir, args.expect_head)
    if (args.allowed_signers is None) != (args.signer_identity is None):
        parser.refuse("--allowed-signers", "--allowed-signers and --signer-identity go together")
    head = HeadCheck(
        expect_head=args.expect_head,
        allowed_signers=args.allowed_signers,
        signer_identity=args.signer_identity,
    )
    code = replay_command(args.run_dir, reap=args.reap, head=head)
    journal = str(Path(args.run_dir) / "journal.jsonl")
    if code == ExitCode.NEGATIVE:
        say_failed(
            sys.stderr,
            "replay",
            "the receipts on disk differ from the journal's, or the run did not finish "
            "(the lines above name each file)",
            f"{journal} and the files named above",
            f"an unfinished run continues with `cache-family run --resume {args.run_dir}`; a "
            "differing receipt means the run directory was changed after the run: keep it "
            "as evidence and rerun into a fresh --output",
        )
    elif code != ExitCode.OK:
        say_failed(
            sys.stderr,
            "replay",
            "the run directory could not be read (the lines above)",
            journal,
            "check that RUN_DIR is a run's output directory and is readable, then replay again",
        )
    return code


# --- cache-family report (the combined README tables) ------------------------------------


def _cmd_report(args: argparse.Namespace) -> int:

    from cache_family.report import build_report
    from cache_family.schemas.refusal_codes import report_hint
    from cache_family.system.publish import replace_atomically

    text = build_report(args.input, args.use_case_corpus)  # refuses before anything is written
    if args.output is None:
        sys.stdout.write(text)
        return ExitCode.OK
    target = str(Path(args.output).absolute())
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        replace_atomically(target, text.encode("utf-8"))
    except OSError as exc:
        raise Refused.one(
            "report.output_unwritable",
            "$",
            f"cannot write {target}: {exc.strerror or exc}",
            report_hint("report.output_unwritable"),
        ) from None
    print(f"Wrote {args.output}")
    return ExitCode.OK


def _add_report_command(sub: argparse._SubParsersAction[_Parser]) -> None:
    report = sub.add_parser(
        "report",
        help="render the combined README tables from production-cache-bench.json files",
    )
    report.add_argument(
        "--input",
        action="append",
        required=True,
        type=_file_path("--input"),
        metavar="JSON",
        help="a production-cache-bench.json (1 to 32, repeatable), at most 16 MiB each",
    )
    # --output and --use-case-corpus: the last occurrence counts, as in the reference CLI.
    report.add_argument(
        "--output",
        type=_file_path("--output"),
        metavar="MARKDOWN",
        help="write the tables here (parents created, replaced atomically); default stdout",
    )
    report.add_argument(
        "--use-case-corpus",
        type=_file_path("--use-case-corpus"),
        metavar="CORPUS_JSON",
        help="corpus for the prompt-source table (default: the checked-in corpus)",
    )
    report.set_defaults(func=_cmd_report)


# --- end of cache-family report ----------------------------------------------------------


# --- cache-family report-run (the run report from a run directory's receipts) -------------


def _publish_report_file(target: str, data: bytes) -> None:
    """Replace ``target`` atomically, creating its parents; a failure is a typed refusal."""
    from cache_family.schemas.refusal_codes import report_hint
    from cache_family.system.publish import replace_atomically

    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        replace_atomically(target, data)
    except OSError as exc:
        raise Refused.one(
            "report.output_unwritable",
            "$",
            f"cannot write {target}: {exc.strerror or exc}",
            report_hint("report.output_unwritable"),
        ) from None


def _cmd_report_run(args: argparse.Namespace) -> int:
    from cache_family.actors.audit.run_files import REPORT_MANIFEST_NAME, report_manifest
    from cache_family.report.run import read_run
    from cache_family.report.run_report import render_run_report

    output = args.output if args.output is not None else args.run_dir
    receipts = read_run(
        args.run_dir, output, production=args.production, corpus=args.use_case_corpus
    )
    files = render_run_report(receipts)  # refuses before anything is written
    root = Path(output).absolute()
    # Plots first and report.md last: a reader who sees the new Markdown finds its plots.
    for name in sorted(files, key=lambda n: (n.count("/") == 0, n.endswith(".md"), n)):
        _publish_report_file(str(root / name), files[name])
    # Then the SHA-256 of each: replay of the run directory finds one missing or extra.
    _publish_report_file(str(root / REPORT_MANIFEST_NAME), report_manifest(files))
    for name in ("report.md", "report.html"):
        print(f"Wrote {Path(output) / name}")
    return ExitCode.OK


def _add_report_run_command(sub: argparse._SubParsersAction[_Parser]) -> None:
    run_report = sub.add_parser(
        "report-run",
        help="write report.md, report.html and plots/*.svg from a run directory's receipts",
    )
    run_report.add_argument("run_dir", metavar="RUN_DIR", type=_dir_path("RUN_DIR"))
    run_report.add_argument(
        "--output",
        action=_Once,
        type=_dir_path("--output"),
        metavar="DIR",
        help="directory for the report files (default: the run directory); links stay relative",
    )
    run_report.add_argument(
        "--production",
        action=_Once,
        type=_file_path("--production"),
        metavar="JSON",
        help="production-cache-bench.json for the reference tables (default: the run's own, "
        "when it has one)",
    )
    run_report.add_argument(
        "--use-case-corpus",
        action=_Once,
        type=_file_path("--use-case-corpus"),
        metavar="CORPUS_JSON",
        help="corpus for the prompt-source table (default: the checked-in corpus)",
    )
    run_report.set_defaults(func=_cmd_report_run)


# --- end of cache-family report-run ------------------------------------------------------


# --- cache-family bench (the wrapper's sequence; scripts/skippy-cache-family-bench.sh) ------


def _cmd_bench(args: argparse.Namespace) -> int:
    from cache_family.console.bench_sequence import bench_command

    return bench_command(args.output_dir, quiet=args.quiet)


def _add_bench_command(sub: argparse._SubParsersAction[_Parser]) -> None:
    bench = sub.add_parser(
        "bench",
        help="both matrices and their combined README tables "
        "(the wrapper; configured by SKIPPY_CACHE_* variables, see the README)",
    )
    bench.add_argument(
        "output_dir",
        nargs="?",
        metavar="OUTPUT_DIR",
        type=_dir_path("OUTPUT_DIR"),
        help="created if missing (default /tmp/skippy-cache-family-bench-<run id>)",
    )
    bench.add_argument(
        "--quiet",
        action="store_true",
        help="no step lines and no run progress; failures and the closing lines remain",
    )
    bench.set_defaults(func=_cmd_bench)


# --- end of cache-family bench -------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="cache-family",
        description="Benchmark inference-server cache payloads against recompute, with byte "
        "pins, journaled host sessions and replayable receipts.",
    )
    parser.add_argument("--version", action="version", version=f"cache-family {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    validate = sub.add_parser(
        "validate", help="check an operator input and print every refusal (exit 0 valid, 2 refused)"
    )
    validate.add_argument(
        "--input",
        required=True,
        action=_Once,
        type=_file_path("--input"),
        metavar="OPERATOR_JSON",
        help="operator input (schema_version 1), at most 1 MiB",
    )
    validate.add_argument("--json", action="store_true", help="print the verdict as JSON on stdout")
    validate.set_defaults(func=_cmd_validate)

    zoo = sub.add_parser("zoo", help="tiny real GGUF models for every catalog family")
    zoo_sub = zoo.add_subparsers(
        dest="zoo_command", metavar="ZOO_COMMAND", required=True, parser_class=_Parser
    )
    zoo_build = zoo_sub.add_parser(
        "build", help="write the tiny random-weight model zoo as a Hugging Face hub cache"
    )
    zoo_build.add_argument(
        "--cache-root",
        required=True,
        action=_Once,
        type=_dir_path("--cache-root"),
        metavar="DIR",
        help="hub cache root to write models--ORG--NAME/ trees into",
    )
    zoo_build.add_argument(
        "--seed", type=int, default=0, help="weights are deterministic for a seed (default 0)"
    )
    zoo_build.set_defaults(func=_cmd_zoo_build)

    for name, what in (
        ("prepare-full", "all catalog presets, no use cases"),
        ("prepare-use-cases", "every use case of the corpus"),
    ):
        prep = sub.add_parser(
            name, help=f"observe bytes and write cache-family-input.json ({what})"
        )
        prep.add_argument(
            "--input",
            required=True,
            action=_Once,
            type=_file_path("--input"),
            metavar="ABS_OPERATOR_JSON",
        )
        prep.add_argument(
            "--output",
            required=True,
            action=_Once,
            type=_dir_path("--output"),
            metavar="ABS_FRESH_DIR",
        )
        for flag, metavar in _PREPARE_OVERRIDES:
            prep.add_argument(
                flag,
                action="append",
                default=[],
                metavar=metavar,
                # A file override passes the checks --input passes.
                type=_file_path(flag) if metavar == "ABS" else str,
                help="plan override, at most once",
            )
        prep.set_defaults(func=_cmd_prepare)

    run = sub.add_parser("run", help="run every prepared row and publish journaled receipts")
    run.add_argument(
        "--input",
        action=_Once,
        type=_file_path("--input"),
        metavar="PREPARED_JSON",
        help="cache-family-input.json from prepare-full or prepare-use-cases",
    )
    run.add_argument(
        "--output",
        action=_Once,
        type=_dir_path("--output"),
        metavar="ABS_FRESH_DIR",
    )
    run.add_argument(
        "--resume",
        action=_Once,
        type=_dir_path("--resume"),
        metavar="RUN_DIR",
        help="continue an interrupted or crashed run in RUN_DIR (instead of --input/--output)",
    )
    run.add_argument(
        "--sign-key",
        action=_Once,
        type=_file_path("--sign-key"),
        metavar="SSH_PRIVATE_KEY",
        help="sign the journal's head with this OpenSSH key (ssh-keygen -Y sign) into "
        "RUN_DIR/journal.head.sig",
    )
    rows = run.add_mutually_exclusive_group()
    rows.add_argument(
        "--rows",
        action=_Once,
        metavar="KEY[,KEY...]",
        help="run only these rows of the prepared input (a key is CASE/USE_CASE/PREFIX; "
        "--dry-run lists them)",
    )
    rows.add_argument(
        "--shard",
        action=_Once,
        metavar="I/N",
        help="run shard I of N (rendezvous hashing of the row keys); auto/N reads "
        "SLURM_ARRAY_TASK_ID or JOB_COMPLETION_INDEX",
    )
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="print the keys of the rows the run would run, one a line, and exit",
    )
    _add_progress_options(run)
    run.set_defaults(func=_cmd_run, parser=run)

    replay = sub.add_parser(
        "replay", help="verify a run's journal and re-fold its receipts byte for byte"
    )
    replay.add_argument("run_dir", metavar="RUN_DIR", type=_dir_path("RUN_DIR"))
    replay.add_argument(
        "--reap",
        action="store_true",
        help="end processes the journal recorded that still match pid and create time",
    )
    replay.add_argument(
        "--expect-head",
        action=_Once,
        metavar="SHA256",
        help="the journal head the run printed as its last line; any other head differs",
    )
    replay.add_argument(
        "--allowed-signers",
        action=_Once,
        type=_file_path("--allowed-signers"),
        metavar="FILE",
        help="verify journal.head.sig against this ssh-keygen allowed-signers file",
    )
    replay.add_argument(
        "--signer-identity",
        action=_Once,
        metavar="ID",
        help="the identity (principal) in --allowed-signers the head must be signed by",
    )
    replay.set_defaults(func=_cmd_replay, parser=replay)

    merge = sub.add_parser(
        "merge", help="merge the run directories of a campaign's shards into one campaign"
    )
    merge.add_argument(
        "--output", required=True, type=_dir_path("--output"), metavar="ABS_CAMPAIGN_DIR"
    )
    merge.add_argument(
        "--placement",
        action=_Once,
        type=_file_path("--placement"),
        metavar="PLACEMENT_JSON",
        help="the placement file the shards were placed by (pinned in the campaign journal)",
    )
    merge.add_argument("shard_dirs", nargs="+", metavar="SHARD_DIR", type=_dir_path("SHARD_DIR"))
    merge.set_defaults(func=_cmd_merge, parser=merge)

    campaign = sub.add_parser(
        "campaign", help="run every row of a prepared input as a Ray task on labelled hosts"
    )
    campaign.add_argument(
        "--input", action=_Once, type=_file_path("--input"), metavar="PREPARED_JSON"
    )
    campaign.add_argument(
        "--resume",
        action=_Once,
        type=_dir_path("--resume"),
        metavar="CAMPAIGN",
        help="run again only the rows of CAMPAIGN without a finished run, then merge",
    )
    campaign.add_argument(
        "--output",
        action=_Once,
        type=_dir_path("--output"),
        metavar="ABS_FRESH_DIR",
        help="the campaign directory (on the driver's host; the nodes need not see it "
        "unless --row-return shared-output)",
    )
    campaign.add_argument(
        "--ray",
        required=True,
        metavar="ADDRESS|local",
        help="a Ray cluster's address, or local: a cluster of --hosts labelled nodes on "
        "this machine, on loopback only (needs root for its network namespace)",
    )
    campaign.add_argument(
        "--placement",
        action=_Once,
        type=_file_path("--placement"),
        metavar="PLACEMENT_JSON",
        help="which hosts (Ray labels, GPUs, CPUs) may run which rows",
    )
    campaign.add_argument(
        "--hosts",
        type=int,
        default=1,
        metavar="N",
        help="with --ray local: the number of nodes, labelled cf.host=host-0..host-N-1",
    )
    campaign.add_argument(
        "--row-return",
        choices=("object-store", "shared-output"),
        default="object-store",
        help="how each row's sealed run comes back: through Ray's object store (default; "
        "the nodes share no directory with the driver) or written by its node into the "
        "campaign directory, which every node must then see",
    )
    campaign.set_defaults(func=_cmd_campaign, parser=campaign)

    _add_report_command(sub)
    _add_report_run_command(sub)
    _add_bench_command(sub)
    return parser


_WORKER_COMMAND = "prepare-worker"


def _worker_parser() -> argparse.ArgumentParser:
    """The preparation worker: started only by prepare-full/prepare-use-cases, never listed."""
    worker = _Parser(prog=f"cache-family {_WORKER_COMMAND}", add_help=False)
    worker.add_argument("--input", required=True, action=_Once, type=_file_path("--input"))
    worker.add_argument("--output", required=True, action=_Once, type=_dir_path("--output"))
    worker.set_defaults(func=_cmd_prepare_worker, command=_WORKER_COMMAND)
    return worker


def _say_refused(args: argparse.Namespace, refused: Refused) -> None:
    """The closing lines after a command's refusals: what, evidence, what to do next."""
    from cache_family.console.refusals import say_failed

    command = str(getattr(args, "command", None) or "cache-family")
    what = f"refused ({len(refused.refusals)} refusal(s) above, each with its hint)"
    if command == "report":
        output = getattr(args, "output", None)
        evidence = "the input file and JSON path each refusal names; " + (
            f"{output} was left untouched" if output else "nothing was written"
        )
        next_step = "fix or drop that input, then run `cache-family report` again"
    elif command == "report-run":
        evidence = f"{args.run_dir} (the file each refusal names); no report file was written"
        next_step = (
            f"`cache-family replay {args.run_dir}` checks the run's receipts; fix what the "
            "refusal names, then run `cache-family report-run` again"
        )
    else:
        evidence = "the input each refusal names; nothing was written"
        next_step = "fix what each refusal names, then run the command again"
    say_failed(sys.stderr, command, what, evidence, next_step)


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """Map `automation cache-family-run [<sub>] ...` and `automation cache-family-report ...`
    onto the native command names."""
    args = list(argv)
    if args[: len(_COMPAT_PREFIX)] == list(_COMPAT_PREFIX):
        args = args[len(_COMPAT_PREFIX) :]
        if args and args[0] == _COMPAT_RUN:
            rest = args[1:]
            if rest and not rest[0].startswith("-"):
                return rest  # automation cache-family-run prepare-full --input ...
            return ["run", *rest]  # automation cache-family-run --input ... --output ...
        if args and args[0] == _COMPAT_REPORT:
            return ["report", *args[1:]]  # automation cache-family-report --input ...
    return args


def _never_fail_on_encoding() -> None:
    """Print what cannot be encoded as escapes instead of failing.

    A path from the filesystem may hold bytes a strict UTF-8 (or ASCII) stdout cannot
    encode; a refusal or verdict naming it must still be printed, not end in a traceback.
    """
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")


def main(argv: Sequence[str] | None = None) -> int:
    """The command line. Called as the program (``argv`` None) by a command that holds the
    process's signal latch (``run``), it never returns: see :func:`_exit_holding_signals`."""
    try:
        code = _command(argv)
    except SystemExit as stop:  # a usage refusal after the latch was put up
        latch = interrupts.process_latch() if argv is None else None
        if latch is None or not isinstance(stop.code, int):
            raise
        _exit_holding_signals(latch, stop.code)
    latch = interrupts.process_latch() if argv is None else None
    if latch is not None:
        _exit_holding_signals(latch, code)
    return code


def _exit_holding_signals(latch: interrupts.Latch, code: int) -> NoReturn:
    """End a ``run`` process once its last line is printed, with the latch still in place.

    Python's finalization would put SIGINT/SIGTERM's default actions back while it tears the
    interpreter down, so a signal in those milliseconds ended the process as -15 or -2. Here
    the signals are blocked, any that came after the command's own last look make the exit
    code 130, and the process ends at once (``os._exit``, after flushing what it printed)."""
    # Flushed first: a signal while the last lines are written reaches the latch (this
    # thread still takes signals); flushed after the last look, it was lost (exit 0).
    _flush_output()
    late = interrupts.signals_at_exit(latch)
    if late:  # the exit is 130 whatever comes now
        for name in late:
            print(f"{name} after the run's last line: the run had finished", file=sys.stderr)
        _flush_output()
    os._exit(ExitCode.INTERRUPTED if late else code)


def _flush_output() -> None:
    for stream in (sys.stdout, sys.stderr):
        # A closed pipe: what could not be written is lost either way.
        with contextlib.suppress(OSError, ValueError):
            stream.flush()


def _command(argv: Sequence[str] | None) -> int:
    _never_fail_on_encoding()
    args_in = normalize_argv(sys.argv[1:] if argv is None else argv)
    worker = args_in[:1] == [_WORKER_COMMAND]
    parser = _worker_parser() if worker else build_parser()
    try:
        args = parser.parse_args(args_in[1:] if worker else args_in)
    except Refused as refused:  # a path argument refused by its own rule
        # Refused while parsing, so args is not there to ask: `validate --json` promises
        # its verdict as a JSON document on stdout whatever refused it.
        _print_refusals(refused, as_json=args_in[:1] == ["validate"] and "--json" in args_in)
        return ExitCode.REFUSED
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return ExitCode.REFUSED
    try:
        return func(args)
    except Refused as refused:
        _print_refusals(refused)
        _say_refused(args, refused)
        return ExitCode.REFUSED
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED


if __name__ == "__main__":
    raise SystemExit(main())
