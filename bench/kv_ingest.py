"""KV-cache event ingestion: blocks per second through the decoder and the index, on one core.

    .venv/bin/python bench/kv_ingest.py [--blocks 200000] [--block-size 16] [--max-blocks 100000]

Messages are built as vLLM publishes them (an event batch of BlockStored maps, msgpack) before
the clock starts; then each is decoded (backends/kv_events.py) and applied to one index
(policies/kv_index.py), as the subscriber does in the router's loop. ``--max-blocks`` below
``--blocks`` makes the index evict as it goes. Also printed: one lookup of an 8k-token prompt
that every block of matches (the most a lookup hashes). Target: at least 100k blocks/s.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402

from backends.kv_events import decode_batch  # noqa: E402
from policies.kv_index import KVIndex  # noqa: E402

BLOCKS_PER_EVENT = 10
EVENTS_PER_BATCH = 5


def messages(n_blocks: int, size: int, rng: random.Random) -> list[bytes]:
    out, handle = [], 1
    while handle <= n_blocks:
        events = []
        for _ in range(EVENTS_PER_BATCH):
            events.append({"type": "BlockStored", "block_hashes": list(range(handle, handle + BLOCKS_PER_EVENT)),
                           "parent_block_hash": None, "token_ids": [rng.randrange(50_000) for _ in range(size * BLOCKS_PER_EVENT)],
                           "block_size": size, "lora_id": None, "medium": "GPU", "lora_name": None,
                           "extra_keys": [None] * BLOCKS_PER_EVENT, "group_idx": 0})
            handle += BLOCKS_PER_EVENT
        out.append(msgspec.msgpack.encode([time.time(), events, 0]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=200_000)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-blocks", type=int, default=1_000_000)
    args = p.parse_args(argv)
    rng = random.Random(7)
    batch = messages(args.blocks, args.block_size, rng)
    index = KVIndex(max_blocks=args.max_blocks)
    workers = [f"http://w{i}" for i in range(4)]
    start = time.perf_counter()
    for i, payload in enumerate(batch):
        index.apply_all(workers[i % len(workers)], decode_batch(payload))
    took = time.perf_counter() - start
    blocks = len(batch) * EVENTS_PER_BATCH * BLOCKS_PER_EVENT
    prompt = [rng.randrange(50_000) for _ in range(8192 // args.block_size * args.block_size)]
    n = len(prompt) // args.block_size
    index.apply_all("http://w0", decode_batch(msgspec.msgpack.encode([0.0, [{
        "type": "BlockStored", "block_hashes": list(range(-n, 0)), "parent_block_hash": None, "token_ids": prompt,
        "block_size": args.block_size, "medium": "GPU"}], 0])))
    lookups = 200
    t = time.perf_counter()
    for _ in range(lookups):
        assert index.overlap(prompt)["http://w0"] == len(prompt)
    lookup_us = (time.perf_counter() - t) / lookups * 1e6
    print(f"{blocks:,} blocks in {took:.3f} s: {blocks / took:,.0f} blocks/s (target >= 100,000); "
          f"{len(index):,} held, {index.evicted:,} evicted")
    print(f"lookup of an 8k-token prompt, every block a match: {lookup_us:,.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
