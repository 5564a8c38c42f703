"""One rank of tests/test_distributed_rules.py: which group, backend and thread every collective
of the plugin uses, recorded in a short balanced training loop with the gradient all-reduce.

``rules_worker.py gpu``: a GPU (NCCL) job as the plugin sees it -- ``groups.job_uses_gpu``
answers True, and since this machine has no NCCL a gloo group stands in for each device group
(its collectives are recorded as the NCCL ones they would be). ``rules_worker.py cpu``: the
plain CPU job. Prints one ``RESULT {json}`` with the recorded collectives and what was checked.
"""

import json
import os
import sys
import threading

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import paddle  # noqa: E402
import paddle.distributed as dist  # noqa: E402
from paddle.distributed import fleet  # noqa: E402

import paddle_unpad.fleet as pf  # noqa: E402
from paddle_unpad.distributed import groups  # noqa: E402

MODE = sys.argv[1]
RECORD = []


def record(op, group):
    RECORD.append(
        {
            "op": op,
            "purpose": group.purpose,
            "role": group.role,
            "backend": group.backend,
            "thread": threading.current_thread().name,
        }
    )


groups.RECORDER = record
if MODE == "gpu":
    groups.job_uses_gpu = lambda: True
    groups._paddle_group = lambda ranks, backend: dist.new_group(ranks, backend="gloo")  # no NCCL on a CPU

strategy = pf.DistributedStrategy()
fleet.init(is_collective=True, strategy=strategy)
rank = dist.get_rank()
paddle.seed(1)
model = paddle.nn.Sequential(paddle.nn.Embedding(50, 8), paddle.nn.Linear(8, 2))
opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())
sync = pf.GradientAllReduce(model)
rng = np.random.default_rng(rank)
batches = [
    [{"input_ids": rng.integers(1, 50, int(n)).astype(np.int64)} for n in rng.integers(2, 30, 4)] for _ in range(3)
]
for batch in pf.distributed_loader(batches):
    loss = model(batch["input_ids"]).mean()
    loss.backward()
    sync.wait()
    opt.step()
    opt.clear_grad()

threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("paddle_unpad"))
guard = None
if MODE == "gpu":  # a device collective from another thread is refused, naming the rule

    def other():
        global guard
        try:
            groups.all_reduce(sync._group, paddle.zeros([1]))
        except RuntimeError as e:
            guard = str(e)

    t = threading.Thread(target=other, name="not-the-training-thread")
    t.start()
    t.join()
sync.close()
device_ops = [(r["op"], r["purpose"]) for r in RECORD if r["role"] == "device"]
every = []
dist.all_gather_object(every, device_ops)  # Paddle's own, not recorded
print(
    "RESULT "
    + json.dumps(
        {
            "rank": rank,
            "record": RECORD,
            "threads_after_training": threads,
            "guard": guard,
            "same_device_order_on_every_rank": all(x == every[0] for x in every),
        }
    ),
    flush=True,
)
