"""Condense the committed quality studies into ridgefill_gguf/data/quality.json, which `ridgefill-gguf advise` reads.

    python tools/quality_curves.py [--check]

Every results/eval/*/report/study.json (`eval report`'s output) counts; each model's signature (name and shape)
comes from its file under models/ where `make models` fetched it, else from the file being replaced. --check
exits 1 when the packaged file is not what the committed studies give."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ridgefill_gguf import advise  # noqa: E402
from ridgefill_gguf.util import write_atomic  # noqa: E402


def build() -> str:
    reports = sorted(ROOT.glob("results/eval/*/report/study.json"))
    old = advise.load_curves()["models"] if advise.PACKAGED.exists() else {}
    names = {m for r in reports for m in json.loads(r.read_text())}
    sigs = {m: advise.signature(ROOT / "models" / m) if (ROOT / "models" / m).exists()
            else (old.get(m) or {}).get("signature") for m in names}
    curves = advise.curves_from_reports(reports, ROOT, sigs)
    return json.dumps({"from": [str(r.relative_to(ROOT)) for r in reports], "models": curves}, indent=1) + "\n"


if __name__ == "__main__":
    text = build()
    if "--check" in sys.argv:
        same = advise.PACKAGED.exists() and advise.PACKAGED.read_text() == text
        print("quality.json is " + ("up to date" if same else "stale: run python tools/quality_curves.py"))
        sys.exit(0 if same else 1)
    write_atomic(advise.PACKAGED, text)
    print(f"wrote {advise.PACKAGED.relative_to(ROOT)}")
