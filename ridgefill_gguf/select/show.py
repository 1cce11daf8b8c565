"""Which prefix rows each exact-row rule selects on one prompt, from the engine (llama_ridgefill_select_rows) and
from the Python twin (rules.py), side by side: `ridgefill-gguf rules`."""
from __future__ import annotations

from pathlib import Path

from . import rules
from .pieces import prompt_pieces
from .unigrams import read_token_freq


class RulesError(ValueError):
    pass


def compare_rules(model: Path, maps: Path | None, text: str, tail: int) -> dict:
    from ..engine import bindings
    from ..libs import use_build

    llama_cpp = use_build()
    llm = llama_cpp.Llama(model_path=str(model), n_ctx=256, n_batch=32, verbose=False)
    loaded = None
    try:
        freq = None
        if maps:
            try:
                loaded = bindings.load_maps(llm.model, maps)
            except bindings.MapsRefused as e:
                raise RulesError(str(e)) from e
            freq = read_token_freq(maps)
        tokens = llm.tokenize(text.encode(), add_bos=True, special=True)
        n_prefix = len(tokens) - tail
        if n_prefix <= 0:
            raise RulesError(f"the prompt has {len(tokens)} tokens, no more than the tail ({tail}): no prefix")
        pieces, breaks = prompt_pieces(llama_cpp, llm.model, tokens)
        twins = {"digits": lambda: rules.digit_rows(pieces, breaks, n_prefix),
                 "lexical": lambda: rules.lexical_rows(pieces, breaks, n_prefix)}
        if freq is not None:
            twins["protected"] = lambda: rules.protected_rows(pieces, breaks, tokens, n_prefix, freq, 0.25)
            twins["protected-half"] = lambda: rules.protected_rows(pieces, breaks, tokens, n_prefix, freq, 0.5)
        report = {"n_tokens": len(tokens), "n_prefix": n_prefix, "rules": {}}
        for rule, twin in twins.items():
            engine = bindings.select_rows(llm.model, loaded, tokens, n_prefix, rule)
            entry = {"engine": engine, "python": twin()}
            if rule == "lexical":
                entry["text"] = b"".join(pieces[r] for r in engine).decode(errors="replace")
            report["rules"][rule] = entry
        return report
    finally:
        if loaded:
            loaded.free()
        llm.close()
