"""The start-up and stop of a service's process, written once for the three ``__main__`` modules.

Every ``python -m <service>`` does the same things in the same order; ``ServiceMain`` holds them
and each ``__main__`` keeps only what is its own (what it opens, serves and closes):

1. the command line: one ``--field-name`` per config field, ``--config-file`` and
   ``--print-config-schema`` (printed, exit 0); no abbreviations, since a flag the chart passes
   must be the exact name (a renamed flag fails instead of matching another);
2. the config, CLI > env ``<PREFIX><FIELD>`` > file > default: an invalid one prints
   ``<service>: invalid configuration: ...`` and exits 2 before anything starts;
3. logging (``log_level``, ``log_format``) and tracing (a bad tracing environment exits 2 too);
4. the service's own ``serve(config, args)``, which uses ``serve_metrics`` (``/metrics``),
   ``watch_config`` (live reload on a file change, a ConfigMap change or SIGHUP) and
   ``stop_on_signals``/``wait`` (SIGTERM/SIGINT) and ``stopped`` (its last step), and returns
   the exit code;
5. tracing flushed, whatever ``serve`` returned.

Exit codes: 0 after a clean stop, 2 (``EXIT_START_FAILED``) when the config, the tracing
environment or the service's start is unusable (the message says which), 1 on an unexpected error.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from expertcache import telemetry
from expertcache.config_loader import add_arguments, cli_values, load_config, print_config_schema
from expertcache.errors import ExpertCacheError
from expertcache.live_config import LiveConfig
from expertcache.logs import setup_logging
from expertcache.prom import MetricsServer, Registry, serve

EXIT_START_FAILED = 2


@dataclass(frozen=True)
class ServiceMain:
    """One service's process: ``name`` (its package, the prefix of its messages and its logger),
    ``prog`` (its command, ``expertcache-<short>``, also its tracing service name), its config
    class and environment prefix."""

    name: str
    prog: str
    config_cls: type
    env_prefix: str
    description: str
    config_flags: tuple[str, ...] = ("--config-file",)
    """Spellings of the config file option (the predictor also takes ``--config``)."""
    config_map_key: str = ""
    """The key of the ConfigMap ``config_map_name`` holding this service's config file."""

    @property
    def short(self) -> str:
        """``daemon``, ``predictor``, ``compute``: how ``/metrics`` messages name the service."""
        return self.prog.removeprefix("expertcache-")

    @property
    def logger(self) -> logging.Logger:
        return logging.getLogger(self.name)

    def parser(self) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(
            prog=self.prog,
            allow_abbrev=False,
            description=self.description,
            epilog=f"Every option can also be set as {self.env_prefix}<OPTION> or in "
            f"{self.config_flags[0]} (CLI > env > file).",
        )
        parser.add_argument(
            *self.config_flags,
            dest="config_file",
            default=None,
            help="YAML file of config fields (the ConfigMap).",
        )
        add_arguments(parser, self.config_cls)
        return parser

    def run(
        self,
        argv: list[str] | None,
        serve: Callable[[Any, argparse.Namespace], int],
        parser: argparse.ArgumentParser | None = None,
    ) -> int:
        """Steps 1-5 above; ``parser``: ``self.parser()`` with the service's own extra options."""
        args = (parser or self.parser()).parse_args(argv)
        if args.print_config_schema:
            print_config_schema(self.config_cls, self.env_prefix)
            return 0
        try:
            config = load_config(
                self.config_cls,
                cli=cli_values(args, self.config_cls),
                env_prefix=self.env_prefix,
                file=args.config_file,
            )
        except ExpertCacheError as exc:
            print(f"{self.name}: invalid configuration: {exc}", file=sys.stderr)
            return EXIT_START_FAILED
        setup_logging(config.log_level, config.log_format)
        try:
            telemetry.setup(self.prog)
        except ExpertCacheError as exc:
            print(f"{self.name}: invalid tracing environment: {exc}", file=sys.stderr)
            return EXIT_START_FAILED
        try:
            return serve(config, args)
        finally:
            telemetry.shutdown()

    def serve_metrics(self, registry: Registry, config: Any) -> MetricsServer | None:
        """``/metrics`` on ``metrics_address:metrics_port`` (None when the port is 0); ``OSError``
        naming the address when it cannot bind."""
        return serve(registry, config.metrics_address, config.metrics_port, self.short)

    def start_failed(self, exc: BaseException, *close: Callable[[], object]) -> int:
        """``serve``'s way out when its start fails: ``cannot start: <exc>`` logged, what had
        started closed (``close``, in order), and ``EXIT_START_FAILED`` to return."""
        self.logger.error("cannot start: %s", exc)
        for closer in close:
            closer()
        return EXIT_START_FAILED

    def watch_config(
        self, args: argparse.Namespace, config: Any, apply: Callable[[Any, str], None]
    ) -> LiveConfig:
        """Reload the config (as at start) when ``--config-file`` or the ConfigMap
        ``config_map_name`` changes, or on SIGHUP, and hand it to ``apply(fresh, origin)``."""
        live = LiveConfig(
            self.config_cls,
            cli=cli_values(args, self.config_cls),
            env_prefix=self.env_prefix,
            config_file=args.config_file,
            apply=apply,
            config_map_name=config.config_map_name,
            config_map_key=self.config_map_key,
            service=self.prog,
        )
        # Applied by the reload thread, outside the signal handler.
        signal.signal(signal.SIGHUP, lambda *_: live.trigger(f"file {args.config_file} (SIGHUP)"))
        return live

    def stop_on_signals(self) -> SignalStop:
        """A ``SignalStop`` that SIGTERM and SIGINT set (logged), for ``wait``; on the main thread."""
        stop = SignalStop()

        def on_signal(signum: int, _frame: object) -> None:
            self.logger.info("received %s, stopping", signal.Signals(signum).name)
            stop.set_by_signal()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        return stop

    def stopped(self, metrics_server: MetricsServer | None, service_name: str) -> None:
        """The last step of a stop: ``/metrics`` (when served) closed and ``stopped <service_name>``
        logged, after the gRPC server and the service have closed."""
        if metrics_server is not None:
            metrics_server.close()
        self.logger.info("stopped %s", service_name)

    @staticmethod
    def wait(stop: SignalStop) -> None:
        """Until a signal sets ``stop`` (reloads run on their own thread); the heap built at start
        is frozen first (``freeze_start_heap``)."""
        freeze_start_heap()
        stop.sleep()


