#!/usr/bin/env python
"""Soak `foldline serve` with normal clients beside hostile ones, and report whether the normal ones noticed.

    .venv/bin/python scripts/soak_serve.py BUNDLE [--seconds 120]

Starts `foldline serve BUNDLE` on a free port of 127.0.0.1 (loopback only) and,
for `--seconds`, runs:

- normal clients (as many as the bundle has rows), each cycling through
  completions and chat completions, streaming and not (chat and text prompts
  only when the bundle has a tokenizer; token-id prompts otherwise);
- hostile clients, one of each: a stop flood (as many stop strings as the
  server takes, each as long as it takes, then a refused 100-string request),
  a socket that never finishes its headers, one that never finishes its body,
  a client that leaves mid-stream, and oversized bodies (declared, and chunked
  without a length);
- a /health probe every 0.1 s.

It prints normal requests sent / succeeded / failed / lost (target: none failed or
lost), /health latency p50/p99 (target p99 < 100 ms), the server's RSS at the start,
after the first tenth of the run and at the end, and how each hostile case was
answered; it exits 1 when a target is missed. Every loop is bounded in count and
in time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

HOST = "127.0.0.1"
MODEL = "soak"
MAX_TOKENS = 16
MAX_ROUNDS = 100_000  # per client loop: a bound beside the deadline
HEALTH_EVERY_S = 0.1
HEALTH_P99_TARGET_MS = 100.0
HEADER_TIMEOUT_S, BODY_TIMEOUT_S = 5.0, 10.0  # passed to the server: the slow sockets are answered within the soak
WARM_UP_SHARE = 0.1  # RSS is compared from this share of the run on: the first requests allocate
TEXT_PROMPT = "Write two sentences about the sea."
ID_PROMPT = [5, 17, 99, 3, 250]


@dataclass
class Tally:
    """Thread-safe counts: normal requests by outcome, hostile answers by case, /health latencies."""

    normal: Counter = field(default_factory=Counter)
    problems: Counter = field(default_factory=Counter)  # what went wrong with a normal request, by kind
    hostile: dict[str, Counter] = field(default_factory=dict)
    health_ms: list[float] = field(default_factory=list)
    health_failed: int = 0
    rss: list[tuple[float, float]] = field(default_factory=list)  # (seconds into the soak, server RSS in MiB)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def normal_result(self, outcome: str, problem: str | None = None) -> None:
        with self.lock:
            self.normal[outcome] += 1
            if problem:
                self.problems[problem[:120]] += 1

    def hostile_result(self, case: str, answer: str) -> None:
        with self.lock:
            self.hostile.setdefault(case, Counter())[answer] += 1


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def rss_mib(pid: int) -> float:
    """The process's resident set (VmRSS in /proc), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def start_server(bundle: str, port: int, threads: int | None, log: IO[str]) -> subprocess.Popen:
    """`foldline serve` on loopback, its log lines to `log` (a file: a pipe nobody reads would fill up)."""
    command = [sys.executable, "-m", "foldline.tools.cli", "serve", bundle, "--host", HOST, "--port", str(port),
               "--model-id", MODEL, "--header-timeout", str(HEADER_TIMEOUT_S),
               "--body-timeout", str(BODY_TIMEOUT_S)]
    if threads is not None:
        command += ["--threads", str(threads)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, text=True)
    url, deadline = f"http://{HOST}:{port}", time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise SystemExit(f"foldline serve exited with {proc.returncode}: {log.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("foldline serve did not answer /health within 300 s")


# ---- normal clients ---------------------------------------------------------------------------------------------


def _stream_ok(response: httpx.Response) -> str | None:
    """None when a server-sent event stream ended with a finish_reason and [DONE], else what was wrong."""
    finished = done = False
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            done = True
            continue
        event = json.loads(data)
        if "error" in event:
            return f"stream error: {event['error'].get('message')}"
        finished = finished or any(c.get("finish_reason") for c in event.get("choices", []))
    return None if finished and done else "stream ended without a finish_reason and [DONE]"


def normal_client(url: str, deadline: float, tally: Tally, texts: bool) -> None:
    """Cycle through the request kinds this bundle serves until the deadline; each must succeed."""
    kinds = [("/v1/completions", False), ("/v1/completions", True)]
    if texts:
        kinds += [("/v1/chat/completions", False), ("/v1/chat/completions", True)]
    with httpx.Client(timeout=120) as client:
        for round_ in range(MAX_ROUNDS):
            if time.monotonic() >= deadline:
                return
            path, stream = kinds[round_ % len(kinds)]
            body: dict = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0.7, "seed": round_,
                          "stream": stream}
            if path.endswith("chat/completions"):
                body["messages"] = [{"role": "user", "content": TEXT_PROMPT}]
            else:
                body["prompt"] = TEXT_PROMPT if texts else ID_PROMPT
            try:
                if stream:
                    with client.stream("POST", f"{url}{path}", json=body) as r:
                        problem = (f"HTTP {r.status_code}" if r.status_code != 200 else _stream_ok(r))
                else:
                    r = client.post(f"{url}{path}", json=body)
                    problem = None if r.status_code == 200 and r.json()["choices"][0]["finish_reason"] else \
                        f"HTTP {r.status_code}: {r.text[:80]}"
            except httpx.HTTPError as e:
                tally.normal_result("sent")
                tally.normal_result("lost", f"{type(e).__name__}: {e}")
                continue
            tally.normal_result("sent")
            tally.normal_result("failed" if problem else "succeeded", problem)


