#!/usr/bin/env bash
# On the GPU machine, after tools/gpu/build-and-test.sh --build-only, the model's pieces and
# RESUME_FROM=results/eval/2026-12-07-facts-study-smollm2-gemma3-h100 eval-study.sh smollm2 setup:
# SmolLM2's natural-question facts to 1,600 prompts, the probe arm at budget 1.5 (exact and probe on the new 800)
# and at budget 2 (its first 800 from the committed exact answers), side by side, then budget 2 on the new 800 from
# the exact answers the 1.5 run made. TOTAL bounds the call (s); logs and study.tgz go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NO_PACK=1 THREADS=1 STEP_TIMEOUT=515
out=${OUT:-/tmp/out} total=${TOTAL:-530} start=$SECONDS
mkdir -p "$out"
S=results/eval/2026-12-07-facts-study-smollm2-gemma3-h100/facts-smollm2-S15-T1024-budget1.5/results.jsonl
study=$HOME/ridgefill/study b15=$HOME/ridgefill/study/facts-smollm2-S15-T1024-budget1.5
b2=$HOME/ridgefill/study/facts-smollm2-S15-T1024-budget2
(SAMPLES=1600 BUDGET=1.5 TAG=budget1.5 ARMS=ridge+probe SHARDS=${SHARDS_15:-10} DEADLINE=$total \
    bash tools/gpu/eval-study.sh smollm2 facts > "$out/b15.log" 2>&1) &
(SAMPLES=800 EXACT_FROM=$S BUDGET=2 TAG=budget2 ARMS=ridge+probe SHARDS=${SHARDS_2:-5} DEADLINE=$total \
    bash tools/gpu/eval-study.sh smollm2 facts > "$out/b2.log" 2>&1) &
wait
echo "phase 1 done at $((SECONDS - start)) s"
# the 1.5 run's new exact answers (the exact arm depends on no setting), each line once
grep '"arm": "exact"' "$b15/results.jsonl" | grep -vxFf <(grep '"arm": "exact"' "$b2/results.jsonl") >> "$b2/results.jsonl"
left=$((total - (SECONDS - start)))
if [ "$left" -gt 60 ]; then
    SAMPLES=1600 BUDGET=2 TAG=budget2 ARMS=ridge+probe SHARDS=15 DEADLINE=$left \
        bash tools/gpu/eval-study.sh smollm2 facts > "$out/b2-1600.log" 2>&1
fi
echo "phase 2 done at $((SECONDS - start)) s"
for f in "$b15" "$b2"; do echo "$f: $(grep -c '"arm": "exact"' "$f/results.jsonl") exact, $(grep -c '"arm": "ridge+probe"' "$f/results.jsonl") probe"; done
tar -czf "$out/study.tgz" -C "$HOME/ridgefill" study
