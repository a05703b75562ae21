"""Engine options on harmony pools (gpt-oss: the router renders the tokens and calls the engine's
token-level generate), through a real router process, sim workers speaking vLLM's generate, vLLM's
/v1/completions fallback and SGLang's /generate, and the openai SDK (options in ``extra_body``).

- Every option that applies reaches the generate body under its engine's name and where
  router/dialects/engine_options.py puts it (``[sim:echo=request]``: the sim answers with the body it
  got, without the prompt's ids); ``stop_token_ids`` come after harmony's own stop ids, which stay;
  SGLang's ``extra_key`` is ``cache_salt`` then ``extra_key``; a ``request_id`` replaces the router's.
- ``seed`` draws the words; ``stop`` ends the answer before the stop string (through it with
  ``include_stop_str_in_output``), ``completed``, streamed or not, also when the stop string spans
  tokens; a client's stop id ends it before that token.
- ``session_id``, ``chat_template_kwargs`` and ``skip_special_tokens`` (and the other engine's own
  option) are a 400 ``unsupported_parameter`` naming the field, the model and the pool.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from harness import RouterProcess, start_router
from router.dialects.engine_options import GENERATE_OPTIONS
from tests.e2e.test_e2e_harmony import harmony_pool

pytestmark = pytest.mark.e2e

ECHO = "Show me [sim:echo=request]"
STORY = "Tell me a story [sim:reason=0] [sim:tokens=16]"  # no analysis: every word is the answer's
HARMONY_STOPS = [200002, 200012]  # <|return|>, <|call|>: the router's own stop ids
# Every option a harmony pool on either engine takes, with a value both engines' models accept.
OPTIONS: dict[str, Any] = {
    "seed": 11, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "presence_penalty": 0.5,
    "frequency_penalty": -0.5, "logit_bias": {"42": -100.0}, "priority": 3, "cache_salt": "salt-",
    "request_id": "my-request-1", "stop_token_ids": [7, 9], "ignore_eos": False, "include_stop_str_in_output": False,
}
OWN = {"vllm": {"vllm_xargs": {"mode": "x"}}, "sglang": {"extra_key": "tenant-a"}}
MODELS = {"vllm": "oss-vllm", "sglang": "oss-sglang"}


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, harmony_vocab: Path) -> Iterator[RouterProcess]:
    body = (
        f'[harmony]\nvocab_dir = "{harmony_vocab}"\n'
        + harmony_pool("hv", "vllm", harmony_vocab) + harmony_pool("hs", "sglang", harmony_vocab)
        + harmony_pool("hc", "vllm", harmony_vocab, scale_out=False)
        + '\n[[models]]\nname = "oss-vllm"\npool = "hv"\n[[models]]\nname = "oss-sglang"\npool = "hs"\n'
        + '[[models]]\nname = "oss-completions"\npool = "hc"\n'
    )
    proc = start_router(tmp_path_factory.mktemp("harmony-engine-options"), body)
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)


def echoed(response: Any) -> dict[str, Any]:
    """The generate (or completions) body the worker got, without the prompt's ids."""
    assert response.status == "completed", response
    body: dict[str, Any] = json.loads(response.output_text)
    return body


# -- the generate wires ---------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_every_option_reaches_the_generate_body_where_the_table_says(client: openai.OpenAI, engine: str) -> None:
    sent = {**OPTIONS, **OWN[engine]}
    body = echoed(client.responses.create(model=MODELS[engine], input=ECHO, extra_body=sent))
    sampling = body["sampling_params"]
    for name, value in sent.items():
        where, key = GENERATE_OPTIONS[name][engine]
        if where == "router":
            continue
        got = (sampling if where == "sampling" else body)[key]
        if name == "stop_token_ids":
            assert got == HARMONY_STOPS + value, got  # merged: harmony's own ids stay first
        elif name in ("cache_salt", "extra_key") and engine == "sglang":
            assert got == "salt-tenant-a", got  # SGLang's own server joins them so
        else:
            assert got == value, (name, got)
    if engine == "vllm":  # the names, spelled out: a wrong table fails here too
        assert sampling["seed"] == 11 and sampling["extra_args"] == {"mode": "x"} and body["request_id"] == "my-request-1"
        assert body["cache_salt"] == "salt-" and body["priority"] == 3 and "vllm_xargs" not in sampling
        assert sampling["include_stop_str_in_output"] is False and sampling["skip_special_tokens"] is False
    else:
        assert sampling["sampling_seed"] == 11 and "seed" not in sampling and body["rid"] == "my-request-1"
        assert body["priority"] == 3 and "cache_salt" not in body and sampling["no_stop_trim"] is True
        assert "include_stop_str_in_output" not in sampling and "request_id" not in body


def test_the_completions_fallback_takes_them_by_the_requests_names(client: openai.OpenAI) -> None:
    sent = {**OPTIONS, **OWN["vllm"]}
    body = echoed(client.responses.create(model="oss-completions", input=ECHO, extra_body=sent))
    assert "sampling_params" not in body and "extra_args" not in body
    for name, value in sent.items():
        assert body[name] == (HARMONY_STOPS + value if name == "stop_token_ids" else value), name


