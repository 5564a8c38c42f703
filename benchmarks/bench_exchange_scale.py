"""The sample exchange at 2, 4, 8 and 16 ranks on one host, and 2 nodes x 2 ranks: how its
start-up, per-step cost and traffic grow with the number of ranks, for the exchange as it
ships and the candidate designs, side by side in one run.

Designs (the same balanced loader; only how the samples that move travel, and which groups
exist for it, differ):

* ``allgather`` -- as shipped: one gloo group per loader; the samples that move go in one
  all-gather of each rank's outgoing bytes, padded to the largest rank's.
* ``pairs``     -- the previous design: one 2-rank gloo group (and rendezvous store) per pair
  of ranks, N(N-1)/2 of them, and ``isend``/``irecv`` posted in rank order on them.
* ``allgather:nagle`` -- as shipped, but with Paddle's store connections as Paddle opens them
  (the ``STORE_NODELAY`` setting off): every store request can wait ~40 ms for a delayed ACK.
* ``roundrobin`` -- point-to-point on the loader's one group: a round-robin schedule (the
  circle method) in which every rank exchanges with one partner per round, N-1 rounds, a
  message every round even when nothing moves, so that gloo's per-group message counters stay
  matched. Even N only: with odd N one rank sits out each round and the counters drift.

Per run (one fleetrun job; 12 steps of 8 samples per rank, BERT pre-training lengths up to
512, ``input_ids`` / ``token_type_ids`` / a label per sample): process groups the plugin made
per rank, ``fleet.init`` time, time from ``fleet.init`` returning to the first balanced batch
(the slowest rank), the median time per balanced batch against the same loader with
``balance=False`` (pack only), bytes of the samples that moved per step and bytes each rank
received per step. Ranks beyond the cores share them (16 ranks on a 2-core host): times grow
with oversubscription too; the group counts and bytes do not.

Usage::

    python benchmarks/bench_exchange_scale.py                 # ~6 minutes on 2 cores
    python benchmarks/bench_exchange_scale.py --worlds 2,4 --designs allgather
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import bench_args
import bench_util
import scale_inputs

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STEPS, PER_RANK = 12, 8


def parse_args(argv=None):
    options = [
        ("--worlds", str, "2,4,8,16", "ranks per run on this host"),
        ("--designs", str, "allgather,allgather:nagle,pairs,roundrobin", "designs to run"),
        ("--nodes", int, 2, "also run the shipped design as NODES launchers x 2 ranks on this host (0: skip)"),
        ("--timeout", float, 300.0, "seconds one run may take"),
        ("--quick", bool, False, "fewer repetitions of the model's input measurements (a smoke run)"),
        ("--out", str, None, "JSON (default benchmarks/results/exchange_scale_<kind>.json)"),
        ("--worker", bool, False, argparse.SUPPRESS),
        ("--design", str, "allgather", argparse.SUPPRESS),
        ("--result", str, None, argparse.SUPPRESS),
    ]
    ap = bench_args.add_options(bench_args.parser(__doc__, first_line=True, show_defaults=True), options)
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------- the candidate transports


def pairs_transport(pair_groups):
    """The previous design: isend/irecv posted in rank order, each pair of ranks on a group of its own."""
    import numpy as np
    import paddle
    import paddle.distributed as dist

    from paddle_unpad.distributed import wire

    def transfer(all_gather, samples, lengths, my_dest, W, me, schema):
        tasks, keep, got = [], [], {}
        for peer in range(W.shape[0]):
            if peer == me:
                continue
            g = pair_groups[(min(me, peer), max(me, peer))]
            for op in ("send", "recv") if me < peer else ("recv", "send"):
                if op == "send" and W[me, peer]:
                    sel = np.nonzero(my_dest == peer)[0]
                    t = paddle.to_tensor(wire.encode([samples[k] for k in sel], lengths[sel], schema))
                    keep.append(t)
                    tasks.append(dist.isend(t, peer, group=g))
                elif op == "recv" and W[peer, me]:
                    t = paddle.to_tensor(np.empty(int(W[peer, me]), np.int64))
                    got[peer] = t
                    tasks.append(dist.irecv(t, peer, group=g))
        for task in tasks:
            task.wait()
        got = {p: t.numpy() for p, t in got.items()}
        return got, sum(v.size for v in got.values())

    return transfer


def circle_rounds(n):
    """Round-robin rounds of the circle method for an even ``n``: each a list of (a, b) pairs."""
    ranks, rounds = list(range(n)), []
    for _ in range(n - 1):
        rounds.append([(min(ranks[i], ranks[n - 1 - i]), max(ranks[i], ranks[n - 1 - i])) for i in range(n // 2)])
        ranks = [ranks[0], ranks[-1]] + ranks[1:-1]
    return rounds


def roundrobin_transport(group):
    """Point-to-point on the loader's one group, every rank sending and receiving every round."""
    import numpy as np
    import paddle
    import paddle.distributed as dist

    from paddle_unpad.distributed import wire

    rounds = circle_rounds(group.nranks)

    def transfer(all_gather, samples, lengths, my_dest, W, me, schema):
        got, received = {}, 0
        for pairs in rounds:
            peer = next(b if a == me else a for a, b in pairs if me in (a, b))
            sel = np.nonzero(my_dest == peer)[0]
            out = wire.encode([samples[k] for k in sel], lengths[sel], schema) if W[me, peer] else np.zeros(1, np.int64)
            buf = paddle.to_tensor(np.empty(max(int(W[peer, me]), 1), np.int64))
            for op in ("send", "recv") if me < peer else ("recv", "send"):
                if op == "send":
                    dist.send(paddle.to_tensor(out), peer, group=group.pg)
                else:
                    dist.recv(buf, peer, group=group.pg)
            received += int(buf.shape[0])
            if W[peer, me]:
                got[peer] = buf.numpy()
        return got, received

    return transfer


