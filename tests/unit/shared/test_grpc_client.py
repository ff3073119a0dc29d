"""expertcache.grpc_client.wait_ready on real channels and real servers on loopback ports: a
server with health (the services' own edge), one without, and a port nobody listens on. The wait
subscribes nothing to the channel's connectivity (a subscription keeps gRPC's polling thread
asking the channel, which raises "Channel closed!" in that thread once the channel is closed)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from devtools.launch import free_port
from expertcache.grpc_client import wait_ready
from expertcache.grpc_server import build_server


class RecordingChannel:
    """A real channel whose connectivity subscriptions are recorded (its calls pass through)."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.channel = channel
        self.subscribed: list = []

    def subscribe(self, callback, try_to_connect=False) -> None:
        self.subscribed.append(callback)
        self.channel.subscribe(callback, try_to_connect=try_to_connect)

    def unsubscribe(self, callback) -> None:
        self.channel.unsubscribe(callback)

    def __getattr__(self, name):
        return getattr(self.channel, name)


def test_a_port_nobody_listens_on_is_not_ready_within_the_timeout():
    with grpc.insecure_channel(f"127.0.0.1:{free_port()}") as channel:
        recording = RecordingChannel(channel)
        started = time.monotonic()
        assert wait_ready(recording, 0.3) is False
        assert 0.25 <= time.monotonic() - started < 5.0
        assert recording.subscribed == []


@pytest.mark.parametrize("health", [True, False], ids=["with-health", "without-health"])
def test_a_served_port_is_ready(health):
    if health:  # the services' own edge: health NOT_SERVING until set, which still answers
        port = free_port()
        server, _ = build_server(f"127.0.0.1:{port}", [], ["test.Nothing"])
    else:
        server = grpc.server(ThreadPoolExecutor(max_workers=1))
        port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            recording = RecordingChannel(channel)
            assert wait_ready(recording, 10.0) is True
            assert recording.subscribed == []
    finally:
        server.stop(None)
