"""``devtools.launch.free_port``: two servers of one launch never get the same port."""

from __future__ import annotations

import itertools
import socket

from devtools import launch


class KernelGivingOnePortTwice:
    """A socket whose bind to port 0 gets 5001, 5001, 5002, ... as a kernel may (a port is free
    again once the probing socket is closed)."""

    ports = itertools.chain([5001, 5001], itertools.count(5002))

    def __init__(self, *args) -> None:
        self.port = 0

    def __enter__(self) -> KernelGivingOnePortTwice:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def bind(self, address) -> None:
        self.port = next(self.ports)

    def getsockname(self) -> tuple[str, int]:
        return "127.0.0.1", self.port


def test_a_port_the_kernel_gives_twice_is_handed_out_once(monkeypatch):
    """The soak found a compute whose listen address and metrics port were the same port."""
    monkeypatch.setattr(launch.socket, "socket", KernelGivingOnePortTwice)
    monkeypatch.setattr(launch, "_HANDED_PORTS", set())
    assert [launch.free_port(), launch.free_port(), launch.free_port()] == [5001, 5002, 5003]


def test_free_ports_are_distinct_and_bindable():
    ports = [launch.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))
