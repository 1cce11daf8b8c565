"""Facts in real text asked in other words: the questions people ask about a long document.

Each prompt is a document's opening (prose, code, legal, science, encyclopedic or chat text) with four facts put
at random paragraph or line boundaries, each fact written for its domain. The first question asks for one fact in
words that share no run of four with any fact of the prompt (`shares_run` proves it for every sample), so the
lexical net has nothing to match; the follow-up asks for another fact, as a chat continuation over the cache the
first request left (the server's `cache_prompt`), so its rows are whatever the first prefill made of them.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass, field
from typing import Callable

from .arms import SelectorOptions

RUN = 4  # the lexical net matches runs of this many words


@dataclass(frozen=True)
class FactTemplate:
    domain: str
    fact: str       # {value} is the answer; {name} and {place} name who or where
    question: str   # the same fact in other words


FACTS = (
    FactTemplate("prose", "When the storm had finally passed, {name} counted {value} sheep left in the lower meadow.",
                 "After the bad weather ended, how many animals of the flock did {name} find still grazing in the "
                 "field below?"),
    FactTemplate("prose", "The innkeeper at {place} charged travellers {value} pennies for a bed and a bowl of soup.",
                 "What price did the man running the lodging house in {place} ask of visitors for a night's rest "
                 "with supper?"),
    FactTemplate("prose", "Her brother's letter was sealed with green wax and dated {value}, the year the mill burned.",
                 "In which year was the message her sibling sent written, according to its date?"),
    FactTemplate("code", "UPLOAD_RETRY_LIMIT = {value}  # a failed upload is tried again at most this many times",
                 "In the source, what number caps how often sending a file that did not arrive gets repeated?"),
    FactTemplate("code", "METRICS_EXPORTER_PORT = {value}  # where the metrics exporter listens by default",
                 "Which network port does the component that publishes measurements accept connections on?"),
    FactTemplate("legal", "A tenant who leaves before the term ends shall pay the landlord a penalty of {value} "
                          "dollars.",
                 "What sum does an occupant owe the owner of the property for moving out early?"),
    FactTemplate("legal", "Any person who fails to file the annual report with the clerk of {place} shall be fined "
                          "{value} dollars for each day of delay.",
                 "How much is charged per late day to someone in {place} who does not submit the yearly statement?"),
    FactTemplate("science", "In the final trial the alloy melted at {value} degrees Celsius, well above the earlier "
                            "estimate.",
                 "What temperature did the metal mixture turn liquid at during the last experiment?"),
    FactTemplate("science", "The survey recorded {value} nesting pairs of herons along the {place} estuary.",
                 "How many breeding couples of those wading birds did the study count near the river mouth at "
                 "{place}?"),
    FactTemplate("encyclo", "The stone bridge at {place} was completed in {value} after nine years of work.",
                 "In which year did builders finish the crossing over the river at {place}?"),
    FactTemplate("encyclo", "The lighthouse on the cape near {place} stands {value} feet tall.",
                 "How high is the tower that guides ships off the coast by {place}?"),
    FactTemplate("chat", "{name}: okay, so the budget for the new prototype is {value} euros, that's final.",
                 "How much money was agreed on for building the next trial version of the product?"),
)
DOMAINS = tuple(sorted({f.domain for f in FACTS}))
NAMES = ("Marta", "Tobias", "Ilse", "Corwin", "Agnes", "Rufus", "Delia", "Osric", "Wren", "Hugo", "Petra", "Silas")
PLACES = ("Harlow Cross", "Emberfield", "Kestrel Bay", "Old Wick", "Farrowdale", "Minster Ford", "Coldharbour",
          "Ashby Marsh", "Ravenhythe", "Thornbury")


def words(text: str) -> list[str]:
    """Lower-case words as the lexical net sees them: runs of letters and digits."""
    return re.findall(r"[a-z0-9]+", text.lower())


def shares_run(a: str, b: str, n: int = RUN) -> bool:
    """Whether a and b have a run of n words in common."""
    wa, wb = words(a), words(b)
    grams = {tuple(wa[i:i + n]) for i in range(len(wa) - n + 1)}
    return any(tuple(wb[i:i + n]) in grams for i in range(len(wb) - n + 1))


@dataclass(frozen=True)
class Fact:
    domain: str
    text: str
    question: str
    answer: str


def make_fact(t: FactTemplate, rng: random.Random, taken: set[str]) -> Fact:
    """The template with a name, a place and an answer no other fact of the prompt has (a year for the dated
    facts, else a number of three or four digits)."""
    while True:
        value = str(rng.randrange(1620, 1890) if "year" in t.question.lower() else rng.randrange(120, 9900))
        if value not in taken:
            break
    slots = {"name": rng.choice(NAMES), "place": rng.choice(PLACES), "value": value}
    return Fact(t.domain, t.fact.format(**slots), t.question.format(**slots), value)


def choose_facts(domain: str, rng: random.Random, n: int = 4) -> list[Fact]:
    """n facts, those of the document's domain first; every question clear of every fact by shares_run."""
    own = [t for t in FACTS if t.domain == domain]
    other = [t for t in FACTS if t.domain != domain]
    rng.shuffle(own)
    rng.shuffle(other)
    facts: list[Fact] = []
    for t in (own + other)[:n]:
        facts.append(make_fact(t, rng, {f.answer for f in facts}))
    for q in facts:
        for f in facts:
            if shares_run(q.question, f.text):
                raise AssertionError(f"question {q.question!r} repeats a run of {RUN} words of {f.text!r}")
    return facts


