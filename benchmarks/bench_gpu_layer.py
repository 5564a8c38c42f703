"""GPU benchmark of a BERT encoder layer (fwd+bwd, bf16): packed with our kernels vs padded PyTorch.

Runs on a GPU machine with PyTorch (no Paddle): ``benchmarks/gpu_check.sh`` calls it. For
BERT-base (hidden 768, 12 heads, FFN 3072) and BERT-large (1024, 16, 4096), on one realistic
ragged batch (``bench_gpu_fmha.realistic_lengths``), with dropout 0 and with BERT's 0.1 on
the attention probabilities and after the attention output and the FFN:

* ``packed``  [T, hidden] tokens: torch GEMMs (``torch.nn.functional.linear``) and our
  kernels through the harness (fmha, bias+GELU, bias+dropout+residual+LayerNorm, forward
  and backward), wired with ``torch.autograd.Function``
* ``padded``  [B, S, hidden]: the same GEMMs (with their bias), SDPA with a key-padding
  mask, and dropout, residual add, LayerNorm and GELU as separate PyTorch ops
* ``ideal``   the padded time x real tokens / padded tokens (padding removed for free)

Useful TFLOP/s count real tokens only (GEMMs 2*T*(4*h^2 + 2*h*f) forward, attention
4*h*sum(s^2); backward 2x the GEMMs' and 2.5x the attention's), against the bf16 GEMM rate
of a large ``torch.matmul`` measured in the same run. Before timing, the packed layer (bf16)
is compared with the padded one in fp32 on the real tokens (output, input and parameter
gradients, dropout 0); a disagreement is written to the JSON and the script exits 1
without timing. Writes JSON (--out).
"""

import json
import math
import os
import sys
import time
import zlib

import numpy as np

os.environ.setdefault("OMP_NUM_THREADS", "4")  # host threads (torch reads it at import); the GPU does the work
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "gpu"))

from bench_gpu_fmha import (  # noqa: E402
    gpu_args,
    load_harness,
    realistic_lengths,
    require_cuda,
    run_header,
    timeit,
    write_result,
)

MODELS = [
    # name, hidden, heads, ffn, batch, max_len
    ("bert-base", 768, 12, 3072, 96, 512),
    ("bert-large", 1024, 16, 4096, 56, 512),
]
P_DROPS = (0.0, 0.1)
EPS = 1e-12  # BERT's layer_norm_eps
# The packed layer in bf16 against the padded one in fp32: max |err| / max |ref| per tensor,
# within this or twice the padded bf16 layer's own error, whichever is larger.
CHECK_TOL = {"out": 3e-2, "grad": 6e-2}
CHECK_SEQS = 8  # sequences of the batch the check runs on
PARAMS = ("wq", "bq", "wk", "bk", "wv", "bv", "wo", "bo", "ln1_w", "ln1_b", "w1", "b1", "w2", "b2", "ln2_w", "ln2_b")


def pkey(p):
    return f"dropout={p:g}"


