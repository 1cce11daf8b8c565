"""`ridgefill-gguf eval needles`: RULER-style retrieval, scored on the samples whose needles lie in the filled region.

Tasks (RULER's NIAH family, paper §3.2), generated from a seed so that every arm sees the same prompts:
  single      one needle ("One of the special magic numbers for <key> is: <7 digits>.") in a noise haystack;
  multikey    four needles with different keys, the question asks for one;
  multivalue  four needles with the same key, the question asks for all four values;
  multiquery  four needles with different keys, the question asks for all four.
Lengths count the model's own tokens. Instruct models (the GGUF has a chat template) get the question as a chat
turn; base models a completion prompt. Both end with RULER's answer prefix. Answers are greedy, scored with
RULER's string_match_all (the share of expected values that appear in the answer).

The exact arm runs once per sample; each configuration (maps file = split, tail T) runs the RidgeFill arms.
A sample counts as filled-region for a configuration when every needle lies before the tail (rows < n - T).
Results are appended per (sample, configuration, arm), so an interrupted run resumes.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from ..util import hardware, save_figure, write_atomic
from .arms import ROW_COUNTS, SelectorOptions, arm_params, parse_arms, selected
from .documents import append_jsonl, jsonl_parts, load_jsonl, refuse_packed, write_summary
from .stats import bootstrap_mean, mean_or_none

TASKS = ("single", "multikey", "multivalue", "multiquery")
ARMS = ("ridge", "identity")
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
N_NEEDLES = {"single": 1, "multikey": 4, "multivalue": 4, "multiquery": 4}
MAX_NEW = {"single": 24, "multikey": 24, "multivalue": 64, "multiquery": 64}
# two-word keys, as RULER's word keys
ADJECTIVES = ("amber", "brave", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen",
              "lively", "mellow", "noisy", "odd", "proud", "quiet", "rapid", "silent", "tidy", "upbeat", "vivid",
              "witty", "young", "zealous", "bitter", "clever", "dim", "fuzzy", "grumpy")
NOUNS = ("anchor", "badger", "candle", "dolphin", "engine", "falcon", "garden", "harbor", "island", "jacket",
         "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "rocket", "saddle", "tunnel",
         "umbrella", "violin", "walnut", "yacht", "zipper", "beacon", "canyon", "donkey", "ember", "fossil")


@dataclass
class Sample:
    sample_id: str
    task: str
    length: int                 # the asked length
    n_tokens: int               # the prompt's tokens
    answers: list[str]
    needle_rows: list[list[int]]  # [first, end) prompt rows of each needle
    prompt_sha: str

    def filled_region(self, tail: int) -> bool:
        """Every needle before the tail (the last `tail` prompt rows run exactly)."""
        return all(end <= self.n_tokens - tail for _, end in self.needle_rows)

    def first_tail_row(self, n_tail_prefilled: int) -> int:
        """The tail's first row, from a RidgeFill prefill's n_tail: the prefill covers the prompt less its last
        token, whose row is the tail's too."""
        return self.n_tokens - 1 - n_tail_prefilled

    def needle_rows_exact(self, exact_rows: list[int], first_tail_row: int) -> list[int]:
        """Per needle, how many of its rows ran exactly: the exact prefix rows (special and selected) and the tail."""
        exact = set(exact_rows)
        return [sum(r in exact or r >= first_tail_row for r in range(first, end)) for first, end in self.needle_rows]


def ruler_string_match_all(prediction: str, answers: list[str]) -> float:
    """RULER's string_match_all: the share of expected answers found in the prediction, case-insensitive."""
    pred = prediction.lower()
    return sum(a.lower() in pred for a in answers) / len(answers)


def _question(task: str, keys: list[str]) -> tuple[str, str]:
    """(question, answer prefix) as RULER words them."""
    if task == "multivalue":
        return (f"What are all the special magic numbers for {keys[0]} mentioned in the provided text?",
                f"The special magic numbers for {keys[0]} mentioned in the provided text are")
    if task == "multiquery":
        ks = ", ".join(keys[:-1]) + f", and {keys[-1]}"
        return (f"What are all the special magic numbers for {ks} mentioned in the provided text?",
                f"The special magic numbers for {ks} mentioned in the provided text are")
    return (f"What is the special magic number for {keys[0]} mentioned in the provided text?",
            f"The special magic number for {keys[0]} mentioned in the provided text is")


