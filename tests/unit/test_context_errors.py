"""The engines' context-window errors read (backends/engines.py): a prompt too long by itself (truncation may
drop turns) against a max_tokens too large for the room it leaves (capped to that room, never truncated).

The messages are the engines' own words: vLLM 0.32 (renderers/params.py, v1/engine/input_processor.py, as
its error response renders a VLLMValidationError), vLLM 0.6-0.10 and earlier (serving_engine.py), vLLM 0.1x
renderers, SGLang (tokenizer_manager.py); the sim's (backends/sim/context.py) are checked against the same.
"""

from __future__ import annotations

import pytest

from backends.engines import is_context_overflow, output_room
from backends.sim.context import completion_budget
from backends.sim.script import SimError

BUDGET_ERRORS = [  # (message, the room it names)
    ("max_tokens=100000 cannot be greater than max_model_len=4096. Please request fewer output tokens. "
     "(parameter=max_tokens, value=100000)", 4096),
    ("max_completion_tokens=5000 cannot be greater than max_model_len=4096. Please request fewer output tokens.", 4096),
    ("max_tokens=20000cannot be greater than max_model_len=max_total_tokens=8192. Please request fewer output tokens.",
     8192),
    ("'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum context length is 4096 tokens "
     "and your request has 2778 input tokens (8000 > 4096 - 2778). None", 1318),
    ("This model's maximum context length is 1024 tokens. However, you requested 1200 tokens (1000 in the messages, "
     "200 in the completion). Please reduce the length of the messages or completion.", 24),
    ("You passed 10 input tokens and requested 5000 output tokens. However, the model's context length is only 4096 "
     "tokens, resulting in a maximum input length of -904 tokens. Please reduce the length of the input prompt.", 4086),
    ("You passed 9000 input characters and requested 4000 output tokens. However, the model's context length is only "
     "4096 tokens, resulting in a maximum input length of 96 tokens (at most 1536 characters). Please reduce the "
     "length of the input prompt.", 4096 - 563),  # at least 9000 / 16 characters a token
    ("Requested token count exceeds the model's maximum context length of 32768 tokens. You requested a total of "
     "34000 tokens: 30000 tokens from the input messages and 4000 tokens for the completion. Please reduce the number "
     "of tokens in the input messages or the completion to fit within the limit.", 2767),  # SGLang: below the context
]
PROMPT_ERRORS = [
    "This model's maximum context length is 4096 tokens. However, your prompt contains at least 4097 input tokens, "
    "which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. "
    "(parameter=input_tokens, value=4097)",
    "This model's maximum context length is 4096 tokens. However, your prompt contains 99999 characters (more than "
    "65536 characters, which is the upper bound for 4096 input tokens). Please reduce the length of the input prompt.",
    "The decoder prompt (length 4096) plus the number of requested output tokens (at least 1) is longer than the "
    "maximum model length of 4096. Make sure that `max_model_len` is no smaller than the number of text tokens "
    "(prompt + requested output tokens).",
    "The decoder prompt (length 5000) is longer than the maximum model length of 4096. Make sure that `max_model_len` "
    "is no smaller than the number of text tokens.",
    "This model's maximum context length is 4096 tokens. However, your request has 5000 input tokens. Please reduce "
    "the length of the input messages.",
    "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens in the messages, Please "
    "reduce the length of the messages.",
    "The input (36000 tokens) is longer than the model's context length (32768 tokens).",
    # the prompt fills the context: no room for one token
    "You passed 4096 input tokens and requested 10 output tokens. However, the model's context length is only 4096 "
    "tokens, resulting in a maximum input length of 4086 tokens.",
    "Requested token count exceeds the model's maximum context length of 100 tokens. You requested a total of 110 "
    "tokens: 99 tokens from the input messages and 11 tokens for the completion.",
    "some other server: the context length was exceeded",
]


@pytest.mark.parametrize(("message", "room"), BUDGET_ERRORS)
def test_a_budget_error_names_the_room_and_is_no_overflow(message: str, room: int) -> None:
    assert output_room(400, message) == room
    assert not is_context_overflow(400, message)
    assert output_room(500, message) is None and not is_context_overflow(500, message)


@pytest.mark.parametrize("message", PROMPT_ERRORS)
def test_a_prompt_overflow_names_no_room(message: str) -> None:
    assert is_context_overflow(400, message)
    assert output_room(400, message) is None


@pytest.mark.parametrize("message", ["max_tokens must be at least 1, got 0.", "the output tokens limit is 10",
                                     "Invalid 'response_format'.", "model not found"])
def test_other_errors_are_neither(message: str) -> None:
    assert not is_context_overflow(400, message) and output_room(400, message) is None


@pytest.mark.parametrize(("engine", "body", "prompt"), [
    ("vllm", {"max_tokens": 5000}, 10), ("vllm", {"max_completion_tokens": 4097}, 10), ("vllm", {}, 4097),
    ("vllm", {}, 4096), ("sglang", {"max_tokens": 4090}, 10), ("sglang", {}, 4096)])
def test_the_sims_words_read_as_the_engines(engine: str, body: dict, prompt: int) -> None:
    """Each 400 the sim answers for the context reads as the same kind of error as the engine's own."""
    with pytest.raises(SimError) as err:
        completion_budget(engine, body, prompt, 4096)
    status, message, _param = err.value.args
    if prompt >= 4096:
        assert is_context_overflow(status, message) and output_room(status, message) is None
    else:
        room = output_room(status, message)
        assert room is not None and not is_context_overflow(status, message)
        assert completion_budget(engine, {**body, "max_tokens": room, "max_completion_tokens": None}, prompt, 4096) == (
            4096 - prompt if engine == "vllm" else room)