def health_probe(url: str, deadline: float, tally: Tally, pid: int) -> None:
    """/health every HEALTH_EVERY_S, timed; the server's RSS once a second."""
    began = time.monotonic()
    with httpx.Client(timeout=10) as client:
        for round_ in range(MAX_ROUNDS):
            if time.monotonic() >= deadline:
                return
            if round_ % round(1 / HEALTH_EVERY_S) == 0:
                tally.rss.append((time.monotonic() - began, rss_mib(pid)))
            start = time.perf_counter()
            try:
                ok = client.get(f"{url}/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            elapsed = (time.perf_counter() - start) * 1000
            with tally.lock:
                if ok:
                    tally.health_ms.append(elapsed)
                else:
                    tally.health_failed += 1
            time.sleep(max(0.0, HEALTH_EVERY_S - elapsed / 1000))


# ---- hostile clients --------------------------------------------------------------------------------------------


def _status_of(sock: socket.socket, wait_s: float) -> str:
    """The status code of the answer on a raw socket ("closed" or "no answer in N s" when there is none)."""
    sock.settimeout(wait_s)
    data = b""
    try:
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    except TimeoutError:
        return f"no answer in {wait_s:g} s"
    except OSError as e:
        return type(e).__name__
    line = data.split(b"\r\n", 1)[0].decode("latin-1")
    return line.split(" ", 2)[1] if line.startswith("HTTP/") and " " in line else "closed"


def _raw(port: int) -> socket.socket:
    return socket.create_connection((HOST, port), timeout=10)


def stop_flood(url: str, port: int, deadline: float, tally: Tally, prompt: object, max_stop: int,
               *_: object) -> None:
    """Every stop string the server takes, each as long as it takes (checked on every new piece of text),
    then a refused request with 100 of them."""
    with httpx.Client(timeout=120) as client:
        for round_ in range(MAX_ROUNDS):
            if time.monotonic() >= deadline:
                return
            count = max_stop if round_ % 2 == 0 else 100
            stops = [f"{i:03d}" + "~" * 253 for i in range(count)]
            body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "stop": stops}
            case = f"stop flood: {count} strings of 256 chars"
            try:
                tally.hostile_result(case, str(client.post(f"{url}/v1/completions", json=body).status_code))
            except httpx.HTTPError as e:
                tally.hostile_result(case, type(e).__name__)


