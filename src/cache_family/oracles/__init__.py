"""The embedded default: the native llama.cpp build and the tiny-model zoo."""
