"""The HTTP front door's connection limits, derived from the open-files limit."""

from __future__ import annotations

import pytest

from compute_svc.http.guard import ConnectionLimits
from expertcache.errors import InvalidArgument


def test_connection_limits_follow_the_open_files_limit():
    # 1,024 descriptors: 256 kept for the rest, 128 for a backlog accepted in one go.
    limits = ConnectionLimits.derive(max_requests=256, client_share=0.5, header_timeout_s=10, open_files=1024)
    assert (limits.max_connections, limits.max_connections_per_client, limits.backlog) == (640, 320, 128)
    configured = ConnectionLimits.derive(
        max_requests=8, client_share=0.5, header_timeout_s=1, configured_max=200, open_files=1 << 20
    )
    assert (configured.max_connections, configured.max_connections_per_client) == (200, 100)
    # Never more than the descriptors leave, whatever is configured.
    assert (
        ConnectionLimits.derive(
            max_requests=8, client_share=1.0, header_timeout_s=1, configured_max=5000, open_files=1024
        ).max_connections
        == 640
    )


def test_too_few_descriptors_for_the_requests_is_a_config_error_naming_ulimit():
    with pytest.raises(
        InvalidArgument, match=r"open-files limit \(256, ulimit -n\).*http_max_requests \(256\)"
    ):
        ConnectionLimits.derive(max_requests=256, client_share=0.5, header_timeout_s=10, open_files=256)
