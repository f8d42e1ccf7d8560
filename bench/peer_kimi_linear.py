#!/usr/bin/env python3
"""Peer inference benchmark: HF transformers' KimiLinearForCausalLM with random weights.

Builds the model described by an HF config.json of Kimi Linear semantics (default
configs/kimi-linear-2b.json, the one `longmoe` reads too), with random weights, on one GPU,
and measures, for each (context, batch):
  prefill  one forward over batch x context random prompt ids with use_cache (or --prefill-chunk
           pieces), logits_to_keep=1; prefill_tok_s = batch*context / seconds (cuda-synchronized);
  decode   N greedy steps from that cache (input = argmax of the last logits, one token per
           sequence per step, plain forward calls, no generate()); one untimed step first;
           decode_tok_s = batch*N / seconds.
One JSON line per measurement on stdout; a shape that runs out of memory, exceeds the time limit or
fails prints a line with "skipped": reason, and the run goes on. Details of the model and of the
kernels HF resolved (fla or its torch fallback) go to stderr as one JSON line ("info").

Needs no network and no tokenizer. fla (flash-linear-attention) is used only if it is importable
when transformers' modeling_kimi_linear is first imported (HF resolves its KDA kernels then):
give --fla-path DIR (prepended to sys.path) or PYTHONPATH; --no-fla forces the torch fallback.

Usage (GPU):
  python3 bench/peer_kimi_linear.py [--config configs/kimi-linear-2b.json] [--fla-path DIR]
      [--contexts 4096,32768,131072] [--batches 1,32] [--decode-tokens 32] [--time-limit 300]
      [--isolate]
Smoke test without a GPU (tiny shape of the same family, float32):
  python3 bench/peer_kimi_linear.py --tiny --device cpu --dtype float32 --contexts 64 --batches 1,2 \
      --decode-tokens 4
"""
import argparse
import gc
import json
import math
import os
import signal
import subprocess
import sys
import time
import traceback
import types

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PEER = "hf-transformers"


def log(msg):
    print(f"[peer_kimi_linear] {msg}", file=sys.stderr, flush=True)


def emit(obj):
    print(json.dumps(obj), flush=True)


def int_list(s):
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got '{s}'")
    if not out or any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"expected positive integers, got '{s}'")
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(REPO, "configs", "kimi-linear-2b.json"),
                   help="HF config.json of Kimi Linear semantics (default: configs/kimi-linear-2b.json)")
    p.add_argument("--fla-path", default=None, help="directory prepended to sys.path so that 'import fla' works")
    p.add_argument("--no-fla", action="store_true", help="hide fla: HF uses its torch KDA fallback")
    p.add_argument("--contexts", type=int_list, default=[4096, 32768, 131072])
    p.add_argument("--batches", type=int_list, default=[1, 32])
    p.add_argument("--decode-tokens", type=int, default=32, help="timed greedy decode steps per shape")
    p.add_argument("--time-limit", type=float, default=300.0,
                   help="seconds allowed for the prefill and, separately, for the decode of one shape")
    p.add_argument("--prefill-chunk", type=int, default=0,
                   help="prefill in pieces of this many tokens per sequence (0: one forward)")
    p.add_argument("--prefill-reps", type=int, default=2,
                   help="prefills per shape, the fastest reported (the first at a new shape can include one-time "
                        "costs: kernel autotuning, attention plans); fewer when the time limit would be passed")
    p.add_argument("--warmup-context", type=int, default=512, help="context of the warm-up run per batch size")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--attn-impl", default="sdpa", help="HF attn_implementation (sdpa, eager, flash_attention_2, ...)")
    p.add_argument("--experts-impl", default=None,
                   help="HF experts_implementation (eager, grouped_mm, batched_mm); default: HF's choice")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-predict-skip", action="store_true",
                   help="try every shape even when a smaller one at the same batch predicts it will fail")
    p.add_argument("--isolate", action="store_true",
                   help="run each shape in a fresh subprocess (hard timeout; a crash cannot affect later shapes)")
    p.add_argument("--tiny", action="store_true", help="shrink the config to a tiny model (smoke test)")
    p.add_argument("--check-only", action="store_true",
                   help="build the model on the meta device, print the info line and exit (no GPU needed)")
    p.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.decode_tokens < 0 or a.time_limit <= 0 or a.prefill_chunk < 0 or a.prefill_reps < 1:
        p.error("--decode-tokens >= 0, --time-limit > 0, --prefill-chunk >= 0, --prefill-reps >= 1")
    return a


