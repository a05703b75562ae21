"""``responses-router report``: compare the arms of each model from the router's ``/metrics``.

For each model, one row per arm: requests, error rate (failed + error over
all terminal statuses) with a 95% Wilson interval (a request that failed
through its own fault, ``rejected``: a 4xx such as a prompt over the
context or a request the engine calls bad, is left out of both and counted
on a line of its own), p50/p95 time to first
token and inter-token latency (estimated from the histogram buckets by
linear interpolation, as PromQL's ``histogram_quantile`` does), and output
tokens per second (output tokens over the summed request seconds). Each arm
after the first (the baseline: ``--baseline``, else the first by name) gets a
line with its difference from the baseline.

The counters are totals since the router started: run the report twice and
compare, or read rates in Prometheus, to look at a window.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ArmStats", "arm_report", "arm_stats", "histogram_quantile", "main", "parse_prometheus", "wilson_interval"]

P = "responses_router_"
ERROR_STATUSES = frozenset({"failed", "error"})
Z95 = 1.959963984540054

# --- parsing -------------------------------------------------------------------------------------

_HELP_ESCAPE = re.compile(r"\\(.)")
_SUFFIXES = {
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count"),
    "counter": ("_total", "_created"),
    "gauge": (),
    "untyped": (),
}


def _parse_float(text: str) -> float:
    low = text.lower()
    if low in ("+inf", "inf"):
        return math.inf
    if low == "-inf":
        return -math.inf
    if low == "nan":
        return math.nan
    return float(text)


def _unescape(text: str, i: int) -> tuple[str, int]:
    """The quoted label value starting after the opening quote at ``i``; returns (value, index after the closing quote)."""
    out: list[str] = []
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\" and i + 1 < n:
            nxt = text[i + 1]
            out.append("\n" if nxt == "n" else nxt)
            i += 2
        elif c == '"':
            return "".join(out), i + 1
        else:
            out.append(c)
            i += 1
    raise ValueError("unterminated label value")


def _parse_sample(line: str) -> tuple[str, dict[str, str], float]:
    brace = line.find("{")
    space = line.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        name = line[:brace].strip()
        labels: dict[str, str] = {}
        i = brace + 1
        while True:
            while i < len(line) and line[i] in " ,":
                i += 1
            if i >= len(line):
                raise ValueError("unterminated label set")
            if line[i] == "}":
                i += 1
                break
            eq = line.index("=", i)
            key = line[i:eq].strip()
            q = line.index('"', eq)
            labels[key], i = _unescape(line, q + 1)
        rest = line[i:].split()
    else:
        parts = line.split()
        name, rest, labels = parts[0], parts[1:], {}
    if not rest:
        raise ValueError("sample without a value")
    return name, labels, _parse_float(rest[0])  # a timestamp after the value is ignored


def parse_prometheus(text: str) -> dict[str, dict[str, Any]]:
    """Text exposition format 0.0.4 -> ``{family: {"type", "help", "samples": [(name, labels, value)]}}``.

    Samples are grouped under the family their ``# TYPE`` declares (a
    histogram's ``_bucket``/``_sum``/``_count`` under the histogram's name);
    samples of undeclared families get a family of their own, type
    ``untyped``. Malformed lines are skipped.
    """
    families: dict[str, dict[str, Any]] = {}

    def family(name: str) -> dict[str, Any]:
        fam = families.get(name)
        if fam is None:
            fam = families[name] = {"type": "untyped", "help": "", "samples": []}
        return fam

    def owner(sample: str) -> dict[str, Any]:
        if sample in families:
            return families[sample]
        for fname, fam in families.items():
            if sample.startswith(fname) and sample[len(fname):] in _SUFFIXES.get(fam["type"], ()):
                return fam
        return family(sample)

    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                fam = family(parts[2])
                rest = parts[3] if len(parts) > 3 else ""
                if parts[1] == "TYPE":
                    fam["type"] = rest.strip() or "untyped"
                else:
                    fam["help"] = _HELP_ESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), rest)
            continue
        try:
            name, labels, value = _parse_sample(line)
        except ValueError:
            continue
        owner(name)["samples"].append((name, labels, value))
    return families


# --- statistics ----------------------------------------------------------------------------------


def wilson_interval(k: float, n: float, z: float = Z95) -> tuple[float, float] | None:
    """The Wilson score interval for k successes in n trials; None when n is 0."""
    if n <= 0:
        return None
    p = k / n
    z2 = z * z
    denom = 1 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile from cumulative (le, count) buckets, interpolating linearly within a bucket.

    Like PromQL: the first bucket's lower edge is 0 (when its bound is
    positive); a quantile in the +Inf bucket is the largest finite bound.
    None when there are no observations.
    """
    if not buckets:
        return None
    buckets = sorted(buckets)
    total = buckets[-1][1]
    if total <= 0 or buckets[-1][0] != math.inf:
        return None
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for i, (le, count) in enumerate(buckets):
        if count >= rank and count > prev_count:
            if le == math.inf:
                return buckets[i - 1][0] if i > 0 else None
            if i == 0 and le <= 0:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return buckets[-2][0] if len(buckets) > 1 else None


