"""``expertcache``: the client command line, talking to the services the way users' programs do.

::

    expertcache generate --address HOST:PORT "prompt"      stream tokens as they come (Inference.Generate)
    expertcache info --address HOST:PORT                    the served model (Inference.GetModelInfo)
    expertcache stats [--daemon ADDR] [--predictor ADDR]    counters of the cache daemon and the predictor
    expertcache health [--address ADDR] [--service NAME]    grpc.health.v1 Check of any service
    expertcache feed-trace TRACE --address HOST:PORT        feed a routing trace into a predictor (Observe)

The client commands but ``feed-trace`` (plaintext only) take --tls-ca-file (TLS),
--tls-cert-file/--tls-key-file (mTLS), --tls-server-name (the name the certificate is verified
against) and --auth-token-file.

Exit status: 0 on success, 1 when a service answers with an error (its status code and message
go to stderr), 2 for a usage error (argparse) or an unreachable service. ``health`` exits 0 only
when the service reports SERVING (the line ``ADDR: SERVING`` on stdout), 1 when it answers with
another status (NOT_SERVING, SERVICE_UNKNOWN) or does not know the service name, 2 when it cannot
be reached: Kubernetes' exec probes of the cache daemon (a unix socket, which native gRPC probes
cannot reach) and of a TLS port run it. ``feed-trace`` exits 2 for a bad trace file or arguments
and 1 when the predictor cannot be reached or fails (its gRPC status on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
from google.protobuf import json_format

from expertcache.errors import InvalidArgument
from expertcache.paths import DEFAULT_DAEMON_ADDRESS
from expertcache.security import ClientSecurity

DEFAULT_INFERENCE_ADDRESS = "127.0.0.1:50051"
DEFAULT_PREDICTOR_ADDRESS = "127.0.0.1:50070"
EXIT_RPC_ERROR = 1
EXIT_USAGE = 2

_FINISH_NAMES = {0: "", 1: "length", 2: "eos", 3: "stop"}


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"token ids must be integers separated by commas: {text!r}"
        ) from None
    if not ids:
        raise argparse.ArgumentTypeError("--token-ids is empty")
    return ids


def _message(text: str):
    role, sep, content = text.partition(":")
    if not sep or not role:
        raise argparse.ArgumentTypeError(f"a message is ROLE:CONTENT (e.g. user:Hello), got {text!r}")
    return role, content


def _speed(text: str) -> float | None:
    if text == "max":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--speed must be tokens per second (> 0) or 'max', got {text!r}"
        ) from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"--speed must be > 0 tokens per second or 'max', got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def add_security_arguments(parser: argparse.ArgumentParser) -> None:
    """TLS / mTLS / token options of a client (the servers' ``--tls-*`` / ``--auth-token-file``)."""
    group = parser.add_argument_group("security (TCP services)")
    group.add_argument("--tls-ca-file", default="", help="PEM CA bundle to verify the server; set = TLS")
    group.add_argument("--tls-cert-file", default="", help="PEM client certificate (mTLS)")
    group.add_argument("--tls-key-file", default="", help="PEM private key of --tls-cert-file")
    group.add_argument("--auth-token-file", default="", help="file holding the bearer token to send")
    group.add_argument(
        "--tls-server-name",
        default="",
        help="name to verify the server certificate against, when it differs from the address's host "
        "(a Service name the certificate does not list)",
    )


def client_channel(args: argparse.Namespace, address: str) -> grpc.Channel:
    """A channel to ``address`` with the security options (a unix socket is always plaintext)."""
    if address.startswith("unix:"):
        return grpc.insecure_channel(address)
    security = ClientSecurity(
        getattr(args, "tls_ca_file", ""),
        getattr(args, "tls_cert_file", ""),
        getattr(args, "tls_key_file", ""),
        getattr(args, "auth_token_file", ""),
        field_prefix="",  # messages name tls_cert_file etc. (the --tls-cert-file options)
    )
    security.check()
    server_name = getattr(args, "tls_server_name", "")
    if server_name and not security.tls:
        raise InvalidArgument("--tls-server-name needs --tls-ca-file (it names the TLS server's certificate)")
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return security.channel(address, options)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="expertcache",
        description="Client of ExpertCache's services (inference, cache daemon, predictor).",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream a generation from the compute service")
    gen.add_argument("prompt", nargs="?", default="", help="prompt text (or give --token-ids)")
    gen.add_argument("--address", default=DEFAULT_INFERENCE_ADDRESS, help="compute service host:port")
    gen.add_argument("--token-ids", type=_token_ids, default=None, help="prompt as token ids: 1,2,3")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 = all")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0; 1 = off")
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]; 0 = off")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed; 0 = a fresh one")
    gen.add_argument(
        "--message",
        action="append",
        default=[],
        type=_message,
        metavar="ROLE:CONTENT",
        help="a chat message instead of a prompt (repeatable, in order); the model's chat template applies",
    )
    gen.add_argument("--logprobs", action="store_true", help="with --verbose: each token's log-probability")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument(
        "--stop-token-id", action="append", type=int, default=[], help="stop token id (repeatable)"
    )
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    gen.add_argument("--request-id", default="", help="id echoed in the services' logs and traces")
    gen.add_argument("--timeout-s", type=float, default=600.0, help="deadline of the whole generation")
    gen.add_argument(
        "--verbose", action="store_true", help="one line per token (id, latency, cache) on stderr"
    )
    add_security_arguments(gen)

    info = sub.add_parser("info", help="describe the served model")
    info.add_argument("--address", default=DEFAULT_INFERENCE_ADDRESS, help="compute service host:port")
    info.add_argument("--timeout-s", type=float, default=30.0)
    add_security_arguments(info)

    stats = sub.add_parser("stats", help="print the cache daemon's and the predictor's counters")
    stats.add_argument(
        "--daemon", default=DEFAULT_DAEMON_ADDRESS, help="cache daemon address (unix:///path); '' skips it"
    )
    stats.add_argument(
        "--predictor", default=DEFAULT_PREDICTOR_ADDRESS, help="predictor host:port; '' skips it"
    )
    stats.add_argument("--json", action="store_true", help="one JSON object instead of text")
    stats.add_argument("--timeout-s", type=float, default=10.0)
    add_security_arguments(stats)

    health = sub.add_parser(
        "health",
        help="ask a service's grpc.health.v1 Check (exit 0 only when SERVING): a probe's command",
    )
    health.add_argument(
        "--address",
        default=DEFAULT_DAEMON_ADDRESS,
        help="unix:///path/daemon.sock or host:port (default: the cache daemon's socket)",
    )
    health.add_argument(
        "--service", default="", help="service name to check; '' = the server as a whole (default)"
    )
    health.add_argument("--timeout-s", type=float, default=5.0, help="deadline of the check")
    health.add_argument("--tls-ca-file", default="", help="CA bundle: check over TLS (server certificate)")
    health.add_argument(
        "--tls-cert-file", default="", help="client certificate for mTLS (with --tls-key-file)"
    )
    health.add_argument("--tls-key-file", default="", help="client key for mTLS (with --tls-cert-file)")
    health.add_argument(
        "--tls-server-name",
        default="",
        help="name to verify the server certificate against, when it differs from the address's host",
    )
    health.add_argument(
        "--auth-token-file", default="", help="file holding a bearer token sent as 'authorization'"
    )

    feed = sub.add_parser(
        "feed-trace",
        help="feed a routing trace into a running predictor, as if its requests were live",
        description="Feed a routing trace (.npz, format in expertcache.trace) through a running "
        "predictor's Observe.",
    )
    feed.add_argument("trace", type=Path, help="trace file (.npz)")
    feed.add_argument("--address", required=True, help="predictor host:port")
    feed.add_argument("--model-id", default=None, help="model id to report (default: the trace's model)")
    feed.add_argument(
        "--pod", default="replay", help="pod whose hint subscribers get the hints (default: replay)"
    )
    feed.add_argument("--requests", type=_positive_int, default=None, help="feed only the first N requests")
    feed.add_argument("--speed", type=_speed, default=None, help="tokens per second, or 'max' (default)")
    feed.add_argument("--run-id", default=None, help="request id prefix (default: replay-<ms since epoch>)")
    feed.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _fail(exc: grpc.RpcError, what: str) -> int:
    code = exc.code()
    print(f"expertcache: {what}: {code.name if code else 'UNKNOWN'}: {exc.details()}", file=sys.stderr)
    return EXIT_USAGE if code is grpc.StatusCode.UNAVAILABLE else EXIT_RPC_ERROR


