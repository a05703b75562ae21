"""The router's own fetches never reach a non-public address a request or a page names (SSRF), through a real router.

Every server here is on loopback; "vm" is a name /etc/hosts maps to 127.0.0.1 (the test reads it there).
The search API and the MCP server named in config are the operator's: they are reached on loopback
without any permission. Pages the model opens and a request's own server_url are not.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from harness import RouterProcess, free_port, sim_pool_toml, start_router
from tests.support import mcp_servers
from tests.support.fake_search import FakeSearch

pytestmark = pytest.mark.e2e

MODEL = "sim-chat"
WEB = [{"type": "web_search"}]


def _hosts_name(address: str) -> str:
    """A name /etc/hosts gives ``address``: resolving it asks no DNS server."""
    for line in Path("/etc/hosts").read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) >= 2 and fields[0] == address and fields[1] != "localhost":
            return fields[1]
    raise AssertionError(f"/etc/hosts names no host for {address} besides localhost")


VM = _hosts_name("127.0.0.1")


def _router(tmp: Path, tools: str, chat: str = "") -> RouterProcess:
    body = sim_pool_toml(replicas=1) + chat + f'\n[[models]]\nname = "{MODEL}"\npool = "sim"\n' + tools
    return start_router(tmp, body)


def _client(router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url + "/v1", api_key="x", max_retries=0, timeout=60)


def _search_then_open(client: openai.OpenAI) -> tuple[Any, Any]:
    """The sim searches, then opens result [1] of that search (its open_page gets ``result: 1``)."""
    searched = client.responses.create(model=MODEL, input="look up fish [sim:call=web_search]", tools=WEB)
    opened = client.responses.create(model=MODEL, input="open the first [sim:call=web_search__open_page]", tools=WEB,
                                     previous_response_id=searched.id)
    return searched, opened


# -- no private network permitted --------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A router permitting no private network: a search API whose results name its pages as http://vm:PORT/...,
    an MCP server that the allowlist admits as http://vm:PORT/, and the same server named in config."""
    search = FakeSearch(result_host=VM).start()
    mcp = mcp_servers.start("streamable-http")
    tools = f"""
[tools.web_search]
url = "{search.search_url}"
[tools.mcp]
allow = ["http://{VM}:{mcp.port}/"]
timeout_s = 10
[[tools.mcp.servers]]
label = "named"
url = "{mcp.url}"
"""
    router = _router(tmp_path_factory.mktemp("netguard"), tools)
    try:
        yield {"router": router, "client": _client(router), "search": search, "mcp": mcp}
    finally:
        assert router.stop() == 0, router.log()
        search.stop()
        mcp.stop()


def test_a_result_on_a_loopback_name_is_not_opened(plain: dict[str, Any]) -> None:
    search: FakeSearch = plain["search"]
    before = search.hits["/page/1"]
    searched, opened = _search_then_open(plain["client"])
    page = f"http://{VM}:{search.port}/page/1"
    assert searched.output_text.startswith(f"tool said: [1] Page one\n{page}")  # the search API itself answered
    call = opened.output[0]
    assert call.type == "web_search_call" and call.status == "failed"
    assert f"{VM} resolves to 127.0.0.1, a loopback address" in opened.output_text
    assert search.hits["/page/1"] == before


def test_a_request_server_url_on_a_loopback_name_is_refused(plain: dict[str, Any]) -> None:
    mcp = plain["mcp"]
    client: openai.OpenAI = plain["client"]
    before = mcp.requests_seen()
    url = f"http://{VM}:{mcp.port}/mcp"
    tool = {"type": "mcp", "server_label": "calc", "server_url": url, "require_approval": "never"}
    response = client.responses.create(model=MODEL, input="hi", tools=[tool])
    assert mcp.requests_seen() == before  # not connected to at all
    listing = response.output[0]
    assert listing.type == "mcp_list_tools" and listing.tools == [] and listing.error is not None
    assert f"{VM} resolves to 127.0.0.1, a loopback address" in str(listing.error)
    # The same server, named in config by the operator, is reached.
    named = client.responses.create(model=MODEL, input="hi", tools=[{"type": "mcp", "server_label": "named",
                                                                     "require_approval": "never"}])
    assert named.output[0].type == "mcp_list_tools" and named.output[0].error is None
    assert {t.name for t in named.output[0].tools} >= {"add", "echo"}


# -- 127.0.0.2 permitted -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def permitting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """``private_networks = ["127.0.0.2/32"]``: pages on 127.0.0.2 open; a secret server on 127.0.0.1 (as "vm")
    stays out of reach, even as a search result and a redirect target. Its pool takes only data: media URLs."""
    secret = FakeSearch().start()
    secret_url = f"http://{VM}:{secret.port}/secret"
    port = free_port()
    # Result [1] redirects to result [2]: the redirect passes the "a search result" rule, not the guard.
    pages = FakeSearch(host="127.0.0.2", port=port, redirect_to=secret_url,
                       extra_results=(f"http://127.0.0.2:{port}/page/away", secret_url)).start()
    tools = f"""
[tools]
private_networks = ["127.0.0.2/32"]
[tools.web_search]
url = "{pages.search_url}"
"""
    chat = '[pools.chat]\naccepts_files = true\nmedia_urls = "data_only"\n'
    router = _router(tmp_path_factory.mktemp("netguard-permit"), tools, chat)
    try:
        yield {"router": router, "client": _client(router), "pages": pages, "secret": secret}
    finally:
        assert router.stop() == 0, router.log()
        pages.stop()
        secret.stop()


def test_a_redirect_from_a_permitted_page_to_loopback_is_refused(permitting: dict[str, Any]) -> None:
    pages: FakeSearch = permitting["pages"]
    secret: FakeSearch = permitting["secret"]
    before = pages.hits["/page/away"]
    searched, opened = _search_then_open(permitting["client"])
    assert searched.output_text.startswith(f"tool said: [1] extra 1\n{pages.base}/page/away")
    assert pages.hits["/page/away"] == before + 1  # the permitted page was fetched ...
    assert opened.output[0].status == "failed"  # ... its redirect was not followed
    assert f"{VM} resolves to 127.0.0.1, a loopback address" in opened.output_text
    assert secret.hits["/secret"] == 0


def test_media_urls_data_only(permitting: dict[str, Any]) -> None:
    """input_image / input_file URLs are fetched by the engine, not the router: such a pool takes data: only."""
    client: openai.OpenAI = permitting["client"]
    secret: FakeSearch = permitting["secret"]
    image = {"type": "input_image", "image_url": f"http://127.0.0.1:{secret.port}/secret"}
    file = {"type": "input_file", "file_url": f"http://127.0.0.1:{secret.port}/secret", "filename": "s.txt"}
    for part in (image, file):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=MODEL, input=[{"role": "user", "content": [
                {"type": "input_text", "text": "[sim:echo]"}, part]}])
        assert err.value.body["param"] == "input"
        assert f"{part['type']} URL 'http://127.0.0.1:" in err.value.body["message"]
    inline = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}
    echoed = client.responses.create(model=MODEL, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "[sim:echo]"}, inline]}])
    content = json.loads(echoed.output_text)[-1]["content"]
    assert {"type": "image_url", "image_url": {"url": inline["image_url"], "detail": "auto"}} in content
    assert secret.hits["/secret"] == 0
