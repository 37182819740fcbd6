"""Markdown and other renderings computed from receipts only."""
