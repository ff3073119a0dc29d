"""The HTTP API against a hostile client's bodies, and what the engine's limits answer through it:
lone surrogates and numbers of hundreds of digits are 400 naming the field (not 500 and a
traceback); an engine limit's refusal names its field as ``param``; a request without max_tokens
gets what fits the model's positions after its prompt; the model is named by its served name or
its store id.

The app is the real ``HttpApi``; behind it a scheduler stand-in prepares each request with a real
engine's ``RequestCheck`` (tiny Mixtral: 2048 positions, vocabulary 320, max_new_tokens_limit
4096 as the service's default) and answers one token whose text is the prepared max_new_tokens.
"""

from __future__ import annotations

import dataclasses

import pytest

from compute_svc.engine.generation import FinishReason, TokenEvent, TokenStats
from compute_svc.engine.requests import GenerationRequest
from compute_svc.engine.scheduler import _DONE, RequestHandle
from compute_svc.http.api import HttpApi, HttpLimits, error_of
from compute_svc.http.openai_schema import (
    ApiError,
    ServedModel,
    chat_request,
    completion_request,
    model_list,
    served_model,
)
from compute_svc.metrics import ComputeMetrics
from expertcache.errors import InvalidArgument
from tests.asgi import asgi_json

POSITIONS = 2048  # the tiny checkpoints' max_position_embeddings
SERVICE_LIMIT = 4096  # max_new_tokens_limit's default: above those positions
HUGE = 10**400  # a 401-digit integer: valid JSON, no float can hold it


def completion(**body):
    return completion_request({"model": "m", "prompt": "hi", **body}, max_new_tokens_limit=64, request_id="r")


def chat(**body):
    messages = body.pop("messages", [{"role": "user", "content": "hi"}])
    return chat_request({"model": "m", "messages": messages, **body}, max_new_tokens_limit=64, request_id="r")


def refused(build) -> ApiError:
    with pytest.raises(ApiError) as info:
        build()
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    return info.value


# -- the body's strings and numbers ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("build", "param"),
    [
        (lambda: completion(prompt="ab\ud800cd"), "prompt"),
        (lambda: completion(prompt=["ab\udfffcd"]), "prompt"),  # a batch of one
        (lambda: chat(messages=[{"role": "user", "content": "ab\ud800cd"}]), "messages[0].content"),
        (
            lambda: chat(
                messages=[
                    {"role": "system", "content": "x"},
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "\ud800"}],
                    },
                ]
            ),
            "messages[1].content[1]",
        ),
        (lambda: chat(messages=[{"role": "us\udc00er", "content": "hi"}]), "messages[0].role"),
        (lambda: completion(stop=["ok", "st\ud800op"]), "stop"),
        (lambda: completion(model="m\ud800"), "model"),
    ],
)
def test_a_lone_surrogate_is_400_naming_the_field(build, param):
    error = refused(build)
    assert error.param == param
    assert f"'{param}' is not valid Unicode: it holds a lone surrogate" in error.message


@pytest.mark.parametrize(
    ("build", "param"),
    [
        (lambda: completion(temperature=HUGE), "temperature"),
        (lambda: completion(temperature=-HUGE), "temperature"),
        (lambda: completion(top_p=HUGE), "top_p"),
        (lambda: completion(presence_penalty=HUGE), "presence_penalty"),
        (lambda: completion(frequency_penalty=-HUGE), "frequency_penalty"),
        (lambda: completion(max_tokens=HUGE), "max_tokens"),
        (lambda: completion(seed=HUGE), "seed"),
        (lambda: completion(logprobs=HUGE), "logprobs"),
        (lambda: chat(max_completion_tokens=HUGE), "max_completion_tokens"),
        (lambda: chat(top_logprobs=HUGE), "top_logprobs"),
    ],
)
def test_a_number_of_hundreds_of_digits_is_400_out_of_range(build, param):
    error = refused(build)
    assert error.param == param and "is out of range" in error.message
    assert len(error.message) < 200  # the value is shortened, not written out in full