# ----------------------------------------------------------------------------- one rank


def worker(args):
    import numpy as np
    import paddle.distributed as dist
    from paddle.distributed import fleet

    import paddle_unpad.fleet as pf
    from paddle_unpad.balance import bert_pretraining_lengths
    from paddle_unpad.distributed import exchange, groups

    strategy = pf.DistributedStrategy()
    strategy.unpad_configs = {"timeout": 600.0}
    t0 = time.perf_counter()
    fleet.init(is_collective=True, strategy=strategy)
    t_init = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    lengths = bert_pretraining_lengths(STEPS * PER_RANK, 512, seed=rank)
    batches = [
        [
            {
                "input_ids": np.full(int(s), 5, np.int64),
                "token_type_ids": np.zeros(int(s), np.int64),
                "labels": np.int64(k % 2),
            }
            for k, s in enumerate(lengths[i * PER_RANK : (i + 1) * PER_RANK])
        ]
        for i in range(STEPS)
    ]
    loader = pf.distributed_loader(batches)
    extra_groups = extra_creations = 0
    if args.design.startswith("pairs"):
        pair_groups = {
            (a, b): dist.new_group([a, b], backend="gloo") for a in range(world) for b in range(a + 1, world)
        }
        extra_groups = world - 1  # this rank's pair groups: it is a member of N - 1 of them ...
        extra_creations = len(pair_groups)  # ... and takes part in creating all N(N-1)/2
        exchange.transfer = pairs_transport(pair_groups)
    elif args.design.startswith("roundrobin"):
        exchange.transfer = roundrobin_transport(loader.group)
    it = iter(loader)
    next(it)
    t_first = time.perf_counter()
    wall_init, wall_first = time.time() - (t_first - t_init), time.time()  # one host: a clock every rank shares
    step_s = _step_times(it)
    stats = dict(loader.stats)
    local_s = _step_times(iter(pf.distributed_loader(batches, balance=False)))
    firsts, walls = [], []
    dist.all_gather_object(firsts, t_first - t_init)
    dist.all_gather_object(walls, (wall_init, wall_first))
    if rank == 0:
        res = {
            "design": args.design,
            "world": world,
            "nnodes": int(os.environ.get("PADDLE_NNODES", "1")),
            "groups_per_rank": len(groups.CREATED) + extra_groups,
            "group_creations_per_rank": len(groups.CREATED) + extra_creations,
            "fleet_init_s": t_init - t0,
            "first_batch_s": max(firsts),
            # from the moment every rank had left fleet.init (Paddle's ranks leave it seconds apart
            # when they share few cores) to the last rank's first batch
            "first_batch_after_all_s": max(w[1] for w in walls) - max(w[0] for w in walls),
            "step_ms": 1e3 * statistics.median(step_s),
            "local_step_ms": 1e3 * statistics.median(local_s),
            "steps": stats["steps"],
            "moved_bytes_per_step": stats["moved_bytes"] / max(stats["steps"], 1),
            "received_bytes_per_step": stats["wire_bytes"] / max(stats["steps"], 1),
        }
        with open(args.result, "w") as f:
            json.dump(res, f)


def _step_times(it):
    out, t = [], time.perf_counter()
    for _ in it:
        now = time.perf_counter()
        out.append(now - t)
        t = now
    return out


# ----------------------------------------------------------------------------- the runs


