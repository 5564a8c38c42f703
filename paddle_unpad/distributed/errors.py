"""The errors of the distributed layer: one type per kind of failure between ranks."""


class ExchangeError(RuntimeError):
    """The sample exchange cannot go on (a peer failed, stopped, or disagrees)."""


class ExchangeTimeout(ExchangeError, TimeoutError):
    """No balanced batch arrived within the configured timeout."""


class GradientSyncError(RuntimeError):
    """The gradient all-reduce failed, disagrees between ranks, or did not finish within its timeout."""


class StoreHostLeft(RuntimeError):
    """The job's TCP store cannot be reached: rank 0, whose process serves it, has left the job.
    The owners (the all-reduce, the loader) raise it as their own error type, with this text."""
