"""Each kind of config mistake stops start-up with one readable line naming the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness import ROOT
from router.config import ConfigError, load_config, parse_config

GOOD = """
[server]
port = 8081

[[pools]]
name = "sim"
engine = "sim"
model = "sim-model"
[pools.managed]
replicas = 2

[[models]]
name = "chat"
pool = "sim"
"""


def error_of(text: str) -> str:
    with pytest.raises(ConfigError) as err:
        parse_config(text, source="cfg.toml")
    message = str(err.value)
    assert "\n" not in message and message.startswith("cfg.toml: ")
    return message.removeprefix("cfg.toml: ")


def test_good_config_and_defaults() -> None:
    config = parse_config(GOOD)
    assert config.server.port == 8081 and config.server.host == "127.0.0.1"
    assert config.pools[0].managed is not None and config.pools[0].managed.replicas == 2
    assert config.store.kind == "sqlite" and config.auth.keys == []


def test_the_example_config_is_valid() -> None:
    config = load_config(ROOT / "config.example.toml")
    assert [m.name for m in config.models] == ["sim-chat"]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (("[server]\nport = 8081", "[server]\nport = 8081\nprot = 1"), "server.prot: unknown key"),
        (("port = 8081", 'port = "eighty"'), "server.port: input should be a valid integer"),
        (("port = 8081", "port = 70000"), "server.port: input should be less than or equal to 65535"),
        # Quoted numbers and booleans are type errors, as docs/configuration.md promises, not coerced.
        (("port = 8081", 'port = "8081"'), "server.port: input should be a valid integer (got '8081')"),
        (("replicas = 2", 'replicas = "2"'), "pools[0].managed.replicas: input should be a valid integer"),
        (("port = 8081", 'port = 8081\nshutdown_grace_s = "1"'), "server.shutdown_grace_s: input should be a valid number"),
        (("port = 8081", 'port = 8081\n[tools]\nmax_turns = 2.0'), "tools.max_turns: input should be a valid integer"),
        (('engine = "sim"', 'engine = "tgi"'), "pools[0].engine: input should be 'vllm', 'sglang' or 'sim' (got 'tgi')"),
        (('pool = "sim"', 'pool = "gpu"'), "models[0].pool: no pool named 'gpu' (pools: sim)"),
        (("replicas = 2", "replicas = 0"), "pools[0].managed.replicas: input should be greater than or equal to 1"),
        (("[pools.managed]\nreplicas = 2", ""), "pools[0]: give exactly one of urls or [pools.managed]"),
        (("[pools.managed]\nreplicas = 2", 'urls = ["ftp://x"]'), "pools[0]: url 'ftp://x' must start with http:// or https://"),
        (('model = "sim-model"\n', ""), "pools[0].model: required key is missing"),
        (("port = 8081", "port = 8081\n[auth]\nkeys = [{name='a', key='short'}]"), "auth.keys[0].key: string should have at least 8 characters"),
        (("port = 8081", "port ="), "not valid TOML"),
        (("replicas = 2", "replicas = 2\ngpus = [0, 1, 2]"), "pools[0].managed: 3 gpus do not split evenly between 2 replicas"),
        (("port = 8081", "port = 8081\n[auth]\nkeys = [{name='a'}]"), "auth.keys[0]: give exactly one of key, key_sha256 or key_env"),
        (("port = 8081", "port = 8081\n[auth]\nkeys = [{name='a', key_sha256='abc'}]"), "auth.keys[0].key_sha256: string should match"),
        (("port = 8081", "port = 8081\n[auth]\nadmin_key = 'short'"), "auth.admin_key: must be at least 8 characters"),
    ],
)
def test_each_mistake_names_its_key(change: tuple[str, str], expected: str) -> None:
    old, new = change
    assert old in GOOD
    assert error_of(GOOD.replace(old, new, 1)).startswith(expected)


def test_duplicate_names() -> None:
    doubled = GOOD + '\n[[models]]\nname = "chat"\npool = "sim"\n'
    assert error_of(doubled) == "two models share a name"


@pytest.mark.parametrize(("auth", "expected"), [
    ("keys = [{name = 'a', key = 'sk-same-12345'}, {name = 'b', key = 'sk-same-12345'}]",
     "auth.keys: 'a' and 'b' have the same key"),
    ("keys = [{name = 'a', key = 'sk-same-12345'}]\nadmin_key = 'sk-same-12345'", "auth.admin_key: it is also a client key"),
])
def test_keys_that_would_mix_owners_stop_start_up(tmp_path: Path, auth: str, expected: str) -> None:
    """One key under two names would hand one owner's responses to the other (the later name won)."""
    cfg = tmp_path / "keys.toml"
    cfg.write_text(GOOD.replace("port = 8081", f"port = 8081\n[auth]\n{auth}", 1))
    run = subprocess.run([sys.executable, "-m", "router", "--config", str(cfg)], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [f"responses-router: {expected}"]


def test_cli_prints_one_line_and_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(GOOD.replace('pool = "sim"', 'pool = "gpu"'))
    run = subprocess.run([sys.executable, "-m", "router", "--config", str(bad)], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [f"responses-router: {bad}: models[0].pool: no pool named 'gpu' (pools: sim)"]
    missing = subprocess.run([sys.executable, "-m", "router", "--config", str(tmp_path / "nope.toml")], cwd=ROOT,
                             capture_output=True, text=True, timeout=30)
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
    assert "cannot read" in missing.stderr
