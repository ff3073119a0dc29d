"""The native EAMC match (``eamc_match`` / ``q4_topk`` / ``q4_dots``, csrc/src/eamc_match.cc)
against numpy references: the 4-bit first stage gives exactly the same candidates and scores on
every SIMD path this CPU has (each forced by name) for random sizes (widths inside a group, fewer
rows than k, row blocks crossed), with ties broken by the lower row and no int16 saturation at
the extremes; the whole match equals the formulas of its header computed in numpy; and every
argument a caller can get wrong is refused with a message that names it.
"""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal

from expertcache import _native
from predictor_svc.eamc import block_normalise, pack_q4, q4_row_bytes

PATHS = list(_native.Q4_SCAN_PATHS)
ALL_PATHS = ("avx2", "portable")


def reference_topk(queries: np.ndarray, values: np.ndarray, scale: np.ndarray, k: int):
    """(index int64 [T, min(k, N)], score float32): best first, ties by lower index."""
    dots = queries.astype(np.int64) @ values.astype(np.int64).T  # [T, N], exact
    scores = dots.astype(np.int32).astype(np.float32) * scale[None, :]  # one float32 multiply
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(scores, order, axis=1)


def random_case(rng: np.random.Generator, t: int, n: int, width: int):
    queries = rng.integers(0, 128, size=(t, width), dtype=np.int8)
    values = rng.integers(0, 16, size=(n, width), dtype=np.uint8)
    scale = rng.normal(size=n).astype(np.float32)
    scale[rng.random(n) < 0.1] = 0.0  # zero scores tie with each other
    return queries, values, scale


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


@pytest.mark.parametrize("path", [*PATHS, "auto"])
def test_top_k_equals_the_reference_for_random_sizes(path):
    rng = np.random.default_rng(16)
    widths = [1, 3, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 768, 769]
    for trial in range(60):
        width = widths[trial % len(widths)]
        n = int(rng.choice([1, 2, 3, 5, 17, 100, 255, 256, 257, 600, 1000]))
        t = int(rng.choice([1, 2, 5]))
        k = int(rng.choice([1, 4, 32, n, n + 7]))  # n + 7: fewer rows than k
        queries, values, scale = random_case(rng, t, n, width)
        index, score = _native.q4_topk(queries, pack_q4(values), scale, k, path)
        want_index, want_score = reference_topk(queries, values, scale, k)
        case = f"trial {trial}: T={t} N={n} width={width} k={k}"
        assert index.dtype == np.int64 and score.dtype == np.float32, case
        assert index.shape == (t, min(k, n)), case
        assert_array_equal(index, want_index, err_msg=case)
        assert_array_equal(score, want_score, err_msg=case)


@pytest.mark.parametrize("path", PATHS)
def test_a_prefix_width_reads_whole_groups_of_a_wider_row(path):
    # What the EAMC passes: rows packed at the full width, a query over the first layers only
    # (a width inside a group: the group's later values must count zero).
    rng = np.random.default_rng(9)
    values = rng.integers(0, 16, size=(900, 24 * 32), dtype=np.uint8)
    packed = pack_q4(values)
    queries = rng.integers(0, 128, size=(4, 24 * 32), dtype=np.int8)
    scale = rng.random(900, dtype=np.float32)
    for layers in (1, 3, 5, 23, 24):
        width = layers * 32
        index, score = _native.q4_topk(np.ascontiguousarray(queries[:, :width]), packed, scale, 32, path)
        want_index, want_score = reference_topk(queries[:, :width], values[:, :width], scale, 32)
        assert_array_equal(index, want_index)
        assert_array_equal(score, want_score)


@pytest.mark.parametrize("path", PATHS)
def test_ties_go_to_the_lower_row(path):
    rng = np.random.default_rng(3)
    values = rng.integers(0, 2, size=(700, 45), dtype=np.uint8)  # 0/1 values, one scale: many ties
    queries = np.ones((3, 45), dtype=np.int8)
    scale = np.full(700, 0.5, dtype=np.float32)
    index, score = _native.q4_topk(queries, pack_q4(values), scale, 40, path)
    want_index, want_score = reference_topk(queries, values, scale, 40)
    assert_array_equal(index, want_index)
    assert_array_equal(score, want_score)
    assert len(np.unique(score[0])) < 40  # the case really has ties


@pytest.mark.parametrize("path", PATHS)
def test_dots_are_exact_at_the_extremes(path):
    # The largest products over widths whose sums would overflow int16: no path may saturate.
    for width in (1, 33, 64, 130, 256, 257, 4097):
        query = np.full(width, 127, dtype=np.int8)
        values = np.stack([np.full(width, 15), np.zeros(width), np.full(width, 1)]).astype(np.uint8)
        dots = _native.q4_dots(query, pack_q4(values), path)
        assert dots.dtype == np.int32
        assert_array_equal(dots, [127 * 15 * width, 0, 127 * width])
    rng = np.random.default_rng(5)
    for width in (5, 29, 96, 200, 1023):
        query = rng.integers(0, 128, size=width, dtype=np.int8)
        values = rng.integers(0, 16, size=(37, width), dtype=np.uint8)
        assert_array_equal(
            _native.q4_dots(query, pack_q4(values), path), values.astype(np.int64) @ query.astype(np.int64)
        )


