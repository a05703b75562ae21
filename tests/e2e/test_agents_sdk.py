"""The OpenAI Agents SDK runs an agent with two function tools against the router."""

from __future__ import annotations

import asyncio

import openai
import pytest
from agents import Agent, OpenAIResponsesModel, RunConfig, Runner, function_tool, set_tracing_disabled

from harness import RouterProcess
from tests.conftest import MODEL

pytestmark = pytest.mark.e2e

set_tracing_disabled(True)  # tracing would export to a remote service


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@function_tool
def get_time(zone: str) -> str:
    """The time in a zone."""
    return f"noon in {zone}"


def make_agent(router: RouterProcess) -> Agent:
    client = openai.AsyncOpenAI(base_url=router.base_url + "/v1", api_key="unused", max_retries=0)
    return Agent(
        name="helper",
        instructions="Use the tools.",
        tools=[get_weather, get_time],
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
    )


@pytest.mark.parametrize("mode", ["stateless", "auto_previous_response_id"])
def test_agent_runs_both_tools(router: RouterProcess, mode: str) -> None:
    agent = make_agent(router)
    kwargs = {"auto_previous_response_id": True} if mode != "stateless" else {}
    result = asyncio.run(Runner.run(agent, "Weather and time? [sim:call=get_weather,get_time]", run_config=RunConfig(), **kwargs))
    outputs = [item.output for item in result.new_items if item.type == "tool_call_output_item"]
    assert len(outputs) == 2 and outputs[0].startswith("sunny in ") and outputs[1].startswith("noon in ")
    # The sim answers the last tool output in text: the loop ended with a final answer.
    assert result.final_output.startswith("tool said: noon in ")
    responses = result.raw_responses
    assert len(responses) == 2 and all(r.response_id for r in responses)


def test_agent_continues_from_previous_response(router: RouterProcess) -> None:
    async def both() -> tuple:  # type: ignore[type-arg]
        agent = make_agent(router)  # one event loop for both runs: the client's connections belong to it
        first = await Runner.run(agent, "Weather? [sim:call=get_weather]")
        second = await Runner.run(agent, "Repeat everything [sim:echo]", previous_response_id=first.last_response_id)
        return first, second

    first, second = asyncio.run(both())
    assert first.final_output.startswith("tool said: sunny in ")
    assert "sunny in" in second.final_output  # the earlier tool round trip is in the prompt the worker saw
