"""The int8 scan (``int8_topk`` / ``int8_dots``, csrc/src/int8_scan.cc) against a numpy reference:
exactly the same candidates and scores on every SIMD path this CPU has (each forced by name), for
random sizes (odd widths, tails shorter than a vector, fewer rows than k, row blocks crossed),
strided inputs read in place, ties broken by the lower row index, and the errors a caller can hit.
"""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import pytest
from numpy.testing import assert_array_equal

from expertcache import _native

PATHS = list(_native.INT8_SCAN_PATHS)
ALL_PATHS = ("avx512_vnni", "avx2", "portable")


def reference(queries: np.ndarray, rows: np.ndarray, scale: np.ndarray, k: int):
    """(index int64 [T, min(k, N)], score float32 [T, min(k, N)]): best first, ties by lower index."""
    dots = queries.astype(np.int64) @ rows.astype(np.int64).T  # [T, N], exact
    scores = dots.astype(np.int32).astype(np.float32) * scale[None, :]  # one float32 multiply
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(scores, order, axis=1)


def random_case(rng: np.random.Generator, t: int, n: int, width: int):
    queries = rng.integers(0, 128, size=(t, width), dtype=np.int8)
    rows = rng.integers(-128, 128, size=(n, width), dtype=np.int8)
    scale = rng.normal(size=n).astype(np.float32)
    scale[rng.random(n) < 0.1] = 0.0  # zero scores tie with each other
    return queries, rows, scale


