#!/usr/bin/env python3
"""Development protocol for fits on ../shared/corpus: hold out the last calibration document of each domain
(by name) for choosing lambda, calibrate on the rest, and never touch corpus/eval.

  python tools/dev_calib_split.py OUT_DIR   -> OUT_DIR/calib/<domain>/*.txt, OUT_DIR/heldout/<domain>/*.txt (links)
"""
import sys
from pathlib import Path

CORPUS = Path(__file__).resolve().parent.parent.parent / "shared" / "corpus" / "calib"


def main() -> int:
    out = Path(sys.argv[1])
    for domain in sorted(p for p in CORPUS.iterdir() if p.is_dir()):
        docs = sorted(domain.glob("*.txt"))
        for i, doc in enumerate(docs):
            side = "heldout" if i == len(docs) - 1 else "calib"
            dest = out / side / domain.name / doc.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            if not dest.exists():
                dest.symlink_to(doc)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