def make_needles(task: str, rng: random.Random) -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """([(key, value)] in haystack order, the queried keys, the expected values)."""
    pairs = rng.sample([(a, n) for a in ADJECTIVES for n in NOUNS], N_NEEDLES[task])
    keys = [f"{a}-{n}" for a, n in pairs]
    values = [str(rng.randrange(1_000_000, 10_000_000)) for _ in keys]
    if task == "multivalue":
        keys = [keys[0]] * len(keys)
    needles = list(zip(keys, values))
    if task == "multikey":
        q = rng.randrange(len(needles))
        return needles, [keys[q]], [values[q]]
    if task == "multivalue":
        return needles, [keys[0]], values
    return needles, keys, values  # single, multiquery


class PromptBuilder:
    """Builds prompts of a given token length with the model's tokenizer and (for instruct models) chat template."""

    def __init__(self, tokenize: Callable[[str], list[int]], chat: Callable[[str], str] | None):
        self.tokenize = tokenize   # text (with special markup) -> tokens, BOS included
        self.chat = chat           # user message -> the formatted prompt up to the assistant's turn, or None
        self.noise_tokens = len(tokenize(NOISE * 20)) / 20

    def wrap(self, context: str, question: str, prefix: str) -> str:
        body = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
                f"I will quiz you about the numbers afterwards.\n{context}\n"
                f"What are all the special magic numbers mentioned in the provided text? {question}")
        if self.chat:
            return self.chat(body) + prefix
        return f"{body}\nAnswer: {prefix}"

    def build(self, task: str, length: int, index: int, seed: int) -> tuple[Sample, list[int]]:
        rng = random.Random(f"{seed}/{task}/{length}/{index}")
        needles, keys, answers = make_needles(task, rng)
        question, prefix = _question(task, keys)
        needle_texts = [f"One of the special magic numbers for {k} is: {v}. " for k, v in needles]
        overhead = len(self.tokenize(self.wrap("".join(needle_texts), question, prefix)))
        n_noise = max(1, int((length - overhead) / self.noise_tokens))
        # needles at random depths, at noise-sentence boundaries, in the order they were drawn
        depths = sorted(rng.randrange(0, n_noise + 1) for _ in needle_texts)
        parts, last = [], 0
        for d, text in zip(depths, needle_texts):
            parts += [NOISE * (d - last), text]
            last = d
        parts.append(NOISE * (n_noise - last))
        context = "".join(parts)
        prompt = self.wrap(context, question, prefix)
        tokens = self.tokenize(prompt)
        rows, start = [], 0
        for text in needle_texts:
            at = prompt.index(text, start)
            rows.append([len(self.tokenize(prompt[:at])), len(self.tokenize(prompt[:at + len(text)]))])
            start = at + len(text)
        sha = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]
        sample = Sample(f"{task}-{length}-{index}", task, length, len(tokens), answers, rows, sha)
        return sample, tokens


@dataclass
class NeedleOptions:
    tasks: tuple[str, ...] = TASKS
    lengths: tuple[int, ...] = (4096,)
    samples: int = 10               # per task and length
    tails: tuple[int, ...] = (1024,)
    arms: tuple[str, ...] = ARMS
    fmt: str = "auto"               # auto | chat | completion
    seed: int = 0
    threads: int | None = None
    n_gpu_layers: int = 0
    flash_attn: bool = True
    min_prefix: int = 256
    selectors: SelectorOptions = field(default_factory=SelectorOptions)
    shard: tuple[int, int] = (0, 1)  # (i, n): only the samples whose index is i modulo n
    summary_only: bool = False      # summarize the folder's answers; load no model, answer nothing


def config_name(split: int, tail: int) -> str:
    return f"S{split}-T{tail}"