def slow_headers(url: str, port: int, deadline: float, tally: Tally, *_: object) -> None:
    """Headers that never end: one byte a second."""
    for _ in range(MAX_ROUNDS):
        if time.monotonic() >= deadline:
            return
        with _raw(port) as sock:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}\r\n".encode())
            sock.settimeout(1.0)
            answer = None
            for _ in range(int(HEADER_TIMEOUT_S * 3)):
                try:
                    sock.sendall(b"x")
                    if sock.recv(1, socket.MSG_PEEK):
                        break
                except TimeoutError:
                    continue
                except OSError as e:
                    answer = type(e).__name__
                    break
            tally.hostile_result("headers never finished", answer or _status_of(sock, 5.0))


def slow_body(url: str, port: int, deadline: float, tally: Tally, *_: object) -> None:
    """A body that never ends: 10 of its declared 1000 bytes, then silence."""
    for _ in range(MAX_ROUNDS):
        if time.monotonic() >= deadline:
            return
        with _raw(port) as sock:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: 1000\r\n\r\n{{\"model\": ".encode())
            tally.hostile_result("body never finished", _status_of(sock, BODY_TIMEOUT_S + 10))


def leave_mid_stream(url: str, port: int, deadline: float, tally: Tally, prompt: object, _: int,
                     long_tokens: int) -> None:
    """Read two events of a long stream, then hang up; the row must come back."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": long_tokens, "stream": True}
    for _ in range(MAX_ROUNDS):
        if time.monotonic() >= deadline:
            return
        try:
            with httpx.Client(timeout=60) as client, client.stream("POST", f"{url}/v1/completions", json=body) as r:
                events = 0
                for line in r.iter_lines():
                    events += line.startswith("data: ")
                    if events == 2:
                        break
            tally.hostile_result("left after 2 stream events", f"{r.status_code}, left")
        except httpx.HTTPError as e:
            tally.hostile_result("left after 2 stream events", type(e).__name__)


def oversized(url: str, port: int, deadline: float, tally: Tally, *_: object) -> None:
    """A 2 MiB body, declared in Content-Length and then chunked without one (the limit is 1 MiB)."""
    payload = b"{\"prompt\": \"" + b"a" * (2 << 20) + b"\"}"
    for round_ in range(MAX_ROUNDS):
        if time.monotonic() >= deadline:
            return
        chunked = round_ % 2 == 1
        case = "2 MiB body, " + ("chunked" if chunked else "Content-Length")
        with _raw(port) as sock:
            head = f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
            head += "Transfer-Encoding: chunked\r\n\r\n" if chunked else f"Content-Length: {len(payload)}\r\n\r\n"
            try:
                sock.sendall(head.encode())
                for start in range(0, len(payload), 64 << 10):
                    piece = payload[start:start + (64 << 10)]
                    sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                if chunked:
                    sock.sendall(b"0\r\n\r\n")
            except OSError:
                pass  # the server answered and closed before the whole body was sent: read the answer
            tally.hostile_result(case, _status_of(sock, 10.0))
        time.sleep(0.5)


HOSTILE: list[Callable[..., None]] = [stop_flood, slow_headers, slow_body, leave_mid_stream, oversized]


# ---- the run ----------------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] if ordered else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle", help="a bundle directory (compiled with --batch N to serve N rows)")
    parser.add_argument("--seconds", type=float, default=120.0, help="how long the soak runs (default 120)")
    parser.add_argument("--threads", type=int, default=None, help="the server's CPU threads (default: its own)")
    parser.add_argument("--max-stop", type=int, default=4, help="the server's stop-string limit (default 4)")
    args = parser.parse_args(argv)
    if not Path(args.bundle, "manifest.json").is_file():
        print(f"soak_serve: {args.bundle} is not a bundle (no manifest.json)", file=sys.stderr)
        return 2
    if not 0 < args.seconds <= 3600:
        print(f"soak_serve: --seconds must be in (0, 3600], got {args.seconds:g}", file=sys.stderr)
        return 2

    max_context = json.loads(Path(args.bundle, "manifest.json").read_text())["model"]["max_context"]
    port = free_port()
    url = f"http://{HOST}:{port}"
    log = tempfile.TemporaryFile("w+")
    proc = start_server(args.bundle, port, args.threads, log)
    try:
        rows = httpx.get(f"{url}/health", timeout=10).json()["rows"]
        texts = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
                           timeout=120).status_code == 200
        rss_start = rss_mib(proc.pid)
        tally = Tally()
        deadline = time.monotonic() + args.seconds
        prompt = TEXT_PROMPT if texts else ID_PROMPT
        workers = [threading.Thread(target=normal_client, args=(url, deadline, tally, texts))
                   for _ in range(rows)]
        workers.append(threading.Thread(target=health_probe, args=(url, deadline, tally, proc.pid)))
        long_tokens = min(256, max_context // 2)  # a long generation that still fits the context
        workers += [threading.Thread(target=hostile, args=(url, port, deadline, tally, prompt, args.max_stop,
                                                           long_tokens))
                    for hostile in HOSTILE]
        started, load_at_start = time.monotonic(), os.getloadavg()[0]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(max(1.0, deadline - time.monotonic()) + 150)
        elapsed = time.monotonic() - started
        stuck = sum(w.is_alive() for w in workers)
        rss_end = rss_mib(proc.pid)
        running, waiting = (httpx.get(f"{url}/health", timeout=10).json()[k] for k in ("running", "waiting"))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    n = tally.normal
    p50, p99 = percentile(tally.health_ms, 50), percentile(tally.health_ms, 99)
    print(f"soak: {elapsed:.0f} s on {Path(args.bundle).resolve()} ({rows} rows, "
          f"{'text' if texts else 'token-id'} prompts), {os.cpu_count()} CPUs, "
          f"load average {load_at_start:.2f} at the start; server exit status {proc.returncode}")
    print("\n| measure | value | target |\n|---|---|---|")
    print(f"| normal requests sent / succeeded / failed / lost | {n['sent']} / {n['succeeded']} / {n['failed']} / "
          f"{n['lost']} | none failed or lost |")
    print(f"| /health p50 / p99 ({len(tally.health_ms)} probes, {tally.health_failed} failed) | "
          f"{p50:.1f} ms / {p99:.1f} ms | p99 < {HEALTH_P99_TARGET_MS:g} ms |")
    warm = next((mib for at, mib in tally.rss if at >= WARM_UP_SHARE * elapsed), rss_start)
    print(f"| server RSS start / after {WARM_UP_SHARE:.0%} of the run / end (max) | {rss_start:.0f} / {warm:.0f} / "
          f"{rss_end:.0f} MiB ({max((m for _, m in tally.rss), default=rss_end):.0f}) | flat after warm-up |")
    print(f"| rows running / waiting after the soak | {running} / {waiting} | 0 / 0 |")
    print("\n| hostile case | answers |\n|---|---|")
    for case, answers in sorted(tally.hostile.items()):
        print(f"| {case} | {', '.join(f'{a}: {c}' for a, c in answers.most_common())} |")
    for problem, count in tally.problems.most_common(10):
        print(f"normal request problem ({count}x): {problem}")
    missed = (n["failed"] or n["lost"] or tally.health_failed or not p99 < HEALTH_P99_TARGET_MS or stuck
              or running or waiting)
    if stuck:
        print(f"{stuck} client thread(s) did not finish")
    log.seek(0)
    lines = log.read().splitlines()
    print(f"server log: {len(lines)} lines" + "".join(f"\n  {line}" for line in lines[-8:]))
    print("targets: " + ("missed" if missed else "met"))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
