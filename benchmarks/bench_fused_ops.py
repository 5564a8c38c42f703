"""Fused encoder ops vs the unfused Paddle sequences they replace, side by side, in one process.

Compared, for the forward pass and for forward + backward, on packed tokens ``[T, hidden]``:

* ``bias_gelu``: ``paddle_unpad.ops.bias_gelu(x, bias)`` on ``[T, 4 * hidden]`` vs
  ``paddle.nn.functional.gelu(x + bias)`` (exact GELU; what ``nn.Linear`` + ``gelu`` do after
  the FFN's first GEMM).
* ``bias_dropout_residual_layer_norm``: the fused op on ``[T, hidden]`` vs
  ``layer_norm(residual + dropout(x + bias))`` (the post-LN block of
  ``nn.TransformerEncoderLayer``), with dropout 0.1 (training) and 0.0 (the unfused side then
  skips the dropout op).

Reported: median milliseconds, the speedup of the fused op, and effective bandwidth
GB/s = the minimum bytes the op must move / time, the same byte count for both sides
(bias_gelu: read x, write y; backward read x and dy, write dx. LayerNorm block: read x
and residual, write y; backward read x, residual and dy, write dx and dresidual; the
[F] vectors are negligible).

Threads are set once, before Paddle is imported, and are the same for both sides
(``--threads``, default 2: Paddle's pools and the plugin's kernels, ``bench_util.set_threads``). Writes
``benchmarks/results/fused_ops.json``.

Usage::

    python benchmarks/bench_fused_ops.py                 # T = 4096, hidden 384 and 768
    python benchmarks/bench_fused_ops.py --quick         # smoke run, seconds
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time

import bench_args
import bench_util

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def parse_args(argv=None):
    options = [
        ("--threads", int, 2, "threads for both sides (default 2)"),
        ("--tokens", int, 4096, "T, packed tokens (default 4096)"),
        ("--hidden", str, "384,768", "hidden sizes (default 384,768)"),
        ("--repeats", int, 20, "timed repeats, interleaved (median reported)"),
        ("--warmup", int, 3, None),
        ("--out", str, os.path.join(HERE, "results", "fused_ops.json"), None),
        ("--quick", bool, False, "tiny sizes, few repeats: a smoke run"),
    ]
    ap = bench_args.add_options(bench_args.parser(__doc__), options)
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.hidden, args.repeats, args.warmup = 64, "32", 2, 1
    bench_args.positive_or_exit(ap, args, ["threads"])
    args.hidden = [int(h) for h in str(args.hidden).split(",") if h.strip()]
    return args


def _timed(fns, repeats, warmup):
    """Median seconds of each fn, calls interleaved so that drift hits all alike."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def _time_modes(args, modes, row, diff):
    """One row per mode: fused vs unfused medians, GB/s from the bytes each mode moves."""
    import paddle

    rows = []
    for mode, fns, nbytes in modes:
        with paddle.no_grad() if mode == "fwd" else _null():
            t_fused, t_unfused = _timed(fns, args.repeats, args.warmup)
        rows.append(
            dict(
                row,
                mode=mode,
                fused_ms=1e3 * t_fused,
                unfused_ms=1e3 * t_unfused,
                speedup=t_unfused / t_fused,
                fused_gbs=nbytes / t_fused / 1e9,
                unfused_gbs=nbytes / t_unfused / 1e9,
                max_abs_diff=diff,
            )
        )
    return rows


def _gelu_rows(args, tensor, hidden):
    """bias_gelu on [T, 4h], forward and forward + backward."""
    import paddle
    from paddle_unpad import ops

    T, Fi = args.tokens, 4 * hidden
    x, bias, dy = tensor([T, Fi], True), tensor([Fi], True), tensor([T, Fi], False)

    def gelu_fused():
        return ops.bias_gelu(x, bias)

    def gelu_unfused():
        return paddle.nn.functional.gelu(x + bias)

    # paddle.grad: the gradients themselves, without accumulating them into .grad
    # (which would add the same zero-fill and add passes to both sides).
    def with_backward(f):
        def run():
            return paddle.grad([f()], [x, bias], grad_outputs=[dy])

        return run

    diff = float((gelu_fused() - gelu_unfused()).abs().max())
    elems = T * Fi
    modes = (
        ("fwd", (lambda: gelu_fused(), lambda: gelu_unfused()), 2 * 4 * elems),
        ("fwd_bwd", (with_backward(gelu_fused), with_backward(gelu_unfused)), 5 * 4 * elems),
    )
    return _time_modes(args, modes, dict(op="bias_gelu", hidden=hidden, shape=[T, Fi], dropout=None), diff)


