"""Web search for the router-side ``web_search`` tool: a backend protocol and a SearXNG-style JSON backend.

``open_page`` is the SSRF-sensitive part: it fetches only a URL that this
backend itself returned as a result or one the allowlist passes, and connects
only to addresses the NetGuard passed (its resolver answers aiohttp's lookups,
so the connection goes to the very address that was checked; an IP-literal host,
which aiohttp does not resolve, is judged before the request). Every redirect
hop is judged the same way (a hop on the same origin as an already permitted one
is allowed too), redirects are followed by hand, and bodies are read up to a
byte cap. The search API itself is the operator's choice and is not judged.
"""

from __future__ import annotations

import asyncio
import html
import json
import re
import socket
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urljoin

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

from router.tools.allowlist import DEFAULT_PORTS, UrlAllowlist, UrlNotAllowed, normalize_url
from router.tools.netguard import AddressNotAllowed, NetGuard

__all__ = [
    "HttpJsonSearch",
    "PageFetchError",
    "SearchBackend",
    "SearchBackendUnavailable",
    "SearchError",
    "SearchResult",
    "UrlNotAllowed",
    "html_to_text",
]

USER_AGENT = "responses-router/0.1 (web_search tool)"
MAX_REDIRECTS = 5
REMEMBERED_RESULTS = 2048


@dataclass(frozen=True)
class SearchResult:
    title: str
    url: str
    snippet: str


class SearchBackend(Protocol):
    async def search(self, query: str, *, max_results: int) -> list[SearchResult]: ...

    async def open_page(self, url: str) -> str: ...


class SearchError(Exception):
    """Base of web search failures."""


class SearchBackendUnavailable(SearchError):
    """The search service is down, timed out, or answered with an error or something that is not its JSON."""


class PageFetchError(SearchError):
    """A permitted page could not be fetched (network error, HTTP error, timeout, unsupported content)."""


_DROP_BLOCKS = re.compile(r"<(script|style|noscript|template|svg|head)\b[^>]*>.*?</\1\s*>", re.IGNORECASE | re.DOTALL)
_COMMENTS = re.compile(r"<!--.*?-->", re.DOTALL)
_BREAKS = re.compile(
    r"<\s*(?:br|/?p|/?div|/?li|/?tr|/?h[1-6]|/?section|/?article|/?ul|/?ol|/?table|/?pre)\b[^>]*>", re.IGNORECASE
)
_TAGS = re.compile(r"<[^>]*>")


def html_to_text(markup: str) -> str:
    """Crude HTML to text: drop scripts, styles and tags, keep block breaks, unescape entities."""
    text = _COMMENTS.sub(" ", markup)
    text = _DROP_BLOCKS.sub(" ", text)
    text = _BREAKS.sub("\n", text)
    text = html.unescape(_TAGS.sub(" ", text))
    lines = (" ".join(line.split()) for line in text.splitlines())
    return "\n".join(line for line in lines if line)


class GuardedResolver(AbstractResolver):
    """aiohttp's resolver for page fetches: one lookup, every address checked, only checked ones returned."""

    def __init__(self, guard: NetGuard) -> None:
        self.guard = guard

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        flags = socket.AI_NUMERICHOST | socket.AI_NUMERICSERV
        return [
            ResolveResult(hostname=host, host=address, port=port, family=fam, proto=0, flags=flags)
            for fam, address in await self.guard.resolve(host, port, family)
        ]

    async def close(self) -> None:
        pass


def _origin(url: str) -> tuple[str, str, int]:
    u = normalize_url(url)
    return (u.scheme, u.host, u.port)


def _same_site(a: tuple[str, str, int], b: tuple[str, str, int]) -> bool:
    """Same origin, or its https upgrade on default ports."""
    return a == b or (a[1] == b[1] and a[2] == DEFAULT_PORTS[a[0]] and b[2] == DEFAULT_PORTS[b[0]] and b[0] == "https")