# ----------------------------------------------------------------------------------------------
# Config: the JSON as HF reads it, with every HF alias set explicitly. HF's config class maps some
# of the published field names onto its own (n_routed_experts / num_local_experts, n_shared_experts,
# num_experts_per_tok, n_group, norm_topk_prob, linear_* from linear_attn_config); a field it does not
# map keeps its class default (256 experts, 1 shared, ...), which for a small model is wrong. So the
# values are resolved here the way longmoe resolves them and written under every name, and the
# built model is checked against them (structure_check).
# ----------------------------------------------------------------------------------------------
def pick(raw, *names, default=None):
    for n in names:
        if n in raw and raw[n] is not None:
            return raw[n]
    return default


def canonical(raw):
    la = raw.get("linear_attn_config") or {}
    L = raw["num_hidden_layers"]
    kda = la.get("kda_layers")
    full = la.get("full_attn_layers")
    if kda is None or full is None:  # HF's default pattern: MLA every 4th layer
        full = [i for i in range(1, L + 1) if i % 4 == 0]
        kda = [i for i in range(1, L + 1) if i % 4 != 0]
    fk = pick(raw, "first_k_dense_replace", default=0)
    freq = pick(raw, "moe_layer_freq", default=1)
    E = pick(raw, "num_experts", "num_local_experts", "n_routed_experts", default=0)
    c = {
        "vocab_size": raw["vocab_size"],
        "hidden_size": raw["hidden_size"],
        "num_hidden_layers": L,
        "num_attention_heads": raw["num_attention_heads"],
        "num_key_value_heads": pick(raw, "num_key_value_heads", default=raw["num_attention_heads"]),
        "q_lora_rank": raw.get("q_lora_rank"),
        "kv_lora_rank": raw["kv_lora_rank"],
        "qk_nope_head_dim": raw["qk_nope_head_dim"],
        "qk_rope_head_dim": raw["qk_rope_head_dim"],
        "v_head_dim": raw["v_head_dim"],
        "kda_heads": pick(la, "num_heads", default=pick(raw, "linear_num_heads", default=32)),
        "kda_head_dim": pick(la, "head_dim", default=pick(raw, "linear_head_dim", default=128)),
        "kda_conv": pick(la, "short_conv_kernel_size", default=pick(raw, "linear_conv_kernel_dim", default=4)),
        "kda_full_rank_gate": bool(la.get("use_full_rank_gate", False)),
        "kda_gate_lower_bound": la.get("gate_lower_bound"),
        "kda_layers": sorted(kda),
        "full_attn_layers": sorted(full),
        "intermediate_size": pick(raw, "intermediate_size", default=0),
        "first_k_dense_replace": fk,
        "moe_layers": [i for i in range(L) if E > 0 and i >= fk and i % freq == 0],  # as longmoe's is_moe
        "num_experts": E,
        "num_experts_per_token": pick(raw, "num_experts_per_token", "num_experts_per_tok", default=0),
        "num_shared_experts": pick(raw, "num_shared_experts", "n_shared_experts", default=0),
        "moe_intermediate_size": pick(raw, "moe_intermediate_size", default=0),
        "moe_renormalize": bool(pick(raw, "moe_renormalize", "norm_topk_prob", default=True)),
        "num_expert_group": pick(raw, "num_expert_group", "n_group", default=1),
        "topk_group": pick(raw, "topk_group", default=1),
        "routed_scaling_factor": pick(raw, "routed_scaling_factor", default=1.0),
    }
    return c


def tiny(raw):
    raw = dict(raw)
    raw.update({"vocab_size": 1024, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 2,
                "num_key_value_heads": 2, "intermediate_size": 512, "num_experts": 8, "num_experts_per_token": 2,
                "moe_intermediate_size": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2})
    la = dict(raw.get("linear_attn_config") or {})
    la.update({"num_heads": 2, "kda_layers": [1, 2, 3], "full_attn_layers": [4]})
    raw["linear_attn_config"] = la
    return raw


