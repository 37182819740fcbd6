"""Helpers several test modules share (they were in test_operator_property.py)."""

from __future__ import annotations

import copy
import string
from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

from cache_family.errors import Refused, json_path
from cache_family.schemas.catalog import packaged_catalog
from cache_family.schemas.operator import (
    OperatorInput,
    PinnedFile,
    PlanInput,
    ServerBinary,
    ToolkitDirectory,
    secret_name_marker,
)
from cache_family.schemas.refusal_codes import OPERATOR_REFUSAL_CODES

KEYS = packaged_catalog().catalog.keys


HEX = "0123456789abcdef"


SECRET_VALUE = "pw-Zq7-never-shown"


TOOLKITS = ("CUDA_PATH", "HIP_PATH", "ROCM_PATH", "LLVMInstallDir", "VULKAN_SDK")


SECRET_MARKERS = ("AUTH", "TOKEN", "SECRET", "PASSWORD", "CREDENTIAL", "PATH", "DIR", "ROOT", "KEY")


Doc = dict[str, Any]


Loc = tuple[str | int, ...]


segments = st.text(string.ascii_letters + string.digits + "_-.", min_size=1, max_size=8).filter(
    lambda s: s not in (".", "..")
)


abs_paths = st.lists(segments, min_size=1, max_size=4).map(lambda parts: "/" + "/".join(parts))


sha256s = st.text(HEX, min_size=64, max_size=64)


commits = st.text(HEX, min_size=40, max_size=40) | sha256s


pins = st.fixed_dictionaries({"path": abs_paths, "sha256": sha256s})


keys = st.from_regex(r"[A-Za-z0-9_-]{1,16}", fullmatch=True).filter(lambda k: k != "all")


def _joined(items: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.lists(items, min_size=1, max_size=4).map(",".join)


ENV_VALUES: dict[str, st.SearchStrategy[str]] = {
    "CUDA_VISIBLE_DEVICES": _joined(st.integers(0, 15).map(str)),
    "HIP_VISIBLE_DEVICES": _joined(st.integers(0, 15).map(str)),
    "ROCR_VISIBLE_DEVICES": _joined(st.integers(0, 15).map(str)),
    "OMP_NUM_THREADS": st.integers(1, 1024).map(str),
    "BACKEND": st.sampled_from(["cpu", "cuda", "rocm", "hip", "vulkan", "metal", "sycl"]),
    "LINK_MODE": st.sampled_from(["static", "shared"]),
    "CUDA_ARCHITECTURES": st.sampled_from(["native", "all", "all-major"])
    | _joined(st.from_regex(r"[0-9]{2,3}[af]?(-real|-virtual)?", fullmatch=True)),
    "AMDGPU_TARGETS": _joined(st.from_regex(r"gfx[0-9a-f]{3,4}", fullmatch=True)),
    "GGML_NATIVE": st.sampled_from(["0", "1", "ON", "OFF"]),
}


ALIASES = {
    "BACKEND": ("LLAMA_STAGE_BACKEND", "SKIPPY_LLAMA_BACKEND"),
    "LINK_MODE": ("LLAMA_STAGE_LINK_MODE", "SKIPPY_LLAMA_LINK_MODE"),
    "CUDA_ARCHITECTURES": ("LLAMA_STAGE_CUDA_ARCHITECTURES", "SKIPPY_CUDA_ARCHITECTURES"),
    "AMDGPU_TARGETS": ("LLAMA_STAGE_AMDGPU_TARGETS", "SKIPPY_AMDGPU_TARGETS"),
    "GGML_NATIVE": ("LLAMA_STAGE_GGML_NATIVE", "SKIPPY_GGML_NATIVE"),
}


ggml_names = st.from_regex(r"GGML_[A-Z0-9_]{1,12}", fullmatch=True).filter(
    lambda n: secret_name_marker(n) is None
)


free_values = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cc", "Cs", "Cf")), min_size=1, max_size=40
)


@st.composite
def environments(draw: st.DrawFn) -> dict[str, str]:
    env: dict[str, str] = {}
    for setting in draw(st.lists(st.sampled_from(sorted(ENV_VALUES)), unique=True, max_size=5)):
        value = draw(ENV_VALUES[setting])
        if setting in ALIASES:
            # one name of the pair, or both with the same value
            for name in draw(st.sampled_from([ALIASES[setting][:1], ALIASES[setting][1:],
                                              ALIASES[setting]])):  # fmt: skip
                env[name] = value
        else:
            env[setting] = value
    for name in draw(st.lists(ggml_names, unique=True, max_size=3)):
        env[name] = draw(free_values)
    return env


