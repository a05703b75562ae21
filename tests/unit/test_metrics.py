"""router.metrics (registry, exposition format, RouterMetrics, RequestTimer) and router.report."""

from __future__ import annotations

import math
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from router.metrics import (
    CONTENT_TYPE,
    DURATION_BUCKETS,
    ITL_BUCKETS,
    TTFT_BUCKETS,
    Registry,
    RequestTimer,
    RouterMetrics,
)
from router.report import (
    arm_report,
    arm_stats,
    histogram_quantile,
    main,
    parse_prometheus,
    wilson_interval,
)

GOLDEN = """\
# HELP app_requests_total Requests.\\nSecond line \\\\ end
# TYPE app_requests_total counter
app_requests_total{method="GET",path="/a\\"b\\\\c\\nd"} 3.5
app_requests_total{method="POST",path="/"} 1
# HELP app_temp Temperature.
# TYPE app_temp gauge
app_temp -1.5
# HELP app_latency_seconds Latency.
# TYPE app_latency_seconds histogram
app_latency_seconds_bucket{route="x",le="0.1"} 1
app_latency_seconds_bucket{route="x",le="1"} 2
app_latency_seconds_bucket{route="x",le="2.5"} 2
app_latency_seconds_bucket{route="x",le="+Inf"} 3
app_latency_seconds_sum{route="x"} 3.6
app_latency_seconds_count{route="x"} 3
# HELP app_workers Workers.
# TYPE app_workers gauge
app_workers{pool="p1"} 2
app_workers{pool="p2"} 0
"""


def small_registry() -> Registry:
    reg = Registry()
    c = reg.counter("app_requests_total", "Requests.\nSecond line \\ end", ("method", "path"))
    c.inc(("GET", '/a"b\\c\nd'))
    c.inc(("GET", '/a"b\\c\nd'), 2.5)
    c.inc(("POST", "/"))
    reg.gauge("app_temp", "Temperature.").set((), -1.5)
    h = reg.histogram("app_latency_seconds", "Latency.", ("route",), (0.1, 1, 2.5))
    for v in (0.1, 0.5, 3):  # 0.1 lands in le="0.1": upper bounds are inclusive
        h.observe(("x",), v)
    reg.gauge_func("app_workers", "Workers.", ("pool",), lambda: [(("p1",), 2), (("p2",), 0)])
    return reg


# --- exposition format -------------------------------------------------------------------------------


def test_render_golden() -> None:
    assert small_registry().render() == GOLDEN.encode()
    assert CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"


def test_histogram_buckets_cumulative_and_inf_equals_count() -> None:
    reg = Registry()
    h = reg.histogram("h_seconds", "H.", ("a",), TTFT_BUCKETS)
    values = [0.001, 0.005, 0.0051, 0.3, 0.3, 59.9, 60.0, 61.0, 1e9]
    for v in values:
        h.observe(("1",), v)
    fam = parse_prometheus(reg.render().decode())["h_seconds"]
    buckets = [(s[1]["le"], s[2]) for s in fam["samples"] if s[0] == "h_seconds_bucket"]
    counts = [c for _, c in buckets]
    assert counts == sorted(counts)  # cumulative
    assert buckets[-1][0] == "+Inf"
    assert len(buckets) == len(TTFT_BUCKETS) + 1
    count = next(s[2] for s in fam["samples"] if s[0] == "h_seconds_count")
    total = next(s[2] for s in fam["samples"] if s[0] == "h_seconds_sum")
    assert buckets[-1][1] == count == len(values)
    assert total == pytest.approx(sum(values))
    by_le = dict(buckets)
    assert by_le["0.005"] == 2 and by_le["0.01"] == 3 and by_le["0.3"] == 5 and by_le["60"] == 7
    assert h.count(("1",)) == len(values)


def test_label_count_checked_and_duplicates_refused() -> None:
    reg = Registry()
    c = reg.counter("c_total", "C.", ("a", "b"))
    with pytest.raises(ValueError):
        c.inc(("only-one",))
    with pytest.raises(ValueError):
        reg.counter("c_total", "again")
    with pytest.raises(ValueError):
        reg.histogram("h", "H.", (), (1.0, 0.5))
    with pytest.raises(ValueError):
        reg.counter("bad name", "B.")
    with pytest.raises(ValueError):
        reg.histogram("h2", "H.", ("le",), (1.0,))