def expected_params(c):
    """Parameter count of a Kimi Linear model of this shape (what longmoe's `params` calls trainable)."""
    d, V, H, K, ks = c["hidden_size"], c["vocab_size"], c["kda_heads"], c["kda_head_dim"], c["kda_conv"]
    HK = H * K
    gate = d * HK if c["kda_full_rank_gate"] else d * K + K * HK
    kda = 3 * d * HK + 3 * HK * ks + (d * K + K * HK) + d * H + H + HK + gate + K + HK * d
    h, r, ro, no, v = (c["num_attention_heads"], c["kv_lora_rank"], c["qk_rope_head_dim"], c["qk_nope_head_dim"],
                       c["v_head_dim"])
    q = d * h * (no + ro) if not c["q_lora_rank"] else d * c["q_lora_rank"] + c["q_lora_rank"] + c["q_lora_rank"] * h * (no + ro)
    mla = q + d * (r + ro) + r + r * h * (no + v) + h * v * d
    E, Im, ns = c["num_experts"], c["moe_intermediate_size"], c["num_shared_experts"]
    moe = E * 3 * d * Im + E * d + 3 * d * Im * ns
    L = c["num_hidden_layers"]
    n_moe = len(c["moe_layers"])
    return (2 * V * d + d + L * 2 * d + len(c["kda_layers"]) * kda + len(c["full_attn_layers"]) * mla
            + (L - n_moe) * 3 * d * c["intermediate_size"] + n_moe * moe)


def hf_config(KimiLinearConfig, raw, c, args):
    raw = dict(raw)
    try:
        cfg = KimiLinearConfig.from_dict(raw)
    except Exception as e:  # older/newer signatures
        log(f"KimiLinearConfig.from_dict failed ({type(e).__name__}: {e}); trying the constructor")
        raw.pop("architectures", None)
        raw.pop("model_type", None)
        cfg = KimiLinearConfig(**raw)
    L = c["num_hidden_layers"]
    layer_types = ["full_attention" if (i + 1) in c["full_attn_layers"] else "linear_attention" for i in range(L)]
    mlp_types = ["sparse" if i in c["moe_layers"] else "dense" for i in range(L)]
    H, K = c["kda_heads"], c["kda_head_dim"]
    values = {
        # MoE (every spelling HF has used; attribute_map aliases land on the real field)
        "num_experts": c["num_experts"], "num_local_experts": c["num_experts"], "n_routed_experts": c["num_experts"],
        "num_experts_per_tok": c["num_experts_per_token"], "num_experts_per_token": c["num_experts_per_token"],
        "n_shared_experts": c["num_shared_experts"], "num_shared_experts": c["num_shared_experts"],
        "norm_topk_prob": c["moe_renormalize"], "moe_renormalize": c["moe_renormalize"],
        "n_group": c["num_expert_group"], "num_expert_group": c["num_expert_group"], "topk_group": c["topk_group"],
        "moe_intermediate_size": c["moe_intermediate_size"], "routed_scaling_factor": c["routed_scaling_factor"],
        "first_k_dense_replace": c["first_k_dense_replace"],
        "intermediate_size": c["intermediate_size"], "dense_ffn_hidden": c["intermediate_size"],
        # KDA
        "linear_num_heads": H, "linear_head_dim": K, "linear_conv_kernel_dim": c["kda_conv"],
        "linear_num_key_heads": H, "linear_key_head_dim": K, "linear_num_value_heads": H, "linear_value_head_dim": K,
        "linear_attn_key_heads": H, "linear_attn_key_head_dim": K,
        "linear_attn_value_heads": H, "linear_attn_value_head_dim": K,
        "forget_gate_lower_bound": c["kda_gate_lower_bound"], "use_full_rank_output_gate": c["kda_full_rank_gate"],
        # layer pattern
        "layer_types": layer_types, "mlp_layer_types": mlp_types,
        # Kimi Linear, not K3: no MLA output gate, no AttnRes
        "mla_use_output_gate": bool(raw.get("mla_use_output_gate", False)),
        "attn_res_block_size": raw.get("attn_res_block_size") or 0,
        "use_cache": True,
    }
    failed = []
    for k, v in values.items():
        try:
            setattr(cfg, k, v)
        except Exception as e:
            failed.append(f"{k}: {type(e).__name__}")
    if failed:
        log("could not set config attributes: " + ", ".join(failed))
    return cfg


