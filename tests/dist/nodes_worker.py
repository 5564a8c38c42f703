"""One rank of tests/test_distributed_nodes.py: a short balanced fine-tuning with the gradient
all-reduce, the same on every launch topology (one node of 4 ranks, or 2 nodes of 2). Prints
``RESULT {json}`` with the global rank, its per-step losses and a checksum of the parameters."""

import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import paddle  # noqa: E402
import paddle.distributed as dist  # noqa: E402
from paddle.distributed import fleet  # noqa: E402

import paddle_unpad.fleet as pf  # noqa: E402

strategy = pf.DistributedStrategy()
strategy.unpad_configs = {"timeout": 60.0, "check_plan": True}
fleet.init(is_collective=True, strategy=strategy)
rank, world = dist.get_rank(), dist.get_world_size()
paddle.seed(3)
model = paddle.nn.Sequential(paddle.nn.Embedding(60, 8), paddle.nn.Linear(8, 3))
opt = paddle.optimizer.SGD(0.5, parameters=model.parameters())
sync = pf.GradientAllReduce(model)
rng = np.random.default_rng(rank)
batches = [
    [{"input_ids": rng.integers(1, 60, int(n)).astype(np.int64)} for n in rng.integers(2, 40 if rank == 0 else 12, 3)]
    for _ in range(4)
]
losses = []
for batch in pf.distributed_loader(batches):
    loss = model(batch["input_ids"]).square().mean()
    loss.backward()
    sync.wait()
    opt.step()
    opt.clear_grad()
    losses.append(float(loss))
sync.close()
checksum = float(sum(float(p.abs().sum()) for p in model.parameters()))
print(
    "RESULT "
    + json.dumps(
        {
            "rank": rank,
            "world": world,
            "nnodes": int(os.environ.get("PADDLE_NNODES", "1")),
            "losses": losses,
            "checksum": checksum,
        }
    ),
    flush=True,
)