def boundaries(text: str) -> list[int]:
    """Where a fact may go: after a blank line, or after any line break where there are few blank lines."""
    paras = [m.end() for m in re.finditer(r"\n\s*\n", text)]
    return paras if len(paras) >= 16 else [m.end() for m in re.finditer(r"\n", text)]


@dataclass
class FactSample:
    sample_id: str
    document: str
    domain: str
    n_tokens: int
    facts: list[dict]             # Fact fields and rows: [first, end) prompt rows
    asked: int                    # the first question's fact
    follow_up: int                # the follow-up's fact
    prompt_sha: str

    def filled_region(self, tail: int, k: int) -> bool:
        """Fact k lies before the first prefill's tail."""
        return self.facts[k]["rows"][1] <= self.n_tokens - tail


def body(document: str, question: str) -> str:
    return ("Read the document below, then answer the question after it in a few words.\n\n"
            f"<document>\n{document}\n</document>\n\nQuestion: {question}")


class FactPromptBuilder:
    """Prompts of about `length` tokens from a document's opening, with four facts in it."""

    def __init__(self, tokenize: Callable[[str], list[int]], chat: Callable[[list[dict]], str] | None):
        self.tokenize = tokenize  # text (with special markup) -> tokens, BOS included
        self.chat = chat          # messages -> the formatted conversation up to the assistant's turn, or None

    def first(self, document: str, question: str) -> str:
        text = body(document, question)
        return self.chat([{"role": "user", "content": text}]) if self.chat else f"{text}\nAnswer:"

    def follow_up(self, document: str, question: str, answer: str, question2: str) -> str:
        """The conversation after the first answer, asking question2."""
        again = f"Another question about the same document: {question2}"
        if self.chat:
            return self.chat([{"role": "user", "content": body(document, question)},
                              {"role": "assistant", "content": answer}, {"role": "user", "content": again}])
        return f"{self.first(document, question)}{answer}\n{again}\nAnswer:"

    def opening(self, text: str, cut: int, length: int, overhead: int) -> str:
        """The document's opening that makes a prompt of about `length` tokens with `overhead` more, from a first
        guess of its length in characters. The tokenizer's rate varies along a document, so the cut is rescaled
        three times; where a rate changes too much for that (tables, numbers) and the prompt is still more than 2%
        off, the longest opening that fits is found by bisection."""
        def size(c: int) -> int:
            return len(self.tokenize(text[:c])) + overhead

        for _ in range(3):
            cut = int(cut * length / max(size(cut), 1))
        if 0.97 * length <= size(cut) <= 1.02 * length:
            return text[:cut]
        lo, hi = 0, min(len(text), 4 * max(cut, 1))
        if size(hi) <= length:
            return text[:hi]
        while hi - lo > 8:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if size(mid) <= length else (lo, mid)
        return text[:lo]

    def build(self, name: str, domain: str, text: str, length: int, index: int, seed: int
              ) -> tuple[FactSample, list[int], str]:
        rng = random.Random(f"{seed}/{name}/{length}/{index}")
        facts = choose_facts(domain, rng)
        asked, follow_up = rng.sample(range(len(facts)), 2)
        question = facts[asked].question
        # the document's opening, cut to leave room for the facts and the question
        overhead = len(self.tokenize(self.first("\n".join(f.text for f in facts), question)))
        per_char = len(self.tokenize(text[:20000])) / max(len(text[:20000]), 1)
        document = self.opening(text, int((length - overhead) / max(per_char, 1e-6)), length, overhead)
        spots = boundaries(document) or [len(document)]
        at = sorted(rng.sample(spots, min(len(facts), len(spots))) if len(spots) >= len(facts)
                    else [rng.choice(spots) for _ in facts])
        order = list(range(len(facts)))
        rng.shuffle(order)
        parts, last = [], 0
        for k, pos in zip(order, at):
            parts += [document[last:pos], facts[k].text + "\n"]
            last = pos
        parts.append(document[last:])
        document = "".join(parts)
        prompt = self.first(document, question)
        tokens = self.tokenize(prompt)
        rows = {}
        for k in order:
            start = prompt.index(facts[k].text)
            rows[k] = [len(self.tokenize(prompt[:start])), len(self.tokenize(prompt[:start + len(facts[k].text)]))]
        fields = [{**f.__dict__, "rows": rows[k]} for k, f in enumerate(facts)]
        sha = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]
        sample = FactSample(f"{domain}-{length}-{index}", name, domain, len(tokens), fields, asked, follow_up, sha)
        return sample, tokens, document