def structure_check(model, c):
    """Differences between the built HF model and the config (empty list: it is the intended model)."""
    bad = []
    try:
        layers = model.model.layers
        if len(layers) != c["num_hidden_layers"]:
            bad.append(f"layers {len(layers)} != {c['num_hidden_layers']}")
        kda = [i + 1 for i, l in enumerate(layers) if "Delta" in type(l.self_attn).__name__]
        mla = [i + 1 for i, l in enumerate(layers) if "Delta" not in type(l.self_attn).__name__]
        if kda != c["kda_layers"] or mla != c["full_attn_layers"]:
            bad.append(f"KDA layers {kda} / MLA layers {mla} != {c['kda_layers']} / {c['full_attn_layers']}")
        d = c["hidden_size"]
        HK = c["kda_heads"] * c["kda_head_dim"]
        h = c["num_attention_heads"]
        for i, l in enumerate(layers):
            a, m = l.self_attn, l.mlp
            if "Delta" in type(a).__name__:
                if a.q_proj.out_features != HK or a.v_proj.out_features != HK or a.o_proj.in_features != HK:
                    bad.append(f"layer {i}: KDA q/v/o widths {a.q_proj.out_features}/{a.v_proj.out_features}/"
                               f"{a.o_proj.in_features} != {HK}")
            else:
                qo = getattr(getattr(a, "q_proj", None), "out_features", None) or a.q_b_proj.out_features
                if qo != h * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"]) or \
                        a.kv_b_proj.out_features != h * (c["qk_nope_head_dim"] + c["v_head_dim"]) or \
                        a.kv_a_proj_with_mqa.out_features != c["kv_lora_rank"] + c["qk_rope_head_dim"]:
                    bad.append(f"layer {i}: MLA widths differ from the config")
            if hasattr(m, "experts"):
                if i not in c["moe_layers"]:
                    bad.append(f"layer {i}: MoE where the config has a dense FFN")
                ex = m.experts
                if hasattr(ex, "gate_up_proj"):
                    E, I = ex.gate_up_proj.shape[0], ex.gate_up_proj.shape[1] // 2
                else:
                    E, I = len(ex), ex[0].gate_proj.out_features
                if E != c["num_experts"] or I != c["moe_intermediate_size"]:
                    bad.append(f"layer {i}: {E} experts x {I} != {c['num_experts']} x {c['moe_intermediate_size']}")
                k = getattr(m.gate, "top_k", None)
                if k is not None and k != c["num_experts_per_token"]:
                    bad.append(f"layer {i}: top-{k} != top-{c['num_experts_per_token']}")
                se = getattr(m, "shared_experts", None)
                want = c["moe_intermediate_size"] * c["num_shared_experts"]
                got = se.gate_proj.out_features if se is not None else 0
                if got != want:
                    bad.append(f"layer {i}: shared expert width {got} != {want}")
            else:
                if i in c["moe_layers"]:
                    bad.append(f"layer {i}: dense FFN where the config has MoE")
                elif m.gate_proj.out_features != c["intermediate_size"]:
                    bad.append(f"layer {i}: dense FFN width {m.gate_proj.out_features} != {c['intermediate_size']}")
        if model.lm_head.out_features != c["vocab_size"] or model.lm_head.in_features != d:
            bad.append("lm_head shape differs from the config")
    except Exception as e:
        bad.append(f"structure check failed: {type(e).__name__}: {e}")
    return bad


# ----------------------------------------------------------------------------------------------
# Which kernels HF resolved. use_kernel_func_from_hub_with_fallback decides at import time and keeps
# the answer in the closure of the wrapper (is_new_implementation / implementation); functools.wraps
# copies the torch function's name and module, so those cannot be used.
# ----------------------------------------------------------------------------------------------
def resolved_impl(fn):
    """(hub kernel name, 'torch' or the package function HF resolved), or None if fn is not such a wrapper."""
    seen, stack = set(), [fn]
    while stack:
        f = stack.pop()
        if not isinstance(f, types.FunctionType) or id(f) in seen:
            continue
        seen.add(id(f))
        cells = {}
        for n, cell in zip(f.__code__.co_freevars, f.__closure__ or ()):
            try:
                cells[n] = cell.cell_contents
            except ValueError:
                pass
        if "is_new_implementation" in cells:
            impl = cells.get("implementation")
            name = f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__qualname__', '?')}"
            return str(cells.get("func_name", f.__name__)), (name if cells["is_new_implementation"] else "torch")
        stack.extend(v for v in cells.values() if isinstance(v, types.FunctionType))
        stack.append(getattr(f, "__wrapped__", None))
    return None


def kernel_report(mod):
    """{hub kernel name: resolution} for every kernel-with-fallback function of the modeling module
    (5.17: chunk_kda -> chunk_kimi_delta_attention, fused_recurrent_kda -> recurrent_kimi_delta_attention,
    causal_conv1d_fn, causal_conv1d_update), whether a torch KDA fallback exists, whether fla is used."""
    rep, wrapped = {}, set()
    for k, v in vars(mod).items():
        if isinstance(v, types.FunctionType) and getattr(v, "__module__", None) == mod.__name__:
            r = resolved_impl(v)
            if r:
                rep[r[0]] = r[1]
                wrapped.add(r[0])
    # A version that imports fla's kernels directly has no wrappers: report where its KDA functions live.
    for k, v in vars(mod).items():
        if "kda" in k.lower() and callable(v) and not isinstance(v, type):
            m = getattr(v, "__module__", "") or ""
            if m != mod.__name__:
                rep.setdefault(k, m)
    has_fallback = "chunk_kda" in wrapped  # the wrapper's body is the torch implementation
    uses_fla = any(isinstance(v, str) and v.startswith("fla") for k, v in rep.items() if "kda" in k.lower())
    return rep, has_fallback, uses_fla


