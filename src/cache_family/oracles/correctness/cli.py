"""``skippy-correctness state-handoff``: the reference tool's command line, typed refusals, help.

``--help`` says what is measured, the tolerance and where this oracle differs from a
split-stage runtime. Exit status 0: report written, status pass; 1: report written, status
fail; 2: refused (bad command line, unusable paths), nothing written.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, NoReturn

from cache_family.errors import Refusal, Refused
from cache_family.exit_codes import ExitCode
from cache_family.oracles import llama_bindings
from cache_family.oracles.correctness.report import (
    HIT_LOGITS_TOLERANCE,
    _finite,
    build_report,
    write_report,
)
from cache_family.oracles.correctness.session import (
    FAULT_ENV,
    PACKAGE_MANIFEST,
    THREADS_ENV,
    HandoffArgs,
    HandoffFailed,
    Measured,
    _join_package,
    _quiet_logs,
    oracle_threads,
    run_handoff,
)
from cache_family.oracles.native_build import ORACLE_NATIVE_ENV
from cache_family.states.handoff import (
    LOAD_MODES,
    PAYLOADS,
    PROMPT_TEXT_MAX_BYTES,
    topology_of,
)
from cache_family.system.hashing import sha256_file

COMMAND: Final = "state-handoff"
MAX_REPEATS: Final = 10_000
MAX_PREFIX_TOKENS: Final = 1_000_000

_EPILOG = f"""\
what it does:
  Tokenizes the prompt (--prompt, or a built-in English text; repeated until long enough)
  and accepts the text of its first K+1 tokens (K = --prefix-token-count) as the benchmark
  prompt. Recompute baseline: prefill all K+1 tokens in one batch, greedy next token;
  recompute_total_ms is the mean of R timed recomputes after an untimed reference run.
  Then the K-token prefix is prefilled once and each of R repeats restores it and decodes
  the suffix token (after one untimed warm-up hit, as the recompute has its reference run):
    resident-kv   the prefix KV stays resident in the context; a hit copies the prefix
                  sequence into a second sequence (llama_memory_seq_cp: import) and decodes
                  the suffix there (decode). cache_storage_bytes is the size of the prefix
                  sequence's state (llama_state_seq_get_size).
    kv-recurrent  the prefix sequence state (KV and recurrent state) is exported to bytes
                  once (llama_state_seq_get_data); a hit imports those bytes into a cleared
                  second context (llama_state_seq_set_data: import) and decodes the suffix
                  (decode). cache_storage_bytes is the length of the exported bytes.
  Resident KV alone cannot hold a recurrent or hybrid model's state: that run fails with
  its reason (status fail, exit 1).

checks (status pass needs all):
  predicted_token_matches  every hit's greedy token equals, exactly, the token of an
                           uninterrupted decode with the same batch split (K tokens, then the
                           suffix, no handoff)
  cache_hit_matches        every hit's logits equal that decode's:
                           max|hit - reference| <= {HIT_LOGITS_TOLERANCE}
  matches                  both of the above, and every timed recompute repeats its token
  suffix_prefill_matches   reported apart, not needed for pass: that same-split decode's token
                           equals the one-batch recompute's (exact suffix-prefill depth)
  Logits are not compared with the recompute baseline's for the verdict: it prefills K+1
  tokens in one batch, a hit decodes one token after a K-token batch, and the summation
  order differs (zoo, K=64: up to 3e-3, and 2.8e-2 on a mixture-of-experts model whose
  routing moves). The report gives that difference as recompute_logits_max_abs_diff.