def cmd_generate(args: argparse.Namespace) -> int:
    from moe.inference.v1 import inference_pb2, inference_pb2_grpc

    if sum(map(bool, (args.prompt, args.token_ids, args.message))) != 1:
        print(
            "expertcache generate: give a prompt, --token-ids or --message (exactly one kind)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    request = inference_pb2.GenerateRequest(
        text=args.prompt,
        token_ids=args.token_ids or [],
        messages=[inference_pb2.ChatMessage(role=r, content=c) for r, c in args.message],
        max_new_tokens=args.max_new_tokens,
        sampling=inference_pb2.SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty,
            seed=args.seed,
        ),
        stop=args.stop,
        stop_token_ids=args.stop_token_id,
        ignore_eos=args.ignore_eos,
        request_id=args.request_id,
        logprobs=args.logprobs,
    )
    tokens = 0
    finish = ""
    started = time.perf_counter()
    with client_channel(args, args.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        try:
            for event in stub.Generate(request, timeout=args.timeout_s):
                tokens += 1
                sys.stdout.write(event.text)
                sys.stdout.flush()
                if args.verbose:
                    print(
                        f"[{event.index}] id {event.token_id} {event.latency_s * 1e3:.1f} ms "
                        f"hits {event.cache.hits} misses {event.cache.misses} stall {event.cache.stall_s * 1e3:.1f} ms"
                        + (f" logprob {event.logprob:.4f}" if event.HasField("logprob") else ""),
                        file=sys.stderr,
                    )
                finish = _FINISH_NAMES.get(event.finish_reason, finish) or finish
        except grpc.RpcError as exc:
            print(file=sys.stdout)
            return _fail(exc, f"Generate at {args.address}")
    elapsed = time.perf_counter() - started
    print()
    print(f"[{tokens} tokens in {elapsed:.2f} s, finish: {finish or 'none'}]", file=sys.stderr)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from moe.inference.v1 import inference_pb2, inference_pb2_grpc

    with client_channel(args, args.address) as channel:
        try:
            info = inference_pb2_grpc.InferenceStub(channel).GetModelInfo(
                inference_pb2.GetModelInfoRequest(), timeout=args.timeout_s
            )
        except grpc.RpcError as exc:
            return _fail(exc, f"GetModelInfo at {args.address}")
    print(json.dumps(json_format.MessageToDict(info, preserving_proto_field_name=True), indent=2))
    return 0


def _print_tree(value: object, indent: int = 0) -> None:
    pad = "  " * indent
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, dict | list):
                print(f"{pad}{key}:")
                _print_tree(item, indent + 1)
            else:
                print(f"{pad}{key}: {item}")
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, dict):
                print(
                    f"{pad}- "
                    + ", ".join(f"{k}={v}" for k, v in item.items() if not isinstance(v, dict | list))
                )
                nested = {k: v for k, v in item.items() if isinstance(v, dict | list)}
                if nested:
                    _print_tree(nested, indent + 2)
            else:
                print(f"{pad}- {item}")


