"""Regenerate docs/state-machines.md from the tables in states/cell.py (`just docs`).

`--check` changes nothing and exits 1 when the document is stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cache_family.system.publish import replace_atomically
from cache_family.states.cell import render_table_markdown

DOC = Path(__file__).resolve().parent.parent / "docs" / "state-machines.md"
HEADER = (
    "# State machines\n\n"
    "Generated from `src/cache_family/states/cell.py` by `just docs`; edit the tables, not this\n"
    "file. A (state, event) pair that is not listed is refused with a typed error.\n\n"
)


def render() -> str:
    body = render_table_markdown().replace("\n## ", "\n### ")
    if body.startswith("## "):
        body = "#" + body
    return HEADER + body.rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the document is stale")
    args = parser.parse_args(argv)
    wanted = render()
    current = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
    if wanted == current:
        print(f"{DOC}: up to date")
        return 0
    if args.check:
        print(f"{DOC}: stale; run `just docs`")
        return 1
    replace_atomically(DOC, wanted.encode("utf-8"))
    print(f"{DOC}: regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