@dataclass
class ArmStats:
    model: str
    arm: str
    pools: list[str] = field(default_factory=list)
    statuses: dict[str, float] = field(default_factory=dict)
    requests: float = 0.0
    errors: float = 0.0
    error_rate: float | None = None
    error_ci: tuple[float, float] | None = None
    ttft_p50: float | None = None
    ttft_p95: float | None = None
    itl_p50: float | None = None
    itl_p95: float | None = None
    output_tokens: float = 0.0
    duration_seconds: float = 0.0
    tokens_per_s: float | None = None
    error_kinds: dict[str, float] = field(default_factory=dict)
    rejected: float = 0.0  # failed through the request's fault: in neither requests nor errors


def _samples(families: dict[str, dict[str, Any]], name: str) -> list[tuple[str, dict[str, str], float]]:
    fam = families.get(P + name)
    return fam["samples"] if fam else []


def _buckets(families: dict[str, dict[str, Any]], name: str) -> dict[tuple[str, str], dict[float, float]]:
    """(model, arm) -> {le: cumulative count}, summed over pools."""
    out: dict[tuple[str, str], dict[float, float]] = {}
    for sample, labels, value in _samples(families, name):
        if sample.endswith("_bucket") and "le" in labels:
            key = (labels.get("model", ""), labels.get("arm", ""))
            le = _parse_float(labels["le"])
            per = out.setdefault(key, {})
            per[le] = per.get(le, 0.0) + value
    return out