def cmd_stats(args: argparse.Namespace) -> int:
    from moe.cache.v1 import cache_pb2, cache_pb2_grpc
    from moe.predictor.v1 import predictor_pb2, predictor_pb2_grpc

    targets = []
    if args.daemon:
        targets.append(("daemon", args.daemon, cache_pb2_grpc.ExpertCacheStub, cache_pb2.GetStatsRequest))
    if args.predictor:
        targets.append(
            ("predictor", args.predictor, predictor_pb2_grpc.PredictorStub, predictor_pb2.GetStatsRequest)
        )
    if not targets:
        print("expertcache stats: nothing to ask: give --daemon and/or --predictor", file=sys.stderr)
        return EXIT_USAGE
    report: dict[str, object] = {}
    status = 0
    for name, address, stub_cls, request_cls in targets:
        with client_channel(args, address) as channel:
            try:
                reply = stub_cls(channel).GetStats(request_cls(), timeout=args.timeout_s)
            except grpc.RpcError as exc:
                status = max(status, _fail(exc, f"GetStats of the {name} at {address}"))
                continue
        report[name] = json_format.MessageToDict(
            reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for name, values in report.items():
            address = args.daemon if name == "daemon" else args.predictor
            print(f"{name} ({address}):")
            _print_tree(values, 1)
    return status


class _UsageError(Exception):
    """A problem with the command's arguments (exit 2, message on stderr)."""


def _read_file(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise _UsageError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None


def _health_channel(args: argparse.Namespace) -> grpc.Channel:
    """An insecure channel, or a TLS one when a CA file is given (mTLS with cert and key)."""
    if bool(args.tls_cert_file) != bool(args.tls_key_file):
        raise _UsageError("--tls-cert-file and --tls-key-file go together")
    if args.tls_cert_file and not args.tls_ca_file:
        raise _UsageError("--tls-cert-file needs --tls-ca-file (the check is then made over TLS)")
    if not args.tls_ca_file:
        return grpc.insecure_channel(args.address)
    if args.address.startswith("unix:"):
        raise _UsageError("TLS options apply to a host:port address, not to a unix socket")
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read_file(args.tls_ca_file, "CA file"),
        private_key=_read_file(args.tls_key_file, "client key") if args.tls_key_file else None,
        certificate_chain=_read_file(args.tls_cert_file, "client certificate")
        if args.tls_cert_file
        else None,
    )
    options = [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else []
    return grpc.secure_channel(args.address, credentials, options=options)


def cmd_health(args: argparse.Namespace) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    where = f"{args.address}" + (f" (service {args.service!r})" if args.service else "")
    if args.address.startswith("unix:"):
        path = args.address.removeprefix("unix://").removeprefix("unix:")
        if not Path(path).exists():
            print(f"expertcache health: {where}: no socket at {path} (is the service up?)", file=sys.stderr)
            return EXIT_USAGE
    if args.timeout_s <= 0:
        print(f"expertcache health: --timeout-s must be > 0, got {args.timeout_s}", file=sys.stderr)
        return EXIT_USAGE
    try:
        metadata = ()
        if args.auth_token_file:
            token = _read_file(args.auth_token_file, "token file").decode().strip()
            if not token:
                raise _UsageError(f"the token file {args.auth_token_file} is empty")
            metadata = (("authorization", f"Bearer {token}"),)
        channel = _health_channel(args)
    except _UsageError as exc:
        print(f"expertcache health: {exc}", file=sys.stderr)
        return EXIT_USAGE
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout_s, metadata=metadata
            )
        except grpc.RpcError as exc:
            code = exc.code()
            if code is grpc.StatusCode.NOT_FOUND:
                print(f"expertcache health: {where}: the server does not know this service", file=sys.stderr)
                return EXIT_RPC_ERROR
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                print(
                    f"expertcache health: {where}: unreachable: {code.name}: {exc.details()}",
                    file=sys.stderr,
                )
                return EXIT_USAGE
            return _fail(exc, f"health Check at {where}")
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"expertcache health: {where}: {status}", file=sys.stderr)
        return EXIT_RPC_ERROR
    print(f"{where}: {status}")
    return 0


