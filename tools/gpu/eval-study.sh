#!/usr/bin/env bash
# On the GPU machine: the first quality study of issue 6 (docs/eval.md), after the models arrived
# (tools/gpu/chunks.sh) and the patched tree is built (RIDGEFILL_GPU_TREES=ridgefill TARGETS="llama ggml"
# bash tools/gpu/build-and-test.sh --build-only). Carry .cache/device/maps and .cache/device/corpus-eval too.
#   bash tools/gpu/eval-study.sh smollm2|qwen|gemma3 [needles|nll|agreement|selectors|claim|facts|setup ...]
# selectors is issue 8's study: at the middle split and T = 1024, the needles with the exact-row arms (at least 50
# filled-region samples) and the loss on key tokens beside them. facts is issue 22's: facts asked in other words and
# a follow-up, over the reused cache and as --ridgefill-reuse exact-only serves it, at the middle split and
# T = 1024 (SHARDS side by side as for claim; FACT_LENGTHS the prompt lengths; RERANK=1 adds the re-ranked
# follow-up, BUDGET= and TAG= another budget factor in a folder of its own).
# Results accumulate under $HOME/ridgefill/study (every instrument resumes) and come back as $OUT/study.tgz at the
# end of each call, whatever was reached ($OUT returns 8 files at most). Maps and texts carried in any earlier call
# are kept under $HOME/ridgefill, so a later call can carry a model piece instead. DEADLINE (s from the start of
# this script) bounds the whole call, STEP_TIMEOUT each instrument run; MAX_DOCS the documents of a loss or
# agreement run; SPLITS, TAILS and LENGTHS subsets of the model's; THREADS the CPU threads of each run (runs side by
# side share the cores); ARMS (needles only) adds selector arms, e.g.
# ARMS=ridge,identity,ridge+probe,ridge+random:probe,identity+probe (issue 8); SHARDS (claim only) runs that many
# shares of the samples side by side.
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=${RIDGEFILL_GPU_WORK:-$HOME/ridgefill}
export PYTHONPATH="/tmp/site:$repo" PYTHONUNBUFFERED=1 LD_PRELOAD=${LD_PRELOAD:-/lib/x86_64-linux-gnu/libstdc++.so.6}
export RIDGEFILL_GGUF_BUILD=${RIDGEFILL_GGUF_BUILD:-$work/out-ridgefill}  # the build this machine keeps, whatever links the checkout has
which=${1:?usage: eval-study.sh smollm2|qwen|gemma3 [instrument...]}; shift
instruments=${*:-needles nll agreement}
maps="$work/maps" eval_docs="$work/corpus-eval"
mkdir -p "$maps" "$eval_docs"
# -u and --skip-old-files: a run beside others rewrites no file that is already there and unchanged
[ -d "$repo/.cache/device/maps" ] && cp -au "$repo/.cache/device/maps/." "$maps/"
[ -d "$repo/.cache/device/corpus-eval" ] && cp -au "$repo/.cache/device/corpus-eval/." "$eval_docs/"
# the texts packed (a third of the size, for a call with little room): tar -czf .cache/device/corpus-eval.tgz
[ -f "$repo/.cache/device/corpus-eval.tgz" ] && tar -xzf "$repo/.cache/device/corpus-eval.tgz" -C "$work" --skip-old-files
study="$work/study" && mkdir -p "$study"
# RESUME_FROM: a committed study folder (it travels with the checkout) whose runs this machine continues, its
# per-sample files unpacked; a file already here stays (jobs side by side copy it at once, and may be appending)
[ -n "${RESUME_FROM:-}" ] && python3 "$repo/tools/pack_results.py" --copy-unpacked "$repo/$RESUME_FROM" "$study" > /dev/null
start=$SECONDS deadline=${DEADLINE:-570}
# a tagged folder's first run starts from another run's exact answers of the same prompts (keyed by prompt alone)
seed_exact() {  # seed_exact FROM_RESULTS_JSONL OUT_DIR: FROM.gz's rows and FROM's, a row in both once
    [ -f "$2/results.jsonl" ] || { mkdir -p "$2" && for f in "$1.gz" "$1"; do [ -f "$f" ] && zcat -f "$f"; done |
        grep '"arm": "exact"' | awk '!seen[$0]++' > "$2/results.jsonl"; }
}
step() {
    local left=$((deadline - (SECONDS - start) - ${RESERVE:-15})) limit=${STEP_TIMEOUT:-240}
    [ "$left" -lt 20 ] && { echo "eval-study: deadline reached, skipping: $1 ${*: -3}"; return; }
    [ "$left" -lt "$limit" ] && limit=$left
    echo "== eval $1 ${*: -3} (at most ${limit} s)"
    # every run names the probe's factor (step_budget, set per instrument below): the untagged folders hold runs at
    # 1 (the eval's default until it took llama-server's), and an answer is keyed by its arm's name, not its settings
    timeout "$limit" python3 -m ridgefill_gguf.cli eval "$@" --budget "$step_budget" ${THREADS:+--threads "$THREADS"} 2>&1 |
        grep -v '^WARNING' | tail -"${STEP_LINES:-12}"
}

