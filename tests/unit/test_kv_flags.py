"""The flags a managed pool with KV events gets (backends/engines.py), with plain data."""

from __future__ import annotations

import json

from backends.engines import LaunchOptions, kv_event_endpoints, launch_command


def _config(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--kv-events-config") + 1])


def test_each_engine_publishes_on_the_routers_sockets_named_by_its_port() -> None:
    options = LaunchOptions(kv_events_dir="/run/rr")
    for engine in ("vllm", "sglang", "sim"):
        argv = launch_command(engine, [], host="127.0.0.1", port=18101, model="m", extra=[], options=options)
        config = _config(argv)
        assert (config["endpoint"], config["replay_endpoint"]) == kv_event_endpoints("/run/rr", 18101)
        assert config["enable_kv_cache_events"] is True and config["topic"] == "kv"
    vllm = launch_command("vllm", [], host="h", port=1, model="m", extra=[], options=options)
    assert "--enable-prefix-caching" in vllm
    sim = launch_command("sim", [], host="h", port=1, model="m", extra=[], options=options)
    assert sim[sim.index("--kv-cache-blocks") + 1] == "4096"


def test_what_the_user_gave_wins_and_nothing_without_kv_events() -> None:
    options = LaunchOptions(kv_events_dir="/run/rr")
    mine = launch_command("sim", [], host="h", port=1, model="m", options=options,
                          extra=["--kv-cache-blocks", "64", "--kv-events-config", "{}"])
    assert mine.count("--kv-cache-blocks") == 1 and mine.count("--kv-events-config") == 1 and mine[-1] == "{}"
    assert "--no-enable-prefix-caching" in launch_command("vllm", [], host="h", port=1, model="m", options=options,
                                                          extra=["--no-enable-prefix-caching"])
    assert "--enable-prefix-caching" not in launch_command("vllm", [], host="h", port=1, model="m", options=options,
                                                           extra=["--no-enable-prefix-caching"])
    assert "--kv-events-config" not in launch_command("vllm", [], host="h", port=1, model="m", extra=[])
