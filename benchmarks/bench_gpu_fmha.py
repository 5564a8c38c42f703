"""GPU benchmark of the CUDA FMHA kernels (C-ABI harness) against PyTorch's fastest attention.

Runs on a GPU machine with PyTorch (no Paddle): ``benchmarks/gpu_check.sh`` calls it. Per
batch (head size 64, bf16; ragged pre-training-like lengths, and BERT-large 40 x 512 with
every sequence 512 long), with attention dropout 0 and 0.1, forward and forward+backward
times with CUDA events (median of --iters after --warmup):

ours (paddle_unpad kernels through the harness)
  ``ours_grouped``, ``ours_ungrouped``  length-bucketed multi-stream launch / one launch;
      default backward (one pass, dQ added with fp32 atomics)
  ``ours_grouped_deterministic``, ``ours_ungrouped_deterministic``  the two-kernel backward
      (bitwise reruns)
peers (PyTorch)
  ``varlen_attn``  ``torch.nn.attention.varlen.varlen_attn`` on the packed tokens
      (FlashAttention-2 varlen, autograd), every batch. Where it takes no dropout argument
      its dropout 0.1 entry says so instead of a time.
  ``flash_varlen_aten``  the same FlashAttention-2 varlen kernels through
      ``torch.ops.aten._flash_attention_forward`` / ``_backward``, which take dropout
  ``sdpa_dense_flash`` / ``_cudnn`` / ``_efficient``  dense SDPA on [B, H, S, D] with that
      backend forced, on equal-length batches only (no padding there, so dense is fair)
  ``sdpa_padded_efficient`` / ``_cudnn``  SDPA on the padded batch with a key-padding mask
      (what a padded model runs), on ragged batches
A peer that cannot run records why ("unsupported" / "error"); nothing is substituted.

TFLOP/s count useful work only (4 * H * D * sum(s^2) forward; the backward 2.5x that), so
padding shows as lower throughput. Per batch and dropout: the strongest peer (fastest
forward+backward) and our ratio to it; per method the dropout overhead (time with 0.1 over
time with 0). Before timing, our output and gradients (dropout 0, both backward modes) are
compared with a peer's; a disagreement is recorded and makes the script exit 1 after
writing the JSON (--out).
"""

import argparse
import inspect
import json
import math
import os
import sys
import time
import types
import zlib

import numpy as np

os.environ.setdefault("OMP_NUM_THREADS", "4")  # host threads (torch reads it at import); the GPU does the work
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "gpu"))

P_DROPS = (0.0, 0.1)  # BERT's attention dropout is 0.1
SEED, OFFSET = 1234, 0  # our kernels' Philox key (the peers draw from torch's generator)


def require_cuda(script):
    """torch with a CUDA device, else SystemExit with one sentence (no traceback)."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure means "no torch here"
        raise SystemExit(
            f"{script} needs a CUDA GPU and PyTorch with CUDA: torch is not importable ({type(e).__name__}: {e})"
        ) from None
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA GPU: torch {torch.__version__} sees no CUDA device")
    return torch


def load_harness(script):
    import pu_harness

    try:
        return pu_harness.load()
    except (pu_harness.HarnessError, OSError) as e:
        raise SystemExit(f"{script}: the CUDA harness is not usable: {e}") from None


def gpu_args(doc, iters, subset=None):
    """(args, wanted) of a GPU benchmark's command line: --out, --warmup, --iters (default ``iters``)
    and, with ``subset`` = (flag, names, noun), a comma list of those names (all by default)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=iters)
    if subset is None:
        return ap.parse_args(), None
    flag, names, noun = subset
    ap.add_argument(f"--{flag}", default=",".join(names), help="comma-separated subset of: " + ", ".join(names))
    args = ap.parse_args()
    wanted = getattr(args, flag).split(",")
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        ap.error(f"--{flag}: unknown {noun}(s) {unknown}")
    return args, wanted


