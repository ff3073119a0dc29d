"""EamcIndex matching against a brute-force cosine, and Eamc over the embedded store."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from numpy.testing import assert_allclose

from predictor_svc.eam import EamShape, decode_eam, encode_eam
from predictor_svc.eamc import Eamc, EamcIndex
from predictor_svc.errors import Conflict, CorruptEntry
from predictor_svc.store import EmbeddedStore, open_store
from tests.threads import run_in_threads

SHAPE = EamShape(layers=4, experts=6, top_k=2)
SHAPE_LE = (SHAPE.layers, SHAPE.experts)


def random_eam(rng: np.random.Generator, tokens: int = 20, shape: EamShape = SHAPE) -> np.ndarray:
    eam = np.zeros((shape.layers, shape.experts), dtype=np.uint32)
    prefs = rng.dirichlet(np.full(shape.experts, 0.5), size=shape.layers)
    for _ in range(tokens):
        for layer in range(shape.layers):
            chosen = rng.choice(shape.experts, size=shape.top_k, replace=False, p=prefs[layer])
            eam[layer, chosen] += 1
    return eam


def brute_cosine(query: np.ndarray, entry: np.ndarray, layers: int) -> float:
    """Cosine of the per-layer L2-normalised matrices over the first ``layers`` layers."""

    def blocks(m):
        m = m[:layers].astype(np.float64)
        n = np.linalg.norm(m, axis=1, keepdims=True)
        return np.divide(m, n, out=np.zeros_like(m), where=n > 0).ravel()

    a, b = blocks(query), blocks(entry)
    denom = np.linalg.norm(a) * np.linalg.norm(b)
    return float(a @ b / denom) if denom else 0.0


@pytest.fixture
def filled():
    rng = np.random.default_rng(1)
    index = EamcIndex(SHAPE, initial_rows=2)  # forces growth
    entries = {f"e{i}": random_eam(rng) for i in range(40)}
    for entry_id, eam in entries.items():
        index.upsert(entry_id, eam, 20)
    return index, entries, rng


@pytest.mark.parametrize("layers_seen", [1, 2, 4])
def test_similarities_equal_brute_force(filled, layers_seen):
    index, entries, rng = filled
    query = random_eam(rng, tokens=3)
    query[layers_seen:] = 0  # a partial EAM: later layers not seen yet
    sims = index.similarities(query, layers_seen)
    expected = [brute_cosine(query, entries[i], layers_seen) for i in index.ids()]
    assert sims.dtype == np.float32 and sims.shape == (40,)
    assert_allclose(sims, expected, rtol=1e-5, atol=1e-6)
    # per-layer mean cosine when every block is non-empty
    per_layer = [
        np.mean([brute_cosine(query[j : j + 1], entries[i][j : j + 1], 1) for j in range(layers_seen)])
        for i in index.ids()
    ]
    assert_allclose(sims, per_layer, rtol=1e-5, atol=1e-6)


def test_top_match_is_the_entry_itself(filled):
    index, entries, _ = filled
    entry_id, sim = index.most_similar(entries["e17"] * 3)  # same direction, other scale
    assert entry_id == "e17" and sim == pytest.approx(1.0, abs=1e-5)
    assert EamcIndex(SHAPE).most_similar(entries["e1"]) is None


class CountingArray(np.ndarray):
    """Counts matmul ufunc calls and per-row integer indexing of the index's matrix."""

    matmuls = 0
    row_reads = 0

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if ufunc is np.matmul:
            CountingArray.matmuls += 1
        inputs = tuple(np.asarray(x) if isinstance(x, CountingArray) else x for x in inputs)
        return getattr(ufunc, method)(*inputs, **kwargs)

    def __getitem__(self, item):
        if isinstance(item, (int, np.integer)):
            CountingArray.row_reads += 1
        return super().__getitem__(item)


def test_one_matrix_product_per_query(filled):
    index, _, rng = filled
    index._rows = index._rows.view(CountingArray)
    CountingArray.matmuls = CountingArray.row_reads = 0
    index.similarities(random_eam(rng, 2), 4)
    assert (CountingArray.matmuls, CountingArray.row_reads) == (1, 0)
    index.similarities(np.stack([random_eam(rng, 2) for _ in range(5)]), 3)  # a batch: still one
    assert (CountingArray.matmuls, CountingArray.row_reads) == (2, 0)


