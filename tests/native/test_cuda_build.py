"""The CUDA path of the native extension as far as a machine without a GPU can check it.

- ``CUDA_BUILT`` tells the truth about the toolchain: the build compiles csrc/cuda/*.cu exactly
  when nvcc is found (``NVCC=`` or on PATH) and ``EXPERTCACHE_NO_CUDA`` is not 1, and the features
  file the build recorded agrees.
- Without a device (no driver, or a driver and no GPU) every CUDA entry point fails with an error
  that names the CUDA call and the CUDA error, or the bad argument; the tests of that are skipped
  where a device is present (tests/gpu/test_native_cuda.py covers that case).
- A build with ``EXPERTCACHE_NO_CUDA=1`` into its own NATIVE_DIR compiles and reports
  ``CUDA_BUILT`` False (SLOW the first time: a full rebuild, ~30-60 s on two cores; incremental
  afterwards because it builds into build/native-nocuda, ignored by git).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from expertcache import native
from expertcache.native import CUDA_BUILT, HostPool, cuda_available

REPO = Path(__file__).resolve().parents[2]
CUDA_CALL_ERROR = r"cuda[A-Za-z]+\(.*\) failed: cudaError[A-Za-z]+: \S"
ZERO_UUID = "GPU-00000000-0000-0000-0000-000000000000"

needs_cuda_build = pytest.mark.skipif(not CUDA_BUILT, reason="extension built without nvcc")
no_device = pytest.mark.skipif(
    CUDA_BUILT and cuda_available(), reason="a CUDA device is present (see tests/gpu)"
)


def _nvcc_found() -> bool:
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc")
    return bool(nvcc) and os.environ.get("EXPERTCACHE_NO_CUDA") != "1"


def test_cuda_built_matches_the_toolchain_and_the_recorded_features():
    # conftest.py built the module with this process's environment, so the same detection
    # applies; features.mk is what csrc/native.mk recorded for that build.
    assert CUDA_BUILT is _nvcc_found()
    features = (REPO / "build" / "native" / "features.mk").read_text()
    assert ("-DEXPERTCACHE_WITH_CUDA" in features) is CUDA_BUILT
    assert ("-lcudart_static" in features) is CUDA_BUILT
    for name in ("CudaArena", "CopyEngine", "cuda_device_count", "cuda_device_for_uuid"):
        assert hasattr(native._native, name) is CUDA_BUILT, name


def test_host_pool_is_unpinned_by_default():
    pool = HostPool(2, 100)
    assert pool.pinned is False


@needs_cuda_build
@no_device
def test_no_device_reports_zero_devices_and_why():
    assert native.cuda_device_count() == 0
    assert cuda_available() is False
    reason = native.cuda_no_device_reason()
    assert re.match(r"cudaGetDeviceCount\(\) (failed: cudaError[A-Za-z]+: \S|returned 0 devices)", reason)


@needs_cuda_build
@no_device
def test_no_device_allocate_names_the_cuda_call_and_error():
    with pytest.raises(RuntimeError, match=CUDA_CALL_ERROR):
        native.CudaArena.allocate(0, 4, 4096)


@needs_cuda_build
@no_device
def test_no_device_copy_engine_names_the_cuda_call_and_error():
    with pytest.raises(RuntimeError, match=CUDA_CALL_ERROR):
        native.CopyEngine(0)


@needs_cuda_build
@no_device
def test_no_device_device_uuid_names_the_cuda_call_and_error():
    with pytest.raises(RuntimeError, match=CUDA_CALL_ERROR):
        native.cuda_device_uuid(0)


@needs_cuda_build
@no_device
def test_no_device_pinned_host_pool_fails_with_the_cuda_error():
    with pytest.raises(
        RuntimeError,
        match=r"^cannot pin host memory: cudaHostRegister\(0x[0-9a-f]+, 8192 bytes, "
        r"cudaHostRegisterPortable\) failed: cudaError[A-Za-z]+: \S",
    ):
        HostPool(2, 100, pin=True)


@needs_cuda_build
@no_device
def test_no_device_uuid_lookup_lists_no_devices():
    with pytest.raises(ValueError, match=rf"no visible CUDA device has UUID {ZERO_UUID}; visible: none \("):
        native.cuda_device_for_uuid(ZERO_UUID)


@needs_cuda_build
@no_device
def test_no_device_open_by_unknown_uuid_fails_before_any_cuda_call():
    with pytest.raises(ValueError, match=rf"no visible CUDA device has UUID {ZERO_UUID}; visible: none"):
        native.CudaArena.open(b"\0" * 64, ZERO_UUID.lower().removeprefix("gpu-"), 4, 4096)


@needs_cuda_build
@pytest.mark.parametrize("length", [0, 10, 63, 65, 128])
def test_open_rejects_a_handle_of_the_wrong_length(length):
    with pytest.raises(
        ValueError, match=rf"CUDA IPC handle must be 64 bytes \(cudaIpcMemHandle_t\), got {length}$"
    ):
        native.CudaArena.open(b"\1" * length, ZERO_UUID, 4, 4096)


@needs_cuda_build
@pytest.mark.parametrize(
    ("num_slots", "slot_bytes", "message"),
    [(0, 4096, "num_slots must be > 0"), (4, 0, "slot_bytes must be > 0"), (2**62, 2**20, "size overflows")],
)
def test_arena_rejects_bad_sizes_before_touching_the_device(num_slots, slot_bytes, message):
    with pytest.raises(ValueError, match=f"device arena: {message}"):
        native.CudaArena.allocate(0, num_slots, slot_bytes)
    with pytest.raises(ValueError, match=f"device arena: {message}"):
        native.CudaArena.open(b"\0" * 64, ZERO_UUID, num_slots, slot_bytes)


@needs_cuda_build
@pytest.mark.parametrize("num_streams", [0, -1, 65])
def test_copy_engine_rejects_bad_stream_counts(num_streams):
    with pytest.raises(ValueError, match=rf"num_streams must be in \[1, 64\], got {num_streams}"):
        native.CopyEngine(0, num_streams)


@needs_cuda_build
@pytest.mark.parametrize(
    "given",
    [
        "GPU-0123abcd-4567-89ab-cdef-0123456789ab",
        "gpu-0123ABCD-4567-89AB-CDEF-0123456789AB",
        "0123abcd-4567-89ab-cdef-0123456789ab",  # torch's str(props.uuid)
        "  GPU-0123abcd-4567-89ab-cdef-0123456789ab\n",  # a line of nvidia-smi output
    ],
)
def test_uuid_normalisation_makes_torch_and_nvidia_smi_forms_equal(given):
    assert native.cuda_normalize_uuid(given) == "GPU-0123abcd-4567-89ab-cdef-0123456789ab"


@needs_cuda_build
@pytest.mark.parametrize(
    "given",
    [
        "",
        "GPU-",
        "GPU-0123abcd-4567-89ab-cdef-0123456789a",  # one digit short
        "GPU-0123abcd-4567-89ab-cdef-0123456789abc",
        "GPU-0123abcd44567-89ab-cdef-0123456789ab",  # dash replaced
        "GPU-0123abcg-4567-89ab-cdef-0123456789ab",  # not hex
        "MIG-0123abcd-4567-89ab-cdef-0123456789ab",
        "0",
    ],
)
def test_malformed_uuids_are_rejected_by_name(given):
    with pytest.raises(
        ValueError, match=r"malformed GPU UUID '.*': expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
    ):
        native.cuda_normalize_uuid(given)
    with pytest.raises(ValueError, match=r"malformed GPU UUID"):
        native.cuda_device_for_uuid(given)


def test_no_cuda_build_compiles_and_reports_cuda_not_built():
    """SLOW (~30-60 s the first time): a second full build with EXPERTCACHE_NO_CUDA=1."""
    out = REPO / "build" / "native-nocuda"
    cmd = [
        "make", "-s", "-j2", "-f", "csrc/native.mk", "native",
        f"NATIVE_DIR={out}", "EXPERTCACHE_NO_CUDA=1", f"PY={sys.executable}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "-DEXPERTCACHE_WITH_CUDA" not in (out / "features.mk").read_text()
    (so,) = out.glob("expertcache_native*.so")
    # In a child: this process already holds a module of the same name with the same types.
    probe = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("expertcache_native", {str(so)!r})
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
assert m.CUDA_BUILT is False
assert not hasattr(m, "CudaArena") and not hasattr(m, "CopyEngine") and not hasattr(m, "cuda_device_count")
assert m.HostPool(2, 100).pinned is False
try:
    m.HostPool(2, 100, pin=True)
except RuntimeError as e:
    print(e)
"""
    child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == (
        "cannot pin host memory: this build has no CUDA (nvcc was not found, or EXPERTCACHE_NO_CUDA=1)"
    )
