"""The tiny real-model zoo: random-weight GGUF models for every catalog family."""
