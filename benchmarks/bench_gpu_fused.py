"""GPU benchmark of the fused CUDA encoder kernels (C-ABI harness) against unfused PyTorch.

Runs on a GPU machine with PyTorch (no Paddle): ``benchmarks/gpu_check.sh`` calls it.
BERT-base / BERT-large shapes on a packed batch (rows = tokens), bf16 and fp16, timed with
CUDA events (median of --iters after warm-up), forward and forward+backward:

* ``bias_gelu``  ours vs ``gelu(x + bias)`` (torch: two kernels, autograd backward)
* ``bdrln``      ours (dropout 0.1) vs ``layer_norm(residual + dropout(x + bias))``
                 (torch: dropout with its own generator, so only the speed is comparable)
* ``bdrln_amp_o1`` the same with AMP O1's dtypes: half x and bias, float32 residual, y and
                 LayerNorm parameters

GB/s count the bytes a fused kernel must move at least (each tensor read or written
once; vectors and mean/rstd ignored), for both sides, so the ratio is a time ratio.
Writes JSON (--out).
"""

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "gpu"))

# The same CUDA-event timing, command line and result header as the attention benchmark.
from bench_gpu_fmha import (  # noqa: E402
    autograd_pair,
    gpu_args,
    load_harness,
    require_cuda,
    run_header,
    timeit,
    write_result,
)

CASES = [
    # name, rows (packed tokens), hidden, intermediate
    ("bert-base", 16384, 768, 3072),
    ("bert-large", 16384, 1024, 4096),
]
P_DROP = 0.1


