"""Managed workers: started by the router, reported in /health, never orphaned."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from harness import http_status, sim_pool_toml, start_router

pytestmark = pytest.mark.e2e

MODELS = '\n[[models]]\nname = "chat"\npool = "sim"\n'


def worker_urls(base_url: str) -> list[str]:
    with urllib.request.urlopen(base_url + "/health") as resp:
        return [w["url"] for w in json.loads(resp.read())["pools"][0]["workers"]]


def pid_on(url: str) -> int:
    """The sim worker process serving ``url``, found through /proc (no pgrep needed)."""
    port = url.rsplit(":", 1)[1]
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"backends.sim" in argv and argv[argv.index(b"--port") + 1 : argv.index(b"--port") + 2] == [port.encode()]:
            pids.append(int(entry.name))
    assert len(pids) == 1, f"expected one worker on port {port}, found {pids}"
    return pids[0]


def wait_until(predicate, timeout: float = 15.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_sigterm_stops_the_workers(tmp_path: Path) -> None:
    router = start_router(tmp_path, sim_pool_toml() + MODELS)
    urls = worker_urls(router.base_url)
    assert len(urls) == 2 and all(http_status(u + "/health") == 200 for u in urls)
    assert (tmp_path / "logs" / "sim-0.log").exists()
    assert router.stop() == 0
    assert all(http_status(u + "/health") is None for u in urls), "workers still answer after the router stopped"


def test_sigkill_of_the_router_leaves_no_orphans(tmp_path: Path) -> None:
    router = start_router(tmp_path, sim_pool_toml() + MODELS)
    urls = worker_urls(router.base_url)
    pids = [pid_on(u) for u in urls]
    os.kill(router.proc.pid, signal.SIGKILL)
    router.proc.wait()
    assert wait_until(lambda: all(not _alive(p) for p in pids)), "worker processes outlived a SIGKILLed router"


def test_a_dead_worker_is_reported_avoided_and_restarted(tmp_path: Path) -> None:
    router = start_router(tmp_path, sim_pool_toml() + MODELS)
    try:
        urls = worker_urls(router.base_url)
        os.kill(pid_on(urls[0]), signal.SIGKILL)

        def reported() -> bool:
            with urllib.request.urlopen(router.base_url + "/health") as resp:
                pool = json.loads(resp.read())["pools"][0]
            return pool["healthy_workers"] == 1 and pool["status"] == "degraded"

        assert wait_until(reported)
        import openai

        client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="x", max_retries=0)
        for i in range(4):
            assert client.responses.create(model="chat", input=f"still served {i}").status == "completed"
        assert "exited with code" in router.log()

        def restarted() -> bool:  # the supervisor brings it back after a backoff
            with urllib.request.urlopen(router.base_url + "/health") as resp:
                pool = json.loads(resp.read())["pools"][0]
            dead = next(w for w in pool["workers"] if w["url"] == urls[0])
            return pool["healthy_workers"] == 2 and dead["process"]["restarts"] == 1 and dead["process"]["state"] == "ready"

        assert wait_until(restarted), router.log()
        assert pid_on(urls[0]) > 0
    finally:
        assert router.stop() == 0


def test_a_worker_that_cannot_start_stops_start_up(tmp_path: Path) -> None:
    body = sim_pool_toml(replicas=1, extra_args='["--no-such-flag"]') + MODELS
    router = start_router(tmp_path, body, wait=False)
    code = router.proc.wait(timeout=60)
    assert code == 1
    lines = [line for line in router.log().splitlines() if line.startswith("responses-router:")]
    assert len(lines) == 1 and "exited with code 2 while starting" in lines[0] and "sim-0.log" in lines[0]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose: it holds no port and runs no code.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_gpus_are_split_between_replicas(tmp_path: Path) -> None:
    body = sim_pool_toml().replace("replicas = 2", "replicas = 2\ngpus = [0, 1, 2, 3]") + MODELS
    router = start_router(tmp_path, body)
    try:
        seen = []
        for url in worker_urls(router.base_url):
            environ = Path(f"/proc/{pid_on(url)}/environ").read_bytes().split(b"\0")
            seen.append(next(v for v in environ if v.startswith(b"CUDA_VISIBLE_DEVICES=")).split(b"=", 1)[1].decode())
        assert sorted(seen) == ["0,1", "2,3"]
    finally:
        assert router.stop() == 0


def test_engine_queue_length_is_scraped_into_the_load(tmp_path: Path) -> None:
    import threading

    import openai

    body = (sim_pool_toml(replicas=1, extra_args='["--max-concurrency", "1"]')
            .replace("health_interval_s = 0.5", "health_interval_s = 0.2\nscrape_metrics = true") + MODELS)
    router = start_router(tmp_path, body)
    client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="x", max_retries=0, timeout=30)
    threads = [threading.Thread(target=lambda: client.responses.create(model="chat", input="[sim:tokens=40] [sim:itl_ms=50]"))
               for _ in range(3)]
    try:
        for t in threads:
            t.start()

        def queued() -> bool:  # one generates, the others wait inside the engine
            with urllib.request.urlopen(router.base_url + "/health") as resp:
                return json.loads(resp.read())["pools"][0]["workers"][0]["waiting"] >= 1

        assert wait_until(queued, 15)
    finally:
        for t in threads:
            t.join()
        assert router.stop() == 0


def test_a_crash_loop_ends_once_the_worker_stays_up() -> None:
    """/health's crash_loop: three crashes in a row, until the worker has been up STABLE_S (it
    stayed true for ever before, the count starting over only at a next crash)."""
    from backends.launcher import STABLE_S, ManagedWorker, WorkerSpec

    worker = ManagedWorker(spec=WorkerSpec(engine="sim", model="m", command=[]), port=1, label="w")
    assert not worker.crash_looping
    worker.crashes_in_a_row, worker.state = 3, "backoff"
    assert worker.crash_looping and worker.describe()["crash_loop"] is True
    worker.state, worker._started_at = "ready", time.monotonic()  # just back up: not yet out of it
    assert worker.crash_looping
    worker._started_at = time.monotonic() - STABLE_S - 1
    assert not worker.crash_looping and worker.describe()["crash_loop"] is False


# -- the command lines the launcher builds (backends/engines.py derived_flags) ------------


def test_the_vllm_command_line_says_what_the_pool_needs() -> None:
    from backends.engines import LaunchOptions, launch_command

    options = LaunchOptions(dialect="harmony", context_length=8192, tensor_parallel=2, tool_call_parser="openai",
                            reasoning_parser="openai_gptoss", priority=True, python="/opt/vllm/bin/python")
    argv = launch_command("vllm", [], host="127.0.0.1", port=8001, model="openai/gpt-oss-20b", extra=["--dtype", "bfloat16"],
                          options=options)
    assert argv == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "openai/gpt-oss-20b",
                    "--host", "127.0.0.1", "--port", "8001",
                    "--enable-prompt-tokens-details", "--enable-scale-out", "--tensor-parallel-size", "2",
                    "--max-model-len", "8192", "--tool-call-parser", "openai", "--enable-auto-tool-choice",
                    "--reasoning-parser", "openai_gptoss", "--scheduling-policy", "priority",
                    "--dtype", "bfloat16"]
    # A chat pool with nothing set: cached-token reporting only, on the router's own interpreter.
    import sys

    assert launch_command("vllm", [], host="h", port=1, model="m", extra=[]) == [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "m", "--host", "h", "--port", "1",
        "--enable-prompt-tokens-details"]


def test_the_sglang_command_line_says_what_the_pool_needs() -> None:
    from backends.engines import LaunchOptions, launch_command

    options = LaunchOptions(dialect="harmony", context_length=32768, tensor_parallel=4, tool_call_parser="qwen25",
                            reasoning_parser="qwen3", priority=True, python="/usr/bin/python3")
    argv = launch_command("sglang", [], host="0.0.0.0", port=30000, model="Qwen/Qwen3-8B", extra=[], options=options)
    assert argv == ["/usr/bin/python3", "-m", "sglang.launch_server", "--model-path", "Qwen/Qwen3-8B",
                    "--host", "0.0.0.0", "--port", "30000",
                    "--enable-cache-report", "--tp-size", "4", "--context-length", "32768",
                    "--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3",
                    "--enable-priority-scheduling", "--schedule-low-priority-values-first"]


def test_flags_the_user_gave_win_and_are_not_repeated() -> None:
    from backends.engines import LaunchOptions, launch_command

    options = LaunchOptions(dialect="harmony", context_length=8192, tensor_parallel=2, tool_call_parser="hermes",
                            priority=True, python="py")
    extra = ["--max_model_len=4096", "-tp", "4", "--no-enable-prompt-tokens-details", "--tokens-only",
             "--scheduling-policy", "fcfs", "--enable-auto-tool-choice"]
    argv = launch_command("vllm", [], host="h", port=1, model="m", extra=extra, options=options)
    assert argv == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "m", "--host", "h", "--port", "1",
                    "--tool-call-parser", "hermes", *extra]
    # SGLang's aliases (--tp, --tensor-parallel-size), and flags in the command template count too.
    template = ["{python}", "-m", "sglang.launch_server", "--model-path", "{model}", "--port", "{port}", "--enable-cache-report"]
    argv = launch_command("sglang", template, host="h", port=2, model="m", extra=["--tp", "2"],
                          options=LaunchOptions(tensor_parallel=2, context_length=100, python="py"))
    assert argv == ["py", "-m", "sglang.launch_server", "--model-path", "m", "--port", "2", "--enable-cache-report",
                    "--context-length", "100", "--tp", "2"]
    # derive=False (a command of the user's own): nothing added.
    assert launch_command("vllm", ["my-wrapper", "{port}"], host="h", port=3, model="m", extra=["-x"],
                          options=LaunchOptions(dialect="harmony", derive=False)) == ["my-wrapper", "3", "-x"]


def test_launch_options_come_from_the_pool_config(tmp_path: Path) -> None:
    import sys

    from router.app import launch_options
    from router.config import parse_config

    def options(pool: str, managed: str):  # type: ignore[no-untyped-def]
        body = (f'[[pools]]\nname = "p"\nmodel = "m"\n{pool}\n[pools.managed]\nreplicas = 2\n{managed}\n'
                '[[models]]\nname = "m"\npool = "p"\n')
        return launch_options(parse_config(body).pools[0], tmp_path)

    got = options('engine = "vllm"\ndialect = "harmony"\ncontext_length = 8192\nhonor_service_tier = true',
                  'gpus = [0, 1, 2, 3]\ntool_call_parser = "openai"\nreasoning_parser = "openai_gptoss"')
    assert (got.dialect, got.context_length, got.tensor_parallel, got.tool_call_parser, got.reasoning_parser, got.priority,
            got.python, got.derive) == ("harmony", 8192, 2, "openai", "openai_gptoss", True, sys.executable, True)
    got = options('engine = "vllm"', 'python = "venvs/vllm/bin/python"\ncommand = ["taskset", "-c", "1", "{python}", "-m", "x"]')
    assert got.python == str(tmp_path / "venvs/vllm/bin/python") and not got.derive and got.tensor_parallel is None
    got = options('engine = "sglang"', 'python = "python3.12"\ncommand = ["{python}", "-m", "x"]\nderive_flags = true')
    assert got.python == "python3.12" and got.derive


def _start_sim(tmp: Path, name: str, *args: str):  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    from harness import ROOT, free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "router", "sim", "--port", str(port), *args], cwd=ROOT,
                            stdout=open(tmp / f"{name}.log", "ab"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    assert wait_until(lambda: proc.poll() is None and http_status(url + "/health") == 200, 20), (tmp / f"{name}.log").read_text()
    return proc, url


def test_the_start_up_check_logs_one_line_per_pool(tmp_path: Path, harmony_vocab: Path) -> None:
    """Attached workers: what each pool's workers serve and what will not work, one line per pool."""
    chat, chat_url = _start_sim(tmp_path, "chat", "--model", "sim-model", "--max-model-len", "2048")
    oss, oss_url = _start_sim(tmp_path, "oss", "--model", "gpt-oss-sim", "--dialect", "harmony", "--no-scale-out",
                              "--harmony-vocab-dir", str(harmony_vocab), "--max-model-len", "8192")
    body = f"""
[harmony]
vocab_dir = "{harmony_vocab}"
[[pools]]
name = "chat"
engine = "sim"
model = "sim-model"
urls = ["{chat_url}"]
[[pools]]
name = "bigger"
engine = "vllm"
model = "sim-model"
context_length = 4096
urls = ["{chat_url}"]
[[pools]]
name = "other"
engine = "vllm"
model = "another-model"
urls = ["{chat_url}", "http://127.0.0.1:{free_port_()}"]
[[pools]]
name = "oss"
engine = "vllm"
dialect = "harmony"
model = "gpt-oss-sim"
urls = ["{oss_url}"]
[[models]]
name = "chat"
pool = "chat"
[[models]]
name = "oss"
pool = "oss"
[[models]]
name = "bigger"
pool = "bigger"
[[models]]
name = "other"
pool = "other"
"""
    router = start_router(tmp_path / "router", body)
    try:
        lines = {name: [line for line in router.log().splitlines() if f"router: pool {name} (" in line]
                 for name in ("chat", "bigger", "other", "oss")}
        assert all(len(found) == 1 for found in lines.values()), lines
        chat_line, bigger, other, oss_line = (lines[n][0] for n in ("chat", "bigger", "other", "oss"))
        assert " INFO " in chat_line and chat_line.endswith(
            "pool chat (sim, attached): 1/1 workers answer; model 'sim-model' listed by 1/1; max_model_len 2048; nothing missing")
        assert " WARNING " in bigger and "context_length 4096 is above the workers' max_model_len 2048" in bigger
        assert " WARNING " in other and "1/2 workers answer" in other and "model 'another-model' listed by 0/1" in other
        assert f"{chat_url} does not list 'another-model' (it serves 'sim-model')" in other and "cannot be asked" in other
        assert " WARNING " in oss_line and "generate endpoint on 0/1" in oss_line
        assert f"{oss_url} has no /inference/v1/generate (vLLM needs --enable-scale-out)" in oss_line
        # The harmony pool was told at start-up: its calls go to /v1/completions from the first one.
        import openai

        client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="x", max_retries=0, timeout=30)
        assert client.responses.create(model="oss", input="hello").status == "completed"
    finally:
        assert router.stop() == 0
        for proc in (chat, oss):
            proc.terminate()
            proc.wait(timeout=10)