def test_upsert_and_remove_keep_matrix_consistent(filled):
    index, entries, rng = filled
    for victim in ["e0", "e39", "e20", "e5"]:
        assert index.remove(victim)
        del entries[victim]
    assert not index.remove("e0")
    entries["e7"] = random_eam(rng)  # replace in place
    index.upsert("e7", entries["e7"], 20)
    entries["new"] = random_eam(rng)
    index.upsert("new", entries["new"], 20)
    assert len(index) == len(entries) == 37 and sorted(index.ids()) == sorted(entries)
    query = random_eam(rng, 5)
    expected = [brute_cosine(query, entries[i], 4) for i in index.ids()]
    assert_allclose(index.similarities(query, 4), expected, rtol=1e-5, atol=1e-6)
    assert index.most_similar(entries["new"])[0] == "new"


def test_predict_is_weighted_frequency(filled):
    index, entries, rng = filled
    # top_n=1: the best match's own frequencies (counts / tokens)
    best, _ = index.most_similar(entries["e3"])
    pred = index.predict(entries["e3"], 4, top_n=1)
    assert pred.dtype == np.float32 and pred.shape == (4, 6)
    assert_allclose(pred, entries[best] / 20, rtol=1e-5, atol=1e-6)
    many = index.predict(random_eam(rng, 4), 2, top_n=10, sharpness=2.0)
    assert many.min() >= 0 and many.max() <= 1
    assert_allclose(many.sum(axis=1), SHAPE.top_k, rtol=1e-4)  # each token routes top_k
    # nothing seen: the collection's mean frequency
    mean = np.mean([e / 20 for e in entries.values()], axis=0)
    assert_allclose(index.predict(np.zeros((4, 6)), 0, top_n=40), mean, rtol=1e-5, atol=1e-6)


def test_query_validation(filled):
    index, _, _ = filled
    with pytest.raises(ValueError, match=r"layers_seen must be in \[0, 4\], got 5"):
        index.similarities(np.zeros((4, 6)), 5)
    with pytest.raises(ValueError, match=r"query must be \[4, 6\], got \(3, 6\)"):
        index.similarities(np.zeros((3, 6)), 2)
    with pytest.raises(ValueError, match=r"eam must be \[4, 6\]"):
        index.upsert("x", np.zeros((4, 5)))


# -- Eamc over the embedded store ------------------------------------------------------------


def test_insert_appends_then_replaces_most_similar():
    rng = np.random.default_rng(2)
    store = EmbeddedStore()
    eamc = Eamc(store, "m", SHAPE, capacity=5)
    eams = [random_eam(rng) for _ in range(5)]
    ids = [eamc.insert(e, 20) for e in eams]
    assert eamc.entries == 5 == store.count("m") and len(set(ids)) == 5
    # a near copy of entry 3 replaces entry 3
    near = eams[3] + 1
    expected_victim = eamc.index.most_similar(near)[0]
    assert expected_victim == ids[3]
    new_id = eamc.insert(near, 21)
    assert store.count("m") == 5 == eamc.entries
    assert ids[3] not in eamc.ids() and new_id in eamc.ids()
    entries, _ = store.load("m")
    assert set(entries) == set(eamc.ids())
    np.testing.assert_array_equal(decode_eam(entries[new_id], SHAPE)[0], near)


def test_two_replicas_sync_incrementally():
    rng = np.random.default_rng(3)
    store = EmbeddedStore()
    a, b = Eamc(store, "m", SHAPE, 8), Eamc(store, "m", SHAPE, 8)
    a.sync(), b.sync()
    for _ in range(3):
        a.insert(random_eam(rng), 20)
    assert b.sync() == 3 and b.counters.full_reloads == 1 and b.counters.incremental_syncs == 1
    assert sorted(b.ids()) == sorted(a.ids())
    for _ in range(7):  # passes capacity: b sees the replacements as put+del changes
        b.insert(random_eam(rng), 20)
    a.sync()
    assert sorted(a.ids()) == sorted(b.ids()) and a.entries == 8
    assert a.counters.full_reloads == 1 and b.counters.full_reloads == 1


def test_conflicting_victim_is_retried():
    rng = np.random.default_rng(4)
    store = EmbeddedStore()
    a, b = Eamc(store, "m", SHAPE, 3), Eamc(store, "m", SHAPE, 3)
    for _ in range(3):
        a.insert(random_eam(rng), 20)
    b.sync()
    target = random_eam(rng)
    a.insert(target, 20)  # replaces a victim b still has in its (stale) view
    b.insert(target + 1, 20)  # b picks the same stale victim first -> Conflict -> sync -> retry
    assert b.counters.conflicts >= 1 and store.count("m") == 3
    a.sync()
    assert sorted(a.ids()) == sorted(b.ids())


