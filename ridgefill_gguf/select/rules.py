"""The rule-based exact-row selectors of paper §2.4 and Appendix H, in Python.

The engine's twin is vendor/llama.cpp/src/llama-ridgefill-select.cpp (patches/0015); tests compare the two on real
tokenizers and check these rules on hand-made prompts. A prompt is given as its tokens' pieces (bytes, as
llama_token_to_piece renders them) and, per token, whether it is a break token (control, user-defined, unknown or
unused: such tokens carry no words and end a sentence).

- Token classes: a piece with leading spaces starts a word. Protected (eligible) classes: capitalized word starts,
  capitalized word pieces, lower-case word pieces and mixed tokens (not all letters, not all punctuation, not digits
  with or without punctuation). Digit tokens: digits alone or with punctuation.
- protected_rows: of the eligible prefix tokens, the rarest share by the unigram table (add-one frequency orders as
  the count does; ties: the earlier row).
- lexical_rows: words are runs of Unicode letters and numbers, ASCII lower-cased, a final s dropped from words of four
  or more characters unless they end in ss; sentences end at a line break, at . ! ? followed by whitespace or the end,
  at the CJK full stop, exclamation and question marks, and at break tokens. A prefix sentence is kept when it shares
  a run of four words with the prompt's last 64 content tokens and that run holds a word occurring at most twice in
  the prefix; at most its first 80 rows, and 5% of the prefix in all, in prompt order. Content tokens exclude break
  tokens and a chat template's role header (the rows after a break token up to and including the first piece with a
  line break, or up to the next break token, within 4 rows).

Where the twins can differ: letter, number and uppercase tests come from Python's unicodedata here and from llama.cpp's
own tables (a newer Unicode version, and an uppercase set without some capitals such as U+0130) in the engine. On
ASCII and common accented Latin text they agree (tested); `ridgefill-gguf rules` reports any prompt where they do not.
"""
from __future__ import annotations

import math
import unicodedata
from dataclasses import dataclass
from typing import Sequence

CAP_START, CAP_PIECE, LOWER_START, LOWER_PIECE, NUMBER, DIGIT_PUNCT, PUNCT, MIXED = (
    "cap-start", "cap-piece", "lower-start", "lower-piece", "number", "digit-punct", "punct", "mixed")
PROTECTED_CLASSES = (CAP_START, CAP_PIECE, LOWER_PIECE, MIXED)
DIGIT_CLASSES = (NUMBER, DIGIT_PUNCT)
REPLACEMENT = 0xFFFD
# llama.cpp's whitespace set (unicode_set_whitespace), which Python's isspace() does not match (it adds U+001C-U+001F)
WHITESPACE = frozenset((0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028,
                        0x2029, 0x202F, 0x205F, 0x3000))


def next_cpt(data: bytes, i: int) -> tuple[int, int]:
    """The code point at data[i] and the next offset; an invalid byte reads as U+FFFD, one byte long (as the engine)."""
    b0 = data[i]
    if b0 < 0x80:
        return b0, i + 1
    if not b0 & 0x40:
        return REPLACEMENT, i + 1
    for length, lead_mask in ((2, 0x1F), (3, 0x0F), (4, 0x07)):
        if not b0 & (0x80 >> length):
            tail = data[i + 1:i + length]
            if len(tail) < length - 1 or any(b & 0xC0 != 0x80 for b in tail):
                return REPLACEMENT, i + 1
            cpt = b0 & lead_mask
            for b in tail:
                cpt = (cpt << 6) | (b & 0x3F)
            return cpt, i + length
    return REPLACEMENT, i + 1


def _category(cpt: int) -> str:
    try:
        return unicodedata.category(chr(cpt))
    except ValueError:
        return "Cn"


def is_word_cpt(cpt: int) -> bool:
    return _category(cpt)[0] in "LN"


def _is_space(cpt: int) -> bool:
    return cpt in WHITESPACE


def share_of(share: float, n: int) -> int:
    """ceil(share x n), with the share rounded to 1e-6 as the engine does (it receives shares as floats)."""
    return min(n, math.ceil(round(share * 1e6) / 1e6 * n - 1e-9))


def classify(piece: bytes) -> str:
    i, start = 0, False
    while i < len(piece) and piece[i] in b" \t":
        start, i = True, i + 1
    letters = numbers = punct = other = False
    first_upper, first = False, True
    while i < len(piece):
        cpt, i = next_cpt(piece, i)
        cat = _category(cpt)
        if cat[0] == "L":
            if first:
                first_upper = chr(cpt).isupper()
            letters = True
        elif cat[0] == "N":
            numbers = True
        elif cat[0] in "PS" or _is_space(cpt):
            punct = True
        else:
            other = True
        first = False
    if not (letters or numbers or other):
        return PUNCT
    if letters and not (numbers or punct or other):
        return (CAP_START if start else CAP_PIECE) if first_upper else (LOWER_START if start else LOWER_PIECE)
    if numbers and not (letters or other):
        return DIGIT_PUNCT if punct else NUMBER
    return MIXED


def protected_rows(pieces: Sequence[bytes], breaks: Sequence[bool], tokens: Sequence[int], n_prefix: int,
                   counts: Sequence[int], share: float) -> list[int]:
    eligible = [r for r in range(n_prefix) if not breaks[r] and classify(pieces[r]) in PROTECTED_CLASSES]

    def count(r: int) -> int:
        return counts[tokens[r]] if 0 <= tokens[r] < len(counts) else 0

    eligible.sort(key=count)  # stable: ties keep the earlier row first
    keep = share_of(share, len(eligible))
    return sorted(eligible[:keep])


