"""A running router, checked from the openai SDK as a user would call it (after README command 1).

    .venv/bin/python scripts/smoke_sdk.py [--base-url http://127.0.0.1:8080/v1] [--model sim-chat]

Needs the SDK (``pip install -e '.[test]'``) and a router serving the sim pool
of config.example.toml: the ``[sim:...]`` markers in the inputs pace its
answers. Prints one line per check; exits 1 at the first that fails. The test
suite checks all of this and more; this is the same, by hand, on the real
command.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import openai


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    p.add_argument("--model", default="sim-chat")
    p.add_argument("--api-key", default="unused")
    args = p.parse_args(argv)
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    checks: list[tuple[str, Callable[[openai.OpenAI, argparse.Namespace], str]]] = [
        ("create, chain, retrieve, input items", _chain),
        ("a stream's deltas make its output_text", _stream),
        ("a reasoning stream", _reasoning),
        ("chat completions", _chat),
        ("unknown id: 404 response_not_found", _not_found),
        ("9 MB body over urllib (Connection: close): 413", _too_large),
        ("a stream its client leaves: stored cancelled, chained on", _left),
        ("a background response, cancelled: answers cancelled", _cancel),
    ]
    for name, check in checks:
        try:
            detail = check(client, args)
        except Exception as exc:  # noqa: BLE001 - reported, then exit 1
            print(f"FAIL {name}: {type(exc).__name__}: {exc}")
            return 1
        print(f"ok   {name}{': ' + detail if detail else ''}")
    return 0


def _chain(c: openai.OpenAI, a: argparse.Namespace) -> str:
    first = c.responses.create(model=a.model, input="Hello there [sim:tokens=12]")
    second = c.responses.create(model=a.model, input="And again [sim:tokens=5]", previous_response_id=first.id)
    assert first.status == second.status == "completed" and second.previous_response_id == first.id
    assert c.responses.retrieve(second.id).output_text == second.output_text
    items = c.responses.input_items.list(second.id)
    assert [i.type for i in items.data] == ["message"]
    return second.id


def _stream(c: openai.OpenAI, a: argparse.Namespace) -> str:
    deltas = []
    with c.responses.stream(model=a.model, input="Stream please [sim:tokens=50]") as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert len(deltas) == 50 and "".join(deltas) == final.output_text
    return f"{len(deltas)} deltas"


def _reasoning(c: openai.OpenAI, a: argparse.Namespace) -> str:
    pieces, done = [], None
    for event in c.responses.create(model=a.model, input="Think [sim:reason=30] [sim:tokens=10]", stream=True):
        if event.type == "response.reasoning_text.delta":
            pieces.append(event.delta)
        elif event.type == "response.completed":
            done = event.response
    assert done is not None
    reasoning = [item for item in done.output if item.type == "reasoning"]
    assert len(pieces) == 30 and reasoning and "".join(pieces) == "".join(p.text for p in reasoning[0].content or [])
    return f"{len(pieces)} reasoning deltas"


def _chat(c: openai.OpenAI, a: argparse.Namespace) -> str:
    answer = c.chat.completions.create(model=a.model, messages=[{"role": "user", "content": "hi [sim:tokens=4]"}])
    assert answer.choices[0].message.content
    return ""


def _not_found(c: openai.OpenAI, a: argparse.Namespace) -> str:
    try:
        c.responses.retrieve("resp_doesnotexist")
    except openai.NotFoundError as exc:
        assert isinstance(exc.body, dict) and exc.body["code"] == "response_not_found", exc.body
        return ""
    raise AssertionError("no 404")


def _too_large(c: openai.OpenAI, a: argparse.Namespace) -> str:
    body = json.dumps({"model": a.model, "input": "x" * (9 << 20)}).encode()
    request = urllib.request.Request(a.base_url.rstrip("/") + "/responses", data=body, headers={
        "content-type": "application/json", "authorization": f"Bearer {a.api_key}"})
    try:
        urllib.request.urlopen(request, timeout=60)
    except urllib.error.HTTPError as exc:
        error = json.loads(exc.read())["error"]
        assert exc.code == 413 and error["code"] == "request_too_large", error
        return ""
    raise AssertionError("no 413")


def _settled(c: openai.OpenAI, rid: str) -> openai.types.responses.Response:
    end = time.monotonic() + 15
    while True:
        try:
            stored = c.responses.retrieve(rid)
            if stored.status != "in_progress":
                return stored
        except openai.NotFoundError:
            pass
        assert time.monotonic() < end, f"{rid} did not settle"
        time.sleep(0.1)


def _left(c: openai.OpenAI, a: argparse.Namespace) -> str:
    stream = c.responses.create(model=a.model, input="[sim:tokens=2000] [sim:itl_ms=5]", stream=True)
    rid = None
    for n, event in enumerate(stream):
        if event.type == "response.created":
            rid = event.response.id
        if n > 8:
            break
    stream.close()
    assert rid is not None
    stored = _settled(c, rid)
    assert stored.status == "cancelled", stored.status
    after = c.responses.create(model=a.model, input="go on [sim:tokens=2]", previous_response_id=rid)
    assert after.status == "completed"
    return f"{len(stored.output_text)} characters kept"


def _cancel(c: openai.OpenAI, a: argparse.Namespace) -> str:
    queued = c.responses.create(model=a.model, input="[sim:tokens=2000] [sim:itl_ms=5]", background=True)
    time.sleep(0.5)
    status = c.responses.cancel(queued.id).status
    assert status == "cancelled", status
    return ""


if __name__ == "__main__":
    sys.exit(main())