def test_every_path_gives_the_same_answer():
    rng = np.random.default_rng(11)
    queries, values, scale = random_case(rng, 3, 2000, 24 * 32)
    answers = [_native.q4_topk(queries, pack_q4(values), scale, 32, p) for p in PATHS]
    for index, score in answers[1:]:
        assert_array_equal(index, answers[0][0])
        assert_array_equal(score, answers[0][1])


def test_no_rows_gives_empty_results():
    index, score = _native.q4_topk(
        np.zeros((2, 8), np.int8), np.zeros((0, 32), np.uint8), np.zeros(0, np.float32), 5
    )
    assert index.shape == score.shape == (2, 0)


def test_unsupported_paths_are_refused():
    queries, rows, scale = np.zeros((1, 4), np.int8), np.zeros((3, 32), np.uint8), np.ones(3, np.float32)
    with pytest.raises(ValueError, match=r"unknown q4 scan path 'sse9': use one of avx2, portable"):
        _native.q4_topk(queries, rows, scale, 2, "sse9")
    for missing in sorted(set(ALL_PATHS) - set(PATHS)):
        with pytest.raises(ValueError, match=rf"'{missing}' is not supported on this CPU \(it has: "):
            _native.q4_topk(queries, rows, scale, 2, missing)


def test_bad_first_stage_arguments_name_what_is_wrong():
    q, rows, scale = np.zeros((2, 70), np.int8), np.zeros((4, 64), np.uint8), np.ones(4, np.float32)
    topk = _native.q4_topk
    cases = [
        ((q.astype(np.int16), rows, scale, 3), r"queries must be a 2-D int8 array \[T, width\], got int16"),
        ((q, rows.astype(np.int8), scale, 3), r"rows must be a 2-D uint8 array \[N, row bytes\], got int8"),
        ((q, rows, scale.astype(np.float64), 3), r"scale must be a 1-D float32 array \[N\], got float64"),
        ((q, rows[:, :32], scale, 3), r"rows are 32 bytes but 70 values take 64"),
        ((q, rows, scale[:3], 3), r"scale has 3 rows for 4 entries"),
        ((q, rows, scale, 0), r"k must be >= 1, got 0"),
        ((q[:, ::2], rows, scale, 3), r"the rows of queries must be contiguous"),
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
    with pytest.raises(ValueError, match=r"query values must be in \[0, 127\].*got -3 at \[0, 4\]"):
        _native.q4_dots(negative[1], rows)


# ---- the whole match -------------------------------------------------------------------------


def collection(rng: np.random.Generator, n: int, layers: int, experts: int):
    """The arrays an EamcIndex keeps for n random entries, built here from the header's formulas:
    (counts, q4, rank [L+1, N], rows, nonempty [N, L+1], scale)."""
    counts = rng.integers(0, 12, size=(n, layers, experts)).astype(np.float32)
    counts[rng.random((n, layers)) < 0.1] = 0  # some empty layers
    tokens = np.maximum(counts.sum(axis=2).max(axis=1), 1)
    normalised, norms = block_normalise(counts)
    rows = normalised.reshape(n, -1)
    scale = (norms / tokens[:, None]).astype(np.float32)
    nonempty = np.zeros((n, layers + 1), np.float32)
    nonempty[:, 1:] = np.cumsum(norms > 0, axis=1)
    top = rows.max(axis=1)
    safe = np.where(top > 0, top, 1.0).astype(np.float32)
    q4 = pack_q4(np.rint(rows * (15.0 / safe)[:, None]).astype(np.uint8))
    qscale = np.where(top > 0, top / 15.0, 0.0).astype(np.float32)
    rank = np.divide(qscale[:, None], np.sqrt(nonempty), out=np.zeros_like(nonempty), where=nonempty > 0).T
    return counts, q4, np.ascontiguousarray(rank), rows, nonempty, scale


def reference_match(query, layers, q4_values, rank, rows, nonempty, scale, c, k, sharpness):
    """One query's match by the header's formulas: (best [k], sims [k], prediction [L, E])."""
    L, E = query.shape
    width = layers * E
    qn, qnorms = block_normalise(query[:layers])
    qflat = qn.reshape(width)
    q_nonempty = np.float32((qnorms > 0).sum())
    top = qflat.max()
    q8 = np.rint(qflat * (np.float32(127.0) / (top if top > 0 else np.float32(1.0)))).astype(np.int64)
    approx = (q4_values[:, :width].astype(np.int64) @ q8).astype(np.float32) * rank[layers]
    cand = np.argsort(-approx, kind="stable")[:c]
    d = np.sqrt(q_nonempty * nonempty[cand, layers])
    exact = np.where(d > 0, (rows[cand, :width] @ qflat) / np.where(d > 0, d, 1), 0).astype(np.float32)
    order = np.lexsort((cand, -exact))[:k]
    best, sims = cand[order], exact[order]
    w = np.clip(sims, 0, None) ** np.float32(sharpness)
    w = w / w.sum() if w.sum() > 0 else np.full(k, 1.0 / k, np.float32)
    pred = np.einsum("k,kl,kle->le", w, scale[best], rows[best].reshape(k, L, E))
    return best, sims, np.clip(pred, 0, 1)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("layers", "experts"), [(4, 6), (24, 32), (3, 60)])
