"""Soak test of ``lmforge serve`` under hostile clients: does it stay up, answer and keep its memory?

Starts ``lmforge serve`` on loopback on a tiny seeded checkpoint (or ``--checkpoint``), then runs
``--clients`` concurrent clients for ``--seconds``. Each client sends one request after another,
taking turns through four kinds, on /v1/completions and /v1/chat/completions alternately:

- stream: a streamed request, read to ``data: [DONE]``;
- whole: a request that is not streamed;
- cancel: a streamed request whose client disconnects after the first chunk;
- malformed: one of MALFORMED (bad JSON, deep nesting, unknown fields, wrong types, out of range).

Meanwhile it polls ``GET /health`` (each poll must answer 200) and samples the server's RSS from
/proc/PID/status. At the end, in-flight requests finish. It prints requests by kind, responses by
status, errors, p50/p95 latency of the well-formed requests, health-check failures and RSS
start/peak/end, and exits 1 unless: no 5xx, no error, every health check answered, every
well-formed request completed and every malformed one got a 4xx with OpenAI's error body.
Usage:

    python benchmarks/serve_soak.py [--clients 64] [--seconds 60] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from serve_helpers import Server, random_checkpoint  # noqa: E402  (the test suite's subprocess launcher)

KINDS = ("stream", "whole", "cancel", "malformed")
PROMPTS = ["package main\n\nfunc", "The quick brown fox", "Say hello", "open main.go"]
MALFORMED = [
    b"{not json",
    b"[" * 50_000,
    b'"a string, not an object"',
    json.dumps({"model": "tiny", "prompt": "x", "frobnicate": 1}).encode(),
    json.dumps({"model": "tiny", "prompt": "x", "max_tokens": "5"}).encode(),
    json.dumps({"model": "tiny", "prompt": "x", "temperature": -1}).encode(),
    json.dumps({"model": "tiny", "prompt": "x", "top_k": 10**30}).encode(),
    json.dumps({"model": "gpt-4", "prompt": "x"}).encode(),
    json.dumps({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}).encode(),
    json.dumps({"model": "tiny", "prompt": [1, 10**9]}).encode(),
]


@dataclass
class Report:
    requests: Counter = field(default_factory=Counter)  # by kind
    statuses: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)  # what went wrong, by description
    latencies: list[float] = field(default_factory=list)  # well-formed requests that completed, seconds
    health_checks: int = 0
    health_failures: int = 0
    rss_kib: list[int] = field(default_factory=list)

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


def request_body(kind: str, endpoint: str, turn: int, max_tokens: int) -> dict:
    body: dict = {"model": "tiny", "max_tokens": max_tokens if kind != "cancel" else 4 * max_tokens,
                  "temperature": 0.8, "stream": kind != "whole", "seed": turn}
    prompt = PROMPTS[turn % len(PROMPTS)]
    if endpoint == "/v1/completions":
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    return body


def is_openai_error(response: httpx.Response) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}


async def one_request(http: httpx.AsyncClient, kind: str, endpoint: str, turn: int, max_tokens: int,
                      report: Report) -> None:
    sent = report.requests[kind]
    report.requests[kind] += 1
    start = time.perf_counter()
    if kind == "malformed":  # in turn, whatever the number of clients: the first ones cover MALFORMED
        r = await http.post(endpoint, content=MALFORMED[sent % len(MALFORMED)],
                            headers={"Content-Type": "application/json"})
        report.statuses[r.status_code] += 1
        if not (400 <= r.status_code < 500 and is_openai_error(r)):
            report.errors[f"malformed request got {r.status_code} {r.text[:120]!r}"] += 1
        return
    body = request_body(kind, endpoint, turn, max_tokens)
    if kind == "whole":
        r = await http.post(endpoint, json=body)
        report.statuses[r.status_code] += 1
        if r.status_code != 200 or not r.json().get("choices"):
            report.errors[f"{kind} request got {r.status_code} {r.text[:120]!r}"] += 1
            return
        report.latencies.append(time.perf_counter() - start)
        return
    async with http.stream("POST", endpoint, json=body) as r:
        report.statuses[r.status_code] += 1
        if r.status_code != 200:
            report.errors[f"{kind} request got {r.status_code} {(await r.aread())[:120]!r}"] += 1
            return
        events = []
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if kind == "cancel":
                return  # leaving the block closes the connection mid-stream
    if events[-1:] != ["[DONE]"] or any('"error"' in e for e in events):
        report.errors[f"stream ended badly: {events[-2:]!r}"] += 1
        return
    report.latencies.append(time.perf_counter() - start)


async def client(http: httpx.AsyncClient, index: int, deadline: float, max_tokens: int, report: Report) -> None:
    turn = index  # clients start at different kinds, so every kind runs from the first round on
    while time.perf_counter() < deadline:
        kind = KINDS[turn % len(KINDS)]
        endpoint = ("/v1/completions", "/v1/chat/completions")[(turn // len(KINDS)) % 2]
        try:
            await one_request(http, kind, endpoint, turn, max_tokens, report)
        except httpx.HTTPError as e:
            report.errors[f"{kind} request failed: {type(e).__name__}: {e}"] += 1
        turn += 1


async def watch(http: httpx.AsyncClient, pid: int, report: Report, stop: asyncio.Event, every: float) -> None:
    """Polls /health and samples the server's RSS until ``stop``."""
    while not stop.is_set():
        report.rss_kib.append(rss_kib(pid))
        report.health_checks += 1
        try:
            ok = (await http.get("/health")).status_code == 200
        except httpx.HTTPError:
            ok = False
        report.health_failures += not ok
        try:
            await asyncio.wait_for(stop.wait(), every)
        except asyncio.TimeoutError:
            pass
    report.rss_kib.append(rss_kib(pid))


