"""The rule-based exact-row selectors (paper §2.4, Appendix H): the Python rules on hand-made prompts, and the
engine's rules equal to them on real tokenizers."""
from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, require_builds
from ridgefill_gguf.gguf_io import read_gguf
from ridgefill_gguf.maps.synthetic import write_float_file
from ridgefill_gguf.maps.convert import convert
from ridgefill_gguf.random_gguf import tiny_shape, write_random_model
from ridgefill_gguf.select import rules
from ridgefill_gguf.select.unigrams import add_one_counts, read_token_freq, with_token_freq


def word_pieces(text: str) -> tuple[list[bytes], list[bool]]:
    """A word tokenizer: each piece is a run of spaces and the non-space characters after it; <ctl> is a break."""
    pieces = [p.encode() for p in re.findall(r"\s*\S+|\s+$", text)]
    return [b"" if p.strip() == b"<ctl>" else p for p in pieces], [p.strip() == b"<ctl>" for p in pieces]


def rows_text(pieces, rows) -> str:
    return b"".join(pieces[r] for r in rows).decode()


def test_token_classes_follow_the_papers_four_protected_classes():
    cases = {b" Paris": rules.CAP_START, b"Paris": rules.CAP_PIECE, b" the": rules.LOWER_START,
             b"ing": rules.LOWER_PIECE, b" 2024": rules.NUMBER, b"3.14": rules.DIGIT_PUNCT, b",": rules.PUNCT,
             b" ": rules.PUNCT, b" x2": rules.MIXED, b"_init": rules.MIXED, b"'s": rules.MIXED,
             " Élan".encode(): rules.CAP_START, " 東京".encode(): rules.LOWER_START}
    assert {p: rules.classify(p) for p in cases} == cases
    assert set(rules.PROTECTED_CLASSES) == {rules.CAP_START, rules.CAP_PIECE, rules.LOWER_PIECE, rules.MIXED}


def test_protected_rows_are_the_rarest_share_of_eligible_tokens_with_ties_to_the_earlier_row():
    pieces = [b" Alpha", b" the", b"ing", b" 42", b" Beta", b"", b" x2", b" Gamma"]
    breaks = [False, False, False, False, False, True, False, False]
    tokens = [10, 11, 12, 13, 14, 15, 16, 17]
    counts = np.ones(32, np.float32)
    counts[[10, 12, 14, 16, 17]] = [5, 2, 2, 9, 1]
    # eligible: Alpha(5) ing(2) Beta(2) x2(9) Gamma(1); " the" is a lower-case start, " 42" a number, row 5 a break
    assert rules.protected_rows(pieces, breaks, tokens, 8, counts, 0.5) == [2, 4, 7]  # ceil(2.5) = 3 rarest
    assert rules.protected_rows(pieces, breaks, tokens, 8, counts, 0.25) == [2, 7]
    assert rules.protected_rows(pieces, breaks, tokens, 5, counts, 0.5) == [2, 4]  # prefix only
    assert rules.digit_rows(pieces, breaks, 8) == [3]


def test_words_are_normalized_as_appendix_h_says():
    pieces, breaks = word_pieces("Numbers class bus ÉCOLES fluffy_mango v1.2 Dress's <ctl> end")
    words, sentences = rules.words_and_sentences(pieces, breaks)
    assert [w.norm for w in words] == ["number", "class", "bus", "Écoles"[:-1], "fluffy", "mango", "v1", "2",
                                       "dress", "s", "end"]
    assert len(sentences) == 2  # the break token ends the first sentence; "v1.2" does not


def test_sentences_end_at_line_breaks_terminal_marks_before_whitespace_cjk_marks_and_break_tokens():
    text = "One two. Three\nfour! five?six 七。八 <ctl> nine"
    words, sentences = rules.words_and_sentences(*word_pieces(text))
    by_sentence = {}
    for w in words:
        by_sentence.setdefault(w.sentence, []).append(w.norm)
    assert list(by_sentence.values()) == [["one", "two"], ["three"], ["four"], ["five", "six", "七"], ["八"],
                                          ["nine"]]