def test_paths_follow_the_cpu():
    assert PATHS[-1] == "portable" and set(PATHS) <= set(ALL_PATHS)
    cpuinfo = Path("/proc/cpuinfo")
    if platform.machine() not in ("x86_64", "AMD64"):
        assert PATHS == ["portable"]
        return
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo to read the CPU's flags from")
    flags = set(next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")).split())
    assert ("avx2" in PATHS) == ("avx2" in flags)
    assert ("avx512_vnni" in PATHS) == ({"avx512f", "avx512bw", "avx512_vnni"} <= flags)
    assert PATHS == [p for p in ALL_PATHS if p in PATHS]  # fastest first


@pytest.mark.parametrize("path", [*PATHS, "auto"])
def test_top_k_equals_the_reference_for_random_sizes(path):
    rng = np.random.default_rng(16)
    widths = [1, 3, 7, 31, 32, 33, 63, 64, 65, 100, 127, 768, 769]
    for trial in range(60):
        width = widths[trial % len(widths)]
        n = int(rng.choice([1, 2, 3, 5, 17, 100, 255, 256, 257, 600, 1000]))
        t = int(rng.choice([1, 2, 5]))
        k = int(rng.choice([1, 4, 32, n, n + 7]))  # n + 7: fewer rows than k
        queries, rows, scale = random_case(rng, t, n, width)
        index, score = _native.int8_topk(queries, rows, scale, k, path)
        want_index, want_score = reference(queries, rows, scale, k)
        case = f"trial {trial}: T={t} N={n} width={width} k={k}"
        assert index.dtype == np.int64 and score.dtype == np.float32, case
        assert index.shape == (t, min(k, n)), case
        assert_array_equal(index, want_index, err_msg=case)
        assert_array_equal(score, want_score, err_msg=case)


@pytest.mark.parametrize("path", PATHS)
def test_ties_go_to_the_lower_row(path):
    rng = np.random.default_rng(3)
    # Rows of 0/1 bytes and one scale: many rows share each score.
    rows = rng.integers(0, 2, size=(700, 45), dtype=np.int8)
    queries = np.ones((3, 45), dtype=np.int8)
    scale = np.full(700, 0.5, dtype=np.float32)
    index, score = _native.int8_topk(queries, rows, scale, 40, path)
    want_index, want_score = reference(queries, rows, scale, 40)
    assert_array_equal(index, want_index)
    assert_array_equal(score, want_score)
    assert len(np.unique(score[0])) < 40  # the case really has ties


@pytest.mark.parametrize("path", PATHS)
def test_dots_are_exact_at_the_extremes(path):
    # The largest products in both signs, over widths whose sums would overflow int16: no path
    # may saturate.
    for width in (1, 33, 64, 130, 4097):
        query = np.full(width, 127, dtype=np.int8)
        rows = np.stack([np.full(width, -128), np.full(width, 127), np.zeros(width)]).astype(np.int8)
        dots = _native.int8_dots(query, rows, path)
        assert dots.dtype == np.int32
        assert_array_equal(dots, [-127 * 128 * width, 127 * 127 * width, 0])
    rng = np.random.default_rng(5)
    for width in (5, 29, 96, 200, 1023):
        query = rng.integers(0, 128, size=width, dtype=np.int8)
        rows = rng.integers(-128, 128, size=(37, width), dtype=np.int8)
        assert_array_equal(
            _native.int8_dots(query, rows, path), rows.astype(np.int64) @ query.astype(np.int64)
        )


@pytest.mark.parametrize("path", PATHS)
def test_strided_inputs_are_read_in_place(path):
    # What the EAMC passes: the first `width` columns of a wider matrix, a column of a 2-D scale.
    rng = np.random.default_rng(9)
    wide = rng.integers(-128, 128, size=(900, 24 * 32), dtype=np.int8)
    ranks = rng.random((900, 25), dtype=np.float32)
    queries = rng.integers(0, 128, size=(4, 24 * 32), dtype=np.int8)
    for layers in (1, 5, 23):
        width = layers * 32
        rows, scale = wide[:, :width], ranks[:, layers]
        assert not rows.flags.c_contiguous and not scale.flags.c_contiguous
        index, score = _native.int8_topk(queries[:, :width], rows, scale, 32, path)
        want_index, want_score = reference(queries[:, :width], rows, scale, 32)
        assert_array_equal(index, want_index)
        assert_array_equal(score, want_score)


def test_every_path_gives_the_same_answer():
    rng = np.random.default_rng(11)
    queries, rows, scale = random_case(rng, 3, 2000, 24 * 32)
    answers = [_native.int8_topk(queries, rows, scale, 32, p) for p in PATHS]
    for index, score in answers[1:]:
        assert_array_equal(index, answers[0][0])
        assert_array_equal(score, answers[0][1])


def test_no_rows_gives_empty_results():
    index, score = _native.int8_topk(
        np.zeros((2, 8), np.int8), np.zeros((0, 8), np.int8), np.zeros(0, np.float32), 5
    )
    assert index.shape == score.shape == (2, 0)


def test_unsupported_paths_are_refused():
    queries, rows, scale = np.zeros((1, 4), np.int8), np.zeros((3, 4), np.int8), np.ones(3, np.float32)
    with pytest.raises(
        ValueError, match=r"unknown int8 scan path 'sse9': use one of avx512_vnni, avx2, portable"
    ):
        _native.int8_topk(queries, rows, scale, 2, "sse9")
    for missing in sorted(set(ALL_PATHS) - set(PATHS)):
        with pytest.raises(ValueError, match=rf"'{missing}' is not supported on this CPU \(it has: "):
            _native.int8_topk(queries, rows, scale, 2, missing)
        with pytest.raises(ValueError, match="not supported on this CPU"):
            _native.int8_dots(queries[0], rows, missing)


def test_bad_arguments_name_what_is_wrong():
    q, rows, scale = np.zeros((2, 6), np.int8), np.zeros((4, 6), np.int8), np.ones(4, np.float32)
    topk = _native.int8_topk
    cases = [
        (
            (q.astype(np.int16), rows, scale, 3),
            r"queries must be a 2-D int8 array \[T, width\], got int16 of shape \(2, 6\)",
        ),
        ((q[0], rows, scale, 3), r"queries must be a 2-D int8 array \[T, width\], got int8 of shape \(6,\)"),
        ((q, [[1, 2]], scale, 3), r"rows must be a 2-D int8 array \[N, width\], got list"),
        ((q, rows, scale.astype(np.float64), 3), r"scale must be a 1-D float32 array \[N\], got float64"),
        ((q, rows[:, :5], scale, 3), r"rows are 5 wide but the queries 6"),
        ((q, rows, scale[:3], 3), r"scale has 3 values for 4 rows"),
        ((q, rows, scale, 0), r"k must be >= 1, got 0"),
        ((q, rows[:, ::2], scale[:4], 3), r"rows are 3 wide"),
        ((q[:, ::2], rows[:, ::2], scale, 3), r"must be contiguous \(column stride 1\)"),
        ((q, rows[::-1], scale, 3), r"rows has a negative or unaligned stride"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            topk(*args)
    negative = q.copy()
    negative[1, 4] = -3
    with pytest.raises(ValueError, match=r"query values must be in \[0, 127\].*got -3 at \[1, 4\]"):
        topk(negative, rows, scale, 3)
    nan = scale.copy()
    nan[2] = np.nan
    with pytest.raises(ValueError, match=r"scale\[2\] is NaN"):
        topk(q, rows, nan, 3)
    with pytest.raises(ValueError, match=r"int8_dots: rows are 6 wide but the query 5"):
        _native.int8_dots(q[0, :5].copy(), rows)
    with pytest.raises(ValueError, match=r"query values must be in \[0, 127\].*got -3 at \[0, 4\]"):
        _native.int8_dots(negative[1], rows)
