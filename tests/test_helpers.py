"""The tests' own helpers: a failed byte comparison says how the arrays differ, at once."""
from __future__ import annotations

import time

import numpy as np
import pytest

from conftest import assert_bytes_differ, assert_same_bytes


def test_two_unequal_megabyte_arrays_fail_at_once_and_say_where_and_by_how_much_they_differ(monkeypatch):
    monkeypatch.setenv("CI", "true")  # (where pytest's own explanation of two long `bytes` would diff them all)
    a = np.random.default_rng(0).standard_normal((40, 65536)).astype(np.float32)
    b = a.copy()
    b[3, 7] += 0.5
    b[20, 100] = np.nan
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"^rows: 2 of 2621440 values differ, the first at \(3, 7\), the largest by 0\.5$"):
        assert_same_bytes(b, a, "rows")
    assert time.monotonic() - t0 < 5
    assert_same_bytes(a, a.copy())


def test_files_compare_as_bytes_and_arrays_of_other_shapes_say_so():
    with pytest.raises(AssertionError, match=r"1 of 3 values differ, the first at \(1,\)"):
        assert_same_bytes(b"abc", b"axc")
    with pytest.raises(AssertionError, match=r"\(2, 3\) float32 against \(3, 2\) float32"):
        assert_same_bytes(np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float32))
    with pytest.raises(AssertionError, match="same bytes"):
        assert_bytes_differ(np.ones(4), np.ones(4), "probe")
    assert_bytes_differ(np.ones(4), np.zeros(4))
