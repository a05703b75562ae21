"""``/v1/responses/compact`` and ``/v1/responses/input_tokens`` through the openai SDK, against sim workers."""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from harness import RouterProcess, sim_pool_toml, start_router
from router.protocol.sealing import SUMMARY_PREFIX
from router.turns.compaction import SUMMARY_PROMPT
from tests.e2e.test_e2e_harmony import harmony_pool
from tests.support.streamrules import check_stream

pytestmark = pytest.mark.e2e

CHAT = "sim-chat"
HARMONY = "oss-sim"
KEY_ALICE = "sk-compaction-alice-1"
KEY_BOB = "sk-compaction-bob-22"
SEAL_OLD = base64.b64encode(os.urandom(32)).decode()
SEAL_NEW = base64.b64encode(os.urandom(32)).decode()
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}

def config(vocab: Path, keys: list[str]) -> str:
    return (
        f'[harmony]\nvocab_dir = "{vocab}"\n'
        + f"[sealing]\nkeys = {json.dumps(keys)}\n"
        + f'[auth]\nkeys = [{{ name = "alice", key = "{KEY_ALICE}" }}, {{ name = "bob", key = "{KEY_BOB}" }}]\n'
        + sim_pool_toml(replicas=2)
        + harmony_pool("oss", "vllm", vocab)
        + f'\n[[models]]\nname = "{CHAT}"\npool = "sim"\n[[models]]\nname = "{HARMONY}"\npool = "oss"\n'
    )


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, harmony_vocab: Path) -> Iterator[RouterProcess]:
    proc = start_router(tmp_path_factory.mktemp("compaction"), config(harmony_vocab, [SEAL_OLD]))
    yield proc
    assert proc.stop() == 0, proc.log()


def sdk(router: RouterProcess, key: str = KEY_ALICE) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url + "/v1", api_key=key, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def client(router: RouterProcess) -> openai.OpenAI:
    return sdk(router)


@pytest.fixture(scope="module")
def http(router: RouterProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=router.base_url, timeout=30, headers={"authorization": f"Bearer {KEY_ALICE}"}) as c:
        yield c


def as_input(output: list[Any]) -> list[dict[str, Any]]:
    """A compacted output, sent back as input the way clients do."""
    return [item.model_dump(exclude_none=True, warnings=False) for item in output]


