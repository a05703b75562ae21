"""One worker's KV-cache events, subscribed over ZMQ and applied to its pool's index.

vLLM and SGLang publish on a PUB socket (``--kv-events-config``: an ``endpoint`` such as
``tcp://*:5557``, which the engine binds; this subscriber connects to it) a message of three
frames: topic, sequence number, msgpack batch (backends/kv_events.py). Each message's events go
to the pool's ``KVIndex`` (policies/kv_index.py) under the worker's url, at once, in the event
loop: a message is a few microseconds of decoding and dict updates, never an await.

What can go wrong degrades routing to load alone for that worker, never a request:

- a gap in the sequence (``seq > last + 1``: the socket's high-water mark dropped some): with a
  ``replay_endpoint`` (a ROUTER socket, vLLM's replay), the missed batches are asked for from
  ``last + 1``; without one, or when replay does not answer in time or no longer holds them, the
  worker's entries are dropped and build up again from new events;
- a subscription that starts after the engine did (a replica started late): the batches before
  its first are asked of the replay socket too, from 0, as far as the engine still keeps them;
- a sequence that goes back (``seq <= last``): the engine restarted, with an empty cache: its
  entries are dropped (and so does ``Pool`` when it sees the worker come back);
- a message that does not decode: counted, logged once per worker, skipped;
- an endpoint that cannot be reached, or an engine that never publishes: nothing arrives, the
  worker holds nothing in the index (``counts.messages`` stays 0).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import zmq
import zmq.asyncio

from backends.kv_events import BadMessage, decode_batch, sequence
from policies.kv_index import KVIndex

log = logging.getLogger("router.kv_events")

REPLAY_END = -1


@dataclass
class Counts:
    """What one worker's subscription saw (the metrics read these)."""

    messages: int = 0
    events: int = 0
    bad: int = 0  # messages that did not decode
    gaps: int = 0
    replayed: int = 0  # batches recovered through replay
    dropped: int = 0  # times the worker's entries were dropped (a gap not replayed, a restart)


class KVSubscriber:
    """Subscribes to ``endpoint`` and keeps ``worker``'s entries of ``index`` current."""

    def __init__(self, index: KVIndex, worker: str, endpoint: str, *, replay_endpoint: str | None = None,
                 topic: str = "", replay_timeout_s: float = 1.0, context: zmq.asyncio.Context | None = None) -> None:
        self.index = index
        self.worker = worker
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.replay_timeout_s = replay_timeout_s
        self.counts = Counts()
        self.last: int | None = None  # the last sequence number applied
        self._context = context or zmq.asyncio.Context.instance()
        self._warned_bad = False

    async def run(self) -> None:
        """Until cancelled: receive, check the sequence, apply."""
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        try:
            while True:
                frames = await sub.recv_multipart()
                await self.receive(frames)
        finally:
            sub.close()

    async def receive(self, frames: list[bytes]) -> None:
        """One message: ``[topic, seq, payload]``."""
        try:
            if len(frames) != 3:
                raise BadMessage(f"a message of {len(frames)} frames, not 3")
            seq = sequence(frames[1])
        except BadMessage as exc:
            self._bad(exc)
            return
        last = self.last
        if last is None and seq > 0 and self.replay_endpoint is not None:
            # Subscribed after the engine began: what it stored before is asked of the replay socket.
            await self._replay(0, seq)
        elif last is not None and seq <= last:
            log.info("KV events from %s went back from %d to %d: the engine restarted; its entries dropped",
                     self.worker, last, seq)
            self._drop()
        elif last is not None and seq > last + 1:
            self.counts.gaps += 1
            if not await self._replay(last + 1, seq):
                log.warning("KV events from %s: %d to %d missed and not replayed; its entries dropped",
                            self.worker, last + 1, seq - 1)
                self._drop()
        self._apply(seq, frames[2])

    def _apply(self, seq: int, payload: bytes) -> None:
        self.last = seq
        self.counts.messages += 1
        try:
            events = decode_batch(payload)
        except BadMessage as exc:
            self._bad(exc)
            return
        self.counts.events += len(events)
        self.index.apply_all(self.worker, events)

    def _drop(self) -> None:
        self.index.forget(self.worker)
        self.counts.dropped += 1

    def _bad(self, exc: BadMessage) -> None:
        self.counts.bad += 1
        if not self._warned_bad:
            self._warned_bad = True
            log.warning("KV events from %s: a message that does not decode (%s); such messages are skipped",
                        self.worker, exc)

    async def _replay(self, start: int, until: int) -> bool:
        """Ask the replay socket for batches ``start`` .. ``until - 1`` and apply them; True when it
        gave them all."""
        if self.replay_endpoint is None:
            return False
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            expected = start
            async with asyncio.timeout(self.replay_timeout_s):
                while True:
                    frames = await dealer.recv_multipart()
                    if len(frames) != 3:
                        return False
                    seq = sequence(frames[1])
                    if seq == REPLAY_END:
                        return expected >= until
                    if seq >= until:
                        continue  # the live socket delivers it
                    if seq != expected:
                        return False  # the replay buffer no longer holds what was missed
                    self._apply(seq, frames[2])
                    self.counts.replayed += 1
                    expected += 1
        except (TimeoutError, BadMessage, zmq.ZMQError):
            return False
        finally:
            dealer.close()