case "$which" in
smollm2)
    model="$work/models/SmolLM2-135M-Instruct.Q4_1.gguf"; splits="11 15 19"; prefix=smollm2
    lengths=4096,8192; tails="1024 4096"; doc_max=8192; mid=15; select_samples=10; claim_samples=70
    fact_lengths=4096; fact_samples=400 ;;
qwen)
    model="$work/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"; splits="9 12 15"; prefix=qwen
    lengths=8192,16384,32768; tails="1024 4096"; doc_max=32768; mid=12; select_samples=6; claim_samples=20
    fact_lengths=4096; fact_samples=400 ;;
gemma3)
    # a base model with sliding-window layers: completion prompts, the windowed cache keeping every row; maps at
    # split 9 only so far
    model="$work/models/gemma-3-270m-q4_k_m.gguf"; splits=9; prefix=gemma3
    lengths=8192,16384,32768; tails="1024 4096"; doc_max=32768; mid=9; select_samples=6; claim_samples=20
    fact_lengths=4096; fact_samples=400 ;;
*) echo "eval-study: smollm2, qwen or gemma3" >&2; exit 2 ;;
esac
splits=${SPLITS:-$splits} tails=${TAILS:-$tails} lengths=${LENGTHS:-$lengths}  # subsets when time is short
if [ "${BUDGET:-1}" != 1 ] && [ -z "${TAG:-}" ]; then
    echo "eval-study: BUDGET=$BUDGET needs TAG=... (the untagged folders hold budget-1 runs)" >&2; exit 2
fi
maps_args=(); for s in $splits; do maps_args+=(--maps "$maps/$prefix.S$s.gguf"); done
tail_args=(); for t in $tails; do tail_args+=(--tail "$t"); done

