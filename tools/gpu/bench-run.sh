# Sourced by tools/gpu/hybrid-runs.sh and multi-gpu-runs.sh, which set repo, out (results go to $out/bench), tag and
# runner. bench_run NAME VAR=VALUE...: tools/gpu/bench-prefill-8b.sh with those settings under LIMIT_S, its results
# labelled $tag-NAME and its log and server logs named after the run, so that one that stalls leaves the others
# their time.
bench_run() {
    local name=$1; shift
    echo "$runner: $name ($*)"
    # timeout signals the bench's whole process group, its servers included (and no other process's)
    env "$@" LABEL="$tag-$name" timeout --kill-after=10 "${LIMIT_S:-240}" bash "$repo/tools/gpu/bench-prefill-8b.sh" \
        > "$out/bench/run-$name.log" 2>&1
    local rc=$?
    for log in "$out"/bench/server-*.log; do
        [ -f "$log" ] && mv "$log" "$out/bench/$name-$(basename "$log")"
    done
    tail -"${TAIL_LINES:-20}" "$out/bench/run-$name.log"
    [ $rc -eq 0 ] || echo "$runner: $name stopped (rc $rc)"
}
