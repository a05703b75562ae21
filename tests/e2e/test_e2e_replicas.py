"""Several router processes sharing one PostgreSQL, and routers that die mid-response."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from harness import RouterProcess, sim_pool_toml, start_router
from tests.conftest import MODEL
from tests.e2e.test_e2e_state import wait_for
from tests.support.pg import pg_dsn  # noqa: F401 - the fixture
from tests.support.streamrules import check_stream
from tests.support.waits import running_on_workers, wait_until

pytestmark = pytest.mark.e2e


def replica(tmp: Path, dsn: str, lease_s: float = 2.0) -> RouterProcess:
    store = f'[store]\nkind = "postgres"\ndsn = "{dsn}"\n[background]\nlease_s = {lease_s}\n'
    body = sim_pool_toml(replicas=1) + f'\n[[models]]\nname = "{MODEL}"\npool = "sim"\n'
    return start_router(tmp, body, store=store)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, pg_dsn: str) -> Iterator[tuple[RouterProcess, RouterProcess]]:  # noqa: F811
    a = replica(tmp_path_factory.mktemp("a"), pg_dsn)
    b = replica(tmp_path_factory.mktemp("b"), pg_dsn)
    yield a, b
    assert a.stop() == 0 and b.stop() == 0


def sdk(router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_create_on_one_replica_chain_on_the_other(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = map(sdk, pair)
    first = a.responses.create(model=MODEL, input="on a")
    second = b.responses.create(model=MODEL, input="on b [sim:echo]", previous_response_id=first.id)
    assert "on a" in second.output_text
    conv = b.conversations.create()
    a.responses.create(model=MODEL, input="in conv", conversation=conv.id)
    assert len(b.conversations.items.list(conv.id).data) == 2


def test_background_on_a_replayed_and_cancelled_from_b(pair) -> None:  # type: ignore[no-untyped-def]
    router_a, _ = pair
    a, b = map(sdk, pair)
    quick = a.responses.create(model=MODEL, input="short [sim:tokens=20] [sim:itl_ms=5]", background=True)
    with b.responses.stream(response_id=quick.id) as stream:  # follows live events logged by a
        final = stream.get_final_response()
    assert final.status == "completed" and len(final.output_text.split()) == 20
    long = a.responses.create(model=MODEL, input="long [sim:tokens=3000] [sim:itl_ms=20]", background=True)
    wait_for(b, long.id, {"in_progress"})
    assert b.responses.cancel(long.id).status == "cancelled"  # b waits until a has stopped it
    assert wait_for(b, long.id, {"cancelled"}).status == "cancelled"
    deadline = time.monotonic() + 10
    while running_on_workers(router_a) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running_on_workers(router_a) == 0, "a's worker kept generating after b cancelled"


def test_deleted_on_b_while_a_runs_it(pair) -> None:  # type: ignore[no-untyped-def]
    """a sees the delete at its next poll and stops; its last writes find nothing to update."""
    router_a, _ = pair
    a, b = map(sdk, pair)
    long = a.responses.create(model=MODEL, input="long [sim:tokens=3000] [sim:itl_ms=20]", background=True)
    wait_for(b, long.id, {"in_progress"})
    b.responses.delete(long.id)
    deadline = time.monotonic() + 10
    while running_on_workers(router_a) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running_on_workers(router_a) == 0, "a's worker kept generating for a response b deleted"
    # a's run says it stopped once its last writes are done: they had their chance to bring it back.
    wait_until(lambda: f"background response {long.id} was deleted while it ran; stopped" in router_a.log(), 10,
               "the stopped run's end in a's log")
    for client in (a, b):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(long.id)


def test_a_stream_is_stored_as_it_runs_and_seen_from_the_other_replica(pair) -> None:  # type: ignore[no-untyped-def]
    """A streamed ``store: true`` response is there from its start: ``in_progress`` (no output yet) on
    either replica, and not chained on until it ends (a 400, not a 404); then ``completed``."""
    a, b = map(sdk, pair)
    with a.responses.stream(model=MODEL, input="[sim:tokens=60] [sim:itl_ms=30]") as stream:
        deltas = 0
        for event in stream:
            if event.type == "response.created":
                rid = event.response.id
            elif event.type == "response.output_text.delta":
                deltas += 1
                if deltas == 5:
                    break
        running = b.responses.retrieve(rid)
        # No output yet, or a checkpoint's (each second): what it had then, its message incomplete.
        assert running.status == "in_progress" and all(item.status == "incomplete" for item in running.output)
        assert b.responses.input_items.list(rid).data[0].content[0].text == "[sim:tokens=60] [sim:itl_ms=30]"
        with pytest.raises(openai.BadRequestError) as chained:
            b.responses.create(model=MODEL, input="next", previous_response_id=rid)
        assert chained.value.code == "previous_response_in_progress"
        final = stream.get_final_response()
    for client in (a, b):
        stored = client.responses.retrieve(rid)
        assert stored.status == "completed" and stored.output_text == final.output_text and len(final.output_text.split()) == 60
    assert b.responses.create(model=MODEL, input="next", previous_response_id=rid).status == "completed"


def test_a_stream_deleted_while_it_runs_ends_and_stays_deleted(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = map(sdk, pair)
    with a.responses.stream(model=MODEL, input="[sim:tokens=40] [sim:itl_ms=20]") as stream:
        rid = next(e for e in stream if e.type == "response.created").response.id
        wait_for(b, rid, {"in_progress"})
        b.responses.delete(rid)
        final = stream.get_final_response()  # the client that streams it sees it to its end
    assert final.status == "completed" and len(final.output_text.split()) == 40
    for client in (a, b):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(rid)


def test_a_dead_replicas_stream_fails(tmp_path: Path, pg_dsn: str) -> None:  # noqa: F811
    """The replica streaming a stored response dies: its lease runs out and the survivor's sweep marks it failed."""
    doomed = replica(tmp_path / "doomed", pg_dsn, lease_s=1.0)
    survivor = replica(tmp_path / "survivor", pg_dsn, lease_s=1.0)
    try:
        stream = sdk(doomed).responses.create(model=MODEL, input="[sim:tokens=3000] [sim:itl_ms=20]", stream=True)
        rid = next(e for e in stream if e.type == "response.created").response.id
        wait_for(sdk(survivor), rid, {"in_progress"})
        time.sleep(1.5)  # past one lease (its length is what is tested): the doomed replica renews it while it lives
        assert sdk(survivor).responses.retrieve(rid).status == "in_progress"
        os.kill(doomed.proc.pid, signal.SIGKILL)
        doomed.proc.wait()
        failed = wait_for(sdk(survivor), rid, {"failed"}, timeout=20)
        assert failed.error.code == "server_error" and "stopped" in failed.error.message
        # What the stream had made up to its last checkpoint (every second) is kept, its message incomplete.
        assert failed.output_text and failed.output[0].status == "incomplete"
    finally:
        survivor.stop()


