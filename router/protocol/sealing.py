"""Sealed blobs: router-made data a client carries and hands back unchanged.

A compaction summary (and anything else the router gives a client to send
back later) leaves as an opaque string the router alone can read, and comes
back refused if one byte changed, if it was sealed for another purpose, or
if no key the router holds opens it. AES-256-GCM (``cryptography``):

    blob = base64url(version | key id | nonce | ciphertext+tag)
    associated data = version | key id | "responses-router:" + purpose

The first key seals, every key opens, so keys rotate: put the new key first
and keep the old one while blobs sealed with it are still in clients' hands.
With no key configured a random per-process key is used (a warning is
logged): blobs then die with the process and are not shared by replicas.

``expand_compactions`` opens the ``compaction`` items of a prompt (it lives
here, low in the layers, so ``router/turns`` can call it).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
import time
from typing import Any

import orjson
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from router.protocol.errors import InvalidRequest
from router.protocol.ids import new_id
from router.protocol.items import Item

log = logging.getLogger("router.sealing")

VERSION = 1
KEY_BYTES = 32  # AES-256
_KEY_ID_BYTES = 4
_NONCE_BYTES = 12
_TAG_BYTES = 16
_HEADER = 1 + _KEY_ID_BYTES + _NONCE_BYTES
_AD_PREFIX = b"responses-router:"
MAX_BLOB_CHARS = 4 * 1024 * 1024  # longer input is refused before decoding

COMPACTION = "compaction"  # the purpose compaction summaries are sealed for
SUMMARY_PREFIX = "Summary of the earlier conversation: "


class SealError(Exception):
    """A blob that cannot be opened: altered, for another purpose, an unknown key, or not a blob.

    The message never carries the blob's content.
    """


def key_id(key: bytes) -> bytes:
    """A short public name of a key (not the key: a hash of it)."""
    return hashlib.sha256(b"responses-router sealing key id\0" + key).digest()[:_KEY_ID_BYTES]


def decode_key(text: str) -> bytes:
    """A configured key: base64 (standard or url-safe, padding optional) of 32 bytes."""
    raw = text.strip()
    try:
        key = base64.b64decode(raw.replace("-", "+").replace("_", "/") + "=" * (-len(raw) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("a sealing key must be base64 text") from None
    if len(key) != KEY_BYTES:
        raise ValueError(f"a sealing key must be {KEY_BYTES} bytes (base64 of 32 random bytes), got {len(key)}")
    return key


def new_key_text() -> str:
    """A fresh key in the form the config takes (``[sealing] keys``)."""
    return base64.b64encode(os.urandom(KEY_BYTES)).decode()


class Sealer:
    """Seals with the first key, opens with any of them. Immutable once made; safe to share."""

    def __init__(self, keys: list[bytes]) -> None:
        if not keys:
            raise ValueError("a Sealer needs at least one key")
        unique: list[bytes] = []
        for key in keys:
            if len(key) != KEY_BYTES:
                raise ValueError(f"a sealing key must be {KEY_BYTES} bytes, got {len(key)}")
            if key not in unique:
                unique.append(key)
        self._ciphers: dict[bytes, AESGCM] = {}
        for key in unique:
            kid = key_id(key)
            if kid in self._ciphers:
                raise ValueError("two sealing keys share a key id; generate a new key")
            self._ciphers[kid] = AESGCM(key)
        self._seal_id = key_id(unique[0])

    @classmethod
    def ephemeral(cls) -> Sealer:
        return cls([os.urandom(KEY_BYTES)])

    def seal(self, purpose: str, payload: dict[str, Any]) -> str:
        header = bytes([VERSION]) + self._seal_id
        nonce = os.urandom(_NONCE_BYTES)
        sealed = self._ciphers[self._seal_id].encrypt(nonce, orjson.dumps(payload), _ad(header, purpose))
        return base64.urlsafe_b64encode(header + nonce + sealed).rstrip(b"=").decode()

    def open(self, purpose: str, blob: Any) -> dict[str, Any]:
        if not isinstance(blob, str) or not blob or len(blob) > MAX_BLOB_CHARS:
            raise SealError("not a sealed blob")
        try:
            raw = base64.b64decode(blob + "=" * (-len(blob) % 4), altchars=b"-_", validate=True)
        except (binascii.Error, ValueError):
            raise SealError("not a sealed blob") from None
        if len(raw) < _HEADER + _TAG_BYTES:
            raise SealError("not a sealed blob")
        if raw[0] != VERSION:
            raise SealError("unknown sealed blob version")
        kid = raw[1:1 + _KEY_ID_BYTES]
        cipher = self._ciphers.get(kid)
        if cipher is None:
            raise SealError("sealed with a key this router does not hold")
        header = raw[:1 + _KEY_ID_BYTES]
        try:
            plain = cipher.decrypt(raw[1 + _KEY_ID_BYTES:_HEADER], raw[_HEADER:], _ad(header, purpose))
        except InvalidTag:
            raise SealError("the blob was altered or sealed for another purpose") from None
        try:
            payload = orjson.loads(plain)
        except orjson.JSONDecodeError:  # only a key holder could have sealed it; still never a crash
            raise SealError("the sealed payload is not a JSON object") from None
        if not isinstance(payload, dict):
            raise SealError("the sealed payload is not a JSON object")
        return payload


def _ad(header: bytes, purpose: str) -> bytes:
    return header + _AD_PREFIX + purpose.encode()


def make_sealer(keys: list[bytes]) -> Sealer:
    """The router's sealer: the configured keys, or a random per-process key (with a warning)."""
    if keys:
        return Sealer(keys)
    log.warning("sealing: no [sealing] keys configured; using a random per-process key. Compaction items "
                "and other sealed blobs will not open after a restart or on another replica. "
                "Set [sealing] keys = [\"<base64 of 32 random bytes>\"] (or keys_env).")
    return Sealer.ephemeral()


