"""A worker's KV-event subscription (backends/kv_subscriber.py) on real ZMQ sockets, against a
publisher that speaks as vLLM's ZmqEventPublisher does: [topic, seq (8 bytes), msgpack batch] on
a PUB socket, and a ROUTER replay socket answering (seq, payload) frames, then seq -1."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from backends.kv_subscriber import KVSubscriber
from harness import free_port
from policies.kv_index import KVIndex

TOPIC = b"kv"
END = (-1).to_bytes(8, "big", signed=True)


def stored(first: int, tokens: list[int], parent: int | None = None) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": list(range(first, first + len(tokens) // 4)),
            "parent_block_hash": parent, "token_ids": tokens, "block_size": 4, "lora_id": None, "medium": "GPU"}


class Publisher:
    """vLLM's publisher, by its wire: an XPUB (a PUB that also hears subscriptions) and a replay ROUTER."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.pub = ctx.socket(zmq.XPUB)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay_port = self.replay.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: list[tuple[int, bytes]] = []

    async def subscribed(self) -> None:
        await asyncio.wait_for(self.pub.recv(), 10)  # the subscription message

    async def publish(self, seq: int, events: list[Any], *, live: bool = True) -> None:
        payload = msgspec.msgpack.encode([0.0, events, 0])
        self.buffer.append((seq, payload))
        if live:
            await self.pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])

    async def serve_replay(self) -> None:
        client, _, start = await self.replay.recv_multipart()
        for seq, payload in self.buffer:
            if seq >= int.from_bytes(start, "big"):
                await self.replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
        await self.replay.send_multipart([client, b"", END, b""])

    def close(self) -> None:
        self.pub.close(0)
        self.replay.close(0)


async def until(check: Callable[[], bool], what: str) -> None:
    for _ in range(1000):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def run(body: Callable[[zmq.asyncio.Context, Publisher, KVIndex], Awaitable[None]]) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        publisher = Publisher(ctx)
        try:
            await body(ctx, publisher, KVIndex())
        finally:
            publisher.close()
            ctx.term()
    asyncio.run(main())


def _subscriber(ctx: zmq.asyncio.Context, pub: Publisher, index: KVIndex, replay: bool = True) -> KVSubscriber:
    return KVSubscriber(index, "w", f"tcp://127.0.0.1:{pub.port}", topic="kv", context=ctx,
                        replay_endpoint=f"tcp://127.0.0.1:{pub.replay_port}" if replay else None)


async def _started(sub: KVSubscriber, pub: Publisher) -> asyncio.Task[None]:
    task = asyncio.create_task(sub.run())
    await pub.subscribed()
    return task


def test_published_blocks_reach_the_index() -> None:
    async def body(ctx: zmq.asyncio.Context, pub: Publisher, index: KVIndex) -> None:
        sub = _subscriber(ctx, pub, index)
        task = await _started(sub, pub)
        await pub.publish(0, [stored(1, [1, 2, 3, 4, 5, 6, 7, 8])])
        await pub.publish(1, [stored(3, [9, 9, 9, 9], parent=2), {"type": "BlockRemoved", "block_hashes": [1]}])
        await until(lambda: sub.counts.messages == 2, "two messages")
        assert index.overlap([1, 2, 3, 4, 5, 6, 7, 8]) == {} and len(index) == 2  # block 1 removed: no prefix
        assert sub.counts.events == 3 and sub.counts.gaps == 0
        await stop(task)
    run(body)


def test_a_gap_is_replayed_from_the_replay_socket() -> None:
    async def body(ctx: zmq.asyncio.Context, pub: Publisher, index: KVIndex) -> None:
        sub = _subscriber(ctx, pub, index)
        task = await _started(sub, pub)
        await pub.publish(0, [stored(1, [1, 2, 3, 4])])
        await until(lambda: sub.counts.messages == 1, "the first message")
        await pub.publish(1, [stored(2, [5, 6, 7, 8], parent=1)], live=False)  # lost by the live socket
        replay = asyncio.create_task(pub.serve_replay())
        await pub.publish(2, [stored(3, [9, 10, 11, 12], parent=2)])
        await until(lambda: sub.counts.messages == 3, "the replayed and the live message")
        await replay
        assert index.overlap(list(range(1, 13))) == {"w": 12}
        assert (sub.counts.gaps, sub.counts.replayed, sub.counts.dropped) == (1, 1, 0)
        await stop(task)
    run(body)


def test_a_gap_without_replay_drops_the_workers_entries() -> None:
    async def body(ctx: zmq.asyncio.Context, pub: Publisher, index: KVIndex) -> None:
        sub = _subscriber(ctx, pub, index, replay=False)
        task = await _started(sub, pub)
        await pub.publish(0, [stored(1, [1, 2, 3, 4])])
        await pub.publish(5, [stored(9, [7, 7, 7, 7])])
        await until(lambda: sub.counts.messages == 2, "both messages")
        assert index.overlap([1, 2, 3, 4]) == {} and index.overlap([7, 7, 7, 7]) == {"w": 4}
        assert (sub.counts.gaps, sub.counts.dropped) == (1, 1)
        await stop(task)
    run(body)


def test_a_restarted_engine_and_garbage() -> None:
    async def body(ctx: zmq.asyncio.Context, pub: Publisher, index: KVIndex) -> None:
        sub = _subscriber(ctx, pub, index)
        task = await _started(sub, pub)
        await pub.publish(0, [stored(1, [1, 2, 3, 4])])
        await pub.publish(1, [stored(2, [5, 5, 5, 5])])
        await pub.pub.send_multipart([TOPIC, (2).to_bytes(8, "big"), b"\xc1 not msgpack"])
        await pub.pub.send_multipart([TOPIC, b"short"])
        await pub.publish(0, [stored(1, [8, 8, 8, 8])])  # seq back to 0: a new engine, an empty cache
        await until(lambda: sub.counts.messages == 4, "four messages")
        assert index.overlap([1, 2, 3, 4]) == {} and index.overlap([8, 8, 8, 8]) == {"w": 4}
        assert (sub.counts.bad, sub.counts.dropped) == (2, 1)
        await stop(task)
    run(body)


def test_an_unreachable_endpoint_is_quiet_and_stops_when_cancelled() -> None:
    async def main() -> None:
        sub = KVSubscriber(KVIndex(), "w", f"tcp://127.0.0.1:{free_port()}")
        task = asyncio.create_task(sub.run())
        await asyncio.sleep(0.2)  # nothing can arrive: the wait is the test
        assert not task.done() and sub.counts.messages == 0
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled()
    asyncio.run(main())