def test_a_dead_replicas_background_response_fails(tmp_path: Path, pg_dsn: str) -> None:  # noqa: F811
    doomed = replica(tmp_path / "doomed", pg_dsn, lease_s=1.0)
    survivor = replica(tmp_path / "survivor", pg_dsn, lease_s=1.0)
    try:
        kept = sdk(doomed).responses.create(model=MODEL, input="kept")
        running = sdk(doomed).responses.create(model=MODEL, input="[sim:tokens=3000] [sim:itl_ms=20]", background=True)
        wait_for(sdk(survivor), running.id, {"in_progress"})
        os.kill(doomed.proc.pid, signal.SIGKILL)
        doomed.proc.wait()
        failed = wait_for(sdk(survivor), running.id, {"failed"}, timeout=20)
        assert failed.error.code == "server_error" and "stopped" in failed.error.message
        assert sdk(survivor).responses.retrieve(kept.id).status == "completed"
    finally:
        survivor.stop()


def test_a_stopping_router_ends_what_runs_past_its_grace_and_says_so(tmp_path: Path) -> None:
    """SIGTERM with ``shutdown_grace_s = 1``: a stream still running then ends with ``error`` +
    ``response.failed`` (router_stopped) and is stored failed with what it had; a create still
    waiting for its worker answers 503 router_stopped. Before, uvicorn cut both with nothing said,
    and the stream was stored as if its client had left."""
    body = sim_pool_toml(replicas=1) + f'\n[[models]]\nname = "{MODEL}"\npool = "sim"\n'
    router = start_router(tmp_path, body, server="shutdown_grace_s = 1")
    client = sdk(router)
    waiting: dict[str, Any] = {}

    def create() -> None:
        try:
            client.responses.create(model=MODEL, input="[sim:tokens=3000] [sim:itl_ms=20]")
        except openai.APIStatusError as exc:
            waiting["error"] = exc

    events = []
    for event in client.responses.create(model=MODEL, input="[sim:tokens=3000] [sim:itl_ms=20]", stream=True):
        events.append(event.model_dump())
        if len(events) == 10:
            other = threading.Thread(target=create)
            other.start()
            wait_until(lambda: running_on_workers(router) == 2, 10, "the create out to the worker, beside the stream")
            router.proc.send_signal(signal.SIGTERM)
    final = check_stream(events)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"] and events[-2]["code"] == "router_stopped"
    other.join(30)
    assert waiting["error"].status_code == 503 and waiting["error"].body["code"] == "router_stopped"
    assert router.proc.wait(30) == 0
    restarted = start_router(tmp_path, body)
    try:
        stored = sdk(restarted).responses.retrieve(final["id"])
        assert stored.status == "failed" and stored.error.code == "server_error" and "stopped" in stored.error.message
        assert stored.output_text and stored.output[0].status == "incomplete"
    finally:
        assert restarted.stop() == 0