def test_the_match_equals_its_formulas(path, layers, experts):
    rng = np.random.default_rng(layers * 100 + experts)
    n = 400
    counts, q4, rank, rows, nonempty, scale = collection(rng, n, layers, experts)
    from predictor_svc.eamc import unpack_q4

    values = unpack_q4(q4, layers * experts)
    queries = rng.integers(0, 5, size=(6, layers, experts)).astype(np.float32)
    for seen in sorted({1, max(1, layers // 2), layers}):
        for sharpness in (0.0, 1.0, 3.0):
            best, sims, pred = _native.eamc_match(
                queries, seen, q4, rank[seen], rows, nonempty[:, seen], scale, 32, 8, sharpness, path
            )
            assert best.shape == sims.shape == (6, 8) and pred.shape == (6, layers, experts)
            for t in range(6):
                want = reference_match(
                    queries[t], seen, values, rank, rows, nonempty, scale, 32, 8, sharpness
                )
                case = f"seen {seen} sharpness {sharpness} query {t}"
                assert_array_equal(best[t], want[0], err_msg=case)
                assert_allclose(sims[t], want[1], rtol=1e-5, atol=1e-6, err_msg=case)
                assert_allclose(pred[t], want[2], rtol=1e-5, atol=1e-6, err_msg=case)


def test_bad_match_arguments_name_what_is_wrong():
    rng = np.random.default_rng(1)
    counts, q4, rank, rows, nonempty, scale = collection(rng, 50, 4, 6)
    q = rng.integers(0, 3, size=(2, 4, 6)).astype(np.float32)
    good = dict(counts=q, layers=2, q4=q4, rank=rank[2], rows=rows, nonempty=nonempty[:, 2], scale=scale)

    def call(candidates=32, k=8, sharpness=1.0, **change):
        args = {**good, **change}
        return _native.eamc_match(
            args["counts"],
            args["layers"],
            args["q4"],
            args["rank"],
            args["rows"],
            args["nonempty"],
            args["scale"],
            candidates,
            k,
            sharpness,
        )

    call()  # the good call works
    nan_count = q.copy()
    nan_count[1, 2, 3] = np.nan
    negative = q.copy()
    negative[0, 1, 0] = -1
    nan_rank = rank[2].copy()
    nan_rank[7] = np.nan
    cases = [
        (dict(counts=q.astype(np.float64)), r"counts must be a 3-D float32 array \[T, L, E\], got float64"),
        (dict(counts=q[0]), r"counts must be a 3-D float32 array"),
        (dict(counts=q[:, :, ::2]), r"counts must be C-contiguous"),
        (dict(layers=0), r"layers must be in \[1, 4\], got 0"),
        (dict(layers=5), r"layers must be in \[1, 4\], got 5"),
        (dict(q4=q4[:40]), r"rank has 50 rows for 40 entries"),
        (dict(q4=q4[:, :16]), r"q4 rows are 16 bytes, 24 values take 32"),
        (dict(rows=rows[:, :20]), r"rows must be at least L \* E = 24 wide"),
        (dict(scale=scale[:, :3]), r"scale at least L = 4"),
        (dict(rank=np.ascontiguousarray(np.stack([rank[2]] * 2, 1))[:, 0]), r"rank must be contiguous"),
        (dict(nonempty=nonempty[:30, 2]), r"nonempty has 30 rows for 50 entries"),
        (dict(counts=nan_count), r"counts must be finite and >= 0, got nan at \[1, 2, 3\]"),
        (dict(counts=negative), r"counts must be finite and >= 0, got -1.0+ at \[0, 1, 0\]"),
        (dict(rank=nan_rank), r"rank\[7\] is NaN"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            call(**change)
    with pytest.raises(ValueError, match=r"candidates must be in \[k, N\] = \[8, 50\], got 51"):
        call(candidates=51)
    with pytest.raises(ValueError, match=r"candidates must be in \[k, N\] = \[9, 50\], got 8"):
        call(candidates=8, k=9)
    with pytest.raises(ValueError, match=r"k must be >= 1"):
        call(k=0)
    with pytest.raises(ValueError, match=r"sharpness must be a finite number >= 0"):
        call(sharpness=float("nan"))
    with pytest.raises(ValueError, match=r"sharpness must be a finite number >= 0"):
        call(sharpness=-1.0)
    assert q4_row_bytes(24) == 32
