"""Throwaway TLS material for tests: a CA, a server certificate for 127.0.0.1 / localhost, a client
certificate, and a TLS-terminating proxy run as its own process (a worker "behind TLS", as nginx
in front of vLLM would put it)."""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from harness import ROOT, free_port


@dataclass(frozen=True)
class Pki:
    """Paths of PEM files: ``ca`` signs ``server_cert`` (127.0.0.1, localhost) and ``client_cert``;
    ``other_ca`` signs nothing here (a bundle that does not trust the server)."""

    ca: Path
    other_ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


def _ca(cn: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return cert, key


def _leaf(cn: str, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, *, server: bool) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
                              critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False))
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def make_pki(folder: Path) -> Pki:
    folder.mkdir(parents=True, exist_ok=True)
    ca, ca_key = _ca("responses-router test CA")
    other, _ = _ca("a CA nobody here uses")
    server, server_key = _leaf("sim-worker", ca, ca_key, server=True)
    client, client_key = _leaf("router-client", ca, ca_key, server=False)
    pki = Pki(folder / "ca.pem", folder / "other-ca.pem", folder / "server.pem", folder / "server-key.pem",
              folder / "client.pem", folder / "client-key.pem")
    pem = serialization.Encoding.PEM
    pki.ca.write_bytes(ca.public_bytes(pem))
    pki.other_ca.write_bytes(other.public_bytes(pem))
    pki.server_cert.write_bytes(server.public_bytes(pem))
    _write_key(server_key, pki.server_key)
    pki.client_cert.write_bytes(client.public_bytes(pem))
    _write_key(client_key, pki.client_key)
    return pki


# The proxy: TLS on its port (a client certificate signed by the CA required when one is given),
# each connection piped to the plain-HTTP worker. One line per accepted connection on stdout,
# naming the client certificate's CN, so a test can see that TLS was spoken.
PROXY = r'''
import asyncio, ssl, sys

cert, key, client_ca, port, upstream = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
ctx.load_cert_chain(cert, key)
if client_ca:
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(client_ca)


async def pipe(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        writer.close()


async def handle(reader, writer):
    peer = writer.get_extra_info("peercert") or {}
    cn = next((v for rdn in peer.get("subject", ()) for k, v in rdn if k == "commonName"), "-")
    print(f"tls connection, client certificate {cn}, {writer.get_extra_info('ssl_object').version()}", flush=True)
    up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream)
    await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", port, ssl=ctx)
    print("proxy ready", flush=True)
    async with server:
        await server.serve_forever()

asyncio.run(main())
'''


class TlsProxy:
    """``python -c PROXY`` on a free port in front of ``upstream_port``; its stdout goes to ``log``."""

    def __init__(self, pki: Pki, upstream_port: int, log: Path, *, require_client_cert: bool = True) -> None:
        self.port = free_port()
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PROXY, str(pki.server_cert), str(pki.server_key),
             str(pki.ca) if require_client_cert else "", str(self.port), str(upstream_port)],
            cwd=ROOT, stdout=open(log, "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while "proxy ready" not in log.read_text():
            assert self.proc.poll() is None, f"the TLS proxy exited: {log.read_text()}"
            assert time.monotonic() < deadline, "the TLS proxy did not start"
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def connections(self) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if line.startswith("tls connection")]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
