#!/usr/bin/env bash
# Gemma-3-270M: agreement and retrieval at splits 12, 9 and 6, one thread (beside other work):
#   run.sh 1024   six documents cut to 4,096 tokens; 10 needle prompts of 4,096
#   run.sh 4096   three documents (chat, code, prose) cut to 8,192 tokens; 6 needle prompts of 8,192
# Maps: /tmp/gemma/gemma3-270m.maps.S{12,9,6}.gguf from the fit in ../2026-12-05-nll-gemma3-270m-T4096-cpu/.
set -u
cd "$(dirname "$0")/../../.."
T=${1:?usage: run.sh 1024|4096}
D=results/eval/2026-12-05-gemma3-270m-agreement-needles-cpu
M=models/gemma-3-270m-q4_k_m.gguf
E=../shared/corpus/eval
export LLAMA_CPP_LIB_PATH=${LLAMA_CPP_LIB_PATH:-build/ridgefill/bin}
docs=(--docs $E/chat/qmsum-ami-TS3004a-d.txt --docs $E/code/regex-src-_regex.c.txt)
if [ "$T" = 1024 ]; then
    docs+=(--docs $E/encyclo/factbook-north-america-region.txt --docs $E/legal/usc-title17-copyrights.txt
           --docs $E/prose/gitenberg-145-middlemarch.txt --docs $E/science/lme4-lmer.txt)
    n=4096 samples=10
else
    docs+=(--docs $E/prose/gitenberg-145-middlemarch.txt)
    n=8192 samples=6
fi
for s in 12 9 6; do
    .venv/bin/ridgefill-gguf eval agreement $M --maps /tmp/gemma/gemma3-270m.maps.S$s.gguf "${docs[@]}" \
        --out $D/agreement-S$s-T$T --arms ridge,identity,ridge+probe --tail $T --min-tokens $n --max-tokens $n -t 1
done
.venv/bin/ridgefill-gguf eval needles $M --maps /tmp/gemma/gemma3-270m.maps.S12.gguf \
    --maps /tmp/gemma/gemma3-270m.maps.S9.gguf --maps /tmp/gemma/gemma3-270m.maps.S6.gguf \
    --out $D/needles-T$T --tasks single --lengths $n --samples $samples --tail $T \
    --arms ridge,identity,ridge+probe --format completion -t 1
