"""Which URLs router-side tools may reach: an allowlist of URL prefixes and hosts.

An entry is either a URL prefix (``https://mcp.example.com/mcp/``: same scheme,
host and port, and a path under the prefix on a segment boundary) or a bare host
(``mcp.example.com``: http or https on the default port; ``127.0.0.1:8931``:
that port, either scheme). Every URL is normalized before it is compared, and
anything ambiguous (userinfo, backslashes, control characters, encoded slashes,
percent-encoded or otherwise odd hosts, unknown schemes) is refused outright, so
the comparison is on what a server would actually see.

``AllowlistTransport`` re-checks every request an httpx2 client sends (the MCP
SDK's client type), so a redirect to an address that is not allowed is refused
before it is fetched, and connects through a ``GuardedBackend``: a URL the
allowlist passes still reaches only addresses the NetGuard passes (the host is
resolved once and the connection made to the checked address; TLS verifies the
host name). ``mcp_http_client_factory`` builds such clients for the SDK's
``httpx_client_factory`` / ``http_client`` parameters.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self, cast
from urllib.parse import unquote, urlsplit

import httpcore2  # the MCP SDK's HTTP client (both are the router's own dependencies too)
import httpx2

from router.tools.netguard import AddressNotAllowed, NetGuard

_TransportBase: Any = httpx2.AsyncBaseTransport
_BackendBase: Any = httpcore2.AsyncNetworkBackend

__all__ = [
    "AllowlistTransport",
    "GuardedBackend",
    "UrlAllowlist",
    "UrlNotAllowed",
    "guarded_transport",
    "mcp_http_client_factory",
    "normalize_url",
]

DEFAULT_PORTS = {"http": 80, "https": 443}
_HOST_LABEL = re.compile(r"^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$")
_BAD_CHARS = re.compile(r"[\x00-\x20\x7f\\]")
_BAD_ESCAPES = re.compile(r"%(?:2f|5c|25|00)", re.IGNORECASE)


class UrlNotAllowed(Exception):
    """A URL that the allowlist refuses (or that cannot be judged safely)."""

    def __init__(self, url: str, reason: str = "not in the allowlist") -> None:
        super().__init__(f"URL not allowed ({reason}): {url}")
        self.url = url
        self.reason = reason


@dataclass(frozen=True)
class NormalizedUrl:
    scheme: str
    host: str
    port: int
    path: str


def _normalize_host(raw: str, url: str) -> str:
    if not raw or "%" in raw:
        raise UrlNotAllowed(url, "bad host")
    if raw.startswith("["):
        if not raw.endswith("]"):
            raise UrlNotAllowed(url, "bad host")
        try:
            return "[" + ipaddress.IPv6Address(raw[1:-1]).compressed + "]"
        except ValueError:
            raise UrlNotAllowed(url, "bad host") from None
    host = raw.lower().rstrip(".")
    if not host.isascii():
        try:
            import idna

            host = idna.encode(host, uts46=True).decode("ascii")
        except (idna.IDNAError, UnicodeError, ValueError):
            raise UrlNotAllowed(url, "bad host") from None
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    labels = host.split(".")
    if not all(_HOST_LABEL.match(label) for label in labels):
        raise UrlNotAllowed(url, "bad host")
    if labels[-1].isdigit() or re.fullmatch(r"0x[0-9a-f]*", labels[-1]):
        # "127.1", "0x7f.1", "2130706433": numeric spellings of an address resolvers accept.
        raise UrlNotAllowed(url, "non-canonical IP address")
    return host


def _normalize_path(raw: str, url: str) -> str:
    if _BAD_ESCAPES.search(raw):
        raise UrlNotAllowed(url, "encoded slash or percent in path")
    path = unquote(raw)
    if _BAD_CHARS.search(path):
        raise UrlNotAllowed(url, "bad path")
    segments = path.lstrip("/").split("/")
    out: list[str] = []
    for segment in segments:
        if segment == "..":
            if out:
                out.pop()
        elif segment != ".":
            out.append(segment)
    trailing = "/" if segments[-1] in (".", "..") and out else ""
    return "/" + "/".join(out) + trailing


def normalize_url(url: Any) -> NormalizedUrl:
    """Scheme, host, port and path of an absolute http(s) URL as a server sees them; raises UrlNotAllowed."""
    text = str(url)
    if _BAD_CHARS.search(text):
        raise UrlNotAllowed(text, "bad characters")
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        raise UrlNotAllowed(text, "unparseable") from None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise UrlNotAllowed(text, "scheme must be http or https")
    netloc = parts.netloc
    if "@" in netloc:
        raise UrlNotAllowed(text, "userinfo in URL")
    hostport = netloc
    if hostport.startswith("["):
        raw_host = hostport[: hostport.find("]") + 1]
    else:
        raw_host = hostport.rsplit(":", 1)[0] if ":" in hostport else hostport
    host = _normalize_host(raw_host, text)
    return NormalizedUrl(
        scheme, host, port if port is not None else DEFAULT_PORTS[scheme], _normalize_path(parts.path or "/", text)
    )


@dataclass(frozen=True)
class _Entry:
    schemes: tuple[str, ...]
    host: str
    ports: tuple[int, ...]
    path: str

    def matches(self, u: NormalizedUrl) -> bool:
        if u.scheme not in self.schemes or u.host != self.host or u.port not in self.ports:
            return False
        prefix = self.path
        if prefix == "/" or u.path == prefix:
            return True
        return u.path.startswith(prefix if prefix.endswith("/") else prefix + "/")


@dataclass(frozen=True)
class _BareHost(_Entry):
    """A host without a port: http on 80 or https on 443."""

    def matches(self, u: NormalizedUrl) -> bool:
        return u.host == self.host and u.port == DEFAULT_PORTS[u.scheme]


def _parse_entry(entry: str) -> _Entry:
    entry = entry.strip()
    if "://" in entry:
        u = normalize_url(entry)
        return _Entry((u.scheme,), u.host, (u.port,), u.path)
    u = normalize_url("http://" + entry)
    if u.path != "/":
        raise ValueError(f"allowlist entry {entry!r}: a bare host takes no path (write a URL prefix instead)")
    port = urlsplit("http://" + entry).port
    if port is None:
        return _BareHost(("http", "https"), u.host, (80, 443), "/")
    return _Entry(("http", "https"), u.host, (port,), "/")


class UrlAllowlist:
    """URL prefixes and bare hosts a router-side tool may reach; empty allows nothing."""

    def __init__(self, entries: list[str]) -> None:
        try:
            self._entries = [_parse_entry(e) for e in entries if e.strip()]
        except UrlNotAllowed as exc:
            raise ValueError(f"bad allowlist entry: {exc.url} ({exc.reason})") from None
        self.entries = list(entries)

    def allows(self, url: Any) -> bool:
        try:
            self.check(url)
        except UrlNotAllowed:
            return False
        return True

    def check(self, url: Any) -> None:
        u = normalize_url(url)
        if not any(e.matches(u) for e in self._entries):
            raise UrlNotAllowed(str(url))

    def __repr__(self) -> str:
        return f"UrlAllowlist({self.entries!r})"


class GuardedBackend(_BackendBase):
    """An httpcore2 network backend that connects only to addresses the guard resolved and passed.

    httpcore2 keeps the host name for the pool key, the Host header and TLS (SNI and
    certificate checks); only the TCP connection goes to the checked address.
    """

    def __init__(self, guard: NetGuard, inner: Any = None) -> None:
        self.guard = guard
        # cast: httpcore2 also defines a stand-in AnyIOBackend (for when anyio is missing), and pyright reads that one.
        self.inner: httpcore2.AsyncNetworkBackend = inner if inner is not None else cast(
            "httpcore2.AsyncNetworkBackend", httpcore2.AnyIOBackend())

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore2's AsyncNetworkBackend signature
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> Any:
        try:
            addresses = await self.guard.resolve(host, port)
        except OSError as exc:
            raise httpcore2.ConnectError(f"could not resolve {host}: {exc}") from exc
        failure: Exception = httpcore2.ConnectError(f"could not connect to {host}")
        for _family, address in addresses:
            try:
                return await self.inner.connect_tcp(
                    address, port, timeout=timeout, local_address=local_address, socket_options=socket_options
                )
            except (httpcore2.ConnectError, httpcore2.ConnectTimeout) as exc:
                failure = exc
        raise failure

    async def connect_unix_socket(self, path: str, timeout: float | None = None, socket_options: Any = None) -> Any:  # noqa: ASYNC109
        raise httpcore2.ConnectError("unix sockets are not reachable from router-side tools")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


def guarded_transport(guard: NetGuard) -> Any:
    """httpx2's own transport (exceptions mapped as usual) over a pool whose connections go through the guard.

    httpx2 takes no network backend, so its pool is replaced; if that attribute ever
    goes away this fails loudly rather than connecting unguarded.
    """
    transport = httpx2.AsyncHTTPTransport(trust_env=False)
    if not isinstance(getattr(transport, "_pool", None), httpcore2.AsyncConnectionPool):
        raise RuntimeError("httpx2.AsyncHTTPTransport has no connection pool to guard")  # noqa: TRY004 - httpx2 changed
    limits = httpx2.Limits(max_connections=100, max_keepalive_connections=20)
    transport._pool = httpcore2.AsyncConnectionPool(
        ssl_context=httpx2.create_ssl_context(trust_env=False),
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry,
        network_backend=GuardedBackend(guard),
    )
    return transport


class AllowlistTransport(_TransportBase):
    """An httpx2 transport that checks every request URL (redirect hops included) before sending it,
    and connects only where ``guard`` allows (default: public addresses only).

    It also notes what a caller needs to tell an HTTP failure from a protocol one
    after the MCP SDK has wrapped it: the URL it refused, the status of the last
    redirect, and the statuses >= 300 that POSTs got.
    """

    def __init__(self, allowlist: UrlAllowlist, inner: Any = None, *, guard: NetGuard | None = None) -> None:
        self.allowlist = allowlist
        self.inner = inner if inner is not None else guarded_transport(guard if guard is not None else NetGuard())
        self.refused: UrlNotAllowed | None = None
        self.redirect_status: int | None = None
        self.statuses: list[int] = []

    def permits(self, request: Any) -> None:
        """Raise UrlNotAllowed unless this request may be sent."""
        self.allowlist.check(str(request.url))

    async def handle_async_request(self, request: Any) -> Any:
        try:
            self.permits(request)
        except UrlNotAllowed as exc:
            self.refused = exc
            raise
        try:
            response = await self.inner.handle_async_request(request)
        except AddressNotAllowed as exc:
            self.refused = UrlNotAllowed(str(request.url), str(exc))
            raise self.refused from exc
        status = response.status_code
        if 300 <= status < 400:
            self.redirect_status = status
        if status >= 300 and request.method == "POST":
            self.statuses.append(status)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def __aenter__(self) -> Self:
        await self.inner.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc: BaseException | None = None,
        tb: TracebackType | None = None,
    ) -> None:
        await self.inner.__aexit__(exc_type, exc, tb)


def mcp_http_client_factory(
    allowlist: UrlAllowlist, transport: AllowlistTransport | None = None, *, guard: NetGuard | None = None
) -> Any:
    """An ``httpx_client_factory`` for the MCP SDK whose clients go through an AllowlistTransport."""

    def factory(headers: dict[str, str] | None = None, timeout: Any = None, auth: Any = None) -> Any:
        return httpx2.AsyncClient(
            headers=headers,
            timeout=timeout if timeout is not None else httpx2.Timeout(30.0),
            auth=auth,
            transport=transport if transport is not None else AllowlistTransport(allowlist, guard=guard),
            follow_redirects=False,
            trust_env=False,
        )

    return factory