def test_a_request_without_max_tokens_asks_for_a_ceiling_an_explicit_one_an_exact_count():
    assert (chat().generation.max_new_tokens, chat().generation.fit_max_new_tokens) == (64, True)
    assert (completion().generation.max_new_tokens, completion().generation.fit_max_new_tokens) == (16, True)
    for explicit in (chat(max_tokens=5), chat(max_completion_tokens=5), completion(max_tokens=5)):
        assert (explicit.generation.max_new_tokens, explicit.generation.fit_max_new_tokens) == (5, False)


# -- the model's name ------------------------------------------------------------------------------
def test_the_served_name_and_its_alias_are_the_model_other_names_are_not():
    served = ServedModel("Mixtral-8x7B-v0.1", frozenset({"ab" * 32}))
    assert served.named_by("Mixtral-8x7B-v0.1") and served.named_by("ab" * 32)
    assert not served.named_by("gpt-4") and not served.named_by("")
    assert model_list(served.name, 7)["data"] == [
        {"id": "Mixtral-8x7B-v0.1", "object": "model", "created": 7, "owned_by": "expertcache"}
    ]


@pytest.mark.parametrize(
    ("configured", "path", "name"),
    [
        ("", "/models/Mixtral-8x7B-Instruct-v0.1", "Mixtral-8x7B-Instruct-v0.1"),
        ("", "/models/Mixtral-8x7B-Instruct-v0.1/", "Mixtral-8x7B-Instruct-v0.1"),
        (
            "",
            "/root/.cache/huggingface/hub/models--mistralai--Mixtral-8x7B-v0.1/snapshots/41bd4c9e7e4f",
            "mistralai/Mixtral-8x7B-v0.1",
        ),
        ("my-model", "/models/Mixtral-8x7B-Instruct-v0.1", "my-model"),
        ("", None, "<model id>"),  # no path recorded: the store's model id
        ("", "/models/bad\udcff", "<model id>"),  # a directory named in bytes that are not UTF-8
    ],
)
def test_the_served_name_defaults_to_the_checkpoints(tiny_store, configured, path, name):
    manifest = tiny_store("mixtral").manifest
    source = {k: v for k, v in manifest.source.items() if k != "path"}
    if path is not None:
        source["path"] = path
    manifest = dataclasses.replace(manifest, source=source)
    served = served_model(configured, manifest)
    assert served.name == name.replace("<model id>", manifest.model_id)
    assert served.named_by(manifest.model_id)  # the store's model id is always an alias


def test_a_converted_store_records_its_checkpoints_directory(tiny_store):
    tiny = tiny_store("mixtral")
    assert tiny.manifest.checkpoint_name == tiny.checkpoint.name


