"""The compute service's one frozen, validated config.

Loaded once in ``__main__`` (CLI > env ``EXPERTCACHE_COMPUTE_*`` > ``--config-file`` YAML >
default, see ``expertcache.config_loader``) and passed down explicitly; nothing else in this
package reads the environment.
"""

from __future__ import annotations

from dataclasses import dataclass

from expertcache.config_fields import (
    DEVICE_KINDS,
    ObservabilityFields,
    PredictorClientFields,
    ServerSecurityFields,
    TransportFields,
    setting,
)
from expertcache.errors import InvalidArgument
from expertcache.paths import DEFAULT_DAEMON_ADDRESS
from expertcache.security import ClientSecurity, ServerSecurity

ENV_PREFIX = "EXPERTCACHE_COMPUTE_"


def parse_address(address: str, field: str = "http_listen_address") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) → (host, port); ``InvalidArgument`` naming ``field``."""
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InvalidArgument(f"config field {field!r} = {address!r} is not HOST:PORT (e.g. 0.0.0.0:8080)")
    return host, int(port)


@dataclass(frozen=True)
class ComputeConfig(ServerSecurityFields, PredictorClientFields, ObservabilityFields, TransportFields):
    """Settings of one compute process (the GPU pod's main container)."""

    store_dir: str = setting(
        "",
        "expert store directory written by python -m cache_daemon.convert (compute reads its "
        "manifest.json, config.json, dense.safetensors and tokenizer)",
    )

    daemon_address: str = setting(
        DEFAULT_DAEMON_ADDRESS, "gRPC address of the cache daemon, unix:///path/daemon.sock"
    )

    listen_address: str = setting(
        "127.0.0.1:50051",
        "address the Inference gRPC service (with health and reflection) binds, host:port "
        "or unix:///path (0.0.0.0:50051 in a pod)",
    )

    http_listen_address: str = setting(
        "",
        "address the OpenAI-compatible HTTP API (/v1/models, /v1/completions, "
        "/v1/chat/completions, /health) binds, HOST:PORT (e.g. 0.0.0.0:8080), served with gRPC's "
        "scheduler, limits, bearer token and TLS files; empty = off",
    )

    http_max_requests: int = setting(
        256,
        "HTTP API generation requests in progress at once, before the scheduler's own admission "
        "(one client address holds at most max_client_share of them); one more gets 429",
        min=1,
        max=1 << 16,
    )

    http_max_connections: int = setting(
        0,
        "HTTP connections open at once (at the limit a new one closes the idlest); 0 = what the "
        "open-files limit leaves (3/4 of it, less the listen backlog)",
        min=0,
        max=1 << 20,
    )

    http_header_timeout_s: float = setting(
        10.0,
        "seconds an HTTP connection may take to send a whole request's headers, from its opening "
        "or the first byte of its next request; 0 = no limit",
        min=0.0,
        max=3600.0,
    )

    served_model_name: str = setting(
        "",
        "the model's name in the HTTP API (GET /v1/models, a request's model, which may also "
        "name the store's model id); empty = the converted checkpoint's name",
    )

    device: str = setting(
        "auto",
        "torch device for the dense weights: auto follows the daemon's arena (an explicit value "
        "must agree with it)",
        choices=DEVICE_KINDS,
    )

    max_new_tokens_limit: int = setting(
        4096, "largest max_new_tokens a request may ask for", min=1, max=1 << 20
    )

    max_prompt_tokens: int = setting(
        0,
        "largest prompt in tokens (INVALID_ARGUMENT beyond), never above the model's maximum "
        "positions; 0 = those",
        min=0,
        max=1 << 24,
    )

    max_total_tokens: int = setting(
        0,
        "largest prompt + max_new_tokens of one request, bounding its KV cache; 0 = the model's "
        "maximum positions",
        min=0,
        max=1 << 24,
    )

    max_prompt_bytes: int = setting(
        1 << 20, "largest prompt text (or chat messages) in bytes, checked before tokenising", min=1
    )

    max_batch_size: int = setting(16, "requests batched in one step; the rest wait", min=1, max=4096)

    max_batched_tokens: int = setting(
        256,
        "tokens in one step (decode tokens + prompt chunks), at least max_batch_size; "
        "0 = no limit (whole prompts)",
        min=0,
        max=1 << 20,
    )

    # Mixtral-8x7B's 128 KiB of KV per token make the default pool 1 GiB of GPU memory.
    graph_kv_rows: int = setting(
        4,
        "requests whose decode steps a GPU replays as CUDA graphs: rows of a KV pool of "
        "graph_kv_tokens each, allocated at the first request; 0 = none",
        min=0,
        max=1024,
    )

    graph_kv_tokens: int = setting(
        2048,
        "prompt + new tokens a KV pool row holds (never above max_total_tokens); a longer "
        "request decodes through transformers",
        min=1,
        max=1 << 20,
    )

    max_waiting_requests: int = setting(
        64,
        "requests that may wait for a place in the batch; one more gets RESOURCE_EXHAUSTED",
        min=0,
        max=1 << 16,
    )

    max_client_share: float = setting(
        0.5,
        "the most of the batch and of the waiting queue one client address may hold "
        "(1 = no bound; set 1 behind a proxy, where every client has its address)",
        min=0.01,
        max=1.0,
    )

    max_cache_tokens: int = setting(
        0,
        "prompt + max_new_tokens of the running requests together (the KV budget; a request "
        "beyond waits); 0 = no limit",
        min=0,
        max=1 << 30,
    )

    daemon_connect_timeout_s: float = setting(
        5.0, "seconds to wait for the cache daemon at start", min=0.1, max=3600.0
    )

    acquire_timeout_s: float = setting(
        120.0, "seconds one layer may wait for its experts (then DEADLINE_EXCEEDED)", min=0.1, max=86400.0
    )

    predictor_address: str = setting(
        "",
        "gRPC address of the predictor (host:port) routing is reported to, lossily and never "
        "slowing a Generate; empty = no reporting",
    )

    pod_name: str = setting(
        "",
        "pod name sent with each activation (the daemon subscribed with it gets their hints); "
        "empty = this host's name",
    )

    report_queue_tokens: int = setting(
        8192,
        "tokens of routing that may wait for the predictor; a step beyond is dropped and counted",
        min=1,
        max=1 << 24,
    )

    record_trace_path: str = setting("", "write every request's routing to this .npz trace; empty = off")

    record_trace_every_requests: int = setting(
        16,
        "finished requests between two rewrites of the trace file (always written at shutdown)",
        min=1,
        max=1 << 20,
    )

    shm_fast_path: bool = setting(
        True,
        "pin resident experts through the daemon's shared slot table, without RPC (off: every "
        "acquire is a Demand, e.g. when the daemon's shm directory is not shared)",
    )

    layer_ahead: bool = setting(True, "send the daemon the next MoE layers' experts, predicted layers early")

    # 1 by measurement (python -m bench.e2e --layer-ahead-depth D, gpt-oss shape, 25% budget): at depth 3
    # 44% of prefetches went unused and 1.41x LRU's bytes were read per token, at depth 1 17% and 1.03x.
    layer_ahead_depth: int = setting(
        1,
        "MoE layers predicted ahead by the lookahead (1 = the next layer only); the daemon "
        "prefetches only the depths that prove precise and useful",
        min=1,
        max=64,
    )

    trace_layer_ratio: float = setting(
        0.05,
        "share of traced steps whose MoE layers get spans (moe_layer, acquire), with tracing on "
        "(OTEL_* environment)",
        min=0.0,
        max=1.0,
    )

    drain_timeout_s: float = setting(
        30.0,
        "on SIGTERM: seconds the running and queued Generates may take to finish (new ones get "
        "UNAVAILABLE at once, those still running then end UNAVAILABLE)",
        min=0.0,
        max=86400.0,
    )

    def check(self) -> None:
        """Cross-field checks beyond the per-field metadata (called by ``load_config``)."""
        if not self.store_dir:
            raise InvalidArgument("config field 'store_dir' is empty: pass --store-dir STORE")
        if not self.daemon_address:
            raise InvalidArgument(
                "config field 'daemon_address' is empty: pass --daemon-address unix:///path"
            )
        if not self.listen_address:
            raise InvalidArgument("config field 'listen_address' is empty: pass --listen-address HOST:PORT")
        if self.http_listen_address:
            parse_address(self.http_listen_address)
        if not self.served_model_name.isprintable():
            raise InvalidArgument(
                f"config field 'served_model_name' = {self.served_model_name!r} holds a character that "
                "is not printable (a control character, or bytes that are not UTF-8)"
            )
        ServerSecurity.from_config(self).check()
        ClientSecurity.from_config(self).check()
        if self.max_batched_tokens and self.max_batched_tokens < self.max_batch_size:
            raise InvalidArgument(
                f"config field 'max_batched_tokens' = {self.max_batched_tokens} is below max_batch_size "
                f"{self.max_batch_size}: a full batch feeds one token per request (use 0 for no limit)"
            )