def test_broken_gauge_func_does_not_break_the_scrape() -> None:
    reg = Registry()
    reg.counter("ok_total", "OK.").inc()

    def boom() -> Iterator[tuple[tuple[str, ...], float]]:
        raise RuntimeError("pool gone")

    reg.gauge_func("broken", "Broken.", ("x",), boom)
    text = reg.render().decode()
    assert "ok_total 1\n" in text
    assert "# TYPE broken gauge\n" in text and "broken{" not in text


def test_value_formatting() -> None:
    reg = Registry()
    g = reg.gauge("g", "G.", ("k",))
    for k, v in {"int": 3.0, "frac": 0.25, "small": 1e-05, "inf": math.inf, "ninf": -math.inf, "nan": math.nan}.items():
        g.set((k,), v)
    text = reg.render().decode()
    for line in ('g{k="int"} 3', 'g{k="frac"} 0.25', 'g{k="small"} 1e-05', 'g{k="inf"} +Inf', 'g{k="ninf"} -Inf',
                 'g{k="nan"} NaN'):
        assert line + "\n" in text


# --- RouterMetrics and RequestTimer ---------------------------------------------------------------------

NAMES = {
    "responses_router_requests_total": ("counter", {"model", "arm", "pool", "status"}),
    "responses_router_errors_total": ("counter", {"model", "arm", "pool", "kind"}),
    "responses_router_time_to_first_token_seconds": ("histogram", {"model", "arm", "pool"}),
    "responses_router_inter_token_latency_seconds": ("histogram", {"model", "arm", "pool"}),
    "responses_router_request_duration_seconds": ("histogram", {"model", "arm", "pool"}),
    "responses_router_output_tokens_total": ("counter", {"model", "arm", "pool"}),
    "responses_router_input_tokens_total": ("counter", {"model", "arm", "pool"}),
    "responses_router_cached_tokens_total": ("counter", {"model", "arm", "pool"}),
    "responses_router_arm_failovers_total": ("counter", {"model", "from_arm", "to_arm"}),
    "responses_router_affinity_moves_total": ("counter", {"pool", "why"}),
    "responses_router_worker_healthy": ("gauge", {"pool", "worker"}),
    "responses_router_worker_in_flight": ("gauge", {"pool", "worker"}),
    "responses_router_worker_restarts": ("gauge", {"pool", "worker"}),
}


class FakeProcess:
    restarts = 4


class FakeWorker:
    def __init__(self, url: str, healthy: bool, in_flight: int, process: object = None) -> None:
        self.url, self.healthy, self.in_flight, self.process = url, healthy, in_flight, process


class FakePool:
    def __init__(self, name: str, workers: list[FakeWorker]) -> None:
        self.name, self.workers = name, workers


class FakeClock:
    def __init__(self, *times: float) -> None:
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def test_router_metrics_names_types_and_labels() -> None:
    m = RouterMetrics()
    m.watch_pools(lambda: [FakePool("vllm", [FakeWorker("http://w1", True, 3, FakeProcess()),
                                             FakeWorker("http://w2", False, 0)])])
    t = m.timer("gpt", "a", "vllm")
    t.token()
    t.token()
    t.error("timeout")
    t.finish("completed", {"input_tokens": 7, "output_tokens": 2, "input_tokens_details": {"cached_tokens": 3}})
    m.failover("gpt", "a", "b")
    m.affinity_move("vllm", "overloaded")
    families = parse_prometheus(m.render().decode())
    for name, (kind, labels) in NAMES.items():
        assert families[name]["type"] == kind, name
        assert families[name]["help"], name
        samples = families[name]["samples"]
        assert samples, name
        assert set(samples[0][1]) - {"le"} == labels, name
    workers = {(s[1]["worker"], n): s[2] for n in ("healthy", "in_flight", "restarts")
               for s in families[f"responses_router_worker_{n}"]["samples"]}
    assert workers == {("http://w1", "healthy"): 1, ("http://w2", "healthy"): 0, ("http://w1", "in_flight"): 3,
                       ("http://w2", "in_flight"): 0, ("http://w1", "restarts"): 4, ("http://w2", "restarts"): 0}
    assert TTFT_BUCKETS[0] == 0.005 and TTFT_BUCKETS[-1] == 60
    assert ITL_BUCKETS[0] == 0.0005 and ITL_BUCKETS[-1] == 5
    assert DURATION_BUCKETS[0] == 0.01 and DURATION_BUCKETS[-1] == 600


