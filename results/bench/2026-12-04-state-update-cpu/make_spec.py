# The runs of the CPU state-update comparison (result.json): 4,096 tokens, plain ridge, tail 512, split 2, the
# fused op and the chunked graph twice each, alternating.
import json, numpy as np
toks = [int(t) for t in np.random.default_rng(0).integers(1000, 50000, 4096)]
base = {"fill": "ridge", "tail": 512, "min_prefix": 0}
runs = []
for rep in range(2):
    for u in ("fused", "chunked"):
        runs.append({"name": f"{u}{rep}", "params": {**base, "state_update": u}})
spec = {"model": "/tmp/cpuq/m.gguf", "n_ctx": 8192, "runs": runs, "special": False, "pieces": False, "tokens": toks,
        "session": {"n_batch": 512, "n_ubatch": 512, "n_threads": 2, "maps": "/tmp/cpuq/maps.gguf"}}
json.dump(spec, open("/tmp/cpuq/spec.json", "w"))
