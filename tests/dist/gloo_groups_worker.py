"""Creates gloo process groups back to back -- all ranks, then each pair of ranks, in
turns -- and all-reduces over each one; prints ``ALL OK`` when every sum is right, and
whether the job store's key ``"0"`` (where Paddle's gloo groups meet) still holds what the
default group wrote there.

Run under ``python -m paddle.distributed.launch --nproc_per_node 3``. Before any group is
created it installs what the plugin's distributed features install first
(``paddle_unpad.distributed.groups.install_group_stores``): every group then gets a
rendezvous store of its own (unless ``PADDLE_UNPAD_GLOO_GROUP_STORES=0``)."""

import sys

from paddle_unpad.distributed import groups

groups.install_group_stores()  # before any group is created

import paddle  # noqa: E402 - after the stores are installed, as a training script would
import paddle.distributed as dist  # noqa: E402
from paddle.base import core  # noqa: E402

n_groups = int(sys.argv[1])
dist.init_parallel_env()
rank, world = dist.get_rank(), dist.get_world_size()
job_store = core.create_or_get_global_tcp_store()
key0 = job_store.get("0")  # the default group's rank 0 address
for i in range(n_groups):
    if i % 2 == 0:
        ranks = list(range(world))
    else:
        a = (i // 2) % world
        ranks = sorted({a, (a + 1) % world})
    group = dist.new_group(ranks)
    if rank in ranks:
        x = paddle.to_tensor([float(rank + 1)])
        dist.all_reduce(x, group=group)
        want = float(sum(r + 1 for r in ranks))
        if x.item() != want:
            print(f"CHECK group {i} {ranks}: FAILED, sum {x.item()} != {want}", flush=True)
            sys.exit(1)
dist.barrier()  # every group has been created on every rank
print(f"KEY0 {'kept' if job_store.get('0') == key0 else 'overwritten'}", flush=True)
print(f"rank {rank}: {n_groups} groups created and used; ALL OK", flush=True)