def make_params(torch, hidden, ffn, dtype, seed):
    """BERT's initialisation: weights N(0, 0.02), biases small, LayerNorm near (1, 0)."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, std, mean=0.0):
        return (torch.randn(*shape, device="cuda", generator=g) * std + mean).to(dtype)

    p = {}
    for n in ("q", "k", "v", "o"):
        p["w" + n], p["b" + n] = randn(hidden, hidden, std=0.02), randn(hidden, std=0.02)
    p["w1"], p["b1"] = randn(ffn, hidden, std=0.02), randn(ffn, std=0.02)
    p["w2"], p["b2"] = randn(hidden, ffn, std=0.02), randn(hidden, std=0.02)
    for n in ("ln1", "ln2"):
        p[n + "_w"], p[n + "_b"] = randn(hidden, std=0.05, mean=1.0), randn(hidden, std=0.05)
    return {k: v.requires_grad_() for k, v in p.items()}


def autograd_ops(torch, harness):
    """torch.autograd.Function wrappers of our kernels (harness calls on contiguous tensors)."""

    class Fmha(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, cu_np, scale, p, seed):
            out, lse = harness.fwd(q, k, v, cu_np, scale, p, seed)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.args = (cu_np, scale, p, seed)
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            cu_np, scale, p, seed = ctx.args
            dq, dk, dv = harness.bwd(q, k, v, out, lse, dout.contiguous(), cu_np, scale, p, seed)
            return dq, dk, dv, None, None, None, None

    class BiasGelu(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, bias):
            ctx.save_for_backward(x, bias)
            return harness.bias_gelu_fwd(x, bias)

        @staticmethod
        def backward(ctx, dy):
            x, bias = ctx.saved_tensors
            return harness.bias_gelu_bwd(x, bias, dy.contiguous())

    class Bdrln(torch.autograd.Function):
        """layer_norm(residual + dropout(x + bias))"""

        @staticmethod
        def forward(ctx, x, bias, residual, w, b, p, seed):
            y, mean, rstd = harness.bdrln_fwd(x, bias, residual, w, b, dropout=p, epsilon=EPS, seed=seed)
            ctx.save_for_backward(x, bias, residual, w, mean, rstd)
            ctx.args = (p, seed)
            return y

        @staticmethod
        def backward(ctx, dy):
            x, bias, residual, w, mean, rstd = ctx.saved_tensors
            p, seed = ctx.args
            dx, dres, dbias, dw, db = harness.bdrln_bwd(
                x, bias, residual, w, mean, rstd, dy.contiguous(), dropout=p, epsilon=EPS, seed=seed
            )
            return dx, dbias, dres, dw, db, None, None

    return Fmha, BiasGelu, Bdrln


def packed_layer(torch, ops, prm, x, cu_np, heads, p, seed):
    """x [T, hidden] -> [T, hidden]: our kernels between torch GEMMs."""
    F = torch.nn.functional
    Fmha, BiasGelu, Bdrln = ops
    T, hidden = x.shape
    D = hidden // heads
    q, k, v = (F.linear(x, prm["w" + n], prm["b" + n]).view(T, heads, D) for n in "qkv")
    ctx = Fmha.apply(q, k, v, cu_np, 1.0 / math.sqrt(D), p, seed)
    h1 = Bdrln.apply(F.linear(ctx.view(T, hidden), prm["wo"]), prm["bo"], x, prm["ln1_w"], prm["ln1_b"], p, seed + 1)
    g = BiasGelu.apply(F.linear(h1, prm["w1"]), prm["b1"])
    return Bdrln.apply(F.linear(g, prm["w2"]), prm["b2"], h1, prm["ln2_w"], prm["ln2_b"], p, seed + 2)


def padded_layer(torch, prm, x, keymask, heads, p):
    """x [B, S, hidden] -> [B, S, hidden]: a padded BERT layer in plain PyTorch."""
    F = torch.nn.functional
    B, S, hidden = x.shape
    D = hidden // heads
    q, k, v = (F.linear(x, prm["w" + n], prm["b" + n]).view(B, S, heads, D).transpose(1, 2) for n in "qkv")
    ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=keymask, dropout_p=p)
    a = F.linear(ctx.transpose(1, 2).reshape(B, S, hidden), prm["wo"], prm["bo"])
    h1 = F.layer_norm(x + F.dropout(a, p), (hidden,), prm["ln1_w"], prm["ln1_b"], EPS)
    g = F.gelu(F.linear(h1, prm["w1"], prm["b1"]))
    o = F.linear(g, prm["w2"], prm["b2"])
    return F.layer_norm(h1 + F.dropout(o, p), (hidden,), prm["ln2_w"], prm["ln2_b"], EPS)


class Batch:
    """One batch in both layouts: packed [T, hidden] and padded [B, S, hidden] (zeros at pads)."""

    def __init__(self, torch, lengths, hidden, seed):
        self.lengths = lengths
        self.cu_np = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        self.T, self.B, self.S = int(self.cu_np[-1]), len(lengths), max(lengths)
        self.rows = torch.cat([torch.arange(s, device="cuda") + b * self.S for b, s in enumerate(lengths)])
        lens = torch.tensor(lengths, device="cuda")
        self.keymask = (torch.arange(self.S, device="cuda")[None, :] < lens[:, None])[:, None, None, :]
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.nn.functional.layer_norm(torch.randn(self.T, hidden, device="cuda", generator=g), (hidden,))
        dy = torch.randn(self.T, hidden, device="cuda", generator=g)
        # fp32 values that bf16 holds exactly: every layer gets the same inputs
        self.x, self.dy = x.to(torch.bfloat16).float(), dy.to(torch.bfloat16).float()
        self.hidden = hidden
        self.torch = torch

    def pad(self, t):
        out = t.new_zeros(self.B * self.S, t.shape[-1])
        out[self.rows] = t
        return out.view(self.B, self.S, -1)

    def unpad(self, t):
        return t.reshape(self.B * self.S, -1)[self.rows]


def run_packed(torch, ops, prm, batch, heads, p, dtype, seed=7):
    x = batch.x.to(dtype).requires_grad_()
    y = packed_layer(torch, ops, prm, x, batch.cu_np, heads, p, seed)
    y.backward(batch.dy.to(dtype))
    return y, x


def run_padded(torch, prm, batch, heads, p, dtype):
    x = batch.pad(batch.x).to(dtype).requires_grad_()
    y = padded_layer(torch, prm, x, batch.keymask, heads, p)
    y.backward(batch.pad(batch.dy).to(dtype))  # zeros at pads: pads add nothing to any gradient
    return y, x


def check_layer(torch, ops, lengths, hidden, heads, ffn):
    """Packed bf16 vs padded fp32 (and padded bf16, whose own error widens the bound) on the
    real tokens, dropout 0: output, input gradient and every parameter gradient."""
    from torch_checks import rel_err

    batch = Batch(torch, lengths, hidden, seed=11)
    mine = make_params(torch, hidden, ffn, torch.bfloat16, seed=5)
    fp32 = {k: v.detach().float().requires_grad_() for k, v in mine.items()}
    low = {k: v.detach().clone().requires_grad_() for k, v in mine.items()}
    results = {}
    for what, prm, run in (
        ("ours", mine, lambda prm: run_packed(torch, ops, prm, batch, heads, 0.0, torch.bfloat16)),
        ("ref", fp32, lambda prm: run_padded(torch, prm, batch, heads, 0.0, torch.float32)),
        ("low", low, lambda prm: run_padded(torch, prm, batch, heads, 0.0, torch.bfloat16)),
    ):
        y, x = run(prm)
        y, dx = y.detach(), x.grad
        if what != "ours":
            y, dx = batch.unpad(y), batch.unpad(dx)
        # dbk is left out: softmax ignores a shift shared by a row's scores, so it is zero up to rounding
        results[what] = {"out": y, "dx": dx, **{"d" + k: v.grad for k, v in prm.items() if k != "bk"}}
    ours, ref, low = results["ours"], results["ref"], results["low"]
    res = {"lengths": lengths, "tolerance": CHECK_TOL, "rel_err": {}, "rel_err_padded_bf16": {}, "bad": []}
    for name in ours:
        tol = CHECK_TOL["out" if name == "out" else "grad"]
        err, err_low = rel_err(torch, ours[name], ref[name]), rel_err(torch, low[name], ref[name])
        res["rel_err"][name], res["rel_err_padded_bf16"][name] = err, err_low
        if not err <= max(tol, 2.0 * err_low):  # NaN fails too
            res["bad"].append(name)
    res["ok"] = not res["bad"]
    return res


def layer_flops(lengths, hidden, ffn):
    """Useful (real-token) FLOPs: (forward, forward+backward)."""
    T = float(sum(lengths))
    gemm = 2.0 * T * (4 * hidden * hidden + 2 * hidden * ffn)
    attn = 4.0 * hidden * float(sum(s * s for s in lengths))
    return gemm + attn, 3.0 * gemm + 3.5 * attn


def gemm_rate(torch, warmup, iters, n=8192):
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = timeit(torch, lambda: torch.matmul(a, b), warmup, iters)
    return {"what": f"torch.matmul [{n}, {n}] x [{n}, {n}] bf16", "ms": ms, "tflops": 2.0 * n**3 / ms / 1e9}


def time_model(torch, ops, name, hidden, heads, ffn, B, max_len, warmup, iters, gemm_tflops):
    lengths = realistic_lengths(B, max_len, seed=zlib.crc32(name.encode()))
    res = {
        "hidden": hidden,
        "heads": heads,
        "ffn": ffn,
        "batch": B,
        "max_len": max_len,
        "tokens": sum(lengths),
        "padded_tokens": B * max(lengths),
        "dtype": "bfloat16",
    }
    check_lengths = [s for s in lengths if s > 0][:CHECK_SEQS]
    res["check"] = check_layer(torch, ops, check_lengths, hidden, heads, ffn)
    if not res["check"]["ok"]:
        return res
    batch = Batch(torch, lengths, hidden, seed=3)
    prm = make_params(torch, hidden, ffn, torch.bfloat16, seed=1)
    fwd_flops, fb_flops = layer_flops(lengths, hidden, ffn)
    xp, dyp = batch.x.to(torch.bfloat16).requires_grad_(), batch.dy.to(torch.bfloat16)
    xpad, dypad = batch.pad(batch.x).to(torch.bfloat16).requires_grad_(), batch.pad(batch.dy).to(torch.bfloat16)
    leaves = [xp, xpad, *prm.values()]

    def clear():
        for t in leaves:
            t.grad = None

    for p in P_DROPS:

        def packed_fwd(p=p):
            with torch.no_grad():
                packed_layer(torch, ops, prm, xp, batch.cu_np, heads, p, 7)

        def packed_fb(p=p):
            clear()
            packed_layer(torch, ops, prm, xp, batch.cu_np, heads, p, 7).backward(dyp)

        def padded_fwd(p=p):
            with torch.no_grad():
                padded_layer(torch, prm, xpad, batch.keymask, heads, p)

        def padded_fb(p=p):
            clear()
            padded_layer(torch, prm, xpad, batch.keymask, heads, p).backward(dypad)

        r = {}
        for side, f, fb in (("packed", packed_fwd, packed_fb), ("padded", padded_fwd, padded_fb)):
            f_ms, fb_ms = timeit(torch, f, warmup, iters), timeit(torch, fb, warmup, iters)
            tf = fb_flops / fb_ms / 1e9
            r[side] = {
                "fwd_ms": f_ms,
                "fwdbwd_ms": fb_ms,
                "fwd_useful_tflops": fwd_flops / f_ms / 1e9,
                "fwdbwd_useful_tflops": tf,
                "fwdbwd_fraction_of_gemm_rate": tf / gemm_tflops,
            }
        share = res["tokens"] / res["padded_tokens"]
        r["ideal"] = {"fwd_ms": r["padded"]["fwd_ms"] * share, "fwdbwd_ms": r["padded"]["fwdbwd_ms"] * share}
        r["speedup_over_padded_fwdbwd"] = r["padded"]["fwdbwd_ms"] / r["packed"]["fwdbwd_ms"]
        r["possible_speedup"] = 1.0 / share
        r["packed_over_ideal_fwdbwd"] = r["packed"]["fwdbwd_ms"] / r["ideal"]["fwdbwd_ms"]
        res[pkey(p)] = r
    hi, lo = max(P_DROPS), min(P_DROPS)
    res["dropout_overhead_fwdbwd"] = {
        s: res[pkey(hi)][s]["fwdbwd_ms"] / res[pkey(lo)][s]["fwdbwd_ms"] for s in ("packed", "padded")
    }
    return res


def headline(models):
    """What gpu_check.sh's summary shows: per model and dropout."""
    out = {}
    for name, r in models.items():
        if not r.get("check", {}).get("ok"):
            out[name] = {"check": "FAILED", "bad": r.get("check", {}).get("bad")}
            continue
        out[name] = {
            pkey(p): {
                "speedup_over_padded": r[pkey(p)]["speedup_over_padded_fwdbwd"],
                "possible_speedup": r[pkey(p)]["possible_speedup"],
                "packed_useful_tflops": r[pkey(p)]["packed"]["fwdbwd_useful_tflops"],
                "packed_fraction_of_gemm_rate": r[pkey(p)]["packed"]["fwdbwd_fraction_of_gemm_rate"],
            }
            for p in P_DROPS
        }
        out[name]["dropout_overhead_fwdbwd"] = r["dropout_overhead_fwdbwd"]
    return out


