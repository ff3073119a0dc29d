"""The services' main thread waits for SIGTERM/SIGINT (``expertcache.service_main.SignalStop``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from devtools.launch import REPO

# The main thread blocks SIGUSR1, so the kernel hands the signal to the one other thread: the
# main thread's wait is not interrupted, and only the wakeup fd tells it a handler is due.
SCENARIO = textwrap.dedent(
    """
    import os, signal, threading, time
    from expertcache.service_main import SignalStop

    stop = SignalStop()
    signal.signal(signal.SIGUSR1, lambda *_: stop.set_by_signal())
    done = threading.Event()
    other = threading.Thread(target=done.wait)
    other.start()  # before the block: it takes SIGUSR1
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1)).start()
    started = time.monotonic()
    stop.WAIT()
    done.set()
    print(f"woke after {time.monotonic() - started:.2f} s")
    """
)


def _run(wait: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SCENARIO.replace("WAIT", wait)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_signal_taken_by_another_thread_wakes_the_main_thread():
    try:
        out = _run("sleep")
    except subprocess.TimeoutExpired:
        raise AssertionError("the main thread slept through a signal another thread took") from None
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.split()[2]) < 5, out.stdout


def test_an_event_wait_would_sleep_through_it():
    """What ``sleep`` is for: ``Event.wait()`` on the main thread never runs the handler here."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", SCENARIO.replace("WAIT", "wait")],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=3,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return
    raise AssertionError(f"Event.wait() woke: {out.stdout}{out.stderr}")


def test_the_wait_freezes_the_heap_built_at_start_and_later_cycles_are_still_collected():
    """``ServiceMain.wait`` first moves what start-up built out of the cyclic collector's walks
    (``gc.freeze``); garbage made while serving is still collected."""
    scenario = textwrap.dedent(
        """
        import gc, weakref
        from expertcache.service_main import ServiceMain, SignalStop

        started = [[i] for i in range(10000)]  # what a start builds: it lives on
        assert gc.get_freeze_count() == 0
        stop = SignalStop()
        stop.set()
        ServiceMain.wait(stop)
        frozen = gc.get_freeze_count()

        class Node:
            pass

        a, b = Node(), Node()
        a.peer, b.peer = b, a  # a cycle made while serving
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        print(frozen, len(started), gone() is None)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", scenario], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    frozen, started, collected = out.stdout.split()
    assert int(frozen) >= int(started), out.stdout
    assert collected == "True", out.stdout