def test_request_timer_records() -> None:
    m = RouterMetrics()
    labels = ("gpt", "a", "p")
    # start 10.0; first token 10.25; tokens at 10.35, 10.45; last token 10.65; finish 11.0
    t = RequestTimer(m, *labels, clock=FakeClock(10.0, 10.25, 10.35, 10.45, 10.65, 11.0))
    t.first_token()
    t.first_token()  # ignored: no clock read, no second TTFT
    t.token(2)
    t.token(3)
    t.token(1)
    assert t.tokens == 6
    t.finish("completed", {"input_tokens": 100, "output_tokens": 9, "input_tokens_details": {"cached_tokens": 64}})
    t.finish("failed")  # ignored
    assert m.requests.get((*labels, "completed")) == 1 and m.requests.get((*labels, "failed")) == 0
    assert m.ttft.count(labels) == 1 and m.ttft.sum(labels) == pytest.approx(0.25)
    assert m.duration.count(labels) == 1 and m.duration.sum(labels) == pytest.approx(1.0)
    # usage's 9 output tokens win over the 6 counted; mean ITL = (10.65 - 10.25) / (9 - 1)
    assert m.itl.count(labels) == 1 and m.itl.sum(labels) == pytest.approx(0.05)
    assert m.output_tokens.get(labels) == 9
    assert m.input_tokens.get(labels) == 100
    assert m.cached_tokens.get(labels) == 64


def test_request_timer_without_usage_and_odd_statuses() -> None:
    m = RouterMetrics()
    labels = ("gpt", "b", "p")
    t = m.timer(*labels, clock=FakeClock(1.0, 1.5, 1.6, 1.7, 2.0), start=0.0)  # start given: no clock read
    for _ in range(4):  # the first token() marks the first token
        t.token()
    t.finish("cancelled")
    assert m.ttft.sum(labels) == pytest.approx(1.0)
    assert m.itl.sum(labels) == pytest.approx(0.7 / 3)
    assert m.output_tokens.get(labels) == 4
    assert m.input_tokens.get(labels) == 0
    assert m.requests.get((*labels, "cancelled")) == 1

    # no output at all: no TTFT, no ITL; an unknown status counts as "error"
    t = m.timer("gpt", "c", "p", clock=FakeClock(0.0, 3.0))
    t.finish("weird")
    assert m.requests.get(("gpt", "c", "p", "error")) == 1
    assert m.ttft.count(("gpt", "c", "p")) == 0 and m.itl.count(("gpt", "c", "p")) == 0
    assert m.duration.sum(("gpt", "c", "p")) == 3.0

    # one token: TTFT but no ITL sample
    t = m.timer("gpt", "d", "p", clock=FakeClock(0.0, 0.5, 0.9))
    t.token()
    t.finish("incomplete", {"prompt_tokens": 3, "completion_tokens": 1})
    assert m.ttft.count(("gpt", "d", "p")) == 1 and m.itl.count(("gpt", "d", "p")) == 0
    assert m.input_tokens.get(("gpt", "d", "p")) == 3


# --- parse_prometheus --------------------------------------------------------------------------------------


def test_parse_round_trip() -> None:
    families = parse_prometheus(small_registry().render().decode())
    assert list(families) == ["app_requests_total", "app_temp", "app_latency_seconds", "app_workers"]
    req = families["app_requests_total"]
    assert req["type"] == "counter"
    assert req["help"] == "Requests.\nSecond line \\ end"
    assert req["samples"] == [
        ("app_requests_total", {"method": "GET", "path": '/a"b\\c\nd'}, 3.5),
        ("app_requests_total", {"method": "POST", "path": "/"}, 1.0),
    ]
    assert families["app_temp"]["samples"] == [("app_temp", {}, -1.5)]
    lat = families["app_latency_seconds"]
    assert lat["type"] == "histogram"
    assert [(s[0], s[1].get("le"), s[2]) for s in lat["samples"]] == [
        ("app_latency_seconds_bucket", "0.1", 1), ("app_latency_seconds_bucket", "1", 2),
        ("app_latency_seconds_bucket", "2.5", 2), ("app_latency_seconds_bucket", "+Inf", 3),
        ("app_latency_seconds_sum", None, 3.6), ("app_latency_seconds_count", None, 3),
    ]
    assert families["app_workers"]["samples"] == [("app_workers", {"pool": "p1"}, 2), ("app_workers", {"pool": "p2"}, 0)]


