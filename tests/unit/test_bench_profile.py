"""bench.profile: py-spy's raw stacks summed into threads, hand-offs and functions; a real
recording of a real process; and a run without py-spy that says so instead of failing."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bench import profile

REPO = Path(__file__).resolve().parents[2]


def _line_of(path: str, text: str) -> int:
    lines = (REPO / path).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def test_samples_are_summed_by_thread_and_function_with_hand_offs_apart(tmp_path):
    doorbell = _line_of("cache_daemon/residency/channel.py", "channel.wait_doorbell(seen)")
    poll = _line_of("cache_daemon/residency/prefetcher.py", "waker.poll()")
    boot = "Thread._bootstrap (threading.py:1002);Thread.run (threading.py:982)"
    raw = tmp_path / "ours-daemon.txt"
    raw.write_text(
        "\n".join(
            [
                f"thread (0x7f01): expertcache-channel-0;{boot};ChannelServer._run (cache_daemon/residency/channel.py:{doorbell}) 30",
                f"thread (0x7f01): expertcache-channel-0;{boot};ChannelServer._run (cache_daemon/residency/channel.py:140);"
                "SignalIntake.apply_ops (cache_daemon/decisions/intake.py:190);"
                "ActivationSignals.observe (cache_daemon/decisions/signals.py:249) 6",
                f"thread (0x7f02): expertcache-residency;{boot};PrefetchWorker._loop (cache_daemon/residency/prefetcher.py:{poll}) 10",
                f"thread (0x7f02): expertcache-residency;{boot};PrefetchWorker._loop (cache_daemon/residency/prefetcher.py:245);"
                "PrefetchScheduler.decide (cache_daemon/decisions/scheduler.py:410) 4",
                f"thread (0x7f02): expertcache-residency;{boot};Condition.__enter__ (threading.py:272) 5",
                "thread (0x7f00): MainThread;<module> (cache_daemon/__main__.py:23) 100",  # start-up: left out
                "a line that is not a sample",
            ]
        )
        + "\n"
    )
    prof = profile.summarize("ours-daemon", raw)
    assert prof.samples == 55 and prof.handoffs == 45 and prof.working == 10
    assert prof.threads == {"expertcache-channel-0": 36, "expertcache-residency": 19}
    assert prof.inclusive["ChannelServer._run (cache_daemon/residency/channel.py)"] == 6
    assert prof.inclusive["PrefetchScheduler.decide (cache_daemon/decisions/scheduler.py)"] == 4
    assert prof.own["ActivationSignals.observe (cache_daemon/decisions/signals.py)"] == 6
    assert "ChannelServer._run (cache_daemon/residency/channel.py)" not in prof.own
    shown = prof.as_dict(top=5, tokens=10)
    assert shown["tokens"] == 10 and shown["handoffs"] == 45


def test_without_py_spy_a_recording_says_why(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(profile, "py_spy", lambda: None)
    rec = profile.start("lru-daemon", 1, tmp_path)
    assert rec.proc is None and "py-spy is not installed" in rec.error
    rec.stop()  # nothing to stop
    profile.print_profiles({"lru": {"profile": {"daemon": {"error": rec.error}}}})
    assert "profile lru daemon: py-spy is not installed" in capsys.readouterr().out


def test_a_real_process_is_recorded_and_its_busy_function_found(tmp_path):
    if profile.py_spy() is None:
        pytest.skip("py-spy is not installed (the bench extra)")
    script = tmp_path / "busy.py"
    script.write_text(
        textwrap.dedent(
            """
            import threading, time

            def spin_in_a_named_function():
                end = time.monotonic() + 30
                while time.monotonic() < end:
                    sum(range(1000))

            t = threading.Thread(target=spin_in_a_named_function, name="busy-worker")
            t.start()
            t.join()
            """
        )
    )
    proc = subprocess.Popen([sys.executable, str(script)])
    try:
        time.sleep(0.5)  # the thread has started
        rec = profile.start("busy-daemon", proc.pid, tmp_path / "out")
        time.sleep(2.0)
        rec.stop()
    finally:
        proc.kill()
        proc.wait()
    if rec.error and ("ermission" in rec.error or "ptrace" in rec.error.lower()):
        pytest.skip(f"py-spy cannot attach here: {rec.error}")
    assert not rec.error, rec.error
    prof = profile.summarize("busy-daemon", rec.path)
    assert prof.samples > 20
    assert prof.threads.most_common(1)[0][0] == "busy-worker"
    spin = {name: n for name, n in prof.inclusive.items() if name.startswith("spin_in_a_named_function")}
    assert len(spin) == 1, prof.inclusive
    # on the stack of (nearly) every sample: the thread does nothing else
    assert next(iter(spin.values())) >= 0.9 * prof.samples, prof.inclusive


def test_a_recording_that_py_spy_could_not_make_says_why(tmp_path):
    if profile.py_spy() is None:
        pytest.skip("py-spy is not installed (the bench extra)")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid names no process now
    rec = profile.start("gone-daemon", gone.pid, tmp_path)
    rec.stop()
    assert rec.error.startswith("py-spy wrote nothing for gone-daemon: "), rec.error
    assert not rec.path.exists()
