#!/usr/bin/env python3
"""Attacks on a running `longmoe serve` (issue 24's repeated attack runs).

Measures the latency of short sequential requests unloaded, then again under the attack, for `--seconds` (60):
  slow connections (default): `--slow` connections (200) each send one more header line every `--interval` seconds
    (10) and never finish their request, reopening whenever the server closes one;
  --long-prompt N: one client sends prompts of N token ids (max_tokens 1) back to back, so a long prefill is always
    in progress (the server needs --context > N).
Every short request must be answered with 200; prints p50 / p99 of both phases and their ratio, and exits non-zero
when a request failed or loaded p99 > `--max-ratio` x unloaded p99 (default 2; issue 24 bounds the long prompt at 3).
  python3 scripts/serve_attack.py --port P [--slow 200] [--seconds 60] [--interval 10] [--max-ratio 2]
  python3 scripts/serve_attack.py --port P --long-prompt 60000 [--seconds 120] --max-ratio 3
"""
import argparse, http.client, json, socket, sys, threading, time


def complete(port, body, timeout):
    """POSTs /v1/completions; (answered with 200, milliseconds)."""
    t0 = time.monotonic()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        r.read()
        ok = r.status == 200
    except OSError:
        ok = False
    finally:
        c.close()
    return ok, (time.monotonic() - t0) * 1e3


def short(port):
    return complete(port, json.dumps({"prompt": "alpha", "max_tokens": 2, "temperature": 0}), 60)


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--slow", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--unloaded-seconds", type=float, default=15)
    ap.add_argument("--interval", type=float, default=10)
    ap.add_argument("--max-ratio", type=float, default=2.0)
    ap.add_argument("--long-prompt", type=int, default=0, help="tokens of the long prompt (0: the slow attack)")
    ap.add_argument("--vocab", type=int, default=300, help="long-prompt ids are drawn from [3, vocab)")
    a = ap.parse_args()

    for _ in range(5):
        short(a.port)  # warm-up
    unloaded, failed = [], 0
    t_end = time.monotonic() + a.unloaded_seconds
    while time.monotonic() < t_end:
        ok, ms = short(a.port)
        failed += not ok
        unloaded.append(ms)

    stop = threading.Event()
    stats = {"opened": 0, "closed_by_server": 0}
    lock = threading.Lock()

    def slowloris(i):
        line = 0
        s = None
        while not stop.is_set():
            try:
                if s is None:
                    s = socket.create_connection(("127.0.0.1", a.port), timeout=5)
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                    with lock:
                        stats["opened"] += 1
                    line = 0
                stop.wait(a.interval)
                s.sendall(f"X-Slow-{line}: {i}\r\n".encode())
                line += 1
            except OSError:
                with lock:
                    stats["closed_by_server"] += 1
                try:
                    s.close()
                except Exception:
                    pass
                s = None
        if s is not None:
            s.close()

    longs = {"done": 0, "failed": 0, "ms": []}

    def long_prompts():
        k = 0
        while not stop.is_set():
            # (each prompt differs from its first token on: no prefix-cache hit shortens it)
            ids = [3 + (i * 7 + k) % (a.vocab - 3) for i in range(a.long_prompt)]
            body = json.dumps({"prompt": ids, "max_tokens": 1})
            k += 1
            ok, ms = complete(a.port, body, 3600)
            with lock:
                longs["done" if ok else "failed"] += 1
                longs["ms"].append(ms)

    if a.long_prompt > 0:
        threads = [threading.Thread(target=long_prompts, daemon=True)]
    else:
        threads = [threading.Thread(target=slowloris, args=(i,), daemon=True) for i in range(a.slow)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    loaded = []
    t_end = time.monotonic() + a.seconds
    while time.monotonic() < t_end:
        ok, ms = short(a.port)
        failed += not ok
        loaded.append(ms)
    stop.set()
    for t in threads:
        t.join(timeout=a.interval + 5 if a.long_prompt == 0 else 0.1)
    u50, u99, l50, l99 = pct(unloaded, 50), pct(unloaded, 99), pct(loaded, 50), pct(loaded, 99)
    if a.long_prompt > 0:
        attack = {"long_prompt_tokens": a.long_prompt, "long_prompts_done": longs["done"],
                  "long_prompts_failed": longs["failed"], "long_prompt_ms": [round(x) for x in longs["ms"]]}
    else:
        attack = {"slow_connections": a.slow, "interval_s": a.interval, "slow_opened": stats["opened"],
                  "slow_closed_by_server": stats["closed_by_server"]}
    print(json.dumps({**attack, "seconds": a.seconds,
                      "unloaded": {"requests": len(unloaded), "p50_ms": round(u50, 2), "p99_ms": round(u99, 2)},
                      "loaded": {"requests": len(loaded), "p50_ms": round(l50, 2), "p99_ms": round(l99, 2)},
                      "p99_ratio": round(l99 / u99, 3), "failed": failed}))
    ok = failed == 0 and l99 <= a.max_ratio * u99
    print("serve_attack:", "PASS" if ok else "FAIL", f"(loaded p99 {l99:.1f} ms vs unloaded {u99:.1f} ms, {failed} failed)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
