"""cache-family-bench: trustworthy cache-payload benchmarks for LLM inference servers."""

__version__ = "0.1.0"