def freeze_start_heap() -> None:
    """Move every object alive once the service serves (its modules, torch's registries, the model,
    the store's index) out of the cyclic collector's reach: they live as long as the process, and
    each full collection walked all of them again. In ``bench.e2e`` (mxfp4, ``perf record``) the
    collector took 12% of the serving compute process's CPU before this and 3.5% after, and 8% of
    the daemon's before. What serving allocates is still collected; only cycles among the frozen
    objects are never freed, and they live as long as the process anyway."""
    gc.collect()
    gc.freeze()


class SignalStop(threading.Event):
    """Set by a signal's handler; ``sleep`` is the main thread's wait for it.

    Not ``Event.wait()``: a signal sent to the process is taken by whichever of its threads does
    not block it, and when that is not the main thread, the main thread's lock wait goes on and
    Python never gets to run the handler (which runs on the main thread only). So the main thread
    sleeps on a pipe instead: the interpreter's C-level handler writes each signal to it (the
    wakeup fd) whatever thread took the signal, which wakes the main thread to run the handler;
    the handler writes to it too, for a signal handled between the check and the read."""

    def __init__(self) -> None:
        super().__init__()
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)

    def set_by_signal(self) -> None:
        self.set()
        try:
            os.write(self._write, b"\0")
        except BlockingIOError:  # the pipe is full of wake-ups already
            pass

    def sleep(self) -> None:
        while not self.is_set():
            os.read(self._read, 64)
