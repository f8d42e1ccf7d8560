#!/usr/bin/env python3
"""Peer figures for the CUDA attention and MoE benchmarks, measured in the same run, set beside ours.

Usage: peer_attention_moe.py [--attention OURS.txt] [--moe OURS.txt] [--reps N]
  OURS.txt: the "RESULT key value" lines of `longmoe bench attention|moe --device cuda` (the CLI runs this
  script itself with --peer); only the sections whose file is given are measured.

Peers (bf16, median of CUDA-event timings after warm-up):
  attention: torch.nn.functional.scaled_dot_product_attention, causal, forcing the cuDNN backend (what SDPA
             picks on Hopper for these head dims; falls back to SDPA's own choice if cuDNN refuses a shape);
             layout [B, H, T, D], its native one. FLOPs exactly as bench/cuda/attention.cu: causal pairs
             P = B·H·T²/2, forward 2·P·(Dk+Dv), backward 2·P·(3·Dk+2·Dv).
  decode:    matmul → softmax (fp32) → matmul over the latent cache (PyTorch has no fused absorbed decode).
  grouped GEMM: torch._grouped_mm(x [M, K], W [E, K, N] (a transposed view of [E, N, K]), offs = cumulative
             row ends, int32); FLOPs 2·M·N·K.
  expert weight gradients: torch._grouped_mm(dy^T [N, M] (a transposed view, or made contiguous), x [M, K],
             offs) -> [E, N, K], the offsets splitting the reduction dim; bf16 output written (ours and cuBLAS
             accumulate into fp32); FLOPs 2·M·N·K.
"""
import argparse
import math

import torch
import torch.nn.functional as F


def median_ms(fn, warm=3, reps=20):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def read_results(path):
    out = {}
    try:
        with open(path) as f:
            for line in f:
                p = line.split()
                if len(p) == 3 and p[0] == "RESULT":
                    out[p[1]] = float(p[2])
    except OSError:
        pass
    return out


def sdpa_backend():
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel, SDPBackend
    except ImportError:
        return None, None