# ----------------------------------------------------------------------------------------------
# Measurement
# ----------------------------------------------------------------------------------------------
class TimeLimit(BaseException):
    """Raised by SIGALRM; a BaseException so that no `except Exception` inside HF swallows it."""


def _alarm(signum, frame):
    raise TimeLimit()


class alarm:
    def __init__(self, seconds):
        self.seconds = seconds

    def __enter__(self):
        if self.seconds and hasattr(signal, "setitimer"):
            signal.signal(signal.SIGALRM, _alarm)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)

    def __exit__(self, *exc):
        if self.seconds and hasattr(signal, "setitimer"):
            signal.setitimer(signal.ITIMER_REAL, 0)
        return False


def is_oom(e):
    import torch
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    s = str(e).lower()
    return "out of memory" in s or "cublas_status_alloc_failed" in s or "cuda_error_out_of_memory" in s


def is_fatal_cuda(e):
    s = str(e).lower()
    return any(x in s for x in ("illegal memory access", "device-side assert", "unspecified launch failure",
                                "cuda error: an illegal", "misaligned address", "cudaerrorlaunchfailure"))


class Bench:
    def __init__(self, args, model, vocab, dev, info):
        import torch
        self.torch, self.args, self.model, self.vocab, self.dev, self.info = torch, args, model, vocab, dev, info
        self.cuda = dev.type == "cuda"
        self.gen = torch.Generator(device=dev)
        self.gen.manual_seed(args.seed + 1)

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def forward(self, ids, cache, start):
        torch = self.torch
        pos = torch.arange(start, start + ids.shape[1], device=ids.device).unsqueeze(0)
        return self.model(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True, logits_to_keep=1)

    def prefill(self, B, C, deadline=None):
        """Returns (next_ids, cache, seconds)."""
        torch = self.torch
        ids = torch.randint(0, self.vocab, (B, C), device=self.dev, generator=self.gen)
        chunk = self.args.prefill_chunk or C
        self.sync()
        t0 = time.perf_counter()
        cache, out = None, None
        for s in range(0, C, chunk):
            out = self.forward(ids[:, s:s + chunk], cache, s)
            cache = out.past_key_values
            if deadline is not None and time.perf_counter() > deadline and s + chunk < C:
                raise TimeLimit()
        nxt = out.logits[:, -1, :].argmax(-1, keepdim=True)
        self.sync()
        return nxt, cache, time.perf_counter() - t0

    def decode(self, nxt, cache, start, steps, limit):
        """One untimed step, then up to `steps` timed ones (fewer if `limit` seconds pass)."""
        out = self.forward(nxt, cache, start)
        nxt = out.logits[:, -1, :].argmax(-1, keepdim=True)
        self.sync()
        done = 0
        t0 = time.perf_counter()
        for i in range(steps):
            out = self.forward(nxt, cache, start + 1 + i)
            nxt = out.logits[:, -1, :].argmax(-1, keepdim=True)
            done += 1
            if time.perf_counter() - t0 > limit:
                break
        self.sync()
        return done, time.perf_counter() - t0

    def peak_gib(self):
        return self.torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None

    def cleanup(self):
        gc.collect()
        if self.cuda:
            try:
                self.torch.cuda.synchronize()
            except Exception:
                pass
            self.torch.cuda.empty_cache()

    def warmup(self, B):
        C = min(self.args.warmup_context, min(self.args.contexts))
        t0 = time.perf_counter()
        with alarm(self.args.time_limit * 2):
            nxt, cache, _ = self.prefill(B, C)
            self.decode(nxt, cache, C, 2, self.args.time_limit)
        del nxt, cache
        self.cleanup()
        log(f"warm-up batch {B} context {C}: {time.perf_counter() - t0:.1f} s")

    def measure(self, C, B):
        """One shape. Returns the JSON record (with 'skipped' when it could not be measured)."""
        torch, a = self.torch, self.args
        rec = dict(self.info)
        rec.update({"context": C, "batch": B, "prefill_tok_s": None, "decode_tok_s": None, "peak_mem_gib": None})
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        phase, nxt, cache = "prefill", None, None
        try:
            times = []
            deadline = time.perf_counter() + a.time_limit
            for rep in range(a.prefill_reps):
                if times:  # free the previous run's cache first (decode starts from the last run's)
                    if deadline - time.perf_counter() < 1.5 * min(times):
                        break  # another run would not fit in the time limit
                    nxt = cache = None
                    self.cleanup()
                try:
                    with alarm(max(deadline - time.perf_counter(), 0.001)):
                        nxt, cache, secs = self.prefill(B, C, deadline)
                except TimeLimit:
                    if not times:
                        raise
                    nxt = cache = None  # the earlier runs' figure stands; no cache is left to decode from
                    rec["note"] = "a repeated prefill hit the time limit; decode not measured"
                    break
                times.append(secs)
            best = min(times)
            rec["prefill_s"] = round(best, 4)
            if len(times) > 1:
                rec["prefill_s_runs"] = [round(t, 4) for t in times]
            rec["prefill_tok_s"] = round(B * C / best, 1)
            rec["prefill_peak_mem_gib"] = self.peak_gib()
            if a.decode_tokens > 0 and cache is not None:
                phase = "decode"
                with alarm(a.time_limit * 2 + 60):  # backstop; the loop itself stops at the limit
                    done, secs = self.decode(nxt, cache, C, a.decode_tokens, a.time_limit)
                rec["decode_steps"] = done
                rec["decode_s"] = round(secs, 4)
                rec["decode_ms_per_step"] = round(1000 * secs / max(done, 1), 3)
                rec["decode_tok_s"] = round(B * done / secs, 2)
                if done < a.decode_tokens:
                    rec["note"] = f"decode stopped at the time limit after {done} of {a.decode_tokens} steps"
            rec["peak_mem_gib"] = self.peak_gib()
        except TimeLimit:
            rec["skipped"] = f"{phase} exceeded the time limit of {a.time_limit:g} s"
            rec["fail_kind"] = "time"
        except Exception as e:  # OOM and anything else: this shape only
            kind = "oom" if is_oom(e) else ("cuda_fatal" if is_fatal_cuda(e) else "error")
            msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            rec["skipped"] = f"{phase}: {'out of memory' if kind == 'oom' else type(e).__name__}: {msg}"
            rec["fail_kind"] = kind
            if kind == "error":
                log("".join(traceback.format_exception(type(e), e, e.__traceback__))[-4000:])
        finally:
            nxt = cache = None
            if self.cuda and rec.get("peak_mem_gib") is None:
                try:
                    rec["peak_mem_gib_at_failure"] = self.peak_gib()
                except Exception:
                    pass
            self.cleanup_safe()
        for k in ("peak_mem_gib", "prefill_peak_mem_gib", "peak_mem_gib_at_failure"):
            if rec.get(k) is not None:
                rec[k] = round(rec[k], 3)
        return rec

    def cleanup_safe(self):
        try:
            self.cleanup()
        except Exception as e:
            log(f"cleanup failed: {type(e).__name__}: {e}")