topologies:
  --layer-end must be the model's block count and (--state-layer-start,
  --state-layer-end, --state-stage-index) one topology's range for it: one-stage (0,L,0),
  split-stage0 (0,f,0), split-middle (f,s,1), split-final (s,L,2) with f=L/3,
  s=2(L/3)+(2(L%3))/3; with --stage-load-mode layer-package only package-stage1 (3,4,1).
  llama.cpp runs whole models, so the handed-off state always covers every layer (a
  superset of the stage's layers); the report states the range it validated and
  "state_scope": "all-layers".

  --stage-load-mode layer-package: --model is a schema-1 layer package directory
  ({PACKAGE_MANIFEST}, shared/metadata|embeddings|output.gguf, layers/...); its parts are
  checked against the manifest's SHA-256 and joined into one temporary GGUF that llama.cpp
  loads (llama.cpp cannot load a layer package directly). The join needs free space for
  the whole model in $TMPDIR: fine for the zoo, not for a full-size DeepSeek package.

accepted, recorded, not used (the handoff runs in this process):
  --stage-server-bin (must be a file), --source-bind-addr and --restore-bind-addr (must be
  127.0.0.1:PORT), --runtime-lane-count, --borrow-resident-hits,
  --cache-decoded-result-hits.

environment:
  {THREADS_ENV}: the threads of every llama.cpp context, as the stage servers get it; one
  thread when it is unset or not a positive whole number. The report records the count
  ("threads") and where it came from ("threads_source").
  The native build's libllama.so: $LLAMA_STAGE_BUILD_DIR/lib (the run's build), else
  $LLAMA_CPP_LIB_PATH, else ${ORACLE_NATIVE_ENV}/lib (the build the skippy-correctness
  launcher was written with).
  {FAULT_ENV}=1: FAULT INJECTION, tests only: alters the exported kv-recurrent bytes
  before each import (no effect on resident-kv, which imports no bytes).

exit status: 0 pass, 1 fail (report written), 2 refused (nothing written).
"""


def _refuse_argv(code: str, path: str, message: str) -> NoReturn:
    raise Refused.one(
        f"correctness.argv.{code}", path, message, f"see `skippy-correctness {COMMAND} --help`"
    )


class _Parser(argparse.ArgumentParser):
    """argparse that refuses (typed) instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        _refuse_argv("invalid", "$.argv", message)


def _set_once(namespace: argparse.Namespace, dest: str, value: object, flag: str | None) -> None:
    seen: set[str] = namespace.__dict__.setdefault("_seen", set())
    if dest in seen:
        _refuse_argv("duplicate", f"$.argv[{flag}]", f"{flag} given twice")
    seen.add(dest)
    setattr(namespace, dest, value)


class _Once(argparse.Action):
    """Stores a flag's value, refusing a flag given twice."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        _set_once(namespace, self.dest, values, option_string)


class _OnceFlag(argparse.Action):
    """A switch, refused when given twice."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=False, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        _set_once(namespace, self.dest, True, option_string)


