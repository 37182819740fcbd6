"""``skippy-correctness state-handoff``: the reference correctness oracle, on llama.cpp.

Honours the reference tool's command line and writes its ``state-handoff.json`` report. The
handoff runs in this process on the native build's ``libllama`` through the low-level
``llama-cpp-python`` bindings (``oracles/llama_bindings.py``). ``--help`` says what is measured,
the tolerance and where this oracle differs from a split-stage runtime.

Entry point: ``python -m cache_family.oracles.correctness state-handoff FLAGS...``. Exit status
0: report written, status pass; 1: report written, status fail; 2: refused (bad command line,
unusable paths), nothing written.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, NoReturn

import numpy as np

from cache_family.errors import Refusal, Refused
from cache_family.oracles import llama_bindings, native_build, package_builder
from cache_family.states.handoff import (
    LOAD_MODES,
    MODE,
    PAYLOADS,
    PROMPT_TEXT_MAX_BYTES,
    LoadMode,
    Payload,
    topology_of,
)
from cache_family.states.plans import thread_setting
from cache_family.system.hashing import sha256_file
from cache_family.system.publish import publish_fresh

COMMAND: Final = "state-handoff"
#: Test-only fault injection: when this variable is "1", the exported kv-recurrent bytes are
#: altered before every import, so the token or logits check must fail.
FAULT_ENV: Final = "CACHE_FAMILY_FAULT_ALTER_STATE_BYTES"
#: A hit's logits against an uninterrupted decode with the same batch split (K tokens, then
#: the suffix): the handoff is exact, so only float noise is allowed (measured: 0.0).
HIT_LOGITS_TOLERANCE: Final = 1e-5
MAX_REPEATS: Final = 10_000
#: Untimed hits before the R timed ones: a context's first decode of a new batch shape
#: allocates (measured 200 ms against 0.7 ms afterwards on the zoo's qwen3next).
WARMUP_HITS: Final = 1
MAX_PREFIX_TOKENS: Final = 1_000_000
EVIDENCE: Final = "reference-oracle"
PACKAGE_MANIFEST: Final = "model-package.json"
_CUT_SEARCH_CHARS: Final = 64
_GGML_LOG_LEVEL_ERROR: Final = 4

DEFAULT_PROMPT: Final = (
    "A cache keeps the work a model has already done on a prompt so that the next request "
    "with the same beginning can skip it. The benchmark hands the saved state of a prefix "
    "from one place to another, restores it, and decodes the next token, then checks that "
    "the answer is exactly the one a full recomputation gives. Every number is measured on "
    "the machine that runs it, and every failure is written down instead of hidden. "
)

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
  LLAMA_STAGE_BUILD_DIR/lib, else LLAMA_CPP_LIB_PATH: the directory of libllama.so.
  {FAULT_ENV}=1: FAULT INJECTION, tests only: alters the exported kv-recurrent bytes
  before each import (no effect on resident-kv, which imports no bytes).

exit status: 0 pass, 1 fail (report written), 2 refused (nothing written).
"""


# --- the command line ------------------------------------------------------------------------


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


@dataclass(frozen=True, slots=True)
class HandoffArgs:
    """The validated command line."""

    model: Path
    model_id: str
    stage_server_bin: Path
    layer_end: int
    ctx_size: int
    n_gpu_layers: int
    activation_width: int
    load_mode: LoadMode
    layer_start_state: int
    layer_end_state: int
    stage_index: int
    payload: Payload
    prefix_tokens: int
    repeats: int
    lanes: int
    source_bind_addr: str
    restore_bind_addr: str
    report_out: Path
    borrow_resident_hits: bool
    cache_decoded_result_hits: bool
    prompt: str | None
    topology: str = field(default="")


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


# --- layer packages -----------------------------------------------------------------------


def _join_package(package: Path, into: Path) -> tuple[Path, int]:
    """The package builder's own assembly of every layer into one GGUF (llama.cpp loads no
    layer package); each part is verified against the manifest first. Returns the joined
    model and the package's layer count; any bad part is refused, never a traceback."""

    def refused(message: str, hint: str) -> Refused:
        return Refused.one("correctness.package", "$.argv[--model]", message, hint)

    try:
        manifest, _ = package_builder.read_package_manifest(package)
        joined = package_builder.assemble_package(package, into / "package-joined.gguf")
    except Refused as bad:
        raise refused(
            "; ".join(r.message for r in bad.refusals),
            "pass a schema-1 layer package written by skippy-package-builder write-package",
        ) from None
    except (ValueError, OSError, KeyError) as error:
        raise refused(
            f"a part of the package is not a readable GGUF: {error!r}",
            "rewrite the package with skippy-package-builder write-package",
        ) from None
    return joined, manifest.layer_count


