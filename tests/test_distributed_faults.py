"""The failure promise of docs/distributed.md on 3 CPU ranks: every fault of the exchange or the
gradient all-reduce ends in a named Python error on every rank within the timeout (or the job
completes, where the case is not an error), no rank is left running, and no rank aborts on its
way out (no signal, no "terminate called"). Every rank is started directly
(tests/rank_runner.py), so each one's own exit code and exit time are checked; each run is
bounded. Scenarios: tests/dist/ranks_worker.py.
"""
import os
import signal

import pytest

from paddle_unpad.distributed.groups import AGREE_MIN_S, GLOO_OWN_TIMEOUT_S
from rank_runner import assert_no_abort, one_failure, run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "dist", "ranks_worker.py")
WORLD = 3

pytestmark = pytest.mark.dist


def run(scenario, **kw):
    return run_ranks(WORKER, [scenario], WORLD, **kw)


def assert_named_error_everywhere(ranks, exc, *texts, within=None):
    assert_no_abort(ranks)
    for rk in ranks:
        assert rk.rc == 1, rk  # an uncaught Python exception
        got = one_failure(rk)
        assert got["exc"] in (exc if isinstance(exc, tuple) else (exc,)), rk
        assert all(t in got["msg"] for t in texts), (texts, rk)
        if within is not None:
            assert got["after"] < within, rk


# ------------------------------------------------------------------ peers that die, stall or run short


def test_killed_peer_gives_a_named_error_on_every_survivor():
    ranks = run("peer_killed")
    assert ranks[2].rc == -signal.SIGKILL, ranks[2]
    assert_named_error_everywhere(ranks[:2], "ExchangeError", "exchange on rank", within=5.0)


def test_stopped_peer_gives_a_timeout_on_every_survivor_and_they_exit():
    ranks = run("peer_stopped", kill_after_exit_of=[0, 1])
    assert_named_error_everywhere(ranks[:2], "ExchangeTimeout", "no balanced batch within 5 s", within=8.0)
    for rk in ranks[:2]:  # at exit each waits until its thread has left the collective (gloo fails it)
        assert rk.exit_s < GLOO_OWN_TIMEOUT_S + 25, rk
    assert ranks[2].rc == -signal.SIGKILL, ranks[2]  # killed by the test once the others had exited


def test_ranks_with_fewer_or_no_batches_finish_and_nothing_is_lost():
    ranks = run("fewer_or_no_batches")  # 4, 1 and 0 batches
    assert_no_abort(ranks)
    for rk in ranks:
        assert rk.rc == 0 and rk.results[-1]["complete"], rk


# ------------------------------------------------------------------ the gradient all-reduce


def test_models_that_differ_are_refused_on_every_rank():
    ranks = run("models_differ")
    assert_named_error_everywhere(ranks, "GradientSyncError", "rank 0 has 4 trainable parameters, rank 2 6",
                                  within=10.0)


def test_a_second_all_reduce_on_one_model_is_refused_until_close():
    ranks = run("allreduce_twice")
    assert_no_abort(ranks)
    for rk in ranks:
        assert rk.rc == 0, rk
        second = [r for r in rk.results if "second" in r]
        assert second and second[0]["second"] == "refused" and "close()" in second[0]["msg"], rk
        assert [r["dense_mean"] for r in rk.results if "dense_mean" in r] == [True], rk


def test_all_reduce_timeout_is_a_named_error_and_no_abort():
    """wait() gives up while the communication thread is inside gloo: the next wait() refuses,
    and at exit the thread is joined before the interpreter finalizes (a thread left in native
    code aborts the process). Every peer is alive, so each thread finishes the pass it holds and
    no rank waits for gloo's own timeout on its way out."""
    ranks = run("allreduce_timeout")
    assert_named_error_everywhere(ranks, "GradientSyncError", "an earlier wait() failed",
                                  "did not finish within 0.0001 s", "close()", within=3.0)
    for rk in ranks:
        (first,) = [r["first"] for r in rk.results if "first" in r]
        assert "did not finish within 0.0001 s" in first, rk
        assert rk.exit_s < GLOO_OWN_TIMEOUT_S, rk


