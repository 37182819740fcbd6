"""What the oracle launchers run: check the package source pin, then run one oracle module.

A launcher script's bytes are what an operator input pins; it names the interpreter, the oracle
module and the tree pin of the ``cache_family`` source it was written against, and any other
source is refused (exit 126), so an edited or reinstalled package needs a fresh build of the
tools.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Final

import cache_family
from cache_family.exit_codes import ExitCode
from cache_family.oracles.native_build import package_source_sha256

ORACLE_MODULES: Final = ("stage_server", "correctness", "package_builder")


def package_root() -> Path:
    return Path(cache_family.__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or args[1] not in ORACLE_MODULES:
        print(
            "usage: python -I -m cache_family.oracles.launch SOURCE_SHA256 "
            f"{{{','.join(ORACLE_MODULES)}}} [ARG...]",
            file=sys.stderr,
        )
        return ExitCode.REFUSED
    expected, module, rest = args[0], args[1], args[2:]
    actual = package_source_sha256()
    if actual != expected:
        print(
            f"oracle.source_changed: this launcher was built for cache_family source {expected}, "
            f"the installed source at {package_root()} is {actual} (hint: run `just "
            "skippy-workload-oracles-build OUTPUT` again)",
            file=sys.stderr,
        )
        return ExitCode.SOURCE_CHANGED
    sys.argv = [module, *rest]
    runpy.run_module(f"cache_family.oracles.{module}", run_name="__main__", alter_sys=True)
    return ExitCode.OK


if __name__ == "__main__":
    raise SystemExit(main())
