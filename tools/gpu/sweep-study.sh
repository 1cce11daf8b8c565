#!/usr/bin/env bash
# On the GPU machine, after `eval-study.sh qwen setup` and the Qwen model's pieces (tools/gpu/chunks.sh): issue 22's
# sweep and controls on Qwen2.5-Coder-0.5B at split 12, beside the committed budget-1.5 study (whose exact answers
# the new facts folders start from: the same prompts, and the exact arm depends on no setting).
#   bash tools/gpu/sweep-study.sh controls|nll|window|tail [...]
# controls: plain RidgeFill, the question-blind probe and the protected selector at budget 1.5 (400 prompts);
# nll: key-token loss at budgets 1, 1.5 and 2, probe rows 64 and 1024 and tail 512, side by side;
# window / tail: the facts at budget 1.5 with ROWS probe rows (default 1024) / a tail of TAIL_ROWS (default 512).
# MODEL=smollm2|gemma3 (nll only): another model at its study split; SEQUENTIAL=1 runs the loss settings one after
# another (the CPU). DEADLINE bounds each step (s); results come back as $OUT/study.tgz.
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=${RIDGEFILL_GPU_WORK:-$HOME/ridgefill}
model=${MODEL:-qwen}
study="bash $repo/tools/gpu/eval-study.sh $model"
exact=results/eval/2026-12-06-facts-study-qwen-h100/facts-qwen-S12-T1024-budget1.5/results.jsonl
facts() { env "$@" EXACT_FROM=$exact BUDGET=1.5 SAMPLES=${SAMPLES:-400} SHARDS=8 THREADS=2 NO_PACK=1 \
              STEP_TIMEOUT=${DEADLINE:-500} $study facts; }
for what in "$@"; do
    [ "$model" != qwen ] && [ "$what" != nll ] && { echo "sweep-study: $what runs on qwen only" >&2; exit 2; }
    case "$what" in
    controls) facts TAG=controls ARMS=ridge,ridge+blind-probe,ridge+protected ;;
    window) rows=${ROWS:-1024}; facts TAG=budget1.5-rows$rows PROBE_ROWS=$rows ARMS=ridge+probe ;;
    tail) facts TAG=budget1.5 FACT_TAIL=${TAIL_ROWS:-512} ARMS=ridge,ridge+probe ;;
    nll)
        # plain RidgeFill once per tail: the base run (tail 1,024) and the tail-512 run
        for s in "BUDGET=1 ARMS=ridge,ridge+probe" "TAG=budget1.5 BUDGET=1.5 ARMS=ridge+probe" "TAG=budget2 BUDGET=2 ARMS=ridge+probe" \
                 "TAG=budget1.5-rows1024 BUDGET=1.5 PROBE_ROWS=1024 ARMS=ridge+probe" \
                 "TAG=budget1.5-rows64 BUDGET=1.5 PROBE_ROWS=64 ARMS=ridge+probe" \
                 "TAG=budget1.5 BUDGET=1.5 FACT_TAIL=512 ARMS=ridge,ridge+probe"; do
            # shellcheck disable=SC2086
            env $s THREADS=2 NO_PACK=1 STEP_TIMEOUT=${DEADLINE:-500} $study nll-sweep &
            [ -n "${SEQUENTIAL:-}" ] && wait
        done
        wait ;;
    *) echo "sweep-study: controls, nll, window or tail" >&2; exit 2 ;;
    esac
done
mkdir -p "${OUT:-$work/out}" && tar -czf "${OUT:-$work/out}/study.tgz" -C "$work" study
