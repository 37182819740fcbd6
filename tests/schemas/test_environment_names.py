"""Environment names and values: secret-looking names refused by pattern wherever they
appear; values free-form (no control characters), as real GPU hosts need them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from operator_documents import valid_document

from cache_family.errors import Refused
from cache_family.schemas.operator import (
    secret_name_marker,
    validate_operator_object,
)
from cache_family.schemas.prepared import read_prepared_input

# Names seen in real environments (CI systems, cloud SDKs, databases, hubs) and the
# abbreviations an operator might invent; every one must be refused as a secret.
SECRET_NAMES = [
    "GGML_PASSWD",
    "GGML_DB_PWD",
    "GGML_AWS_CREDS",
    "GGML_HF_TOK",
    "GGML_API_TOK2",
    "GGML_DB_PASS",
    "GGML_SESSION_ID",
    "GGML_COOKIE",
    "GGML_PRIVATE_KEY",
    "GGML_TLS_CERT",
    "GGML_JWT",
    "GGML_SSH_PASSPHRASE",
    "GGML_GH_PAT",
    "GGML_SIGNING_SALT",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_ACCESS_KEY_ID",
    "AWS_SESSION_TOKEN",
    "OPENAI_API_KEY",
    "GITHUB_TOKEN",
    "NPM_TOKEN",
    "PGPASSWORD",
    "MYSQL_PWD",
    "REDIS_PASS",
    "DOCKER_AUTH_CONFIG",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "AZURE_CLIENT_SECRET",
    "SSL_CERT_FILE",
    "SLACK_BOT_TOKEN",
    "ggml_db_pwd",
    "GgmlDbPwd",
    "HFToken",
    "GGML_BACKEND_DL_PATH",
    "LLAMA_STAGE_BUILD_DIR",
]

# Real settings of GPU and CPU hosts: none of them may look like a secret.
PLAIN_NAMES = [
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "GGML_CUDA_FORCE_MMQ",
    "GGML_CUDA_FORCE_CUBLAS",
    "GGML_CUDA_NO_PINNED",
    "GGML_CUDA_ENABLE_UNIFIED_MEMORY",
    "GGML_CUDA_PEER_MAX_BATCH_SIZE",
    "GGML_SCHED_MAX_COPIES",
    "GGML_VK_VISIBLE_DEVICES",
    "GGML_VK_DISABLE_COOPMAT",
    "GGML_METAL_NDEBUG",
    "GGML_OPENCL_PLATFORM",
    "GGML_SYCL_DEBUG",
    "GGML_NUMA",
    "GGML_OP_OFFLOAD_MIN_BATCH",
    "LLAMA_ARG_N_GPU_LAYERS",
    "LLAMA_STAGE_BACKEND",
    "LLAMA_STAGE_LINK_MODE",
    "LLAMA_STAGE_CUDA_ARCHITECTURES",
    "LLAMA_STAGE_AMDGPU_TARGETS",
    "SKIPPY_GGML_NATIVE",
    "SKIPPY_CUDA_ARCHITECTURES",
    "GGML_BYPASS_CHECKS",
    "GGML_STOKES_SOLVER",
    "GGML_COMPASS_MODE",
]


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_secret_looking_names_are_recognised(name: str) -> None:
    assert secret_name_marker(name) is not None


@pytest.mark.parametrize("name", PLAIN_NAMES)
def test_plain_settings_do_not_look_like_secrets(name: str) -> None:
    assert secret_name_marker(name) is None


def _refusals(environment: dict[str, str]) -> list[tuple[str, str]]:
    doc = valid_document()
    doc["environment"] = environment
    try:
        validate_operator_object(doc)
    except Refused as refused:
        return [(r.code, r.path) for r in refused.refusals]
    return []


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_the_operator_environment_refuses_secret_names_and_never_shows_the_value(
    name: str,
) -> None:
    doc = valid_document()
    doc["environment"] = {name: "s3cr3t-value"}
    with pytest.raises(Refused) as refused:
        validate_operator_object(doc)
    assert [r.code for r in refused.value.refusals] == ["operator.environment.secret_name"]
    assert "s3cr3t-value" not in str(refused.value)


def test_a_name_off_the_allowlist_that_is_not_secret_is_refused_as_not_allowed() -> None:
    assert _refusals({"LLAMA_ARG_N_GPU_LAYERS": "99"}) == [
        ("operator.environment.not_allowed", "$.environment.LLAMA_ARG_N_GPU_LAYERS")
    ]


def _prepared_with(tmp_path: Path, edit: Any) -> Path:
    from run_harness import make_prepared

    path = make_prepared(tmp_path / "prep")
    document = json.loads(path.read_bytes())
    edit(document)
    path.write_text(json.dumps(document))
    return path


def _first_profile(document: dict[str, Any]) -> dict[str, Any]:
    profiles: dict[str, Any] = document["profiles"]
    return profiles[next(iter(profiles))]


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda d: d["environment"].update(GGML_DB_PWD="x"), id="top"),
        pytest.param(
            lambda d: _first_profile(d)["native"]["environment"].update(GGML_HF_TOK="x"),
            id="host-profile",
        ),
        pytest.param(
            lambda d: _first_profile(d)["correctness"]["settings"].update(GGML_AWS_CREDS="x"),
            id="correctness-settings",
        ),
    ],
)
def test_a_prepared_input_with_a_secret_name_in_any_environment_map_is_refused(
    tmp_path: Path, edit: Any
) -> None:
    path = _prepared_with(tmp_path, edit)
    with pytest.raises(Refused) as refused:
        read_prepared_input(str(path))
    assert "operator.environment.secret_name" in str(refused.value)
    assert refused.value.codes[0] == "prepared.invalid"


# A GPU box's real settings: device UUIDs and MIG instances, -1 (no device), CMake lists,
# target features, ON/off spellings. The reference enumerates names, never values.
GPU_ENVIRONMENTS = [
    {"CUDA_VISIBLE_DEVICES": "GPU-8f6d2c1e-3b4a-4e5f-9a0b-1c2d3e4f5a6b"},
    {"CUDA_VISIBLE_DEVICES": "MIG-4b1c7e2a-9d3f-5a6b-8c7d-0e1f2a3b4c5d"},
    {"CUDA_VISIBLE_DEVICES": "GPU-8f6d2c1e-3b4a-4e5f-9a0b-1c2d3e4f5a6b,1"},
    {"CUDA_VISIBLE_DEVICES": "-1"},
    {"CUDA_VISIBLE_DEVICES": "0,1", "OMP_NUM_THREADS": "32"},
    {"HIP_VISIBLE_DEVICES": "0,1", "ROCR_VISIBLE_DEVICES": "GPU-0123456789abcdef"},
    {"LLAMA_STAGE_CUDA_ARCHITECTURES": "86;89", "SKIPPY_CUDA_ARCHITECTURES": "86;89"},
    {"LLAMA_STAGE_AMDGPU_TARGETS": "gfx90a:xnack-;gfx942"},
    {"SKIPPY_GGML_NATIVE": "off", "LLAMA_STAGE_BACKEND": "CUDA"},
    {"LLAMA_STAGE_LINK_MODE": "Shared", "GGML_CUDA_FORCE_MMQ": "1"},
    {"GGML_VK_VISIBLE_DEVICES": "0", "GGML_SCHED_MAX_COPIES": "4", "OMP_NUM_THREADS": "auto"},
]


@pytest.mark.parametrize("environment", GPU_ENVIRONMENTS)
def test_a_gpu_style_environment_validates(environment: dict[str, str]) -> None:
    doc = valid_document()
    doc["environment"] = environment
    model = validate_operator_object(doc)
    assert model.environment == environment


@pytest.mark.parametrize(
    ("environment", "code", "where"),
    [
        ({"CUDA_VISIBLE_DEVICES": "GPU-1\n"}, "operator.environment.bad_value",
         "$.environment.CUDA_VISIBLE_DEVICES"),
        ({"SKIPPY_GGML_NATIVE": "\u200boff"}, "operator.environment.bad_value",
         "$.environment.SKIPPY_GGML_NATIVE"),
        ({"LLAMA_STAGE_CUDA_ARCHITECTURES": "86;89", "SKIPPY_CUDA_ARCHITECTURES": "86"},
         "operator.environment.alias_conflict", "$.environment.SKIPPY_CUDA_ARCHITECTURES"),
        ({"NVIDIA_VISIBLE_DEVICES": "all"}, "operator.environment.not_allowed",
         "$.environment.NVIDIA_VISIBLE_DEVICES"),
        ({"GGML_DB_PWD": "x"}, "operator.environment.secret_name",
         "$.environment.GGML_DB_PWD"),
    ],
)  # fmt: skip
def test_free_values_still_refuse_controls_unknown_names_secrets_and_alias_conflicts(
    environment: dict[str, str], code: str, where: str
) -> None:
    assert _refusals(environment) == [(code, where)]
