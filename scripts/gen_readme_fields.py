"""Regenerate README.md's operator input reference from the schema (`just readme-fields`).

Only the text between `<!-- operator-fields:begin -->` and `<!-- operator-fields:end -->`
changes; the heading and markers are appended at the end if the README lacks them.
`--check` changes nothing and exits 1 when the section is stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cache_family.system.publish import replace_atomically
from cache_family.schemas.docs import render_operator_reference, replace_marked_section

README = Path(__file__).resolve().parent.parent / "README.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", type=Path, default=README, help="README to update")
    parser.add_argument("--check", action="store_true", help="exit 1 if the section is stale")
    args = parser.parse_args(argv)
    readme: Path = args.readme
    current = readme.read_text(encoding="utf-8")
    wanted = replace_marked_section(current, render_operator_reference())
    if wanted == current:
        print(f"{readme}: operator input reference is up to date")
        return 0
    if args.check:
        print(f"{readme}: operator input reference is stale; run `just readme-fields`")
        return 1
    replace_atomically(readme, wanted.encode("utf-8"), mode=readme.stat().st_mode & 0o777)
    print(f"{readme}: operator input reference regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