def _ln_rows(args, tensor, hidden):
    """bias + dropout + residual + LayerNorm on [T, h], with and without dropout."""
    import paddle
    from paddle_unpad import ops

    F, T = paddle.nn.functional, args.tokens
    xs, bs, res = tensor([T, hidden], True), tensor([hidden], True), tensor([T, hidden], True)
    w, b = tensor([hidden], True), tensor([hidden], True)
    dyh = tensor([T, hidden], False)
    params = (xs, bs, res, w, b)
    rows = []
    for p in (0.1, 0.0):

        def ln_fused(p=p):
            return ops.bias_dropout_residual_layer_norm(xs, bs, res, w, b, dropout=p, epsilon=1e-12)

        def ln_unfused(p=p):
            h = xs + bs
            if p > 0:  # without dropout the unfused side skips the dropout op altogether
                h = F.dropout(h, p=p, training=True)
            return F.layer_norm(res + h, [hidden], weight=w, bias=b, epsilon=1e-12)

        def ln_backward(f):
            def run():
                return paddle.grad([f()], list(params), grad_outputs=[dyh])

            return run

        diff = float((ln_fused(0.0) - ln_unfused(0.0)).abs().max())
        elems = T * hidden
        modes = (
            ("fwd", (ln_fused, ln_unfused), 3 * 4 * elems),
            ("fwd_bwd", (ln_backward(ln_fused), ln_backward(ln_unfused)), 8 * 4 * elems),
        )
        rows += _time_modes(
            args, modes, dict(op="bias_dropout_residual_layer_norm", hidden=hidden, shape=[T, hidden], dropout=p), diff
        )
    return rows


def _print_rows(args, rows, native, isa, paddle_version):
    print(f"threads: {args.threads} (both sides)   native: {native}   isa: {isa}")
    print(
        f"paddle {paddle_version}, {platform.processor() or platform.machine()}, "
        f"median of {args.repeats} interleaved repeats"
    )
    for mode, title in (("fwd", "forward"), ("fwd_bwd", "forward + backward")):
        print(f"\n== {title} ==")
        hdr = f"{'op':<34}{'shape':>13}{'p':>5}{'fused ms':>10}{'unfused ms':>12}{'speedup':>9}{'fused GB/s':>12}{'unfused GB/s':>14}"
        bench_util.print_head(hdr)
        for r in rows:
            if r["mode"] != mode:
                continue
            shape = "x".join(map(str, r["shape"]))
            p = "-" if r["dropout"] is None else f"{r['dropout']:.1f}"
            print(
                f"{r['op']:<34}{shape:>13}{p:>5}{r['fused_ms']:>10.3f}{r['unfused_ms']:>12.3f}"
                f"{r['speedup']:>8.2f}x{r['fused_gbs']:>12.2f}{r['unfused_gbs']:>14.2f}"
            )


def main(argv=None):
    args = parse_args(argv)
    bench_util.set_threads(args.threads)  # before Paddle loads: its pools and the plugin's kernels
    sys.path.insert(0, ROOT)
    import numpy as np
    import paddle

    import paddle_unpad
    from paddle_unpad._runtime import native as _native

    avail = paddle_unpad.ops_available()
    native = {op: avail[op]["cpu"] for op in ("bias_gelu", "bias_dropout_residual_layer_norm")}
    rng = np.random.default_rng(0)

    def tensor(shape, grad):
        t = paddle.to_tensor(rng.standard_normal(shape, dtype=np.float32))
        t.stop_gradient = not grad
        return t

    rows = []
    for hidden in args.hidden:
        rows += _gelu_rows(args, tensor, hidden) + _ln_rows(args, tensor, hidden)
    isa = _native.info().get("isa")
    _print_rows(args, rows, native, isa, paddle.__version__)
    result = {
        "config": {
            "threads": args.threads,
            "tokens": args.tokens,
            "hidden": args.hidden,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "quick": args.quick,
            "native": native,
            "isa": isa,
            "paddle": paddle.__version__,
            "machine": platform.machine(),
        },
        "rows": rows,
    }
    bench_util.write_result(args.out, result)
    print(f"\nwrote {args.out}")
    return result


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
