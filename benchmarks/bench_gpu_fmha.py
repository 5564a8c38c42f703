"""GPU benchmark of the CUDA FMHA kernels (C-ABI harness) against PyTorch attention.

Runs on a GPU machine with PyTorch (no Paddle): ``benchmarks/gpu_check.sh`` calls it.
For each case (BERT-base / BERT-large head shapes, bf16, a realistic ragged batch) it
times, with CUDA events (median of --iters after warm-up):

* ``ours_grouped``   paddle_unpad kernels, length-bucketed multi-stream launch
* ``ours_ungrouped`` the same kernels, one launch over the batch
* ``sdpa_padded``    torch ``scaled_dot_product_attention`` on the padded [B, H, S, D]
                     batch with a key-padding mask (what a padded model runs)
* ``torch_flash_varlen`` torch's own flash attention on the same packed tokens, if
                     available (``flash_attn`` package, else nested-tensor SDPA with the
                     flash backend)

TFLOP/s count useful work only (4 * H * D * sum(s^2) forward; 3.5x that for forward +
backward), so padding shows up as lower throughput. Writes JSON (--out).
"""
import argparse
import json
import math
import os
import sys
import time
import types
import zlib

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "gpu"))


def realistic_lengths(n, max_len, seed):
    """Pre-training-like batch: ~40% full-length samples, the rest spread below."""
    rng = np.random.default_rng(seed)
    full = rng.random(n) < 0.4
    short = rng.integers(max(8, max_len // 16), max_len, size=n)
    return [int(max_len) if f else int(s) for f, s in zip(full, short)]


CASES = [
    # name, heads, head_dim, batch, max_len
    ("bert-base", 12, 64, 96, 512),
    ("bert-large", 16, 64, 56, 512),
    ("bert-large-long", 16, 64, 14, 2048),
]


def timeit(torch, fn, warmup, iters):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))


def flash_varlen_impl(torch):
    """(name, fn(q, k, v, cu, max_len, scale) -> out [T, H, D]) or (None, reason)."""
    try:
        from flash_attn import flash_attn_varlen_func  # type: ignore

        def f(q, k, v, cu, max_len, scale):
            return flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, 0.0, softmax_scale=scale)

        return "flash_attn.flash_attn_varlen_func", f
    except Exception as e:  # noqa: BLE001
        reason = f"flash_attn: {type(e).__name__}: {e}"
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def f(q, k, v, cu, max_len, scale):
            offs = cu.to(torch.int64)
            nq, nk, nv = (torch.nested.nested_tensor_from_jagged(x, offsets=offs).transpose(1, 2)
                          for x in (q, k, v))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o = torch.nn.functional.scaled_dot_product_attention(nq, nk, nv, scale=scale)
            return o.transpose(1, 2).values()

        T, H, D = 64, 2, 64
        x = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        cu = torch.tensor([0, 20, 64], device="cuda", dtype=torch.int32)
        f(x, x, x, cu, 44, 0.125).sum().backward()
        return "torch nested-tensor SDPA (flash backend)", f
    except Exception as e:  # noqa: BLE001
        return None, reason + f"; nested SDPA flash: {type(e).__name__}: {e}"


