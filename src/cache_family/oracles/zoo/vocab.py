"""A real, small byte-level BPE vocabulary written into every zoo model.

Every token a zoo model can generate renders visible text on its own (printable ASCII, tab,
newline, carriage return, and end-of-sequence), so each generated token reaches the client as
its own event: first-token times are observable and a chat answer always has content.
"""

from __future__ import annotations

import string
from functools import cache

import gguf

EOS_TOKEN = "<|endoftext|>"  # noqa: S105 - a vocabulary entry, not a secret
CONTROL_TOKENS = (EOS_TOKEN,)
#: The bytes with a token of their own: printable ASCII and tab, newline, carriage return.
TOKEN_BYTES: tuple[int, ...] = (0x09, 0x0A, 0x0D, *range(0x20, 0x7F))


@cache
def byte_to_printable() -> tuple[str, ...]:
    """The GPT-2 byte map: printable Latin-1 bytes stand for themselves, the rest shift up.

    Byte-level BPE never stores raw control bytes or spaces in token text; a space becomes
    ``Ġ`` (U+0120) and a newline ``Ċ`` (U+010A), which llama.cpp decodes back to bytes.
    """
    kept = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table: dict[int, str] = {b: chr(b) for b in kept}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return tuple(table[b] for b in range(256))


@cache
def vocabulary() -> tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...]]:
    """(tokens, merges, token types), in id order, the control token last; the same for
    every model and seed."""
    printable = byte_to_printable()
    tokens: list[str] = [printable[b] for b in TOKEN_BYTES]
    types: list[int] = [gguf.TokenType.NORMAL] * len(tokens)
    merges: list[str] = []
    space = printable[ord(" ")]
    letters = string.ascii_lowercase
    # Lower rank merges first: a space joins the letter after it before letters pair up.
    for letter in letters:
        merges.append(f"{space} {letter}")
        tokens.append(space + letter)
    for first in letters:
        for second in letters:
            merges.append(f"{first} {second}")
            tokens.append(first + second)
    types.extend([gguf.TokenType.NORMAL] * (len(tokens) - len(types)))
    for control in CONTROL_TOKENS:
        tokens.append(control)
        types.append(gguf.TokenType.CONTROL)
    return tuple(tokens), tuple(merges), tuple(int(t) for t in types)


def eos_token_id() -> int:
    tokens, _, _ = vocabulary()
    return tokens.index(EOS_TOKEN)


def add_byte_bpe_vocab(writer: gguf.GGUFWriter) -> int:
    """Write the tokenizer metadata into ``writer`` and return the vocabulary size."""
    tokens, merges, types = vocabulary()
    eos = eos_token_id()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(list(tokens))
    writer.add_token_types(list(types))
    writer.add_token_merges(list(merges))
    writer.add_bos_token_id(eos)
    writer.add_eos_token_id(eos)
    writer.add_add_bos_token(False)
    return len(tokens)


def rendered_bytes(token: str) -> bytes:
    """What llama.cpp's ``token_to_piece`` gives for an ordinary token of this vocabulary:
    each character mapped back to its byte (the inverse of :func:`byte_to_printable`)."""
    back = {ch: b for b, ch in enumerate(byte_to_printable())}
    return bytes(back[ch] for ch in token)
