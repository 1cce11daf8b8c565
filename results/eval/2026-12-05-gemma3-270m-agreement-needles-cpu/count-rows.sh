#!/usr/bin/env bash
# count_rows.py for every agreement run here (the documents of run.sh)
set -u
cd "$(dirname "$0")/../../.."
D=results/eval/2026-12-05-gemma3-270m-agreement-needles-cpu
M=models/gemma-3-270m-q4_k_m.gguf
E=../shared/corpus/eval
export LLAMA_CPP_LIB_PATH=${LLAMA_CPP_LIB_PATH:-build/ridgefill/bin}
six=($E/chat/qmsum-ami-TS3004a-d.txt $E/code/regex-src-_regex.c.txt $E/encyclo/factbook-north-america-region.txt
     $E/legal/usc-title17-copyrights.txt $E/prose/gitenberg-145-middlemarch.txt $E/science/lme4-lmer.txt)
three=($E/chat/qmsum-ami-TS3004a-d.txt $E/code/regex-src-_regex.c.txt $E/prose/gitenberg-145-middlemarch.txt)
for s in 12 9 6; do
    .venv/bin/python $D/count_rows.py $M /tmp/gemma/gemma3-270m.maps.S$s.gguf 1024 4096 "${six[@]}"
    .venv/bin/python $D/count_rows.py $M /tmp/gemma/gemma3-270m.maps.S$s.gguf 4096 8192 "${three[@]}"
done