def test_insert_gives_up_after_attempts():
    class AlwaysConflict(EmbeddedStore):
        def insert(self, model_id, blob, capacity, victim_id):
            raise Conflict("victim x is gone")

    eamc = Eamc(AlwaysConflict(), "m", SHAPE, 3, max_insert_attempts=3)
    with pytest.raises(Conflict, match="gave up after 3 conflicting attempts") as info:
        eamc.insert(random_eam(np.random.default_rng(0)), 20)
    assert info.value.grpc_code == "FAILED_PRECONDITION" and eamc.counters.conflicts == 3


def test_store_rejects_stale_views():
    store = EmbeddedStore()
    blob = encode_eam(np.ones((4, 6), np.uint32), 1)
    first = store.insert("m", blob, 1, None)
    with pytest.raises(Conflict, match="at capacity 1 .1 entries. and no victim was named"):
        store.insert("m", blob, 1, None)
    with pytest.raises(Conflict, match="victim 'nope' is gone"):
        store.insert("m", blob, 1, "nope")
    assert store.insert("m", blob, 1, first) != first and store.count("m") == 1


def test_trimmed_log_forces_full_reload():
    rng = np.random.default_rng(5)
    store = EmbeddedStore(log_len=4)
    a, b = Eamc(store, "m", SHAPE, 50), Eamc(store, "m", SHAPE, 50)
    b.sync()
    for _ in range(6):
        a.insert(random_eam(rng), 20)
    b.sync()
    assert b.counters.full_reloads == 2 and sorted(b.ids()) == sorted(a.ids())
    assert store.changes("m", "other-epoch:0") is None


def test_concurrent_threads_hold_capacity():
    store = EmbeddedStore()
    capacity = 10
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        eamc = Eamc(store, "m", SHAPE, capacity)
        try:
            for _ in range(15):
                eamc.insert(random_eam(rng, tokens=5), 5)
                assert store.count("m") <= capacity
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    run_in_threads(worker, range(4))
    assert not errors
    entries, _ = store.load("m")
    assert len(entries) == capacity
    for blob in entries.values():
        decode_eam(blob, SHAPE)


def test_corrupt_entry_in_store_is_skipped_and_counted():
    store = EmbeddedStore()
    store.insert("m", b"garbage", 5, None)
    store.insert("m", encode_eam(np.ones((4, 6), np.uint32), 1), 5, None)
    eamc = Eamc(store, "m", SHAPE, 5)
    eamc.sync()
    assert eamc.entries == 1 and eamc.counters.corrupt_entries == 1


# -- embedded store file -----------------------------------------------------------------------


def test_embedded_save_load_round_trip(tmp_path: Path):
    rng = np.random.default_rng(6)
    path = tmp_path / "eamc.bin"
    store = open_store(None, path)
    for model in ("a", "b"):
        eamc = Eamc(store, model, SHAPE, 4)
        for _ in range(6):
            eamc.insert(random_eam(rng), 20)
    before = {m: store.load(m)[0] for m in ("a", "b")}
    store.close()
    assert path.exists() and not list(tmp_path.glob(".*tmp"))
    reopened = open_store("", path)
    assert {m: reopened.load(m)[0] for m in ("a", "b")} == before
    eamc = Eamc(reopened, "a", SHAPE, 4)
    eamc.insert(random_eam(rng), 20)  # ids continue, no clash
    assert eamc.entries == 4 and len(set(eamc.ids())) == 4


def test_embedded_save_is_atomic(tmp_path: Path, monkeypatch):
    path = tmp_path / "eamc.bin"
    store = EmbeddedStore()
    store.insert("m", encode_eam(np.ones((4, 6), np.uint32), 1), 4, None)
    store.save(path)
    good = path.read_bytes()
    store.insert("m", encode_eam(np.ones((4, 6), np.uint32), 2), 4, None)

    def boom(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr("os.replace", boom)
    with pytest.raises(OSError, match="disk gone"):
        store.save(path)
    assert path.read_bytes() == good and not list(tmp_path.glob(".*tmp"))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b[:5], "is truncated"),
        (lambda b: b"NOTMAGIC" + b[8:], "bad magic"),
        (lambda b: b[:20] + bytes([b[20] ^ 1]) + b[21:], "checksum mismatch"),
        (lambda b: b[:-10], "checksum mismatch"),
    ],
)
def test_corrupt_embedded_file(tmp_path: Path, mutate, message):
    path = tmp_path / "eamc.bin"
    store = EmbeddedStore()
    store.insert("m", encode_eam(np.ones((4, 6), np.uint32), 1), 4, None)
    store.save(path)
    path.write_bytes(mutate(path.read_bytes()))
    with pytest.raises(CorruptEntry, match=message) as info:
        open_store(None, path)
    assert str(path) in str(info.value) and info.value.grpc_code == "DATA_LOSS"