def run_header(torch, harness, args):
    """What every GPU result opens with: the date, the GPU, torch and CUDA, the harness, the timing."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "harness": harness.path,
        "timing": f"CUDA events, median of {args.iters} after {args.warmup} warm-up",
    }


def write_result(path, result, t0):
    """Write ``result`` as JSON with the seconds since ``t0``."""
    result["seconds"] = time.time() - t0
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def realistic_lengths(n, max_len, seed):
    """Pre-training-like batch: ~40% full-length samples, the rest spread below."""
    rng = np.random.default_rng(seed)
    full = rng.random(n) < 0.4
    short = rng.integers(max(8, max_len // 16), max_len, size=n)
    return [int(max_len) if f else int(s) for f, s in zip(full, short)]


CASES = [
    # name, heads, head_dim, batch, max_len, lengths ("ragged": realistic_lengths, "equal": all max_len)
    ("bert-base", 12, 64, 96, 512, "ragged"),
    ("bert-large", 16, 64, 56, 512, "ragged"),
    ("bert-large-40x512", 16, 64, 40, 512, "equal"),
    ("bert-large-long", 16, 64, 14, 2048, "ragged"),
]
REFERENCE_CASE = "bert-large-40x512"  # the shape the project reports against


def short(e):
    """An exception in one line (torch's dispatcher errors run to pages)."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"[:300]


class Unsupported(Exception):
    """A method that cannot run this problem, with the reason (recorded, not timed)."""


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


# ----------------------------------------------------------------------------- peers' entry points


def varlen_entry(torch):
    """(fn, info) for torch.nn.attention.varlen.varlen_attn, or (None, reason). info says
    whether it takes a scale and a dropout, from its signature."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception as e:  # noqa: BLE001
        return None, f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn ({short(e)})"
    params = inspect.signature(varlen_attn).parameters
    positional = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    shape_ok = (
        len(positional) >= 7 and all("cu" in n for n in positional[3:5]) and all("max" in n for n in positional[5:7])
    )
    if not shape_ok:
        return None, f"varlen_attn{inspect.signature(varlen_attn)}: not (q, k, v, cu_q, cu_k, max_q, max_k, ...)"
    dropout = next((n for n in ("dropout_p", "dropout") if n in params), None)
    return varlen_attn, {
        "signature": f"varlen_attn{inspect.signature(varlen_attn)}",
        "scale": "scale" in params,
        "dropout": dropout,
    }


def aten_flash_entry(torch):
    """(forward, backward) of torch.ops.aten._flash_attention_*, checked against the argument
    order this script passes, or (None, reason)."""
    varlen = ["cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal"]  # both directions take these
    want_f = ["query", "key", "value", *varlen, "return_debug_mask"]
    # the backward's next two: (rng_state, unused) or (philox_seed, philox_offset)
    want_b = ["grad_out", "query", "key", "value", "out", "logsumexp", *varlen]
    try:
        fwd, bwd = torch.ops.aten._flash_attention_forward, torch.ops.aten._flash_attention_backward
        for op, want in ((fwd, want_f), (bwd, want_b)):
            args = op.default._schema.arguments
            names = [a.name for a in args if not a.kwarg_only]
            if names[: len(want)] != want or "scale" not in [a.name for a in args]:
                return None, f"unexpected schema {op.default._schema}"
        return (fwd, bwd), None
    except Exception as e:  # noqa: BLE001
        return None, f"torch.ops.aten._flash_attention_forward/_backward: {short(e)}"


# ----------------------------------------------------------------------------- methods
# Each takes (case, p) and returns (forward, forward+backward) callables, or raises Unsupported.


def ours(grouping, deterministic):
    def make(c, p):
        torch, q = c.torch, c.q
        out, lse = torch.empty_like(q), torch.empty(c.T, c.H, device="cuda")
        dq, dk, dv = (torch.empty_like(q) for _ in range(3))
        nbytes = c.harness.lib.pu_fmha_bwd_workspace_bytes(c.T, c.H, c.D, int(deterministic))
        ws = torch.empty((nbytes + 3) // 4, device="cuda")
        kw = dict(dropout=p, seed=SEED, offset=OFFSET, grouping=grouping)

        def fwd():
            c.harness.fwd(q, c.k, c.v, c.cu_np, c.scale, out=out, lse=lse, **kw)

        def fb():
            fwd()
            c.harness.bwd(
                q,
                c.k,
                c.v,
                out,
                lse,
                c.dout,
                c.cu_np,
                c.scale,
                dq=dq,
                dk=dk,
                dv=dv,
                workspace=ws,
                deterministic=deterministic,
                **kw,
            )

        return fwd, fb

    return make


def autograd_pair(torch, leaves, run, dout):
    """forward (no_grad) and forward+backward (autograd) of run() over leaves."""

    def fwd():
        with torch.no_grad():
            run()

    def fb():
        for t in leaves:
            t.grad = None
        run().backward(dout)

    return fwd, fb


def varlen_attn_method(c, p):
    fn, info = c.varlen
    if fn is None:
        raise Unsupported(info)
    if p > 0 and info["dropout"] is None:
        raise Unsupported(
            f"varlen_attn takes no dropout argument in torch {c.torch.__version__} "
            "(its signature has none): no dropout time; flash_varlen_aten runs the same "
            "FlashAttention-2 kernels with dropout"
        )
    if not info["scale"] and abs(c.scale - 1.0 / math.sqrt(c.D)) > 1e-12:
        raise Unsupported("varlen_attn takes no scale and the scale is not 1/sqrt(D)")
    kw = {"scale": c.scale} if info["scale"] else {}
    if p > 0:
        kw[info["dropout"]] = p
    leaves = [x.detach().clone().requires_grad_() for x in (c.q, c.k, c.v)]
    return autograd_pair(c.torch, leaves, lambda: fn(*leaves, c.cu_t, c.cu_t, c.S, c.S, **kw), c.dout)


def flash_varlen_aten_method(c, p):
    ops, why = c.aten_flash
    if ops is None:
        raise Unsupported(why)
    fwd_op, bwd_op = ops
    q, k, v = c.q, c.k, c.v

    def fwd():
        return fwd_op(q, k, v, c.cu_t, c.cu_t, c.S, c.S, p, False, False, scale=c.scale)

    def fb():
        out, lse, rng, unused = fwd()[:4]
        bwd_op(c.dout, q, k, v, out, lse, c.cu_t, c.cu_t, c.S, c.S, p, False, rng, unused, scale=c.scale)

    return fwd, fb


def to_bhsd(c, x, padded):
    """[T, H, D] packed -> [B, H, S, D] (a transposed view of [B, S, H, D], as a model has it)."""
    if not padded:
        return x.view(c.B, c.S, c.H, c.D).transpose(1, 2)
    o = x.new_zeros(c.B, c.S, c.H, c.D)
    for b, s in enumerate(c.lengths):
        o[b, :s] = x[c.cu_np[b] : c.cu_np[b] + s]
    return o.transpose(1, 2)


def sdpa_method(backend_name, padded):
    def make(c, p):
        torch = c.torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        leaves = [to_bhsd(c, x, padded).detach().requires_grad_() for x in (c.q, c.k, c.v)]
        dout = to_bhsd(c, c.dout, padded)
        mask = None
        if padded:
            lens = torch.tensor(c.lengths, device="cuda")
            mask = (torch.arange(c.S, device="cuda")[None, :] < lens[:, None])[:, None, None, :]

        def run():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    *leaves, attn_mask=mask, dropout_p=p, scale=c.scale
                )

        return autograd_pair(torch, leaves, run, dout)

    return make


METHODS = {
    # name: (ours?, the batches it runs on: "all", "equal" lengths or "ragged", factory)
    "ours_grouped": (True, "all", ours(True, False)),
    "ours_ungrouped": (True, "all", ours(False, False)),
    "ours_grouped_deterministic": (True, "all", ours(True, True)),
    "ours_ungrouped_deterministic": (True, "all", ours(False, True)),
    "varlen_attn": (False, "all", varlen_attn_method),
    "flash_varlen_aten": (False, "all", flash_varlen_aten_method),
    "sdpa_dense_flash": (False, "equal", sdpa_method("FLASH_ATTENTION", padded=False)),
    "sdpa_dense_cudnn": (False, "equal", sdpa_method("CUDNN_ATTENTION", padded=False)),
    "sdpa_dense_efficient": (False, "equal", sdpa_method("EFFICIENT_ATTENTION", padded=False)),
    "sdpa_padded_efficient": (False, "ragged", sdpa_method("EFFICIENT_ATTENTION", padded=True)),
    "sdpa_padded_cudnn": (False, "ragged", sdpa_method("CUDNN_ATTENTION", padded=True)),
}
OURS_DEFAULT = "ours_grouped"


def pkey(p):
    return f"dropout={p:g}"


# ----------------------------------------------------------------------------- correctness


def check_against_peer(c):
    """Our out / dq / dk / dv (dropout 0, grouped, both backward modes) against the first peer
    that runs (varlen_attn, else the dense or padded SDPA), within twice the kernel's bf16
    tolerance (both sides round to bf16). Returns a dict with 'ok'."""
    from torch_checks import op_rules, rel_err

    torch = c.torch
    tol = op_rules().FMHA_GPU_TOLERANCE["bfloat16"]
    peer = None
    for name in ("varlen_attn", "sdpa_dense_flash", "sdpa_padded_efficient", "sdpa_padded_cudnn"):
        try:
            leaves = [x.detach().clone().requires_grad_() for x in (c.q, c.k, c.v)]
            if name == "varlen_attn":
                fn, info = c.varlen
                if fn is None:
                    continue
                out = fn(*leaves, c.cu_t, c.cu_t, c.S, c.S, **({"scale": c.scale} if info["scale"] else {}))
            else:
                if (name == "sdpa_dense_flash") != c.equal:
                    continue
                from torch.nn.attention import SDPBackend, sdpa_kernel

                bh = [to_bhsd(c, x, not c.equal) for x in leaves]
                mask = None
                if not c.equal:
                    lens = torch.tensor(c.lengths, device="cuda")
                    mask = (torch.arange(c.S, device="cuda")[None, :] < lens[:, None])[:, None, None, :]
                backend = {
                    "sdpa_dense_flash": "FLASH_ATTENTION",
                    "sdpa_padded_efficient": "EFFICIENT_ATTENTION",
                    "sdpa_padded_cudnn": "CUDNN_ATTENTION",
                }[name]
                with sdpa_kernel(getattr(SDPBackend, backend)):
                    o = torch.nn.functional.scaled_dot_product_attention(*bh, attn_mask=mask, scale=c.scale)
                o = o.transpose(1, 2)  # [B, S, H, D]
                out = (
                    o.reshape(c.B * c.S, c.H, c.D)
                    if c.equal
                    else torch.cat([o[b, :s] for b, s in enumerate(c.lengths)])
                )
            out.backward(c.dout)
            peer = (name, out.detach(), *(x.grad for x in leaves))
            break
        except Exception as e:  # noqa: BLE001 - try the next peer
            c.check_errors[name] = short(e)
    if peer is None:
        return {"ok": False, "why": "no peer ran to check against", "errors": c.check_errors}
    res = {"peer": peer[0], "tolerance": {"out": 2 * tol["out"], "grad": 2 * tol["grad"]}, "rel_err": {}}
    ok = True
    for det in (False, True):
        out, lse = c.harness.fwd(c.q, c.k, c.v, c.cu_np, c.scale)
        grads = c.harness.bwd(c.q, c.k, c.v, out, lse, c.dout, c.cu_np, c.scale, deterministic=det)
        torch.cuda.synchronize()
        errs = {n: rel_err(torch, a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), peer[1:])}
        res["rel_err"][f"deterministic={det}"] = errs
        ok = ok and all(e <= res["tolerance"]["out" if n == "out" else "grad"] for n, e in errs.items())
    res["ok"] = ok
    return res


# ----------------------------------------------------------------------------- one case


def summarise(methods):
    """Strongest peer per dropout, our ratios to it, and each method's dropout overhead."""

    def ms(m, p, key):
        return methods.get(m, {}).get(pkey(p), {}).get(key)

    def ratio(a, b):
        return None if a is None or b is None else a / b

    res = {}
    for p in P_DROPS:
        r = {}
        for key in ("fwdbwd_ms", "fwd_ms"):
            peers = {m: ms(m, p, key) for m, (is_ours, _, _) in METHODS.items() if not is_ours}
            peers = {m: t for m, t in peers.items() if t is not None}
            best = min(peers, key=peers.get) if peers else None
            what = key.split("_")[0]
            r[f"strongest_peer_{what}"] = best
            for m in ("ours_grouped", "ours_ungrouped", "ours_grouped_deterministic"):
                r[f"{key} {m} / strongest peer"] = ratio(ms(m, p, key), peers.get(best))
        padded = [t for m in ("sdpa_padded_efficient", "sdpa_padded_cudnn") if (t := ms(m, p, "fwdbwd_ms"))]
        r["fwdbwd_ms ours_grouped / best padded sdpa"] = ratio(
            ms(OURS_DEFAULT, p, "fwdbwd_ms"), min(padded) if padded else None
        )
        r["fwdbwd_ms ours_grouped / ours_ungrouped"] = ratio(
            ms("ours_grouped", p, "fwdbwd_ms"), ms("ours_ungrouped", p, "fwdbwd_ms")
        )
        r["fwdbwd_ms ours_grouped_deterministic / ours_grouped"] = ratio(
            ms("ours_grouped_deterministic", p, "fwdbwd_ms"), ms("ours_grouped", p, "fwdbwd_ms")
        )
        res[pkey(p)] = r
    hi, lo = max(P_DROPS), min(P_DROPS)
    res["dropout_overhead"] = {
        m: {k: ratio(ms(m, hi, k), ms(m, lo, k)) for k in ("fwd_ms", "fwdbwd_ms")} for m in methods
    }
    res["dropout_overhead_note"] = f"time with dropout {hi:g} / time with {lo:g}"
    return res


def run_case(torch, harness, name, H, D, B, max_len, kind, warmup, iters, varlen, aten_flash):
    dt = torch.bfloat16
    lengths = [max_len] * B if kind == "equal" else realistic_lengths(B, max_len, seed=zlib.crc32(name.encode()))
    cu_np = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    T, S = int(cu_np[-1]), max(lengths)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(T, H, D, device="cuda", generator=g).to(dt) for _ in range(4))
    fwd_flops = 4.0 * H * D * float(sum(s * s for s in lengths))
    res = {
        "heads": H,
        "head_dim": D,
        "batch": B,
        "lengths": kind,
        "tokens": T,
        "max_len": S,
        "mean_len": float(np.mean(lengths)),
        "padded_tokens": B * S,
        "dtype": "bfloat16",
        "fwd_gflop": fwd_flops / 1e9,
        "methods": {},
    }
    c = types.SimpleNamespace(
        torch=torch,
        harness=harness,
        q=q,
        k=k,
        v=v,
        dout=dout,
        cu_np=cu_np,
        cu_t=torch.from_numpy(cu_np).cuda(),
        lengths=lengths,
        T=T,
        S=S,
        B=B,
        H=H,
        D=D,
        scale=1.0 / math.sqrt(D),
        equal=kind == "equal",
        varlen=varlen,
        aten_flash=aten_flash,
        check_errors={},
    )
    res["check"] = check_against_peer(c)
    for method, (_, runs_on, make) in METHODS.items():
        if runs_on not in ("all", kind):
            continue
        entry = res["methods"].setdefault(method, {})
        for p in P_DROPS:
            try:
                f, fb = make(c, p)
                f_ms, fb_ms = timeit(torch, f, warmup, iters), timeit(torch, fb, warmup, iters)
                entry[pkey(p)] = {
                    "fwd_ms": f_ms,
                    "fwd_tflops": fwd_flops / f_ms / 1e9,
                    "fwdbwd_ms": fb_ms,
                    "fwdbwd_tflops": 3.5 * fwd_flops / fb_ms / 1e9,
                }
            except Unsupported as e:
                entry[pkey(p)] = {"unsupported": str(e)}
            except Exception as e:  # noqa: BLE001 - a peer that fails is recorded, not fatal
                entry[pkey(p)] = {"error": short(e)}
            torch.cuda.synchronize()
    res["ratios"] = summarise(res["methods"])
    return res