# --- the handoff on llama.cpp ---------------------------------------------------------------


class HandoffFailed(Exception):
    """The run reached a verdict of fail for a stated reason (the report is still written)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class Decoded:
    token: int
    logits: np.ndarray[Any, np.dtype[np.float32]]


def _ms(start_ns: int, end_ns: int) -> float:
    return (end_ns - start_ns) / 1e6


_LOG_SINK: list[Any] = []


def _quiet_logs(lib: Any) -> None:
    """Route llama.cpp's log to stderr, errors only (its info lines are thousands per load)."""
    if _LOG_SINK:
        return

    def sink(level: int, text: bytes | None, _user: object) -> None:
        if level == _GGML_LOG_LEVEL_ERROR and text:
            sys.stderr.write(text.decode(errors="replace"))

    callback = lib.llama_log_callback(sink)
    _LOG_SINK.append(callback)  # ctypes calls it later: keep it alive
    lib.llama_log_set(callback, ctypes.c_void_p())


class Session:
    """One loaded model and the contexts of one handoff run."""

    def __init__(self, lib: Any, model_path: Path, n_gpu_layers: int) -> None:
        self.lib = lib
        params = lib.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        self.model = lib.llama_model_load_from_file(str(model_path).encode(), params)
        if not self.model:
            raise HandoffFailed(f"model.load_failed: llama.cpp could not load {model_path}")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = int(lib.llama_vocab_n_tokens(self.vocab))
        self.contexts: list[Any] = []

    def close(self) -> None:
        for ctx in self.contexts:
            self.lib.llama_free(ctx)
        self.contexts.clear()
        if self.model:
            self.lib.llama_model_free(self.model)
            self.model = None

    # model facts
    def n_layer(self) -> int:
        return int(self.lib.llama_model_n_layer(self.model))

    def n_embd(self) -> int:
        return int(self.lib.llama_model_n_embd(self.model))

    def recurrent(self) -> bool:
        return bool(self.lib.llama_model_is_recurrent(self.model))

    def hybrid(self) -> bool:
        return bool(self.lib.llama_model_is_hybrid(self.model))

    def meta(self, key: str) -> str | None:
        buffer = ctypes.create_string_buffer(1024)
        n = self.lib.llama_model_meta_val_str(self.model, key.encode(), buffer, len(buffer))
        return None if n < 0 else buffer.value.decode(errors="replace")

    # text
    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        capacity = len(data) + 8
        while True:
            out = (self.lib.llama_token * capacity)()
            n = self.lib.llama_tokenize(self.vocab, data, len(data), out, capacity, True, False)
            if n >= 0:
                return list(out[:n])
            capacity = -n

    def detokenize(self, tokens: Sequence[int]) -> str:
        array = (self.lib.llama_token * len(tokens))(*tokens)
        capacity = 16 * len(tokens) + 16
        while True:
            out = ctypes.create_string_buffer(capacity)
            n = self.lib.llama_detokenize(
                self.vocab, array, len(tokens), out, capacity, True, False
            )
            if n >= 0:
                return out.raw[:n].decode("utf-8", errors="replace")
            capacity = -n

    # contexts
    def context(self, n_ctx: int, n_batch: int, n_seq_max: int) -> Any:
        params = self.lib.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_batch
        params.n_seq_max = n_seq_max
        # The operator's thread count, as llama-server gets it (-t); else up to 4 cores.
        setting = thread_setting(os.environ)
        threads = int(setting) if setting else max(1, min(4, len(os.sched_getaffinity(0))))
        params.n_threads = threads
        params.n_threads_batch = threads
        params.kv_unified = True
        params.swa_full = True
        params.no_perf = True
        ctx = self.lib.llama_init_from_model(self.model, params)
        if not ctx:
            raise HandoffFailed(f"context.init_failed: no context of {n_ctx} tokens")
        self.contexts.append(ctx)
        return ctx

    def memory(self, ctx: Any) -> Any:
        return self.lib.llama_get_memory(ctx)

    def decode(self, ctx: Any, tokens: Sequence[int], first_pos: int, seq: int) -> Decoded:
        """Decode ``tokens`` at positions from ``first_pos`` in ``seq``; the last token's output."""
        lib = self.lib
        batch = lib.llama_batch_init(len(tokens), 0, 1)
        try:
            for i, token in enumerate(tokens):
                batch.token[i] = token
                batch.pos[i] = first_pos + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = 1 if i == len(tokens) - 1 else 0
            batch.n_tokens = len(tokens)
            status = lib.llama_decode(ctx, batch)
        finally:
            lib.llama_batch_free(batch)
        if status != 0:
            raise HandoffFailed(f"decode.failed: llama_decode returned {status}")
        pointer = lib.llama_get_logits_ith(ctx, -1)
        if not pointer:
            raise HandoffFailed("decode.no_logits: llama.cpp returned no logits")
        logits = np.ctypeslib.as_array(pointer, shape=(self.n_vocab,)).astype(np.float32)
        return Decoded(token=int(np.argmax(logits)), logits=logits)

    def state_size(self, ctx: Any, seq: int, flags: int = 0) -> int:
        return int(self.lib.llama_state_seq_get_size_ext(ctx, seq, flags))

    def export_state(self, ctx: Any, seq: int) -> bytes:
        size = int(self.lib.llama_state_seq_get_size(ctx, seq))
        buffer = (ctypes.c_uint8 * size)()
        written = int(self.lib.llama_state_seq_get_data(ctx, buffer, size, seq))
        if written <= 0:
            raise HandoffFailed("state.export_failed: llama_state_seq_get_data wrote nothing")
        return bytes(buffer)[:written]

    def import_state(self, ctx: Any, payload: bytes, seq: int) -> None:
        buffer = (ctypes.c_uint8 * len(payload)).from_buffer_copy(payload)
        if int(self.lib.llama_state_seq_set_data(ctx, buffer, len(payload), seq)) == 0:
            raise HandoffFailed("state.import_failed: llama_state_seq_set_data refused the bytes")


