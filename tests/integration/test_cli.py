"""The client CLI against real services: ``expertcache generate`` streams what Generate streams,
``expertcache info`` and ``expertcache stats`` print what the services report, and every failure
gives an exit code and a message naming the problem. Runs the installed console script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from moe.inference.v1 import inference_pb2, inference_pb2_grpc

from devtools.launch import free_port, start_predictor
from tests.procs import start_compute, start_daemon

pytestmark = pytest.mark.integration

CLI = Path(sys.executable).parent / "expertcache"
PROMPT = "Once upon a time"


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(CLI), *args], capture_output=True, text=True, timeout=timeout, env={**os.environ}
    )


@pytest.fixture(scope="module")
def stack(tiny_store, tmp_path_factory):
    tiny = tiny_store("mixtral")
    work = tmp_path_factory.mktemp("cli")
    predictor = start_predictor(work)
    wiring = ["--predictor-address", predictor.address, "--pod-name", "cli-test"]
    budget = max(1, tiny.manifest.num_blobs // 4) * tiny.manifest.blob_bytes
    daemon = start_daemon(tiny.store, work, device="cpu", device_budget_bytes=budget, extra=wiring)
    compute = start_compute(tiny.store, daemon, work, extra=wiring)
    yield predictor, daemon, compute
    for proc in (compute, daemon, predictor):
        proc.stop()


def test_generate_streams_the_same_text_as_the_api(stack):
    _, _, compute = stack
    with grpc.insecure_channel(compute.address) as channel:
        replies = list(
            inference_pb2_grpc.InferenceStub(channel).Generate(
                inference_pb2.GenerateRequest(text=PROMPT, max_new_tokens=6, ignore_eos=True), timeout=60
            )
        )
    want = "".join(r.text for r in replies)
    out = run_cli(
        "generate", "--address", compute.address, "--max-new-tokens", "6", "--ignore-eos", "--verbose", PROMPT
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == want + "\n"
    assert out.stderr.count("] id ") == 6  # one --verbose line per token
    assert "[6 tokens in " in out.stderr and "finish: length" in out.stderr


def test_generate_with_token_ids_and_sampling_options(stack):
    _, _, compute = stack
    args = ("generate", "--address", compute.address, "--token-ids", "1,2,3,4", "--max-new-tokens", "4")
    sampled = [
        run_cli(*args, "--temperature", "0.8", "--top-p", "0.9", "--seed", "7", "--ignore-eos")
        for _ in range(2)
    ]
    assert all(r.returncode == 0 for r in sampled), sampled[0].stderr
    assert sampled[0].stdout == sampled[1].stdout  # same seed, same tokens


def test_chat_messages_and_logprobs(stack):
    _, _, compute = stack
    out = run_cli(
        "generate", "--address", compute.address, "--message", "system:Be brief.", "--message", "user:Hello",
        "--max-new-tokens", "3", "--ignore-eos", "--verbose", "--logprobs",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stderr.count(" logprob -") + out.stderr.count(" logprob 0.0000") == 3


def test_info_and_stats_print_what_the_services_report(stack):
    predictor, daemon, compute = stack
    info = run_cli("info", "--address", compute.address)
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["model_type"] == "mixtral"

    stats = run_cli("stats", "--daemon", daemon.address, "--predictor", predictor.address, "--json")
    assert stats.returncode == 0, stats.stderr
    report = json.loads(stats.stdout)
    assert {t["tier"] for t in report["daemon"]["tiers"]} == {"TIER_DEVICE", "TIER_HOST", "TIER_STORE"}
    assert report["predictor"]["store_kind"] == "embedded"
    text = run_cli("stats", "--daemon", daemon.address, "--predictor", predictor.address)
    assert text.returncode == 0
    assert f"daemon ({daemon.address}):" in text.stdout and "store_io_mode:" in text.stdout
    assert f"predictor ({predictor.address}):" in text.stdout and "eamc_entries:" in text.stdout


def test_a_request_the_service_refuses_exits_1_with_its_status(stack):
    _, _, compute = stack
    out = run_cli("generate", "--address", compute.address, "--max-new-tokens", "0", PROMPT)
    assert out.returncode == 1
    assert "INVALID_ARGUMENT" in out.stderr and "max_new_tokens 0 is out of range" in out.stderr


def test_usage_errors_and_unreachable_services_exit_2():
    nowhere = f"127.0.0.1:{free_port()}"
    out = run_cli("generate", "--address", nowhere, "--timeout-s", "3", PROMPT)
    assert out.returncode == 2 and f"Generate at {nowhere}: UNAVAILABLE" in out.stderr
    both = run_cli("generate", "--token-ids", "1,2", PROMPT)
    assert (
        both.returncode == 2 and "give a prompt, --token-ids or --message (exactly one kind)" in both.stderr
    )
    bad_message = run_cli("generate", "--message", "no-colon")
    assert bad_message.returncode == 2 and "a message is ROLE:CONTENT" in bad_message.stderr
    bad_ids = run_cli("generate", "--token-ids", "1,x")
    assert bad_ids.returncode == 2 and "token ids must be integers" in bad_ids.stderr
    stats = run_cli("stats", "--daemon", "", "--predictor", "")
    assert stats.returncode == 2 and "nothing to ask" in stats.stderr
    down = run_cli(
        "stats", "--daemon", "unix:///nonexistent/daemon.sock", "--predictor", "", "--timeout-s", "2"
    )
    assert (
        down.returncode == 2
        and "GetStats of the daemon at unix:///nonexistent/daemon.sock: UNAVAILABLE" in down.stderr
    )
