"""The demo's document puts its answer in the rows RidgeFill fills."""
from __future__ import annotations

from ridgefill_gguf import demo


def test_the_demo_document_is_long_enough_and_plants_the_answer_after_the_first_module():
    doc, n = demo.build_document(lambda text: len(text) // 4, 8500)
    assert n >= 8500
    assert doc.count(demo.CODENAME) == 1
    # after the first module and far ahead of the tail, which covers only the last rows
    where = doc.index(demo.NEEDLE)
    assert where > len("# ---- textwrap.py ----") and where / len(doc) < 0.5
