"""The address guard of the router's own fetches: what it refuses, and that connections go where it checked.

Only loopback is ever connected to. Names are resolved either by an injected lookup or, where
the system resolver is used, only for numeric spellings and names /etc/hosts maps to 127.x (no DNS).
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from hypothesis import given
from hypothesis import strategies as st

from harness import free_port
from router.config import ConfigError, parse_config
from router.tools.allowlist import GuardedBackend, UrlAllowlist, UrlNotAllowed, mcp_http_client_factory
from router.tools.netguard import AddressNotAllowed, NetGuard, refusal, system_lookup
from router.tools.web_search import GuardedResolver, HttpJsonSearch
from tests.support.fake_search import FakeSearch


def _loopback_names() -> list[str]:
    """Names this machine's /etc/hosts maps to 127.x: safe to resolve for real (no DNS query)."""
    names: list[str] = []
    for line in Path("/etc/hosts").read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) >= 2 and fields[0].startswith("127."):
            names += fields[1:]
    return names


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("127.0.0.1", "loopback"),
        ("127.255.0.9", "loopback"),
        ("::1", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("fd12::1", "private"),
        ("169.254.1.1", "link-local"),
        ("fe80::1", "link-local"),
        ("169.254.169.254", "cloud metadata"),
        ("fd00:ec2::254", "cloud metadata"),
        ("100.64.0.1", "shared (CGNAT)"),
        ("0.1.2.3", "this-network"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("ff0e::1", "multicast"),
        ("240.0.0.1", "reserved"),
        ("::7f00:1", "reserved"),  # IPv4-compatible (deprecated)
        ("::ffff:127.0.0.1", "loopback (inside IPv6)"),
        ("::ffff:10.0.0.1", "private (inside IPv6)"),
        ("2002:7f00:1::", "loopback (inside IPv6)"),  # 6to4
        ("64:ff9b::a9fe:a9fe", "cloud metadata (inside IPv6)"),  # NAT64
        ("8.8.8.8", None),
        ("2001:4860:4860::8888", None),
        ("::ffff:8.8.8.8", None),
        ("64:ff9b::808:808", None),
    ],
)
def test_refusal_names_why(address: str, reason: str | None) -> None:
    assert refusal(ipaddress.ip_address(address)) == reason


@given(st.ip_addresses(v=4))
def test_ipv4_inside_ipv6_is_judged_as_the_ipv4(v4: ipaddress.IPv4Address) -> None:
    verdict = refusal(v4) is None
    mapped = ipaddress.IPv6Address("::ffff:" + str(v4))
    sixtofour = ipaddress.IPv6Address((0x2002 << 112) | (int(v4) << 80))
    nat64 = ipaddress.IPv6Address(int(ipaddress.IPv6Address("64:ff9b::")) | int(v4))
    assert [refusal(a) is None for a in (mapped, sixtofour, nat64)] == [verdict] * 3