def arm_stats(families: dict[str, dict[str, Any]], baseline: str | None = None) -> dict[str, list[ArmStats]]:
    """model -> its arms' statistics, the baseline arm first (else sorted by name); models sorted."""
    arms: dict[tuple[str, str], ArmStats] = {}

    def arm(labels: dict[str, str]) -> ArmStats:
        key = (labels.get("model", ""), labels.get("arm", ""))
        stats = arms.get(key)
        if stats is None:
            stats = arms[key] = ArmStats(*key)
        pool = labels.get("pool")
        if pool is not None and pool not in stats.pools:
            stats.pools.append(pool)
        return stats

    for _, labels, value in _samples(families, "requests_total"):
        stats = arm(labels)
        status = labels.get("status", "")
        stats.statuses[status] = stats.statuses.get(status, 0.0) + value
    for _, labels, value in _samples(families, "errors_total"):
        stats = arm(labels)
        kind = labels.get("kind", "")
        stats.error_kinds[kind] = stats.error_kinds.get(kind, 0.0) + value
    for _, labels, value in _samples(families, "output_tokens_total"):
        arm(labels).output_tokens += value
    for sample, labels, value in _samples(families, "request_duration_seconds"):
        if sample.endswith("_sum"):
            arm(labels).duration_seconds += value
    ttft = _buckets(families, "time_to_first_token_seconds")
    itl = _buckets(families, "inter_token_latency_seconds")

    for key, stats in arms.items():
        stats.rejected = stats.statuses.get("rejected", 0.0)
        stats.requests = sum(v for s, v in stats.statuses.items() if s != "rejected")
        stats.errors = sum(v for s, v in stats.statuses.items() if s in ERROR_STATUSES)
        if stats.requests > 0:
            stats.error_rate = stats.errors / stats.requests
            stats.error_ci = wilson_interval(stats.errors, stats.requests)
        t = list(ttft.get(key, {}).items())
        stats.ttft_p50, stats.ttft_p95 = histogram_quantile(0.5, t), histogram_quantile(0.95, t)
        i = list(itl.get(key, {}).items())
        stats.itl_p50, stats.itl_p95 = histogram_quantile(0.5, i), histogram_quantile(0.95, i)
        if stats.duration_seconds > 0:
            stats.tokens_per_s = stats.output_tokens / stats.duration_seconds
        stats.pools.sort()

    by_model: dict[str, list[ArmStats]] = {}
    for (model, _), stats in sorted(arms.items()):
        by_model.setdefault(model, []).append(stats)
    for model_arms in by_model.values():
        model_arms.sort(key=lambda s: (s.arm != baseline, s.arm))
    return by_model


# --- the report ----------------------------------------------------------------------------------


def _num(value: float) -> str:
    return str(int(value)) if value == int(value) else f"{value:.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.2f}%"


