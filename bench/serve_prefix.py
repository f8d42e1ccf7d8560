# python3 bench/serve_prefix.py PORT DOC_WORDS
# Prefix reuse on a running `longmoe serve`: a long document with a question, sent cold, then the same document with
# other questions (each resumes from the document's stored prefix) and the cold request again; time to 16
# generated tokens and whether each answer equals the one of a cold run of the same prompt (greedy).
import json, sys, time, http.client
port, words = int(sys.argv[1]), int(sys.argv[2])
def get(path):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60); c.request("GET", path)
    return json.loads(c.getresponse().read())
def post(prompt, mt=1):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    t0 = time.time()
    c.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": mt, "temperature": 0}),
              {"Content-Type": "application/json"})
    r = c.getresponse(); j = json.loads(r.read())
    return r.status, j.get("usage", {}).get("prompt_tokens", 0), time.time() - t0, j["choices"][0]["text"] if r.status == 200 else j
doc = "the river stone light " * words
qs = [" where is the stone?", " what is the light?", " who saw the river?"]
cold = post(doc + qs[0], 16)
print(f"cold: {cold[1]} prompt tokens, {cold[2]:.2f} s ({cold[1] / cold[2]:.0f} tokens/s)")
for q in qs:
    warm = post(doc + q, 16)
    print(f"warm '{q.strip()}': {warm[2] * 1e3:.1f} ms ({cold[2] / warm[2]:.0f}x faster than cold), status {warm[0]}")
again = post(doc + qs[0], 16)
print(f"the cold prompt again: {again[2] * 1e3:.1f} ms, same text as its cold run: {again[3] == cold[3]}")
print("prefix cache:", json.dumps(get("/health")["prefix_cache"]))
