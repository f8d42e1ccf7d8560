#!/usr/bin/env python3
"""Load client for `longmoe serve` (standard library only).

N concurrent clients against one server, first for a warm-up (at least --warmup seconds and
--warmup-requests answered requests, so every HTTP thread and batch size has been through), then for
--seconds measured seconds: each loops over streaming and plain requests for
a fixed set of prompts with greedy decoding and checks every answer against the reference answer taken
before the load starts (batched decoding is bitwise equal to decoding alone, so answers must match
exactly); every k-th request of a client is a malformed one from a fixed list that must get a 400 (404 for the unknown model) with a
JSON error body. The server's resident memory (VmRSS of --pid) is sampled every second; the report gives
it at the end of warm-up and at the end. Exit status 0 only if every request was answered correctly and
RSS at the end exceeds RSS at the end of warm-up by at most --rss-slack-mib (the maximum in between is
reported too: single samples move by a page or two while requests come and go).
"""
import argparse, http.client, json, sys, threading, time

BAD = [
    ("/v1/completions", "{not json"),
    ("/v1/completions", '{"prompt": 5}'),
    ("/v1/completions", '{"prompt": "x", "max_tokens": "lots"}'),
    ("/v1/completions", '{"prompt": "x", "model": "no-such-model"}'),
    ("/v1/completions", '{"prompt": "x", "temperature": 9}'),
    ("/v1/completions", '{"prompt": "x", "top_p": 0}'),
    ("/v1/completions", '{"prompt": "x", "max_tokens": 0}'),
    ("/v1/chat/completions", '{"messages": [{"role": "wizard", "content": "x"}]}'),
    ("/v1/completions", None),  # over-long prompt, filled in main()
]
PROMPTS = ["The river", "alpha beta gamma", "Once upon a time", "light and stone", "seven green clouds",
           "What is the pass key?", "In the beginning", "numbers: 1 2 3"]


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def request(port, path, body, timeout=120):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", path, body=body.encode(), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.getheader("Content-Type") or "", r.read().decode("utf-8", "replace")
    finally:
        c.close()