# -- through the app, over a real engine's request check -----------------------------------------
class _Preparing:
    """The scheduler's side of a submit: the real ``prepare`` (limits, tokenising), then one
    token whose text is the prepared max_new_tokens."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.serving = True

    def submit(self, request: GenerationRequest, client: str | None = None) -> RequestHandle:
        prepared = self.engine.requests.prepare(request)
        handle = RequestHandle(prepared, lambda: None)
        count = prepared.request.max_new_tokens
        handle._put(
            TokenEvent(
                0, 1, str(count), 0.0, TokenStats(), FinishReason.LENGTH, len(prepared.prompt_ids), None
            )
        )
        handle._put(_DONE)
        return handle


@pytest.fixture(scope="module")
def api(local_engine):
    engine, _, tiny = local_engine("mixtral", limit=SERVICE_LIMIT)
    assert engine.requests.limits.max_total_tokens == POSITIONS
    app = HttpApi(
        _Preparing(engine),
        model=served_model("tiny-mixtral", tiny.manifest),
        limits=HttpLimits(
            max_body_bytes=1 << 20, max_requests=4, request_timeout_s=0, stream_stall_timeout_s=0
        ),
        metrics=ComputeMetrics(),
    )
    yield app, tiny
    app.close()


def post(api, path: str, **body) -> tuple[int, dict]:
    app, _ = api
    return asgi_json(app, "POST", path, {"model": "tiny-mixtral", **body})


def test_chat_without_max_tokens_gets_what_fits_after_its_prompt(api):
    status, answer = post(api, "/v1/chat/completions", messages=[{"role": "user", "content": "Hello there"}])
    assert status == 200, answer
    prompt = answer["usage"]["prompt_tokens"]
    assert int(answer["choices"][0]["message"]["content"]) == POSITIONS - prompt
    # A completion's default (16) fits as it is; near the end of the positions it is lowered.
    status, answer = post(api, "/v1/completions", prompt="Hello there")
    assert (status, answer["choices"][0]["text"]) == (200, "16")
    status, answer = post(api, "/v1/completions", prompt=[5] * (POSITIONS - 3))
    assert (status, answer["choices"][0]["text"]) == (200, "3")


def test_a_prompt_that_leaves_no_room_is_400_naming_why(api):
    status, answer = post(api, "/v1/completions", prompt=[5] * POSITIONS)
    assert status == 400 and answer["error"]["param"] == "prompt"
    assert (
        f"the prompt ({POSITIONS} tokens) leaves no room for a new token within {POSITIONS}"
        in (answer["error"]["message"])
    )


def test_an_explicit_max_tokens_that_does_not_fit_is_still_refused(api):
    status, answer = post(
        api, "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], max_tokens=POSITIONS
    )
    assert status == 400 and answer["error"]["param"] == "max_tokens"
    assert f"exceeds {POSITIONS} (max_total_tokens" in answer["error"]["message"]


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {"prompt": "hi", "max_tokens": 4, "stop": ["x" * 300]},
            "stop",
            "stop holds a string longer than 256",
        ),
        ({"prompt": [1, 320], "max_tokens": 4}, "prompt", "token_ids[1] = 320 is out of range [0, 320)"),
        ({"prompt": [1] * 2000, "max_tokens": 100}, "max_tokens", "= 2100 exceeds 2048 (max_total_tokens"),
        ({"prompt": [1] * 3000, "max_tokens": 1}, "prompt", "3000 ids; this service takes at most 2048"),
        ({"prompt": "ab\ud800cd", "max_tokens": 4}, "prompt", "'prompt' is not valid Unicode"),
        ({"prompt": "hi", "temperature": HUGE}, "temperature", "'temperature' "),
    ],
)
def test_a_refusal_names_its_field_as_param(api, body, param, message):
    status, answer = post(api, "/v1/completions", **body)
    assert status == 400 and answer["error"]["param"] == param, answer
    assert message in answer["error"]["message"]


def test_surrogates_in_a_chat_are_400_through_the_app(api):
    bad_part = [{"type": "text", "text": "fine"}, {"type": "text", "text": "\udfff"}]
    for content, param in (("ab\ud800cd", "messages[0].content"), (bad_part, "messages[0].content[1]")):
        status, answer = post(api, "/v1/chat/completions", messages=[{"role": "user", "content": content}])
        assert status == 400 and answer["error"]["param"] == param, answer


def test_the_model_is_its_served_name_or_its_store_id(api):
    app, tiny = api
    assert asgi_json(app, "GET", "/v1/models")[1]["data"][0]["id"] == "tiny-mixtral"
    for name in ("tiny-mixtral", tiny.manifest.model_id):
        status, answer = asgi_json(
            app, "POST", "/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 2}
        )
        assert status == 200 and answer["model"] == name
    status, answer = asgi_json(app, "POST", "/v1/completions", {"model": "gpt-4", "prompt": "hi"})
    assert status == 404 and "serves 'tiny-mixtral'" in answer["error"]["message"]


# -- the engine's check itself ---------------------------------------------------------------------
def test_the_engine_refuses_a_lone_surrogate_naming_the_field(api):
    check = api[0].scheduler.engine.requests
    with pytest.raises(InvalidArgument) as info:
        check.prepare(GenerationRequest(text="ab\ud800", max_new_tokens=2))
    assert info.value.field == "text" and "text is not valid Unicode" in str(info.value)


def test_engine_fields_are_written_as_the_bodys():
    def param(field):
        return error_of(InvalidArgument("x", field=field)).param

    assert (param("max_new_tokens"), param("token_ids"), param("text")) == ("max_tokens", "prompt", "prompt")
    assert (param("stop"), param("messages[2].role"), param(None)) == ("stop", "messages[2].role", None)
    assert error_of(InvalidArgument("x")).body()["error"]["param"] is None
