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
F = "paddle_unpad.distributed.GradientAllReduce"

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
    assert_named_error_everywhere(
        ranks, "GradientSyncError", "rank 0 has 4 trainable parameters, rank 2 6", within=10.0
    )


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
    assert_named_error_everywhere(
        ranks, "GradientSyncError", "an earlier wait() failed", "did not finish within 0.0001 s", "close()", within=3.0
    )
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
    assert_named_error_everywhere(
        ranks, "GradientSyncError", "different steps", "rank 0 step 1", "rank 1 step 2", within=10.0
    )


def test_all_reduce_misuse_is_exact_or_refused_on_every_rank():
    """A table reduced by rows whose weight is also used outside its layer (a tied matmul,
    ``F.embedding``), called with a keyword or not used at all: averaged gradients as the global
    batch's, computed in one process. Gradient accumulation with overlap (whether or not its
    buckets were reduced before the second backward, on every rank or one), parameters frozen
    or unfrozen after construction, a sparse embedding: refused by name on every rank."""
    ranks = run("allreduce_misuse")
    assert_no_abort(ranks)
    for rk in ranks:
        assert rk.rc == 0, rk
        got = {(r["case"], r.get("use") or r.get("who")): r for r in rk.results if "case" in r}
        for use in ("plain", "keyword", "functional", "matmul", "unused"):
            res = got[("tied", use)]
            assert res["by_rows"] == 1 and res["error"] < 1e-4, res
            assert res["unproven"] == (2 if use in ("functional", "matmul") else 0), res  # reduced whole, each step
        assert got[("accumulation", "overlap=False")]["error"] < 1e-4, rk
        assert got[("rebuilt", None)]["error"] < 1e-4, rk
        refused = {
            "accumulation": "gradient accumulation needs GradientAllReduce(overlap=False)",
            "unfrozen": "is trainable now (stop_gradient=False) on rank 0 but was frozen when",
            "frozen": "is frozen now (stop_gradient=True) on rank 0",
            "sparse list": "has a sparse (SelectedRows) gradient on rank 0",
        }
        for (case, who), res in got.items():
            if case in refused and who != "overlap=False":
                assert res["error"].startswith("GradientSyncError: paddle_unpad.distributed.GradientAllReduce: "), res
                assert refused[case] in res["error"], res
        assert "nn.Embedding(sparse=True)" in got[("sparse layer", None)]["error"], rk
        assert "build a new GradientAllReduce" in got[("unfrozen", None)]["error"], rk
        assert len([k for k in got if k[0] == "accumulation"]) == 3, rk


def test_an_exception_between_backward_and_wait_fails_the_peers_at_once():
    """Ranks 1 (an exception) and 2 (close()) leave with the reduction of their step open while
    their communication thread waits for a bucket (a layer without a gradient): each finishes
    the pass with a closing mark, at exit or in close(), so rank 0's wait() names them at once
    and every rank exits promptly."""
    ranks = run("allreduce_exception_before_wait")
    assert_named_error_everywhere([ranks[1]], "RuntimeError", "failed on purpose")
    assert_named_error_everywhere(
        [ranks[0]], "GradientSyncError", "rank(s) [1, 2] closed the all-reduce", "not reduced on any rank", within=10.0
    )
    assert_no_abort(ranks[2:])
    assert ranks[2].rc == 0 and ranks[2].results[-1]["closed_in"] < 5.0, ranks[2]
    for rk in ranks:
        assert rk.exit_s < GLOO_OWN_TIMEOUT_S, rk  # before: rank 1 stayed about 40 s, the others failed at 30 s


def test_a_model_changed_after_its_all_reduce_is_named_on_every_rank_and_so_is_rank_0_leaving():
    """2 ranks. Before, a head replaced after GradientAllReduce(model) was never reduced (the ranks'
    heads drifted apart, exit 0); an all-reduce over a group of rank 0 only, built on rank 1, was
    a silent no-op there; and after rank 0 had left, a new all-reduce or loader failed with
    Paddle's TCP error. Each is now a named error, at once, on every rank concerned."""
    ranks = run_ranks(WORKER, ["allreduce_model_changes"], 2, bound=60)
    assert_no_abort(ranks)
    names = {
        "head replaced": "'head.weight'",
        "head replaced on rank 0 only": "'head.weight'",
        "sublayer added": "'extra.weight'",
        "weight re-assigned": "'body.weight'",
        "embedding resized": "'emb.weight'",
    }
    for rk in ranks:
        assert rk.rc == 0, rk
        got = {r["case"]: r for r in rk.results if "case" in r}
        for case, name in names.items():
            err = got[case]["error"]
            head = f"GradientSyncError: {F}: a trainable parameter of the model on rank 0, {name}"
            assert err is not None and err.startswith(head), (case, rk)
            assert "close() the all-reduce and build a new GradientAllReduce" in err, (case, rk)
            assert got[case]["after"] < 5, (case, rk)
        assert "shape [48, 6]" in got["embedding resized"]["error"], rk
        assert got["rebuilt after the change"]["error"] < 1e-5, rk
        outside = [r for r in rk.results if r.get("what") == "all-reduce over a group without this rank"]
        assert outside and outside[0]["refused"] is (rk.rank == 1), rk
    assert (
        "all-reduce (group=) over ranks [0] was built on rank 1, which is not one of them"
        in [r for r in ranks[1].results if r.get("what") == "all-reduce over a group without this rank"][0]["msg"]
    )
    assert ranks[0].results[-1].get("leaving") is True, ranks[0]
    after = {r["what"]: r for r in ranks[1].results if "what" in r}
    for what, exc, prefix in (
        ("all-reduce after rank 0 left", "GradientSyncError", "distributed.GradientAllReduce"),
        ("loader after rank 0 left", "ExchangeError", "distributed: exchange"),
    ):
        r = after[what]
        assert r["refused"] and r["exc"] == exc and r["after"] < 5, (what, ranks[1])
        assert r["msg"].startswith(f"paddle_unpad.{prefix}: rank 0 has left the job"), (what, ranks[1])