def answered(prediction: str, answer: str) -> float:
    """1 when the answer's digits appear in the prediction (case and spacing aside), else 0."""
    return float(answer in re.sub(r"[\s,]", "", prediction))


# --- the instrument: `ridgefill-gguf eval facts` ---------------------------------------------------------------

MAX_NEW = 24
# what kept a fact's row exact: "number" is a digit whose reason a run made before the engine said it (API 22) did
# not record (the probe's ranking or a whole number completed); later runs tell them apart
MECHANISMS = ("tail", "special", "lexical", "whole_number", "number", "selected", "filled")
CORPUS_DOMAINS = {"shakespeare": "prose", "python": "code"}  # the default corpus's folders


@dataclass
class FactOptions:
    docs: tuple[str, ...] = ()      # files or folders (a folder per domain); none: the default corpus's held-out text
    lengths: tuple[int, ...] = (4096,)
    samples: int = 12
    tails: tuple[int, ...] = (1024,)
    arms: tuple[str, ...] = ("ridge", "ridge+probe", "ridge+random:probe")
    fmt: str = "auto"
    seed: int = 0
    threads: int | None = None
    n_gpu_layers: int = 0
    flash_attn: bool = True
    selectors: SelectorOptions = field(default_factory=SelectorOptions)
    # the follow-up also as llama-server's --ridgefill-reuse exact-only serves it: a fresh RidgeFill prefill of the
    # whole conversation, so the probe ranks the rows for the new question
    exact_only_follow_up: bool = False
    # the follow-up also prefilled again with the first prefill's exact rows kept exact and the probe ranking the
    # rest for the new question: what a follow-up that re-ranks the reused cache's filled rows would read (the
    # engine serves no such follow-up yet; the research API's listed rows emulate it)
    rerank_follow_up: bool = False
    # (i, n): only the samples whose index is i modulo n, for runs side by side in one folder; they write no
    # summary, and a whole run (0, 1) afterwards answers what they left and writes it
    shard: tuple[int, int] = (0, 1)
    summary_only: bool = False      # summarize the folder's answers again; load no model, answer nothing


# the questions a summary reports: (turn, the answer's score field, the fact asked, the mechanisms' field)
TURNS = (("first", "score", "asked", "mechanisms"), ("follow_up", "score_follow_up", "follow_up", "mechanisms"),
         ("follow_up_exact_only", "score_follow_up_exact_only", "follow_up", "mechanisms_exact_only"),
         ("follow_up_rerank", "score_follow_up_rerank", "follow_up", "mechanisms_rerank"))
# the turns asked only on request: the option that asks each
OPTIONAL_TURNS = {"follow_up_exact_only": "exact_only_follow_up", "follow_up_rerank": "rerank_follow_up"}