for inst in $instruments; do
    # only claim, facts and nll-sweep take BUDGET, into a TAG's folder
    case "$inst" in claim|facts|nll-sweep) step_budget=${BUDGET:-1} ;; *) step_budget=1 ;; esac
    case "$inst" in
    needles)
        step needles "$model" "${maps_args[@]}" "${tail_args[@]}" --lengths "$lengths" --samples "${SAMPLES:-8}" \
            --arms "${ARMS:-ridge,identity}" --out "$study/needles-$which" -ngl 99 ;;
    selectors)
        step needles "$model" --maps "$maps/$prefix.S$mid.gguf" --tail 1024 --lengths "$lengths" \
            --samples "${SAMPLES:-$select_samples}" --out "$study/selectors-$which-S$mid-T1024" -ngl 99 \
            --arms "${ARMS:-ridge,ridge+probe,ridge+random:probe,ridge+attention,identity+probe,ridge+blind-probe}"
        step nll "$model" --maps "$maps/$prefix.S$mid.gguf" --docs "$eval_docs" --tail 1024 --min-tokens 3072 \
            --max-tokens "$doc_max" --max-docs "${MAX_DOCS:-12}" --score 512 -ngl 99 \
            --arms ridge,ridge+probe,ridge+random:probe,ridge+protected --out "$study/selectors-nll-$which-S$mid-T1024" ;;
    claim)
        # issue 8's 2-point claim: paper §3.4's floor passes -2 points only from 149 filled samples, so more
        # samples with only the arm the claim tests, in a folder of their own (the selectors run keeps its arms).
        # SmolLM2 flips about a quarter of its answers either way (exact or not), so its bootstrap bound needs
        # about 350 filled samples to reach -2 even with no mean loss; Qwen flips few and needs the floor's 149.
        # SHARDS=N: N runs side by side into the one folder (the small model leaves the GPU mostly idle), then a
        # whole pass that answers what the shards left and writes the summary; if the deadline cuts it, a
        # --summary-only pass (seconds, no model) summarizes the answers made
        # TAG=name: a folder of its own (claim-...-name; an arm's answers are keyed by its name, not its settings),
        # which starts from the exact answers already made; BUDGET=F the probe's budget factor; WHOLE_NUMBERS=0 the
        # probe without whole numbers (patch 0020); TASKS=a,b a subset of the needle tasks
        base="$study/claim-$which-S$mid-T1024"; out="$base${TAG:+-$TAG}"
        claim=(needles "$model" --maps "$maps/$prefix.S$mid.gguf" --tail 1024 --lengths "$lengths"
               --samples "${SAMPLES:-$claim_samples}" --out "$out" -ngl 99 --arms "${ARMS:-ridge+probe}"
               ${TASKS:+--tasks "$TASKS"})
        [ "${WHOLE_NUMBERS:-1}" = 0 ] && claim+=(--no-whole-numbers)
        [ "$out" != "$base" ] && [ -f "$base/results.jsonl" ] && seed_exact "$base/results.jsonl" "$out"
        shards=${SHARDS:-1}
        if [ "$shards" -gt 1 ]; then
            for i in $(seq 0 $((shards - 1))); do
                STEP_LINES=3 step "${claim[@]}" --shard "$i/$shards" &
            done
            wait
        fi
        touch "$work/.claim-start"
        RESERVE=40 step "${claim[@]}"
        [ "$out/summary.json" -nt "$work/.claim-start" ] || RESERVE=5 step "${claim[@]}" --summary-only ;;
    facts)
        # SmolLM2 and Qwen answer about two thirds of these facts exactly, and a 2-point bound on a paired
        # difference needs a few hundred filled-region samples
        # FACT_TAIL and PROBE_ROWS: the sweep's other settings; EXACT_FROM: a committed results.jsonl of the same
        # prompts whose exact answers a new tagged folder starts from (the exact arm depends on no setting)
        out="$study/facts-$which-S$mid-T${FACT_TAIL:-1024}${TAG:+-$TAG}"
        facts=(facts "$model" --maps "$maps/$prefix.S$mid.gguf" --docs "$eval_docs" --tail "${FACT_TAIL:-1024}"
               --lengths "${FACT_LENGTHS:-$fact_lengths}" --samples "${SAMPLES:-$fact_samples}" --out "$out" -ngl 99
               --arms "${ARMS:-ridge,ridge+probe,ridge+random:probe,ridge+blind-probe,ridge+protected}"
               --exact-only-follow-up ${RERANK:+--rerank-follow-up}
               ${PROBE_ROWS:+--probe-rows "$PROBE_ROWS"})
        [ -n "${EXACT_FROM:-}" ] && seed_exact "$repo/$EXACT_FROM" "$out"
        shards=${SHARDS:-1}
        if [ "$shards" -gt 1 ]; then
            for i in $(seq 0 $((shards - 1))); do
                RESERVE=40 STEP_LINES=3 step "${facts[@]}" --shard "$i/$shards" &
            done
            wait
        fi
        RESERVE=5 step "${facts[@]}" ;;
    nll-sweep)
        # issue 22's sweep, key-token loss: at the middle split, ARMS at BUDGET, PROBE_ROWS and FACT_TAIL, in a
        # folder per TAG; several side by side (&) share the GPU
        t=${FACT_TAIL:-1024}
        step nll "$model" --maps "$maps/$prefix.S$mid.gguf" --docs "$eval_docs" --tail "$t" --min-tokens 3072 \
            --max-tokens "${NLL_MAX_TOKENS:-$doc_max}" --max-docs "${MAX_DOCS:-12}" --score 512 -ngl 99 --arms "${ARMS:-ridge,ridge+probe}" \
            ${PROBE_ROWS:+--probe-rows "$PROBE_ROWS"} \
            --out "$study/nll-sweep-$which-S$mid-T$t${TAG:+-$TAG}" ;;
    setup) ;;  # only the copies above (study-parallel.sh makes them once before its runs start)
    nll|agreement)
        for s in $splits; do for t in $tails; do
            extra=(); [ "$inst" = nll ] && extra=(--score 512)
            step "$inst" "$model" --maps "$maps/$prefix.S$s.gguf" --docs "$eval_docs" --tail "$t" \
                --min-tokens $((t + 2048)) --max-tokens "$doc_max" --max-docs "${MAX_DOCS:-12}" "${extra[@]}" \
                --out "$study/$inst-$which-S$s-T$t" -ngl 99
        done; done ;;
    esac
done
# NO_PACK: several of these run side by side (tools/gpu/study-parallel.sh packs once at the end)
[ -n "${NO_PACK:-}" ] || { mkdir -p "${OUT:-$work/out}" && tar -czf "${OUT:-$work/out}/study.tgz" -C "$work" study; }