def free_port_() -> int:
    from harness import free_port

    return free_port()


def test_a_managed_pool_starts_its_engine_with_the_derived_flags(tmp_path: Path) -> None:
    """context_length reaches the sim as --max-model-len: its /v1/models says so, and the check line too."""
    body = sim_pool_toml(replicas=1).replace("health_interval_s = 0.5", "health_interval_s = 0.5\ncontext_length = 2048") + MODELS
    router = start_router(tmp_path, body)
    try:
        (url,) = worker_urls(router.base_url)
        with urllib.request.urlopen(url + "/v1/models") as resp:
            assert json.loads(resp.read())["data"][0]["max_model_len"] == 2048
        log = router.log()
        started = next(line for line in log.splitlines() if "worker 1/1: starting on" in line)
        assert started.endswith("-m backends.sim --host 127.0.0.1 --port " + url.rsplit(":", 1)[1] + " --model sim-model --max-model-len 2048")
        assert "pool sim (sim, managed): 1/1 workers answer; model 'sim-model' listed by 1/1; max_model_len 2048; nothing missing" in log
    finally:
        assert router.stop() == 0


def test_pool_settings_that_cannot_work_are_one_config_line() -> None:
    from router.config import ConfigError, parse_config

    def error(pool: str) -> str:
        with pytest.raises(ConfigError) as err:
            parse_config(f'[[pools]]\nname = "p"\nmodel = "m"\n{pool}\n[[models]]\nname = "m"\npool = "p"\n', source="cfg.toml")
        return str(err.value)

    assert error('engine = "sim"\n[pools.managed]\ntool_call_parser = "hermes"') == (
        "cfg.toml: pools[0].managed.tool_call_parser: the sim engine has no parsers (vllm and sglang do)")
    assert error('engine = "vllm"\nurls = ["https://gpu-1:70000"]').startswith("cfg.toml: pools[0].urls[0]: 'https://gpu-1:70000': ")
    assert error('engine = "vllm"\nurls = ["https://gpu-1"]\ntls_key_file = "k.pem"') == (
        "cfg.toml: pools[0].tls_key_file: a client key needs its certificate: set tls_cert_file too")
    assert error('engine = "vllm"\ntls_ca_file = "ca.pem"\n[pools.managed]\n') == (
        "cfg.toml: pools[0].tls_ca_file: TLS settings are for https workers, and a managed pool's workers are reached over http")
