#!/usr/bin/env bash
# On the GPU machine: the first quality study of issue 6 (docs/eval.md), after the models arrived
# (tools/gpu/chunks.sh) and the patched tree is built (RIDGEFILL_GPU_TREES=ridgefill TARGETS="llama ggml"
# bash tools/gpu/build-and-test.sh --build-only). Carry .cache/device/maps and .cache/device/corpus-eval too.
#   bash tools/gpu/eval-study.sh smollm2|qwen [needles|nll|agreement ...]
# Results accumulate under $HOME/ridgefill/study (every instrument resumes) and are copied to $OUT/study at the
# end of each call, whatever was reached. STEP_TIMEOUT (s) bounds each instrument run; ARMS (needles only) adds
# selector arms, e.g. ARMS=ridge,identity,ridge+probe,ridge+random:probe,identity+probe (issue 8).
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=${RIDGEFILL_GPU_WORK:-$HOME/ridgefill}
export PYTHONPATH="/tmp/site:$repo" PYTHONUNBUFFERED=1 LD_PRELOAD=${LD_PRELOAD:-/lib/x86_64-linux-gnu/libstdc++.so.6}
which=${1:?usage: eval-study.sh smollm2|qwen [instrument...]}; shift
instruments=${*:-needles nll agreement}
maps="$repo/.cache/device/maps" eval_docs="$repo/.cache/device/corpus-eval"
study="$work/study" && mkdir -p "$study"
step() { timeout "${STEP_TIMEOUT:-240}" python3 -m ridgefill_gguf.cli eval "$@" 2>&1 | grep -v '^WARNING' | tail -25; }

case "$which" in
smollm2)
    model="$work/models/SmolLM2-135M-Instruct.Q4_1.gguf"; splits="11 15 19"; prefix=smollm2
    lengths=4096,8192; tails="1024 4096"; doc_max=8192 ;;
qwen)
    model="$work/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"; splits="9 12 15"; prefix=qwen
    lengths=8192,16384,32768; tails="1024 4096"; doc_max=32768 ;;
*) echo "eval-study: smollm2 or qwen" >&2; exit 2 ;;
esac
maps_args=(); for s in $splits; do maps_args+=(--maps "$maps/$prefix.S$s.gguf"); done
tail_args=(); for t in $tails; do tail_args+=(--tail "$t"); done

for inst in $instruments; do
    case "$inst" in
    needles)
        step needles "$model" "${maps_args[@]}" "${tail_args[@]}" --lengths "$lengths" --samples "${SAMPLES:-8}" \
            --arms "${ARMS:-ridge,identity}" --out "$study/needles-$which" -ngl 99 ;;
    nll|agreement)
        for s in $splits; do for t in $tails; do
            extra=(); [ "$inst" = nll ] && extra=(--score 512)
            step "$inst" "$model" --maps "$maps/$prefix.S$s.gguf" --docs "$eval_docs" --tail "$t" \
                --min-tokens $((t + 2048)) --max-tokens "$doc_max" --max-docs "${MAX_DOCS:-12}" "${extra[@]}" \
                --out "$study/$inst-$which-S$s-T$t" -ngl 99
        done; done ;;
    esac
done
mkdir -p "${OUT:-$work/out}/study" && cp -r "$study"/. "${OUT:-$work/out}/study/"