def cmd_feed_trace(args: argparse.Namespace) -> int:
    from expertcache.feed_trace import FeedError, feed
    from expertcache.trace import TraceError, read_trace

    try:
        trace = read_trace(args.trace)
    except TraceError as exc:
        print(f"expertcache feed-trace: {exc}", file=sys.stderr)
        return EXIT_USAGE
    model_id = args.model_id or trace.model
    start = time.monotonic()
    try:
        sent, done = feed(
            trace,
            args.address,
            model_id=model_id,
            pod=args.pod,
            requests=args.requests,
            tokens_per_s=args.speed,
            run_id=args.run_id,
            show_progress=not args.no_progress,
        )
    except FeedError as exc:
        print(f"expertcache feed-trace: {exc}", file=sys.stderr)
        return EXIT_RPC_ERROR
    except grpc.RpcError as exc:
        print(
            f"expertcache feed-trace: predictor at {args.address} failed: {exc.code().name}: {exc.details()}",
            file=sys.stderr,
        )
        return EXIT_RPC_ERROR
    elapsed = time.monotonic() - start
    print(
        f"replayed {done} requests, {sent} tokens of {args.trace.name} as model {model_id!r} "
        f"in {elapsed:.1f}s ({sent / elapsed if elapsed else 0:.0f} tokens/s)"
    )
    return 0


COMMANDS = {
    "generate": cmd_generate,
    "info": cmd_info,
    "stats": cmd_stats,
    "health": cmd_health,
    "feed-trace": cmd_feed_trace,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except InvalidArgument as exc:  # unusable --tls-* / --auth-token-file
        print(f"expertcache: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
