"""Multi-process acceptance tests of the sample exchange, on CPU ranks (gloo).

Each test launches ``tests/dist/balance_worker.py`` under
``python -m paddle.distributed.launch --nproc_per_node N`` with a timeout, and requires
every rank to print ``ALL OK``; on failure the worker logs are printed.

Every test runs once: ``import paddle_unpad`` gives each gloo group its own rendezvous
store, which removes the "Connection refused" that group creation used to hit now and
then (tests/test_gloo_groups.py shows it and its cause), so a failed launch is a failure.
"""

import os

import pytest

from launch_util import launch_job

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "dist", "balance_worker.py")

pytestmark = pytest.mark.dist


def launch(tmp_path, nproc, scenario, timeout=150):
    rc, out, logs = launch_job([WORKER, scenario], nproc, tmp_path / f"log_{scenario}_{nproc}", timeout)
    if rc == 0 and len(logs) == nproc and all("ALL OK" in t for t in logs.values()):
        return logs
    text = [f"launch of {scenario} with {nproc} ranks failed (rc={rc})", "--- launcher output (tail) ---", out[-3000:]]
    for name, t in logs.items():
        text += [f"--- {name} (tail) ---", t[-6000:]]
    pytest.fail("\n".join(text))


def _checks(logs):
    return {
        line.split("CHECK ", 1)[1].rsplit(" OK", 1)[0]
        for t in logs.values()
        for line in t.splitlines()
        if "CHECK " in line and line.endswith(" OK")
    }


TRAIN_CHECKS = {
    "fleet hook enabled the exchange",
    "each step's global batch is the same set as without exchange",
    "nothing lost or duplicated over the epoch",
    "every rank's batch carries balance.plan_hash of its step's plan",
    "samples were actually exchanged",
    "same parameters as one-process training (allclose 1e-5)",
    "thread stopped at end of epoch 0",
    "thread stopped after break",
    "thread stopped after RuntimeError in the training loop",
    "thread stopped after KeyboardInterrupt in the training loop",
    "a full epoch still works after early stops",
    "len() is the number of batches every rank received",
}


@pytest.mark.parametrize("nproc", [3, 4])
def test_exchange_training_matches_single_process(tmp_path, nproc):
    logs = launch(tmp_path, nproc, "train")
    missing = TRAIN_CHECKS - _checks(logs)
    assert not missing, missing
    if nproc == 3:
        assert "some rank has zero samples in the last step" in _checks(logs)


def test_exchange_error_paths(tmp_path):
    logs = launch(tmp_path, 2, "errors")
    checks = _checks(logs)
    for name in [
        "over-long sample: clear error naming sample id and rank",
        "empty sample: clear error naming sample id and rank",
        "raising rank sees its own exception",
        "different planner settings: clear error on every rank",
        "thread stopped after different planner settings",
        "the same cost spelled two ways is accepted",
        "peer of a raising rank fails with a clear error",
        "rank that stopped early shut its thread down",
        "peer of a rank that stopped early fails with a clear error",
        "the peer of a stalled rank fails within the timeout",
        "a stalled rank fails once it resumes",
        "thread stopped after the stall",
    ]:
        assert name in checks, name
