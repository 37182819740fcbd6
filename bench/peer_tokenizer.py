"""Write an offline Hugging Face tokenizer directory from a zoo GGUF's own vocabulary.

The peers (AIPerf, GuideLLM) load a tokenizer by name or path to size prompts and count
output tokens; offline they need a directory. This reads ``tokenizer.ggml.*`` from the GGUF
with the ``gguf`` library and writes the same byte-level BPE as ``tokenizer.json`` (tokens
are already in the GPT-2 byte-to-printable spelling), plus ``tokenizer_config.json``.

    .venv/bin/python bench/peer_tokenizer.py OUTDIR [--model llama]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import gguf

CONTROL = int(gguf.TokenType.CONTROL)


def read_vocabulary(model: Path) -> tuple[list[str], list[str], list[int], int]:
    reader = gguf.GGUFReader(model)

    def field(key: str) -> Any:
        value = reader.get_field(key)
        if value is None:
            raise SystemExit(f"{model} has no {key}")
        return value.contents()

    if field(gguf.Keys.Tokenizer.MODEL) != "gpt2":
        raise SystemExit(f"{model}: only byte-level BPE (gpt2) vocabularies are written")
    tokens = list(field(gguf.Keys.Tokenizer.LIST))
    merges = list(field(gguf.Keys.Tokenizer.MERGES))
    types = [int(t) for t in field(gguf.Keys.Tokenizer.TOKEN_TYPE)]
    eos = int(field(gguf.Keys.Tokenizer.EOS_ID))
    return tokens, merges, types, eos


def tokenizer_json(tokens: list[str], merges: list[str], types: list[int]) -> dict[str, Any]:
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": index,
                "content": token,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for index, (token, kind) in enumerate(zip(tokens, types, strict=True))
            if kind == CONTROL
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {token: index for index, token in enumerate(tokens)},
            "merges": merges,
        },
    }


def write(out: Path, model: Path) -> None:
    tokens, merges, types, eos = read_vocabulary(model)
    eos_token = tokens[eos]
    files = {
        "tokenizer.json": tokenizer_json(tokens, merges, types),
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": eos_token,
            "eos_token": eos_token,
            "model_max_length": 8192,
            "clean_up_tokenization_spaces": False,
        },
        "special_tokens_map.json": {"bos_token": eos_token, "eos_token": eos_token},
        "source.json": {"gguf": str(model), "tokens": len(tokens), "merges": len(merges)},
    }
    out.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        # Atomic: a peer never reads a half-written file.
        fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{name}.")
        with os.fdopen(fd, "w") as handle:
            json.dump(value, handle, ensure_ascii=False)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out / name)
    print(f"peer tokenizer: {out} ({len(tokens)} tokens from {model.name})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="llama", help="zoo preset key")
    args = parser.parse_args(argv)
    from cache_family.oracles.native_parts import ensure_parts

    parts = ensure_parts(sys.stderr, build=False)
    write(args.out, parts.model_path(args.model))


if __name__ == "__main__":
    main()
