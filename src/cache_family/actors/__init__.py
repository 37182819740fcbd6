"""Trio tasks that perform I/O; they ask states/ what to do and journal what happened."""
