"""Wire ↔ domain conversion at the compute gRPC edge (compute_svc.server)."""

from __future__ import annotations

from moe.inference.v1 import inference_pb2

from compute_svc.engine.generation import FinishReason, ModelInfo, TokenEvent, TokenStats
from compute_svc.engine.requests import ChatMessage
from compute_svc.engine.sampling import SamplingParams
from compute_svc.server import event_to_pb, model_info_to_pb, request_from_pb


def test_request_from_pb_keeps_every_field():
    pb = inference_pb2.GenerateRequest(
        text="hi",
        token_ids=[1, 2],
        max_new_tokens=5,
        sampling=inference_pb2.SamplingParams(
            temperature=0.5, top_p=0.9, seed=11, top_k=40, repetition_penalty=1.25, presence_penalty=-0.5
        ),
        stop=["\n"],
        stop_token_ids=[7],
        ignore_eos=True,
        request_id="r1",
        messages=[inference_pb2.ChatMessage(role="user", content="hello")],
        logprobs=True,
    )
    req = request_from_pb(pb, deadline=123.0)
    assert (req.text, req.token_ids, req.max_new_tokens) == ("hi", (1, 2), 5)
    assert req.sampling == SamplingParams(
        temperature=0.5,
        top_p=pb.sampling.top_p,
        seed=11,
        top_k=40,
        repetition_penalty=1.25,
        presence_penalty=-0.5,
    )
    assert (req.stop, req.stop_token_ids, req.ignore_eos, req.request_id) == (("\n",), (7,), True, "r1")
    assert req.messages == (ChatMessage("user", "hello"),) and req.logprobs and req.deadline == 123.0
    # Unset penalty fields are 0 on the wire: read as "off" by the sampler.
    plain = request_from_pb(inference_pb2.GenerateRequest(text="x", max_new_tokens=1))
    assert plain.sampling.repetition_penalty == 0.0 and plain.deadline is None


def test_event_to_pb_sets_first_and_last_only_fields():
    first = event_to_pb(TokenEvent(0, 5, "a", 0.25, TokenStats(3, 1, 0.5), prompt_tokens=4))
    assert (first.index, first.token_id, first.text, first.prompt_tokens) == (0, 5, "a", 4)
    assert (first.cache.hits, first.cache.misses, first.cache.stall_s) == (3, 1, 0.5)
    assert first.finish_reason == inference_pb2.FINISH_REASON_UNSPECIFIED
    assert not first.HasField("logprob")
    assert event_to_pb(TokenEvent(0, 5, "a", 0.1, TokenStats(), logprob=-0.5)).logprob == -0.5
    last = event_to_pb(TokenEvent(1, 6, "", 0.1, TokenStats(), finish_reason=FinishReason.STOP))
    assert last.finish_reason == inference_pb2.FINISH_REASON_STOP and last.prompt_tokens == 0


def test_model_info_to_pb():
    info = ModelInfo("mixtral", 3, (0, 1, 2), 8, 2, 320, 4096, 98304, 6, True, 4096, "float32")
    pb = model_info_to_pb(info)
    assert list(pb.moe_layers) == [0, 1, 2] and pb.device_slots == 6 and pb.dtype == "float32"
    assert pb.has_tokenizer and pb.total_expert_bytes == 98304