def mechanism_counts(rows: list[int], st: dict, first_tail: int, special: set[int]) -> dict[str, int]:
    """Per row of a fact, what kept it exact in the prefill, or that it was filled: the tail, a special token, the
    lexical net's match, a whole number the budgeted probe completed (the engine's own record of both), or the
    selector's choice (the probe's ranking, or the arm's random or protected rows)."""
    exact = set(st.get("exact_rows", []))
    lexical, whole = set(st.get("lexical_rows", [])), set(st.get("whole_numbers_rows", []))
    out = dict.fromkeys(MECHANISMS, 0)
    for r in range(*rows):
        kind = ("tail" if r >= first_tail else "filled" if r not in exact else "special" if r in special else
                "lexical" if r in lexical else "whole_number" if r in whole else "selected")
        out[kind] += 1
    return out


def _documents(opts: FactOptions) -> list[tuple[str, str, str]]:
    """(name, domain, text) of every document, in a stable order."""
    from ..corpus import default_corpus
    from ..fit.capture import iter_documents
    from .documents import domain

    paths = list(opts.docs) or [str(default_corpus() / "heldout")]
    by_domain: dict[str, list] = {}
    for doc in iter_documents(paths):
        d = domain(doc.name)
        d = d if d in DOMAINS else CORPUS_DOMAINS.get(d, "prose")
        by_domain.setdefault(d, []).append((doc.name, d, doc.text))
    # the domains in turn, so that the first samples already cover every one
    lists = [by_domain[d] for d in sorted(by_domain)]
    return [docs[i] for i in range(max(map(len, lists))) for docs in lists if i < len(docs)]


STATS_KEPT = ("applied", "n_filled", "n_exact", "n_tail", "n_probe_exact", "n_lexical", "n_whole_numbers", "n_budget",
              "reason", "held")


def ranges_of(rows: list[int]) -> list[list[int]]:
    """Ascending rows as [first, end) runs, the compact form a record keeps."""
    out: list[list[int]] = []
    for r in rows:
        if out and out[-1][1] == r:
            out[-1][1] = r + 1
        else:
            out.append([r, r + 1])
    return out


def rows_of(ranges: list[list[int]]) -> list[int]:
    return [r for a, b in ranges for r in range(a, b)]