def print_case(name, res):
    print(
        f"\n{name}: {res['batch']} x up to {res['max_len']} ({res['lengths']}), {res['heads']} heads, "
        f"d={res['head_dim']}, {res['tokens']} tokens; check vs {res['check'].get('peer')}: "
        f"{'ok' if res['check']['ok'] else 'FAILED'}"
    )
    print(f"  {'method':30s}" + "".join(f" {pkey(p) + ' fwd / fwd+bwd ms (TFLOP/s)':>44s}" for p in P_DROPS))
    for m, entry in res["methods"].items():
        cells = []
        for p in P_DROPS:
            e = entry.get(pkey(p), {})
            if "fwd_ms" in e:
                cells.append(
                    f"{e['fwd_ms']:7.3f} / {e['fwdbwd_ms']:7.3f} ({e['fwd_tflops']:5.0f} / {e['fwdbwd_tflops']:5.0f})"
                )
            else:
                cells.append(("n/a: " + e.get("unsupported", e.get("error", "?")))[:44])
        print(f"  {m:30s}" + "".join(f" {x:>44s}" for x in cells))
    for p in P_DROPS:
        r = res["ratios"][pkey(p)]
        x = r.get("fwdbwd_ms ours_grouped / strongest peer")
        print(
            f"  {pkey(p)}: strongest peer {r['strongest_peer_fwdbwd']}, ours_grouped fwd+bwd / it = "
            f"{'n/a' if x is None else f'{x:.2f}'}"
        )
    x = res["ratios"]["dropout_overhead"].get(OURS_DEFAULT, {}).get("fwdbwd_ms")
    print(f"  dropout overhead of ours_grouped (fwd+bwd): {'n/a' if x is None else f'{x:.2f}x'}", flush=True)