def _bounded_int(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is outside {low}..{high}")
        return value

    parse.__name__ = "integer"
    return parse


def _loopback(text: str) -> str:
    host, _, port = text.rpartition(":")
    if host != "127.0.0.1" or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not 127.0.0.1:PORT")
    return text


def _absolute(text: str) -> Path:
    path = Path(text)
    if not path.is_absolute():
        raise argparse.ArgumentTypeError(f"{text!r} is not an absolute path")
    return path


def _model_id(text: str) -> str:
    if not text or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError("a model id is non-empty and has no whitespace")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=f"skippy-correctness {COMMAND}",
        description="Check a prefix state handoff against recompute and write the report.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    count = _bounded_int(0, 1 << 20)
    add = parser.add_argument
    add("--model", type=_absolute, required=True, action=_Once, help="GGUF file or package dir")
    add("--model-id", type=_model_id, required=True, action=_Once, help="the row's model id")
    add("--stage-server-bin", type=_absolute, required=True, action=_Once, help="(recorded)")
    add("--layer-end", type=_bounded_int(1, 1 << 16), required=True, action=_Once)
    add("--ctx-size", type=_bounded_int(2, 1 << 24), required=True, action=_Once)
    add("--n-gpu-layers", type=_bounded_int(-1, 1 << 16), required=True, action=_Once)
    add("--activation-width", type=_bounded_int(1, 1 << 24), required=True, action=_Once)
    add("--stage-load-mode", choices=LOAD_MODES, required=True, action=_Once)
    add("--state-layer-start", type=count, required=True, action=_Once)
    add("--state-layer-end", type=count, required=True, action=_Once)
    add("--state-stage-index", type=count, required=True, action=_Once)
    add("--state-payload-kind", choices=PAYLOADS, required=True, action=_Once)
    add(
        "--prefix-token-count",
        type=_bounded_int(1, MAX_PREFIX_TOKENS),
        required=True,
        action=_Once,
    )
    add("--cache-hit-repeats", type=_bounded_int(1, MAX_REPEATS), required=True, action=_Once)
    add("--runtime-lane-count", type=_bounded_int(1, 256), required=True, action=_Once)
    add("--source-bind-addr", type=_loopback, required=True, action=_Once, help="(recorded)")
    add("--restore-bind-addr", type=_loopback, required=True, action=_Once, help="(recorded)")
    add("--report-out", type=_absolute, required=True, action=_Once, help="report path")
    add("--borrow-resident-hits", action=_OnceFlag, help="(recorded)")
    add("--cache-decoded-result-hits", action=_OnceFlag, help="(recorded)")
    add("--prompt", action=_Once, help="benchmark prompt text (never printed)")
    return parser


def _known_words(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """The words as ``--flag=value``; refuses the first unknown flag or stray word first.

    Runs before argparse, which would report missing flags before an unknown one. Only whole
    flag names are known (no abbreviations); a value-taking flag takes the next word even
    when it starts with a dash (a prompt may).
    """
    out: list[str] = []
    takes_value = {
        option: action.nargs != 0 for action in parser._actions for option in action.option_strings
    }
    words = iter(enumerate(argv))
    for index, word in words:
        name = word.split("=", 1)[0]
        if name not in takes_value:
            what = "flag" if word.startswith("-") else "argument"
            _refuse_argv(f"unknown_{what}", f"$.argv[{index + 1}]", f"unknown {what} {word!r}")
        if takes_value[name] and "=" not in word:
            value = next(words, None)
            if value is None:
                _refuse_argv("missing_value", f"$.argv[{index + 1}]", f"{word} needs a value")
            word = f"{word}={value[1]}"
        out.append(word)
    return out


def parse_args(argv: Sequence[str]) -> HandoffArgs | None:
    """The validated arguments after the command word; None when help was printed."""
    parser = build_parser()
    args = list(argv)
    if not args:
        _refuse_argv("command", "$.argv[0]", f"no command; the only command is {COMMAND}")
    if args[0] in ("-h", "--help"):
        parser.print_help()
        return None
    if args[0] != COMMAND:
        _refuse_argv("command", "$.argv[0]", f"unknown command {args[0]!r}; use {COMMAND}")
    rest = args[1:]
    if "-h" in rest or "--help" in rest:
        parser.print_help()
        return None
    namespace = parser.parse_args(_known_words(parser, rest))
    parsed = HandoffArgs(
        model=namespace.model,
        model_id=namespace.model_id,
        stage_server_bin=namespace.stage_server_bin,
        layer_end=namespace.layer_end,
        ctx_size=namespace.ctx_size,
        n_gpu_layers=namespace.n_gpu_layers,
        activation_width=namespace.activation_width,
        load_mode=namespace.stage_load_mode,
        layer_start_state=namespace.state_layer_start,
        layer_end_state=namespace.state_layer_end,
        stage_index=namespace.state_stage_index,
        payload=namespace.state_payload_kind,
        prefix_tokens=namespace.prefix_token_count,
        repeats=namespace.cache_hit_repeats,
        lanes=namespace.runtime_lane_count,
        source_bind_addr=namespace.source_bind_addr,
        restore_bind_addr=namespace.restore_bind_addr,
        report_out=namespace.report_out,
        borrow_resident_hits=namespace.borrow_resident_hits,
        cache_decoded_result_hits=namespace.cache_decoded_result_hits,
        prompt=namespace.prompt,
    )
    return _checked(parsed)


def _checked(args: HandoffArgs) -> HandoffArgs:
    """Refuses what the flags cannot mean together, before anything is loaded."""
    refusals: list[Refusal] = []

    def refuse(code: str, flag: str, message: str, hint: str) -> None:
        refusals.append(Refusal(f"correctness.{code}", f"$.argv[{flag}]", message, hint))

    topology = topology_of(
        args.load_mode,
        args.layer_end,
        args.layer_start_state,
        args.layer_end_state,
        args.stage_index,
    )
    if topology is None:
        refuse(
            "range",
            "--state-layer-start",
            f"state range ({args.layer_start_state}, {args.layer_end_state}, stage "
            f"{args.stage_index}) is no {args.load_mode} topology of a {args.layer_end}-layer "
            "model",
            "use one-stage, split-stage0, split-middle or split-final (runtime-slice) or "
            "package-stage1 (layer-package) as --help computes them",
        )
    if args.prefix_tokens + 1 > args.ctx_size:
        refuse(
            "context",
            "--ctx-size",
            f"prefix {args.prefix_tokens} plus one suffix token does not fit ctx {args.ctx_size}",
            "raise --ctx-size or lower --prefix-token-count",
        )
    if args.prompt is not None and not args.prompt.strip():
        refuse("prompt", "--prompt", "the prompt is empty", "give a non-empty prompt")
    if args.prompt is not None and len(args.prompt.encode()) > PROMPT_TEXT_MAX_BYTES:
        refuse(
            "prompt",
            "--prompt",
            f"the prompt has more than {PROMPT_TEXT_MAX_BYTES} bytes",
            "give a shorter prompt",
        )
    if not args.stage_server_bin.is_file():
        refuse("stage_server", "--stage-server-bin", "is not a file", "name the stage server")
    if args.load_mode == "runtime-slice" and not args.model.is_file():
        refuse("model", "--model", f"{args.model} is not a file", "name the GGUF model file")
    if args.load_mode == "layer-package" and not (args.model / PACKAGE_MANIFEST).is_file():
        refuse(
            "model",
            "--model",
            f"{args.model} holds no {PACKAGE_MANIFEST}",
            "name the layer package directory",
        )
    if not args.report_out.parent.is_dir():
        refuse("report_out", "--report-out", "its directory does not exist", "create it first")
    elif args.report_out.exists() or args.report_out.is_symlink():
        refuse("report_out", "--report-out", "already exists", "give a fresh report path")
    if refusals:
        raise Refused(tuple(refusals))
    return dataclasses.replace(args, topology=topology or "")


def state_handoff(args: HandoffArgs) -> dict[str, Any]:
    """Run the handoff and write the report; returns it."""
    lib = llama_bindings.load(llama_bindings.library_dir())
    _quiet_logs(lib)
    lib.llama_backend_init()
    seen = Measured(threads=oracle_threads(os.environ))
    failure: str | None = None
    with tempfile.TemporaryDirectory(prefix="skippy-correctness-") as scratch:
        try:
            model_path = args.model
            if args.load_mode == "layer-package":
                model_path, layer_count = _join_package(args.model, Path(scratch))
                seen.package = {
                    "root": str(args.model.resolve()),
                    "manifest_sha256": sha256_file(args.model / PACKAGE_MANIFEST),
                    "layer_count": layer_count,
                    "loaded_as": "parts joined into one temporary GGUF",
                }
            run_handoff(args, lib, model_path, seen)
        except HandoffFailed as failed:
            failure = failed.reason
    report = _finite(build_report(args, seen, failure))
    write_report(args.report_out, report)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else list(argv)
    try:
        parsed = parse_args(arguments)
        if parsed is None:
            return ExitCode.OK
        report = state_handoff(parsed)
    except Refused as refused:
        for refusal in refused.refusals:
            print(f"refused: {refusal.line()}", file=sys.stderr)
        return ExitCode.REFUSED
    line = f"state-handoff: {report['status']}"
    if report["reason"]:
        line += f" ({report['reason']})"
    print(f"{line}; report {parsed.report_out}", flush=True)
    return ExitCode.OK if report["status"] == "pass" else ExitCode.NEGATIVE
