"""The web search backend against a fake SearXNG-style server on 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from harness import free_port
from router.tools.allowlist import UrlAllowlist, UrlNotAllowed
from router.tools.netguard import NetGuard
from router.tools.web_search import (
    HttpJsonSearch,
    PageFetchError,
    SearchBackendUnavailable,
    SearchResult,
    html_to_text,
)
from tests.support.fake_search import PAGE_1, FakeSearch


@pytest.fixture(scope="module")
def secret() -> Iterator[FakeSearch]:
    """Stands for an internal service: nothing may fetch its /secret."""
    with FakeSearch() as server:
        yield server


@pytest.fixture(scope="module")
def fake(secret: FakeSearch) -> Iterator[FakeSearch]:
    with FakeSearch(redirect_to=secret.base + "/secret") as server:
        yield server


def backend(fake: FakeSearch, **kwargs: object) -> HttpJsonSearch:
    kwargs.setdefault("guard", NetGuard.permitting(["127.0.0.0/8"]))  # the fake's results are on 127.0.0.1
    return HttpJsonSearch(fake.search_url, timeout_s=5, **kwargs)  # type: ignore[arg-type]


def test_results_parsed(fake: FakeSearch) -> None:
    results = asyncio.run(backend(fake).search("fish", max_results=10))
    assert results[0] == SearchResult(title="Page one", url=fake.base + "/page/1", snippet="All about fish")
    assert results[1].url == fake.base + "/page/2"
    urls = [r.url for r in results]
    assert "javascript:alert(1)" not in urls  # not http(s)
    assert len(results) == 6  # the entry without a url is skipped too
    big = results[2]
    assert big.title == big.url and big.snippet == ""
    assert len(asyncio.run(backend(fake).search("fish", max_results=2))) == 2


def test_open_page_of_a_result(fake: FakeSearch) -> None:
    async def main() -> tuple[str, str]:
        b = backend(fake)
        await b.search("fish", max_results=10)
        return await b.open_page(fake.base + "/page/1"), await b.open_page(fake.base + "/page/2")

    page1, page2 = asyncio.run(main())
    assert "Fish & chips" in page1 and "The best fish and chips." in page1.replace("\xa0", " ")
    assert "cod\nhaddock" in page1
    assert "do not show" not in page1 and "color:red" not in page1 and "hidden comment" not in page1
    assert page2 == "plain text page two"


def test_open_page_caps_size(fake: FakeSearch) -> None:
    async def main() -> str:
        b = backend(fake, max_page_chars=1000, max_page_bytes=5000)
        await b.search("fish", max_results=10)
        return await b.open_page(fake.base + "/page/big")

    text = asyncio.run(main())
    assert len(text) < 1100 and text.endswith("[... truncated]")


def test_open_page_same_origin_redirect_followed(fake: FakeSearch) -> None:
    async def main() -> str:
        b = backend(fake)
        await b.search("fish", max_results=10)
        return await b.open_page(fake.base + "/page/hop")

    assert "Fish & chips" in asyncio.run(main())


def test_open_page_refuses_random_url(fake: FakeSearch, secret: FakeSearch) -> None:
    before = secret.hits["/secret"]
    b = backend(fake)
    with pytest.raises(UrlNotAllowed):
        asyncio.run(b.open_page(secret.base + "/secret"))
    # Not even a result of a search done before, nor a result URL with a path trick.
    asyncio.run(b.search("fish", max_results=10))
    for url in (
        secret.base + "/secret",
        fake.base + "/page/1/../../secret",
        "file:///etc/passwd",
        "http://169.254.169.254/",
    ):
        with pytest.raises(UrlNotAllowed):
            asyncio.run(b.open_page(url))
    assert secret.hits["/secret"] == before


def test_open_page_refuses_redirect_off_results(fake: FakeSearch, secret: FakeSearch) -> None:
    before = secret.hits["/secret"]

    async def main() -> None:
        b = backend(fake)
        await b.search("fish", max_results=10)
        await b.open_page(fake.base + "/page/away")

    with pytest.raises(UrlNotAllowed):
        asyncio.run(main())
    assert fake.hits["/page/away"] >= 1
    assert secret.hits["/secret"] == before


def test_open_page_allowlisted_url(fake: FakeSearch, secret: FakeSearch) -> None:
    b = backend(fake, allowlist=UrlAllowlist([secret.base + "/secret"]))
    assert asyncio.run(b.open_page(secret.base + "/secret")) == "internal secret"
    with pytest.raises(UrlNotAllowed):
        asyncio.run(b.open_page(secret.base + "/page/1"))


def test_private_result_refused_by_default(fake: FakeSearch) -> None:
    async def main() -> None:
        b = HttpJsonSearch(fake.search_url, timeout_s=5)
        await b.search("fish", max_results=10)
        await b.open_page(fake.base + "/page/1")

    with pytest.raises(UrlNotAllowed, match=r"127\.0\.0\.1, a loopback address"):
        asyncio.run(main())


def test_results_on_names_that_resolve_to_loopback_are_refused() -> None:
    """Judged on the address the name resolves to, not its spelling: /etc/hosts names, IPv4-mapped loopback."""
    names = [line.split()[1] for line in open("/etc/hosts") if line.startswith("127.") and len(line.split()) > 1]

    async def outcome(server: FakeSearch) -> str:
        b = HttpJsonSearch(server.search_url, timeout_s=5)  # the search API: the operator's, reached
        (first, *_) = await b.search("fish", max_results=10)
        try:
            await b.open_page(first.url)
        except UrlNotAllowed as exc:
            return exc.reason
        return "fetched"

    outcomes, fetched = {}, {}
    for host in [*names, "[::ffff:127.0.0.1]"]:
        with FakeSearch(result_host=host) as server:
            outcomes[host] = asyncio.run(outcome(server))
            fetched[host] = server.hits["/page/1"]
    assert outcomes == {host: outcomes[host] for host in outcomes if "loopback" in outcomes[host]}, outcomes
    assert set(fetched.values()) == {0}


def test_open_page_non_text_and_http_errors(fake: FakeSearch) -> None:
    async def main(path: str) -> str:
        b = backend(fake, allowlist=UrlAllowlist([fake.base + "/page/"]))
        return await b.open_page(fake.base + path)

    with pytest.raises(PageFetchError, match="image/png"):
        asyncio.run(main("/page/image"))
    with pytest.raises(PageFetchError, match="404"):
        asyncio.run(main("/page/nope"))


def test_backend_down() -> None:
    b = HttpJsonSearch(f"http://127.0.0.1:{free_port()}/search", timeout_s=2)
    with pytest.raises(SearchBackendUnavailable):
        asyncio.run(b.search("fish", max_results=3))


def test_backend_errors(fake: FakeSearch) -> None:
    with pytest.raises(SearchBackendUnavailable, match="500"):
        asyncio.run(backend(fake).search("http500", max_results=3))
    with pytest.raises(SearchBackendUnavailable):
        asyncio.run(backend(fake).search("notjson", max_results=3))


def test_html_to_text() -> None:
    text = html_to_text(PAGE_1)
    assert text.splitlines()[0] == "Fish & chips"
    assert "<" not in text and "secret" not in text


def test_titles_of_results_are_remembered(fake: FakeSearch) -> None:
    b = backend(fake)
    assert b.title(fake.base + "/page/1") is None
    asyncio.run(b.search("fish", max_results=10))
    assert b.title(fake.base + "/page/1") == "Page one" and b.title(fake.base + "/page/2#top") == "Page two"
    assert b.title(fake.base + "/secret") is None and b.title("javascript:alert(1)") is None