def main():
    args, wanted = gpu_args(__doc__, 10, ("models", [m[0] for m in MODELS], "model"))

    script = os.path.basename(__file__)
    torch = require_cuda(script)
    harness = load_harness(script)
    ops = autograd_ops(torch, harness)
    t0 = time.time()
    gemm = gemm_rate(torch, args.warmup, args.iters)
    result = {
        **run_header(torch, harness, args),
        "omp_num_threads": os.environ["OMP_NUM_THREADS"],
        "flops": "useful (real tokens): GEMMs 2*T*(4*h^2 + 2*h*f) and attention 4*h*sum(s^2) forward; "
        "forward+backward 3x the GEMMs and 3.5x the attention",
        "gemm": gemm,
        "models": {},
    }
    for name, hidden, heads, ffn, B, L in MODELS:
        if name not in wanted:
            continue
        r = time_model(torch, ops, name, hidden, heads, ffn, B, L, args.warmup, args.iters, gemm["tflops"])
        result["models"][name] = r
        print(json.dumps({name: r}, indent=1), flush=True)
    result["headline"] = headline(result["models"])
    write_result(args.out, result, t0)
    print(json.dumps({"gemm_tflops": gemm["tflops"], "headline": result["headline"]}, indent=1))
    bad = {n: r["check"]["bad"] for n, r in result["models"].items() if not r["check"]["ok"]}
    if bad:
        raise SystemExit(
            f"{script}: the packed layer disagrees with the padded fp32 one (not timed): {bad} "
            f"(see each model's 'check' in {args.out})"
        )


if __name__ == "__main__":
    main()