class HttpJsonSearch:
    """A SearXNG-style JSON search API: ``GET {base_url}?q=...&format=json`` -> ``{"results": [{title, url, content}]}``."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 10.0,
        allowlist: UrlAllowlist | None = None,
        max_page_bytes: int = 2_000_000,
        max_page_chars: int = 20_000,
        guard: NetGuard | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.base_url = base_url
        self.timeout_s = timeout_s
        self.allowlist = allowlist or UrlAllowlist([])
        self.max_page_bytes = max_page_bytes
        self.max_page_chars = max_page_chars
        self.guard = guard if guard is not None else NetGuard()
        self.headers = {"User-Agent": USER_AGENT, **(headers or {})}
        # URLs this backend returned, so open_page can fetch them (bounded, oldest forgotten first), with their titles.
        self._results: OrderedDict[str, str] = OrderedDict()

    def _session(self, guard: NetGuard | None = None) -> aiohttp.ClientSession:
        """A session; with ``guard``, one whose connections go only to addresses the guard passed."""
        connector = aiohttp.TCPConnector(resolver=GuardedResolver(guard)) if guard is not None else None
        return aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout_s), headers=self.headers, trust_env=False,
            connector=connector,
        )

    def _remember(self, url: str, title: str) -> None:
        self._results[url] = title
        self._results.move_to_end(url)
        while len(self._results) > REMEMBERED_RESULTS:
            self._results.popitem(last=False)

    def title(self, url: str) -> str | None:
        """The title a search result gave this page, while it is remembered (for citations of opened pages)."""
        try:
            return self._results.get(self._key(url))
        except (UrlNotAllowed, ValueError):
            return None

    def _key(self, url: str) -> str:
        u = normalize_url(url)
        return f"{u.scheme}://{u.host}:{u.port}{u.path}"

    async def search(self, query: str, *, max_results: int = 10) -> list[SearchResult]:
        origin = _origin(self.base_url)

        def permit(url: str, previous: Any) -> None:  # the search API may redirect within its own origin only
            if _origin(url) != origin:
                raise UrlNotAllowed(url, "search API redirected off its origin")

        try:
            async with asyncio.timeout(self.timeout_s), self._session() as session:
                status, _content_type, body, _ = await self._fetch(
                    session, self.base_url, permit, params={"q": query, "format": "json"}, limit=self.max_page_bytes
                )
            if status != 200:
                raise SearchBackendUnavailable(f"search backend answered HTTP {status}")
            data = json.loads(body)
        except (aiohttp.ClientError, OSError, TimeoutError, UrlNotAllowed, ValueError, _TooManyRedirects) as exc:
            raise SearchBackendUnavailable(f"search backend failed: {_describe(exc, self.timeout_s)}") from exc
        raw = data.get("results") if isinstance(data, dict) else None
        if not isinstance(raw, list):
            raise SearchBackendUnavailable("search backend answered without a results list")
        results: list[SearchResult] = []
        for entry in raw:
            if len(results) >= max_results:
                break
            if not isinstance(entry, dict) or not isinstance(entry.get("url"), str):
                continue
            url = entry["url"].strip()
            try:
                key = self._key(url)
            except UrlNotAllowed:
                continue  # not http(s), or not a URL we could ever fetch
            title = " ".join(str(entry.get("title") or url).split())
            self._remember(key, title)
            snippet = " ".join(str(entry.get("content") or "").split())
            results.append(SearchResult(title=title, url=url, snippet=snippet))
        return results

    def _permit_page(self, url: str, previous: tuple[str, str, int] | None = None) -> None:
        """Raise UrlNotAllowed unless open_page may fetch this URL (or this redirect hop)."""
        if self.allowlist.allows(url):
            return
        u = normalize_url(url)
        if previous is not None and _same_site(previous, (u.scheme, u.host, u.port)):
            return
        if self._key(url) in self._results:
            return
        raise UrlNotAllowed(url, "not a search result and not in the allowlist")

    async def open_page(self, url: str) -> str:
        """The text of a page from this backend's results (or the allowlist), capped in size."""
        self._permit_page(url)
        try:
            async with asyncio.timeout(self.timeout_s), self._session(self.guard) as session:
                status, content_type, body, truncated = await self._fetch(
                    session, url, self._permit_page, limit=self.max_page_bytes, guard=self.guard
                )
        except (aiohttp.ClientError, OSError, TimeoutError, _TooManyRedirects) as exc:
            raise PageFetchError(f"could not fetch {url}: {_describe(exc, self.timeout_s)}") from exc
        if status >= 400:
            raise PageFetchError(f"{url} answered HTTP {status}")
        mime, _, params = content_type.partition(";")
        mime = mime.strip().lower()
        if mime and not (mime.startswith("text/") or mime.endswith(("json", "xml"))):
            raise PageFetchError(f"{url}: content type {mime} is not text")
        charset = re.search(r"charset=([\w.-]+)", params, re.IGNORECASE)
        try:
            text = body.decode(charset.group(1) if charset else "utf-8", errors="replace")
        except LookupError:
            text = body.decode("utf-8", errors="replace")
        if mime in ("", "text/html", "application/xhtml+xml") and ("<" in text):
            text = html_to_text(text)
        if len(text) > self.max_page_chars or truncated:
            text = text[: self.max_page_chars] + "\n[... truncated]"
        return text

    async def _fetch(
        self,
        session: aiohttp.ClientSession,
        url: str,
        permit: Any,
        *,
        params: dict[str, str] | None = None,
        limit: int,
        guard: NetGuard | None = None,
    ) -> tuple[int, str, bytes, bool]:
        """GET with redirects followed by hand, each hop passed to ``permit`` (and ``guard``) first; body read
        up to ``limit``. A guard's refusal is UrlNotAllowed for the hop it refused."""
        for _ in range(MAX_REDIRECTS + 1):
            try:
                if guard is not None:
                    target = URL(url)
                    guard.check_literal(target.raw_host or "", target.port or 0)
                resp = await session.get(url, params=params, allow_redirects=False)
            except AddressNotAllowed as exc:
                raise UrlNotAllowed(url, str(exc)) from exc
            async with resp:
                location = resp.headers.get("Location")
                if resp.status in (301, 302, 303, 307, 308) and location:
                    previous = _origin(url)
                    url, params = urljoin(str(resp.url), location), None
                    permit(url, previous)
                    continue
                body = bytearray()
                truncated = False
                async for chunk in resp.content.iter_chunked(65536):
                    body += chunk
                    if len(body) >= limit:
                        truncated = True
                        del body[limit:]
                        break
                return resp.status, resp.headers.get("Content-Type", ""), bytes(body), truncated
        raise _TooManyRedirects(f"more than {MAX_REDIRECTS} redirects")


class _TooManyRedirects(Exception):
    pass


def _describe(exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, TimeoutError):
        return f"timed out after {timeout_s:g}s"
    return f"{type(exc).__name__}: {exc}"