FILLER = "The grass is green and the sky is blue today. " * 30


def test_the_lexical_net_keeps_the_sentence_sharing_four_words_and_a_rare_word_with_the_question():
    text = (FILLER + "One of the special magic numbers for fluffy-mango is: 7731. " + FILLER +
            "One of the special magic numbers for spiky-pear is: 1234. " + FILLER +
            "One of the special magic numbers for round-kiwi is: 5678. " + FILLER +
            "<ctl> user\nWhat is the special magic number for fluffy-mango mentioned above? <ctl> assistant\n")
    pieces, breaks = word_pieces(text)
    n_prefix = len(pieces) - 20
    rows = rules.lexical_rows(pieces, breaks, n_prefix)
    # "special magic number for" occurs three times in the prefix: only the run through "fluffy" is rare
    assert rows_text(pieces, rows) == " One of the special magic numbers for fluffy-mango is: 7731."
    two = text.replace("One of the special magic numbers for round-kiwi is: 5678. ", "")
    pieces, breaks = word_pieces(two)
    # with two needles "special" occurs twice, at most twice counts as rare: the other needle matches too
    assert "spiky-pear" in rows_text(pieces, rules.lexical_rows(pieces, breaks, len(pieces) - 20))


def test_a_run_of_three_words_or_of_common_words_only_keeps_nothing():
    three = FILLER + "Seen the fluffy mango today. " + FILLER + "Where was the fluffy mango seen?"
    pieces, breaks = word_pieces(three)
    assert rules.lexical_rows(pieces, breaks, len(pieces) - 8) == []  # "the fluffy mango" is three words
    common = FILLER + "Where was the fluffy mango seen?"
    pieces, breaks = word_pieces(common * 4)
    # every word of the question occurs three times in the prefix: no rare word
    assert rules.lexical_rows(pieces, breaks, len(pieces) - 8) == []


def test_the_lexical_net_keeps_at_most_80_rows_a_sentence_and_5_percent_of_the_prefix():
    long_sentence = "the fluffy mango code word " + "and more words here " * 40 + "end."
    text = FILLER * 3 + long_sentence + " " + FILLER * 3 + "Tell me about the fluffy mango code word."
    pieces, breaks = word_pieces(text)
    n_prefix = len(pieces) - 12
    rows = rules.lexical_rows(pieces, breaks, n_prefix)
    assert len(rows) == 80 and rows_text(pieces, rows[:5]).strip().startswith("the fluffy mango code word")
    capped = rules.lexical_rows(pieces, breaks, n_prefix, rules.LexicalParams(max_share=0.01))
    assert len(capped) == int(0.01 * n_prefix) and capped == rows[:len(capped)]


def test_the_window_skips_a_chat_templates_role_header_and_the_question_does_not_match_itself():
    pieces, breaks = word_pieces(FILLER + "<ctl> user\nthe fluffy mango code word? <ctl> assistant\n")
    content = rules.content_rows(pieces, breaks)
    header = [i for i, p in enumerate(pieces) if p.strip() in (b"user", b"assistant")]
    assert header and not any(content[i] for i in header)
    # the question lies in the prefix here (no tail): it is the only place its run occurs, so nothing is kept
    assert rules.lexical_rows(pieces, breaks, len(pieces)) == []


def test_add_one_counts_count_every_token_once_more_than_it_occurs():
    counts = add_one_counts([[1, 2, 2], [2, 5, 99]], 6)
    assert counts.tolist() == [1, 2, 4, 1, 1, 2]  # 99 lies outside the vocabulary