def test_sqlite_router_killed_and_restarted(tmp_path: Path) -> None:
    body = sim_pool_toml(replicas=1) + f'\n[[models]]\nname = "{MODEL}"\npool = "sim"\n'
    router = start_router(tmp_path, body)
    client = sdk(router)
    kept = client.responses.create(model=MODEL, input="kept")
    running = client.responses.create(model=MODEL, input="[sim:tokens=3000] [sim:itl_ms=20]", background=True)
    wait_for(client, running.id, {"in_progress"})
    with client.responses.retrieve(running.id, stream=True) as replay:  # read back from the store's event log
        words = 0
        for event in replay:  # a few dozen words produced and logged
            words += event.type == "response.output_text.delta"
            if words >= 24:
                break
    os.kill(router.proc.pid, signal.SIGKILL)
    router.proc.wait()
    restarted = start_router(tmp_path, body)  # the same config, store file and port range
    try:
        client = sdk(restarted)
        failed = client.responses.retrieve(running.id)
        assert failed.status == "failed" and failed.error.code == "server_error"
        # It keeps what its log says it had produced, as its replay shows it.
        replayed = [e.model_dump() for e in client.responses.retrieve(running.id, stream=True)]
        logged = "".join(e["delta"] for e in replayed if e["type"] == "response.output_text.delta")
        assert logged and failed.output_text == logged and failed.output[0].status == "incomplete"
        assert replayed[-1]["type"] == "response.failed" and replayed[-1]["response"]["output"][0]["status"] == "incomplete"
        assert client.responses.retrieve(kept.id).output_text
        assert client.responses.create(model=MODEL, input="go on", previous_response_id=kept.id).status == "completed"
    finally:
        assert restarted.stop() == 0


def test_sqlite_router_killed_mid_stream(tmp_path: Path) -> None:
    """A stored stream cut by a kill -9: after the restart it is ``failed``, not a 404, with what its
    client had received up to the last checkpoint (every second), its message ``incomplete``."""
    body = sim_pool_toml(replicas=1) + f'\n[[models]]\nname = "{MODEL}"\npool = "sim"\n'
    router = start_router(tmp_path, body)
    client = sdk(router)
    stream = client.responses.create(model=MODEL, input="[sim:tokens=3000] [sim:itl_ms=20]", stream=True)
    rid = next(e for e in stream if e.type == "response.created").response.id
    received = ""
    for n, event in enumerate(stream):
        if event.type == "response.output_text.delta":
            received += event.delta
        if n % 20 == 0 and client.responses.retrieve(rid).output_text:  # a checkpoint stored some output
            break
    os.kill(router.proc.pid, signal.SIGKILL)
    router.proc.wait()
    restarted = start_router(tmp_path, body)
    try:
        failed = sdk(restarted).responses.retrieve(rid)
        assert failed.status == "failed" and failed.error.code == "server_error"
        kept = failed.output_text
        assert kept and received.startswith(kept), (kept[:80], received[:80])
        assert len(kept) >= len(received) // 4  # most of it: at most a second behind what was sent
        assert failed.output[0].status == "incomplete"
    finally:
        assert restarted.stop() == 0
