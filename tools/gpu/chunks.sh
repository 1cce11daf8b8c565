#!/usr/bin/env bash
# Models travel to the GPU machine in pieces: one call carries at most 64 MiB, and the machine cannot download.
#   here:         bash tools/gpu/chunks.sh split models/X.gguf [...]   -> .cache/device/chunks/X.gguf.NN + .sha256
#   each call:    carry [".cache/device/chunks/X.gguf.NN"] (one piece per call, calls back to back) and run
#                 bash tools/gpu/chunks.sh receive
#                 which keeps every carried piece under $HOME/ridgefill/models/ and, once all pieces of a model
#                 are there, joins them and checks the sha256 (the model then is $HOME/ridgefill/models/X.gguf).
# The checksum files are small: split puts them in tools/gpu/models.sha256, which is tracked and always travels.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
chunks="$repo/.cache/device/chunks"
work=${RIDGEFILL_GPU_WORK:-$HOME/ridgefill}
# a piece and the tree a call carries with it (tracked and untracked-not-ignored files) stay under 64 MiB, 4 to spare
tree_bytes() { (cd "$repo" && git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1); }

case "${1:-}" in
split)
    shift
    piece_mib=${PIECE_MIB:-$(( (64 * 1048576 - $(tree_bytes) - 4 * 1048576) / 1048576 ))}
    mkdir -p "$chunks"
    for model in "$@"; do
        name=$(basename "$model")
        rm -f "$chunks/$name".*
        split -d -a 2 -b "${piece_mib}M" "$model" "$chunks/$name."
        n=$(ls "$chunks/$name".* | wc -l)
        sum=$(sha256sum "$model" | cut -d' ' -f1)
        # the model's line replaced where it is (a re-split of the same model leaves the tracked file unchanged)
        sums="$repo/tools/gpu/models.sha256"
        [ -f "$sums" ] || : > "$sums"
        awk -v name="$name" -v line="$sum $n $name" '$3 == name { print line; done = 1; next } { print }
            END { if (!done) print line }' "$sums" > "$sums.tmp"
        mv "$sums.tmp" "$sums"
        echo "chunks: $name in $n pieces of ${piece_mib} MiB: $(ls "$chunks/$name".* | xargs -n1 basename | tr '\n' ' ')"
    done
    ;;
receive)
    mkdir -p "$work/models/pieces"
    [ -d "$chunks" ] && cp -n "$chunks"/* "$work/models/pieces/" 2>/dev/null || true
    while read -r sum n name; do
        [ -f "$work/models/$name" ] && { echo "chunks: $name ready"; continue; }
        have=$(ls "$work/models/pieces/$name".* 2>/dev/null | wc -l || true)
        if [ "$have" -lt "$n" ]; then echo "chunks: $name: $have of $n pieces"; continue; fi
        cat $(ls "$work/models/pieces/$name".* | sort) > "$work/models/$name.tmp"
        if [ "$(sha256sum "$work/models/$name.tmp" | cut -d' ' -f1)" != "$sum" ]; then
            rm -f "$work/models/$name.tmp"; echo "chunks: $name: checksum mismatch, pieces kept" >&2; exit 1
        fi
        mv "$work/models/$name.tmp" "$work/models/$name" && rm -f "$work/models/pieces/$name".*
        echo "chunks: $name ready"
    done < "$repo/tools/gpu/models.sha256"
    ;;
*)
    echo "usage: tools/gpu/chunks.sh split MODEL... | receive" >&2; exit 2 ;;
esac
