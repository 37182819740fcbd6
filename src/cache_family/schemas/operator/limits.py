"""The operator input's bounds and vocabularies: sizes, allowlisted names, catalog limits.

Pure constants, shared by the value rules, the models (whose documented rules quote them) and
the cross checks; ``docs.py`` renders the environment tables from them.
"""

from __future__ import annotations

import re
from typing import Final

Loc = tuple[str | int, ...]

SCHEMA_VERSION: Final = 1
DOCUMENT_MAX_BYTES: Final = 1024 * 1024
# The schema nests 4 levels and its longest list holds 128 entries; these leave room for
# any honest mistake while keeping every document's validation work bounded.
JSON_MAX_DEPTH: Final = 32
JSON_MAX_ENTRIES: Final = 1024
# A valid document holds a few hundred values; past this many, checking each one (a refusal
# per bad value, 130,000 from one 1 MiB input) is work the verdict does not need.
JSON_MAX_VALUES: Final = 4096
PATH_MAX_BYTES: Final = 4096
U32_MAX: Final = 2**32 - 1
I32_MAX: Final = 2**31 - 1

ENV_MAX_ENTRIES: Final = 64
ENV_VALUE_MAX_BYTES: Final = 256
ENV_SECRET_MARKERS: Final = (
    "AUTH",
    "TOKEN",
    "SECRET",
    "PASSWORD",
    "CREDENTIAL",
    "PATH",
    "DIR",
    "ROOT",
    "KEY",
)
# Abbreviations and words that mark a secret only as a whole segment of a name (split at
# `_`, `-`, `.`, digits and case changes): `GGML_DB_PWD` and `GGML_HF_TOK` are secrets,
# while `TOK` inside `STOKES` or `PASS` inside `BYPASS` or `PASSES` are not.
ENV_SECRET_WORDS: Final = (
    "TOK",
    "TOKS",
    "PWD",
    "PASSWD",
    "PASS",
    "PW",
    "PASSPHRASE",
    "CRED",
    "CREDS",
    "COOKIE",
    "COOKIES",
    "SESSION",
    "SESS",
    "SID",
    "PRIVATE",
    "PRIV",
    "CERT",
    "CERTS",
    "CERTIFICATE",
    "PEM",
    "PFX",
    "P12",
    "JWT",
    "BEARER",
    "OAUTH",
    "SSH",
    "GPG",
    "PGP",
    "PAT",
    "OTP",
    "TOTP",
    "HMAC",
    "SALT",
    "SIGNING",
    "APIKEY",
    "PASSKEY",
)
ENV_DEVICE_NAMES: Final = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
ENV_PLAIN_NAMES: Final = (*ENV_DEVICE_NAMES, "OMP_NUM_THREADS")
# (stage-server spelling, skippy spelling): the same setting under two names.
ENV_ALIAS_PAIRS: Final = (
    ("LLAMA_STAGE_BACKEND", "SKIPPY_LLAMA_BACKEND"),
    ("LLAMA_STAGE_LINK_MODE", "SKIPPY_LLAMA_LINK_MODE"),
    ("LLAMA_STAGE_CUDA_ARCHITECTURES", "SKIPPY_CUDA_ARCHITECTURES"),
    ("LLAMA_STAGE_AMDGPU_TARGETS", "SKIPPY_AMDGPU_TARGETS"),
    ("LLAMA_STAGE_GGML_NATIVE", "SKIPPY_GGML_NATIVE"),
)
ENV_GGML_PREFIX: Final = "GGML_"

TOOLKIT_NAMES: Final = ("CUDA_PATH", "HIP_PATH", "ROCM_PATH", "LLVMInstallDir", "VULKAN_SDK")
TOOLKIT_MAX_ENTRIES: Final = 5

CASES_MAX: Final = 14
USE_CASES_MAX: Final = 128
USE_CASES_ALL: Final = "all"
PREFIX_SWEEP_MAX: Final = 32
CONCURRENCY_MAX_RUNGS: Final = 32
MAX_RUNG: Final = 1024

KEY_PATTERN: Final = re.compile(r"[A-Za-z0-9_-]{1,128}")
