"""requirements.lock pins every dependency pyproject.toml declares, each with its hashes."""

from __future__ import annotations

import re
import tomllib

from lock_reading import _PIN, ROOT, _locked  # noqa: F401
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def _declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    declared = [*project["project"]["dependencies"], *project["build-system"]["requires"]]
    for extra in project["project"].get("optional-dependencies", {}).values():
        declared.extend(extra)
    return [Requirement(text) for text in declared]


def test_every_declared_dependency_is_pinned_to_a_version_it_allows() -> None:
    locked = _locked()
    declared = _declared()
    assert declared
    for requirement in declared:
        name = canonicalize_name(requirement.name)
        assert name in locked, f"{requirement} is not in requirements.lock: run `just lock`"
        version = locked[name][0]
        assert requirement.specifier.contains(version, prereleases=True), (
            f"requirements.lock pins {name}=={version}, outside {requirement}: run `just lock`"
        )


def test_every_pin_has_sha256_hashes_so_pip_can_require_them() -> None:
    locked = _locked()
    assert "pip" in locked  # bootstrap installs pip itself from the lock too
    for name, (version, hashes) in locked.items():
        assert hashes, f"{name}=={version} has no hash"
        assert all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes), name


def test_bootstrap_installs_from_the_lock_with_hashes_and_stamps_it() -> None:
    bootstrap = (ROOT / "bootstrap").read_text(encoding="utf-8")
    assert "--require-hashes -r requirements.lock" in bootstrap
    assert "--no-deps --no-build-isolation -e ." in bootstrap
    # The install is redone when the lock changes, not only when pyproject.toml does.
    assert "cat pyproject.toml requirements.lock" in bootstrap
