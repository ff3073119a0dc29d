"""bench.io_bench.random_expert_reads: random experts read the daemon's way (native reader,
O_DIRECT, CRC-checked) from a real store, the disk figure bench.e2e prints its disk time from."""

from __future__ import annotations

import pytest

from bench.io_bench import random_expert_reads

pytestmark = pytest.mark.integration


def test_reads_random_experts_of_a_real_store(tiny_store):
    tiny = tiny_store("mixtral")
    for in_flight in (1, 3):
        out = random_expert_reads(tiny.store, tiny.manifest, reads=10, in_flight=in_flight)
        assert out["reads"] == 10 and out["in_flight"] == in_flight
        assert out["blob_bytes"] == tiny.manifest.blob_bytes
        assert out["bytes"] == 10 * tiny.manifest.blob_bytes
        assert out["seconds"] > 0 and out["latency_ms_p50"] > 0
        assert out["gb_per_s"] == pytest.approx(out["bytes"] / out["seconds"] / 1e9)
    # More in flight than reads: the batch is the reads.
    assert random_expert_reads(tiny.store, tiny.manifest, reads=2, in_flight=8)["in_flight"] == 2


@pytest.mark.parametrize(("reads", "in_flight"), [(0, 1), (4, 0), (-1, 2)])
def test_refuses_empty_batches(tiny_store, reads, in_flight):
    tiny = tiny_store("mixtral")
    with pytest.raises(ValueError, match=f"reads and in_flight must be >= 1, got {reads} and {in_flight}"):
        random_expert_reads(tiny.store, tiny.manifest, reads=reads, in_flight=in_flight)


def test_a_corrupt_blob_fails_the_read_by_its_checksum(tiny_store, tmp_path):
    import shutil

    tiny = tiny_store("mixtral")
    store = tmp_path / "store"
    shutil.copytree(tiny.store, store)
    manifest = tiny.manifest
    for layer in manifest.moe_layers:  # every blob corrupt: any random pick hits one
        path = store / manifest.layer_files[layer]
        data = bytearray(path.read_bytes())
        for e in range(manifest.num_experts):
            data[e * manifest.blob_bytes] ^= 0xFF
        path.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="native read failed: checksum mismatch for .*layer_"):
        random_expert_reads(store, manifest, reads=3, in_flight=1)


@pytest.mark.parametrize("bad", ["0", "100001"])
def test_io_bench_refuses_random_reads_out_of_range(bad, capsys):
    from bench import io_bench

    with pytest.raises(SystemExit) as exc:
        io_bench.main(["--random-reads", bad])
    assert exc.value.code == 2
    assert f"--random-reads must be in [1, 100000], got {bad}" in capsys.readouterr().err
