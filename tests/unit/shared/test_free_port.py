"""``devtools.launch.free_port``: two servers of one launch never get the same port, and no port
is one the kernel may hand to another socket meanwhile."""

from __future__ import annotations

import socket

from devtools import launch


class Picks:
    """A random source that draws 15001, 15001, 15002, ...: the same port twice in a row."""

    def __init__(self) -> None:
        self.draws = iter([15001, 15001, 15002, 15003])

    def randrange(self, start: int, stop: int) -> int:
        return next(self.draws)


def test_a_port_drawn_twice_is_handed_out_once(monkeypatch):
    """The soak found a compute whose listen address and metrics port were the same port."""
    monkeypatch.setattr(launch, "_RANDOM", Picks())
    monkeypatch.setattr(launch, "_HANDED_PORTS", set())
    assert [launch.free_port(), launch.free_port(), launch.free_port()] == [15001, 15002, 15003]


def test_a_port_in_use_is_skipped(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        taken = busy.getsockname()[1]
        draws = iter([taken, 15001])
        monkeypatch.setattr(launch, "_RANDOM", type("R", (), {"randrange": lambda self, a, b: next(draws)})())
        monkeypatch.setattr(launch, "_HANDED_PORTS", set())
        assert launch.free_port() == 15001


def test_ports_lie_outside_the_kernels_ephemeral_range(tmp_path):
    """A port the kernel picks itself (a client's connection, a bind to port 0 elsewhere) is
    never one a server was told to listen on."""
    local = tmp_path / "ip_local_port_range"
    local.write_text("32768\t60999\n")
    assert launch.listen_ports(local) == range(launch.LOWEST_PORT, 32768)
    local.write_text("1024 50000\n")
    assert launch.listen_ports(local) == range(50001, 65536)
    assert launch.listen_ports(tmp_path / "absent") == range(launch.LOWEST_PORT, 32768)
    low, high = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    ports = [launch.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert not any(low <= p <= high for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))
