# python3 bench/serve_latency.py PORT PROMPT_WORDS
# A short request's latency while a long prompt prefills on a running `longmoe serve` (and unloaded).
import json, sys, threading, time, http.client
port, words = int(sys.argv[1]), int(sys.argv[2])
def post(prompt, mt):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.time()
    c.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": mt, "temperature": 0}),
              {"Content-Type": "application/json"})
    r = c.getresponse(); j = json.loads(r.read())
    return r.status, j.get("usage", {}).get("prompt_tokens", 0), time.time() - t0
base = min(post("alpha beta", 2)[2] for _ in range(5))
out = {}
th = threading.Thread(target=lambda: out.update(long=post("the river stone light " * words, 2)))
th.start(); time.sleep(0.05)
short = post("alpha beta", 2)
th.join()
print(f"latency: a 2-token request alone {base * 1e3:.1f} ms, during a {out['long'][1]}-token prefill "
      f"{short[2] * 1e3:.1f} ms ({short[2] / base:.1f}x); the long request took {out['long'][2]:.2f} s "
      f"({out['long'][1] / out['long'][2]:.0f} prompt tokens/s); status {short[0]}, {out['long'][0]}")
