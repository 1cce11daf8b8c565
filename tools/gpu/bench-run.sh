# Sourced by tools/gpu/hybrid-runs.sh and multi-gpu-runs.sh, which set repo, out (results go to $out/bench), tag and
# runner. bench_run NAME VAR=VALUE...: tools/gpu/bench-prefill-8b.sh with those settings under LIMIT_S, its results
# labelled $tag-NAME and its log and server logs named after the run, so that one that stalls leaves the others
# their time.
bench_run() {
    local name=$1; shift
    echo "$runner: $name ($*)"
    # timeout makes the bench a process group of its own and signals all of it at the limit; a llama-server takes
    # that first signal as a request to finish its work, so what is left of the group is killed after it (the
    # bench's servers, no other process's)
    env "$@" LABEL="$tag-$name" timeout --kill-after=10 "${LIMIT_S:-240}" bash "$repo/tools/gpu/bench-prefill-8b.sh" \
        > "$out/bench/run-$name.log" 2>&1 &
    local pid=$! rc
    wait "$pid"; rc=$?
    kill -KILL -- "-$pid" 2> /dev/null
    for log in "$out"/bench/server-*.log; do
        [ -f "$log" ] && mv "$log" "$out/bench/$name-$(basename "$log")"
    done
    tail -"${TAIL_LINES:-20}" "$out/bench/run-$name.log"
    [ $rc -eq 0 ] || echo "$runner: $name stopped (rc $rc)"
}