def bench_attention(reps):
    res = {}
    sdpa_kernel, SDPBackend = sdpa_backend()
    shapes = [(1, 8192, 32, 192, 128), (1, 8192, 64, 192, 128), (1, 8192, 32, 128, 128), (4, 4096, 32, 192, 128)]
    for B, T, H, Dk, Dv in shapes:
        key = f"attn_B{B}_T{T}_H{H}_{Dk}_{Dv}"
        q = torch.randn(B, H, T, Dk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(B, H, T, Dk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(B, H, T, Dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        do = torch.randn(B, H, T, Dv, device="cuda", dtype=torch.bfloat16)
        pairs = B * H * T * T / 2
        ff, fb = 2 * pairs * (Dk + Dv), 2 * pairs * (3 * Dk + 2 * Dv)

        def fwd():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def fwdbwd():
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            o.backward(do)

        used = "default"
        for backend in (["cudnn"] if sdpa_kernel else []) + ["default"]:
            try:
                if backend == "cudnn":
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        tf, tfb = median_ms(fwd, 3, reps), median_ms(fwdbwd, 2, reps)
                else:
                    tf, tfb = median_ms(fwd, 3, reps), median_ms(fwdbwd, 2, reps)
                used = backend
                break
            except Exception as e:  # noqa: BLE001 - report and fall back
                print(f"# {key}: SDPA backend {backend} failed: {str(e).splitlines()[0][:120]}")
        res[key] = (tf, ff / tf / 1e9, tfb, (ff + fb) / tfb / 1e9, used)
        del q, k, v, do
        torch.cuda.empty_cache()
    return res


def bench_decode(reps):
    res = {}
    for H, Tc in [(64, 32768), (128, 32768), (16, 131072)]:
        q = torch.randn(H, 576, device="cuda", dtype=torch.bfloat16) * 0.5
        cache = torch.randn(Tc, 576, device="cuda", dtype=torch.bfloat16)
        scale = 192 ** -0.5

        def run():
            s = (q @ cache.T).float() * scale
            p = torch.softmax(s, dim=-1).to(torch.bfloat16)
            return p @ cache[:, :512]

        t = median_ms(run, 5, reps * 2)
        res[f"decode_H{H}_Tc{Tc}"] = (t * 1e3, Tc * 576 * 2 / t / 1e9)
    return res


def uneven(E, mean):
    c = [int(mean * (0.25 + 1.5 * ((e * 37) % E) / (E - 1))) for e in range(E)]
    c[0] += E * mean - sum(c)
    return c


def fastest_layout(name, reps, flops, variants):
    """(ms, TFLOP/s, label) of the fastest (label, fn) variant; a failing variant is reported and skipped."""
    best = None
    for label, fn in variants:
        try:
            t = median_ms(fn, 3, reps)
            if best is None or t < best[0]:
                best = (t, label)
        except Exception as e:  # noqa: BLE001
            print(f"# {name}: torch._grouped_mm with {label} failed: {str(e).splitlines()[0][:120]}")
    return (best[0], flops / best[0] / 1e9, best[1]) if best else None


def bench_gemm(reps):
    res = {}
    cases = [
        ("g64_2048x1024x768", [2048] * 64, 768, 1024),
        ("k3_w13_uniform", [256] * 64, 6144, 3584),
        ("k3_w2_uniform", [256] * 64, 3584, 3072),
        ("k3_w13_uneven", uneven(64, 256), 6144, 3584),
        ("k3_w2_uneven", uneven(64, 256), 3584, 3072),
    ]
    if not hasattr(torch, "_grouped_mm"):
        print("# torch._grouped_mm is not available in this PyTorch")
        return res
    for name, counts, N, K in cases:
        E, M = len(counts), sum(counts)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        offs = torch.tensor(counts, device="cuda", dtype=torch.int32).cumsum(0).to(torch.int32)
        best = fastest_layout(name, reps, 2 * M * N * K, (
            ("W[E,N,K]^T", lambda wb=w.transpose(-2, -1): torch._grouped_mm(x, wb, offs=offs)),
            ("W[E,K,N]", lambda wb=w.transpose(-2, -1).contiguous(): torch._grouped_mm(x, wb, offs=offs))))
        if best:
            res[name] = best
        del x, w
        torch.cuda.empty_cache()
    return res


def bench_wgrad(reps):
    res = {}
    # As bench/cuda/moe.cu: k3-1b dW2 (dy = d_eo [M, 768], x = h [M, 384]) and dW13 (dab [M, 768], xs [M, 768]).
    cases = [
        ("k3_1b_dw2_uniform", [2048] * 64, 768, 384),
        ("k3_1b_dw2_uneven", uneven(64, 2048), 768, 384),
        ("k3_1b_dw13_uniform", [2048] * 64, 768, 768),
        ("k3_1b_dw13_uneven", uneven(64, 2048), 768, 768),
    ]
    if not hasattr(torch, "_grouped_mm"):
        return res  # bench_gemm has said so
    for name, counts, N, K in cases:
        if any(c % 8 for c in counts):
            # torch's split of the reduction dim needs 16-byte group sizes; a failed device assert would end the
            # whole process, so such cases are not run
            print(f"# wgrad {name}: not run for torch._grouped_mm (row counts must be multiples of 8)")
            continue
        M = sum(counts)
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        offs = torch.tensor(counts, device="cuda", dtype=torch.int32).cumsum(0).to(torch.int32)
        # a build without the 2-D x 2-D (split reduction) case only prints a note
        best = fastest_layout(f"wgrad {name}", reps, 2 * M * N * K, (
            ("dy^T view", lambda a=dy.t(): torch._grouped_mm(a, x, offs=offs)),
            ("dy^T contiguous", lambda a=dy.t().contiguous(): torch._grouped_mm(a, x, offs=offs))))
        if best:
            res[name] = best
        del dy, x
        torch.cuda.empty_cache()
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attention", help="our attention RESULT lines")
    ap.add_argument("--moe", help="our MoE RESULT lines")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    ours = {**(read_results(args.attention) if args.attention else {}), **(read_results(args.moe) if args.moe else {})}
    reps = args.reps
    print(f"# torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    att = bench_attention(reps) if args.attention else {}
    dec = bench_decode(reps) if args.attention else {}
    gem = bench_gemm(reps) if args.moe else {}
    wgr = bench_wgrad(reps) if args.moe else {}

    def o(k):
        return ours.get(k, math.nan)

    if att:
        print("\n## Causal attention, bf16 (TFLOP/s; fwd 2P(Dk+Dv), bwd 2P(3Dk+2Dv), P = B·H·T²/2)")
        print(f"{'shape (B,T,H,Dk/Dv)':<24} | {'ours fwd':>9} | {'SDPA fwd':>9} | {'ratio':>6} | {'ours f+b':>9} | "
              f"{'SDPA f+b':>9} | {'ratio':>6} | ours ms fwd / f+b | SDPA ms fwd / f+b | ours bwd | mma.sync fwd / bwd | SDPA backend")
        for key, (tf, pf, tfb, pfb, used) in att.items():
            of, ofb = o(key + "_fwd_tflops"), o(key + "_fwdbwd_tflops")
            shp = key[len("attn_"):].replace("_", " ")
            print(f"{shp:<24} | {of:9.1f} | {pf:9.1f} | {of / pf:6.2f} | {ofb:9.1f} | {pfb:9.1f} | {ofb / pfb:6.2f} | "
                  f"{o(key + '_fwd_ms'):7.3f} / {o(key + '_fwdbwd_ms'):7.3f} | {tf:7.3f} / {tfb:7.3f} | "
                  f"{o(key + '_bwd_tflops'):8.1f} | {o(key + '_fwd_mma_tflops'):8.1f} / {o(key + '_bwd_mma_tflops'):6.1f} | "
                  f"{used}")
        print("\nbackward alone (TFLOP/s, incl. row statistics and dQ conversion): wgmma; "
              "SDPA backward = (f+b) - fwd")
        for key, (tf, pf, tfb, pfb, used) in att.items():
            B, T, H, Dk, Dv = [int(x) for x in key[len("attn_B"):].replace("_T", " ").replace("_H", " ").replace("_", " ").split()]
            fb = 2 * B * H * T * T / 2 * (3 * Dk + 2 * Dv)
            print(f"{key[len('attn_'):]:<24} | {o(key + '_bwd_wgmma_tflops'):6.1f} | "
                  f"SDPA {fb / (tfb - tf) / 1e9:6.1f}")

    if dec:
        print("\n## Absorbed MLA decode over the 576-wide latent cache (bytes = cache read once)")
        print(f"{'H, Tc':<16} | {'ours us':>8} | {'ours TB/s':>9} | {'torch us':>8} | {'torch TB/s':>10} | speed-up")
        for key, (tus, ttb) in dec.items():
            ous, otb = o(key + "_us"), o(key + "_tbps")
            print(f"{key[len('decode_'):]:<16} | {ous:8.1f} | {otb:9.2f} | {tus:8.1f} | {ttb:10.2f} | {tus / ous:6.2f}")

    if gem:
        print("\n## Grouped expert GEMM, bf16 (TFLOP/s = 2MNK / time)")
        print(f"{'case':<24} | {'ours':>7} | {'ours GLU-fused':>14} | {'torch._grouped_mm':>17} | {'ratio':>6} | "
              f"variants o0e0 / o1e0 / o0e1 / o1e1 | peer layout")
        for key, (t, tfl, label) in gem.items():
            ours_t, ours_g = o(f"gemm_{key}_tflops"), o(f"gemm_{key}_glu_tflops")
            var = " / ".join(f"{o(f'gemm_{key}_o{a}e{b}_tflops'):5.0f}" for b in (0, 1) for a in (0, 1))
            print(f"{key:<24} | {ours_t:7.1f} | {ours_g:14.1f} | {tfl:17.1f} | {ours_t / tfl:6.2f} | {var:<35} | {label}")

    if wgr:
        print("\n## Expert weight gradients dW_e = dy_e^T x_e, bf16 in (TFLOP/s = 2MNK / time; "
              "ours and cuBLAS += fp32, torch writes bf16)")
        print(f"{'case':<20} | {'ours':>7} | {'cuBLAS/expert':>13} | {'torch._grouped_mm':>17} | "
              f"{'ours/torch':>10} | {'ours/cuBLAS':>11} | ours ms | err vs cuBLAS | peer layout")
        for key, (t, tfl, label) in wgr.items():
            ours_t, cub_t = o(f"wgrad_{key}_tflops"), o(f"wgrad_{key}_cublas_tflops")
            print(f"{key:<20} | {ours_t:7.1f} | {cub_t:13.1f} | {tfl:17.1f} | {ours_t / tfl:10.2f} | "
                  f"{ours_t / cub_t:11.2f} | {o(f'wgrad_{key}_ms'):7.3f} | {o(f'wgrad_{key}_err'):13.1e} | {label}")

    route = {k: v for k, v in ours.items() if k.startswith("route_")}
    if route:
        print("\n## Routing path (ours)")
        for k, v in route.items():
            print(f"{k:<40} {v:10.2f}")


if __name__ == "__main__":
    main()
