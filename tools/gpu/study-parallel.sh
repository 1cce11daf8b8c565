#!/usr/bin/env bash
# On the GPU machine: several eval-study.sh runs side by side. The small models leave the H200 mostly idle and
# each run spends most of its time in Python, so four runs take little longer than one.
#   bash tools/gpu/study-parallel.sh JOB...     JOB = model:instrument[:max_docs[:splits]],
#   e.g. qwen:nll:6:9 qwen:nll:6:12,15 smollm2:selectors
# DEADLINE, STEP_TIMEOUT, RESUME_FROM, SPLITS, TAILS and ARMS pass through to every job. Each job's log and the
# study folder come back as $OUT/study.tgz, packed once after the last job ends.
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=${RIDGEFILL_GPU_WORK:-$HOME/ridgefill}
logs="$work/study/logs" && mkdir -p "$logs"
[ $# -gt 0 ] || { echo "usage: study-parallel.sh model:instrument[:max_docs[:splits]]..." >&2; exit 2; }
log_of() { echo "$logs/$(echo "$1" | tr ':,' '-_').log"; }
NO_PACK=1 bash "$repo/tools/gpu/eval-study.sh" "${1%%:*}" setup
pids=()
for job in "$@"; do
    IFS=: read -r which inst docs splits <<< "$job"
    log=$(log_of "$job")
    echo "== $job (log study/logs/$(basename "$log"))"
    job_splits=${splits//,/ }
    SPLITS=${job_splits:-${SPLITS:-}} NO_PACK=1 MAX_DOCS=${docs:-${MAX_DOCS:-12}} THREADS=${THREADS:-2} \
        bash "$repo/tools/gpu/eval-study.sh" "$which" "$inst" > "$log" 2>&1 &
    pids+=($!)
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=$((failed + 1)); done
for job in "$@"; do
    echo "== $job"; tail -"${LOG_LINES:-8}" "$(log_of "$job")"
done
mkdir -p "${OUT:-$work/out}" && tar -czf "${OUT:-$work/out}/study.tgz" -C "$work" study
[ "$failed" -eq 0 ] || { echo "study-parallel: $failed job(s) failed (their logs above)" >&2; exit 1; }
