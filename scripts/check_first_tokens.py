"""The stalled-client check of run directories (issue 28's done-criterion), as a script.

    .venv/bin/python scripts/check_first_tokens.py RUN_DIR [RUN_DIR...]

Prints, per run, its streamed requests of the ladder arms (native and stage servers), how
many had the server's per-event timings, which first tokens were not observable and why, and
every request whose client TTFT is at least 95 % of its elapsed time or whose client TPOT is
below a tenth of the server's own; exits 1 when the server's timings show a stalled client
faked one of them.
"""

from __future__ import annotations

import sys

from cache_family.actors.audit.first_tokens import check_first_tokens


def main(argv: list[str]) -> int:
    faked = 0
    for run_dir in argv:
        check = check_first_tokens(run_dir)
        print(f"{run_dir}:")
        for line in check.lines():
            print(f"  {line}")
        faked += len(check.faked)
    return 1 if faked else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
