"""A manifest is untrusted input: every malformed one is a DataLoss naming the file and the key,
never a traceback of another kind, and the daemon exits 2 with that message."""

from __future__ import annotations

import copy
import json

import pytest

import expertcache.manifest as manifest_mod
from expertcache.errors import DataLoss
from expertcache.manifest import MANIFEST_NAME, read_manifest, store_path
from tests.procs import run_module
from tests.stores import valid_manifest_raw


def write(store, content: bytes | str | dict):
    store.mkdir(parents=True, exist_ok=True)
    path = store / MANIFEST_NAME
    if isinstance(content, dict):
        content = json.dumps(content)
    if isinstance(content, str):
        content = content.encode()
    path.write_bytes(content)
    return path


def refused(store, content) -> str:
    path = write(store, content)
    with pytest.raises(DataLoss) as err:
        read_manifest(store)
    message = str(err.value)
    assert str(path) in message, message
    return message


def mutated(edit) -> dict:
    raw = copy.deepcopy(valid_manifest_raw())
    edit(raw)
    return raw


def test_valid_manifest_loads(tmp_path):
    write(tmp_path, valid_manifest_raw())
    assert read_manifest(tmp_path).num_experts == 4


def test_binary_truncated_and_non_object(tmp_path):
    assert "not UTF-8" in refused(tmp_path, b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    text = json.dumps(valid_manifest_raw())
    assert "not valid JSON" in refused(tmp_path, text[: len(text) // 2])
    assert "key '(top level)': must be an object" in refused(tmp_path, "[1, 2, 3]")
    assert "nests too deeply" in refused(tmp_path, "[" * 100_000 + "]" * 100_000)
    assert "not valid JSON" in refused(tmp_path, '{"format_version": ' + "9" * 50_000 + "}")
    assert "NaN is not valid" in refused(tmp_path, '{"format_version": NaN}')


@pytest.mark.parametrize(
    ("edit", "key", "problem"),
    [
        (lambda r: r.pop("model_id"), "model_id", "is missing"),
        (lambda r: r.update(num_experts="4"), "num_experts", "must be an integer"),
        (lambda r: r.update(num_experts=True), "num_experts", "must be an integer"),
        (lambda r: r.update(num_experts=4.0), "num_experts", "must be an integer"),
        (lambda r: r.update(num_experts=0), "num_experts", "out of range"),
        (lambda r: r.update(top_k=9), "top_k", "out of range [1, 4]"),
        (lambda r: r.update(moe_layers=[0, 7]), "moe_layers[1]", "out of range [0, 1]"),
        (lambda r: r.update(moe_layers=[0, 0]), "moe_layers", "names a layer twice"),
        (lambda r: r.update(tensors={"w1": 1}), "tensors", "must be a list"),
        (
            lambda r: r["tensors"][0]["parts"][0].update(shape="8x4"),
            "tensors[0].parts[0].shape",
            "must be a list",
        ),
        (
            lambda r: r["tensors"][1].update(transposed="yes"),
            "tensors[1].transposed",
            "must be true or false",
        ),
        (
            lambda r: r["tensors"][0]["parts"][0].update(offset=-256),
            "tensors[0].parts[0].offset",
            "out of range",
        ),
        (lambda r: r["checksums"]["0"].__setitem__(0, 1 << 40), "checksums.0[0]", "out of range"),
        (
            lambda r: r["checksums"].update({"zero": [1, 2, 3, 4]}),
            "checksums.'zero'",
            "non-numeric layer key",
        ),
        (
            lambda r: r["layer_files"].update({"0": "../../../../etc/passwd"}),
            "layer_files.0",
            "inside the store",
        ),
        (lambda r: r["layer_files"].update({"1": "/etc/passwd"}), "layer_files.1", "inside the store"),
        (lambda r: r["layer_files"].update({"1": "experts/./x.bin"}), "layer_files.1", "inside the store"),
        (lambda r: r.update(dense_file="../dense.safetensors"), "dense_file", "inside the store"),
        (lambda r: r.update(model_type=["mixtral"]), "model_type", "must be a string"),
        (lambda r: r.update(source=[1]), "source", "must be an object"),
        (lambda r: r.update(format_version=1), "format_version", "convert the checkpoint again"),
    ],
)
def test_malformed_fields_name_the_key(tmp_path, edit, key, problem):
    message = refused(tmp_path, mutated(edit))
    assert f"key {key!r}" in message or f"key '{key}'" in message, message
    assert problem in message, message


def test_semantic_checks_name_the_key(tmp_path):
    assert "key 'layer_files' names layers [0]" in refused(
        tmp_path, mutated(lambda r: r["layer_files"].pop("1"))
    )
    assert "key 'tensors' is empty" in refused(tmp_path, mutated(lambda r: r.update(tensors=[])))
    assert "unknown dtype" in refused(
        tmp_path, mutated(lambda r: r["tensors"][0]["parts"][0].update(dtype="float128"))
    )


def test_oversized_manifest(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest_mod, "MAX_MANIFEST_BYTES", 1000)
    assert "is over 1000 bytes" in refused(tmp_path, " " * 1001)


def test_daemon_exits_2_naming_file_and_key(tmp_path):
    store = tmp_path / "store"
    path = write(store, mutated(lambda r: r["layer_files"].update({"0": "../../../../etc/passwd"})))
    proc = run_module(
        "cache_daemon",
        "--store-dir",
        str(store),
        "--socket-path",
        str(tmp_path / "run" / "daemon.sock"),
        "--device",
        "cpu",
        timeout_s=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert str(path) in proc.stderr and "layer_files.0" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_manifest_symlinked_out_of_the_store_is_refused(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    outside = write(tmp_path / "other", valid_manifest_raw())
    (store / MANIFEST_NAME).symlink_to(outside)
    with pytest.raises(
        DataLoss,
        match=r"the manifest 'manifest.json' of store .* resolves to .*other/manifest.json, outside the store",
    ):
        read_manifest(store)
    # The store directory itself may be reached through a symlink.
    (tmp_path / "link").symlink_to(tmp_path / "other")
    assert read_manifest(tmp_path / "link").num_experts == 4


def test_store_path_refuses_symlink_loops_and_escapes(tmp_path):
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    with pytest.raises(DataLoss, match="'a' of store"):
        store_path(tmp_path, "a", "x")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "up").symlink_to("../..")
    with pytest.raises(DataLoss, match="outside the store"):
        store_path(tmp_path, "sub/up/etc", "x")
    assert store_path(tmp_path, "sub/f", "x") == tmp_path.resolve() / "sub" / "f"