@contextmanager
def _session(lib: Any, model_path: Path, n_gpu_layers: int) -> Iterator[Session]:
    session = Session(lib, model_path, n_gpu_layers)
    try:
        yield session
    finally:
        session.close()


def alter_state_bytes(payload: bytes) -> bytes:
    """FAULT INJECTION (tests only): invert the tail of the state, which is tensor data.

    Both the KV and the recurrent state end with the last layer's tensor rows, so the tail
    sixteenth is payload, not the sequence metadata ``llama_state_seq_set_data`` checks.
    """
    span = max(1, len(payload) // 16)
    tail = bytes(b ^ 0xFF for b in payload[-span:])
    return payload[:-span] + tail


@dataclass(frozen=True, slots=True)
class Benchmark:
    text: str
    tokens: list[int]
    prompt_token_count: int


def benchmark_prompt(session: Session, prompt: str | None, prefix_tokens: int) -> Benchmark:
    """The text whose own tokenization is exactly K+1 tokens, cut from the start of the prompt.

    A short prompt is repeated. The cut is the detokenized first K+1 tokens when that text
    tokenizes back to K+1 tokens; otherwise the nearest character cut that does.
    """
    want = prefix_tokens + 1
    base = prompt if prompt is not None else DEFAULT_PROMPT
    text = base
    tokens = session.tokenize(text)
    while len(tokens) < want and len(text.encode()) < PROMPT_TEXT_MAX_BYTES:
        text = f"{text} {base}" if prompt is not None else text + base
        tokens = session.tokenize(text)
    if len(tokens) < want:
        raise HandoffFailed(
            f"prompt.too_short: the prompt gives {len(tokens)} tokens within "
            f"{PROMPT_TEXT_MAX_BYTES} bytes, fewer than prefix + 1 = {want}"
        )
    candidate = session.detokenize(tokens[:want])
    if len(candidate.encode()) > PROMPT_TEXT_MAX_BYTES:
        raise HandoffFailed(
            f"prompt.too_long: {want} tokens take more than the report's "
            f"{PROMPT_TEXT_MAX_BYTES}-byte benchmark prompt text"
        )
    if candidate and session.tokenize(candidate) == tokens[:want]:
        return Benchmark(candidate, tokens[:want], len(tokens))
    # nearest character cut around the detokenized length whose tokenization has K+1 tokens
    centre = min(len(candidate), len(text))
    for delta in range(_CUT_SEARCH_CHARS + 1):
        for cut in (centre - delta, centre + delta):
            if 0 < cut <= len(text):
                again = session.tokenize(text[:cut])
                if len(again) == want and len(text[:cut].encode()) <= PROMPT_TEXT_MAX_BYTES:
                    return Benchmark(text[:cut], again, len(tokens))
    raise HandoffFailed(
        f"prompt.no_exact_cut: no cut of the prompt tokenizes to exactly {want} tokens"
    )


@dataclass
class Measured:
    """What a run observed; becomes the report."""

    benchmark: Benchmark | None = None
    baseline_token: int | None = None
    recompute_ms: list[float] = field(default_factory=list)
    recompute_tokens: list[int] = field(default_factory=list)
    import_ms: list[float] = field(default_factory=list)
    decode_ms: list[float] = field(default_factory=list)
    hit_tokens: list[int] = field(default_factory=list)
    baseline_diffs: list[float] = field(default_factory=list)
    split_diffs: list[float] = field(default_factory=list)
    split_token: int | None = None
    state_bytes: int = 0
    resident_state_bytes: int = 0
    kv_bytes: int = 0
    recurrent_bytes: int = 0
    payload_sha256: str | None = None
    export_ms: float | None = None
    model_facts: dict[str, Any] = field(default_factory=dict)
    fault_injection: str | None = None
    package: dict[str, Any] | None = None


def _max_diff(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> float:
    diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return float(np.max(diff)) if np.all(np.isfinite(diff)) else float("inf")


def run_handoff(args: HandoffArgs, lib: Any, model_path: Path, seen: Measured) -> None:
    """Measure into ``seen``; raises :class:`HandoffFailed` with the reason of a failed run."""
    with _session(lib, model_path, args.n_gpu_layers) as session:
        recurrent, hybrid = session.recurrent(), session.hybrid()
        seen.model_facts = {
            "architecture": session.meta("general.architecture"),
            "n_layer": session.n_layer(),
            "n_embd": session.n_embd(),
            "n_vocab": session.n_vocab,
            "recurrent": recurrent,
            "hybrid": hybrid,
        }
        if session.n_layer() != args.layer_end:
            raise HandoffFailed(
                f"layer_end.mismatch: the model has {session.n_layer()} layers, "
                f"--layer-end says {args.layer_end}"
            )
        if session.n_embd() != args.activation_width:
            raise HandoffFailed(
                f"activation_width.mismatch: the model's width is {session.n_embd()}, "
                f"--activation-width says {args.activation_width}"
            )
        if args.payload == "resident-kv" and (recurrent or hybrid):
            kind = "hybrid (attention + recurrent)" if hybrid else "recurrent"
            raise HandoffFailed(
                f"payload.unsupported: resident-kv keeps only attention KV resident, but this "
                f"{kind} model's prefix state includes recurrent state that a sequence copy "
                "does not hand off; use kv-recurrent"
            )
        benchmark = benchmark_prompt(session, args.prompt, args.prefix_tokens)
        seen.benchmark = benchmark
        prefix, suffix = benchmark.tokens[:-1], benchmark.tokens[-1:]
        k = len(prefix)
        n_batch = k + 1
        seq_slots = 2 if args.payload == "resident-kv" else 1
        source = session.context(args.ctx_size, n_batch, seq_slots)
        source_mem = session.memory(source)

        # recompute baseline: an untimed reference run, then R timed recomputes
        lib.llama_memory_clear(source_mem, True)
        baseline = session.decode(source, benchmark.tokens, 0, 0)
        seen.baseline_token = baseline.token
        for _ in range(args.repeats):
            lib.llama_memory_clear(source_mem, True)
            started = time.perf_counter_ns()
            again = session.decode(source, benchmark.tokens, 0, 0)
            seen.recompute_ms.append(_ms(started, time.perf_counter_ns()))
            seen.recompute_tokens.append(again.token)

        # the same split without a handoff: K tokens, then the suffix
        lib.llama_memory_clear(source_mem, True)
        session.decode(source, prefix, 0, 0)
        split = session.decode(source, suffix, k, 0)
        seen.split_token = split.token

        # the prefix state every hit restores
        lib.llama_memory_clear(source_mem, True)
        session.decode(source, prefix, 0, 0)
        seen.resident_state_bytes = session.state_size(source, 0)
        partial = session.state_size(source, 0, lib.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
        if recurrent:
            seen.recurrent_bytes = seen.resident_state_bytes
        elif hybrid:
            seen.recurrent_bytes = partial
        seen.kv_bytes = seen.resident_state_bytes - seen.recurrent_bytes

        def record(hit: Decoded) -> None:
            seen.hit_tokens.append(hit.token)
            seen.baseline_diffs.append(_max_diff(hit.logits, baseline.logits))
            seen.split_diffs.append(_max_diff(hit.logits, split.logits))

        if args.payload == "resident-kv":
            seen.state_bytes = seen.resident_state_bytes
            if os.environ.get(FAULT_ENV) == "1":
                seen.fault_injection = "not-applicable: resident-kv imports no bytes"
            for repeat in range(WARMUP_HITS + args.repeats):
                lib.llama_memory_seq_rm(source_mem, 1, -1, -1)
                started = time.perf_counter_ns()
                lib.llama_memory_seq_cp(source_mem, 0, 1, -1, -1)
                imported = time.perf_counter_ns()
                hit = session.decode(source, suffix, k, 1)
                decoded = time.perf_counter_ns()
                if repeat >= WARMUP_HITS:
                    seen.import_ms.append(_ms(started, imported))
                    seen.decode_ms.append(_ms(imported, decoded))
                    record(hit)
            return

        started = time.perf_counter_ns()
        payload = session.export_state(source, 0)
        seen.export_ms = _ms(started, time.perf_counter_ns())
        if os.environ.get(FAULT_ENV) == "1":
            payload = alter_state_bytes(payload)
            seen.fault_injection = "altered: tail sixteenth of the exported bytes inverted"
        seen.state_bytes = len(payload)
        seen.payload_sha256 = hashlib.sha256(payload).hexdigest()
        restore = session.context(args.ctx_size, n_batch, 1)
        restore_mem = session.memory(restore)
        for repeat in range(WARMUP_HITS + args.repeats):
            lib.llama_memory_clear(restore_mem, True)
            started = time.perf_counter_ns()
            session.import_state(restore, payload, 0)
            imported = time.perf_counter_ns()
            hit = session.decode(restore, suffix, k, 0)
            decoded = time.perf_counter_ns()
            if repeat >= WARMUP_HITS:
                seen.import_ms.append(_ms(started, imported))
                seen.decode_ms.append(_ms(imported, decoded))
                record(hit)


# --- the report -----------------------------------------------------------------------------


def _mean(values: Sequence[float]) -> float:
    total = 0.0
    for value in values:
        total += value
    return total / len(values) if values else 0.0


def build_report(args: HandoffArgs, seen: Measured, failure: str | None) -> dict[str, Any]:
    """The report, in the reference's members plus informative extras."""
    repeats_done = len(seen.hit_tokens)
    # A hit is judged against what the same computation gives without a handoff (the K-token
    # prefix, then the suffix); whether that split decode also picks the one-batch recompute's
    # token is the suffix-prefill capability, reported apart: on a tiny random model a near tie
    # between two logits can flip it with no cache involved.
    token_ok = (
        repeats_done == args.repeats
        and seen.split_token is not None
        and all(t == seen.split_token for t in seen.hit_tokens)
    )
    done = repeats_done == args.repeats
    logits_ok = done and all(d <= HIT_LOGITS_TOLERANCE for d in seen.split_diffs)
    split_ok = seen.split_token is not None and seen.split_token == seen.baseline_token
    recompute_ok = bool(seen.recompute_tokens) and all(
        t == seen.baseline_token for t in seen.recompute_tokens
    )
    matches = token_ok and logits_ok and recompute_ok
    reason = failure
    if reason is None and not matches:
        broken = [
            name
            for name, ok in (
                ("predicted_token", token_ok),
                ("cache_hit_logits", logits_ok),
                ("recompute_token", recompute_ok),
            )
            if not ok
        ]
        reason = f"mismatch: the {', '.join(broken)} check failed"
    pairs = [i + d for i, d in zip(seen.import_ms, seen.decode_ms, strict=True)]
    benchmark = seen.benchmark
    pin = native_build.source_pin()
    report: dict[str, Any] = {
        "mode": MODE,
        "status": "pass" if reason is None else "fail",
        "reason": reason,
        "matches": matches,
        "predicted_token_matches": token_ok,
        "cache_hit_matches": logits_ok,
        "suffix_prefill_matches": split_ok,
        "model_identity": {
            "model_id": args.model_id,
            "model_path": str(args.model),
            "load_mode": args.load_mode,
            **seen.model_facts,
        },
        "state_payload_kind": args.payload,
        "topology": args.topology,
        "stage_index": args.stage_index,
        "layer_start": args.layer_start_state,
        "layer_end": args.layer_end_state,
        "model_layer_end": args.layer_end,
        "state_scope": "all-layers",
        "requested_prefix_token_count": args.prefix_tokens,
        "benchmark_prompt_token_count": len(benchmark.tokens) if benchmark else 0,
        "prompt_token_count": benchmark.prompt_token_count if benchmark else 0,
        "benchmark_prompt_text": benchmark.text if benchmark else "",
        "activation_width": args.activation_width,
        "cache_hit_repeats": args.repeats,
        "cache_hit_import_ms": seen.import_ms,
        "cache_hit_decode_ms": seen.decode_ms,
        "cache_hit_total_ms": _mean(pairs),
        "recompute_total_ms": _mean(seen.recompute_ms),
        "recompute_ms": seen.recompute_ms,
        "baseline_token": seen.baseline_token,
        "cache_hit_tokens": seen.hit_tokens,
        "cache_hit_logits_max_abs_diff": seen.split_diffs,
        "recompute_logits_max_abs_diff": seen.baseline_diffs,
        "cache_hit_logits_tolerance": HIT_LOGITS_TOLERANCE,
        "suffix_prefill_token": seen.split_token,
        "state_bytes": seen.state_bytes,
        "cache_storage_bytes": seen.state_bytes,
        "resident_state_bytes": seen.resident_state_bytes,
        "payload_digest": {"kv_bytes": seen.kv_bytes, "recurrent_bytes": seen.recurrent_bytes},
        "payload_sha256": seen.payload_sha256,
        "state_export_ms": seen.export_ms,
        "borrowed_resident_hits": repeats_done if args.payload == "resident-kv" else 0,
        "native_seq_remapped": args.payload == "resident-kv",
        "source_native_seq_id": 0,
        "restore_native_seq_id": 1 if args.payload == "resident-kv" else 0,
        "options": {
            "borrow_resident_hits": args.borrow_resident_hits,
            "cache_decoded_result_hits": args.cache_decoded_result_hits,
            "runtime_lane_count": args.lanes,
            "n_gpu_layers": args.n_gpu_layers,
            "ctx_size": args.ctx_size,
            "stage_server_bin": str(args.stage_server_bin),
            "source_bind_addr": args.source_bind_addr,
            "restore_bind_addr": args.restore_bind_addr,
        },
        "fault_injection": seen.fault_injection,
        "package": seen.package,
        "evidence": EVIDENCE,
        "oracle": {
            "implementation": "cache-family-bench reference oracle, in-process llama.cpp",
            "llama_cpp_commit": pin.llama_cpp_commit,
            "bindings": llama_bindings.requirement(),
        },
    }
    return report


def write_report(path: Path, report: dict[str, Any]) -> None:
    """Publish the report atomically at a fresh path (a reader never sees half of it)."""
    publish_fresh(str(path), (json.dumps(report, indent=2, allow_nan=False) + "\n").encode())


def _finite(report: dict[str, Any]) -> dict[str, Any]:
    """JSON has no infinity: a diverged logits difference is reported as null."""
    for member in ("cache_hit_logits_max_abs_diff", "recompute_logits_max_abs_diff"):
        report[member] = [d if np.isfinite(d) else None for d in report[member]]
    return report


def state_handoff(args: HandoffArgs) -> dict[str, Any]:
    """Run the handoff and write the report; returns it."""
    lib = llama_bindings.load(llama_bindings.library_dir())
    _quiet_logs(lib)
    lib.llama_backend_init()
    seen = Measured()
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
            return 0
        report = state_handoff(parsed)
    except Refused as refused:
        for refusal in refused.refusals:
            print(f"refused: {refusal.line()}", file=sys.stderr)
        return 2
    line = f"state-handoff: {report['status']}"
    if report["reason"]:
        line += f" ({report['reason']})"
    print(f"{line}; report {parsed.report_out}", flush=True)
    return 0 if report["status"] == "pass" else 1


if __name__ == "__main__":
    raise SystemExit(main())