def test_open_store_registry():
    assert isinstance(open_store(None, None), EmbeddedStore)
    with pytest.raises(ValueError, match=r"unknown EAMC store URL scheme 'http'.*valid: \['redis'"):
        open_store("http://localhost:6379", None)


def test_queries_answer_while_the_store_hangs():
    """A slow/down store (a Redis connect timeout) must not stall matching."""
    rng = np.random.default_rng(7)
    entered, release = threading.Event(), threading.Event()

    class HangingStore(EmbeddedStore):
        hang = False

        def changes(self, model_id, cursor, limit=0):
            if self.hang:
                entered.set()
                release.wait(10)
            return super().changes(model_id, cursor, limit)

    store = HangingStore()
    eamc = Eamc(store, "m", SHAPE, 10)
    for _ in range(3):
        eamc.insert(random_eam(rng), 20)
    store.hang = True
    syncing = threading.Thread(target=eamc.sync)
    syncing.start()
    assert entered.wait(5)
    answered = []
    query = threading.Thread(target=lambda: answered.append(eamc.similarities(random_eam(rng, 2))))
    query.start()
    query.join(2)
    release.set()
    syncing.join(5)
    assert answered and answered[0].shape == (3,)


def exact_predict(
    index: EamcIndex, query: np.ndarray, layers: int, top_n: int, sharpness: float
) -> np.ndarray:
    """The prediction from the exact scan of every entry (the reference of the two-stage match)."""
    sims = index.similarities(query, layers)
    best = np.argsort(-sims, kind="stable")[:top_n]
    weights = np.clip(sims[best], 0.0, None) ** sharpness
    weights = weights / weights.sum()
    n = len(index)
    freqs = index._rows[:n].reshape(n, *query.shape) * index._scale[:n][..., None]
    return np.einsum("k,kle->le", weights, freqs[best])