def run_needles(model: str | Path, maps: list[str | Path], out_dir: str | Path, opts: NeedleOptions,
                log: Callable[[str], None] = print) -> dict:
    from .. import libs
    from ..engine.session import Session
    from ..gguf_io import read_gguf

    for t in opts.tasks:
        if t not in TASKS:
            raise ValueError(f"unknown task '{t}': one of {', '.join(TASKS)}")
    arms = parse_arms(opts.arms)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results_path = out_dir / "results.jsonl"
    done = {(r["sample"], r["config"], r["arm"]): r for r in load_jsonl(results_path)}
    if done:
        log(f"eval needles: resuming, {len(done)} answers done")
    splits = {str(m): int(read_gguf(m).get("ridgefill.split")) for m in maps}
    if opts.summary_only:
        return summarize_folder(out_dir, list(done.values()), model, maps, splits, opts)
    refuse_packed(out_dir)

    libs.use_build("ridgefill")
    n_ctx = max(opts.lengths) + max(MAX_NEW.values()) + 64
    sess = Session(model, n_ctx=n_ctx, n_batch=512, n_ubatch=512, flash_attn=opts.flash_attn,
                   n_threads=opts.threads, n_gpu_layers=opts.n_gpu_layers)
    template = sess.chat_template()
    fmt = opts.fmt if opts.fmt != "auto" else ("chat" if template else "completion")
    if fmt == "chat" and not template:
        raise ValueError("--format chat: the model has no chat template")
    builder = PromptBuilder(lambda text: sess.tokenize(text, special=True),
                            (lambda msg: sess.apply_chat_template(msg)) if fmt == "chat" else None)

    def answer(sample: Sample, tokens: list[int], arm: str, **params) -> dict:
        task = sample.task
        if arm == "exact":
            logits, _ = sess.stock(tokens)
            out, st = sess.greedy(logits, len(tokens), MAX_NEW[task]), {}
        elif params.get("fill") == "none":
            # every answer token from its own prefill, which hides the filled rows in the late layers
            out, st = sess.ridgefill_greedy(tokens, MAX_NEW[task], **params)
        else:
            logits, _, st = sess.ridgefill(tokens, **params)
            out = sess.greedy(logits, len(tokens), MAX_NEW[task])
        kept = {k: st[k] for k in ("applied", *ROW_COUNTS, "reason") if k in st}
        if st.get("applied") and "exact_rows" in st:
            kept["needle_rows_exact"] = sample.needle_rows_exact(st["exact_rows"], sample.first_tail_row(st["n_tail"]))
        return {"pred": sess.detokenize(out), "stats": kept}

    samples: list[Sample] = []
    # shards side by side in one folder each keep their own list, which --summary-only joins
    samples_path = out_dir / ("samples.jsonl" if opts.shard == (0, 1) else
                              f"samples.shard-{opts.shard[0]}-of-{opts.shard[1]}.jsonl")
    t0, n_new = time.perf_counter(), 0
    total = len(opts.tasks) * len(opts.lengths) * len(range(opts.shard[0], opts.samples, opts.shard[1]))
    try:
        for task in opts.tasks:
            for length in opts.lengths:
                for index in range(opts.shard[0], opts.samples, opts.shard[1]):
                    sample, tokens = builder.build(task, length, index, opts.seed)
                    samples.append(sample)
                    # the exact arm once, then per configuration every arm in order (a random arm takes the
                    # count its selector chose on this sample)
                    jobs = [("exact", None, None, None)]
                    for m, split in splits.items():
                        for tail in opts.tails:
                            if sample.n_tokens - tail >= opts.min_prefix:  # else the length does not allow the tail
                                jobs += [(config_name(split, tail), m, tail, arm) for arm in arms]
                    marks, counts = [], {}
                    for config, m, tail, arm in jobs:
                        name = "exact" if arm is None else arm.name
                        key = (sample.sample_id, config, name)
                        if key not in done:
                            if arm is None:
                                r = answer(sample, tokens, "exact")
                            else:
                                sess.attach(m)
                                params = arm_params(arm, len(tokens), tail, opts.selectors, counts.get(config, {}))
                                r = answer(sample, tokens, name, tail=tail, min_prefix=0, **params)
                            r.update(sample=sample.sample_id, config=config, arm=name,
                                     score=ruler_string_match_all(r["pred"], sample.answers))
                            append_jsonl(results_path, r)
                            done[key] = r
                            n_new += 1
                        if arm is not None and arm.selector:
                            counts.setdefault(config, {})[arm.selector] = selected(done[key]["stats"], arm.selector)
                        marks.append(f"{config if arm is None else config + ' ' + name} {done[key]['score']:.2f}")
                    rate = (time.perf_counter() - t0) / max(n_new, 1)
                    log(f"eval needles: sample {len(samples)}/{total} ({task}, {sample.n_tokens} tokens, needles at "
                        f"rows {[r[0] for r in sample.needle_rows]}): " + ", ".join(marks) +
                        f"; {rate:.1f} s per answer")
                    # the samples so far, so that a run stopped by a timeout can still be summarized
                    write_atomic(samples_path, "".join(json.dumps(asdict(s)) + "\n" for s in samples))
    finally:
        sess.close()

    write_atomic(samples_path, "".join(json.dumps(asdict(s)) + "\n" for s in samples))
    return write_needles_summary(out_dir, samples, list(done.values()), model, maps, splits, opts,
                                 machine=hardware(), fmt=fmt)