class FactConversations:
    """One engine session asking each sample's questions, per arm: the first question, the follow-up over the cache
    the first answer left and, when asked for, the follow-up as --ridgefill-reuse exact-only serves it and re-ranked
    for its question beside the first prefill's exact rows."""

    def __init__(self, sess, builder: "FactPromptBuilder", opts: FactOptions):
        self.sess, self.builder, self.opts = sess, builder, opts

    def follow_up_tokens(self, sample: FactSample, document: str, pred: str) -> list[int]:
        f1, f2 = sample.facts[sample.asked], sample.facts[sample.follow_up]
        return self.sess.tokenize(self.builder.follow_up(document, f1["question"], pred, f2["question"]),
                                  special=True)

    def first_turn(self, sample: FactSample, tokens: list[int], document: str, params: dict | None) -> dict:
        """Both questions, the follow-up over the cache the first answer left, with what kept the facts exact."""
        sess = self.sess
        if params is None:
            logits, _ = sess.stock(tokens)
            st = {}
        else:
            logits, _, st = sess.ridgefill(tokens, **params)
        out1, _ = sess.follow(logits, len(tokens), MAX_NEW)
        pred1 = sess.detokenize(out1)
        tokens2 = self.follow_up_tokens(sample, document, pred1)
        cached = tokens + (out1[:-1] if len(out1) == MAX_NEW else out1)
        logits2, reused = sess.extend(cached, tokens2)
        pred2 = sess.detokenize(sess.greedy(logits2, len(tokens2), MAX_NEW))
        r = {"pred": pred1, "pred_follow_up": pred2, "reused": reused,
             "score": answered(pred1, sample.facts[sample.asked]["answer"]),
             "score_follow_up": answered(pred2, sample.facts[sample.follow_up]["answer"])}
        return {**r, **self.prefill_record(sample, tokens, st, "")}

    def exact_only_turn(self, sample: FactSample, document: str, r: dict, params_for) -> dict:
        """The follow-up after the first answer r["pred"] as --ridgefill-reuse exact-only serves it: a RidgeFill
        prefill of the conversation with the arm's parameters for its length (params_for(n) -> params, or None for
        stock, whose exact cache that policy keeps whole), resumed from the split state the engine holds from the
        last prefill of the same rows (stats "held": how many; the rows below the split run alike in every arm)."""
        tokens2 = self.follow_up_tokens(sample, document, r["pred"])
        params = params_for(len(tokens2))
        if params is None:
            return {"pred_follow_up_exact_only": r["pred_follow_up"],
                    "score_follow_up_exact_only": r["score_follow_up"]}
        logits, _, st = self.sess.ridgefill_resumed(tokens2, **params)
        pred = self.sess.detokenize(self.sess.greedy(logits, len(tokens2), MAX_NEW))
        return {"pred_follow_up_exact_only": pred,
                "score_follow_up_exact_only": answered(pred, sample.facts[sample.follow_up]["answer"]),
                **self.prefill_record(sample, tokens2, st, "_exact_only")}

    def rerank_turn(self, sample: FactSample, tokens: list[int], document: str, r: dict, params_for,
                    first_params_for) -> dict:
        """The follow-up after the first answer r["pred"] as --ridgefill-reuse rerank serves it: prefilled again
        (resumed from the held split state) with the rows the first prefill ran exactly (its chosen prefix rows and
        its tail) listed exact, the arm's selector ranking the rest for the new question (params_for(n) -> params,
        or None for stock); the engine's keep_held_exact gives the same bytes (tests/test_engine_resume.py). The
        first prefill's rows come from r, or from that prefill run again with its own parameters (first_params_for)
        where a run before this option left them out."""
        tokens2 = self.follow_up_tokens(sample, document, r["pred"])
        params = params_for(len(tokens2))
        if params is None:
            return {"pred_follow_up_rerank": r["pred_follow_up"], "score_follow_up_rerank": r["score_follow_up"]}
        if "exact_ranges" in r:
            prefix, n_tail = rows_of(r["exact_ranges"]), r["stats"]["n_tail"]
        else:
            st = self.sess.ridgefill(tokens, **first_params_for(len(tokens)))[2]
            prefix, n_tail = st["exact_rows"], st["n_tail"]
        kept = prefix + list(range(len(tokens) - 1 - n_tail, len(tokens) - 1))
        logits, _, st = self.sess.ridgefill_resumed(tokens2, **{**params, "exact_rows": kept})
        pred = self.sess.detokenize(self.sess.greedy(logits, len(tokens2), MAX_NEW))
        return {"pred_follow_up_rerank": pred, "kept_exact": len(kept),
                "score_follow_up_rerank": answered(pred, sample.facts[sample.follow_up]["answer"]),
                **self.prefill_record(sample, tokens2, st, "_rerank")}

    def prefill_record(self, sample: FactSample, tokens: list[int], st: dict, suffix: str) -> dict:
        """A prefill's statistics and, where RidgeFill ran, what kept each fact's rows exact (and for the first
        prefill, when a re-ranked follow-up will list them, its exact prefix rows as ranges)."""
        from ..select.pieces import prompt_pieces

        out = {"stats" + suffix: {k: st[k] for k in STATS_KEPT if k in st}}
        if suffix == "" and self.opts.rerank_follow_up and st.get("applied"):
            out["exact_ranges"] = ranges_of(st["exact_rows"])
        if st.get("applied"):
            _, breaks = prompt_pieces(self.sess.llama_cpp, self.sess.llm.model, tokens[:-1])
            prefix = len(tokens) - 1 - st["n_tail"]
            special = {0} | {i for i, b in enumerate(breaks) if b}
            out["mechanisms" + suffix] = [mechanism_counts(f["rows"], st, prefix, special) for f in sample.facts]
        return out


