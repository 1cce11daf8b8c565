"""Which prefix rows the default selector (ridge+probe) ran exactly on each agreement document: the agreement runs
here began before `eval agreement` recorded it. The same prompts (each document's first max_tokens tokens), the
same arm parameters, one prefill each; writes rows-S<split>-T<tail>.jsonl beside them."""
import json
import sys
from pathlib import Path

from ridgefill_gguf import libs
from ridgefill_gguf.engine.session import Session
from ridgefill_gguf.eval.agreement import AgreementOptions
from ridgefill_gguf.eval.arms import ROW_COUNTS, arm_params, parse_arms
from ridgefill_gguf.eval.documents import long_documents

here = Path(__file__).parent
model, maps, tail, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
docs = sys.argv[5:]
split = Path(maps).stem.split(".S")[-1]
opts = AgreementOptions(arms=("ridge+probe",), tail=tail, min_tokens=max_tokens, max_tokens=max_tokens, threads=1)
libs.use_build("ridgefill")
sess = Session(model, n_ctx=max_tokens + 16, n_batch=512, n_ubatch=512, flash_attn=True, n_threads=1, maps=maps)
(arm,) = parse_arms(opts.arms, follows=True)
with open(here / f"rows-S{split}-T{tail}.jsonl", "w") as out:
    for doc, prompt in long_documents(docs, sess.tokenize, opts, {}, print, "count rows"):
        _, _, st = sess.ridgefill(prompt, tail=tail, min_prefix=0,
                                  **arm_params(arm, len(prompt), tail, opts.selectors, {}))
        row = {"name": doc.name, "tokens": len(prompt), **{k: st[k] for k in ROW_COUNTS if k in st}}
        out.write(json.dumps(row) + "\n")
        print(row, flush=True)
sess.close()