@pytest.mark.parametrize("layers_seen", [1, 3, 4])
def test_two_stage_match_chooses_the_exact_top_n(layers_seen):
    # 600 entries: more than the candidates rescored, so the 4-bit scan runs first.
    rng = np.random.default_rng(7)
    index = EamcIndex(SHAPE)
    entries = [random_eam(rng, tokens=int(rng.integers(5, 60))) for _ in range(600)]
    index.upsert_many(
        [f"e{i}" for i in range(600)], np.stack(entries), np.array([e.sum(1).max() // 2 for e in entries])
    )
    assert len(index) == 600 and index.candidates(8) < 600
    for _ in range(20):
        query = random_eam(rng, tokens=4)
        query[layers_seen:] = 0
        got = index.predict(query, layers_seen, top_n=8, sharpness=4.0)
        assert_allclose(got, exact_predict(index, query, layers_seen, 8, 4.0), rtol=1e-4, atol=1e-6)
    batch = np.stack([random_eam(rng, tokens=3) for _ in range(40)])  # two query chunks
    many = index.predict(batch, 4, top_n=8, sharpness=4.0)
    for t in (0, 33, 39):
        assert_allclose(many[t], exact_predict(index, batch[t], 4, 8, 4.0), rtol=1e-4, atol=1e-6)


def test_upsert_many_equals_one_by_one():
    rng = np.random.default_rng(3)
    eams = np.stack([random_eam(rng) for _ in range(10)])
    one, many = EamcIndex(SHAPE, initial_rows=1), EamcIndex(SHAPE, initial_rows=1)
    for i, eam in enumerate(eams):
        one.upsert(f"e{i}", eam, 20)
    many.upsert_many([f"e{i}" for i in range(10)], eams, np.full(10, 20))
    query = random_eam(rng, 3)
    assert_allclose(many.similarities(query, 4), one.similarities(query, 4))
    assert_allclose(many.predict(query, 4, top_n=3), one.predict(query, 4, top_n=3))
    with pytest.raises(ValueError, match=r"eams must be \[2, 4, 6\]"):
        many.upsert_many(["a", "b"], eams[:3], np.full(3, 20))


def test_embedded_registry_is_atomic_bounded_and_saved(tmp_path):
    store = EmbeddedStore()
    assert store.register_model("a", "2x4x1", max_models=2) == ("created", "2x4x1")
    assert store.register_model("a", "9x9x9", max_models=2) == ("exists", "2x4x1")  # never overwritten
    assert store.register_model("b", "1x2x1", max_models=2) == ("created", "1x2x1")
    assert store.register_model("c", "1x2x1", max_models=2) == ("full", "2")
    path = tmp_path / "eamc.bin"
    store.save(path)
    again = EmbeddedStore.load_file(path)
    assert again.models() == {"a": "2x4x1", "b": "1x2x1"}


def test_embedded_file_of_the_first_format_still_loads(tmp_path):
    import struct  # noqa: PLC0415
    import zlib  # noqa: PLC0415

    body = b"EAMCSTO1" + struct.pack("<I", 0)  # no models, no registry section
    path = tmp_path / "old.bin"
    path.write_bytes(body + struct.pack("<I", zlib.crc32(body)))
    assert EmbeddedStore.load_file(path).models() == {}


@pytest.mark.parametrize("layers_seen", [1, 3, 4])
def test_every_first_stage_scan_gives_the_same_match(layers_seen):
    # The native match, its numpy fallback and the exact scan choose the same entries, with the
    # same exact weights, on a collection larger than the candidates.
    from predictor_svc.eamc import DEFAULT_SCAN, SCANS

    rng = np.random.default_rng(21)
    index = EamcIndex(SHAPE)
    entries = np.stack([random_eam(rng, tokens=int(rng.integers(5, 60))) for _ in range(500)])
    index.upsert_many([f"e{i}" for i in range(500)], entries, entries.sum(2).max(1) // 2)
    queries = np.stack([random_eam(rng, tokens=4) for _ in range(12)])
    queries[:, layers_seen:] = 0
    available = [s for s in SCANS if s != "native" or DEFAULT_SCAN == "native"]
    got = {}
    for scan in available:
        index.scan = scan
        best, sims = index.best_matches(queries, layers_seen, 8)
        order = np.argsort(-sims, axis=1, kind="stable")
        got[scan] = (np.take_along_axis(best, order, axis=1), np.take_along_axis(sims, order, axis=1))
    for scan in available:
        assert_allclose(got[scan][1], got["exact"][1], rtol=1e-6, atol=1e-7)
        assert np.array_equal(np.sort(got[scan][0], axis=1), np.sort(got["exact"][0], axis=1)), scan


def test_scan_names_are_checked():
    from predictor_svc import eamc

    with pytest.raises(ValueError, match=r"unknown EAMC scan 'fast': use one of native, numpy, exact"):
        EamcIndex(SHAPE, scan="fast")
    index = EamcIndex(SHAPE, scan="numpy")
    assert index.scan == "numpy"
    if eamc.DEFAULT_SCAN == "native":  # the build has the kernel: it is the default
        assert EamcIndex(SHAPE).scan == "native"


def test_native_scan_refused_without_the_kernel(monkeypatch):
    from predictor_svc import eamc

    monkeypatch.setattr(eamc, "_NATIVE_MATCH", None)
    with pytest.raises(ValueError, match=r"has no eamc_match .* use 'numpy'"):
        EamcIndex(SHAPE, scan="native")


@pytest.mark.parametrize("layers_seen", [1, 3, 4])
def test_native_and_numpy_predictions_agree(layers_seen):
    # The native match is held to the numpy one: the same prediction (to float32 rounding) for
    # single queries and batches across query chunks, at several sharpness values (0: equal
    # weights of the matches).
    from predictor_svc import eamc

    if eamc.DEFAULT_SCAN != "native":
        pytest.skip("this build has no native match")
    rng = np.random.default_rng(33)
    index = EamcIndex(SHAPE)
    entries = np.stack([random_eam(rng, tokens=int(rng.integers(5, 60))) for _ in range(300)])
    index.upsert_many([f"e{i}" for i in range(300)], entries, entries.sum(2).max(1) // 2)
    queries = np.stack([random_eam(rng, tokens=int(rng.integers(1, 9))) for _ in range(70)])
    queries[:, layers_seen:] = 0
    for sharpness in (0.0, 1.0, 4.0):
        got = {}
        for scan in ("native", "numpy"):
            index.scan = scan
            got[scan] = index.predict(queries, layers_seen, top_n=8, sharpness=sharpness)
            assert got[scan].shape == (70, *SHAPE_LE) and got[scan].dtype == np.float32
            single = index.predict(queries[3], layers_seen, top_n=8, sharpness=sharpness)
            assert_allclose(single, got[scan][3], rtol=1e-6, atol=1e-7)
        assert_allclose(got["native"], got["numpy"], rtol=1e-5, atol=1e-6)
    # A query with no count at all: every score ties at 0, and the native match keeps the lowest
    # rows (numpy's torch.topk keeps any), with equal weights.
    index.scan = "native"
    best, sims = index.best_matches(np.zeros((1, *SHAPE_LE), np.uint32), layers_seen, 8)
    assert best.tolist() == [list(range(8))] and not sims.any()
    freqs = index._rows[:8].reshape(8, *SHAPE_LE) * index._scale[:8][..., None]
    assert_allclose(
        index.predict(np.zeros(SHAPE_LE, np.uint32), layers_seen, top_n=8, sharpness=2.0),
        np.clip(freqs.mean(axis=0), 0, 1),
        rtol=1e-5,
        atol=1e-6,
    )


def test_q4_layout_round_trips():
    from predictor_svc.eamc import pack_q4, q4_row_bytes, unpack_q4

    rng = np.random.default_rng(2)
    for width in (1, 31, 32, 33, 64, 65, 100, 768):
        values = rng.integers(0, 16, size=(7, width), dtype=np.uint8)
        packed = pack_q4(values)
        assert packed.shape == (7, q4_row_bytes(width)) and q4_row_bytes(width) % 32 == 0
        assert np.array_equal(unpack_q4(packed, width), values.astype(np.int8))
        # byte i of group 0 holds value i (low nibble) and value 32 + i (high nibble)
        if width >= 64:
            assert np.array_equal(packed[:, :32] & 0x0F, values[:, :32])
            assert np.array_equal(packed[:, :32] >> 4, values[:, 32:64])


def test_a_reload_streams_the_collection_in_bounded_batches(monkeypatch):
    """Loading a collection never holds a second copy of it: the ids first, then the blobs in
    batches of about LOAD_BATCH_BYTES decoded into the index in place. Its allocation peak is
    within 1.2x of what the loaded index holds, and the same EAMs come back."""
    import tracemalloc

    import predictor_svc.eamc as eamc_module

    shape = EamShape(layers=16, experts=256, top_k=2)  # 16 KiB per entry
    entry_bytes = 24 + 4 * shape.cells
    monkeypatch.setattr(eamc_module, "LOAD_BATCH_BYTES", 8 * entry_bytes)
    rng = np.random.default_rng(11)
    store = EmbeddedStore()
    writer = Eamc(store, "m", shape, 400)
    eams = [random_eam(rng, shape=shape) for _ in range(400)]
    for eam in eams:
        writer.insert(eam, 20)

    batches: list[int] = []

    class Recording(EmbeddedStore):
        def load(self, model_id):
            raise AssertionError("the whole collection was asked for at once")

        def get_many(self, model_id, entry_ids):
            batches.append(len(entry_ids))
            return store.get_many(model_id, entry_ids)

        def entry_ids(self, model_id):
            return store.entry_ids(model_id)

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        reader = Eamc(Recording(), "m", shape, 400)
        assert reader.sync() == 400
        steady, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert max(batches) == 8 and sum(batches) == 400
    assert peak - before <= 1.2 * (steady - before), (peak - before, steady - before)
    got = {i: decode_eam(b, shape)[0] for i, b in store.get_many("m", reader.ids()).items()}
    assert sorted(map(bytes, got.values())) == sorted(bytes(e.astype(np.uint32)) for e in eams)
    assert_allclose(reader.predict(eams[0], top_n=1), writer.predict(eams[0], top_n=1), rtol=1e-6)


def test_changes_come_in_batches_with_their_cursor():
    store = EmbeddedStore()
    rng = np.random.default_rng(5)
    _ids, cursor = store.entry_ids("m")
    for _ in range(5):
        store.insert("m", encode_eam(random_eam(rng), 20), 10, None)
    first, cursor2 = store.changes("m", cursor, limit=2)
    assert [c.entry_id for c in first] == ["1", "2"] and cursor2.endswith(":2")
    rest, cursor3 = store.changes("m", cursor2, limit=10)
    assert [c.entry_id for c in rest] == ["3", "4", "5"] and cursor3.endswith(":5")