def run_facts(model, maps: list, out_dir, opts: FactOptions, log: Callable[[str], None] = print) -> dict:
    from pathlib import Path

    from .. import libs
    from ..engine.session import Session
    from ..gguf_io import read_gguf
    from .arms import parse_arms
    from .documents import load_jsonl, refuse_packed

    arms = parse_arms(opts.arms, follows=True)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    done = {(r["sample"], r["config"], r["arm"]): r for r in load_jsonl(out_dir / "results.jsonl")}
    splits = {str(m): int(read_gguf(m).get("ridgefill.split")) for m in maps}
    if opts.summary_only:
        return summarize_facts_folder(out_dir, list(done.values()), model, maps, splits, opts)
    refuse_packed(out_dir)
    docs = [d for d in _documents(opts) if len(d[2]) > 4 * max(opts.lengths)]
    if not docs:
        raise ValueError(f"no document is long enough for {max(opts.lengths)} tokens")
    libs.use_build("ridgefill")
    # a prompt may be 2% over its length (opening), then two answers and the follow-up question
    sess = Session(model, n_ctx=int(1.02 * max(opts.lengths)) + 3 * MAX_NEW + 256, n_batch=512, n_ubatch=512,
                   flash_attn=opts.flash_attn, n_threads=opts.threads, n_gpu_layers=opts.n_gpu_layers)
    fmt = opts.fmt if opts.fmt != "auto" else ("chat" if sess.chat_template() else "completion")
    talk = FactConversations(sess, FactPromptBuilder(lambda t: sess.tokenize(t, special=True),
                                                     sess.apply_chat if fmt == "chat" else None), opts)
    samples: list[FactSample] = []
    indices = range(opts.shard[0], opts.samples, opts.shard[1])
    try:
        for length in opts.lengths:
            for index in indices:
                name, dom, text = docs[index % len(docs)]
                sample, tokens, document = talk.builder.build(name, dom, text, length, index, opts.seed)
                samples.append(sample)
                asked, marks = answer_sample(talk, sample, tokens, document, arms, splits, done, out_dir)
                log(f"eval facts: sample {len(samples)}/{len(opts.lengths) * len(indices)} ({sample.domain}, "
                    f"{sample.n_tokens} tokens): " + ", ".join(marks))
                # a whole run keeps its samples and summary as it goes, so that a run a deadline cuts has them
                if opts.shard == (0, 1) and asked:
                    write_facts_summary(out_dir, samples, list(done.values()), model, maps, splits, opts, fmt)
    finally:
        sess.close()
    if opts.shard != (0, 1):
        return {}
    return write_facts_summary(out_dir, samples, list(done.values()), model, maps, splits, opts, fmt)


def answer_sample(talk: FactConversations, sample: FactSample, tokens: list[int], document: str, arms: list,
                  splits: dict, done: dict, out_dir) -> tuple[bool, list[str]]:
    """Every arm's answers to one sample that `done` lacks (appended to results.jsonl and kept in done); a run
    resumed with the exact-only or re-ranked follow-up adds it to the answers it has. (whether any was asked,
    progress marks)"""
    from .arms import arm_params, selected
    from .documents import append_jsonl

    opts = talk.opts
    jobs = [("exact", None, None, None)] + [(f"S{split}-T{tail}", m, tail, arm) for m, split in splits.items()
                                            for tail in opts.tails for arm in arms]
    counts: dict = {}  # per config and prefill (first, exact-only): the rows each selector chose, for its controls
    asked, marks = False, []
    for config, m, tail, arm in jobs:
        key = (sample.sample_id, config, "exact" if arm is None else arm.name)
        add = opts.exact_only_follow_up and "score_follow_up_exact_only" not in done.get(key, {})
        rerank = opts.rerank_follow_up and "score_follow_up_rerank" not in done.get(key, {})

        def params_for(n: int, turn: str = "first") -> dict | None:
            if arm is None:
                return None
            talk.sess.attach(m)
            return {**arm_params(arm, n, tail, opts.selectors, counts.get((config, turn), {})), "tail": tail,
                    "min_prefix": 0}

        if key not in done or add or rerank:
            r = dict(done[key]) if key in done else talk.first_turn(sample, tokens, document, params_for(len(tokens)))
            if add:
                r.update(talk.exact_only_turn(sample, document, r, lambda n: params_for(n, "exact_only")))
            if rerank:
                r.update(talk.rerank_turn(sample, tokens, document, r, lambda n: params_for(n, "rerank"),
                                          params_for))
            r.update(sample=sample.sample_id, config=config, arm=key[2])
            append_jsonl(out_dir / "results.jsonl", r)
            done[key], asked = r, True
        if arm is not None and arm.selector:
            for turn, suffix in (("first", ""), ("exact_only", "_exact_only"), ("rerank", "_rerank")):
                if "stats" + suffix in done[key]:
                    counts.setdefault((config, turn), {})[arm.selector] = selected(done[key]["stats" + suffix],
                                                                                   arm.selector)
        marks.append(f"{key[1]} {key[2]} {done[key]['score']:.0f}/{done[key]['score_follow_up']:.0f}")
    return asked, marks


