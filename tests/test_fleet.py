"""Fleet hook, single process: strategy fields and the pass-through loader."""

import copy
import re

import numpy as np
import pytest
from paddle.distributed import fleet

import paddle_unpad.fleet as pf
from paddle_unpad.data import PackingCollator, SampleError

pytestmark = pytest.mark.paddle_gpu_stage


def test_strategy_fields_merge_and_validate():
    s = pf.DistributedStrategy()
    assert isinstance(s, fleet.DistributedStrategy)
    assert s.unpad is True and s.unpad_configs == pf.DEFAULT_UNPAD_CONFIGS  # one table of defaults
    s.unpad = False  # the fleet-style spelling of unpad_configs["balance"]: one value
    assert s.unpad_configs["balance"] is False
    s.unpad_configs = {"balance": True}
    assert s.unpad is True
    s.unpad_configs = {"prefetch": 3, "cost": "tokens"}
    s.unpad_configs = {"timeout": 5.0}  # merges, like hybrid_configs
    assert s.unpad_configs["prefetch"] == 3 and s.unpad_configs["cost"] == "tokens"
    assert s.unpad_configs["timeout"] == 5.0
    with pytest.raises(
        ValueError,
        match=r"^paddle_unpad\.fleet\.DistributedStrategy: unpad_configs: unknown keys "
        r"\['prefetc'\]",
    ):
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
    batches = [
        [
            {"input_ids": rng.integers(1, 9, size=int(n)), "sample_id": 10 * t + k}
            for k, n in enumerate(rng.integers(1, 20, size=4))
        ]
        for t in range(3)
    ]
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
    with pytest.raises(ValueError, match=r"distributed_loader: unknown keys \['prefech'\]"):
        pf.distributed_loader(batches, strategy=s, prefech=2)
    # plain fleet strategy / no strategy: pass-through too, overrides apply
    dl = pf.distributed_loader(batches, strategy=fleet.DistributedStrategy(), max_seqlen=4)
    with pytest.raises(Exception, match="more than max_seqlen=4"):
        list(dl)


@pytest.mark.parametrize(
    "key,bad,error",
    [
        ("timeout", float("nan"), ValueError),
        ("timeout", float("inf"), ValueError),
        ("timeout", 0, ValueError),
        ("close_timeout", -1.0, ValueError),
        ("prefetch", True, TypeError),
        ("prefetch", 0, ValueError),
        ("max_seqlen", 0, ValueError),
        ("max_seqlen", 2.5, TypeError),
        ("tol", float("nan"), ValueError),
    ],
)
def test_bad_settings_name_the_key_and_value(key, bad, error):
    s = pf.DistributedStrategy()
    with pytest.raises(error, match=rf"unpad_configs\['{key}'\].*{re.escape(repr(bad))}"):
        s.unpad_configs = {key: bad}
    with pytest.raises(error, match=rf"{key}.*{re.escape(repr(bad))}"):
        pf.distributed_loader([], strategy=s, **{key: bad})


def test_single_process_loader_checks_every_sample():
    batch = [
        {"input_ids": np.ones(4, np.int64), "extra": np.int64(0)},
        {"input_ids": np.ones(2, np.int64), "extra": np.full(3, -5)},
    ]
    with pytest.raises(SampleError, match=r"sample 1 \(id 1\) on rank 0: field 'extra'.*shape \[3\].*shape \[\]"):
        list(pf.distributed_loader([batch]))


@pytest.mark.parametrize(
    "kw,error,pattern",
    [
        ({"timeout": float("nan")}, ValueError, r"BalancedLoader: timeout must be a finite number.*nan"),
        ({"close_timeout": float("inf")}, ValueError, r"BalancedLoader: close_timeout .*inf"),
        ({"prefetch": 1.5}, TypeError, r"BalancedLoader: prefetch must be an int >= 1.*1\.5"),
        ({"max_seqlen": 0}, ValueError, r"BalancedLoader: max_seqlen must be a positive int or None.*0"),
    ],
)
def test_balanced_loader_checks_its_arguments(kw, error, pattern):
    from paddle_unpad.distributed import BalancedLoader

    with pytest.raises(error, match=r"^paddle_unpad\.distributed\." + pattern):
        BalancedLoader([], **kw)


@pytest.mark.parametrize("alias", ["quadratic", "flops", "tokens", "token"])
def test_cost_names_are_the_same_everywhere(alias):
    from paddle_unpad.balance import as_cost_fn
    from paddle_unpad.distributed import BalancedLoader

    s = pf.DistributedStrategy()
    s.unpad_configs = {"cost": alias}
    assert pf.distributed_loader([], strategy=s).cost == alias
    assert BalancedLoader([], cost=alias).cost == alias
    assert as_cost_fn(alias)(np.array([3])).shape == (1,)
    for where in (
        lambda: setattr(s, "unpad_configs", {"cost": "flop"}),
        lambda: pf.distributed_loader([], cost="flop"),
        lambda: BalancedLoader([], cost="flop"),
    ):
        with pytest.raises(ValueError, match=r"unknown cost 'flop'; use one of \['default', 'flops'"):
            where()


