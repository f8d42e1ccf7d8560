# python3 bench/serve_clients.py PORT CLIENTS MAX_TOKENS [PROMPT_WORDS]
# Concurrent completions against a running `longmoe serve`: aggregate generated tokens/s at N clients.
import json, sys, threading, time, http.client
port, n, max_tokens = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
prompt_words = int(sys.argv[4]) if len(sys.argv) > 4 else 20
res = []
def health():
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60); c.request("GET", "/health")
    return json.loads(c.getresponse().read())
h0 = health()
def one(i):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"prompt": ("the river stone %d " % i) * prompt_words, "max_tokens": max_tokens, "temperature": 0})
    t0 = time.time()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse(); j = json.loads(r.read())
    res.append((r.status, j.get("usage", {}).get("completion_tokens", 0), j.get("usage", {}).get("prompt_tokens", 0), time.time() - t0))
t0 = time.time()
th = [threading.Thread(target=one, args=(i,)) for i in range(n)]
[t.start() for t in th]; [t.join() for t in th]
t = time.time() - t0
h1 = health()
d = {k: h1[k] - h0[k] for k in ("decode_steps", "decode_tokens", "decode_seconds", "prefill_chunks", "prefill_seconds")}
ok = sum(1 for r in res if r[0] == 200); gen = sum(r[1] for r in res); pr = sum(r[2] for r in res)
print(f"serve load: {n} concurrent clients, {ok} ok, {pr} prompt + {gen} generated tokens in {t:.2f} s: "
      f"{gen / t:.0f} generated tokens/s, mean latency {sum(r[3] for r in res) / n:.2f} s")
print(f"  engine: {d['decode_steps']} decode steps ({d['decode_tokens']} tokens) in {d['decode_seconds']:.3f} s "
      f"({1e3 * d['decode_seconds'] / max(1, d['decode_steps']):.2f} ms/step), {d['prefill_chunks']} prefill chunks in "
      f"{d['prefill_seconds']:.3f} s; the rest of {t:.2f} s is the scheduler, sampling and HTTP")
