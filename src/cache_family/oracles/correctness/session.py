"""The handoff on llama.cpp: one loaded model, its contexts, and the timed state handoff.

Runs in this process on the native build's ``libllama`` through the low-level
``llama-cpp-python`` bindings (``oracles/llama_bindings.py``); what it observes is
:class:`Measured`, which ``report.py`` turns into the report.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np

from cache_family.errors import Refused
from cache_family.oracles import package_builder
from cache_family.states.handoff import PROMPT_TEXT_MAX_BYTES, LoadMode, Payload

#: Test-only fault injection: when this variable is "1", the exported kv-recurrent bytes are
#: altered before every import, so the token or logits check must fail.
FAULT_ENV: Final = "CACHE_FAMILY_FAULT_ALTER_STATE_BYTES"
#: Untimed hits before the R timed ones: a context's first decode of a new batch shape
#: allocates (measured 200 ms against 0.7 ms afterwards on the zoo's qwen3next).
WARMUP_HITS: Final = 1
PACKAGE_MANIFEST: Final = "model-package.json"
#: The shared environment's thread count: the stage servers and llama-server get the same.
THREADS_ENV: Final = "OMP_NUM_THREADS"
#: Without a thread count every context runs on one thread, so a hit's timing does not depend
#: on how busy the machine is (with up to four threads: 421 ms per hit decode on a loaded
#: machine, 0.4 ms on an idle one, for the same call).
DEFAULT_THREADS: Final = 1
_CUT_SEARCH_CHARS: Final = 64
_GGML_LOG_LEVEL_ERROR: Final = 4

DEFAULT_PROMPT: Final = (
    "A cache keeps the work a model has already done on a prompt so that the next request "
    "with the same beginning can skip it. The benchmark hands the saved state of a prefix "
    "from one place to another, restores it, and decodes the next token, then checks that "
    "the answer is exactly the one a full recomputation gives. Every number is measured on "
    "the machine that runs it, and every failure is written down instead of hidden. "
)


@dataclass(frozen=True, slots=True)
class Threads:
    """How many threads each llama.cpp context runs on, and where that number came from."""

    count: int = DEFAULT_THREADS
    source: str = "default"  # default | OMP_NUM_THREADS


def oracle_threads(environ: Mapping[str, str]) -> Threads:
    """``OMP_NUM_THREADS`` when it is a positive whole number, else one thread."""
    value = environ.get(THREADS_ENV, "")
    if value.isdigit() and int(value) > 0:
        return Threads(int(value), THREADS_ENV)
    return Threads()


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

    def __init__(
        self, lib: Any, model_path: Path, n_gpu_layers: int, threads: int = DEFAULT_THREADS
    ) -> None:
        self.lib = lib
        self.threads = threads
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
        params.n_threads = self.threads
        params.n_threads_batch = self.threads
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
def _session(lib: Any, model_path: Path, n_gpu_layers: int, threads: int) -> Iterator[Session]:
    session = Session(lib, model_path, n_gpu_layers, threads)
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
    threads: Threads = field(default_factory=Threads)


def _max_diff(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> float:
    diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return float(np.max(diff)) if np.all(np.isfinite(diff)) else float("inf")


def run_handoff(args: HandoffArgs, lib: Any, model_path: Path, seen: Measured) -> None:
    """Measure into ``seen``; raises :class:`HandoffFailed` with the reason of a failed run."""
    with _session(lib, model_path, args.n_gpu_layers, seen.threads.count) as session:
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
