"""Which addresses the router's own fetches may connect to, judged after name resolution.

A URL's host is only a name: ``vm`` in /etc/hosts, ``127.1``, a DNS name that
answers 10.0.0.5 now and a public address a second later. So nothing here judges
a host by its spelling. ``NetGuard.resolve`` looks a name up once, refuses it if
ANY address it resolves to is not public (see ``refusal``) and lies outside the
networks the operator permits, and returns exactly the addresses it checked: the
caller connects to those, so there is no second lookup for DNS rebinding to
answer differently. The HTTP clients plug it in as an aiohttp resolver
(web_search pages) and an httpcore2 network backend (MCP); TLS still verifies the
certificate for the host name.

An origin the operator configured (a named MCP server) can be *trusted*: its
addresses are resolved but not judged, since the operator chose it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field, replace

__all__ = ["AddressNotAllowed", "Lookup", "NetGuard", "refusal", "system_lookup"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# host, port, family -> (family, numeric address) pairs, as getaddrinfo gives them.
Lookup = Callable[[str, int, int], Awaitable[list[tuple[int, str]]]]

# Cloud instance metadata (AWS, GCP, Azure, ...; AWS's IPv6 one): refused even inside a permitted network.
METADATA = frozenset({ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")})
_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")
_SHARED = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # the well-known prefix: an IPv4 address in the low 32 bits


class AddressNotAllowed(Exception):
    """A host resolved to (or is) an address the router's fetches may not reach."""

    def __init__(self, host: str, address: str, reason: str) -> None:
        spelled = address if host.strip("[]") == address else f"{host} resolves to {address}"
        super().__init__(f"{spelled}, a {reason} address; only public addresses may be fetched")
        self.host = host
        self.address = address
        self.reason = reason


def embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries (mapped, 6to4, NAT64), which is where packets would go."""
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def refusal(address: IPAddress) -> str | None:
    """Why this address is not a public one ("loopback", "private", ...), or None when it is."""
    inner = embedded_ipv4(address)
    if inner is not None:
        why = refusal(inner)
        return f"{why} (inside IPv6)" if why else None
    if address in METADATA:
        return "cloud metadata"
    checks = (
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("unspecified", address.is_unspecified),
        ("this-network", address in _THIS_NETWORK),
        ("shared (CGNAT)", address in _SHARED),
        ("reserved", address.is_reserved),
        ("private", address.is_private),
        ("non-global", not address.is_global),
    )
    return next((name for name, hit in checks if hit), None)


async def system_lookup(host: str, port: int, family: int = socket.AF_UNSPEC) -> list[tuple[int, str]]:
    """The system resolver (/etc/hosts, DNS) through the event loop; distinct addresses in its order."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, family=family, type=socket.SOCK_STREAM)
    out: list[tuple[int, str]] = []
    for fam, _type, _proto, _name, sockaddr in infos:
        entry = (int(fam), str(sockaddr[0]))
        if entry not in out:
            out.append(entry)
    return out


def _host_key(host: str) -> str:
    return host.strip("[]").rstrip(".").lower()


def _literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


@dataclass(frozen=True)
class NetGuard:
    """Public addresses only, plus the networks in ``permitted``; ``trusted`` (host, port) pairs are not judged."""

    permitted: tuple[IPNetwork, ...] = ()
    trusted: frozenset[tuple[str, int]] = frozenset()
    lookup: Lookup = field(default=system_lookup, compare=False)

    @classmethod
    def permitting(cls, networks: Iterable[str], lookup: Lookup = system_lookup) -> NetGuard:
        return cls(tuple(ipaddress.ip_network(n) for n in networks), lookup=lookup)

    def trusting(self, host: str, port: int) -> NetGuard:
        """This guard, with one operator-configured origin exempt from the address check."""
        return replace(self, trusted=self.trusted | {(_host_key(host), port)})

    def trusts(self, host: str, port: int) -> bool:
        return (_host_key(host), port) in self.trusted

    def check(self, host: str, address: str) -> None:
        """Raise AddressNotAllowed unless ``host`` may be reached at ``address``."""
        ip = ipaddress.ip_address(address)
        why = refusal(ip)
        if why is None:
            return
        forms = [a for a in (ip, embedded_ipv4(ip)) if a is not None]
        if not METADATA.intersection(forms) and any(a in net for net in self.permitted for a in forms):
            return
        raise AddressNotAllowed(host, address, why)

    def check_literal(self, host: str, port: int) -> None:
        """For clients that connect to an IP-literal host without asking a resolver: judge it here."""
        ip = _literal(host)
        if ip is not None and not self.trusts(host, port):
            self.check(host, str(ip))

    async def resolve(self, host: str, port: int, family: int = socket.AF_UNSPEC) -> list[tuple[int, str]]:
        """Look ``host`` up once; every address must pass (a name with one bad address is refused whole).

        Returns the (family, address) pairs checked, to connect to as they are. OSError if it does not resolve.
        """
        ip = _literal(host)
        if ip is not None:
            addresses: list[tuple[int, str]] = [(socket.AF_INET if ip.version == 4 else socket.AF_INET6, str(ip))]
        else:
            addresses = await self.lookup(host, port, family)
            if not addresses:
                raise OSError(f"{host} resolves to no address")
        if not self.trusts(host, port):
            for _family, address in addresses:
                self.check(host, address)
        return addresses
