"""A tiny SearXNG-style search server for tests, run in a background thread on 127.0.0.1 (or another
loopback address: ``host``). Its results name its pages through ``result_host`` (another name or address
for the same server, e.g. "vm" from /etc/hosts), after any ``extra_results`` URLs, which come first.

GET /search?q=...&format=json   canned results pointing at this server's pages
    q=http500 -> 500, q=notjson -> an HTML page
GET /page/1, /page/2            HTML pages (scripts, styles, entities)
GET /page/big                   a page larger than a small cap
GET /page/image                 a PNG
GET /page/away                  302 to `redirect_to` (another origin)
GET /page/hop                   302 to /page/1 (same origin)
GET /secret                     what must never be fetched; counted in `hits`

Every request's path is counted in ``hits``, its Host header in ``host_headers``; with ``ssl_context``
it serves HTTPS.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from collections import Counter
from typing import Any, Self

from aiohttp import web

from harness import free_port

# "Small ...": the simulated worker fills a find_in_page pattern with the word "small" (tests/unit/test_web_browse.py).
PAGE_1 = """<!doctype html><html><head><title>Page one</title><style>body{color:red}</style></head>
<body><script>var secret = "do not show";</script><h1>Fish &amp; chips</h1>
<p>The <b>best</b> fish&nbsp;and chips.</p><!-- hidden comment --><ul><li>cod</li><li>haddock</li></ul>
<p>Small plates on Fridays.</p></body></html>"""



class FakeSearch:
    def __init__(self, *, redirect_to: str | None = None, host: str = "127.0.0.1", port: int | None = None,
                 result_host: str | None = None, extra_results: tuple[str, ...] = (),
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.host = host
        self.port = port if port is not None else free_port()
        self.redirect_to = redirect_to
        self.result_host = result_host or host
        self.extra_results = extra_results
        self.ssl_context = ssl_context
        self.hits: Counter[str] = Counter()
        self.host_headers: Counter[str] = Counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    @property
    def base(self) -> str:
        return f"{'https' if self.ssl_context else 'http'}://{self.host}:{self.port}"

    @property
    def result_base(self) -> str:
        """Where the results say the pages are."""
        return f"{'https' if self.ssl_context else 'http'}://{self.result_host}:{self.port}"

    @property
    def search_url(self) -> str:
        return self.base + "/search"

    def results(self) -> list[dict[str, Any]]:
        base = self.result_base
        return [
            *({"title": f"extra {i}", "url": url, "content": ""} for i, url in enumerate(self.extra_results, 1)),
            {"title": "Page  one", "url": base + "/page/1", "content": "All about\n fish"},
            {"title": "Page two", "url": base + "/page/2", "content": "More"},
            {"title": "not a web page", "url": "javascript:alert(1)", "content": "x"},
            {"title": "no url"},
            {"title": "", "url": base + "/page/big", "content": None},
            {"title": "image", "url": base + "/page/image", "content": ""},
            {"title": "away", "url": base + "/page/away", "content": ""},
            {"title": "hop", "url": base + "/page/hop", "content": ""},
        ]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        self.hits[path] += 1
        self.host_headers[request.headers.get("Host", "")] += 1
        if path == "/search":
            q = request.query.get("q", "")
            if q == "http500":
                return web.Response(status=500, text="boom")
            if q == "notjson" or request.query.get("format") != "json":
                return web.Response(text="<html>not json</html>", content_type="text/html")
            return web.json_response({"query": q, "results": self.results()})
        if path == "/page/1":
            return web.Response(text=PAGE_1, content_type="text/html")
        if path == "/page/2":
            return web.Response(text="plain text page two", content_type="text/plain")
        if path == "/page/big":
            return web.Response(text="<p>" + "x" * 100_000 + "</p>", content_type="text/html")
        if path == "/page/image":
            return web.Response(body=b"\x89PNG\r\n\x1a\n" + b"\0" * 64, content_type="image/png")
        if path == "/page/away":
            raise web.HTTPFound(self.redirect_to or "http://127.0.0.1:9/")
        if path == "/page/hop":
            raise web.HTTPFound("/page/1")
        if path == "/secret":
            return web.Response(text="internal secret")
        return web.Response(status=404, text="not found")

    def start(self) -> Self:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", self._handle)
            self._runner = web.AppRunner(app, access_log=None)
            loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, self.host, self.port, ssl_context=self.ssl_context)
            loop.run_until_complete(site.start())
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=run, name="fake-search", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake search server did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