def test_parse_tolerates_other_exporters() -> None:
    text = (
        "# a free comment\n"
        "up 1 1700000000000\n"
        'vllm:num_requests_running{model_name="m"} 2.0\n'
        "# TYPE s summary\n"
        's{quantile="0.5"} 0.1\ns_sum 4\ns_count 10\n'
        "garbage{unterminated 1\n"
        'x{a="1",} +Inf\n'
    )
    f = parse_prometheus(text)
    assert f["up"]["samples"] == [("up", {}, 1.0)]
    assert f["vllm:num_requests_running"]["samples"] == [("vllm:num_requests_running", {"model_name": "m"}, 2.0)]
    assert [s[0] for s in f["s"]["samples"]] == ["s", "s_sum", "s_count"]
    assert f["x"]["samples"] == [("x", {"a": "1"}, math.inf)]
    assert "garbage" not in f


# --- statistics and the arm report -------------------------------------------------------------------------


def test_wilson_and_quantile() -> None:
    lo, hi = wilson_interval(5, 100)  # type: ignore[misc]
    assert lo == pytest.approx(0.021544, abs=1e-6) and hi == pytest.approx(0.111750, abs=1e-6)
    lo, hi = wilson_interval(0, 10)  # type: ignore[misc]
    assert lo == 0.0 and hi == pytest.approx(0.277533, abs=1e-6)
    assert wilson_interval(0, 0) is None
    buckets = [(0.1, 2.0), (0.2, 6.0), (math.inf, 8.0)]
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.1)  # rank 2: the top of the first bucket
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.15)  # rank 4: half way through (0.1, 0.2]
    assert histogram_quantile(0.125, buckets) == pytest.approx(0.05)  # first bucket starts at 0
    assert histogram_quantile(0.95, buckets) == pytest.approx(0.2)  # in +Inf: the largest finite bound
    assert histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None


def two_arms() -> RouterMetrics:
    m = RouterMetrics()
    a, b = ("gpt", "vllm", "pool-v"), ("gpt", "sglang", "pool-s")
    # vllm: 100 responses, 3 failed + 2 error (5%), 10 incomplete (not errors)
    m.requests.inc((*a, "completed"), 85)
    m.requests.inc((*a, "incomplete"), 10)
    m.requests.inc((*a, "failed"), 3)
    m.requests.inc((*a, "error"), 2)
    for _ in range(50):
        m.ttft.observe(a, 0.02)  # (0.01, 0.025]
        m.ttft.observe(a, 0.09)  # (0.075, 0.1]
    for _ in range(100):
        m.itl.observe(a, 0.011)  # (0.01, 0.0125]
        m.duration.observe(a, 2.0)
    m.output_tokens.inc(a, 10000)  # over 200 s: 50 tok/s
    # sglang: 200 responses, 20 failed (10%), 2 cancelled
    m.requests.inc((*b, "completed"), 178)
    m.requests.inc((*b, "cancelled"), 2)
    m.requests.inc((*b, "failed"), 20)
    for _ in range(100):
        m.ttft.observe(b, 0.2)  # (0.15, 0.2]
        m.ttft.observe(b, 0.4)  # (0.3, 0.5]
    for _ in range(200):
        m.itl.observe(b, 0.009)  # (0.0075, 0.01]
        m.duration.observe(b, 1.5)
    m.output_tokens.inc(b, 12000)  # over 300 s: 40 tok/s
    m.error(*b, "upstream")
    m.failover("gpt", "sglang", "vllm")
    # another model with one arm and no latency data
    m.requests.inc(("other", "x", "x", "completed"), 3)
    return m


