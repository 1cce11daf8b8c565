"""A prompt's token pieces and break flags, read from a loaded model's vocabulary as the engine reads them."""
from __future__ import annotations

import ctypes


def prompt_pieces(llama_cpp, model, tokens: list[int]) -> tuple[list[bytes], list[bool]]:
    """(pieces, breaks) for rules.py: each token's text (special tokens rendered too) and whether it is a control,
    user-defined, unknown or unused token."""
    vocab = llama_cpp.llama_model_get_vocab(model)
    brk_attrs = (llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED |
                 llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN | llama_cpp.LLAMA_TOKEN_ATTR_UNUSED)
    buf = ctypes.create_string_buffer(256)
    pieces, breaks = [], []
    for t in tokens:
        n = llama_cpp.llama_token_to_piece(vocab, t, buf, len(buf), 0, True)
        if n < 0:
            big = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(vocab, t, big, len(big), 0, True)
            pieces.append(big.raw[:n])
        else:
            pieces.append(buf.raw[:n])
        breaks.append(bool(llama_cpp.llama_vocab_get_attr(vocab, t) & brk_attrs))
    return pieces, breaks
