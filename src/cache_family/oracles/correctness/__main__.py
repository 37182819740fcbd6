"""``python -m cache_family.oracles.correctness``: the command line's entry point."""

from cache_family.oracles.correctness.cli import main

raise SystemExit(main())