def _time_ours(c, harness, record):
    """The CUDA kernel through the harness, with and without grouping of sequences."""
    torch, q = c.torch, c.q
    out = torch.empty_like(q)
    lse = torch.empty(c.T, c.H, device="cuda")
    dq, dk, dv = (torch.empty_like(q) for _ in range(3))
    ws = torch.empty(harness.lib.pu_fmha_bwd_workspace_bytes(c.T, c.H) // 4, device="cuda")
    for grouping in (True, False):
        def fwd(grouping=grouping):
            harness.fwd(q, c.k, c.v, c.cu_np, c.scale, grouping=grouping, out=out, lse=lse)

        def fb(grouping=grouping):
            harness.fwd(q, c.k, c.v, c.cu_np, c.scale, grouping=grouping, out=out, lse=lse)
            harness.bwd(q, c.k, c.v, out, lse, c.dout, c.cu_np, c.scale, grouping=grouping, dq=dq, dk=dk,
                        dv=dv, workspace=ws)

        record("ours_grouped" if grouping else "ours_ungrouped", fwd, fb)


def _time_sdpa_padded(c, record):
    """Padded SDPA: [B, H, S, D] with a boolean key mask (padding is computed, then wasted)."""
    torch, B, S, H, D = c.torch, c.B, c.S, c.H, c.D

    def pad(x):
        o = x.new_zeros(B, S, H, D)
        for b, s in enumerate(c.lengths):
            o[b, :s] = x[c.cu_np[b] : c.cu_np[b] + s]
        return o.transpose(1, 2).contiguous()

    qp, kp, vp, dop = (pad(x) for x in (c.q, c.k, c.v, c.dout))
    qp.requires_grad_(), kp.requires_grad_(), vp.requires_grad_()
    lens = torch.tensor(c.lengths, device="cuda")
    mask = (torch.arange(S, device="cuda")[None, :] < lens[:, None])[:, None, None, :]
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def p_fwd():
        with torch.no_grad():
            sdpa(qp, kp, vp, attn_mask=mask, scale=c.scale)

    def p_fb():
        qp.grad = kp.grad = vp.grad = None
        sdpa(qp, kp, vp, attn_mask=mask, scale=c.scale).backward(dop)

    record("sdpa_padded", p_fwd, p_fb)


def _time_flash(c, flash, record, res):
    """torch's own variable-length attention, when there is one (else the reason is recorded)."""
    if flash[0] is None:
        res["methods"]["torch_flash_varlen"] = {"error": flash[1]}
        return
    torch = c.torch
    fname, ffn = flash
    cu_t = torch.from_numpy(c.cu_np).cuda()
    ql, kl, vl = (x.detach().clone().requires_grad_() for x in (c.q, c.k, c.v))

    def fl_fwd():
        with torch.no_grad():
            ffn(ql, kl, vl, cu_t, c.S, c.scale)

    def fl_fb():
        ql.grad = kl.grad = vl.grad = None
        ffn(ql, kl, vl, cu_t, c.S, c.scale).backward(c.dout)

    record("torch_flash_varlen", fl_fwd, fl_fb)
    res["torch_flash_varlen_impl"] = fname


def _ratios(m):
    def ratio(a, b, key):
        try:
            return m[a][key] / m[b][key]
        except Exception:  # noqa: BLE001
            return None

    return {
        "fwdbwd_ms ours_grouped / torch_flash_varlen": ratio("ours_grouped", "torch_flash_varlen", "fwdbwd_ms"),
        "fwdbwd_ms ours_grouped / sdpa_padded": ratio("ours_grouped", "sdpa_padded", "fwdbwd_ms"),
        "fwdbwd_ms ours_grouped / ours_ungrouped": ratio("ours_grouped", "ours_ungrouped", "fwdbwd_ms"),
        "fwd_ms ours_grouped / torch_flash_varlen": ratio("ours_grouped", "torch_flash_varlen", "fwd_ms"),
        "fwd_ms ours_grouped / sdpa_padded": ratio("ours_grouped", "sdpa_padded", "fwd_ms"),
        "fwd_ms ours_grouped / ours_ungrouped": ratio("ours_grouped", "ours_ungrouped", "fwd_ms"),
    }


def run_case(torch, harness, name, H, D, B, max_len, warmup, iters, flash):
    dt = torch.bfloat16
    lengths = realistic_lengths(B, max_len, seed=zlib.crc32(name.encode()))
    cu_np = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    T = int(cu_np[-1])
    S = max(lengths)
    scale = 1.0 / math.sqrt(D)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(T, H, D, device="cuda", generator=g).to(dt) for _ in range(4))
    fwd_flops = 4.0 * H * D * float(sum(s * s for s in lengths))
    res = {"heads": H, "head_dim": D, "batch": B, "tokens": T, "max_len": S,
           "mean_len": float(np.mean(lengths)), "padded_tokens": B * S, "dtype": "bfloat16",
           "fwd_gflop": fwd_flops / 1e9, "methods": {}}

    def record(method, fwd_fn, fb_fn):
        try:
            f_ms = timeit(torch, fwd_fn, warmup, iters)
            fb_ms = timeit(torch, fb_fn, warmup, iters) if fb_fn else None
            res["methods"][method] = {
                "fwd_ms": f_ms, "fwd_tflops": fwd_flops / f_ms / 1e9,
                "fwdbwd_ms": fb_ms, "fwdbwd_tflops": (3.5 * fwd_flops / fb_ms / 1e9) if fb_ms else None}
        except Exception as e:  # noqa: BLE001
            res["methods"][method] = {"error": f"{type(e).__name__}: {e}"}

    case = types.SimpleNamespace(torch=torch, q=q, k=k, v=v, dout=dout, cu_np=cu_np, lengths=lengths, T=T, S=S,
                                 B=B, H=H, D=D, scale=scale)
    _time_ours(case, harness, record)
    _time_sdpa_padded(case, record)
    _time_flash(case, flash, record, res)
    res["ratios"] = _ratios(res["methods"])
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--cases", default=",".join(c[0] for c in CASES))
    args = ap.parse_args()

    import torch

    import pu_harness

    harness = pu_harness.load()
    flash = flash_varlen_impl(torch)
    t0 = time.time()
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "cuda": torch.version.cuda, "harness": harness.path,
              "timing": f"CUDA events, median of {args.iters} after {args.warmup} warm-up",
              "cases": {}}
    wanted = set(args.cases.split(","))
    for name, H, D, B, L in CASES:
        if name not in wanted:
            continue
        result["cases"][name] = run_case(torch, harness, name, H, D, B, L, args.warmup, args.iters, flash)
        print(json.dumps({name: result["cases"][name]["methods"]}, indent=1), flush=True)
    large = result["cases"].get("bert-large", {}).get("ratios", {})

    def le(x, limit):
        return None if x is None else bool(x <= limit)

    result["targets_bert_large_bf16_d64"] = {
        "fwdbwd within 1.3x of torch flash": le(large.get("fwdbwd_ms ours_grouped / torch_flash_varlen"), 1.3),
        "fwdbwd faster than padded sdpa": le(large.get("fwdbwd_ms ours_grouped / sdpa_padded"), 1.0),
        "grouped no slower than ungrouped (2% noise allowance)": le(large.get("fwdbwd_ms ours_grouped / ours_ungrouped"), 1.02),
    }
    result["seconds"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["targets_bert_large_bf16_d64"], indent=1))


if __name__ == "__main__":
    main()