# -- compaction items -----------------------------------------------------------------


def expand_compactions(items: list[Item], sealer: Sealer, owner: str, *, first_input: int = 0) -> list[Item]:
    """The prompt with each ``compaction`` item replaced by the summary it seals, as a developer message.

    ``items``: history then this request's input; ``first_input``: where the input
    starts (errors name ``input[i]``; an item of the history names
    ``previous_response_id``). A blob that does not open, or that another owner
    made, is a 400. Items without compactions come back as they are.
    """
    if not any(item.get("type") == "compaction" for item in items):
        return items
    out: list[Item] = []
    for i, item in enumerate(items):
        if item.get("type") != "compaction":
            out.append(item)
            continue
        payload = _open_compaction(item, sealer, owner, i, first_input)
        summary = _summary_message(payload["summary"])
        keep = payload.get("keep_from")
        at = next((j for j, it in enumerate(out) if keep is not None and it.get("id") == keep), None)
        if at is None:
            out.append(summary)
        else:  # made by a create's context_management: it replaces everything before the turn it kept
            system = [it for it in out[:at] if it.get("type") == "message" and it.get("role") in ("system", "developer")
                      and not _is_summary(it)]
            out = [*system, summary, *out[at:]]
    return out


def _summary_message(summary: str) -> Item:
    return {"type": "message", "id": new_id("msg"), "role": "developer", "status": "completed",
            "content": [{"type": "input_text", "text": SUMMARY_PREFIX + summary}]}


def _is_summary(item: Item) -> bool:
    parts = item.get("content") or [{}]
    return isinstance(parts[0].get("text"), str) and parts[0]["text"].startswith(SUMMARY_PREFIX)


def seal_compaction(sealer: Sealer, owner: str, model: str, summary: str, *, keep_from: str | None = None) -> Item:
    """A ``compaction`` output item sealing ``summary``; ``keep_from``: the first item it did not replace."""
    item_id = new_id("cmpi")
    payload = {"summary": summary, "model": model, "owner": owner, "id": item_id, "created_at": int(time.time())}
    if keep_from is not None:
        payload["keep_from"] = keep_from
    return {"id": item_id, "type": "compaction", "encrypted_content": sealer.seal(COMPACTION, payload)}


def _open_compaction(item: Item, sealer: Sealer, owner: str, index: int, first_input: int) -> dict[str, Any]:
    if index >= first_input:
        where, param = f"input[{index - first_input}]", f"input[{index - first_input}].encrypted_content"
    else:
        where, param = f"history item {index} (from previous_response_id)", "previous_response_id"
    try:
        payload = sealer.open(COMPACTION, item.get("encrypted_content"))
    except SealError:
        payload = None
    summary = payload.get("summary") if payload is not None else None
    if payload is None or payload.get("owner") != owner or not isinstance(summary, str):
        raise InvalidRequest(
            f"{where}: the compaction item's encrypted_content could not be verified: it was altered, made for "
            "another account, or sealed with a key this router no longer holds.",
            param=param, code="invalid_encrypted_content",
        )
    return payload


# -- encrypted reasoning ------------------------------------------------------------------

REASONING = "reasoning"


def seal_reasoning(sealer: Sealer, owner: str, text: str) -> str:
    """Reasoning for a stateless client to carry back: only this router can read it, and only for this owner."""
    return sealer.seal(REASONING, {"owner": owner, "text": text})


def open_reasoning(items: list[Item], sealer: Sealer, owner: str, *, first_input: int = 0) -> list[Item]:
    """The prompt with each ``reasoning`` item's ``encrypted_content`` opened into its ``content``.

    A blob that does not open, or that another owner got, is a 400: never a
    crash, never shown as text.
    """
    if not any(item.get("type") == "reasoning" and item.get("encrypted_content") for item in items):
        return items
    out: list[Item] = []
    for i, item in enumerate(items):
        blob = item.get("encrypted_content") if item.get("type") == "reasoning" else None
        if not blob:
            out.append(item)
            continue
        try:
            payload = sealer.open(REASONING, blob)
        except SealError:
            payload = None
        text = payload.get("text") if payload is not None else None
        if payload is None or payload.get("owner") != owner or not isinstance(text, str):
            param = f"input[{i - first_input}].encrypted_content" if i >= first_input else "previous_response_id"
            raise InvalidRequest("a reasoning item's encrypted_content could not be verified: it was altered, made for "
                                 "another account, or sealed with a key this router no longer holds.",
                                 param=param, code="invalid_encrypted_content")
        out.append({**item, "content": [{"type": "reasoning_text", "text": text}]})
    return out