def digit_rows(pieces: Sequence[bytes], breaks: Sequence[bool], n_prefix: int) -> list[int]:
    return [r for r in range(n_prefix) if not breaks[r] and classify(pieces[r]) in DIGIT_CLASSES]


def whole_number_rows(digits: Sequence[int], exact: set[int]) -> list[int]:
    """The digit rows the budgeted probe adds: every number (a run of consecutive digit rows) with an exact row runs
    exactly whole (the whole_numbers parameter)."""
    out, run = [], []
    for r in [*sorted(digits), None]:
        if run and (r is None or r != run[-1] + 1):
            if any(x in exact for x in run):
                out += [x for x in run if x not in exact]
            run = []
        if r is not None:
            run.append(r)
    return out


@dataclass(frozen=True)
class LexicalParams:
    window: int = 64
    min_run: int = 4
    max_count: int = 2
    per_sentence: int = 80
    max_share: float = 0.05


@dataclass
class _Word:
    norm: str
    row0: int
    row1: int
    sentence: int


def content_rows(pieces: Sequence[bytes], breaks: Sequence[bool]) -> list[bool]:
    n = len(pieces)
    content = [True] * n
    for r in range(n):
        if not breaks[r]:
            continue
        content[r] = False
        end = -1
        for j in range(r + 1, min(n, r + 5)):
            if breaks[j]:
                end = j - 1
                break
            if b"\n" in pieces[j]:
                end = j
                break
        for j in range(r + 1, end + 1):
            content[j] = False
    return content


def words_and_sentences(pieces: Sequence[bytes], breaks: Sequence[bool]) -> tuple[list[_Word], list[tuple[int, int]]]:
    """The prompt's normalized words (with their first and last rows and sentence) and each sentence's rows."""
    text = bytearray()
    row_of_byte: list[int] = []
    for r, piece in enumerate(pieces):
        if not breaks[r]:
            text += piece
            row_of_byte += [r] * len(piece)
    data = bytes(text)
    words: list[_Word] = []
    sentences: list[tuple[int, int]] = []
    state = {"row0": -1, "row1": -1}
    cur: list[int] = []
    cur_rows = [-1, -1]

    def end_word() -> None:
        if cur:
            if len(cur) >= 4 and cur[-1] == ord("s") and cur[-2] != ord("s"):
                cur.pop()
            words.append(_Word("".join(map(chr, cur)), cur_rows[0], cur_rows[1], len(sentences)))
        cur.clear()
        cur_rows[0] = cur_rows[1] = -1

    def end_sentence() -> None:
        if state["row0"] >= 0:
            sentences.append((state["row0"], state["row1"]))
        state["row0"] = state["row1"] = -1

    i, prev_row = 0, -1
    while i < len(data):
        row = row_of_byte[i]
        if any(breaks[r] for r in range(prev_row + 1, row)):
            end_word()
            end_sentence()
        prev_row = row
        cpt, i = next_cpt(data, i)
        if state["row0"] < 0:
            state["row0"] = row
        state["row1"] = row_of_byte[i - 1]
        if is_word_cpt(cpt):
            if ord("A") <= cpt <= ord("Z"):
                cpt += ord("a") - ord("A")
            cur.append(cpt)
            if cur_rows[0] < 0:
                cur_rows[0] = row
            cur_rows[1] = row_of_byte[i - 1]
            continue
        end_word()
        ends = cpt in (0x0A, 0x0D, 0x3002, 0xFF01, 0xFF1F)
        if cpt in (ord("."), ord("!"), ord("?")):
            ends = i >= len(data) or _is_space(next_cpt(data, i)[0])
        if ends:
            end_sentence()
    end_word()
    end_sentence()
    return words, sentences


def lexical_rows(pieces: Sequence[bytes], breaks: Sequence[bool], n_prefix: int,
                 params: LexicalParams = LexicalParams()) -> list[int]:
    n = len(pieces)
    content = content_rows(pieces, breaks)
    in_window = [False] * n
    k = 0
    for r in range(n - 1, -1, -1):
        if k >= params.window:
            break
        if content[r]:
            in_window[r] = True
            k += 1
    words, sentences = words_and_sentences(pieces, breaks)
    prefix_count: dict[str, int] = {}
    for w in words:
        if w.row0 < n_prefix:
            prefix_count[w.norm] = prefix_count.get(w.norm, 0) + 1
    run = max(params.min_run, 1)

    def gram(a: int) -> tuple[str, ...]:
        return tuple(w.norm for w in words[a:a + run])

    def same_sentence(a: int) -> bool:
        return words[a].sentence == words[a + run - 1].sentence

    window_grams = set()
    for a in range(len(words) - run + 1):
        span = words[a:a + run]
        if same_sentence(a) and all(in_window[w.row0] for w in span) and \
                any(prefix_count.get(w.norm, 0) <= params.max_count for w in span):
            window_grams.add(gram(a))
    matched = set()
    for a in range(len(words) - run + 1):
        if window_grams and words[a].row0 < n_prefix and same_sentence(a) and not in_window[words[a].row0] \
                and gram(a) in window_grams:
            matched.add(words[a].sentence)
    cap = math.floor(params.max_share * n_prefix)
    rows: list[int] = []
    for s in sorted(matched):
        kept = 0
        for r in range(sentences[s][0], sentences[s][1] + 1):
            if r >= n_prefix or kept >= params.per_sentence or len(rows) >= cap:
                break
            if not breaks[r] and (not rows or rows[-1] != r):
                rows.append(r)
                kept += 1
    return rows