def test_options_are_checked_once_where_the_user_gives_them(monkeypatch):
    from paddle_unpad.distributed import BalancedLoader, options

    seen, real = [], options._check
    monkeypatch.setattr(
        options, "_check", lambda k, v, where, arg: (seen.append((k, where)), real(k, v, where, arg))[1]
    )
    s = pf.DistributedStrategy()
    s.unpad_configs = {"tol": 0.25, "counts": (0, 0)}
    assert seen == [("tol", "fleet.DistributedStrategy"), ("counts", "fleet.DistributedStrategy")]
    seen.clear()
    bl = pf.distributed_loader([], strategy=s, prefetch=3)
    assert seen == [("prefetch", "fleet.distributed_loader")]  # the strategy's values are not checked again
    assert (bl.tol, bl.prefetch, bl.counts) == (0.25, 3, [0, 0])  # counts: normalised where checked
    cfg = s.unpad_configs
    cfg["counts"].append(-1)  # a copy: the strategy's resolved values cannot be changed unchecked
    assert s.unpad_configs["counts"] == [0, 0]
    # the loader holds them as one read-only value that names where they were given
    assert bl.options.where == bl.where == "fleet.distributed_loader"
    bl.options["counts"].append(-1)
    assert bl.options["counts"] == [0, 0]
    with pytest.raises(TypeError, match="does not support item assignment"):
        bl.options["tol"] = 0.1
    with pytest.raises(AttributeError):
        bl.options.where = "distributed.BalancedLoader"
    seen.clear()
    again = BalancedLoader.from_options([], bl.options)
    assert seen == [] and again.options is bl.options and (again.tol, again.where) == (0.25, "fleet.distributed_loader")
    with pytest.raises(
        TypeError,
        match=r"^paddle_unpad\.distributed\.BalancedLoader\.from_options: options must be "
        r"the exchange's options as .*resolve\(\) returns them, got \{'tol': 0\.1\}",
    ):
        BalancedLoader.from_options([], {"tol": 0.1})


def test_one_switch_name_for_the_exchange():
    s = pf.DistributedStrategy()
    assert pf.distributed_loader([], strategy=s, balance=False).options["balance"] is False
    with pytest.raises(ValueError, match=r"unknown keys \['enabled'\]"):
        pf.distributed_loader([], strategy=s, enabled=False)
    with pytest.raises(
        TypeError,
        match=r"^paddle_unpad\.fleet\.distributed_loader: balance must be True or False, "
        r"got 'no'",
    ):
        pf.distributed_loader([], balance="no")


def test_a_timeout_beyond_what_threads_can_wait_is_refused_where_given():
    import threading

    too_long = threading.TIMEOUT_MAX * 2
    with pytest.raises(ValueError, match=r"unpad_configs\['timeout'\].*at most threading.TIMEOUT_MAX"):
        pf.DistributedStrategy().unpad_configs = {"timeout": too_long}
    with pytest.raises(ValueError, match=r"distributed_loader: close_timeout .*at most threading.TIMEOUT_MAX"):
        pf.distributed_loader([], close_timeout=too_long)


@pytest.mark.parametrize("fields", ["input_ids", ("input_ids", 3), b"input_ids"])
def test_token_fields_must_be_names(fields):
    from paddle_unpad.distributed import BalancedLoader

    with pytest.raises(
        TypeError, match=r"token_fields must be a sequence of field names.*got " + re.escape(repr(fields))
    ):
        BalancedLoader([], token_fields=fields)


def test_each_user_takes_its_own_rows_of_the_options_table():
    from paddle_unpad.distributed import BalancedLoader, options

    exchange_only = [k for k, o in options.OPTIONS.items() if o.scopes == (options.EXCHANGE,)]
    allreduce_only = [k for k, o in options.OPTIONS.items() if o.scopes == (options.ALLREDUCE,)]
    assert exchange_only and allreduce_only
    for key in allreduce_only:  # an all-reduce option given to the loader is an unknown key there
        with pytest.raises(ValueError, match=rf"BalancedLoader: unknown keys \['{key}'\]"):
            BalancedLoader([], **{key: options.OPTIONS[key].default})
    with pytest.raises(ValueError, match=r"GradientAllReduce: unknown keys \['prefetch'\]"):
        options.resolve({"prefetch": 2}, "distributed.GradientAllReduce", scope=options.ALLREDUCE)
    assert set(pf.DEFAULT_UNPAD_CONFIGS) == set(options.DEFAULTS)


def test_a_changed_default_reaches_the_strategies_made_after_and_a_bad_one_is_named(monkeypatch):
    before = pf.DistributedStrategy()
    monkeypatch.setitem(pf.DEFAULT_UNPAD_CONFIGS, "prefetch", 5)
    assert pf.DistributedStrategy().unpad_configs["prefetch"] == 5
    from paddle_unpad.distributed import options

    assert before.unpad_configs["prefetch"] == options.DEFAULTS["prefetch"] != 5  # made before the change
    monkeypatch.setitem(pf.DEFAULT_UNPAD_CONFIGS, "prefetch", -1)
    with pytest.raises(ValueError, match=r"^paddle_unpad\.fleet\.DistributedStrategy: DEFAULT_UNPAD_CONFIGS.*prefetch"):
        pf.DistributedStrategy().unpad


def test_the_docs_table_is_the_declared_options_table():
    import os

    from paddle_unpad.distributed import options

    with open(os.path.join(os.path.dirname(__file__), os.pardir, "docs", "api.md")) as f:
        assert options.markdown_table() in f.read(), "docs/api.md: regenerate with distributed.options.markdown_table()"


def test_exchange_names_reached_through_balance_are_the_distributed_ones_with_a_warning():
    import paddle_unpad.distributed as pd
    from paddle_unpad import balance
    from paddle_unpad._runtime import warn as _warn

    _warn.forget()
    for name in ("BalancedLoader", "ExchangeError", "ExchangeTimeout"):
        with pytest.warns(DeprecationWarning, match=f"paddle_unpad.distributed.{name}"):
            assert getattr(balance, name) is getattr(pd, name)
    with pytest.raises(AttributeError, match="no attribute 'Balanced'"):
        balance.Balanced