def targets(cases):
    ref = cases.get(REFERENCE_CASE, {}).get("ratios", {})
    ragged = cases.get("bert-large", {}).get("ratios", {})

    def le(x, limit):
        return None if x is None else bool(x <= limit)

    def get(r, p, key):
        return r.get(pkey(p), {}).get(key)

    hi = max(P_DROPS)
    return {
        "40x512 fwdbwd within 1.3x of the strongest peer, dropout 0": le(
            get(ref, 0.0, "fwdbwd_ms ours_grouped / strongest peer"), 1.3
        ),
        f"40x512 fwdbwd within 1.3x of the strongest peer, dropout {hi:g}": le(
            get(ref, hi, "fwdbwd_ms ours_grouped / strongest peer"), 1.3
        ),
        f"40x512 dropout {hi:g} costs at most +20% fwdbwd": le(
            ref.get("dropout_overhead", {}).get(OURS_DEFAULT, {}).get("fwdbwd_ms"), 1.2
        ),
        f"ragged fwdbwd faster than padded sdpa, dropout {hi:g}": le(
            get(ragged, hi, "fwdbwd_ms ours_grouped / best padded sdpa"), 1.0
        ),
        "ragged grouped no slower than ungrouped (2% noise allowance)": le(
            get(ragged, 0.0, "fwdbwd_ms ours_grouped / ours_ungrouped"), 1.02
        ),
    }