def write_facts_summary(out_dir, samples: list[FactSample], answers: list[dict], model, maps: list, splits: dict,
                        opts: FactOptions, fmt: str, machine: dict | None | bool = False,
                        summary_pass: dict | None = None, made_with: dict | None = None) -> dict:
    from pathlib import Path

    from ..util import hardware, write_atomic
    from .documents import write_summary

    write_atomic(Path(out_dir) / "samples.jsonl", "".join(json.dumps(s.__dict__) + "\n" for s in samples))
    result = summarize(samples, answers, splits, opts)
    result.update(instrument="eval facts", hardware=hardware() if machine is False else machine, model=str(model),
                  maps=[str(m) for m in maps], format=fmt,
                  options={k: v for k, v in opts.__dict__.items() if k != "selectors"} | (made_with or {}),
                  selectors=opts.selectors.__dict__, **({"summary_pass": summary_pass} if summary_pass else {}))
    write_summary(out_dir, result, markdown(result), plot)
    return result


# the options that say how a run's answers were made, which a summary-only pass keeps from the run's summary
MADE_WITH = ("docs", "threads", "n_gpu_layers", "flash_attn", "shard")


def summarize_facts_folder(out_dir, answers: list[dict], model, maps: list, splits: dict,
                           opts: FactOptions) -> dict:
    """The summary of the answers already in out_dir, with this version's summary: its samples.jsonl as the run
    wrote it, the model, maps, hardware and prompt format of the run's own summary.json (where the answers were
    made), and this pass's machine recorded apart."""
    from pathlib import Path

    from ..util import hardware
    from .documents import jsonl_parts, load_jsonl

    out_dir = Path(out_dir)
    if not jsonl_parts(out_dir / "samples.jsonl"):
        raise ValueError(f"--summary-only: {out_dir / 'samples.jsonl'} is missing (no whole run wrote samples there)")
    samples = [FactSample(**r) for r in load_jsonl(out_dir / "samples.jsonl")]
    before = json.loads((out_dir / "summary.json").read_text()) if (out_dir / "summary.json").exists() else {}
    return write_facts_summary(out_dir, samples, answers, before.get("model", model), before.get("maps", maps),
                               splits, opts, before.get("format", opts.fmt), machine=before.get("hardware"),
                               summary_pass={"hardware": hardware(), "note": "--summary-only: the answers in "
                                             "results.jsonl were made by earlier runs; this pass answered nothing"},
                               made_with={k: v for k, v in before.get("options", {}).items() if k in MADE_WITH})


def paired_scores(samples: list[FactSample], by: dict, config: str, arm: str, field: str, fact: str,
                  tail: int) -> tuple[list[FactSample], list[dict], list[float]]:
    """The samples whose fact (asked or follow_up) lies before the tail and that exact and the arm both answered
    (the score field), the arm's answers, and its score minus exact's on each."""
    got = [s for s in samples if s.filled_region(tail, getattr(s, fact))
           and field in by.get((s.sample_id, "exact", "exact"), {}) and field in by.get((s.sample_id, config, arm), {})]
    rows = [by[(s.sample_id, config, arm)] for s in got]
    return got, rows, [r[field] - by[(s.sample_id, "exact", "exact")][field] for s, r in zip(got, rows)]


# the samples an arm answered differently from exact: lost (exact right, the arm wrong) or won, and whether any of the
# asked fact's rows was filled in the prefill the answer read, or all were exact (so the fill elsewhere decided)
DISCORDANT = ("lost_filled", "lost_exact", "won_filled", "won_exact")