async def soak(base: str, pid: int, clients: int, seconds: float, max_tokens: int = 32,
               poll_every: float = 0.5) -> Report:
    """Runs the clients against the server at ``base`` (process ``pid``) and returns what happened."""
    report = Report()
    limits = httpx.Limits(max_connections=clients + 1, max_keepalive_connections=clients + 1)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as http, \
            httpx.AsyncClient(base_url=base, timeout=120) as monitor:  # its own pool: never queued behind clients
        # (120 s guards against a hang only: on a busy machine a slow answer is still an answer)
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(monitor, pid, report, stop, poll_every))
        deadline = time.perf_counter() + seconds
        await asyncio.gather(*(client(http, i, deadline, max_tokens, report) for i in range(clients)))
        stop.set()
        await watcher
        report.health_checks += 1  # and once more after the last request
        r = await monitor.get("/health")
        report.health_failures += r.status_code != 200
    return report


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def print_report(report: Report) -> None:
    print("requests by kind: " + ", ".join(f"{k} {report.requests[k]}" for k in KINDS)
          + f" (total {sum(report.requests.values())})")
    print("responses by status: " + ", ".join(f"{s}: {n}" for s, n in sorted(report.statuses.items())))
    print(f"5xx: {report.server_errors}; errors: {sum(report.errors.values())}")
    for what, n in report.errors.most_common(5):
        print(f"  {n} x {what}")
    if report.latencies:
        print(f"latency of well-formed requests (s): p50 {statistics.median(report.latencies):.2f}, "
              f"p95 {percentile(report.latencies, 0.95):.2f} ({len(report.latencies)} completed)")
    print(f"health checks: {report.health_checks}, failures: {report.health_failures}")
    rss = report.rss_kib
    half = rss[len(rss) // 2:]
    print(f"server RSS (MiB): start {rss[0] / 1024:.0f}, peak {max(rss) / 1024:.0f}, end {rss[-1] / 1024:.0f} "
          f"(peak of the second half {max(half) / 1024:.0f}; bounded: {memory_is_bounded(report)})")


def memory_is_bounded(report: Report) -> bool:
    """The server's RSS levels off: the second half's peak is within 10% (+16 MiB) of the first half's.
    A leak per request would keep it climbing through the whole run."""
    rss = report.rss_kib
    first, second = rss[:len(rss) // 2], rss[len(rss) // 2:]
    return bool(first) and max(second) <= 1.1 * max(first) + (16 << 10)


def passed(report: Report) -> bool:
    return (report.server_errors == 0 and not report.errors and report.health_failures == 0
            and memory_is_bounded(report))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=None, help="default: a tiny seeded model built here")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-batch-size", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(args.checkpoint) if args.checkpoint else random_checkpoint(Path(tmp), n_positions=256)
        server = Server(ckpt, "--max-batch-size", str(args.max_batch_size))
        try:
            print(f"lmforge serve (pid {server.proc.pid}) on {ckpt}; {args.clients} clients for {args.seconds:g} s, "
                  f"max_tokens {args.max_tokens}", flush=True)
            report = asyncio.run(soak(server.base, server.proc.pid, args.clients, args.seconds, args.max_tokens))
            alive = server.proc.poll() is None
        finally:
            server.stop()
    print_report(report)
    print(f"server still running at the end: {alive}")
    ok = passed(report) and alive
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
