"""One request, one meaning on every chat pool: through a real router process and sim workers
speaking vLLM's and SGLang's wires, driven by the openai SDK.

- ``max_output_tokens`` above the room the prompt leaves is clamped to it, as the engines' own
  Responses servers do (vLLM clamps below its context itself; SGLang answers 400 with the prompt's
  count and the router sends the call again capped): a short prompt with ``max_output_tokens:
  100000`` completes, foreground, streamed and in the background, and a long answer is cut by the
  context (``incomplete``), never failed.
- ``truncation: "auto"`` drops turns only when the prompt alone does not fit: a max_tokens error is
  not a prompt overflow.
- The 400 for an ``mcp`` tool whose ``server_url`` is not allowed names that tool's index.
- Under ``tool_choice: "auto"`` the sim calls a declared function its last user message mentions.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import openai
import pytest

from harness import RouterProcess, sim_pool_toml, start_router

pytestmark = pytest.mark.e2e

CONTEXT = 600
MODELS = {"vl": "vllm", "sg": "sglang"}  # public model name -> the sim's engine


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    body = ""
    for name, engine in MODELS.items():
        body += sim_pool_toml(name=engine, replicas=1,
                              extra_args=f'["--engine", "{engine}", "--max-model-len", "{CONTEXT}"]')
        body += f'\n[[models]]\nname = "{name}"\npool = "{engine}"\n'
    proc = start_router(tmp_path_factory.mktemp("parity"), body)
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url + "/v1", api_key="unused", max_retries=0)


def wait_done(client: openai.OpenAI, response_id: str) -> openai.types.responses.Response:
    deadline = time.monotonic() + 30
    while True:
        response = client.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return response
        time.sleep(0.05)


# -- max_output_tokens above the room left ----------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
def test_huge_max_output_tokens_completes(client: openai.OpenAI, model: str) -> None:
    response = client.responses.create(model=model, input="Hello there", max_output_tokens=100000)
    assert response.status == "completed" and response.output_text and response.error is None
    assert response.max_output_tokens == 100000  # echoed as asked; only the engine's call is clamped
    stored = client.responses.retrieve(response.id)
    assert stored.status == "completed" and stored.output_text == response.output_text


@pytest.mark.parametrize("model", MODELS)
def test_huge_max_output_tokens_streamed(client: openai.OpenAI, model: str) -> None:
    events = list(client.responses.create(model=model, input="Stream this", max_output_tokens=100000, stream=True))
    assert [e.type for e in events][-1] == "response.completed"
    final = events[-1].response  # type: ignore[union-attr]
    assert final.status == "completed" and final.output_text
    assert client.responses.retrieve(final.id).status == "completed"


@pytest.mark.parametrize("model", MODELS)
def test_huge_max_output_tokens_in_the_background(client: openai.OpenAI, model: str) -> None:
    queued = client.responses.create(model=model, input="Later, please", max_output_tokens=100000, background=True)
    assert queued.status in ("queued", "in_progress")
    done = wait_done(client, queued.id)
    assert done.status == "completed" and done.error is None and done.output_text


@pytest.mark.parametrize("model", MODELS)
def test_the_context_caps_a_long_answer(client: openai.OpenAI, model: str) -> None:
    """An answer longer than the room: cut where the context ends, as the engine's own server cuts it."""
    response = client.responses.create(model=model, input="[sim:tokens=5000] go on", max_output_tokens=100000)
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    usage = response.usage
    assert usage is not None and usage.output_tokens > 0
    # vLLM fills the context; SGLang keeps prompt + answer below it.
    assert usage.input_tokens + usage.output_tokens == (CONTEXT if model == "vl" else CONTEXT - 1)
    assert client.responses.retrieve(response.id).status == "incomplete"


@pytest.mark.parametrize("model", MODELS)
def test_a_budget_error_never_truncates_the_history(client: openai.OpenAI, model: str) -> None:
    """truncation "auto" with a max_output_tokens above the room: the history stays whole."""
    previous = None
    for turn in range(3):
        response = client.responses.create(model=model, input=f"turn {turn} [sim:tokens=3]", previous_response_id=previous)
        previous = response.id
    echo = client.responses.create(model=model, input="what do you see [sim:echo]", previous_response_id=previous,
                                   truncation="auto", max_output_tokens=100000)
    assert echo.status == "completed" and echo.truncation == "auto"
    seen = [m["content"] for m in json.loads(echo.output_text) if m["role"] == "user"]
    assert seen == ["turn 0 [sim:tokens=3]", "turn 1 [sim:tokens=3]", "turn 2 [sim:tokens=3]", "what do you see [sim:echo]"]