def main():
    args, wanted = gpu_args(__doc__, 15, ("cases", [c[0] for c in CASES], "case"))

    script = os.path.basename(__file__)
    torch = require_cuda(script)
    harness = load_harness(script)
    varlen, aten_flash = varlen_entry(torch), aten_flash_entry(torch)
    t0 = time.time()
    result = {
        **run_header(torch, harness, args),
        "omp_num_threads": os.environ["OMP_NUM_THREADS"],
        "flops": "useful only: forward 4*H*D*sum(s^2), forward+backward 3.5x that",
        "varlen_attn": varlen[1] if varlen[0] is not None else {"missing": varlen[1]},
        "flash_varlen_aten": "ok" if aten_flash[0] is not None else {"missing": aten_flash[1]},
        "cases": {},
    }
    for name, H, D, B, L, kind in CASES:
        if name not in wanted:
            continue
        result["cases"][name] = run_case(
            torch, harness, name, H, D, B, L, kind, args.warmup, args.iters, varlen, aten_flash
        )
        print_case(name, result["cases"][name])
    result["targets_bert_large_bf16_d64"] = targets(result["cases"])
    write_result(args.out, result, t0)
    print(json.dumps(result["targets_bert_large_bf16_d64"], indent=1))
    bad = sorted(n for n, c in result["cases"].items() if not c["check"]["ok"])
    if bad:
        raise SystemExit(
            f"{script}: our kernels disagree with the peer, or no peer ran to check them, in "
            f"{', '.join(bad)} (see each case's 'check' in {args.out})"
        )


if __name__ == "__main__":
    main()
