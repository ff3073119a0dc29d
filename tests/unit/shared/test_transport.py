"""The transport's bounds (``expertcache.transport``): per connection, per address, in all, and
health's own budget; the options gRPC's core gets."""

from __future__ import annotations

import pytest

from compute_svc.config import ComputeConfig
from expertcache.errors import InvalidArgument, ResourceExhausted
from expertcache.prom import value
from expertcache.transport import HEALTH_STREAMS, StreamAccounting, TransportLimits, peer_address

GENERATE = "/moe.inference.v1.Inference/Generate"
HEALTH = "/grpc.health.v1.Health/Check"


def limits(**overrides) -> TransportLimits:
    return TransportLimits.from_config(None, **overrides)


def test_peer_addresses_group_connections_by_host():
    assert peer_address("ipv4:10.0.0.7:51234") == ("ipv4:10.0.0.7", "ipv4:10.0.0.7:51234")
    assert peer_address("ipv6:[::1]:40000") == ("ipv6:[::1]", "ipv6:[::1]:40000")
    assert peer_address("unix:/run/daemon.sock") == ("unix:/run/daemon.sock", "unix:/run/daemon.sock")
    assert peer_address("") == ("", "")


def test_streams_per_address_are_bounded_and_released():
    acct = StreamAccounting(limits(max_streams_per_address=3, max_streams=10))
    tickets = [acct.admit(f"ipv4:1.2.3.4:{1000 + i}", GENERATE) for i in range(3)]
    with pytest.raises(ResourceExhausted, match="max_streams_per_address"):
        acct.admit("ipv4:1.2.3.4:2000", GENERATE)
    other = acct.admit("ipv4:5.6.7.8:1000", GENERATE)  # another client is not affected
    acct.release(tickets[0])
    acct.admit("ipv4:1.2.3.4:2000", GENERATE)
    acct.release(other)
    assert value(acct.stats.refused, "max_streams_per_address") == 1
    assert acct.snapshot()["streams"] == 3


def test_connections_per_address_count_those_with_streams():
    acct = StreamAccounting(limits(max_connections_per_address=2))
    a = acct.admit("ipv4:1.2.3.4:1", GENERATE)
    acct.admit("ipv4:1.2.3.4:1", GENERATE)  # the same connection again
    acct.admit("ipv4:1.2.3.4:2", GENERATE)
    with pytest.raises(ResourceExhausted, match="max_connections_per_address"):
        acct.admit("ipv4:1.2.3.4:3", GENERATE)
    acct.release(a)  # connection 1 still carries a stream
    with pytest.raises(ResourceExhausted):
        acct.admit("ipv4:1.2.3.4:3", GENERATE)


def test_the_server_total_is_bounded_and_health_has_its_own_budget():
    acct = StreamAccounting(limits(max_streams=4, max_streams_per_address=4))
    for i in range(4):
        acct.admit(f"ipv4:10.0.0.{i}:1", GENERATE)
    with pytest.raises(ResourceExhausted, match="max_streams"):
        acct.admit("ipv4:10.0.0.9:1", GENERATE)
    health = [acct.admit("ipv4:10.0.0.9:1", HEALTH) for _ in range(HEALTH_STREAMS)]
    with pytest.raises(ResourceExhausted, match="health"):
        acct.admit("ipv4:10.0.0.9:1", HEALTH)
    acct.release(health[0])
    acct.admit("ipv4:10.0.0.9:1", HEALTH)


def test_limits_are_checked_and_become_core_options():
    with pytest.raises(InvalidArgument, match="max_streams_per_address"):
        limits(max_streams_per_address=10, max_streams=5).check()
    with pytest.raises(InvalidArgument, match="request_timeout_s"):
        limits(request_timeout_s=float("nan")).check()
    options = dict(limits(max_connection_age_s=60.0, max_concurrent_streams=7).server_options())
    assert options["grpc.max_concurrent_streams"] == 7
    assert options["grpc.max_connection_age_ms"] == 60000
    assert options["grpc.max_connection_idle_ms"] == 300000
    assert "grpc.max_connection_age_ms" not in dict(limits().server_options())


def test_the_services_config_carries_the_limits():
    config = ComputeConfig(stream_stall_timeout_s=5.0, max_streams=64, max_streams_per_address=32)
    got = TransportLimits.from_config(config)
    assert (got.stream_stall_timeout_s, got.max_streams, got.max_streams_per_address) == (5.0, 64, 32)