def _maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.none() | strategy


@st.composite
def plans(draw: st.DrawFn) -> Doc:
    use_cases = draw(
        st.just([]) | st.just(["all"]) | st.lists(keys, min_size=1, max_size=5, unique=True)
    )
    servers = draw(st.none() | st.tuples(*[
        st.fixed_dictionaries({"path": abs_paths, "sha256": _maybe(sha256s)})] * 2))  # fmt: skip
    plan: Doc = {
        "schema_version": 1,
        "cache_root": draw(abs_paths),
        "cases": draw(st.lists(st.sampled_from(KEYS), unique=True, max_size=14)),
        "use_cases": use_cases,
        "corpus": draw(pins) if use_cases else None,
        "prefix_sweep": draw(st.lists(st.integers(1, 2**32 - 1), unique=True, max_size=32)),
        "prefix_tokens": draw(_maybe(st.integers(1, 4096))),
        "n_gpu_layers": draw(_maybe(st.integers(-1, 999))),
        "cache_hit_repeats": draw(_maybe(st.integers(1, 1024))),
        "runtime_lane_count": draw(_maybe(st.integers(1, 1024))),
        "serving_ctx_size": draw(_maybe(st.integers(1, 2**20))),
        "concurrency": sorted(
            draw(st.lists(st.integers(1, 1024), min_size=1, max_size=32, unique=True))
        ),
        "concurrent_requests": draw(st.integers(1, 65536)),
        "concurrent_output_tokens": draw(st.integers(1, 65536)),
        "llama_parallel": draw(st.integers(1, 1024)),
        "llama_repeats": draw(st.integers(1, 1024)),
        "ttft_slo_ms": draw(st.integers(1, 2**32 - 1)),
        "tpot_slo_ms": draw(st.integers(1, 2**32 - 1)),
        "skip_llama_server": draw(st.booleans()),
        "old_server": servers[0] if servers else None,
        "new_server": servers[1] if servers else None,
        "model_sha256": draw(st.dictionaries(st.sampled_from(KEYS), sha256s, max_size=14)),
    }
    catalog = draw(st.sampled_from(["absent", "null", "pinned"]))
    if catalog != "absent":
        plan["catalog"] = draw(pins) if catalog == "pinned" else None
    return plan


@st.composite
def operator_inputs(draw: st.DrawFn) -> Doc:
    doc: Doc = {
        "schema_version": 1,
        "plan": draw(plans()),
        "correctness": draw(abs_paths),
        "stage_server": draw(abs_paths),
        "native_server": draw(_maybe(abs_paths)),
        "artifact_tool": draw(_maybe(abs_paths)),
        "native_build": draw(abs_paths),
        "old_source_commit": draw(commits),
        "new_source_commit": draw(commits),
        "native_source_commit": draw(commits),
        "borrow_resident_hits": draw(st.booleans()),
        "cache_decoded_result_hits": draw(st.booleans()),
        "environment": draw(environments()),
        "toolkit_directories": {
            name: draw(pins) for name in draw(st.lists(st.sampled_from(TOOLKITS), unique=True))
        },
        "execution_seconds": draw(st.integers(30, 86400)),
        "cell_seconds": draw(st.integers(15, 3600)),
        "request_timeout_ms": draw(st.integers(1, 600000)),
        "preparation_seconds": draw(st.integers(30, 3600)),
    }
    for optional in ("borrow_resident_hits", "cache_decoded_result_hits", "environment",
                     "toolkit_directories"):  # fmt: skip
        if draw(st.booleans()):
            del doc[optional]
    return doc


Expected = tuple[str, str] | None


Mutation = Callable[[st.DrawFn, Doc], Expected]


def _path(loc: Loc) -> str:
    return json_path(loc)


def _node(doc: Doc, loc: Loc) -> Any:
    node: Any = doc
    for part in loc:
        node = node[part]
    return node


def _locations(doc: Doc) -> list[Loc]:
    """Every member and element of the document, outermost first."""
    out: list[Loc] = []
    stack: list[tuple[Any, Loc]] = [(doc, ())]
    while stack:
        node, loc = stack.pop(0)
        children = (
            list(node.items()) if isinstance(node, dict)
            else list(enumerate(node)) if isinstance(node, list) else []
        )  # fmt: skip
        for key, child in children:
            out.append((*loc, key))
            stack.append((child, (*loc, key)))
    return out