def assert_error(resp: httpx.Response, status: int, *, param: str | None = None, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    if param is not None:
        assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


@pytest.fixture(scope="module")
def compacted(client: openai.OpenAI) -> Any:
    first = client.responses.create(model=CHAT, input="my name is Ada and I like rain [sim:tokens=4]")
    return client.responses.compact(model=CHAT, previous_response_id=first.id, input="what is my name?",
                                    instructions="be brief")


# -- compact ------------------------------------------------------------------------------


def test_compact_returns_the_user_messages_and_a_sealed_summary(client: openai.OpenAI, compacted: Any) -> None:
    """As OpenAI's CompactedResponse.output: every user message, then one compaction item."""
    assert compacted.object == "response.compaction" and compacted.id.startswith("cmp_")
    assert isinstance(compacted.created_at, int)
    *kept, item = compacted.output
    assert all(k.type == "message" and k.role == "user" for k in kept)
    assert [k.content[0].text for k in kept] == ["my name is Ada and I like rain [sim:tokens=4]", "what is my name?"]
    assert item.type == "compaction" and item.id.startswith("cmpi_")
    assert "Ada" not in item.encrypted_content and len(item.encrypted_content) > 40
    usage = compacted.usage
    assert usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_the_whole_conversation_reaches_the_summarizer(client: openai.OpenAI) -> None:
    first = client.responses.create(model=CHAT, input="one two three [sim:tokens=4]")
    counted = client.responses.input_tokens.count(model=CHAT, previous_response_id=first.id, input="four five",
                                                  instructions="be brief")
    compacted = client.responses.compact(model=CHAT, previous_response_id=first.id, input="four five",
                                         instructions="be brief")
    # the sim counts 3 + words per message: the prompt is the conversation plus the summarization request
    assert compacted.usage.input_tokens == counted.input_tokens + 3 + len(SUMMARY_PROMPT.split())


def test_compacted_output_continues_the_conversation(client: openai.OpenAI, compacted: Any) -> None:
    follow = client.responses.create(model=CHAT, input=[*as_input(compacted.output),
                                                        {"role": "user", "content": "so? [sim:echo]"}])
    messages = json.loads(follow.output_text)
    assert messages[0]["role"] == "system"
    system = messages[0]["content"]
    assert system.startswith(SUMMARY_PREFIX)  # the compacted conversation's instructions are not carried over
    summary = system.removeprefix(SUMMARY_PREFIX)
    assert summary.strip()
    assert [m["content"] for m in messages[1:]] == ["my name is Ada and I like rain [sim:tokens=4]", "what is my name?",
                                                    "so? [sim:echo]"]
    assert compacted.output[-1].encrypted_content not in follow.output_text
    # stored as sent, and opened again when the chain goes on
    again = client.responses.create(model=CHAT, previous_response_id=follow.id, input="more [sim:echo]")
    assert SUMMARY_PREFIX + summary in json.loads(again.output_text)[0]["content"]


def test_compaction_of_a_compacted_conversation(client: openai.OpenAI, compacted: Any) -> None:
    twice = client.responses.compact(model=CHAT, input=[*as_input(compacted.output), {"role": "user", "content": "next"}])
    *kept, item = twice.output
    assert [k.content[0].text for k in kept][-1] == "next" and item.type == "compaction"
    assert item.encrypted_content != compacted.output[-1].encrypted_content


def tampered(blob: str) -> str:
    raw = bytearray(base64.urlsafe_b64decode(blob + "=" * (-len(blob) % 4)))
    raw[len(raw) // 2] ^= 0x20
    return base64.urlsafe_b64encode(bytes(raw)).rstrip(b"=").decode()


@pytest.mark.parametrize("path", ["/v1/responses/compact", "/v1/responses/input_tokens",
                                  "/v1/responses"])
def test_tampered_compaction_is_a_400(http: httpx.Client, compacted: Any, path: str) -> None:
    items = as_input(compacted.output)
    items[-1]["encrypted_content"] = tampered(items[-1]["encrypted_content"])
    resp = http.post(path, json={"model": CHAT, "input": [{"role": "user", "content": "hi"}, *items]})
    where = f"input[{len(items)}]"  # the compaction, after "hi" and the kept user messages
    error = assert_error(resp, 400, param=f"{where}.encrypted_content", code="invalid_encrypted_content")
    assert where in error["message"]


@pytest.mark.parametrize("path", ["/v1/responses/compact", "/v1/responses"])
def test_another_owners_compaction_is_a_400(router: RouterProcess, compacted: Any, path: str) -> None:
    with httpx.Client(base_url=router.base_url, timeout=30, headers={"authorization": f"Bearer {KEY_BOB}"}) as bob:
        resp = bob.post(path, json={"model": CHAT, "input": as_input(compacted.output)})
    assert_error(resp, 400, param=f"input[{len(compacted.output) - 1}].encrypted_content", code="invalid_encrypted_content")


@pytest.mark.parametrize("path", ["/v1/responses/compact", "/v1/responses/input_tokens"])
def test_model_is_required(http: httpx.Client, path: str) -> None:
    assert_error(http.post(path, json={"input": "hi"}), 400, param="model", code="missing_required_parameter")
    assert_error(http.post(path, json={"model": "nope", "input": "hi"}), 404, param="model", code="model_not_found")
    assert_error(http.post(path, json={"model": CHAT, "input": "hi", "surprise": 1}), 400, param="surprise",
                 code="unknown_parameter")
    assert_error(http.post(path, json={"model": CHAT}), 400, code="empty_input")


def test_compact_errors_through_the_sdk(router: RouterProcess, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.post("/responses/compact", body={"input": "hi"}, cast_to=object)
    with pytest.raises(openai.NotFoundError):
        client.responses.compact(model=CHAT, previous_response_id="resp_missing")
    with pytest.raises(openai.AuthenticationError):
        sdk(router, "sk-nobody-0000").responses.compact(model=CHAT, input="hi")


# -- input_tokens ---------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    {"input": "hello there, how are you today?"},
    {"input": [{"role": "user", "content": "weather in Paris?"}], "instructions": "You are terse.", "tools": [WEATHER]},
    {"input": [{"role": "developer", "content": "use metric"}, {"role": "user", "content": "a b c d e f"}]},
])
@pytest.mark.parametrize("model", [CHAT, HARMONY])
def test_input_tokens_equal_what_the_worker_reports(client: openai.OpenAI, model: str, kwargs: dict) -> None:
    counted = client.responses.input_tokens.count(model=model, **kwargs)
    assert counted.object == "response.input_tokens"
    created = client.responses.create(model=model, max_output_tokens=16, **kwargs)
    assert counted.input_tokens == created.usage.input_tokens > 0
    assert client.responses.input_tokens.count(model=model, **kwargs).input_tokens == counted.input_tokens


@pytest.mark.parametrize("model", [CHAT, HARMONY])
def test_input_tokens_of_a_chain(client: openai.OpenAI, model: str) -> None:
    first = client.responses.create(model=model, input="remember the number 7", max_output_tokens=16)
    counted = client.responses.input_tokens.count(model=model, previous_response_id=first.id, input="which number?")
    second = client.responses.create(model=model, previous_response_id=first.id, input="which number?",
                                     max_output_tokens=16)
    assert counted.input_tokens == second.usage.input_tokens
    # model is optional (as the SDK types it) when continuing: the previous response's, then.
    assert client.responses.input_tokens.count(previous_response_id=first.id, input="which number?").input_tokens \
        == counted.input_tokens
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.input_tokens.count(previous_response_id="resp_missing", input="x")
    assert err.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.input_tokens.count(input="x")
    assert err.value.body["param"] == "model"


def test_input_tokens_count_the_summary(client: openai.OpenAI, compacted: Any) -> None:
    bare = client.responses.input_tokens.count(model=CHAT, input=as_input(compacted.output)[:1])
    with_summary = client.responses.input_tokens.count(model=CHAT, input=as_input(compacted.output))
    assert with_summary.input_tokens > bare.input_tokens + len(SUMMARY_PREFIX.split())


# -- keys survive a restart and rotate ------------------------------------------------------


def test_rotated_keys_open_old_blobs(tmp_path: Path, harmony_vocab: Path, compacted: Any) -> None:
    """A new router with [new, old] keys opens what the old one sealed; its own blobs need the new key."""
    rotated = start_router(tmp_path / "rotated", config(harmony_vocab, [SEAL_NEW, SEAL_OLD]))
    try:
        client = sdk(rotated)
        counted = client.responses.input_tokens.count(model=CHAT, input=as_input(compacted.output))
        assert counted.input_tokens > 0
        fresh = client.responses.compact(model=CHAT, input=as_input(compacted.output))
    finally:
        assert rotated.stop() == 0, rotated.log()
    retired = start_router(tmp_path / "retired", config(harmony_vocab, [SEAL_OLD]))
    try:
        with httpx.Client(base_url=retired.base_url, timeout=30, headers={"authorization": f"Bearer {KEY_ALICE}"}) as h:
            resp = h.post("/v1/responses/input_tokens", json={"model": CHAT, "input": as_input(fresh.output)})
        assert_error(resp, 400, param=f"input[{len(fresh.output) - 1}].encrypted_content")
    finally:
        assert retired.stop() == 0, retired.log()


# -- automatic compaction (context_management) ---------------------------------------


def test_context_management_compacts_past_the_threshold(client: openai.OpenAI) -> None:
    cm = [{"type": "compaction", "compact_threshold": 60}]
    previous = None
    compacted_at = None
    for turn in range(8):
        response = client.responses.create(model=CHAT, input=f"turn {turn} [sim:tokens=6]", previous_response_id=previous,
                                           context_management=cm)
        assert response.status == "completed"
        if response.output[0].type == "compaction":
            compacted_at = turn
            assert response.output[0].encrypted_content and response.output[1].type == "message"
            break
        previous = response.id
    assert compacted_at is not None and compacted_at >= 1, "the prompt never passed 60 tokens"
    # The next turn continues from the summary: the older turns are no longer in the prompt.
    after = client.responses.create(model=CHAT, input="go on [sim:echo]", previous_response_id=response.id,
                                    context_management=[{"type": "compaction", "compact_threshold": 100_000}])
    messages = json.loads(after.output_text)
    assert messages[0]["role"] == "system" and "Summary of the earlier conversation" in messages[0]["content"]
    users = [m["content"] for m in messages if m["role"] == "user"]
    assert users == [f"turn {compacted_at} [sim:tokens=6]", "go on [sim:echo]"]
    # The store still holds the whole chain.
    assert len(client.responses.input_items.list(response.id).data) == 1
    # Streamed: the compaction item comes first, whole, and the stream obeys the rules.
    events = [e.model_dump() for e in client.responses.create(
        model=CHAT, input="again [sim:tokens=3]", previous_response_id=after.id, stream=True,
        context_management=[{"type": "compaction", "compact_threshold": 10}])]
    final = check_stream(events)
    assert [i["type"] for i in final["output"]] == ["compaction", "message"]


def test_context_management_is_validated(http: httpx.Client) -> None:
    for cm, param in [([{"type": "compaction"}], "context_management[0].compact_threshold"),
                      ([{"type": "truncate", "compact_threshold": 5}], "context_management[0].type"),
                      ({"type": "compaction"}, "context_management")]:
        resp = http.post("/v1/responses", json={"model": CHAT, "input": "x", "context_management": cm})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
