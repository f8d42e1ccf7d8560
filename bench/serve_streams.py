# python3 bench/serve_streams.py --port PORT [--clients 64] [--seconds 60] [--max-tokens 64]
#                                [--long-prompt N --vocab V]
# Streaming clients against a running `longmoe serve` (standard library only). Each client streams greedy
# completions of one of 16 prompts back to back; every answer must equal that prompt's non-streaming answer taken
# first, alone. Prints aggregate generated tokens/s, time to first token and inter-token latency (p50 / p99).
# --long-prompt N: then one client sends a prompt of N token ids (below V) while the others stream; the inter-token
# gaps of the other streams while it is in flight are compared with theirs before it arrived (p99 ratio; issue 18's
# bound is 3x). Exits non-zero when a request fails or an answer differs.
import argparse, http.client, json, random, threading, time

PROMPTS = [f"the river stone {i} light and seven green clouds" for i in range(16)]


def post(port, body, timeout=600):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return c, c.getresponse()


def stream(port, prompt, max_tokens):
    """One streamed completion: (status, text, completion tokens, send time, [arrival time of each content event])."""
    t0 = time.monotonic()
    c, r = post(port, {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    if r.status != 200:
        r.read()
        return r.status, "", 0, t0, []
    text, times, used = [], [], 0
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if ev.get("usage"):
            used = ev["usage"]["completion_tokens"]
        for ch in ev.get("choices", []):
            if ch.get("text"):
                text.append(ch["text"])
                times.append(time.monotonic())
    c.close()
    return 200, "".join(text), used, t0, times


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p / 100))] if xs else float("nan")


def run_clients(a, n, seconds, want, on_start=None):
    stats = {"requests": 0, "bad": 0, "tokens": 0, "ttft": [], "gaps": []}  # gaps: (end time, seconds)
    lock = threading.Lock()
    t_end = time.monotonic() + seconds

    def client(i):
        k = i
        while time.monotonic() < t_end:
            p = PROMPTS[k % len(PROMPTS)]
            k += 1
            st, text, used, t0, times = stream(a.port, p, a.max_tokens)
            with lock:
                stats["requests"] += 1
                if st != 200 or text != want[p]:
                    stats["bad"] += 1
                    if stats["bad"] <= 3:
                        print(f"  bad answer (status {st}) for {p!r}: {text[:60]!r} vs {want[p][:60]!r}")
                stats["tokens"] += used
                if times:
                    stats["ttft"].append(times[0] - t0)
                    stats["gaps"] += [(times[j], times[j] - times[j - 1]) for j in range(1, len(times))]

    th = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    t0 = time.monotonic()
    [t.start() for t in th]
    extra = on_start() if on_start else None
    [t.join() for t in th]
    return stats, time.monotonic() - t0, extra


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--long-prompt", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=400)
    a = ap.parse_args()

    want = {}
    for p in PROMPTS:
        c, r = post(a.port, {"prompt": p, "max_tokens": a.max_tokens, "temperature": 0})
        j = json.loads(r.read())
        assert r.status == 200, j
        want[p] = j["choices"][0]["text"]
    ok = True

    def report(name, s, wall):
        ms = lambda x: f"{1e3 * x:.1f}"
        gaps = [g for _, g in s["gaps"]]
        print(f"{name}: {s['requests']} streams ({s['bad']} wrong or failed), {s['tokens']} tokens in {wall:.1f} s = "
              f"{s['tokens'] / wall:.0f} generated tok/s; TTFT p50 {ms(pct(s['ttft'], 50))} / p99 "
              f"{ms(pct(s['ttft'], 99))} ms; inter-token p50 {ms(pct(gaps, 50))} / p99 {ms(pct(gaps, 99))} ms")
        return s["bad"] == 0 and s["requests"] > 0

    s, wall, _ = run_clients(a, a.clients, a.seconds, want)
    ok &= report(f"{a.clients} streaming clients", s, wall)
    if a.long_prompt > 0:
        ids = [random.Random(7).randrange(1, a.vocab) for _ in range(a.long_prompt)]

        def long_one():
            time.sleep(a.seconds / 3)
            t0 = time.monotonic()
            c, r = post(a.port, {"prompt": ids, "max_tokens": 1, "temperature": 0})
            j = json.loads(r.read())
            return r.status, j.get("usage", {}).get("prompt_tokens", 0), t0, time.monotonic()

        n = a.clients - 1
        s, wall, (st, ptok, l0, l1) = run_clients(a, n, a.seconds, want, long_one)
        ok &= report(f"{n} streaming clients and one {ptok}-token prompt", s, wall) and st == 200
        before = [g for t, g in s["gaps"] if t < l0]
        during = [g for t, g in s["gaps"] if l0 <= t <= l1]
        r = pct(during, 99) / pct(before, 99)
        print(f"  the long prompt (status {st}) took {l1 - l0:.2f} s ({ptok / (l1 - l0):.0f} prompt tok/s); the streams' "
              f"inter-token p99 {1e3 * pct(before, 99):.1f} ms before it, {1e3 * pct(during, 99):.1f} ms while it "
              f"prefilled ({len(during)} gaps): {r:.2f}x (bound 3x)")
    print("serve_streams:", "PASS" if ok else "FAIL")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
