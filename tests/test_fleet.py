"""Fleet hook, single process: strategy fields and the pass-through loader."""
import copy

import numpy as np
import pytest
from paddle.distributed import fleet

import paddle_unpad.fleet as pf
from paddle_unpad.data import PackingCollator


def test_strategy_fields_merge_and_validate():
    s = pf.DistributedStrategy()
    assert isinstance(s, fleet.DistributedStrategy)
    assert s.unpad is False and s.unpad_configs == pf.DEFAULT_UNPAD_CONFIGS
    s.unpad = True
    s.unpad_configs = {"prefetch": 3, "cost": "tokens"}
    s.unpad_configs = {"timeout": 5.0}  # merges, like hybrid_configs
    assert s.unpad_configs["prefetch"] == 3 and s.unpad_configs["cost"] == "tokens"
    assert s.unpad_configs["timeout"] == 5.0
    with pytest.raises(ValueError, match="unknown unpad_configs keys"):
        s.unpad_configs = {"prefetc": 3}
    with pytest.raises(ValueError):
        s.unpad_configs = {"prefetch": 0}
    with pytest.raises(TypeError):
        s.unpad = "yes"
    with pytest.raises(TypeError):  # the base class still rejects unknown attributes
        s.not_a_field = 1
    c = copy.deepcopy(s)  # what fleet.init does
    assert isinstance(c, pf.DistributedStrategy) and c.unpad and c.unpad_configs == s.unpad_configs
    c.unpad = False
    assert s.unpad  # independent copies
    s.hybrid_configs = {"dp_degree": 1}  # base fields still work
    assert "unpad" in str(s)


def test_single_process_loader_is_a_pass_through():
    s = pf.DistributedStrategy()
    s.unpad = True
    rng = np.random.default_rng(0)
    batches = [[{"input_ids": rng.integers(1, 9, size=int(n)), "sample_id": 10 * t + k}
                for k, n in enumerate(rng.integers(1, 20, size=4))] for t in range(3)]
    dl = pf.distributed_loader(batches, strategy=s)
    assert not dl.distributed  # one process: no exchange, no thread
    got = list(dl)
    ref = [PackingCollator()(b) for b in batches]
    assert len(got) == 3 and len(dl) == 3
    for g, r in zip(got, ref):
        assert g["sample_ids"].tolist() == r["sample_ids"].tolist()
        np.testing.assert_array_equal(g["input_ids"].numpy(), r["input_ids"].numpy())
        np.testing.assert_array_equal(g["cu_seqlens_host"], r["cu_seqlens_host"])
        assert g["max_seqlen"] == r["max_seqlen"]
    with pytest.raises(ValueError, match="unknown settings"):
        pf.distributed_loader(batches, strategy=s, prefech=2)
    # plain fleet strategy / no strategy: pass-through too, overrides apply
    dl = pf.distributed_loader(batches, strategy=fleet.DistributedStrategy(), max_seqlen=4)
    with pytest.raises(Exception, match="more than max_seqlen=4"):
        list(dl)