def test_a_stopped_peer_in_the_all_reduce_is_a_named_error_and_the_others_exit():
    ranks = run("allreduce_peer_stopped", kill_after_exit_of=[0, 1])
    assert_named_error_everywhere(ranks[:2], "GradientSyncError", "did not finish within 2 s", within=8.0)
    for rk in ranks[:2]:
        assert one_failure(rk)["after"] > 1.9, rk
        assert rk.exit_s < GLOO_OWN_TIMEOUT_S + 25, rk  # the thread left gloo at its own timeout
    assert ranks[2].rc == -signal.SIGKILL, ranks[2]  # killed by the test once the others had exited


def test_a_rank_that_skips_a_step_is_a_named_error_on_every_rank():
    ranks = run("skipped_step")
    assert_named_error_everywhere(ranks, "GradientSyncError", "different steps", "rank 0 step 1", "rank 1 step 2",
                                  within=10.0)


# ------------------------------------------------------------------ the exchange's ends and settings


def test_loader_timeout_is_a_named_error_and_no_abort():
    ranks = run("loader_timeout")
    assert_named_error_everywhere(ranks[:2], "ExchangeTimeout", "no balanced batch within 2 s", within=5.0)
    assert_named_error_everywhere(ranks[2:], "ExchangeError", "closed its loader")


def test_break_and_del_stop_the_exchange_threads_and_exit_is_prompt():
    ranks = run("break_and_del")
    assert_no_abort(ranks)
    for rk in ranks:
        assert rk.rc == 0, rk
        res = rk.results[-1]
        assert res["after_break"] == 0 and res["after_del_iterator"] == 0 and res["after_epoch"] == 0, res
        assert res["rest_of_epoch"] == 5 and res["in_flight_at_exit"] == 2, res
        assert rk.exit_s < 30, rk  # both in-flight epochs close at exit without a close_timeout (5 s) stall
    last_result = max(rk.results[-1]["exit_from"] for rk in ranks)
    assert max(rk.exit_s for rk in ranks) - min(rk.exit_s for rk in ranks) < 5.0, (last_result, ranks)


def test_balance_on_one_rank_only_is_refused_on_every_rank():
    ranks = run("balance_on_one_rank_only")
    assert_named_error_everywhere(ranks, "ExchangeError", "different settings",
                                  "balance: rank 0 True, rank 1 False, rank 2 True", within=10.0)


def test_a_rank_without_a_loader_is_named_within_the_timeout():
    ranks = run("missing_loader")
    assert_named_error_everywhere(ranks[:2], "ExchangeError", "rank(s) [2] did not build", within=AGREE_MIN_S + 3)
    assert ranks[2].rc == 0, ranks[2]


def test_a_string_field_is_refused_by_name_before_sending():
    ranks = run("string_field")
    assert_named_error_everywhere([ranks[1]], "SampleError", "field 'text' is not numeric")
    assert_named_error_everywhere([ranks[0], ranks[2]], "ExchangeError", "rank 1 failed", "field 'text'")


def test_arguments_are_refused_where_given_and_the_job_goes_on():
    """Before, these passed validation: a timeout beyond threading.TIMEOUT_MAX failed later
    (OverflowError; the all-reduce aborted every rank), a parameter listed twice hung until the
    timeout, and a string token_fields was read character by character."""
    ranks = run("bad_arguments")
    assert_no_abort(ranks)
    want = {"all-reduce timeout": ("ValueError", "paddle_unpad.distributed.GradientAllReduce: timeout "),
            "parameter listed twice": ("ValueError", "is listed twice"),
            "loader timeout": ("ValueError", "paddle_unpad.fleet.distributed_loader: timeout "),
            "token_fields string": ("TypeError", "token_fields must be a sequence of field names")}
    for rk in ranks:
        assert rk.rc == 0, rk
        got = {r["what"]: r for r in rk.results if "what" in r}
        assert set(got) == set(want), rk
        for what, (exc, text) in want.items():
            assert got[what]["refused"] and got[what]["exc"] == exc and text in got[what]["msg"], (what, rk)
        assert rk.results[-1]["afterwards"] is True, rk