@pytest.mark.parametrize("model", MODELS)
def test_a_prompt_overflow_still_truncates(client: openai.OpenAI, model: str) -> None:
    """The prompt alone past the context: the oldest turns go (truncation "auto"), or a 400 names the input."""
    filler = " ".join(["word"] * 150)
    previous = None
    for turn in range(4):  # 4 x ~160 tokens: past the 600-token context at the fourth
        response = client.responses.create(model=model, input=f"turn {turn} {filler} [sim:tokens=2]",
                                           previous_response_id=previous, truncation="auto", max_output_tokens=100000)
        assert response.status == "completed" and response.usage is not None
        assert response.usage.input_tokens < CONTEXT
        previous = response.id
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=model, input="again", previous_response_id=previous, max_output_tokens=100000)
    assert err.value.status_code == 400
    assert err.value.body["code"] == "context_length_exceeded" and err.value.body["param"] == "input"  # type: ignore[index]


def test_the_logs_name_the_cap(router: RouterProcess, client: openai.OpenAI) -> None:
    """SGLang's 400 named the room; the router capped max_tokens to it (the vLLM pool needed no second call)."""
    for model in MODELS:
        assert client.responses.create(model=model, input="Hi", max_output_tokens=100000).status == "completed"
    log = router.log()
    assert "pool sglang: max_tokens capped to the" in log
    assert "pool vllm: max_tokens capped" not in log


# -- the 400 for an mcp server_url names the tool's own index ----------------------------------

FUNCTION = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}


@pytest.mark.parametrize(("before", "index"), [([], 0), ([FUNCTION], 1),
                                               ([FUNCTION, {"type": "web_search"}, {"type": "custom", "name": "c"}], 3)])
def test_disallowed_mcp_server_url_names_its_index(client: openai.OpenAI, before: list[dict], index: int) -> None:
    mcp = {"type": "mcp", "server_label": "calc", "server_url": "http://169.254.169.254/mcp", "require_approval": "never"}
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="vl", input="hi", tools=[*before, mcp])  # type: ignore[list-item]
    body = err.value.body
    assert err.value.status_code == 400 and isinstance(body, dict)
    assert body["param"] == f"tools[{index}].server_url" and body["code"] == "mcp_server_not_allowed"
    assert body["type"] == "invalid_request_error"


def test_unknown_mcp_label_names_its_index(client: openai.OpenAI) -> None:
    """No server_url and no configured server of that label: the same index, on the second mcp tool too."""
    allowed_first = {"type": "mcp", "server_label": "a", "server_url": "http://169.254.169.254/mcp"}
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="vl", input="hi", tools=[FUNCTION, {"type": "mcp", "server_label": "nowhere"},  # type: ignore[list-item]
                                                                allowed_first])
    assert isinstance(err.value.body, dict) and err.value.body["param"] == "tools[1].server_url"


# -- the sim calls a function a plain prompt mentions ------------------------------------------

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "required": ["city", "unit"], "additionalProperties": False,
                          "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}}},
           "strict": True}


@pytest.mark.parametrize("model", MODELS)
def test_a_plain_prompt_gets_a_tool_round_trip(client: openai.OpenAI, model: str) -> None:
    first = client.responses.create(model=model, input="What's the weather in Paris?", tools=[WEATHER, FUNCTION])
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    args = json.loads(call.arguments)
    assert set(args) == {"city", "unit"} and isinstance(args["city"], str) and args["unit"] in ("c", "f")
    second = client.responses.create(model=model, previous_response_id=first.id, tools=[WEATHER, FUNCTION],
                                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert second.status == "completed" and second.output_text == "tool said: sunny"
    plain = client.responses.create(model=model, input="Hello there!", tools=[WEATHER, FUNCTION])
    assert [item.type for item in plain.output] == ["message"] and plain.output_text