def test_len_of_a_late_sized_sampler_counts_wrong_length_and_a_peer_that_left():
    """2 ranks. A batch sampler that sizes itself as its iteration starts: len() after iter() is
    the epoch's (before, the previous epoch's: 2 / 2 / 4 for epochs of 2 / 4 / 6). counts=[4] is
    refused where it is given (before: at the first step). A peer that left cleanly is named in
    the survivor's error (before: gloo's "TIMEOUT ... pair_rank = 1")."""
    ranks = run_ranks(WORKER, ["late_sized_loader"], 2, bound=60)
    assert_no_abort(ranks)
    for rk in ranks:
        got = {r["what"]: r for r in rk.results if "what" in r}
        for epoch, n in enumerate((2, 4, 6)):
            assert (got[f"epoch {epoch}"]["len"], got[f"epoch {epoch}"]["received"]) == (n, n), (epoch, rk)
        r = got["counts of one rank"]
        assert r["refused"] and r["exc"] == "ValueError" and r["after"] < 1.0, rk
        assert "counts must hold one count per rank (2 ranks in this job), got 1: [4]" in r["msg"], rk
    assert ranks[1].rc == 0 and ranks[1].results[-1]["leaving"], ranks[1]
    failed = ranks[0].results[-1]
    assert ranks[0].rc == 1 and failed["exc"] == "GradientSyncError", ranks[0]
    assert "rank(s) [1] left the job (their process ended)" in failed["msg"], ranks[0]
    assert "not reduced" in failed["msg"], ranks[0]
    assert failed["after"] < 10.0, ranks[0]


# ------------------------------------------------------------------ the exchange's ends and settings


def test_a_setting_that_must_agree_differs_on_one_rank_and_every_rank_is_told():
    """The per-group stores off on the last rank only (one machine exporting it): before, every
    rank blocked in fleet.init without a word. Now pu.fleet.DistributedStrategy() compares the
    settings through the job's store first."""
    ranks = run("settings_differ")
    assert_named_error_everywhere(
        ranks, "ConfigError", "PADDLE_UNPAD_GLOO_GROUP_STORES: rank 0 on, rank 1 on, rank 2 off", within=AGREE_MIN_S
    )
    for rk in ranks:
        assert rk.exit_s < 30, rk


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
    assert_named_error_everywhere(
        ranks, "ExchangeError", "different settings", "balance: rank 0 True, rank 1 False, rank 2 True", within=10.0
    )


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
    want = {
        "all-reduce timeout": ("ValueError", "paddle_unpad.distributed.GradientAllReduce: timeout "),
        "parameter listed twice": ("ValueError", "is listed twice"),
        "loader timeout": ("ValueError", "paddle_unpad.fleet.distributed_loader: timeout "),
        "token_fields string": ("TypeError", "token_fields must be a sequence of field names"),
    }
    for rk in ranks:
        assert rk.rc == 0, rk
        got = {r["what"]: r for r in rk.results if "what" in r}
        assert set(got) == set(want), rk
        for what, (exc, text) in want.items():
            assert got[what]["refused"] and got[what]["exc"] == exc and text in got[what]["msg"], (what, rk)
        assert rk.results[-1]["afterwards"] is True, rk


def test_the_balanced_loaders_contract_holds_on_every_rank():
    """Found at 3-5 ranks: a loader reusing its buffer gave 44 of 48 samples another batch's
    tokens; len() was each rank's own batch count while every rank received the longest's; a
    loader built before fleet.init packed alone, silently; a group over a subset of the ranks
    was an IndexError. Each is now right, or refused by name on every rank at once."""
    ranks = run("loader_contract")
    assert_no_abort(ranks)
    refused = {
        "before fleet.init": (
            "ExchangeError",
            "paddle_unpad.fleet.distributed_loader: built before the job was initialized",
            "call fleet.init",
        ),
        "subset group": (
            "ValueError",
            "paddle_unpad.distributed.BalancedLoader: group must span every rank",
            "got a group over ranks [0, 1]",
        ),
        "len unknown on rank 1": ("TypeError", "len() is not known: the loader of rank(s) [1] has no len()"),
        "iterate after close": ("ValueError", "iterating a closed loader"),
    }
    for rk in ranks:
        assert rk.rc == 0, rk
        got = {r["what"]: r for r in rk.results if "what" in r}
        for what, (exc, *texts) in refused.items():
            r = got[what]
            assert r["refused"] and r["exc"] == exc and all(t in r["msg"] for t in texts), (what, rk)
            assert r["after"] < 1.0, (what, rk)  # at once: no rank waits for another
        # 6 / 4 / 2 batches, then 3 / 5 / 1: every rank receives the longest rank's count, and len() says so
        assert got["built"]["len"] == 6, rk
        for epoch, n in ((0, 6), (1, 5)):
            e = got[f"epoch {epoch}"]
            assert (e["lens"], e["received"], e["own_tokens"], e["complete"]) == ([n], n, True, True), (epoch, rk)
        assert got["closed"]["released"] is True, rk
