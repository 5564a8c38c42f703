"""What the fault workers share: a ``RESULT {json}`` line per outcome (the test reads them from
the rank's output) and ``fleet.init`` with the plugin's strategy."""

import json
import time

T0 = time.monotonic()


def result(**kw):
    kw.setdefault("t", round(time.monotonic() - T0, 3))
    print("RESULT " + json.dumps(kw), flush=True)


def init(defaults, configs):
    """``fleet.init`` with the balancing strategy, ``configs`` over ``defaults``; (rank, world)."""
    import paddle.distributed as dist
    from paddle.distributed import fleet

    import paddle_unpad.fleet as pf

    strategy = pf.DistributedStrategy()
    strategy.unpad = True
    strategy.unpad_configs = dict(defaults, **configs)
    fleet.init(is_collective=True, strategy=strategy)
    return dist.get_rank(), dist.get_world_size()