def _model_at(loc: Loc) -> type[Any] | None:
    """The model whose members live at ``loc`` (None for maps, lists and scalars)."""
    if loc == ():
        return OperatorInput
    if loc == ("plan",):
        return PlanInput
    if loc in (("plan", "corpus"), ("plan", "catalog")):
        return PinnedFile
    if loc in (("plan", "old_server"), ("plan", "new_server")):
        return ServerBinary
    if len(loc) == 2 and loc[0] == "toolkit_directories":
        return ToolkitDirectory
    return None


def drop_member(draw: st.DrawFn, doc: Doc) -> Expected:
    members = [loc for loc in _locations(doc) if isinstance(_node(doc, loc[:-1]), dict)]
    loc = draw(st.sampled_from(members))
    del _node(doc, loc[:-1])[loc[-1]]
    model = _model_at(loc[:-1])
    if model is not None and model.model_fields[str(loc[-1])].is_required():
        return "operator.missing_field", _path(loc)
    return None


def add_member(draw: st.DrawFn, doc: Doc) -> Expected:
    objects = [()] + [loc for loc in _locations(doc) if _model_at(loc) is not None]
    objects = [loc for loc in objects if isinstance(_node(doc, loc), dict)]
    loc = draw(st.sampled_from(objects))
    name = draw(st.text(min_size=1, max_size=12).filter(lambda n: n not in _node(doc, loc)))
    model = _model_at(loc)
    _node(doc, loc)[name] = draw(st.integers() | st.text(max_size=5))
    if model is not None and name not in model.model_fields:
        return "operator.unknown_field", _path((*loc, name))
    return None


def _kind(value: Any) -> str:
    return type(value).__name__


def retype_value(draw: st.DrawFn, doc: Doc) -> Expected:
    loc = draw(st.sampled_from(_locations(doc)))
    current = _node(doc, loc)
    others = [v for v in (None, True, 7, 1.5, "text", [], {}) if _kind(v) != _kind(current)]
    value = copy.deepcopy(draw(st.sampled_from(others)))
    _node(doc, loc[:-1])[loc[-1]] = value
    # A null can be allowed (nullable fields), and so can a value where a nullable field held
    # null (7 for a null prefix_tokens); any other retyping is refused at or below loc.
    return None if value is None or current is None else ("*", _path(loc))


BOUNDED = {
    ("execution_seconds",): (30, 86400, "operator.budget.out_of_range"),
    ("cell_seconds",): (15, 3600, "operator.budget.out_of_range"),
    ("request_timeout_ms",): (1, 600000, "operator.budget.out_of_range"),
    ("preparation_seconds",): (30, 3600, "operator.budget.out_of_range"),
    ("plan", "prefix_tokens"): (1, 2**32 - 1, "plan.out_of_range"),
    ("plan", "n_gpu_layers"): (-1, 2**31 - 1, "plan.out_of_range"),
    ("plan", "cache_hit_repeats"): (1, 1024, "plan.out_of_range"),
    ("plan", "runtime_lane_count"): (1, 1024, "plan.out_of_range"),
    ("plan", "serving_ctx_size"): (1, 2**32 - 1, "plan.out_of_range"),
    ("plan", "concurrent_requests"): (1, 65536, "plan.out_of_range"),
    ("plan", "concurrent_output_tokens"): (1, 65536, "plan.out_of_range"),
    ("plan", "llama_parallel"): (1, 1024, "plan.out_of_range"),
    ("plan", "llama_repeats"): (1, 1024, "plan.out_of_range"),
    ("plan", "ttft_slo_ms"): (1, 2**32 - 1, "plan.out_of_range"),
    ("plan", "tpot_slo_ms"): (1, 2**32 - 1, "plan.out_of_range"),
}


def out_of_range(draw: st.DrawFn, doc: Doc) -> Expected:
    loc = draw(st.sampled_from(sorted(BOUNDED)))
    low, high, code = BOUNDED[loc]
    value = draw(st.integers(max_value=low - 1) | st.integers(min_value=high + 1))
    _node(doc, loc[:-1])[loc[-1]] = value
    return code, _path(loc)


BAD_PATHS = [
    ("relative/tool", "operator.path.not_absolute"),
    ("", "operator.path.not_absolute"),
    ("/a/../b", "operator.path.not_normalized"),
    ("/a/", "operator.path.not_normalized"),
    ("//a", "operator.path.not_normalized"),
    ("/a/\x00b", "operator.path.bad_char"),
    ("/" + "x" * 5000, "operator.path.too_long"),
]