def run(design, world, nodes, timeout):
    """One job (``nodes`` launchers of ``world // nodes`` ranks); rank 0's result, or why not."""
    from launch_util import LAUNCHER, free_port, kill_tree, launch_cmd  # tests/launch_util.py: bounded launches

    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        tail = [__file__, "--worker", "--design", design, "--result", result]
        if nodes == 1:
            cmds = [launch_cmd(tail, world, os.path.join(tmp, "log"))]
        else:
            master = f"127.0.0.1:{free_port()}"
            cmds = [
                LAUNCHER
                + [
                    "--master",
                    master,
                    "--nnodes",
                    str(nodes),
                    "--rank",
                    str(r),
                    "--nproc_per_node",
                    str(world // nodes),
                    "--log_dir",
                    os.path.join(tmp, f"log{r}"),
                ]
                + tail
                for r in range(nodes)
            ]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env[bench_util.config.variable("STORE_NODELAY").env] = "0" if design.endswith(":nagle") else "1"
        env.pop("PADDLE_TRAINER_ENDPOINTS", None)
        procs = [
            subprocess.Popen(
                c, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
            )
            for c in cmds
        ]
        t0 = time.monotonic()
        for p in procs:
            try:
                p.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                for q in procs:
                    kill_tree(q.pid)
                return {"design": design, "world": world, "nnodes": nodes, "error": f"timed out after {timeout:g} s"}
        if not os.path.exists(result):
            return {
                "design": design,
                "world": world,
                "nnodes": nodes,
                "error": f"launcher exit codes {[p.returncode for p in procs]}",
            }
        with open(result) as f:
            return json.load(f)


GLOO_ADDRESS_BYTES = 136  # one pair's address in gloo's rendezvous blob (measured: 272 B at 3 ranks, 544 at 5)


def at_scale(rows, inputs, samples_per_rank=32, worlds=(64, 256, 1024)):
    """Per rank and step, and at start-up, at ``worlds`` ranks: a model whose inputs are this
    run's measurements (``inputs``: see scale_inputs.py; ``rows``: the shipped design's runs).

    * Bytes: moved bytes per sample slot (``m``, mean of the runs) and the all-gather's
      padding, received over moved bytes fitted as ``a + b ln N`` (the largest rank's outgoing
      share grows slowly with N); headers (``HDR`` words per rank) and lengths (16 bytes per
      sample) are exact.
    * Messages: an all-gather on gloo is a ring, N - 1 sent and N - 1 received per rank; three
      per step (header, lengths, samples).
    * One step of the exchange (in its background thread): the measured 2-rank step, plus
      what N ranks add: 3 (N - 2) more hops, the extra received bytes at the measured
      bandwidth, and the planner's time at N x ``samples_per_rank``.
    * Creating one gloo group: gloo connects every pair through the group's store -- per peer
      a wait and a get of the peer's blob of N - 1 addresses, then a TCP connect. The slowest
      rank finishes no sooner than its own N - 1 round trips and downloads, nor than the store
      server can serve everyone's: 2 N (N - 1) requests and N (N - 1) blobs.
    * Start-up: the measured 2-rank time from ``fleet.init`` to the first balanced batch, plus
      what the group and the first step add between 2 and N ranks; the agreement of the
      settings is O(1) store requests per rank."""
    pts = [
        r
        for r in rows
        if r.get("design") == "allgather"
        and r.get("nnodes") == 1
        and "error" not in r
        and r["moved_bytes_per_step"] > 0
    ]
    two = [r for r in pts if r["world"] == 2]
    if len(pts) < 2 or not two:
        return None
    model = _ScaleModel(pts, two, inputs)
    i = inputs
    base = two[0]["first_batch_after_all_s"] - model.group_s(2, i["store_request_s"]) - model.step_s(2, PER_RANK, 0.0)
    out = [_scale_row(model, n, samples_per_rank, base) for n in worlds]
    return {
        "moved_bytes_per_sample_slot": model.m,
        "padding_fit": [model.a, model.b],
        "inputs": inputs,
        "base_2_ranks_s": base,
        "rows": out,
    }


class _ScaleModel:
    """The terms of :func:`at_scale`, fitted to this run's rows and measured inputs."""

    def __init__(self, pts, two, inputs):
        import math

        import numpy as np

        self.m = float(np.mean([r["moved_bytes_per_step"] / (r["world"] * PER_RANK) for r in pts]))
        ln_n = np.array([math.log(r["world"]) for r in pts])
        ratio = np.array([r["received_bytes_per_step"] / r["moved_bytes_per_step"] for r in pts])
        self.b, self.a = np.polyfit(ln_n, ratio, 1)
        self.i = inputs
        self.bw, self.hop = inputs["bytes_per_s"], inputs["hop_s"]
        self.base_step = two[0]["step_ms"] / 1e3 - (3 * self.hop + self.received(2, PER_RANK) / self.bw)

    def received(self, n, per_rank):
        import math

        return (self.a + self.b * math.log(n)) * n * per_rank * self.m

    def step_s(self, n, per_rank, planner_s):
        return self.base_step + 3 * (n - 1) * self.hop + self.received(n, per_rank) / self.bw + planner_s

    def group_s(self, n, request_s):
        i, bw = self.i, self.bw
        blob = GLOO_ADDRESS_BYTES * (n - 1)
        own = (n - 1) * (2 * request_s + i["connect_s"] + 2 * self.hop) + (n - 1) * blob / bw
        server = 2 * n * (n - 1) * i["store_server_s"] + n * (n - 1) * blob / bw
        return max(own, server)


def _scale_row(model, n, samples_per_rank, base):
    import math

    from paddle_unpad.distributed.wire import HDR

    i = model.i
    planner = i["planner_s"][str(n)]
    return {
        "ranks": n,
        "samples_per_rank": samples_per_rank,
        "groups_per_rank": 1,
        "messages_per_rank": 6 * (n - 1),
        "header_bytes": n * HDR * 8,
        "length_bytes": n * samples_per_rank * 16,
        "moved_bytes_total": n * samples_per_rank * model.m,
        "padding_ratio": model.a + model.b * math.log(n),
        "received_bytes": model.received(n, samples_per_rank),
        "planner_s": planner,
        "step_s": model.step_s(n, samples_per_rank, planner),
        "group_s": model.group_s(n, i["store_request_s"]),
        "group_nagle_s": model.group_s(n, i["store_request_nagle_s"]),
        "rendezvous_bytes_per_rank": (n - 1) * GLOO_ADDRESS_BYTES * (n - 1),
        "startup_s": base + model.group_s(n, i["store_request_s"]) + model.step_s(n, samples_per_rank, planner),
    }


def table(rows):
    head = (
        "design",
        "ranks",
        "nodes",
        "groups/rank",
        "group creations/rank",
        "fleet.init s",
        "1st batch s",
        "1st batch after all s",
        "ms/step",
        "pack-only ms",
        "moved KB/step",
        "received KB/rank/step",
    )
    print(" | ".join(head))
    for r in rows:
        if "error" in r:
            print(f"{r['design']} | {r['world']} | {r['nnodes']} | {r['error']}")
            continue
        print(
            " | ".join(
                [
                    r["design"],
                    str(r["world"]),
                    str(r["nnodes"]),
                    str(r["groups_per_rank"]),
                    str(r["group_creations_per_rank"]),
                    f"{r['fleet_init_s']:.1f}",
                    f"{r['first_batch_s']:.2f}",
                    f"{r['first_batch_after_all_s']:.2f}",
                    f"{r['step_ms']:.1f}",
                    f"{r['local_step_ms']:.1f}",
                    f"{r['moved_bytes_per_step'] / 1e3:.0f}",
                    f"{r['received_bytes_per_step'] / 1e3:.0f}",
                ]
            ),
            flush=True,
        )


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    rows = []
    for world in worlds:
        for design in [d.strip() for d in args.designs.split(",") if d.strip()]:
            if design == "roundrobin" and world % 2:
                rows.append(
                    {
                        "design": design,
                        "world": world,
                        "nnodes": 1,
                        "error": "odd number of ranks: one rank sits out each round and gloo's message counters drift",
                    }
                )
                continue
            rows.append(run(design, world, 1, args.timeout))
            table(rows[-1:])
    if args.nodes:
        rows.append(run("allgather", 2 * args.nodes, args.nodes, args.timeout))
        table(rows[-1:])
    print()
    table(rows)
    print("\nmeasuring the model's inputs on this host ...", flush=True)
    inputs = scale_inputs.measure((64, 256, 1024), quick=args.quick)
    print("  " + ", ".join(f"{k} {v:.3g}" for k, v in inputs.items() if isinstance(v, float)))
    model = at_scale(rows, inputs)
    if model:
        print("\nat scale (model from the runs above):")
        for r in model["rows"]:
            print(
                f"  {r['ranks']} ranks x {r['samples_per_rank']} samples: {r['messages_per_rank']} messages, "
                f"headers {r['header_bytes'] / 1e6:.2f} MB + lengths {r['length_bytes'] / 1e6:.2f} MB + samples "
                f"{r['received_bytes'] / 1e6:.1f} MB received per rank and step; step {1e3 * r['step_s']:.0f} ms "
                f"(planner {1e3 * r['planner_s']:.1f} ms); one gloo group {r['group_s']:.1f} s "
                f"(store as Paddle opens it: {r['group_nagle_s']:.0f} s); first batch {r['startup_s']:.1f} s"
            )
    out = args.out or bench_util.kind_result_path("exchange_scale")
    bench_util.write_result(
        out,
        {
            "date": bench_util.utc_now(),
            "steps": STEPS,
            "samples_per_rank": PER_RANK,
            "max_len": 512,
            "runs": rows,
            "at_scale": model,
        },
    )
    print("wrote", out)


if __name__ == "__main__":
    main()
