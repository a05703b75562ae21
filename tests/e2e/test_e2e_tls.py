"""TLS to workers, through a real router: a sim worker (``responses-router sim``) behind a TLS proxy
that asks for a client certificate; Responses create (JSON and stream), the chat passthrough and
health over it; a worker whose certificate is not trusted, and an https URL on a plain-HTTP worker,
fail clearly; TLS files that cannot work stop start-up with one line."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from harness import ROOT, RouterProcess, free_port, http_status, start_router
from tests.support.tls_certs import Pki, TlsProxy, make_pki

pytestmark = pytest.mark.e2e

MODEL = "sim-model"


@dataclass
class TlsSetup:
    router: RouterProcess
    proxy: TlsProxy
    sim_port: int
    pki: Pki


def _pool(name: str, url: str, tls: str = "") -> str:
    return f"""
[[pools]]
name = "{name}"
engine = "sim"
model = "{MODEL}"
urls = ["{url}"]
health_interval_s = 0.5
{tls}
[[models]]
name = "{name}"
pool = "{name}"
"""


def _start_sim(log: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "router", "sim", "--port", str(port), "--model", MODEL],
                            cwd=ROOT, stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while http_status(f"http://127.0.0.1:{port}/health") != 200:
        assert proc.poll() is None, f"the sim exited: {log.read_text()}"
        assert time.monotonic() < deadline, "the sim did not start"
        time.sleep(0.05)
    return proc, port


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsSetup]:
    tmp = tmp_path_factory.mktemp("tls")
    pki = make_pki(tmp / "pki")
    sim, sim_port = _start_sim(tmp / "sim.log")
    proxy = TlsProxy(pki, sim_port, tmp / "proxy.log")
    # Paths relative to the config file, as an operator writes them.
    client = 'tls_cert_file = "pki/client.pem"\ntls_key_file = "pki/client-key.pem"\n'
    body = (_pool("trusted", proxy.url, 'tls_ca_file = "pki/ca.pem"\n' + client)
            + _pool("untrusted", proxy.url, 'tls_ca_file = "pki/other-ca.pem"\n' + client)
            + _pool("plain", f"https://127.0.0.1:{sim_port}"))
    router = start_router(tmp, body)
    try:
        yield TlsSetup(router, proxy, sim_port, pki)
    finally:
        code = router.stop()
        proxy.stop()
        sim.terminate()
        sim.wait(timeout=10)
        assert code == 0, router.log()


def _health(router: RouterProcess) -> dict[str, dict]:
    """/health's pools by name (it answers 503 while a pool is down: the untrusted one is)."""
    try:
        with urllib.request.urlopen(router.base_url + "/health") as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:
        assert exc.code == 503
        body = exc.read()
    return {p["name"]: p for p in json.loads(body)["pools"]}