PATH_FIELDS = [("correctness",), ("stage_server",), ("native_server",), ("artifact_tool",),
               ("native_build",), ("plan", "cache_root")]  # fmt: skip


def bad_path(draw: st.DrawFn, doc: Doc) -> Expected:
    loc = draw(st.sampled_from(PATH_FIELDS))
    value, code = draw(st.sampled_from(BAD_PATHS))
    _node(doc, loc[:-1])[loc[-1]] = value
    return code, _path(loc)


def secret_env_name(draw: st.DrawFn, doc: Doc) -> Expected:
    marker = draw(st.sampled_from(SECRET_MARKERS))
    name = (
        draw(st.sampled_from(["", "GGML_", "HF_", "SKIPPY_"]))
        + marker
        + draw(st.sampled_from(["", "_X", "S"]))
    )
    doc.setdefault("environment", {})[name] = SECRET_VALUE
    return "operator.environment.secret_name", _path(("environment", name))


def secret_env_abbreviation(draw: st.DrawFn, doc: Doc) -> Expected:
    word = draw(st.sampled_from(["PWD", "PASSWD", "PASS", "TOK", "CREDS", "COOKIE", "CERT"]))
    name = draw(st.sampled_from(["GGML_", "GGML_DB_", "GGML_HF_"])) + word
    name += draw(st.sampled_from(["", "_X", "2"]))
    doc.setdefault("environment", {})[name] = SECRET_VALUE
    return "operator.environment.secret_name", _path(("environment", name))


def reorder_ladder(draw: st.DrawFn, doc: Doc) -> Expected:
    ladder = doc["plan"]["concurrency"]
    if len(ladder) < 2:
        ladder.append(ladder[0])
        return "plan.concurrency.duplicate", "$.plan.concurrency"
    shuffled = draw(st.permutations(ladder).filter(lambda p: list(p) != sorted(p)))
    doc["plan"]["concurrency"] = list(shuffled)
    return "plan.concurrency.not_ascending", "$.plan.concurrency"


def bad_commit(draw: st.DrawFn, doc: Doc) -> Expected:
    name = draw(st.sampled_from(["old_source_commit", "new_source_commit",
                                 "native_source_commit"]))  # fmt: skip
    doc[name] = draw(st.text(HEX + "ABCDEFg", max_size=70).filter(
        lambda c: len(c) not in (40, 64) or any(ch not in HEX for ch in c)))  # fmt: skip
    return "operator.commit.bad_hex", _path((name,))


def unknown_case(draw: st.DrawFn, doc: Doc) -> Expected:
    case = draw(keys.filter(lambda k: k not in KEYS))
    doc["plan"]["cases"].append(case)
    if doc["plan"].get("catalog") is not None:
        return None  # an own catalog's keys are checked by preparation, against that catalog
    return "plan.case.unknown", _path(("plan", "cases", len(doc["plan"]["cases"]) - 1))


def one_sided_servers(draw: st.DrawFn, doc: Doc) -> Expected:
    plan = doc["plan"]
    side = draw(st.sampled_from(["old_server", "new_server"]))
    if plan[side] is None:
        plan[side] = {"path": "/opt/skippy", "sha256": None}
        other = "new_server" if side == "old_server" else "old_server"
        return "plan.servers.one_sided", _path(("plan", other))
    plan[side] = None
    return "plan.servers.one_sided", _path(("plan", side))


def bad_env_value(draw: st.DrawFn, doc: Doc) -> Expected:
    # Values are free-form; a control or invisible format character is what is refused.
    name = draw(st.sampled_from(["OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "GGML_SCHED"]))
    bad = draw(st.sampled_from(["\n", "\x00", "\u202e", "\u200b", "\x1b[2J"]))
    doc.setdefault("environment", {})[name] = "bogus " + SECRET_VALUE + bad
    return "operator.environment.bad_value", _path(("environment", name))


MUTATIONS: list[Mutation] = [
    drop_member, add_member, retype_value, out_of_range, bad_path, secret_env_name,
    reorder_ladder, bad_commit, unknown_case, one_sided_servers, bad_env_value,
    secret_env_abbreviation,
]  # fmt: skip


def assert_well_formed(refused: Refused) -> None:
    assert refused.refusals
    for refusal in refused.refusals:
        assert refusal.code in OPERATOR_REFUSAL_CODES, refusal.code
        assert refusal.path.startswith("$")
        for text in (refusal.code, refusal.path, refusal.message, refusal.hint):
            assert isinstance(text, str) and text and "\n" not in text
        assert SECRET_VALUE not in refusal.message + refusal.hint + refusal.path
