"""One model in this process, prefilled the stock way or with RidgeFill, for checks, eval and benchmarks.

The prompt's last token always goes through llama_decode, so both ways end in the same stock step that
produces the logits; RidgeFill prefills the rows before it (n_following = 1: that token counts as tail).

  python -m ridgefill_gguf.engine.session --build ridgefill --spec SPEC.json -o OUT.npz
runs the runs of a JSON spec (see `run_spec`) in a process of its own, since a process loads one libllama.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import time
from pathlib import Path

import numpy as np


class Session:
    def __init__(self, model: str | Path, *, n_ctx: int, n_batch: int = 512, n_ubatch: int = 512,
                 flash_attn: bool = False, f32_cache: bool = False, n_threads: int | None = None,
                 n_gpu_layers: int = 0, maps: str | Path | None = None, placement: str = "resident",
                 n_seq_max: int = 1, kv_unified: bool = False, swa_full: bool | None = None):
        from .. import libs
        from . import bindings

        self.llama_cpp = libs.llama_cpp_module()
        self.lc = self.llama_cpp.llama_cpp
        kv = dict(type_k=0, type_v=0) if f32_cache else {}
        self.llm = self.llama_cpp.Llama(model_path=str(model), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch,
                                        flash_attn=flash_attn, n_threads=n_threads, n_threads_batch=n_threads,
                                        n_gpu_layers=n_gpu_layers, swa_full=swa_full, verbose=False, **kv)
        self.ctx, self.n_batch = self.llm.ctx, n_batch
        self._own_ctx = None
        if n_seq_max > 1:  # the Llama class opens one sequence: a context of several, as llama-server's slots
            cp = self.llm.context_params
            cp.n_seq_max, cp.kv_unified = n_seq_max, kv_unified
            self._own_ctx = self.lc.llama_init_from_model(self.llm.model, cp)
            if not self._own_ctx:
                raise RuntimeError(f"could not open a context of {n_seq_max} sequences")
            self.ctx = self._own_ctx
        self.vocab = self.lc.llama_model_get_vocab(self.llm.model)
        self.n_vocab = self.lc.llama_vocab_n_tokens(self.vocab)
        self.bindings = bindings
        self.maps = None                 # the attached maps
        self._loaded: dict[tuple, object] = {}
        if maps:
            self.attach(maps, placement)

    def attach(self, maps: str | Path, placement: str = "resident") -> None:
        """Attach a maps file (loaded once per session and kept) for the next RidgeFill prefills."""
        key = (str(maps), placement)
        if key not in self._loaded:
            self._loaded[key] = self.bindings.load_maps(self.llm.model, maps, placement)
        if self.maps is self._loaded[key]:
            return  # attaching again would drop the context's RidgeFill buffers
        self.maps = self._loaded[key]
        self.bindings.attach(self.ctx, self.maps)

    def chat_template(self) -> str | None:
        """The model's default chat template, or None."""
        t = self.lc.llama_model_chat_template(self.llm.model, None)
        return t.decode() if t else None

    def apply_chat_template(self, user: str) -> str:
        """One user turn formatted by llama.cpp's chat templates, up to the assistant's answer."""
        return self.apply_chat([{"role": "user", "content": user}])

    def apply_chat(self, messages: list[dict]) -> str:
        """A conversation ({role, content} turns) formatted by llama.cpp's chat templates, up to the assistant's
        next answer."""
        contents = [(m["role"].encode(), m["content"].encode()) for m in messages]
        msg = (self.lc.llama_chat_message * len(contents))(
            *[self.lc.llama_chat_message(role=r, content=c) for r, c in contents])
        tmpl = self.lc.llama_model_chat_template(self.llm.model, None)
        size = sum(len(c) for _, c in contents) * 2 + 1024
        buf = ctypes.create_string_buffer(size)
        n = self.lc.llama_chat_apply_template(tmpl, msg, len(contents), True, buf, size)
        if n > size:
            buf = ctypes.create_string_buffer(n)
            n = self.lc.llama_chat_apply_template(tmpl, msg, len(contents), True, buf, n)
        if n < 0:
            raise RuntimeError("llama.cpp cannot apply this model's chat template")
        return buf.raw[:n].decode()

    def detokenize(self, tokens: list[int]) -> str:
        return self.llm.detokenize(tokens).decode(errors="replace")

    def follow(self, logits: np.ndarray, pos: int, n: int,
               tokens: list[int] | None = None) -> tuple[list[int], np.ndarray]:
        """Continue after a prefill whose last row gave `logits`, from position `pos`: greedily for up to n tokens
        (tokens=None; stops before an end-of-generation token) or along `tokens`. Every step runs the full model.
        Returns (the tokens, their logits [len, n_vocab]: row i is the distribution token i was taken from)."""
        out: list[int] = []
        rows: list[np.ndarray] = []
        steps = n if tokens is None else len(tokens)
        for i in range(steps):
            t = int(np.argmax(logits)) if tokens is None else int(tokens[i])
            if tokens is None and self.lc.llama_vocab_is_eog(self.vocab, t):
                break
            out.append(t)
            rows.append(logits)
            if i + 1 < steps:
                self._decode([t], pos + i, "last")
                logits = self._last_logits()
        return out, np.array(rows, dtype=np.float32).reshape(len(rows), self.n_vocab)

    def greedy(self, logits: np.ndarray, pos: int, n: int) -> list[int]:
        """The greedy continuation's tokens (see follow)."""
        return self.follow(logits, pos, n)[0]

    def tokenize(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=add_bos, special=special)

    def _decode(self, tokens: list[int], pos0: int, want: str | None = None, seq: int = 0) -> None:
        """One llama_decode; logits for no row, the last row (want="last") or every row (want="all")."""
        lc, n = self.lc, len(tokens)
        batch = lc.llama_batch_init(n, 0, 1)
        try:
            for i, t in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, pos0 + i, 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = int(want == "all" or (want == "last" and i == n - 1))
            batch.n_tokens = n
            rc = lc.llama_decode(self.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
        finally:
            lc.llama_batch_free(batch)

    def _stock_prefix(self, tokens: list[int]) -> None:
        for start in range(0, len(tokens), self.n_batch):
            self._decode(tokens[start:start + self.n_batch], start)

    def _rows_logits(self, n: int) -> np.ndarray:
        """The last decode's logits, all n of its rows."""
        ptrs = [self.lc.llama_get_logits_ith(self.ctx, i) for i in range(n)]
        return np.stack([np.ctypeslib.as_array(p, shape=(self.n_vocab,)).copy() for p in ptrs])

    def stock_rows(self, tokens: list[int], n_last: int) -> np.ndarray:
        """Logits of the last n_last prompt rows, stock prefill: [n_last, n_vocab]."""
        self.clear()
        self._stock_prefix(tokens[:-n_last])
        return self._decode_rows(tokens[-n_last:], len(tokens) - n_last)

    def ridgefill_rows(self, tokens: list[int], n_last: int, **params) -> tuple[np.ndarray, dict]:
        """Logits of the last n_last prompt rows from the RidgeFill prefill itself (every token goes through it,
        so fill=none is exact to the method for them too): ([n_last, n_vocab], stats)."""
        self.bindings.configure(self.ctx, logits_rows=n_last, **params)
        self.clear()
        try:
            if not self.bindings.prefill(self.ctx, tokens, n_following=0):
                raise RuntimeError(f"RidgeFill did not apply: {self.bindings.not_applied_reason()}")
            return self.bindings.logits(self.ctx, self.n_vocab), self.bindings.stats(self.ctx)
        finally:
            self.bindings.configure(self.ctx, logits_rows=0)

    def ridgefill_greedy(self, tokens: list[int], n: int, *, tail: int, **params) -> tuple[list[int], dict]:
        """Greedy answer of up to n tokens (stopping before an end-of-generation token), each from the logits of a
        RidgeFill prefill of the prompt and the answer so far, whose tail grows with the answer so that the filled
        rows stay the prompt's. For fill=none this is the only way to generate: a llama_decode step would read the
        filled rows' unwritten late-layer cells. One prefill per token. Returns (tokens, the first prefill's stats)."""
        out: list[int] = []
        first: dict | None = None
        for k in range(n):
            logits, st = self.ridgefill_rows(tokens + out, 1, tail=tail + k, **params)
            first = first or st
            t = int(np.argmax(logits[-1]))
            if self.lc.llama_vocab_is_eog(self.vocab, t):
                break
            out.append(t)
        return out, first or {}

    def _decode_rows(self, tokens: list[int], pos0: int) -> np.ndarray:
        """Decode tokens with logits for every one of them, in batches: [n, n_vocab]."""
        out = []
        for start in range(0, len(tokens), self.n_batch):
            part = tokens[start:start + self.n_batch]
            self._decode(part, pos0 + start, "all")
            out.append(self._rows_logits(len(part)))
        return np.concatenate(out)

    def _last_logits(self) -> np.ndarray:
        ptr = self.lc.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def extend(self, cached: list[int], tokens: list[int]) -> tuple[np.ndarray, int]:
        """Continue a sequence whose cache holds `cached` with the prompt `tokens`, as llama-server's cache_prompt
        does: the longest common prefix stays (whatever prefill made its cells), the rest is decoded stock.
        Returns (the last row's logits, the positions reused)."""
        k = 0
        while k < min(len(cached), len(tokens) - 1) and cached[k] == tokens[k]:
            k += 1
        if not self.lc.llama_memory_seq_rm(self.lc.llama_get_memory(self.ctx), 0, k, -1):
            raise RuntimeError(f"the cache cannot keep its first {k} of {len(cached)} positions alone: this model's "
                               "recurrent state cannot go back (continue the whole cached sequence instead)")
        for start in range(k, len(tokens), self.n_batch):
            part = tokens[start:start + self.n_batch]
            self._decode(part, start, "last" if start + len(part) == len(tokens) else None)
        return self._last_logits(), k

    def clear(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)

    def stock(self, tokens: list[int]) -> tuple[np.ndarray, float]:
        """(last-row logits, seconds) of a stock prefill of tokens."""
        self.clear()
        t0 = time.perf_counter()
        self._stock_prefix(tokens[:-1])
        self._decode(tokens[-1:], len(tokens) - 1, "last")
        return self._last_logits(), time.perf_counter() - t0

    def ridgefill(self, tokens: list[int], **params) -> tuple[np.ndarray, float, dict]:
        """(last-row logits, seconds, stats) of a RidgeFill prefill; params as bindings.configure takes them.
        A request that does not qualify runs stock (stats["applied"] == 0, stats["reason"] says why)."""
        if not self.maps:
            raise RuntimeError("no maps: open the session with maps=")
        self.bindings.configure(self.ctx, **params)
        self.clear()
        return self._ridgefill_prompt(tokens, 0)

    def ridgefill_resumed(self, tokens: list[int], **params) -> tuple[np.ndarray, float, dict]:
        """ridgefill() of tokens over the sequence's cache, as an exact-only follow-up: the leading rows that the last
        sweep one ran with the same tokens keep their cells and split state (stats["held"] of them), so that layers
        [0, S) run only for the rest; every row's late layers are written anew."""
        self.bindings.configure(self.ctx, **params)
        n_held = self.bindings.held_rows(self.ctx, tokens[:-1], 0)
        if not self.bindings.keep_held(self.ctx, 0, n_held):
            n_held = 0
        logits, seconds, stats = self._ridgefill_prompt(tokens, n_held)
        return logits, seconds, {**stats, "held": n_held if stats["applied"] else 0}

    def _ridgefill_prompt(self, tokens: list[int], n_held: int) -> tuple[np.ndarray, float, dict]:
        """The RidgeFill prefill of tokens[:-1] from position 0 (its first n_held rows held), the stock way where it
        does not apply (the held rows went too), then the last token: (logits, seconds, stats)."""
        t0 = time.perf_counter()
        applied = (self.bindings.prefill_resumed(self.ctx, tokens[:-1], n_held, n_following=1) if n_held else
                   self.bindings.prefill(self.ctx, tokens[:-1], n_following=1))
        reason = "" if applied else self.bindings.not_applied_reason()
        if not applied:
            self._stock_prefix(tokens[:-1])
        self._decode(tokens[-1:], len(tokens) - 1, "last")
        seconds = time.perf_counter() - t0
        stats = self.bindings.stats(self.ctx)
        stats["reason"] = reason
        stats["exact_rows"] = self.bindings.exact_rows(self.ctx) if applied else []
        for rule in self.bindings.ADDED_BY:  # which of them the lexical net and whole numbers added
            stats[f"{rule}_rows"] = self.bindings.added_rows(self.ctx, rule) if applied else []
        return self._last_logits(), seconds, stats

    def close(self) -> None:
        if self._loaded:
            self.bindings.attach(self.ctx, None)
            for maps in self._loaded.values():
                maps.free()
            self._loaded.clear()
            self.maps = None
        if self._own_ctx:
            self.lc.llama_free(self._own_ctx)
            self._own_ctx = None
        self.llm.close()


def run_spec(spec: dict) -> tuple[dict[str, np.ndarray], dict]:
    """spec: {"model", "n_ctx", "session": {Session kwargs}, "prompt": text or "tokens": [...],
    "runs": [{"name", "stock": true} | {"name", "params": {...}}]} -> (arrays by run name, stats by run name)."""
    sess = Session(spec["model"], n_ctx=spec["n_ctx"], **spec.get("session", {}))
    tokens = spec.get("tokens") or sess.tokenize(spec["prompt"], special=spec.get("special", False))
    arrays, stats = {"tokens": np.array(tokens, np.int32)}, {}
    for run in spec["runs"]:
        if run.get("rows"):  # the last `rows` rows' logits, from the prefill itself
            n_last = int(run["rows"])
            if run.get("stock"):
                arrays[run["name"]] = sess.stock_rows(tokens, n_last)
                stats[run["name"]] = {"applied": 0}
            else:
                arrays[run["name"]], stats[run["name"]] = sess.ridgefill_rows(tokens, n_last, **run.get("params", {}))
            continue
        if run.get("stock"):
            logits, seconds = sess.stock(tokens)
            st = {"applied": 0}
        else:
            params = dict(run.get("params", {}))
            for key in ("exact_random", "probe", "attention", "rescale", "probe_budget", "random_budget"):
                # tuples arrive as JSON lists
                if key in params:
                    params[key] = tuple(params[key])
            logits, seconds, st = sess.ridgefill(tokens, **params)
        arrays[run["name"]] = logits
        stats[run["name"]] = {**st, "seconds": seconds}
    if spec.get("pieces"):  # the prompt's pieces and break flags, for the rules' Python twin
        from ..select.pieces import prompt_pieces

        pieces, breaks = prompt_pieces(sess.llama_cpp, sess.llm.model, tokens)
        stats["_prompt"] = {"pieces": [p.hex() for p in pieces], "breaks": breaks}
    sess.close()
    return arrays, stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", required=True)
    ap.add_argument("--spec", required=True, type=Path)
    ap.add_argument("-o", "--out", required=True, type=Path)
    args = ap.parse_args(argv)
    from .. import libs

    libs.use_build(args.build)
    arrays, stats = run_spec(json.loads(args.spec.read_text()))
    np.savez(args.out, **arrays)
    args.out.with_suffix(".json").write_text(json.dumps(stats, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
