"""Every benchmarked system held to its memory budget: its processes run in a memory cgroup of
their own (``devtools.memory_cgroup``) from their first instruction on, page cache included.

The limit is measured, not guessed: once a system is up and idle (imports done, dense weights
loaded, no expert cached yet) its group's usage, less the shared memory of its tiers, is its own
baseline; the limit is that baseline + the system's expert budget + ``HEADROOM_BYTES`` for what
requests allocate while they run.
A process that loads per run (Accelerate, whose loading streams every weight through memory)
measures its own baseline before loading and limits its own group once loaded, to that baseline
+ its budget + headroom. Where no cgroup can be made the run goes on without, and says so.
"""

from __future__ import annotations

from bench.report import MIB, say
from devtools.memory_cgroup import MemoryCgroup

# Requests' transient memory beyond the idle baseline: KV cache, activations, message buffers.
HEADROOM_BYTES = 128 * MIB


class Confinement:
    """The memory cgroup of one system (``cgroup`` None where none could be made)."""

    def __init__(self, label: str, enabled: bool = True) -> None:
        """``enabled`` False: no group (``bench.e2e --no-cgroups``, and the benchmarks that
        measure costs rather than budgets)."""
        self.label = label
        self.cgroup: MemoryCgroup | None = None
        self.note = "not confined"
        self.wanted = enabled
        if enabled:
            self.cgroup, self.note = MemoryCgroup.make(label.replace(".", "-"))
        self.baseline_bytes: int | None = None
        self.budget_bytes = 0

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` started inside the group, if there is one (``MemoryCgroup.command``)."""
        return argv if self.cgroup is None else self.cgroup.command(argv)

    def limit(self, budget_bytes: int, budget_kinds: tuple[str, ...] = ("shmem",)) -> None:
        """Hold the group to its baseline (what it uses now, the system idle, but for the kinds of
        memory that are the budget's: ``budget_kinds`` of ``memory.stat``, by default shared
        memory, the tiers' memfd pages allocated up front) + ``budget_bytes`` +
        ``HEADROOM_BYTES``, and print it."""
        if self.cgroup is None:
            if self.wanted:
                say(f"[{self.label}] memory: {self.note}; it runs without")
            return
        self.baseline_bytes = self.cgroup.usage_bytes - sum(self.cgroup.stat(k) for k in budget_kinds)
        self.budget_bytes = budget_bytes
        limit = self.baseline_bytes + budget_bytes + HEADROOM_BYTES
        self.cgroup.set_limit(limit)
        self.cgroup.reset_peak()  # the peak reported is the one under the limit (not the loading's)
        say(
            f"[{self.label}] memory: {self.note}, limit {limit / MIB:.0f} MiB = baseline "
            f"{self.baseline_bytes / MIB:.0f} + budget {budget_bytes / MIB:.0f} + headroom {HEADROOM_BYTES / MIB:.0f}"
        )

    def held(self, baseline_bytes: int, budget_bytes: int) -> None:
        """What a process that limits its own group (``bench.e2e_accelerate``) was held to: its
        measured baseline and budget (the limit is read from the group)."""
        self.baseline_bytes, self.budget_bytes = baseline_bytes, budget_bytes
        say(
            f"[{self.label}] memory: {self.note}, limited once loaded to {self.cgroup.limit_bytes / MIB:.0f} MiB "
            f"= baseline {baseline_bytes / MIB:.0f} (before loading) + budget {budget_bytes / MIB:.0f} + headroom "
            f"{HEADROOM_BYTES / MIB:.0f}"
        )

    def report(self) -> dict:
        """The group's limit, baseline, peak and OOM kills (what ``bench.e2e`` prints and keeps)."""
        if self.cgroup is None:
            return {"cgroup": None, "note": self.note}
        return {
            "cgroup": str(self.cgroup.path),
            "limit_bytes": self.cgroup.limit_bytes,
            "baseline_bytes": self.baseline_bytes,
            "budget_bytes": self.budget_bytes,
            "headroom_bytes": HEADROOM_BYTES,
            "peak_bytes": self.cgroup.peak_bytes,
            "oom_kills": self.cgroup.oom_kills,
        }

    def remove(self) -> None:
        if self.cgroup is not None:
            self.cgroup.remove()


__all__ = ["HEADROOM_BYTES", "Confinement"]