def base_record(args, extra=None):
    rec = {"peer": PEER, "fla": None}
    if extra:
        rec.update(extra)
    return rec


def fail_all(args, reason, extra=None):
    for B in args.batches:
        for C in args.contexts:
            rec = base_record(args, extra)
            rec.update({"context": C, "batch": B, "prefill_tok_s": None, "decode_tok_s": None,
                        "peak_mem_gib": None, "skipped": reason})
            emit(rec)


# ----------------------------------------------------------------------------------------------
# --isolate: one subprocess per shape
# ----------------------------------------------------------------------------------------------
def strip_args(argv, names_with_value, flags):
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
            continue
        name = x.split("=", 1)[0]
        if name in names_with_value:
            skip = "=" not in x
            continue
        if name in flags:
            continue
        out.append(x)
    return out


def run_isolated(args, argv):
    base = strip_args(argv, {"--contexts", "--batches"}, {"--isolate"})
    setup_allowance = 900
    for B in args.batches:
        for C in args.contexts:
            cmd = [sys.executable, os.path.abspath(__file__), *base, "--contexts", str(C), "--batches", str(B),
                   "--_worker"]
            timeout = 3 * args.time_limit + setup_allowance
            reason, lines = None, []
            try:
                r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, timeout=timeout, text=True)
                for line in r.stdout.splitlines():
                    try:
                        obj = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(obj, dict) and obj.get("context") == C and obj.get("batch") == B:
                        lines.append(obj)
                if not lines:
                    reason = f"worker exited with status {r.returncode} without a result"
            except subprocess.TimeoutExpired:
                reason = f"worker exceeded {timeout:g} s (hard timeout) and was killed"
            if lines:
                for obj in lines:
                    obj["isolated"] = True
                    emit(obj)
            else:
                rec = base_record(args, {"isolated": True})
                rec.update({"context": C, "batch": B, "prefill_tok_s": None, "decode_tok_s": None,
                            "peak_mem_gib": None, "skipped": reason})
                emit(rec)
    return 0