def gelu_case(torch, harness, rows, cols, dt, warmup, iters):
    g = torch.Generator(device="cuda").manual_seed(0)
    x, dy = (torch.randn(rows, cols, device="cuda", generator=g).to(dt) for _ in range(2))
    bias = torch.randn(cols, device="cuda", generator=g).to(dt)
    y, dx, dbias = torch.empty_like(x), torch.empty_like(x), torch.empty_like(bias)
    ws = torch.empty(harness.lib.pu_bias_gelu_bwd_workspace_bytes(rows, cols) // 4 + 1, device="cuda")
    elem = x.element_size()
    fwd_bytes, fb_bytes = 2 * rows * cols * elem, 5 * rows * cols * elem  # fwd x,y; bwd x,dy,dx

    def ours_f():
        harness.bias_gelu_fwd(x, bias, y=y)

    def ours_fb():
        harness.bias_gelu_fwd(x, bias, y=y)
        harness.bias_gelu_bwd(x, bias, dy, dx=dx, dbias=dbias, workspace=ws)

    xt, bt = x.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()

    torch_f, torch_fb = autograd_pair(torch, (xt, bt), lambda: torch.nn.functional.gelu(xt + bt), dy)

    return compare(
        torch, {"ours": (ours_f, ours_fb), "torch_unfused": (torch_f, torch_fb)}, fwd_bytes, fb_bytes, warmup, iters
    )


def bdrln_case(torch, harness, rows, cols, dt, warmup, iters, residual_dt=None, ln_dt=None):
    """residual_dt / ln_dt: AMP O1's mix (float32 residual stream and LayerNorm parameters next
    to a half GEMM output); default: x's dtype."""
    rdt, wdt = residual_dt or dt, ln_dt or dt
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(rows, cols, device="cuda", generator=g).to(dt)
    res, dy = (torch.randn(rows, cols, device="cuda", generator=g).to(rdt) for _ in range(2))
    bias = torch.randn(cols, device="cuda", generator=g).to(dt)
    w, b = (torch.randn(cols, device="cuda", generator=g).to(wdt) for _ in range(2))
    y, dx, dres = torch.empty_like(res), torch.empty_like(x), torch.empty_like(res)
    mean, rstd = torch.empty(rows, device="cuda"), torch.empty(rows, device="cuda")
    db, dw, dlb = torch.empty_like(bias), torch.empty_like(w), torch.empty_like(w)
    ws = torch.empty(harness.lib.pu_bdrln_bwd_workspace_bytes(rows, cols) // 4 + 1, device="cuda")
    ex, er = x.element_size(), res.element_size()
    # fwd: x, residual, y; bwd: x, residual, dy, dx, dresidual
    fwd_bytes, fb_bytes = rows * cols * (ex + 2 * er), rows * cols * (2 * ex + 6 * er)
    kw = dict(dropout=P_DROP, epsilon=1e-12, seed=1234, offset=5)

    def ours_f():
        harness.bdrln_fwd(x, bias, res, w, b, y=y, mean=mean, rstd=rstd, **kw)

    def ours_fb():
        harness.bdrln_fwd(x, bias, res, w, b, y=y, mean=mean, rstd=rstd, **kw)
        harness.bdrln_bwd(
            x,
            bias,
            res,
            w,
            mean,
            rstd,
            dy,
            dx=dx,
            dresidual=dres,
            dbias=db,
            dln_weight=dw,
            dln_bias=dlb,
            workspace=ws,
            **kw,
        )

    leaves = [t.detach().clone().requires_grad_() for t in (x, bias, res, w, b)]

    def torch_y():
        xt, bt, rt, wt, lbt = leaves
        h = torch.nn.functional.dropout(xt + bt, P_DROP, training=True).to(rdt)
        return torch.nn.functional.layer_norm(rt + h, (cols,), wt.to(rdt), lbt.to(rdt), 1e-12)

    torch_f, torch_fb = autograd_pair(torch, leaves, torch_y, dy)

    return compare(
        torch, {"ours": (ours_f, ours_fb), "torch_unfused": (torch_f, torch_fb)}, fwd_bytes, fb_bytes, warmup, iters
    )


def compare(torch, methods, fwd_bytes, fb_bytes, warmup, iters):
    res = {}
    for name, (f, fb) in methods.items():
        try:
            f_ms, fb_ms = timeit(torch, f, warmup, iters), timeit(torch, fb, warmup, iters)
            res[name] = {
                "fwd_ms": f_ms,
                "fwd_gbs": fwd_bytes / f_ms / 1e6,
                "fwdbwd_ms": fb_ms,
                "fwdbwd_gbs": fb_bytes / fb_ms / 1e6,
            }
        except Exception as e:  # noqa: BLE001
            res[name] = {"error": f"{type(e).__name__}: {e}"}
    try:
        res["ratios"] = {k: res["ours"][k] / res["torch_unfused"][k] for k in ("fwd_ms", "fwdbwd_ms")}
    except Exception:  # noqa: BLE001
        res["ratios"] = None
    return res


def main():
    args, _ = gpu_args(__doc__, 20)

    script = os.path.basename(__file__)
    torch = require_cuda(script)
    harness = load_harness(script)
    t0 = time.time()
    result = {
        **run_header(torch, harness, args),
        "bytes": "minimal traffic of a fused kernel (each [rows, cols] tensor once)",
        "cases": {},
    }
    for name, rows, hidden, inter in CASES:
        for dtype in ("bfloat16", "float16"):
            dt = getattr(torch, dtype)
            key = f"{name}/{dtype}"
            result["cases"][key] = {
                "rows": rows,
                "hidden": hidden,
                "intermediate": inter,
                "bias_gelu": gelu_case(torch, harness, rows, inter, dt, args.warmup, args.iters),
                "bdrln": bdrln_case(torch, harness, rows, hidden, dt, args.warmup, args.iters),
                "bdrln_amp_o1": bdrln_case(
                    torch,
                    harness,
                    rows,
                    hidden,
                    dt,
                    args.warmup,
                    args.iters,
                    residual_dt=torch.float32,
                    ln_dt=torch.float32,
                ),
            }
            print(json.dumps({key: result["cases"][key]}, indent=1), flush=True)
    write_result(args.out, result, t0)


if __name__ == "__main__":
    main()