def sse_text(body):
    """Concatenated text of an SSE body; raises on bad framing."""
    events = body.split("\n\n")
    assert events[-1] == "", "body does not end with a blank line"
    events = events[:-1]
    assert events and events[-1] == "data: [DONE]", "no [DONE]"
    text, finish = "", None
    for e in events[:-1]:
        assert e.startswith("data: "), f"bad event {e[:40]!r}"
        j = json.loads(e[6:])
        c = j["choices"][0]
        text += c.get("text", "") if "text" in c else c.get("delta", {}).get("content", "")
        finish = c.get("finish_reason")
    assert finish is not None, "no finish_reason in the last event"
    return text, finish


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--warmup", type=float, default=20)
    ap.add_argument("--warmup-requests", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--bad-every", type=int, default=5)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--rss-slack-mib", type=float, default=2)
    a = ap.parse_args()
    BAD[-1] = ("/v1/completions", json.dumps({"prompt": "alpha " * (2 * a.context)}))

    def body(p, stream, chat):
        b = {"max_tokens": a.max_tokens, "temperature": 0, "stream": stream}
        if chat:
            b["messages"] = [{"role": "user", "content": p}]
        else:
            b["prompt"] = p
        return json.dumps(b)

    ref = {}
    for p in PROMPTS:
        for chat in (False, True):
            st, _, out = request(a.port, "/v1/chat/completions" if chat else "/v1/completions", body(p, False, chat))
            assert st == 200, out
            c = json.loads(out)["choices"][0]
            ref[(p, chat)] = c["message"]["content"] if chat else c["text"]

    lock = threading.Lock()
    stats = {"ok": 0, "wrong": 0, "bad_ok": 0, "bad_wrong": 0, "errors": 0, "tokens": 0}
    failures = []
    t_end = [float("inf")]  # set once the warm-up is over

    def client(i):
        n = 0
        while time.time() < t_end[0]:
            n += 1
            what = "?"
            try:
                if n % a.bad_every == 0:
                    path, b = BAD[(i + n) % len(BAD)]
                    what = f"bad {b[:30]!r}"
                    st, ct, out = request(a.port, path, b)
                    want = 404 if "no-such-model" in b else 400  # an unknown model is OpenAI's 404 model_not_found
                    good = st == want and "error" in json.loads(out) and ct.startswith("application/json")
                    with lock:
                        stats["bad_ok" if good else "bad_wrong"] += 1
                        if not good:
                            failures.append(f"bad request {b[:40]!r} -> {st} {out[:100]}")
                    continue
                p = PROMPTS[(i * 7 + n) % len(PROMPTS)]
                chat = (i + n) % 3 == 0
                stream = (i + n) % 2 == 0
                what = f"{p!r} chat={chat} stream={stream}"
                st, ct, out = request(a.port, "/v1/chat/completions" if chat else "/v1/completions",
                                      body(p, stream, chat))
                if st != 200:
                    raise AssertionError(f"status {st}: {out[:200]}")
                if stream:
                    assert ct.startswith("text/event-stream"), ct
                    text, _ = sse_text(out)
                else:
                    j = json.loads(out)
                    c = j["choices"][0]
                    text = c["message"]["content"] if chat else c["text"]
                    with lock:
                        stats["tokens"] += j["usage"]["completion_tokens"]
                with lock:
                    if text == ref[(p, chat)]:
                        stats["ok"] += 1
                    else:
                        stats["wrong"] += 1
                        failures.append(f"{p!r} chat={chat} stream={stream}: {text!r} != {ref[(p, chat)]!r}")
            except Exception as e:  # noqa: BLE001 - every failure is counted and reported
                with lock:
                    stats["errors"] += 1
                    failures.append(f"client {i} ({what}): {type(e).__name__}: {e}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
    t0 = time.time()
    for t in threads:
        t.start()
    samples = []
    heap = []
    t_warm = None
    while any(t.is_alive() for t in threads):
        now = time.time() - t0
        if t_warm is None:
            with lock:
                answered = stats["ok"] + stats["wrong"] + stats["errors"] + stats["bad_ok"] + stats["bad_wrong"]
            if now >= a.warmup and answered >= a.warmup_requests:
                t_warm = now
                t_end[0] = time.time() + a.seconds
        samples.append((now, rss_kib(a.pid)))
        if len(samples) % 5 == 1:
            try:
                c = http.client.HTTPConnection("127.0.0.1", a.port, timeout=10)
                c.request("GET", "/health")
                heap.append(json.loads(c.getresponse().read())["heap_in_use_bytes"] / 2**20)
                c.close()
            except Exception:  # noqa: BLE001 - a missed sample only
                pass
        time.sleep(1)
    for t in threads:
        t.join()
    wall = time.time() - t0
    warm = [r for (t, r) in samples if t_warm is not None and t >= t_warm and r]
    rss_warm = warm[0] / 1024 if warm else float("nan")
    rss_end = warm[-1] / 1024 if warm else float("nan")
    rss_max = max(warm) / 1024 if warm else float("nan")
    total = stats["ok"] + stats["wrong"] + stats["errors"]
    print(f"serve_load: {a.clients} clients for {wall:.1f} s: {total} generation requests "
          f"({stats['ok']} correct, {stats['wrong']} wrong, {stats['errors']} errors), "
          f"{stats['bad_ok'] + stats['bad_wrong']} malformed ({stats['bad_ok']} got 400 + JSON error); "
          f"{total / wall:.1f} req/s")
    print(f"serve_load: warm-up {t_warm:.0f} s; measured {wall - t_warm:.0f} s")
    print(f"serve_load: server RSS after warm-up {rss_warm:.1f} MiB, at the end {rss_end:.1f} MiB, "
          f"max after warm-up {rss_max:.1f} MiB (growth {rss_end - rss_warm:+.1f} MiB)")
    print("serve_load: RSS MiB every 5 s: " + " ".join(f"{r / 1024:.0f}" for (t, r) in samples[::5] if r))
    print("serve_load: heap in use (MiB) every 5 s: " + " ".join(f"{h:.1f}" for h in heap))
    for f in failures[:10]:
        print("  FAIL", f)
    good = (stats["wrong"] == 0 and stats["errors"] == 0 and stats["bad_wrong"] == 0 and total > 0
            and rss_end - rss_warm <= a.rss_slack_mib)
    print("serve_load: PASS" if good else "serve_load: FAIL")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