def write_needles_summary(out_dir: Path, samples: list[Sample], answers: list[dict], model: str | Path,
                          maps: list[str | Path], splits: dict[str, int], opts: NeedleOptions, machine: dict | None,
                          fmt: str, **extra) -> dict:
    """summary.json, .md and .png of a run: the summary with what was run, the machine the answers came from
    (None when unknown) and `extra` fields."""
    result = summarize(samples, answers, splits, opts)
    result.update(instrument="eval needles", date=dt.date.today().isoformat(), hardware=machine, model=str(model),
                  maps=[str(m) for m in maps], format=fmt, options=asdict(opts), **extra)
    write_summary(out_dir, result, markdown(result), plot)
    return result


def summarize_folder(out_dir: Path, answers: list[dict], model: str | Path, maps: list[str | Path],
                     splits: dict[str, int], opts: NeedleOptions) -> dict:
    """The summary of a run a deadline cut, from its results.jsonl and the samples its runs listed (samples.jsonl
    and the shards' lists): the samples of the asked tasks, lengths and indices that were answered count. Where
    the answers were made is not known here, so the summary's hardware is left empty and this pass's machine is
    recorded apart."""
    paths = [p for p in [out_dir / "samples.jsonl", *sorted(out_dir.glob("samples.shard-*.jsonl"))] if jsonl_parts(p)]
    if not paths:
        raise ValueError(f"--summary-only: {out_dir / 'samples.jsonl'} is missing (no run wrote samples there)")
    found = {s.sample_id: s for p in paths for s in (Sample(**r) for r in load_jsonl(p))}
    order = {(t, n): k for k, (t, n) in enumerate((t, n) for t in opts.tasks for n in opts.lengths)}

    def index(s: Sample) -> int:
        return int(s.sample_id.rsplit("-", 1)[1])

    samples = sorted((s for s in found.values() if (s.task, s.length) in order and index(s) < opts.samples),
                     key=lambda s: (order[(s.task, s.length)], index(s)))
    if not samples:
        raise ValueError(f"--summary-only: no sample in {out_dir} matches the tasks, lengths and --samples asked")
    return write_needles_summary(out_dir, samples, answers, model, maps, splits, opts, machine=None,
                                 fmt=opts.fmt, summary_pass={
                                     "hardware": hardware(), "note": "--summary-only: the answers in results.jsonl "
                                     "were made by earlier runs; this pass answered nothing"})


def summarize(samples: list[Sample], answers: list[dict], splits: dict[str, int], opts: NeedleOptions) -> dict:
    """Per configuration and arm: accuracy on all samples and on filled-region samples, and the paired contrast
    with exact on the filled-region samples (bootstrap interval), overall and per task."""
    score = {(r["sample"], r["config"], r["arm"]): r["score"] for r in answers}
    configs = {}
    for split in sorted(set(splits.values())):
        for tail in opts.tails:
            name = config_name(split, tail)
            groups = {"all tasks": samples, **{t: [s for s in samples if s.task == t] for t in opts.tasks}}
            table = {}
            for group, members in groups.items():
                usable = [s for s in members if (s.sample_id, name, opts.arms[0]) in score]
                filled = [s for s in usable if s.filled_region(tail)]
                row = {"samples": len(usable), "filled_samples": len(filled), "arms": {}}
                for arm in ("exact", *opts.arms):
                    cfg = "exact" if arm == "exact" else name
                    all_scores = [score[(s.sample_id, cfg, arm)] for s in usable]
                    filled_scores = [score[(s.sample_id, cfg, arm)] for s in filled]
                    entry = {"accuracy_all": mean_or_none(all_scores), "accuracy_filled": mean_or_none(filled_scores)}
                    if arm != "exact":
                        # resampled within each task (paper §3.4)
                        entry["delta_filled"] = bootstrap_mean(
                            [score[(s.sample_id, name, arm)] - score[(s.sample_id, "exact", "exact")] for s in filled],
                            strata=[s.task for s in filled])
                    row["arms"][arm] = entry
                table[group] = row
            configs[name] = {"split": split, "tail": tail, "groups": table}
    return {"configs": configs}


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}"


