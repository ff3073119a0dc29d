"""What makes a decode step wait for a GPU, checked on the CPU.

On an H100, torch's sync debug mode counted 7.3 synchronising operations per decode step over 3
MoE layers (tests/gpu/test_compute_cuda.py allows one per MoE layer plus 3). The causes were
host→device copies from pageable memory, each of which waits: the row order of every MoE layer
(``route``) and the step's three index tensors. Now the row order is built on the device and the
step's indices go in one non-blocking copy from page-locked memory (``generation.upload``), so a
step waits only for its routing, once per MoE layer, and for the token it picks.

A host→device copy cannot be observed on a CPU, but every one of them is a ``Tensor.to`` or a
``torch.tensor`` that names a device: these tests count those during real decode steps.

The slots of a wave are released only after its kernels are done (an event per wave, waited for
only when the next wave of an oversized layer needs the slots): on the H100 the waits counted 0
because the small kernels were long done when the host asked; ``FakeEvent`` plays kernels that
are still running.
"""

from __future__ import annotations

import sys

import torch

from compute_svc.engine import generation
from compute_svc.engine.requests import GenerationRequest
from compute_svc.experts.stages import route

PROMPT = tuple(range(5, 20))


class DeviceCopies:
    """Counts calls of compute's code that would copy host data to a device: ``Tensor.to`` /
    ``torch.tensor`` with a device, outside ``generation.upload`` (which is counted on its own)."""

    def __init__(self, monkeypatch) -> None:
        self.copies = 0
        self.uploads = 0
        self._inside_upload = False
        real_to, real_tensor, real_upload = torch.Tensor.to, torch.tensor, generation.upload
        counter = self

        def ours() -> bool:
            # Called from compute's own code (transformers' models move their constant buffers
            # with ``.to(device=x.device)``, a no-op where they already live).
            return sys._getframe(2).f_globals.get("__name__", "").startswith("compute_svc")

        def names_device(args, kwargs) -> bool:
            return "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args)

        def to(self, *args, **kwargs):
            if not counter._inside_upload and names_device(args, kwargs) and ours():
                counter.copies += 1
            return real_to(self, *args, **kwargs)

        def tensor(*args, **kwargs):
            if not counter._inside_upload and kwargs.get("device") is not None and ours():
                counter.copies += 1
            return real_tensor(*args, **kwargs)

        def upload(values, device):
            counter.uploads += 1
            counter._inside_upload = True
            try:
                return real_upload(values, device)
            finally:
                counter._inside_upload = False

        monkeypatch.setattr(torch.Tensor, "to", to)
        monkeypatch.setattr(torch, "tensor", tensor)
        monkeypatch.setattr(generation, "upload", upload)


def test_a_decode_step_copies_to_the_device_once_and_fetches_once_per_layer(local_engine, monkeypatch):
    engine, _, tiny = local_engine("mixtral", slots=64)
    layers = len(tiny.manifest.moe_layers)
    prepared = engine.requests.prepare(GenerationRequest(token_ids=PROMPT, max_new_tokens=4, ignore_eos=True))
    seq = engine.start(prepared)
    engine.step([(seq, len(seq.pending))])  # the prompt
    before = engine.runtime.host_transfers
    counted = DeviceCopies(monkeypatch)
    steps = 3
    for _ in range(steps):
        engine.step([(seq, len(seq.pending))])
    monkeypatch.undo()
    engine.finish(seq, "length")
    assert counted.copies == 0  # no layer, no step index tensor copies from pageable memory
    assert counted.uploads == steps  # the step's indices: one upload
    assert engine.runtime.host_transfers - before == steps * layers  # the routing: one per layer


def test_route_builds_the_row_order_where_the_model_runs():
    # On a GPU the order is sorted there (no copy of a host array); here the meta device stands
    # in for it: nothing of the host's order array may be copied to it.
    index = torch.tensor([[3, 1], [1, 6]], device="meta")
    routing = route(index, torch.ones(2, 2, device="meta"), torch.tensor([[3, 1], [1, 6]]).numpy())
    assert routing.order.device.type == "meta" and routing.tokens.device.type == "meta"
    assert routing.experts == (1, 3, 6) and routing.spans == {1: (0, 2), 3: (2, 3), 6: (3, 4)}


class FakeEvent:
    """A wave's kernels: still running until ``synchronize`` (which counts as the wait)."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_a_wave_whose_kernels_still_run_is_waited_for_before_its_slots_are_released(local_engine):
    engine, provider, _ = local_engine("qwen2_moe", slots=4)
    runtime = engine.runtime
    released: list[tuple[int, tuple[int, ...], bool]] = []
    event = FakeEvent()
    original = provider.release

    def release(layer, experts):
        released.append((layer, tuple(experts), event.done))
        original(layer, experts)

    provider.release = release
    list(provider.acquire(1, [0, 2]))
    runtime.event_waits = 0
    runtime._unreleased.append((1, (0, 2), event))
    runtime._release_unreleased()  # the next wave needs the slots: it must wait for the kernels
    assert runtime.event_waits == 1
    assert released == [(1, (0, 2), True)]  # released only once the kernels were done
    done = FakeEvent()
    done.done = True  # kernels long finished (what the H100 run saw): no wait, nothing counted
    list(provider.acquire(1, [1]))
    runtime._unreleased.append((1, (1,), done))
    runtime._release_unreleased()
    assert runtime.event_waits == 1
