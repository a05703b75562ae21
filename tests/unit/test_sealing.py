"""Sealed blobs (router/protocol/sealing.py) and the [sealing] config section."""

from __future__ import annotations

import base64
import logging
import os

import pytest

from router.config import ConfigError, SealingConfig, parse_config
from router.protocol.errors import InvalidRequest
from router.protocol.items import normalize_input
from router.protocol.sealing import (
    COMPACTION,
    SUMMARY_PREFIX,
    Sealer,
    SealError,
    decode_key,
    expand_compactions,
    make_sealer,
    new_key_text,
)

KEY_A = os.urandom(32)
KEY_B = os.urandom(32)
PAYLOAD = {"summary": "the user wants a haiku about rain", "owner": "alice", "n": [1, 2, 3]}


def _raw(blob: str) -> bytes:
    return base64.urlsafe_b64decode(blob + "=" * (-len(blob) % 4))


def _text(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def test_round_trip() -> None:
    sealer = Sealer([KEY_A])
    blob = sealer.seal("compaction", PAYLOAD)
    assert set(blob) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
    assert "haiku" not in blob and b"haiku" not in _raw(blob)
    assert sealer.open("compaction", blob) == PAYLOAD
    assert sealer.seal("compaction", PAYLOAD) != blob  # a fresh nonce each time


def test_any_flipped_byte_is_refused() -> None:
    sealer = Sealer([KEY_A])
    raw = _raw(sealer.seal("compaction", PAYLOAD))
    for i in range(len(raw)):
        for bit in (0x01, 0x80):
            tampered = bytearray(raw)
            tampered[i] ^= bit
            with pytest.raises(SealError) as info:
                sealer.open("compaction", _text(bytes(tampered)))
            assert "haiku" not in str(info.value)


def test_truncated_or_extended_blob_is_refused() -> None:
    sealer = Sealer([KEY_A])
    raw = _raw(sealer.seal("compaction", PAYLOAD))
    for bad in (raw[:-1], raw[:20], raw + b"\0", raw[1:]):
        with pytest.raises(SealError):
            sealer.open("compaction", _text(bad))


def test_wrong_purpose_is_refused() -> None:
    sealer = Sealer([KEY_A])
    blob = sealer.seal("compaction", PAYLOAD)
    for purpose in ("reasoning", "compactio", "compaction ", ""):
        with pytest.raises(SealError):
            sealer.open(purpose, blob)


def test_rotation_old_key_opens_new_key_seals() -> None:
    old = Sealer([KEY_A])
    old_blob = old.seal("compaction", PAYLOAD)
    rotated = Sealer([KEY_B, KEY_A])
    assert rotated.open("compaction", old_blob) == PAYLOAD
    new_blob = rotated.seal("compaction", {"x": 1})
    assert Sealer([KEY_B]).open("compaction", new_blob) == {"x": 1}  # sealed with the first key
    with pytest.raises(SealError):
        old.open("compaction", new_blob)  # a router without the new key
    with pytest.raises(SealError):
        Sealer([KEY_B]).open("compaction", old_blob)  # the old key retired


def test_unknown_key_is_refused() -> None:
    blob = Sealer([KEY_A]).seal("compaction", PAYLOAD)
    with pytest.raises(SealError, match="key"):
        Sealer([KEY_B]).open("compaction", blob)


@pytest.mark.parametrize("garbage", [
    "", "x", "not base64 at all!", "====", "AAAA", "é" * 40, _text(os.urandom(64)), _text(b"\x01" + os.urandom(60)),
    None, 12, ["a"], {"a": 1}, "A" * 5_000_000,
])
def test_garbage_is_refused_not_crashed(garbage: object) -> None:
    with pytest.raises(SealError):
        Sealer([KEY_A]).open("compaction", garbage)


def test_keys_must_be_32_bytes() -> None:
    with pytest.raises(ValueError):
        Sealer([])
    with pytest.raises(ValueError):
        Sealer([b"short"])
    assert len(decode_key(new_key_text())) == 32
    url_safe = base64.urlsafe_b64encode(KEY_A).decode().rstrip("=")
    assert decode_key(url_safe) == KEY_A
    with pytest.raises(ValueError):
        decode_key(base64.b64encode(b"16 bytes only!!!").decode())
    with pytest.raises(ValueError):
        decode_key("not*base64")


def test_no_keys_gives_an_ephemeral_sealer_and_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="router.sealing"):
        a, b = make_sealer([]), make_sealer([])
    assert "random per-process key" in caplog.text and "restart" in caplog.text
    with pytest.raises(SealError):
        b.open("compaction", a.seal("compaction", PAYLOAD))
    assert make_sealer([KEY_A]).open("compaction", Sealer([KEY_A]).seal("compaction", PAYLOAD)) == PAYLOAD