def _seconds(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    sign = ("+" if value > 0 else "-" if value < 0 else "±") if signed else ("-" if value < 0 else "")
    v = abs(value)
    if v >= 1:
        return f"{sign}{v:.2f} s"
    ms = v * 1000
    return f"{sign}{ms:.2f} ms" if ms < 10 else f"{sign}{ms:.1f} ms" if ms < 100 else f"{sign}{ms:.0f} ms"


def _relative(new: float | None, old: float | None) -> str:
    if new is None or old is None or old == 0:
        return ""
    return f" ({(new - old) / old * 100:+.0f}%)"


def _delta_seconds(new: float | None, old: float | None) -> str:
    if new is None or old is None:
        return ""
    return _seconds(new - old, signed=True) + _relative(new, old)


HEADER = ("arm", "requests", "error rate", "95% CI", "TTFT p50", "TTFT p95", "ITL p50", "ITL p95", "out tok/s")


def _row(s: ArmStats) -> list[str]:
    ci = "-" if s.error_ci is None else f"[{_pct(s.error_ci[0])}, {_pct(s.error_ci[1])}]"
    tps = "-" if s.tokens_per_s is None else f"{s.tokens_per_s:.1f}"
    return [s.arm, _num(s.requests), _pct(s.error_rate), ci, _seconds(s.ttft_p50), _seconds(s.ttft_p95),
            _seconds(s.itl_p50), _seconds(s.itl_p95), tps]


def _delta_row(s: ArmStats, base: ArmStats) -> list[str]:
    err = ""
    if s.error_rate is not None and base.error_rate is not None:
        err = f"{(s.error_rate - base.error_rate) * 100:+.2f} pp"
    overlap = ""
    if s.error_ci and base.error_ci:
        apart = s.error_ci[0] > base.error_ci[1] or s.error_ci[1] < base.error_ci[0]
        overlap = "CIs apart" if apart else "CIs overlap"
    tps = ""
    if s.tokens_per_s is not None and base.tokens_per_s is not None:
        tps = f"{s.tokens_per_s - base.tokens_per_s:+.1f}" + _relative(s.tokens_per_s, base.tokens_per_s)
    return [f"  vs {base.arm}", "", err, overlap, _delta_seconds(s.ttft_p50, base.ttft_p50),
            _delta_seconds(s.ttft_p95, base.ttft_p95), _delta_seconds(s.itl_p50, base.itl_p50),
            _delta_seconds(s.itl_p95, base.itl_p95), tps]


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [cell.rjust(w) for cell, w in zip(r[1:], widths[1:])]
        lines.append("  " + "  ".join(cells).rstrip())
    return lines


def arm_report(metrics_text: str, baseline: str | None = None) -> str:
    """The per-arm comparison, grouped by model, as text to print."""
    families = parse_prometheus(metrics_text)
    by_model = arm_stats(families, baseline)
    if not by_model:
        return "no responses recorded yet (no responses_router_requests_total samples)\n"
    failovers: dict[str, list[tuple[str, str, float]]] = {}
    for _, labels, value in _samples(families, "arm_failovers_total"):
        failovers.setdefault(labels.get("model", ""), []).append((labels.get("from_arm", ""), labels.get("to_arm", ""), value))
    out: list[str] = []
    for model, model_arms in by_model.items():
        base = model_arms[0]
        n = len(model_arms)
        out.append(f"model {model}: {n} arm{'s' if n != 1 else ''}" + (f", baseline {base.arm}" if n > 1 else ""))
        rows: list[list[str]] = [list(HEADER)]
        for s in model_arms:
            rows.append(_row(s))
            if s is not base:
                rows.append(_delta_row(s, base))
        out.extend(_table(rows))
        for s in model_arms:
            if s.error_kinds:
                kinds = ", ".join(f"{k} {_num(v)}" for k, v in sorted(s.error_kinds.items(), key=lambda kv: -kv[1]))
                out.append(f"  errors on {s.arm}: {kinds}")
            if s.rejected:
                out.append(f"  rejected on {s.arm}: {_num(s.rejected)} (the request's fault, e.g. over the context: not counted)")
        for src, dst, value in sorted(failovers.get(model, [])):
            out.append(f"  failovers {src} -> {dst}: {_num(value)}")
        out.append("")
    out.append("error rate: failed + error over all responses; latencies estimated from histogram buckets;")
    out.append("ITL: per-response mean time per output token after the first; out tok/s: output tokens / request seconds.")
    return "\n".join(out) + "\n"


# --- the command ---------------------------------------------------------------------------------


def fetch_metrics(url: str, admin_key: str | None = None, timeout: float = 10.0) -> str:
    request = urllib.request.Request(url.rstrip("/") + "/metrics", headers={"Accept": "text/plain"})
    if admin_key:
        request.add_header("Authorization", f"Bearer {admin_key}")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        charset = response.headers.get_content_charset() or "utf-8"
        return str(response.read().decode(charset, errors="replace"))


def main(argv: list[str] | None = None) -> int:
    """``responses-router report --url URL [--admin-key K] [--baseline ARM]``: prints the report.

    Returns 0; on a connection or HTTP error prints one line to stderr and raises ``SystemExit(2)``.
    """
    parser = argparse.ArgumentParser(prog="responses-router report", description="Compare experiment arms from /metrics.")
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="the router's base URL (default %(default)s)")
    parser.add_argument("--admin-key", help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--baseline", help="the arm the others are compared with (default: the first by name)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds (default %(default)s)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    target = args.url.rstrip("/") + "/metrics"
    try:
        text = fetch_metrics(args.url, args.admin_key, args.timeout)
    except urllib.error.HTTPError as exc:
        print(f"responses-router report: GET {target}: HTTP {exc.code} {exc.reason}", file=sys.stderr)
        raise SystemExit(2) from None
    except urllib.error.URLError as exc:
        print(f"responses-router report: cannot reach {target}: {exc.reason}", file=sys.stderr)
        raise SystemExit(2) from None
    except (OSError, ValueError) as exc:  # timeouts, resets, a malformed URL
        print(f"responses-router report: cannot reach {target}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    sys.stdout.write(arm_report(text, args.baseline))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
