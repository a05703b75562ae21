"""What /metrics says about the work the router does besides Responses turns, through a real router:
the chat passthrough, shadow traffic, router-run tools, the store, the router's own queueing; and
``responses-router report`` leaving the requests' own faults out of an arm's error rate."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from harness import ROOT, RouterProcess, sim_pool_toml, start_router
from router.report import parse_prometheus
from router.turns.shadow import differences
from tests.support.fake_search import FakeSearch

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    search = FakeSearch().start()
    body = sim_pool_toml(replicas=1) + sim_pool_toml(name="cand", replicas=1) + f"""
[[models]]
name = "m"
pool = "sim"
[models.shadow]
pool = "cand"
rate = 1.0

[tools.web_search]
url = "{search.search_url}"
"""
    proc = start_router(tmp_path_factory.mktemp("metrics"), body)
    try:
        yield proc
    finally:
        assert proc.stop() == 0
        search.stop()


def samples(router: RouterProcess) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> (labels, value) of the router's /metrics."""
    text = httpx.get(router.base_url + "/metrics", timeout=10).text
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in parse_prometheus(text).values():
        for name, labels, value in family["samples"]:
            out.setdefault(name, []).append((labels, value))
    return out


def value(found: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for ls, v in found.get(name, []) if all(ls.get(k) == want for k, want in labels.items()))


def test_passthrough_tools_shadow_store_and_queueing_are_measured(router: RouterProcess) -> None:
    client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="none", max_retries=0)
    answer = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi [sim:tokens=7]"}])
    streamed = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi [sim:tokens=5]"}],
                                                   stream=True, stream_options={"include_usage": True}))
    assert answer.usage is not None and streamed[-1].usage is not None
    searched = client.responses.create(model="m", input="look up fish [sim:call=web_search]", tools=[{"type": "web_search"}])
    assert [item.type for item in searched.output] == ["web_search_call", "message"]
    plain = client.responses.create(model="m", input="a plain answer [sim:tokens=12]")
    assert plain.status == "completed"

    # Two Responses creates, each mirrored to the candidate pool once it has its answer.
    deadline = time.monotonic() + 30
    while value(found := samples(router), "responses_router_shadow_requests_total") < 2:
        assert time.monotonic() < deadline, found.get("responses_router_shadow_requests_total")
        time.sleep(0.2)

    chat = {"model": "m", "arm": "sim", "pool": "sim", "route": "chat"}
    assert value(found, "responses_router_passthrough_requests_total", **chat, code="200") == 2
    assert value(found, "responses_router_passthrough_duration_seconds_count", **chat) == 2
    out = answer.usage.completion_tokens + streamed[-1].usage.completion_tokens
    assert value(found, "responses_router_passthrough_tokens_total", **chat, kind="output") == out
    assert value(found, "responses_router_passthrough_tokens_total", **chat, kind="input") == (
        answer.usage.prompt_tokens + streamed[-1].usage.prompt_tokens)

    assert value(found, "responses_router_tool_calls_total", tool="web_search", outcome="ok") == 1
    assert value(found, "responses_router_tool_call_duration_seconds_count", tool="web_search") == 1

    shadow = {"model": "m", "pool": "cand"}
    assert value(found, "responses_router_shadow_requests_total", **shadow) == 2
    assert value(found, "responses_router_shadow_duration_seconds_count", **shadow) == 2
    assert value(found, "responses_router_shadow_output_tokens_total", **shadow) >= plain.usage.output_tokens
    # The plain answer's mirror is the same sim answering the same prompt: no difference; a mirror has
    # no router tools, so the search's ends at its call (its client's went on to a message).
    assert value(found, "responses_router_shadow_differences_total", **shadow) <= 2

    assert value(found, "responses_router_store_operation_seconds_count", operation="put_response") >= 2
    assert value(found, "responses_router_store_errors_total") == 0
    assert value(found, "responses_router_requests_in_flight") == 1  # this scrape itself
    assert value(found, "responses_router_event_loop_lag_seconds_count") >= 1


def test_a_request_refused_for_its_own_fault_is_not_an_arm_error(router: RouterProcess) -> None:
    client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="m", input="many words " * 4000)  # past the sim's 4,096-token context
    assert refused.value.code == "context_length_exceeded"
    found = samples(router)
    arm = {"model": "m", "arm": "sim", "pool": "sim"}
    assert value(found, "responses_router_requests_total", **arm, status="rejected") == 1
    assert value(found, "responses_router_requests_total", **arm, status="failed") == 0
    assert value(found, "responses_router_errors_total", **arm) == 0
    report = subprocess.run([sys.executable, "-m", "router", "report", "--url", router.base_url], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    row = next(line for line in report.stdout.splitlines() if line.strip().startswith("sim "))
    assert row.split()[2] == "0.00%", report.stdout  # requests, then the error rate: the rejected one is in neither
    assert "rejected on sim: 1 (the request's fault" in report.stdout


def test_shadow_differences_read_length_and_ending() -> None:
    def response(status: str, tokens: int, reason: str | None = None) -> dict[str, Any]:
        return {"status": status, "usage": {"output_tokens": tokens},
                "incomplete_details": {"reason": reason} if reason else None}

    assert differences(response("completed", 100), response("completed", 81)) == []
    assert differences(response("completed", 100), response("completed", 79)) == ["length"]
    assert differences(response("completed", 10), response("incomplete", 10, "max_output_tokens")) == ["finish"]
    assert differences(response("incomplete", 10, "max_output_tokens"), response("incomplete", 3, "content_filter")) == [
        "length", "finish"]


def test_the_operations_page_names_every_metric_family(router: RouterProcess) -> None:
    text = httpx.get(router.base_url + "/metrics", timeout=10).text
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    page = (Path(ROOT) / "docs" / "operations.md").read_text()
    missing = sorted(f for f in families if f"`{f}`" not in page)
    assert len(families) > 20 and not missing, missing