# -- config -------------------------------------------------------------------------

POOLS = '[[pools]]\nname = "p"\nengine = "sim"\nmodel = "m"\nurls = ["http://127.0.0.1:1"]\n[[models]]\nname = "m"\npool = "p"\n'


def test_config_keys_and_keys_env(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = base64.b64encode(KEY_A).decode(), base64.b64encode(KEY_B).decode()
    assert parse_config(POOLS).sealing.resolved_keys() == []
    cfg = parse_config(f'[sealing]\nkeys = ["{a}", "{b}"]\n' + POOLS)
    assert cfg.sealing.resolved_keys() == [KEY_A, KEY_B]
    monkeypatch.setenv("SEAL_KEYS", f"{b}, {a}")
    cfg = parse_config('[sealing]\nkeys_env = "SEAL_KEYS"\n' + POOLS)
    assert cfg.sealing.resolved_keys() == [KEY_B, KEY_A]
    monkeypatch.delenv("SEAL_KEYS")
    with pytest.raises(ConfigError, match="SEAL_KEYS"):
        cfg.sealing.resolved_keys()
    monkeypatch.setenv("SEAL_KEYS", "short")
    with pytest.raises(ConfigError, match=r"sealing\.keys_env"):
        cfg.sealing.resolved_keys()


def test_config_refuses_bad_keys() -> None:
    with pytest.raises(ConfigError, match=r"sealing\.keys\[0\]: .*32 bytes"):
        parse_config('[sealing]\nkeys = ["c2hvcnQ="]\n' + POOLS)
    with pytest.raises(ConfigError, match="at most one"):
        parse_config(f'[sealing]\nkeys = ["{new_key_text()}"]\nkeys_env = "X"\n' + POOLS)
    with pytest.raises(ConfigError, match=r"sealing\.nope: unknown key"):
        parse_config('[sealing]\nnope = 1\n' + POOLS)
    assert SealingConfig().keys == []


# -- compaction items -----------------------------------------------------------------


def _compaction(sealer: Sealer, owner: str = "alice", summary: str = "they talked about rain") -> dict:
    blob = sealer.seal(COMPACTION, {"summary": summary, "owner": owner, "model": "m"})
    return {"type": "compaction", "encrypted_content": blob}


def test_compaction_items_normalize_and_expand() -> None:
    sealer = Sealer([KEY_A])
    items = normalize_input([_compaction(sealer), {"role": "user", "content": "and now?"}])
    assert items[0]["type"] == "compaction" and items[0]["id"].startswith("cmpi_")
    out = expand_compactions(items, sealer, "alice")
    assert [i["type"] for i in out] == ["message", "message"]
    assert out[0]["role"] == "developer"
    assert out[0]["content"] == [{"type": "input_text", "text": SUMMARY_PREFIX + "they talked about rain"}]
    assert out[1] is items[1]
    plain = normalize_input("hi")
    assert expand_compactions(plain, sealer, "alice") is plain


def test_compaction_item_needs_encrypted_content() -> None:
    with pytest.raises(InvalidRequest) as info:
        normalize_input([{"type": "compaction"}])
    assert info.value.param == "input[0].encrypted_content"


@pytest.mark.parametrize("case", ["tampered", "foreign owner", "other key", "other purpose", "garbage"])
def test_bad_compaction_is_a_400_naming_the_index(case: str) -> None:
    sealer = Sealer([KEY_A])
    item = _compaction(sealer)
    if case == "tampered":
        raw = bytearray(_raw(item["encrypted_content"]))
        raw[-5] ^= 1
        item["encrypted_content"] = _text(bytes(raw))
    elif case == "foreign owner":
        item = _compaction(sealer, owner="mallory")
    elif case == "other key":
        item = _compaction(Sealer([KEY_B]))
    elif case == "other purpose":
        item["encrypted_content"] = sealer.seal("reasoning", {"summary": "x", "owner": "alice"})
    else:
        item["encrypted_content"] = "garbage"
    history = normalize_input("earlier")
    items = history + normalize_input([{"role": "user", "content": "hi"}, item])
    with pytest.raises(InvalidRequest) as info:
        expand_compactions(items, sealer, "alice", first_input=len(history))
    err = info.value
    assert err.status == 400 and err.code == "invalid_encrypted_content"
    assert err.param == "input[1].encrypted_content" and "input[1]" in err.message
    assert "rain" not in err.message


def test_bad_compaction_in_history_names_previous_response_id() -> None:
    sealer = Sealer([KEY_A])
    history = normalize_input([_compaction(Sealer([KEY_B]))])
    with pytest.raises(InvalidRequest) as info:
        expand_compactions(history + normalize_input("hi"), sealer, "alice", first_input=1)
    assert info.value.param == "previous_response_id"
