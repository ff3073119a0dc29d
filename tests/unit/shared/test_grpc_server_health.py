"""A server built by ``expertcache.grpc_server.build_server`` reports NOT_SERVING, for its services
and for the server as a whole (``""``, what a Kubernetes gRPC probe asks), until ``set_serving``:
a started but not yet ready service never passes a readiness probe."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expertcache.grpc_server import build_server, set_serving


def check(channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_not_serving_until_set_serving(tmp_path):
    address = f"unix://{tmp_path}/s.sock"
    server, health = build_server(address, [], ["moe.inference.v1.Inference"])
    server.start()
    try:
        with grpc.insecure_channel(address) as channel:
            for service in ("", "moe.inference.v1.Inference"):
                assert check(channel, service) == health_pb2.HealthCheckResponse.NOT_SERVING
            set_serving(health, ["moe.inference.v1.Inference"])
            for service in ("", "moe.inference.v1.Inference"):
                assert check(channel, service) == health_pb2.HealthCheckResponse.SERVING
            health.enter_graceful_shutdown()
            assert check(channel, "") == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        server.stop(0)