def markdown(result: dict) -> str:
    o = result["options"]
    lines = [f"# Needle retrieval: {Path(result['model']).name}", "",
             f"{result['date']}; tasks {', '.join(o['tasks'])}; lengths {', '.join(map(str, o['lengths']))} tokens; "
             f"{o['samples']} samples per task and length; {result['format']} prompts; seed {o['seed']}. "
             "Accuracy in % (RULER string_match_all); Δ = arm minus exact on the filled-region samples, paired, "
             "[95% bootstrap interval].", "",
             "| split | tail | tasks | samples (filled) | exact, filled | " +
             " | ".join(f"{a}, filled | {a} Δ" for a in o["arms"]) + " | exact, all | " +
             " | ".join(f"{a}, all" for a in o["arms"]) + " |",
             "|---|---|---|---|---|" + "---|---|" * len(o["arms"]) + "---|" + "---|" * len(o["arms"])]
    for c in result["configs"].values():
        for group, row in c["groups"].items():
            cells = [str(c["split"]), str(c["tail"]), group, f"{row['samples']} ({row['filled_samples']})",
                     _pct(row["arms"]["exact"]["accuracy_filled"])]
            for a in o["arms"]:
                d = row["arms"][a]["delta_filled"]
                cells += [_pct(row["arms"][a]["accuracy_filled"]),
                          "n/a" if not d["n"] else f"{100 * d['mean']:+.1f} [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}]"]
            cells.append(_pct(row["arms"]["exact"]["accuracy_all"]))
            cells += [_pct(row["arms"][a]["accuracy_all"]) for a in o["arms"]]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """Left: filled-region accuracy per arm and configuration, with the exact arm's; right: across splits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(result["options"]["arms"])
    configs = list(result["configs"].values())
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / (len(arms) + 1)
    for k, arm in enumerate(["exact", *arms]):
        xs, ys, err = [], [], [[], []]
        for i, c in enumerate(configs):
            row = c["groups"]["all tasks"]["arms"][arm]
            if row["accuracy_filled"] is None:
                continue
            xs.append(i + (k - len(arms) / 2) * width)
            ys.append(100 * row["accuracy_filled"])
            d = row.get("delta_filled")
            if d and d["n"]:  # the interval of the paired contrast, drawn around the arm's accuracy
                err[0].append(100 * (d["mean"] - d["lo"]))
                err[1].append(100 * (d["hi"] - d["mean"]))
            else:
                err[0].append(0)
                err[1].append(0)
        ax.bar(xs, ys, width, yerr=err, capsize=3, label=arm)
    ax.set_xticks(range(len(configs)), [f"S{c['split']} T{c['tail']}" for c in configs])
    ax.set_ylabel("filled-region accuracy (%)")
    ax.set_ylim(0, 105)
    ax.legend()
    ax.set_title("retrieval from the filled region (error bars: paired Δ vs exact, 95%)")
    for tail in sorted({c["tail"] for c in configs}):
        cs = sorted((c for c in configs if c["tail"] == tail), key=lambda c: c["split"])
        for arm in ["exact", *arms]:
            pts = [(c["split"], c["groups"]["all tasks"]["arms"][arm]["accuracy_filled"]) for c in cs]
            pts = [(s, 100 * a) for s, a in pts if a is not None]
            if pts:
                bx.plot(*zip(*pts), marker="o", ls="--" if arm == "exact" else "-", label=f"{arm}, T{tail}")
    bx.set_xlabel("split")
    bx.set_ylabel("filled-region accuracy (%)")
    bx.set_ylim(0, 105)
    bx.legend(fontsize=7)
    bx.set_title("across splits")
    fig.suptitle(Path(result["model"]).name)
    fig.tight_layout()
    save_figure(fig, path)