# ----------------------------------------------------------------------------------------------
def main(argv):
    args = parse_args(argv)
    if args.isolate and not args._worker and not args.check_only:
        return run_isolated(args, argv)

    if args.fla_path:
        sys.path.insert(0, os.path.abspath(args.fla_path))
    if args.no_fla:
        sys.modules["fla"] = None  # `import fla` now raises ImportError: HF takes its torch fallback

    try:
        with open(args.config) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        log(f"cannot read --config {args.config}: {e}")
        fail_all(args, f"cannot read config: {e}")
        return 2
    if args.tiny:
        raw = tiny(raw)
    c = canonical(raw)

    try:
        import torch
        import transformers
    except ImportError as e:
        log(f"needs torch and transformers: {e}")
        fail_all(args, f"import failed: {e}")
        return 2
    info = {"peer": PEER, "fla": None, "transformers": transformers.__version__, "torch": torch.__version__,
            "config": os.path.basename(args.config) + (" (tiny)" if args.tiny else ""), "dtype": args.dtype}

    fla_version = None
    if not args.no_fla:
        try:
            import fla  # noqa: F401  (import before transformers' modeling module resolves it)
            fla_version = getattr(fla, "__version__", "unknown")
        except Exception as e:
            log(f"fla not importable ({type(e).__name__}: {e}); HF will use its torch KDA fallback if it has one")

    try:
        from transformers import KimiLinearConfig, KimiLinearForCausalLM
    except ImportError:
        try:
            from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
            from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearForCausalLM
        except Exception as e:
            msg = (f"transformers {transformers.__version__} has no usable KimiLinear model "
                   f"({type(e).__name__}: {e}); it needs a version with models/kimi_linear (5.x)")
            log(msg)
            fla_required = "fla" in str(e)
            fail_all(args, msg, {"fla_required": fla_required, "transformers": transformers.__version__})
            return 2
    mod = sys.modules.get(KimiLinearForCausalLM.__module__)
    kernels, has_fallback, uses_fla = kernel_report(mod) if mod else ({}, None, False)
    info["fla"] = bool(uses_fla)
    info["kda_impl"] = kernels.get("chunk_kda")
    info["kda_decode_impl"] = kernels.get("fused_recurrent_kda")
    info["causal_conv1d"] = kernels.get("causal_conv1d_fn") not in (None, "torch")

    dtype = getattr(torch, args.dtype)
    dev = torch.device(args.device if not args.check_only else "meta")
    try:
        cfg = hf_config(KimiLinearConfig, raw, c, args)
        kw = {"dtype": dtype, "attn_implementation": args.attn_impl}
        if args.experts_impl:
            kw["experts_implementation"] = args.experts_impl
        torch.manual_seed(args.seed)
        t0 = time.perf_counter()
        with torch.device(dev):
            try:
                model = KimiLinearForCausalLM._from_config(cfg, **kw)
            except TypeError:
                kw["torch_dtype"] = kw.pop("dtype")
                model = KimiLinearForCausalLM._from_config(cfg, **kw)
        # _from_config builds with `dtype` as the default dtype; the parameters HF creates explicitly
        # in fp32 (A_log, dt_bias) stay fp32. Cast only if the dtype argument was not honoured.
        if model.lm_head.weight.dtype != dtype:
            model.to(dtype)
        model.eval()
        build_s = time.perf_counter() - t0
    except Exception as e:
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        log(tb[-4000:])
        msg = f"model build failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        info["fla_required"] = ("fla" in str(e) or "flash_linear_attention" in str(e)) and not has_fallback
        fail_all(args, msg, info)
        return 2

    mismatch = structure_check(model, c)
    n_params = sum(p.numel() for p in model.parameters())
    info["params"] = n_params
    info["attn_impl"] = getattr(model.config, "_attn_implementation", None)
    info["experts_impl"] = getattr(model.config, "_experts_implementation", None)
    if mismatch:
        info["config_mismatch"] = mismatch
        log("WARNING: the HF model does not match the config: " + "; ".join(mismatch))
    details = dict(info)
    details.update({"info": True, "expected_params": expected_params(c), "fla_version": fla_version,
                    "kda_torch_fallback": has_fallback, "kernels": kernels,
                    "modeling_file": getattr(mod, "__file__", None), "build_s": round(build_s, 2),
                    "layer_types": getattr(model.config, "layer_types", None)})
    if args.check_only:
        print(json.dumps(details), file=sys.stderr, flush=True)
        return 0 if not mismatch and n_params == details["expected_params"] else 1

    # Random weights, the same for every transformers version (HF's own init differs between
    # versions; some leave RMSNorm weights at 0, which would route every token to the same experts).
    with torch.no_grad():
        g = torch.Generator(device=dev)
        g.manual_seed(args.seed)
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name:
                p.fill_(1.0)
            elif leaf == "A_log":
                p.copy_(torch.empty(p.shape, device=dev, dtype=torch.float32).uniform_(1, 16, generator=g).log())
            elif leaf == "dt_bias":
                u = torch.empty(p.shape, device=dev, dtype=torch.float32).uniform_(0, 1, generator=g)
                dt = torch.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
            elif "conv" in name:
                p.uniform_(-0.5, 0.5, generator=g)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.zero_()
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()

    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
        info["weights_gib"] = round(torch.cuda.memory_allocated(dev) / 2**30, 3)
    details.update({k: info[k] for k in ("gpu", "weights_gib") if k in info})

    bench = Bench(args, model, c["vocab_size"], dev, info)
    cache_info = None
    fatal = None
    with torch.inference_mode():
        # Cache class, from a tiny run (also the first compile of every kernel).
        try:
            with alarm(args.time_limit * 2):
                out = bench.forward(torch.zeros(1, 8, dtype=torch.long, device=dev), None, 0)
            pkv = out.past_key_values
            cache_info = {"class": type(pkv).__name__,
                          "layers": sorted({type(l).__name__ for l in getattr(pkv, "layers", [])})}
            del out, pkv
        except BaseException as e:  # noqa: B036 (TimeLimit included)
            if isinstance(e, KeyboardInterrupt):
                raise
            cache_info = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            log("first forward failed:\n" + "".join(traceback.format_exception(type(e), e, e.__traceback__))[-4000:])
        details["cache"] = cache_info
        print(json.dumps(details), file=sys.stderr, flush=True)
        bench.cleanup_safe()

        for B in args.batches:
            try:
                bench.warmup(B)
            except BaseException as e:  # noqa: B036
                if isinstance(e, KeyboardInterrupt):
                    raise
                log(f"warm-up at batch {B} failed: {type(e).__name__}: {str(e)[:300]}")
                bench.cleanup_safe()
            prev = None  # (context, prefill seconds, fail kind) of the last shape at this batch
            for C in sorted(args.contexts):
                if fatal:
                    rec = dict(info)
                    rec.update({"context": C, "batch": B, "prefill_tok_s": None, "decode_tok_s": None,
                                "peak_mem_gib": None, "skipped": f"CUDA context unusable after an earlier error "
                                f"({fatal}); rerun with --isolate"})
                    emit(rec)
                    continue
                reason = None
                if prev and not args.no_predict_skip:
                    pc, ps, pk = prev
                    if pk == "oom":
                        reason = f"predicted out of memory (context {pc} at batch {B} already ran out)"
                    elif pk == "time":
                        reason = f"predicted over the time limit (context {pc} at batch {B} already exceeded it)"
                    elif ps is not None and ps * C / pc > args.time_limit:
                        reason = (f"predicted prefill {ps * C / pc:.0f} s (linear in context from {pc}) "
                                  f"> time limit {args.time_limit:g} s")
                if reason:
                    rec = dict(info)
                    rec.update({"context": C, "batch": B, "prefill_tok_s": None, "decode_tok_s": None,
                                "peak_mem_gib": None, "skipped": reason, "fail_kind": "predicted"})
                    emit(rec)
                    continue
                log(f"measuring context {C} batch {B}")
                rec = bench.measure(C, B)
                emit(rec)
                kind = rec.get("fail_kind")
                if kind == "cuda_fatal":
                    fatal = rec["skipped"][:120]
                prev = (C, rec.get("prefill_s"), kind if kind in ("oom", "time") and "prefill" in
                        rec.get("skipped", "") else None)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        log("interrupted")
        sys.exit(130)