@given(st.ip_addresses())
def test_what_passes_is_global_unicast(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
    if refusal(address) is None:
        inner = getattr(address, "ipv4_mapped", None) or getattr(address, "sixtofour", None)
        judged = inner or address
        assert judged.is_global and not judged.is_multicast and not judged.is_private


NON_PUBLIC = ["127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16", "100.64.0.0/10",
              "0.0.0.0/8", "fc00::/7", "fe80::/10", "::ffff:127.0.0.0/104", "2002:a00::/24"]


@given(st.sampled_from(NON_PUBLIC).flatmap(lambda net: st.ip_addresses(network=net)))
def test_non_public_ranges_are_refused(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
    assert refusal(address) is not None


def test_permitted_networks_but_never_metadata() -> None:
    guard = NetGuard.permitting(["127.0.0.0/8", "169.254.0.0/16"])
    for ok in ("127.0.0.2", "::ffff:127.0.0.1", "169.254.1.1", "8.8.8.8"):
        guard.check("h", ok)
    for bad in ("10.0.0.1", "::1", "169.254.169.254"):
        with pytest.raises(AddressNotAllowed):
            guard.check("h", bad)
    everything = NetGuard.permitting(["0.0.0.0/0", "::/0"])
    everything.check("h", "10.0.0.1")
    for metadata in ("169.254.169.254", "fd00:ec2::254", "::ffff:169.254.169.254"):
        with pytest.raises(AddressNotAllowed, match="cloud metadata"):
            everything.check("h", metadata)


class Answers:
    """An injected resolver: fixed answers per name, and a count of the questions."""

    def __init__(self, answers: dict[str, list[str]]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    async def __call__(self, host: str, port: int, family: int) -> list[tuple[int, str]]:
        self.asked.append(host)
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, a) for a in self.answers[host]]


def test_resolve_refuses_a_name_with_any_bad_address() -> None:
    lookup = Answers({"mixed.test": ["8.8.8.8", "127.0.0.1"], "public.test": ["8.8.8.8", "2001:4860:4860::8888"]})
    guard = NetGuard(lookup=lookup)
    with pytest.raises(AddressNotAllowed, match=r"mixed\.test resolves to 127\.0\.0\.1, a loopback address"):
        asyncio.run(guard.resolve("mixed.test", 80))
    assert asyncio.run(guard.resolve("public.test", 443)) == [(socket.AF_INET, "8.8.8.8"),
                                                             (socket.AF_INET6, "2001:4860:4860::8888")]
    # An origin the operator configured is not judged; the same host on another port is.
    trusted = guard.trusting("MIXED.test.", 80)
    both = [(socket.AF_INET, "8.8.8.8"), (socket.AF_INET, "127.0.0.1")]
    assert asyncio.run(trusted.resolve("mixed.test", 80)) == both
    with pytest.raises(AddressNotAllowed):
        asyncio.run(trusted.resolve("mixed.test", 81))
    # IP literals are judged as they are, without a lookup.
    with pytest.raises(AddressNotAllowed):
        asyncio.run(guard.resolve("[::1]", 80))
    assert lookup.asked == ["mixed.test", "public.test", "mixed.test", "mixed.test"]


def test_loopback_spellings_are_refused_after_resolution() -> None:
    """Numeric forms the system resolver accepts, and /etc/hosts names: all resolve to loopback, all refused."""
    hosts = ["127.1", "2130706433", "0x7f000001", "0177.0.0.1", "[::1]", "[::ffff:127.0.0.1]", *_loopback_names()]
    guard = NetGuard()

    async def verdicts() -> list[str]:
        out = []
        for host in hosts:
            with pytest.raises(AddressNotAllowed) as err:
                await guard.resolve(host, 80)
            out.append(err.value.reason)
        return out

    assert set(asyncio.run(verdicts())) <= {"loopback", "loopback (inside IPv6)"}
    permitted = NetGuard.permitting(["127.0.0.0/8", "::1/128"])
    assert asyncio.run(permitted.resolve("127.1", 80)) == [(socket.AF_INET, "127.0.0.1")]
    assert asyncio.run(system_lookup("2130706433", 80)) == [(socket.AF_INET, "127.0.0.1")]


# -- connections go to the address that was checked --------------------------------------------------


@pytest.fixture(scope="module")
def twins() -> Iterator[tuple[FakeSearch, FakeSearch]]:
    """Two servers on one port: the page on 127.0.0.2 (permitted), the secret on 127.0.0.1 (not).

    The name "vm" (/etc/hosts: 127.0.0.1) is answered 127.0.0.2 by the injected lookup, so a client that
    looked the name up again, or connected by name, would reach the secret instead.
    """
    port = free_port()
    with FakeSearch(host="127.0.0.2", port=port) as page, FakeSearch(port=port) as secret:
        yield page, secret


def _guard() -> tuple[NetGuard, Answers]:
    lookup = Answers({"vm": ["127.0.0.2"]})
    return NetGuard.permitting(["127.0.0.2/32"], lookup=lookup), lookup


def test_aiohttp_connects_to_the_checked_address(twins: tuple[FakeSearch, FakeSearch]) -> None:
    page, secret = twins
    guard, lookup = _guard()
    url = f"http://vm:{page.port}/page/2"
    allow = UrlAllowlist([f"http://vm:{page.port}/"])
    search = HttpJsonSearch(page.search_url, timeout_s=5, allowlist=allow, guard=guard)
    assert asyncio.run(search.open_page(url)) == "plain text page two"
    assert lookup.asked == ["vm"] and page.host_headers[f"vm:{page.port}"] >= 1
    refusing = HttpJsonSearch(page.search_url, timeout_s=5, allowlist=allow, guard=NetGuard(lookup=lookup))
    with pytest.raises(UrlNotAllowed, match=r"vm resolves to 127\.0\.0\.2, a loopback address"):
        asyncio.run(refusing.open_page(url))
    assert secret.hits["/page/2"] == 0


def test_httpx_connects_to_the_checked_address(twins: tuple[FakeSearch, FakeSearch]) -> None:
    page, secret = twins
    guard, lookup = _guard()
    allow = UrlAllowlist([f"http://vm:{page.port}/"])

    async def get(g: NetGuard) -> str:
        async with mcp_http_client_factory(allow, guard=g)() as client:
            response = await client.get(f"http://vm:{page.port}/page/2")
            return response.text

    assert asyncio.run(get(guard)) == "plain text page two"
    assert lookup.asked == ["vm"] and page.host_headers[f"vm:{page.port}"] >= 1
    with pytest.raises(UrlNotAllowed, match=r"vm resolves to 127\.0\.0\.2"):
        asyncio.run(get(NetGuard(lookup=lookup)))
    assert secret.hits["/page/2"] == 0


def _tls(name: str) -> tuple[ssl.SSLContext, ssl.SSLContext, list[str | None]]:
    """A server context with a certificate for ``name`` only, a client context trusting it, and the SNIs seen."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    pem = cert.public_bytes(serialization.Encoding.PEM)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "c.pem").write_bytes(pem)
        private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        (Path(tmp) / "k.pem").write_bytes(private)
        server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server.load_cert_chain(Path(tmp) / "c.pem", Path(tmp) / "k.pem")
    seen: list[str | None] = []
    server.sni_callback = lambda _sock, sni, _ctx: seen.append(sni)  # type: ignore[assignment,return-value]
    client = ssl.create_default_context(cadata=pem.decode())
    return server, client, seen


def test_tls_is_verified_for_the_name_not_the_address() -> None:
    """The connection goes to the checked address; SNI and the certificate check stay on the host name."""
    import httpcore2

    server_ctx, client_ctx, seen = _tls("vm")
    with FakeSearch(host="127.0.0.2", ssl_context=server_ctx) as page:
        guard, lookup = _guard()
        url = f"https://vm:{page.port}/page/2"

        async def both() -> list[bytes]:
            connector = aiohttp.TCPConnector(resolver=GuardedResolver(guard), ssl=client_ctx)
            async with aiohttp.ClientSession(connector=connector) as session, session.get(url) as resp:
                first = await resp.read()
            pool = httpcore2.AsyncConnectionPool(ssl_context=client_ctx, network_backend=GuardedBackend(guard))
            async with pool:
                second = (await pool.request("GET", url)).content
            return [first, second]

        assert asyncio.run(both()) == [b"plain text page two"] * 2
        assert seen == ["vm", "vm"] and lookup.asked == ["vm", "vm"]


# -- config -------------------------------------------------------------------------------------------

BASE = """
[[pools]]
name = "p"
engine = "sim"
model = "m"
urls = ["http://127.0.0.1:1"]
[[models]]
name = "m"
pool = "p"
"""


def test_private_networks_config() -> None:
    config = parse_config(BASE + '[tools]\nprivate_networks = ["127.0.0.0/8", "fd00::/8"]\n')
    assert config.tools.private_networks == ["127.0.0.0/8", "fd00::/8"]
    assert parse_config(BASE).tools.private_networks == []
    with pytest.raises(ConfigError, match=r"tools\.private_networks: '10\.0\.0\.1/8': 10\.0\.0\.1/8 has host bits set"):
        parse_config(BASE + '[tools]\nprivate_networks = ["10.0.0.1/8"]\n')
    with pytest.raises(ConfigError, match=r"tools\.web_search\.allow_private_results: unknown key"):
        parse_config(BASE + '[tools.web_search]\nurl = "http://127.0.0.1:1/s"\nallow_private_results = true\n')