def _wait_for(predicate, timeout: float = 15.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_responses_over_tls_json_and_stream(tls: TlsSetup) -> None:
    client = openai.OpenAI(base_url=tls.router.base_url + "/v1", api_key="x", max_retries=0, timeout=30)
    resp = client.responses.create(model="trusted", input="[sim:tokens=5] over TLS")
    assert resp.status == "completed" and resp.output_text and resp.usage is not None and resp.usage.output_tokens == 5
    with client.responses.stream(model="trusted", input="[sim:tokens=7] a stream over TLS") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and "".join(deltas) == final.output_text and len(deltas) == 7
    chained = client.responses.create(model="trusted", input="and on", previous_response_id=resp.id)
    assert chained.status == "completed"
    # Every connection the proxy took was TLS with the router's client certificate: the health
    # checks' and the model calls' alike (both on backends/wire.py, so they may share one).
    lines = tls.proxy.connections()
    assert lines and all("client certificate router-client" in line for line in lines), lines


def test_the_passthrough_over_tls(tls: TlsSetup) -> None:
    body = {"model": "trusted", "messages": [{"role": "user", "content": "[sim:tokens=4] hi"}]}
    req = urllib.request.Request(tls.router.base_url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        answer = json.loads(resp.read())
    assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] == 4
    req = urllib.request.Request(tls.router.base_url + "/v1/chat/completions",
                                 data=json.dumps({**body, "stream": True}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        text = resp.read().decode()
    frames = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]" and len(frames) >= 5


def test_health_and_the_start_up_line_over_tls(tls: TlsSetup) -> None:
    pools = _health(tls.router)
    trusted = pools["trusted"]
    assert trusted["status"] == "ok" and trusted["workers"][0]["url"] == tls.proxy.url and trusted["workers"][0]["healthy"]
    log = tls.router.log()
    line = next(line for line in log.splitlines() if "pool trusted (sim, attached)" in line)
    assert "1/1 workers answer" in line and f"model '{MODEL}' listed by 1/1" in line and "nothing missing" in line


def test_a_worker_whose_certificate_is_not_trusted_fails_clearly(tls: TlsSetup) -> None:
    worker = _health(tls.router)["untrusted"]["workers"][0]
    assert not worker["healthy"]
    assert "certificate is not trusted" in worker["last_error"] and "tls_ca_file" in worker["last_error"]
    line = next(line for line in tls.router.log().splitlines() if "pool untrusted (sim, attached)" in line)
    assert "WARNING" in line and "0/1 workers answer" in line and "certificate is not trusted" in line
    client = openai.OpenAI(base_url=tls.router.base_url + "/v1", api_key="x", max_retries=0, timeout=30)
    with pytest.raises(openai.APIStatusError) as err:
        client.responses.create(model="untrusted", input="hello")
    assert err.value.status_code == 503
    error = err.value.body
    assert isinstance(error, dict) and error["code"] == "no_healthy_worker" and error["type"] and "message" in error


def test_an_https_url_on_a_plain_http_worker_fails_clearly(tls: TlsSetup) -> None:
    worker = _health(tls.router)["plain"]["workers"][0]
    assert not worker["healthy"] and "TLS handshake failed" in worker["last_error"], worker


def _start_up_error(tmp: Path, body: str) -> str:
    router = start_router(tmp, body, wait=False)
    assert router.proc.wait(timeout=60) == 2, router.log()
    lines = [line for line in router.log().splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_tls_files_that_cannot_work_stop_start_up(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    url = "https://127.0.0.1:1"
    line = _start_up_error(tmp_path / "a", _pool("p", url, 'tls_ca_file = "missing.pem"'))
    assert line.startswith("responses-router: pools[0].tls_ca_file: cannot read ") and "missing.pem" in line
    line = _start_up_error(tmp_path / "b", _pool("p", url, f'tls_ca_file = "{pki.server_key}"'))
    assert line.startswith("responses-router: pools[0].tls_ca_file: ") and "no PEM certificate" in line
    mismatched = f'tls_ca_file = "{pki.ca}"\ntls_cert_file = "{pki.client_cert}"\ntls_key_file = "{pki.server_key}"'
    line = _start_up_error(tmp_path / "c", _pool("p", url, mismatched))
    assert line.startswith("responses-router: pools[0].tls_cert_file: ") and "does not match" in line
    line = _start_up_error(tmp_path / "d", _pool("p", url, f'tls_key_file = "{pki.client_key}"'))
    assert "pools[0].tls_key_file: a client key needs its certificate" in line
    line = _start_up_error(tmp_path / "e", _pool("p", "http://127.0.0.1:1", f'tls_ca_file = "{pki.ca}"'))
    assert "pools[0].tls_ca_file: TLS settings are for https workers" in line


def test_an_unreachable_https_worker_is_no_start_up_error(tmp_path: Path) -> None:
    """A worker that is down at start-up is reported, not refused: it may come up later."""
    router = start_router(tmp_path, _pool("p", f"https://127.0.0.1:{free_port()}"))
    try:
        status = http_status(router.base_url + "/health")
        assert status == 503
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(
                router.base_url + "/v1/responses", data=b'{"model": "p", "input": "x"}',
                headers={"Content-Type": "application/json"}), timeout=10)
        assert err.value.code == 503 and json.loads(err.value.read())["error"]["code"] == "no_healthy_worker"
        assert _wait_for(lambda: "pool p (sim, attached): 0/1 workers answer" in router.log())
    finally:
        assert router.stop() == 0
