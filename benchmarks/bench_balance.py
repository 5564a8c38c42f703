"""Load-balance benchmark.

1. Simulation: imbalance (max rank cost / mean rank cost - 1; mean, p95, max over
   ``--batches`` global batches) of no balancing, sort-and-deal (the paper's / NVIDIA's
   method) and our planner, each planned and scored with the token cost and with the
   quadratic (BERT-large FLOP) cost, at 2, 8, 64 and 512 ranks x 56 samples per rank, on
   the BERT pre-training length distribution of ``paddle_unpad.balance.workloads``
   (max 512); samples moved; planner time (C++ core and the Python fallback).
2. Real 2-rank CPU run (``python -m paddle.distributed.launch --nproc_per_node 2``): a
   small unpadded transformer trained with plain data parallel on each rank's own
   batches, with the asynchronous exchange, and on the same balanced batches prepared
   beforehand and fed directly; per rank: compute time per step, time waiting at the
   gradient all-reduce, and the overhead of the asynchronous exchange.

    python benchmarks/bench_balance.py            # both parts, ~2-3 minutes on 2 cores
    python benchmarks/bench_balance.py --quick    # fewer batches/steps
    python benchmarks/bench_balance.py --no-real  # simulation only

Results: ``benchmarks/results/balance_<kind>.json`` (one file per host kind).  Threads: OMP_NUM_THREADS=1 per rank
(2 ranks on 2 cores), set for every side alike.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import bench_util

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from paddle_unpad import balance  # noqa: E402

COSTS = {"tokens": balance.TokenCost(), "quadratic": balance.DEFAULT_COST}


# ------------------------------------------------------------------------ simulation
def _dest_none(counts):
    return np.repeat(np.arange(len(counts)), counts)


def _dest_sort_and_deal(flat_lengths, R):
    # longest first, ties by (rank, index) == flat order; deal round robin
    order = np.lexsort((np.arange(flat_lengths.size), -flat_lengths))
    dest = np.empty(flat_lengths.size, dtype=np.int64)
    dest[order] = np.arange(flat_lengths.size) % R
    return dest


def _imb(dest, costs, R):
    loads = np.bincount(dest, weights=costs, minlength=R)
    return float(loads.max() / loads.mean() - 1.0)


def simulate(ranks_list, per_rank, n_batches, seed=0):
    pool = balance.bert_pretraining_lengths(200_000, max_len=512, seed=seed)
    rng = np.random.default_rng(seed + 1)
    rows = []
    for R in ranks_list:
        nb = n_batches
        res = {}
        times = {c: [] for c in COSTS}
        moved = {c: [] for c in COSTS}
        for _ in range(nb):
            L = rng.choice(pool, size=(R, per_rank))
            flat = L.reshape(-1)
            counts = np.full(R, per_rank)
            for cname, cm in COSTS.items():
                c = cm.costs(flat)
                for mname, dest in (("none", _dest_none(counts)), ("sort-and-deal", _dest_sort_and_deal(flat, R))):
                    res.setdefault((mname, cname), []).append(_imb(dest, c, R))
                t0 = time.perf_counter()
                dest, _ = balance.plan_dest(L, cost=cm)
                times[cname].append(time.perf_counter() - t0)
                res.setdefault(("ours", cname), []).append(_imb(dest, c, R))
                moved[cname].append(float(np.mean(dest != _dest_none(counts))))
        for (mname, cname), v in sorted(res.items()):
            v = np.array(v) * 100
            rows.append(
                {
                    "ranks": R,
                    "per_rank": per_rank,
                    "method": mname,
                    "cost": cname,
                    "batches": nb,
                    "mean_pct": float(v.mean()),
                    "p95_pct": float(np.percentile(v, 95)),
                    "max_pct": float(v.max()),
                    "plan_ms": (float(np.median(times[cname]) * 1e3) if mname == "ours" else None),
                    "moved_frac": (
                        float(np.mean(moved[cname])) if mname == "ours" else (0.0 if mname == "none" else (R - 1) / R)
                    ),
                }
            )
    return rows


def planner_times(repeats=7):
    """Best time of one planner call (ms), per problem and way of calling it.

    ``lists``: :func:`balance.plan` on Python lists, lists of (rank, index) out (the documented
    API); ``numpy``: :func:`balance.plan_dest` on a [ranks, samples] int64 array, a numpy
    destination array out (what the exchange calls); ``numpy, callable cost``: the same with a
    Python ``length -> cost`` function equal to the default cost model (same plan)."""
    out = {}
    default = balance.DEFAULT_COST

    def py_cost(s):
        return default(s)

    for R, k in ((8, 56), (64, 56), (512, 56), (1024, 64)):
        rows = balance.global_batches(1, R, k, seed=3)[0]
        arr = np.asarray(rows, dtype=np.int64)
        calls = []
        for backend in ("native", "python") if balance.native_available() else ("python",):
            calls.append(
                (
                    f"{R}x{k} {backend} lists",
                    lambda b=backend: balance.plan(rows, backend=b),
                    2 if backend == "python" and R > 512 else repeats,
                )
            )
        if balance.native_available():
            calls.append((f"{R}x{k} native numpy", lambda: balance.plan_dest(arr, backend="native"), repeats))
            calls.append(
                (
                    f"{R}x{k} native numpy, callable cost",
                    lambda: balance.plan_dest(arr, cost=py_cost, backend="native"),
                    repeats,
                )
            )
        for name, fn, reps in calls:
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            out[name] = float(min(ts) * 1e3)
    return out


def print_sim(rows):
    print("\n## Simulated imbalance (max/mean - 1, %) -- BERT pre-training lengths, max 512\n")
    print(
        f"{'ranks':>5} {'x':>3} {'cost':>9} | {'none mean/p95/max':>22} | {'sort-and-deal':>22} | "
        f"{'ours':>24} | {'plan ms':>7} | {'moved':>5}"
    )
    key = {(r["ranks"], r["method"], r["cost"]): r for r in rows}
    for R in sorted({r["ranks"] for r in rows}):
        for c in COSTS:
            cells = []
            for m in ("none", "sort-and-deal", "ours"):
                r = key[(R, m, c)]
                cells.append(f"{r['mean_pct']:6.3f}/{r['p95_pct']:6.3f}/{r['max_pct']:6.3f}")
            o = key[(R, "ours", c)]
            k = o["per_rank"]
            print(
                f"{R:>5} {k:>3} {c:>9} | {cells[0]:>22} | {cells[1]:>22} | {cells[2]:>24} | "
                f"{o['plan_ms']:7.2f} | {o['moved_frac'] * 100:4.1f}%"
            )


# ------------------------------------------------------------------------ real 2-rank run
def _worker_samples(total, world, per_rank, vocab):
    """A ``sample(t, r, k)`` every rank can call for every rank (the pre-balanced feed needs all),
    every sample materialised once in a fixed order (the same on every rank)."""
    pool = balance.bert_pretraining_lengths(total * world * per_rank, max_len=512, seed=5)
    pool = pool.reshape(total, world, per_rank)
    rng = np.random.default_rng(9)
    toks = {}

    def sample(t, r, k):
        key = (t, r, k)
        if key not in toks:
            s = int(pool[t, r, k])
            toks[key] = rng.integers(1, vocab, size=s).astype(np.int64)
        return {"input_ids": toks[key], "sample_id": (t * world + r) * per_rank + k}

    for t in range(total):
        for r in range(world):
            for k in range(per_rank):
                sample(t, r, k)
    return sample


def _toy_model(paddle, H, NH, V):
    """Two post-LN blocks with per-sequence attention (quadratic in each sample's length)."""

    class Block(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.qkv = paddle.nn.Linear(H, 3 * H)
            self.o = paddle.nn.Linear(H, H)
            self.f1 = paddle.nn.Linear(H, 4 * H)
            self.f2 = paddle.nn.Linear(4 * H, H)
            self.n1 = paddle.nn.LayerNorm(H)
            self.n2 = paddle.nn.LayerNorm(H)

        def forward(self, x, cu):
            qkv = self.qkv(x)
            outs = []
            for b in range(len(cu) - 1):  # per-sequence attention: quadratic in its length
                seg = qkv[int(cu[b]) : int(cu[b + 1])].reshape([-1, 3, NH, H // NH]).transpose([1, 2, 0, 3])
                q, k, v = seg[0], seg[1], seg[2]
                a = paddle.nn.functional.softmax(paddle.matmul(q, k, transpose_y=True) / (H // NH) ** 0.5, -1)
                outs.append(paddle.matmul(a, v).transpose([1, 0, 2]).reshape([-1, H]))
            x = self.n1(x + self.o(paddle.concat(outs, 0)))
            return self.n2(x + self.f2(paddle.nn.functional.gelu(self.f1(x))))

    class Model(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.emb = paddle.nn.Embedding(V, H)
            self.pos = paddle.nn.Embedding(512, H)
            self.blocks = paddle.nn.LayerList([Block() for _ in range(2)])
            self.head = paddle.nn.Linear(H, V)

        def forward(self, ids, pos, cu):
            x = self.emb(ids) + self.pos(pos)
            for blk in self.blocks:
                x = blk(x, cu)
            return self.head(x)

    return Model()


def _train(run, batches, label, out):
    """Train on ``batches``; after ``run["warmup"]`` steps record fetch / compute / wait / step seconds."""
    import paddle
    import paddle.distributed as dist

    model, params, opt, flag, warmup = run["model"], run["params"], run["opt"], run["flag"], run["warmup"]
    t_prev = time.perf_counter()
    for i, b in enumerate(batches):
        t0 = time.perf_counter()
        logits = model(b["input_ids"], b["position_ids"], b["cu_seqlens_host"])
        loss = paddle.nn.functional.cross_entropy(logits, b["input_ids"].unsqueeze(-1)).mean()
        loss.backward()
        t1 = time.perf_counter()
        dist.all_reduce(flag)  # returns when the slowest rank arrives: the wait
        t2 = time.perf_counter()
        g = paddle.concat([p.grad.reshape([-1]) for p in params])
        dist.all_reduce(g)
        opt.step()
        opt.clear_grad()
        t3 = time.perf_counter()
        if i >= warmup:
            out.setdefault(label, {"compute": [], "wait": [], "step": [], "fetch": []})
            out[label]["fetch"].append(t0 - t_prev)  # the loop waiting for its batch
            out[label]["compute"].append(t1 - t0)
            out[label]["wait"].append(t2 - t1)
            out[label]["step"].append(t3 - t_prev)  # includes getting the batch
        t_prev = t3


class _Window:
    """One loader object per mode, fed a different slice each round."""

    def __init__(self):
        self.batches = []

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


def _prebalanced(sample, total, world, per_rank, rank):
    """The same balanced batches as the exchange's, prepared beforehand and fed directly."""
    from paddle_unpad.data import pack_samples, to_paddle

    pre = []
    for t in range(total):
        L = [[len(sample(t, r, k)["input_ids"]) for k in range(per_rank)] for r in range(world)]
        p = balance.plan(L, cost="quadratic")
        smp = [sample(t, r, k) for r, k in p[rank]]
        packed = pack_samples(
            [{"input_ids": s["input_ids"]} for s in smp],
            [len(s["input_ids"]) for s in smp],
            [s["sample_id"] for s in smp],
        )
        pre.append(to_paddle(packed))
    return pre


def _rounds(run, own, pre, steps, rounds):
    """The three feeds, interleaved round by round to spread machine noise evenly."""
    import paddle_unpad.fleet as pf

    w_none, w_ex = _Window(), _Window()
    none_loader = pf.distributed_loader(w_none, balance=False)
    ex_loader = pf.distributed_loader(w_ex)
    res, cpu = {}, []
    per_round = max(2, steps // rounds)
    for rnd in range(rounds):
        sl = slice(rnd * per_round, rnd * per_round + per_round + run["warmup"])
        w_none.batches, w_ex.batches = own[sl], own[sl]
        _train(run, none_loader, "none", res)
        _train(run, ex_loader, "exchange", res)
        cpu.append(ex_loader.stats["thread_cpu_s"] / max(1, ex_loader.stats["steps"]))
        _train(run, pre[sl], "prebalanced", res)
    res["exchange_thread_cpu_per_step_s"] = float(np.mean(cpu))
    return res


def worker(out_path, steps, per_rank, warmup, rounds):
    import paddle
    import paddle.distributed as dist
    from paddle.distributed import fleet

    import paddle_unpad.fleet as pf

    strategy = pf.DistributedStrategy()
    strategy.unpad = True
    strategy.unpad_configs = {"cost": "quadratic", "prefetch": 2, "timeout": 120.0}
    fleet.init(is_collective=True, strategy=strategy)
    rank, world = dist.get_rank(), dist.get_world_size()
    total = steps + warmup * rounds + rounds
    sample = _worker_samples(total, world, per_rank, vocab=1000)
    own = [[sample(t, rank, k) for k in range(per_rank)] for t in range(total)]
    paddle.seed(0)
    model = _toy_model(paddle, H=128, NH=4, V=1000)
    params = [p for p in model.parameters()]
    run = {
        "model": model,
        "params": params,
        "opt": paddle.optimizer.SGD(learning_rate=1e-3, parameters=params),
        "flag": paddle.zeros([1]),
        "warmup": warmup,
    }
    res = _rounds(run, own, _prebalanced(sample, total, world, per_rank, rank), steps, rounds)
    allres = []
    dist.all_gather_object(allres, res)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(allres, f)


def real_run(steps, per_rank, warmup, rounds, timeout=900):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "real.json")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        script = [
            os.path.abspath(__file__),
            "--worker",
            out,
            "--steps",
            str(steps),
            "--per-rank",
            str(per_rank),
            "--warmup",
            str(warmup),
            "--rounds",
            str(rounds),
        ]
        cmd = bench_util.launch_util().launch_cmd(script, 2, os.path.join(tmp, "log"))
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0 or not os.path.exists(out):
            logs = ""
            ld = os.path.join(tmp, "log")
            for n in sorted(os.listdir(ld)) if os.path.isdir(ld) else []:
                logs += f"--- {n}\n" + open(os.path.join(ld, n), errors="replace").read()[-4000:]
            raise RuntimeError(f"2-rank run failed (rc={p.returncode}):\n{p.stdout[-2000:]}\n{logs}")
        with open(out) as f:
            return json.load(f)


def print_real(allres):
    print("\n## Real 2-rank CPU run (gloo, OMP_NUM_THREADS=1 per rank; modes interleaved)\n")
    print(
        f"{'mode':>12} | {'rank':>4} | {'compute ms/step':>15} | {'wait at all-reduce ms/step':>26} | "
        f"{'step ms':>8} | {'waiting for batch ms/step':>25}"
    )
    summary = {}
    for mode in ("none", "exchange", "prebalanced"):
        for r, res in enumerate(allres):
            d = res[mode]
            c, w, s, f = (float(np.mean(d[k]) * 1e3) for k in ("compute", "wait", "step", "fetch"))
            print(f"{mode:>12} | {r:>4} | {c:15.1f} | {w:26.1f} | {s:8.1f} | {f:25.2f}")
            summary.setdefault(mode, []).append((c, w, s))
    step = {m: float(np.mean([s for _, _, s in v])) for m, v in summary.items()}
    wait = {m: float(np.mean([w for _, w, _ in v])) for m, v in summary.items()}
    comp_max = {
        m: float(np.mean(np.max([allres[r][m]["compute"] for r in range(len(allres))], axis=0))) * 1e3 for m in summary
    }
    cpu = float(np.mean([res["exchange_thread_cpu_per_step_s"] for res in allres])) * 1e3
    fetch = {m: float(np.mean([np.mean(res[m]["fetch"]) for res in allres])) * 1e3 for m in summary}
    ovh = step["exchange"] / step["prebalanced"] - 1
    print(
        f"\nslowest rank's compute per step: none {comp_max['none']:.1f} ms, exchange "
        f"{comp_max['exchange']:.1f} ms, pre-balanced {comp_max['prebalanced']:.1f} ms"
    )
    print(
        f"mean wait at the all-reduce per rank and step: none {wait['none']:.1f} ms, exchange "
        f"{wait['exchange']:.1f} ms, pre-balanced {wait['prebalanced']:.1f} ms"
    )
    print(
        f"step time: none {step['none']:.1f} ms, exchange {step['exchange']:.1f} ms, pre-balanced "
        f"{step['prebalanced']:.1f} ms -> balancing speed-up {step['none'] / step['exchange']:.3f}x"
    )
    print(
        f"overhead of the asynchronous exchange vs pre-balanced feeding: {ovh * 100:+.2f}% of the step "
        f"(target <= 2%); exchange-thread CPU {cpu:.2f} ms/step = {cpu / step['prebalanced'] * 100:.2f}% of a step"
    )
    print(
        f"time the training loop waits for its next batch: exchange {fetch['exchange']:.2f} ms/step, "
        f"pre-balanced {fetch['prebalanced']:.2f} ms/step, none {fetch['none']:.2f} ms/step"
    )
    print(
        "(absolute and wall-clock numbers on this shared 2-core machine carry +-10% noise from other "
        "processes; the thread-CPU and batch-wait figures are the robust overhead measures)"
    )
    return {
        "step_ms": step,
        "wait_ms": wait,
        "slowest_compute_ms": comp_max,
        "exchange_overhead": ovh,
        "fetch_ms": fetch,
        "exchange_thread_cpu_ms_per_step": cpu,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-real", action="store_true")
    ap.add_argument("--batches", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--per-rank", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--worker", default=None)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, a.steps, a.per_rank, a.warmup, a.rounds)
        return
    nb = a.batches or (20 if a.quick else 200)
    steps = a.steps or (8 if a.quick else 60)
    print(
        f"planner: {'C++ core' if balance.native_available() else 'Python fallback (C++ core not built)'}; "
        f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    )
    t0 = time.time()
    rows = simulate([2, 8, 64, 512], 56, nb)
    print_sim(rows)
    pt = planner_times()
    print("\n## Planner time (best of several, ms, whole plan() call incl. Python in/out)\n")
    for k, v in pt.items():
        print(f"  {k:>36}: {v:8.2f} ms")
    print(f"\n(simulation took {time.time() - t0:.1f} s)")
    out = {
        "simulation": rows,
        "planner_ms": pt,
        "native": balance.native_available(),
        "distribution": "paddle_unpad.balance.workloads.bert_pretraining_lengths(max_len=512)",
    }
    if not a.no_real:
        rounds = a.rounds or (2 if a.quick else 6)
        allres = real_run(steps, a.per_rank, a.warmup, rounds)
        out["real_2rank"] = {
            "per_rank": allres,
            "summary": print_real(allres),
            "steps": steps,
            "samples_per_rank": a.per_rank,
        }
    path = bench_util.write_result(bench_util.kind_result_path("balance"), out)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