def test_without_options_the_body_is_as_before(client: openai.OpenAI) -> None:
    body = echoed(client.responses.create(model="oss-vllm", input=ECHO))
    assert body["sampling_params"]["stop_token_ids"] == HARMONY_STOPS and "seed" not in body["sampling_params"]
    assert body["request_id"] and body["request_id"] != "my-request-1" and "priority" not in body


def test_streamed_calls_get_them_too(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model="oss-sglang", input=ECHO, stream=True, extra_body={"top_k": 5, "seed": 3}))
    assert events[-1].type == "response.completed"
    body = echoed(events[-1].response)  # type: ignore[union-attr]
    assert body["sampling_params"]["top_k"] == 5 and body["sampling_params"]["sampling_seed"] == 3 and body["stream"] is True


# -- refused: what cannot apply where the router renders and reads the tokens ------------------


@pytest.mark.parametrize(("model", "pool", "field", "value", "why"), [
    ("oss-vllm", "hv", "chat_template_kwargs", {"x": 1}, "no chat template"),
    ("oss-sglang", "hs", "chat_template_kwargs", {"x": 1}, "no chat template"),
    ("oss-vllm", "hv", "skip_special_tokens", True, "special tokens"),
    ("oss-sglang", "hs", "skip_special_tokens", False, "special tokens"),
    ("oss-vllm", "hv", "session_id", "s-1", "session id"),
    ("oss-sglang", "hs", "session_id", "s-1", "session id"),
    ("oss-vllm", "hv", "extra_key", "k", "does not take it"),  # SGLang's
    ("oss-completions", "hc", "extra_key", "k", "does not take it"),
    ("oss-sglang", "hs", "vllm_xargs", {"a": 1}, "does not take it"),  # vLLM's
])
def test_an_option_that_cannot_apply_is_a_400_naming_field_and_pool(
        client: openai.OpenAI, model: str, pool: str, field: str, value: Any, why: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model, input="hi", extra_body={"seed": 1, field: value})
    error: dict[str, Any] = caught.value.body  # type: ignore[assignment]
    assert error["code"] == "unsupported_parameter" and error["param"] == field and error["type"] == "invalid_request_error"
    message = error["message"]
    assert f"'{field}'" in message and f"pool '{pool}'" in message and f"'{model}'" in message and why in message


# -- their effect: seed, stop, stop ids -----------------------------------------------------------


@pytest.mark.parametrize("model", ["oss-vllm", "oss-sglang", "oss-completions"])
def test_seed_draws_the_words(client: openai.OpenAI, model: str) -> None:
    def text(**extra: Any) -> str:
        return client.responses.create(model=model, input="Tell me something [sim:tokens=12]", extra_body=extra).output_text

    plain, seven, seven_again, eight = text(), text(seed=7), text(seed=7), text(seed=8)
    assert seven == seven_again
    assert len({plain, seven, eight}) == 3


def _streamed(client: openai.OpenAI, model: str, **extra: Any) -> tuple[str, Any]:
    events = list(client.responses.create(model=model, input=STORY, stream=True, extra_body=extra))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert events[-1].type == "response.completed"
    return deltas, events[-1].response  # type: ignore[union-attr]


@pytest.mark.parametrize("model", ["oss-vllm", "oss-sglang", "oss-completions"])
@pytest.mark.parametrize("spans", [False, True], ids=["word", "across-tokens"])
def test_stop_ends_the_answer_before_the_stop_string(client: openai.OpenAI, model: str, spans: bool) -> None:
    full = client.responses.create(model=model, input=STORY).output_text
    at = full.index(" " + full.split(" ")[5])
    stop = full[at - 2:at + 3] if spans else full[at:at + len(full.split(" ")[5]) + 1]
    expected = full[:full.index(stop)]
    cut = client.responses.create(model=model, input=STORY, extra_body={"stop": [stop, "never-there"]})
    assert cut.output_text == expected and cut.status == "completed"
    assert cut.usage is not None and cut.usage.output_tokens < 16
    deltas, final = _streamed(client, model, stop=stop)
    assert deltas == expected and final.output_text == expected and final.status == "completed"


@pytest.mark.parametrize("model", ["oss-vllm", "oss-sglang"])
def test_stop_string_kept_when_asked(client: openai.OpenAI, model: str) -> None:
    full = client.responses.create(model=model, input=STORY).output_text
    stop = " " + full.split(" ")[4]
    kept = client.responses.create(model=model, input=STORY, extra_body={"stop": stop, "include_stop_str_in_output": True})
    assert kept.output_text == full[:full.index(stop) + len(stop)] and kept.status == "completed"
    deltas, final = _streamed(client, model, stop=stop, include_stop_str_in_output=True)
    assert deltas == kept.output_text == final.output_text


@pytest.mark.parametrize("model", ["oss-vllm", "oss-sglang"])
def test_a_clients_stop_id_ends_the_answer_before_it(client: openai.OpenAI, model: str, enc: Any) -> None:
    full = client.responses.create(model=model, input=STORY).output_text
    ids = enc.encode(full, allowed_special="all")
    stop_id = ids[5]
    expected = enc.decode(ids[:ids.index(stop_id)])
    cut = client.responses.create(model=model, input=STORY, extra_body={"stop_token_ids": [stop_id]})
    assert cut.output_text == expected and cut.status == "completed"
    deltas, final = _streamed(client, model, stop_token_ids=[stop_id])
    assert deltas == expected and final.output_text == expected
