"""The compute service's one frozen, validated config.

Loaded once in ``__main__`` (CLI > env ``EXPERTCACHE_COMPUTE_*`` > ``--config-file`` YAML >
default, see ``expertcache.config_loader``) and passed down explicitly; nothing else in this
package reads the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from expertcache.config_fields import (
    DEVICE_KINDS,
    ObservabilityFields,
    PredictorClientFields,
    ServerSecurityFields,
    TransportFields,
)
from expertcache.errors import InvalidArgument
from expertcache.paths import DEFAULT_DAEMON_ADDRESS
from expertcache.security import ClientSecurity, ServerSecurity

ENV_PREFIX = "EXPERTCACHE_COMPUTE_"


@dataclass(frozen=True)
class ComputeConfig(ServerSecurityFields, PredictorClientFields, ObservabilityFields, TransportFields):
    """Settings of one compute process (the GPU pod's main container)."""

    store_dir: str = field(
        default="",
        metadata={
            "help": "expert store directory (manifest.json, config.json, dense.safetensors, tokenizer)"
        },
    )
    """Store written by ``python -m cache_daemon.convert``; compute reads only its dense part."""

    daemon_address: str = field(
        default=DEFAULT_DAEMON_ADDRESS,
        metadata={"help": "gRPC address of the cache daemon, unix:///path/daemon.sock"},
    )
    """Where the cache daemon serves ``moe.cache.v1.ExpertCache`` (a unix socket in the pod). The
    default is the daemon's default socket (``expertcache.paths``)."""

    listen_address: str = field(
        default="127.0.0.1:50051",
        metadata={"help": "address the Inference gRPC service binds, host:port or unix:///path"},
    )
    """Address of ``moe.inference.v1.Inference`` (plus health, and reflection when asked for).
    Loopback by default: a pod passes ``0.0.0.0:50051`` (the chart does)."""

    http_listen_address: str = field(
        default="",
        metadata={
            "help": "address the OpenAI-compatible HTTP API binds, HOST:PORT (e.g. 0.0.0.0:8080); empty = off"
        },
    )
    """Optional: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` and ``/health``
    (``compute_svc.http.api``), served by this process over the same scheduler and limits as
    gRPC, with the same bearer token (``auth_token_file``) and TLS files."""

    http_max_requests: int = field(
        default=256,
        metadata={
            "help": "HTTP API generation requests in progress at once; one more gets 429",
            "min": 1,
            "max": 1 << 16,
        },
    )
    """Bounds the HTTP API's requests before the scheduler's own admission (max_waiting_requests).
    One client address holds at most max_client_share of them."""

    http_max_connections: int = field(
        default=0,
        metadata={
            "help": "HTTP connections open at once; 0 = what the open-files limit leaves (3/4 of it, less the listen backlog)",
            "min": 0,
            "max": 1 << 20,
        },
    )
    """Never more than the open-files limit (``ulimit -n``) leaves after gRPC, the daemon and the
    store (a quarter, at least 128) and the listen backlog (an eighth, at most 512). At the limit a
    new connection closes the idlest one (of its own client address first); see
    ``compute_svc.http.guard``."""

    http_header_timeout_s: float = field(
        default=10.0,
        metadata={
            "help": "seconds an HTTP connection may take to send a whole request's headers; 0 = no limit",
            "min": 0.0,
            "max": 3600.0,
        },
    )
    """Counted from the connection's opening, or from the first byte of a keep-alive
    connection's next request: a connection that sends nothing, or headers a byte at a time, is
    closed (one idle between requests is closed after max_connection_idle_s)."""

    served_model_name: str = field(
        default="",
        metadata={
            "help": "the model's name in the HTTP API (GET /v1/models, a request's model); "
            "empty = the converted checkpoint's name"
        },
    )
    """What OpenAI clients call the model (vLLM's ``--served-model-name``). By default the name of
    the checkpoint the store was converted from, as its manifest records it
    (``StoreManifest.checkpoint_name``: the directory's name, or ``org/name`` of a Hugging Face
    cache snapshot), else the store's model id. A request may also name the store's model id (the
    64-hex-digit hash ``/v1/models`` listed before this setting existed)."""

    device: str = field(
        default="auto",
        metadata={
            "help": "torch device for the dense weights: auto follows the daemon's arena",
            "choices": DEVICE_KINDS,
        },
    )
    """``auto`` runs where the daemon's arena lives (CUDA IPC → cuda, memfd → cpu); an
    explicit value must agree with the arena, since experts are read in place."""

    max_new_tokens_limit: int = field(
        default=4096,
        metadata={"help": "largest max_new_tokens a request may ask for", "min": 1, "max": 1 << 20},
    )
    """Upper bound of ``GenerateRequest.max_new_tokens`` (reported in ``ModelInfo``)."""

    max_prompt_tokens: int = field(
        default=0,
        metadata={
            "help": "largest prompt in tokens; 0 = the model's maximum positions",
            "min": 0,
            "max": 1 << 24,
        },
    )
    """A longer prompt is refused with INVALID_ARGUMENT naming the limit (never above the model's
    ``max_position_embeddings``)."""

    max_total_tokens: int = field(
        default=0,
        metadata={
            "help": "largest prompt + max_new_tokens of one request; 0 = the model's maximum positions",
            "min": 0,
            "max": 1 << 24,
        },
    )
    """Bounds each request's KV cache; refused with INVALID_ARGUMENT beyond it."""

    max_prompt_bytes: int = field(
        default=1 << 20,
        metadata={
            "help": "largest prompt text (or chat messages) in bytes, checked before tokenising",
            "min": 1,
        },
    )
    """A bigger text is refused before any tokenisation work (a hostile client's 1 GB prompt). So
    is text longer than max_prompt_tokens × the tokenizer's longest token, which cannot fit."""

    max_batch_size: int = field(
        default=16, metadata={"help": "requests batched in one step", "min": 1, "max": 4096}
    )
    """Continuous batching: at most this many requests advance together; the rest wait."""

    max_batched_tokens: int = field(
        default=256,
        metadata={
            "help": "tokens in one step (decode tokens + prompt chunks); 0 = no limit (whole prompts)",
            "min": 0,
            "max": 1 << 20,
        },
    )
    """Bounds a step's work: a long prompt is fed in chunks, so other requests' next tokens wait
    one chunk at most. Must be at least ``max_batch_size`` (or 0)."""

    graph_kv_rows: int = field(
        default=4,
        metadata={
            "help": "requests whose decode steps a GPU replays as CUDA graphs (KV pool rows); 0 = none",
            "min": 0,
            "max": 1024,
        },
    )
    """On a GPU, decode steps of requests holding a row of the KV pool run as replayed CUDA graphs
    (compute_svc.engine.graph_step); the pool is graph_kv_rows x graph_kv_tokens tokens of keys and
    values, allocated at the first request (GPU memory beside max_cache_tokens' KV of the requests
    outside it: Mixtral-8x7B's 128 KiB per token make the default pool 1 GiB). Requests beyond it
    decode through transformers."""

    graph_kv_tokens: int = field(
        default=2048,
        metadata={
            "help": "prompt + new tokens a KV pool row holds (never above max_total_tokens)",
            "min": 1,
            "max": 1 << 20,
        },
    )
    """A longer request gets its own KV buffers and decodes through transformers."""

    max_waiting_requests: int = field(
        default=64,
        metadata={"help": "requests that may wait for a place in the batch", "min": 0, "max": 1 << 16},
    )
    """One more is refused at once with RESOURCE_EXHAUSTED (retry later) instead of queueing
    without bound."""

    max_client_share: float = field(
        default=0.5,
        metadata={
            "help": "the most of the batch and of the waiting queue one client address may hold (1 = no bound)",
            "min": 0.01,
            "max": 1.0,
        },
    )
    """Fairness: one address (a gRPC peer's host, an HTTP client's) runs at most this share of
    max_batch_size and waits in at most this share of max_waiting_requests; more is refused with
    RESOURCE_EXHAUSTED (HTTP 429), and its waiting requests let other addresses' pass. Behind a
    proxy every client has the proxy's address: set 1 there."""

    max_cache_tokens: int = field(
        default=0,
        metadata={
            "help": "prompt + max_new_tokens of the running requests together (the KV budget); 0 = no limit",
            "min": 0,
            "max": 1 << 30,
        },
    )
    """A request whose tokens would exceed this waits until running ones finish."""

    daemon_connect_timeout_s: float = field(
        default=5.0,
        metadata={"help": "seconds to wait for the cache daemon at start", "min": 0.1, "max": 3600.0},
    )
    """How long start-up waits for the daemon's socket before exiting with a clear error."""

    acquire_timeout_s: float = field(
        default=120.0,
        metadata={"help": "seconds one layer may wait for its experts", "min": 0.1, "max": 86400.0},
    )
    """Limit of one Acquire (all experts of a wave); beyond it the request fails with
    DEADLINE_EXCEEDED instead of hanging on a stuck daemon."""

    predictor_address: str = field(
        default="", metadata={"help": "gRPC address of the predictor (host:port); empty = no reporting"}
    )
    """Where each token's routing is reported (``moe.predictor.v1.Predictor.Observe``). Reporting
    is asynchronous and lossy: an absent or slow predictor never slows or fails a Generate."""

    pod_name: str = field(
        default="", metadata={"help": "pod name sent with each activation; empty = this host's name"}
    )
    """Names the cache daemon serving this process's requests: the predictor sends the hints of
    these requests to the daemon that subscribed with the same pod name."""

    report_queue_tokens: int = field(
        default=8192,
        metadata={"help": "tokens of routing that may wait for the predictor", "min": 1, "max": 1 << 24},
    )
    """Bound of the reporter's queue, in tokens; a step that does not fit is dropped and counted
    (``moe_compute_activations_dropped_total``) instead of waiting."""

    record_trace_path: str = field(
        default="", metadata={"help": "write every request's routing to this .npz trace; empty = off"}
    )
    """Trace file in the format of the shared routing traces (``compute_svc.engine.trace_recorder``),
    rewritten atomically every ``record_trace_every_requests`` requests and at shutdown."""

    record_trace_every_requests: int = field(
        default=16,
        metadata={
            "help": "finished requests between two rewrites of the trace file",
            "min": 1,
            "max": 1 << 20,
        },
    )
    """How often the trace file is rewritten while serving (it is always written at shutdown)."""

    shm_fast_path: bool = field(
        default=True,
        metadata={"help": "pin resident experts through the daemon's shared slot table, without RPC"},
    )
    """On a hit compute pins the expert in the daemon's shared-memory slot table and sends no RPC;
    only misses go to the daemon as a Demand. ``--no-shm-fast-path`` sends every acquire through
    Demand (for comparison, or when the daemon's shm directory is not shared with compute)."""

    layer_ahead: bool = field(
        default=True,
        metadata={"help": "send the daemon the next MoE layers' experts, predicted layers early"},
    )
    """In each MoE layer, the routers of the next ``layer_ahead_depth`` MoE layers are applied to
    this layer's input (one [T, H] x [H, E] product each, ``compute_svc.experts.layer_ahead``) and the
    predicted experts go to the daemon as one one-way LayerAhead message, so it can fetch them
    during this and the following layers. ``--no-layer-ahead`` turns it off (the daemon still gets
    each layer's actual routing)."""

    layer_ahead_depth: int = field(
        default=1,
        metadata={
            "help": "MoE layers predicted ahead by the lookahead (1 = the next layer only)",
            "min": 1,
            "max": 64,
        },
    )
    """How many MoE layers ahead the lookahead predicts. The daemon measures each depth's
    precision and the share of its prefetches used, and prefetches only the depths above
    ``min_precision`` and ``min_usefulness``. 1 by measurement end to end
    (``python -m bench.e2e --layer-ahead-depth D``, gpt-oss shape, 25% budget, 2 x 64 tokens on the
    2-core development machine): at depth 3, 44% of the prefetches were evicted unused and ours
    read 1.41x LRU's bytes per token, at depth 1 17% and 1.03x, with a lower p50 (203 against
    226 ms) and a third less daemon CPU per token. The trace replay's GPU timing model gains
    latency from depth 3 (its ``--lookahead-depth`` sweep) at the cost of those bytes."""

    trace_layer_ratio: float = field(
        default=0.05,
        metadata={
            "help": "share of traced steps whose MoE layers get spans (moe_layer, acquire)",
            "min": 0.0,
            "max": 1.0,
        },
    )
    """Only with tracing on (``OTEL_*`` environment, ``expertcache.telemetry``): per-layer spans
    of every step would cost more than the step; a sampled step's layers are all traced."""
    drain_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "on SIGTERM: seconds the Generate streams in progress may take to finish",
            "min": 0.0,
            "max": 86400.0,
        },
    )
    """On SIGTERM (a pod being stopped) health turns NOT_SERVING and new Generates are refused
    with UNAVAILABLE at once (a client retries another replica); the running and queued ones go
    on until they finish or this many seconds pass, and only those still running then are
    stopped (UNAVAILABLE). The chart sets the pod's terminationGracePeriodSeconds above it."""

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
            from compute_svc.http.server import parse_address

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
