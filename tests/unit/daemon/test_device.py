"""Choosing and building the daemon's arena: device names, and the CUDA arena's errors that a
machine without a GPU can reach (the CUDA arena itself is tested in tests/gpu/)."""

from __future__ import annotations

import pytest
import torch

from cache_daemon.errors import ArenaUnavailable
from cache_daemon.tiers.device import CudaArena, create_arena, resolve_device
from expertcache import native

GPU = "GPU-12345678-1234-1234-1234-123456789abc"
needs_no_torch_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a CUDA device")
needs_native_cuda = pytest.mark.skipif(
    not native.CUDA_BUILT, reason="the native module was built without nvcc"
)


def test_device_names():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    for bad in ("gpu", "cpu:0", "tpu:1", ""):
        with pytest.raises(
            ValueError, match=rf"unknown arena device '{bad}'; known: auto, cpu, cuda, cuda:<ordinal>"
        ):
            resolve_device(bad)


@needs_no_torch_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:0", f"cuda:{GPU}"])
def test_cuda_without_a_device_is_refused(device, tmp_path):
    with pytest.raises(
        ArenaUnavailable, match=rf"device='{device}' was configured but torch sees no CUDA device"
    ):
        create_arena(device, 1, 4096, daemon_id="nocuda")
    assert list(tmp_path.iterdir()) == []  # refused before claiming anything


def test_a_gpu_machine_with_a_native_module_built_without_nvcc(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(native, "CUDA_BUILT", False)
    message = (
        r"has a CUDA device but the native core .* was built without CUDA: put nvcc on PATH .*`make native`"
    )
    for device in ("auto", "cuda", "cuda:1"):  # auto does not fall back to CPU memory silently
        with pytest.raises(ArenaUnavailable, match=message):
            resolve_device(device)
    with pytest.raises(ArenaUnavailable, match=message):
        CudaArena(1, 4096, gpu=0)
    assert list(tmp_path.iterdir()) == []


@needs_native_cuda
def test_cuda_arena_on_a_gpu_that_is_not_there():
    count = native.cuda_device_count()
    if count == 0:  # no driver or no GPU here: refused before any allocation, with the reason
        with pytest.raises(
            ArenaUnavailable, match=r"the native core sees no CUDA device: cudaGetDeviceCount\(\)"
        ):
            CudaArena(1, 4096, gpu=0)
        return
    with pytest.raises(ArenaUnavailable, match=rf"CUDA device {count} does not exist: {count} visible"):
        CudaArena(1, 4096, gpu=count)
    with pytest.raises(ArenaUnavailable, match=rf"CUDA device {count} does not exist"):
        CudaArena(1, 4096, gpu=str(count))  # "cuda:<n>" passes the ordinal as text
    if GPU not in {native.cuda_device_uuid(i) for i in range(count)}:
        with pytest.raises(
            ArenaUnavailable,
            match=rf"the configured GPU '{GPU}' is not visible: no visible CUDA device has UUID {GPU}",
        ):
            CudaArena(1, 4096, gpu=GPU)
    with pytest.raises(
        ArenaUnavailable, match="the configured GPU 'GPU-xyz' is not visible: malformed GPU UUID"
    ):
        CudaArena(1, 4096, gpu="GPU-xyz")


def test_a_gpu_the_native_core_cannot_use_is_refused_with_the_reason(monkeypatch):
    # E.g. a driver older than the CUDA runtime the native core links: torch (its own runtime)
    # sees the GPU, the native core does not.
    if not native.CUDA_BUILT:
        pytest.skip("native core built without CUDA")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(native, "cuda_device_count", lambda: 0)
    monkeypatch.setattr(
        native, "cuda_no_device_reason", lambda: "the NVIDIA driver supports CUDA 12.8, older"
    )
    for device in ("auto", "cuda"):
        with pytest.raises(
            ArenaUnavailable,
            match=r"the native core sees no CUDA device: the NVIDIA driver supports CUDA 12\.8",
        ):
            resolve_device(device)
