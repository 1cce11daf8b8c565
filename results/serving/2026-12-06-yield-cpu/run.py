"""One long request against one streaming user at --ridgefill-yield-ms 0, 50 and 200 (README.md); run from the
repository root: run.py smollm2|qwen35 OUT"""
import sys
import tempfile
from pathlib import Path
sys.path.insert(0, "tests")
from conftest import smollm2_with_random_maps
from ridgefill_gguf.maps.synthetic import tiny_model_with_maps
from ridgefill_gguf.serving import run_serving
d = Path(tempfile.mkdtemp())  # the model and maps
which = sys.argv[1]
if which == "smollm2":
    model, maps = smollm2_with_random_maps(d)
    r = run_serving(model, maps, [2300], [2], kv_modes=("unified",), yield_ms=(0, 50, 200), tail=256, select="none",
                    threads=2, out_dir=sys.argv[2], label="yield-smollm2-cpu", extra=("-b", "512", "-ub", "512"))
else:
    model, maps = tiny_model_with_maps(d, "qwen35", n_layer=8, split=2, n_embd=1024, n_ff=3072)
    r = run_serving(model, maps, [2000], [2], kv_modes=("unified",), yield_ms=(0, 50, 200), tail=256, select="none",
                    threads=2, out_dir=sys.argv[2], label="yield-qwen35-tiny-cpu",
                    extra=("-b", "512", "-ub", "512", "--override-kv", "qwen35.context_length=int:8192"))
print(open(r["files"][1]).read())
