"""The CUDA path of the native extension as far as a machine without a GPU can check it.

- ``CUDA_BUILT`` agrees with the build's ``FEATURES`` and with what the module defines (that the
  build has CUDA exactly when asked and nvcc is there is checked per configuration by
  tests/distribution/test_native_matrix.py).
- Without a device (no driver, or a driver and no GPU) every CUDA entry point fails with an error
  that names the CUDA call and the CUDA error, or the bad argument; the tests of that are skipped
  where a device is present (tests/gpu/test_native_cuda.py covers that case).
- A build without CUDA refuses to pin host memory, naming why.
"""

from __future__ import annotations

import re

import pytest

from expertcache import native
from expertcache.native import CUDA_BUILT, HostPool, cuda_available

CUDA_CALL_ERROR = r"cuda[A-Za-z]+\(.*\) failed: cudaError[A-Za-z]+: \S"
ZERO_UUID = "GPU-00000000-0000-0000-0000-000000000000"

needs_cuda_build = pytest.mark.skipif(not CUDA_BUILT, reason="extension built without nvcc")
no_device = pytest.mark.skipif(
    CUDA_BUILT and cuda_available(), reason="a CUDA device is present (see tests/gpu)"
)


def test_cuda_built_matches_the_features_and_the_module():
    assert CUDA_BUILT is ("cuda" in native.FEATURES)
    for name in ("CudaArena", "CopyEngine", "cuda_device_count", "cuda_device_for_uuid"):
        assert hasattr(native._native, name) is CUDA_BUILT, name


@pytest.mark.skipif(CUDA_BUILT, reason="this build has CUDA")
def test_without_cuda_pinning_is_refused_with_the_reason():
    with pytest.raises(RuntimeError, match=r"^cannot pin host memory: this build has no CUDA path"):
        HostPool(2, 100, pin=True)


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


@needs_cuda_build
def test_a_driver_older_than_the_linked_runtime_is_named_with_the_fix():
    runtime = native.cuda_runtime_version()
    major = runtime // 1000
    older = (major - 1) * 1000 + 80  # the last minor release of the previous major version
    message = native.cuda_driver_mismatch(older)
    assert (
        f"the NVIDIA driver supports CUDA {major - 1}.8, older than the CUDA runtime {major}.{runtime % 1000 // 10}"
        in message
    )
    assert f"install a driver for CUDA {major}" in message and "rebuild the native core" in message
    # Same major version (minor-version compatibility), newer, or no driver at all: nothing wrong.
    for fine in (major * 1000, major * 1000 + 90, (major + 1) * 1000, 0):
        assert native.cuda_driver_mismatch(fine) == ""
