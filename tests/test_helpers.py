"""The tests' own helpers: a failed byte comparison says how the arrays differ, at once."""
from __future__ import annotations

import time

import numpy as np
import pytest

from conftest import assert_bytes_differ, assert_same_bytes


def test_two_unequal_megabyte_arrays_fail_at_once_and_say_where_and_by_how_much_they_differ():
    a = np.random.default_rng(0).standard_normal((40, 65536)).astype(np.float32)
    b = a.copy()
    b[3, 7] += 0.5
    b[20, 100] = np.nan
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"^rows: 2 of 2621440 values differ, the first at \(3, 7\), "
                                             r"the largest by 0\.5, 1 of them NaN or infinite$"):
        assert_same_bytes(b, a, "rows")
    assert time.monotonic() - t0 < 5
    assert_same_bytes(a, a.copy())


def test_byte_strings_compare_byte_by_byte_and_arrays_of_another_shape_or_type_never_match():
    with pytest.raises(AssertionError, match=r"^1 of 3 values differ, the first at \(1,\), the largest by 8$"):
        assert_same_bytes(b"abc", b"ajc")
    with pytest.raises(AssertionError, match=r"^\(2, 3\) float32 against \(3, 2\) float32$"):
        assert_same_bytes(np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float32))
    with pytest.raises(AssertionError, match=r"^\(4,\) float32 against \(4,\) int32$"):
        assert_same_bytes(np.zeros(4, np.float32), np.zeros(4, np.int32))


def test_arrays_that_should_differ_fail_when_their_bytes_are_the_same():
    with pytest.raises(AssertionError, match=r"^probe: the \(4,\) float64 and \(4,\) float64 arrays have the same"):
        assert_bytes_differ(np.ones(4), np.ones(4), "probe")
    with pytest.raises(AssertionError, match=r"^the \(4,\) float64"):
        assert_bytes_differ(np.ones(4), np.ones(4))
    assert_bytes_differ(np.ones(4), np.zeros(4))