@pytest.fixture(scope="module")
def models_with_freq(tmp_path_factory):
    d = tmp_path_factory.mktemp("select")
    out = {}
    for arch in ("llama", "qwen2"):
        shape = dataclasses.replace(tiny_shape(arch), n_layer=4)
        model = write_random_model(d / f"{arch}.gguf", shape, seed=3)
        src = write_float_file(d / f"{arch}.safetensors", 1, [2, 3], shape.n_embd, dtype="f32", seed=4)
        maps = convert(src, d / f"{arch}.maps.gguf", model=model, outtype="f32").out
        n_vocab = len(read_gguf(model).get("tokenizer.ggml.tokens"))
        freq = np.random.default_rng(0).integers(1, 50, n_vocab).astype(np.float32)
        out[arch] = (model, with_token_freq(maps, freq, d / f"{arch}.freq.maps.gguf"), freq)
    return out


PROMPTS = {
    "llama": ("<|start_header_id|>user<|end_header_id|>\n\n" + FILLER +
              "One of the special magic numbers for fluffy-mango is: 7731. Prices: 3.14, 12,000 and café's naïve 東京。"
              + FILLER + "What is the special magic number for fluffy-mango mentioned in the provided text?"
              "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
    "qwen2": ("<|im_start|>user\n" + FILLER + "def parse_config(path_name): return load_yaml(path_name) # v2.1\n" +
              FILLER + "Where is parse_config(path_name) defined, and what does it return?<|im_end|>\n"
              "<|im_start|>assistant\n"),
    # a word ending in s right before a special token, C0 separators, accented capitals
    "edge": ("<|im_start|>user\n" + FILLER + "Our fluffy mango secret passwords.\x1c École Élan Ürün café's "
             "naïve\x1d items 10.5% off. " + FILLER + "Tell me the fluffy mango secret passwords<|im_end|>\n"
             "<|im_start|>assistant\n"),
}


@pytest.mark.parametrize("arch,prompt", [("llama", "llama"), ("qwen2", "qwen2"), ("qwen2", "edge")])
def test_the_engines_rules_select_the_same_rows_as_the_python_rules_on_a_real_tokenizer(arch, prompt,
                                                                                          models_with_freq, tmp_path):
    require_builds("ridgefill")
    model, maps, freq = models_with_freq[arch]
    assert np.array_equal(read_token_freq(maps), freq)
    proc = subprocess.run([sys.executable, "-m", "ridgefill_gguf.cli", "rules", str(model), "--maps", str(maps),
                           "--prompt", PROMPTS[prompt], "--tail", "40", "--json"], cwd=ROOT, text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    r = report["rules"]
    assert set(r) == {"digits", "lexical", "protected", "protected-half"}
    assert all(v["engine"] == v["python"] for v in r.values())
    assert r["digits"]["engine"] and r["protected"]["engine"] and r["lexical"]["engine"]
    want = {"llama": "fluffy-mango is: 7731.", "qwen2": "parse_config(path_name)",
            "edge": "Our fluffy mango secret passwords."}[prompt]
    assert want in r["lexical"]["text"]
    assert len(r["protected"]["engine"]) < len(r["protected-half"]["engine"])


def test_the_unigrams_command_adds_the_calibration_texts_counts_to_maps_fitted_without_them(models_with_freq,
                                                                                           tmp_path):
    require_builds("ridgefill")
    model, maps, _ = models_with_freq["qwen2"]
    plain = tmp_path / "plain.gguf"
    plain.write_bytes((maps.parent / "qwen2.maps.gguf").read_bytes())
    assert read_token_freq(plain) is None
    calib = tmp_path / "calib"
    calib.mkdir()
    (calib / "a.txt").write_text("The heron stood still. " * 20)
    (calib / "b.txt").write_text("def f(x): return x + 1\n" * 10)
    proc = subprocess.run([sys.executable, "-m", "ridgefill_gguf.cli", "unigrams", str(plain), "--model", str(model),
                           "--calib", str(calib)], cwd=ROOT, text=True, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    n_tokens = int(re.search(r"2 documents, (\d+) tokens", proc.stdout).group(1))
    freq = read_token_freq(plain)
    assert freq is not None and int(freq.sum()) - freq.size == n_tokens > 100 and freq.min() == 1
