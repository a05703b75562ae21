"""The simulated worker's KV-cache events, published as vLLM publishes them.

With ``--kv-events-endpoint`` (and a prefix cache, ``--kv-cache-blocks``), every block the
cache stores is a ``BlockStored`` and every block its LRU evicts a ``BlockRemoved``, sent on a
ZMQ PUB socket as vLLM's ``ZmqEventPublisher`` sends them (vllm/distributed/kv_events.py): a
message of three frames, the topic, the sequence number (8 bytes, big-endian, from 0) and a
msgpack event batch ``[ts, [event, ...], data_parallel_rank]``. Each event is a map tagged by
``type`` (``--kv-events-encoding map``, vLLM 0.32) or a positional array with the tag first
(``array``, older versions). An endpoint with ``*`` is bound (subscribers connect), any other is
connected to, as vLLM does. ``--kv-events-replay-endpoint`` binds a ROUTER socket that answers a
request (the start sequence, 8 bytes) with the kept batches from there, ``(seq, payload)`` each,
then seq -1 and an empty payload. Hashes are the low 64 bits of the cache's block hashes, as
vLLM's are of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque

import msgspec
import zmq
import zmq.asyncio

END = (-1).to_bytes(8, "big", signed=True)
KEPT = 10_000  # batches kept for replay (vLLM's buffer_steps)


def _hash64(digest: bytes) -> int:
    return int.from_bytes(digest[-8:], "big")


class KVEventPublisher:
    """Batches the cache's changes into event messages and publishes them."""

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
                 encoding: str = "map", block_size: int = 16) -> None:
        if encoding not in ("map", "array"):
            raise ValueError(f"encoding must be map or array, not {encoding!r}")
        self.context = zmq.asyncio.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if "*" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self.pub.bind(endpoint)
        else:
            self.pub.connect(endpoint)
        self.replay = None
        if replay_endpoint is not None:
            self.replay = self.context.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.bind(replay_endpoint)
        self.topic = topic.encode()
        self.encoding = encoding
        self.block_size = block_size
        self.seq = 0
        self.kept: deque[tuple[int, bytes]] = deque(maxlen=KEPT)
        self._encode = msgspec.msgpack.Encoder().encode
        self._replay_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Serve replay requests (from the running event loop)."""
        if self.replay is not None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    def changed(self, stored: list[tuple[bytes, bytes | None, list[int]]], removed: list[bytes]) -> None:
        """The cache's listener: one batch, stored blocks first (backends/sim/cache.py)."""
        events: list[object] = [self._stored(h, parent, tokens) for h, parent, tokens in stored]
        if removed:
            events.append(self._event("BlockRemoved", block_hashes=[_hash64(h) for h in removed], medium="GPU",
                                      group_idx=0))
        payload = self._encode([time.time(), events, 0])
        seq, self.seq = self.seq, self.seq + 1
        self.kept.append((seq, payload))
        with contextlib.suppress(zmq.Again):  # no subscriber, or one past the high-water mark: dropped, as PUB does
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)

    def _stored(self, digest: bytes, parent: bytes | None, tokens: list[int]) -> object:
        return self._event("BlockStored", block_hashes=[_hash64(digest)],
                           parent_block_hash=_hash64(parent) if parent is not None else None, token_ids=tokens,
                           block_size=self.block_size, lora_id=None, medium="GPU", lora_name=None,
                           extra_keys=[None], group_idx=0, kv_cache_spec_kind="full_attention")

    def _event(self, kind: str, **fields: object) -> object:
        if self.encoding == "map":
            return {"type": kind, **fields}
        return [kind, *fields.values()]  # positional: the fields in vLLM's declared order

    async def _serve_replay(self) -> None:
        assert self.replay is not None
        while True:
            frames = await self.replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.kept):
                if seq >= first:
                    await self.replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
            await self.replay.send_multipart([client, b"", END, b""])

    def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
        self.pub.close(0)
        if self.replay is not None:
            self.replay.close(0)
        self.context.term()