def test_arm_stats_numbers() -> None:
    stats = arm_stats(parse_prometheus(two_arms().render().decode()), baseline="vllm")
    assert list(stats) == ["gpt", "other"]
    v, s = stats["gpt"]
    assert (v.arm, s.arm) == ("vllm", "sglang")  # the baseline first
    assert v.pools == ["pool-v"]
    assert (v.requests, v.errors, v.error_rate) == (100, 5, 0.05)
    assert v.error_ci == pytest.approx((0.021544, 0.111750), abs=1e-6)
    assert v.ttft_p50 == pytest.approx(0.025)  # rank 50 = the top of (0.01, 0.025]
    assert v.ttft_p95 == pytest.approx(0.0975)  # rank 95: 0.075 + 0.025 * 45/50
    assert v.itl_p50 == pytest.approx(0.01125)  # 0.01 + 0.0025 * 0.5
    assert v.itl_p95 == pytest.approx(0.012375)  # 0.01 + 0.0025 * 0.95
    assert v.tokens_per_s == pytest.approx(50.0)
    assert (s.requests, s.errors, s.error_rate) == (200, 20, 0.10)
    assert s.error_ci == pytest.approx((0.065670, 0.149406), abs=1e-6)
    assert s.ttft_p50 == pytest.approx(0.2)
    assert s.ttft_p95 == pytest.approx(0.48)  # 0.3 + 0.2 * 90/100
    assert s.itl_p50 == pytest.approx(0.00875)
    assert s.itl_p95 == pytest.approx(0.009875)
    assert s.tokens_per_s == pytest.approx(40.0)
    assert s.error_kinds == {"upstream": 1}
    (other,) = stats["other"]
    assert other.requests == 3 and other.ttft_p50 is None and other.tokens_per_s is None
    # without a baseline the arms are in name order
    assert [a.arm for a in arm_stats(parse_prometheus(two_arms().render().decode()))["gpt"]] == ["sglang", "vllm"]


def test_arm_report_text() -> None:
    text = arm_report(two_arms().render().decode(), baseline="vllm")
    lines = text.splitlines()
    assert lines[0] == "model gpt: 2 arms, baseline vllm"
    header = lines[1].split()
    assert header[:3] == ["arm", "requests", "error"]
    row_v = next(line for line in lines if line.strip().startswith("vllm "))
    row_s = next(line for line in lines if line.strip().startswith("sglang "))
    delta = next(line for line in lines if line.strip().startswith("vs vllm"))
    for cell in ("100", "5.00%", "[2.15%, 11.18%]", "25.0 ms", "97.5 ms", "12.4 ms", "50.0"):
        assert cell in row_v, cell
    for cell in ("200", "10.00%", "[6.57%, 14.94%]", "200 ms", "480 ms", "8.75 ms", "9.88 ms", "40.0"):
        assert cell in row_s, cell
    for cell in ("+5.00 pp", "CIs overlap", "+175 ms (+700%)", "+382 ms (+392%)", "-10.0 (-20%)"):
        assert cell in delta, cell
    assert "  errors on sglang: upstream 1" in lines
    assert "  failovers sglang -> vllm: 1" in lines
    assert "model other: 1 arm" in lines
    row_x = next(line for line in lines if line.strip().startswith("x "))
    assert row_x.split()[1:] == ["3", "0.00%", "[0.00%,", "56.15%]", "-", "-", "-", "-", "-"]
    assert arm_report("").startswith("no responses recorded yet")


# --- the command -----------------------------------------------------------------------------------------


@pytest.fixture
def metrics_server() -> Iterator[tuple[str, list[str | None]]]:
    body = two_arms().render()
    seen: list[str | None] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            auth = self.headers.get("Authorization")
            seen.append(auth)
            if self.path != "/metrics":
                self.send_error(404)
            elif auth not in (None, "Bearer sekrit"):
                self.send_error(401, "Unauthorized")
            else:
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_main_prints_the_report(metrics_server: tuple[str, list[str | None]], capsys: pytest.CaptureFixture[str]) -> None:
    url, seen = metrics_server
    assert main(["--url", url + "/", "--admin-key", "sekrit", "--baseline", "vllm"]) == 0
    out = capsys.readouterr().out
    assert out == arm_report(two_arms().render().decode(), baseline="vllm")
    assert seen == ["Bearer sekrit"]
    assert main(["--url", url]) == 0
    assert seen[-1] is None


def test_main_http_error_is_one_line(metrics_server: tuple[str, list[str | None]],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = metrics_server
    with pytest.raises(SystemExit) as exc:
        main(["--url", url, "--admin-key", "wrong"])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "HTTP 401" in captured.err


def test_main_closed_port(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed when the block ends: nothing listens there
    with pytest.raises(SystemExit) as exc:
        main(["--url", f"http://127.0.0.1:{port}", "--timeout", "5"])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith(f"responses-router report: cannot reach http://127.0.0.1:{port}/metrics")


def test_a_counter_read_at_render_time_says_counter() -> None:
    reg = Registry()
    seen = {"p": 3}
    reg.counter_func("app_picks_total", "Picks.", ("pool",), lambda: [((k,), v) for k, v in seen.items()])
    assert reg.render().decode() == ('# HELP app_picks_total Picks.\n# TYPE app_picks_total counter\n'
                                     'app_picks_total{pool="p"} 3\n')