def summarize(samples: list[FactSample], answers: list[dict], splits: dict, opts: FactOptions) -> dict:
    """Per configuration and arm, for the first question and the follow-up: accuracy on the samples whose asked
    fact lies before the tail, the paired difference from exact (bootstrap within domains), and what kept the
    asked facts' rows exact."""
    from .stats import bootstrap_mean, mean_or_none

    by = {(r["sample"], r["config"], r["arm"]): r for r in answers}
    configs = {}
    for split in sorted(set(splits.values())):
        for tail in opts.tails:
            name = f"S{split}-T{tail}"
            table = {}
            for turn, score, fact, mech_field in TURNS:
                if turn in OPTIONAL_TURNS and not getattr(opts, OPTIONAL_TURNS[turn]):
                    continue
                usable = [s for s in samples if s.filled_region(tail, getattr(s, fact))
                          and score in by.get((s.sample_id, "exact", "exact"), {})]
                exact = [by[(s.sample_id, "exact", "exact")][score] for s in usable]
                arms = {"exact": {"accuracy": mean_or_none(exact)}}
                for arm in opts.arms:
                    got, rows, diffs = paired_scores(samples, by, name, arm, score, fact, tail)
                    mech = dict.fromkeys(MECHANISMS, 0)
                    discordant = dict.fromkeys(DISCORDANT, 0)
                    for s, r, d in zip(got, rows, diffs):
                        counts = (r.get(mech_field) or [{}] * len(s.facts))[getattr(s, fact)]
                        for k, v in counts.items():
                            mech[k] += v
                        if d:
                            rows_filled = "_filled" if counts.get("filled") else "_exact"
                            discordant[("won" if d > 0 else "lost") + rows_filled] += 1
                    paired_exact = [by[(s.sample_id, "exact", "exact")][score] for s in got]
                    arms[arm] = {"accuracy": mean_or_none([r[score] for r in rows]), "samples": len(rows),
                                 "exact_accuracy": mean_or_none(paired_exact),
                                 "delta": bootstrap_mean(diffs, strata=[s.domain for s in got]), "fact_rows": mech,
                                 "discordant": discordant}
                table[turn] = {"samples": len(usable), "arms": arms}
            configs[name] = {"split": split, "tail": tail, "turns": table}
    return {"configs": configs, "n_samples": len(samples),
            "domains": sorted({s.domain for s in samples})}


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}"


def markdown(result: dict) -> str:
    from pathlib import Path

    o = result["options"]
    lines = [f"# Facts asked in other words: {Path(result['model']).name}", "",
             f"{result['n_samples']} prompts of {', '.join(map(str, o['lengths']))} tokens "
             f"({', '.join(result['domains'])}); "
             f"{result['format']} prompts; seed {o['seed']}. Accuracy in % on the samples whose asked fact lies "
             "before the tail (exact's on the samples the arm answered); Δ = arm minus exact, paired [95% bootstrap "
             "interval]. The follow-up asks another fact "
             "over the cache the first answer left; follow_up_exact_only asks it as llama-server's --ridgefill-reuse "
             "exact-only serves it, a fresh RidgeFill prefill of the conversation; follow_up_rerank prefills it "
             "again keeping the first prefill's exact rows exact and ranking the rest for the new question, as "
             "--ridgefill-reuse rerank serves it. Fact rows: what kept the asked "
             "fact's rows exact in the prefill the answer read (tail / special / lexical net / whole number completed / "
             "digit, probe or whole number, in runs before API 22 / the selector's ranking / filled).", "",
             "Lost / won: the samples exact answered and the arm did not / the other way, where any of the asked "
             "fact's rows was filled + where all were exact.", "",
             "| config | question | samples | exact | arm | accuracy | Δ | fact rows t/s/l/w/d/sel/filled "
             "| lost / won |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, c in result["configs"].items():
        for turn, t in c["turns"].items():
            for arm in o["arms"]:
                a = t["arms"][arm]
                d = a["delta"]
                delta = "n/a" if not d["n"] else f"{100 * d['mean']:+.0f} [{100 * d['lo']:+.0f}, {100 * d['hi']:+.0f}]"
                m = "/".join(str(a["fact_rows"][k]) for k in MECHANISMS)
                x = a["discordant"]
                lost_won = f"{x['lost_filled']}+{x['lost_exact']} / {x['won_filled']}+{x['won_exact']}"
                # exact on the samples this arm answered: an arm run on fewer prompts is compared on those
                lines.append(f"| {name} | {turn} | {a['samples']} | {_pct(a['exact_accuracy'])} | {arm} | "
                             f"{_pct(a['accuracy'])} | {delta} | {m} | {lost_won} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..util import save_figure

    arms = ["exact", *result["options"]["arms"]]
    configs = list(result["configs"].items())
    fig, axes = plt.subplots(1, len(configs), figsize=(6 * len(configs), 4), squeeze=False)
    for ax, (name, c) in zip(axes[0], configs):
        turns = list(c["turns"])
        width = 0.8 / len(turns)
        for i, turn in enumerate(turns):
            ys = [100 * (c["turns"][turn]["arms"][a]["accuracy"] or 0) for a in arms]
            ax.bar([k + (i - (len(turns) - 1) / 2) * width for k in range(len(arms))], ys, width,
                   label=turn.replace("_", "-"))
        ax.set_xticks(range(len(arms)), arms, rotation=20, fontsize=8)
        ax.set_ylim(0, 105)
        ax.set_ylabel("facts answered (%)")
        ax.set_title(name)
        ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
