"""Cost models: how long a rank works on a sample of length ``s``.

The cost of one sample of length ``s`` in a BERT-like encoder is, to a very good
approximation, ``a*s + b*s**2 (+ c)``: every GEMM (QKV, attention output, FFN) is linear
in the number of tokens, the two attention products ``Q K^T`` and ``P V`` are quadratic
in the sequence length.  ``c`` is an optional per-sample constant (kernel launches, the
pooler); the default models set it to 0.

The planner accepts a :class:`CostModel`, :class:`TokenCost`, or any callable
``length -> float``.  Only ratios matter to it: a model in FLOPs and one in seconds give
the same plan when they are proportional.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Optional, Sequence

import numpy as np

__all__ = ["CostModel", "TokenCost", "bert_cost", "calibrate", "as_cost_fn", "check_cost", "COST_NAMES", "DEFAULT_COST"]


class CostModel:
    """``cost(s) = a*s + b*s**2 + c`` for a sample of ``s`` tokens (``s = 0`` costs 0)."""

    def __init__(self, a: float = 1.0, b: float = 0.0, c: float = 0.0, name: Optional[str] = None):
        for nm, v in (("a", a), ("b", b), ("c", c)):
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
                raise TypeError(f"paddle_unpad.balance.CostModel: {nm} must be a finite number >= 0, got {v!r}")
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"paddle_unpad.balance.CostModel: {nm} must be a finite number >= 0, got {v!r}")
        if a == 0 and b == 0 and c == 0:
            raise ValueError("paddle_unpad.balance.CostModel: a, b and c are all 0; every plan would be equally good")
        self.a, self.b, self.c = float(a), float(b), float(c)
        self.name = name or ("tokens" if (b == 0 and c == 0) else "quadratic")

    def __call__(self, length) -> float:
        s = float(length)
        if s <= 0:
            return 0.0
        return self.a * s + self.b * s * s + self.c

    def costs(self, lengths) -> np.ndarray:
        """Vectorised costs (float64) of an array of lengths."""
        s = np.asarray(lengths, dtype=np.float64)
        out = self.a * s + self.b * s * s + self.c
        return np.where(s > 0, out, 0.0)

    @property
    def quadratic_share_at(self):
        """``f(s)``: share of the cost of a length-``s`` sample that is the quadratic term."""
        return lambda s: (self.b * s * s) / max(self(s), 1e-300)

    def __repr__(self) -> str:
        return f"CostModel(a={self.a:.6g}, b={self.b:.6g}, c={self.c:.6g}, name={self.name!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, CostModel) and (self.a, self.b, self.c) == (other.a, other.b, other.c)

    def __hash__(self):
        return hash((self.a, self.b, self.c))


class TokenCost(CostModel):
    """Cost proportional to the token count (what sort-and-deal implicitly balances)."""

    def __init__(self):
        super().__init__(1.0, 0.0, 0.0, name="tokens")


def bert_cost(
    hidden_size: int = 1024, intermediate_size: Optional[int] = None, num_layers: int = 24, training: bool = True
) -> CostModel:
    """FLOP-count cost model of a BERT-like encoder layer stack.

    Per layer and token, the GEMMs do ``4*h*h + 2*h*i`` multiply-adds (QKV, output
    projection, two FFN GEMMs); per layer and sequence, attention does ``2*h*s*s``
    (``Q K^T`` and ``P V`` over all heads).  One multiply-add is 2 FLOPs; training
    (forward + backward) is 3x the forward.  Defaults: BERT-large (``h=1024``,
    ``i=4h``, 24 layers), the MLPerf model.  The quadratic share of a 512-token sample
    is then 512 / (512 + 6*1024) = 7.7%.
    """
    h = int(hidden_size)
    i = int(intermediate_size) if intermediate_size else 4 * h
    if h <= 0 or i <= 0 or num_layers <= 0:
        raise ValueError("paddle_unpad.balance.bert_cost: hidden_size, intermediate_size and num_layers must be > 0")
    k = (6.0 if training else 2.0) * num_layers
    return CostModel(a=k * (4 * h * h + 2 * h * i), b=k * 2 * h, c=0.0, name=f"bert(h={h},i={i},L={num_layers})")


#: the cost model used when ``cost=None``: BERT-large FLOPs (linear + quadratic)
DEFAULT_COST = bert_cost()


#: the cost models that have a name (and their aliases)
COST_NAMES = {
    "quadratic": DEFAULT_COST,
    "flops": DEFAULT_COST,
    "default": DEFAULT_COST,
    "tokens": TokenCost(),
    "token": TokenCost(),
}


def check_cost(cost, name="cost", where="balance.as_cost_fn"):
    """Raise unless ``cost`` is None, a name of :data:`COST_NAMES`, a CostModel or a callable
    (``where``: the public name it was given to, after ``paddle_unpad.``)."""
    if cost is None or isinstance(cost, CostModel) or (callable(cost) and not isinstance(cost, str)):
        return cost
    if isinstance(cost, str):
        if cost in COST_NAMES:
            return cost
        raise ValueError(
            f"paddle_unpad.{where}: {name}: unknown cost {cost!r}; use one of {sorted(COST_NAMES)}, a CostModel or a callable length -> cost"
        )
    raise TypeError(
        f"paddle_unpad.{where}: {name} must be None, a cost name, a CostModel or a callable length -> cost, got {type(cost).__name__}"
    )


def as_cost_fn(cost, where="balance.as_cost_fn") -> Callable[[np.ndarray], np.ndarray]:
    """Turn ``cost`` (None, a name of :data:`COST_NAMES`, a CostModel, or any callable
    ``length -> float``) into a vectorised ``lengths -> float64 costs``."""
    check_cost(cost, where=where)
    if cost is None:
        return DEFAULT_COST.costs
    if isinstance(cost, str):
        return COST_NAMES[cost].costs
    if isinstance(cost, CostModel):
        return cost.costs

    # a callable (check_cost refused everything else)
    def fn(lengths):
        # one Python call per distinct length; a lookup table indexed by length when
        # lengths are small (a sort-free np.unique: the planner's hot path at 1024 ranks)
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.size == 0:
            return np.zeros(lengths.shape, dtype=np.float64)
        top = int(lengths.max())
        if 0 <= int(lengths.min()) and top <= max(_TABLE_MIN, 8 * lengths.size):
            uniq = np.flatnonzero(np.bincount(lengths.reshape(-1)))
            table = np.zeros(top + 1, dtype=np.float64)
            table[uniq] = _call_each(cost, uniq)
            return table[lengths]
        uniq, inv = np.unique(lengths, return_inverse=True)
        return _call_each(cost, uniq)[inv.reshape(lengths.shape)]

    return fn


# a lookup table indexed by length costs O(max length): used while that is small next to the batch
_TABLE_MIN = 1 << 16


def _call_each(cost, lengths):
    vals = np.empty(len(lengths), dtype=np.float64)
    for j, s in enumerate(lengths.tolist()):
        v = float(cost(int(s)))
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"paddle_unpad.balance: cost({s}) = {v!r}: costs must be finite and >= 0")
        vals[j] = v
    return vals


def _fit(lengths: np.ndarray, times: np.ndarray):
    """Least-squares fit of t = c + a*s + b*s^2 with a, b, c >= 0 (tiny active-set search)."""
    s = lengths.astype(np.float64)
    cols = {"c": np.ones_like(s), "a": s, "b": s * s}
    best = None
    for keep in (("c", "a", "b"), ("a", "b"), ("c", "a"), ("c", "b"), ("a",), ("b",), ("c",)):
        X = np.stack([cols[k] for k in keep], axis=1)
        # scale columns for conditioning
        scale = np.abs(X).max(axis=0)
        coef, *_ = np.linalg.lstsq(X / scale, times, rcond=None)
        coef = coef / scale
        if np.any(coef < 0):
            continue
        resid = float(np.sum((X @ coef - times) ** 2))
        if best is None or resid < best[0] - 1e-18:
            best = (resid, dict(zip(keep, coef.tolist())))
    vals = best[1] if best else {"a": float(np.mean(times / s))}
    return vals.get("a", 0.0), vals.get("b", 0.0), vals.get("c", 0.0), (best[0] if best else float("nan"))


def calibrate(
    model=None,
    lengths: Sequence[int] = (32, 64, 128, 192, 256, 384, 512),
    tokens_per_call: int = 2048,
    repeats: int = 3,
    warmup: int = 1,
    backward: bool = True,
    step: Optional[Callable[[int], None]] = None,
    vocab_size: int = 100,
    keep_intercept: bool = False,
    timer: Callable[[], float] = time.perf_counter,
) -> CostModel:
    """Fit ``a`` and ``b`` of :class:`CostModel` from a short timing run on this device.

    Either pass ``model`` (a ``paddle.nn.Layer`` taking ``input_ids [n, s]`` int64, like
    PaddleNLP's ``BertModel``; its first output is summed and, with ``backward=True``,
    back-propagated), or ``step``: a callable ``step(s)`` that runs one representative
    unit of work on ``n`` sequences of length ``s`` and returns the number ``n`` (or
    None for 1).  For each length, ``n = max(1, tokens_per_call // s)`` sequences are run
    ``repeats`` times; the median time per sequence is fitted by non-negative least
    squares to ``c + a*s + b*s^2``.  The per-call constant is dropped unless
    ``keep_intercept`` (a step's fixed cost does not depend on which rank a sample is
    on).  The fit is attached as ``.samples`` (list of (s, seconds per sequence)).
    ``timer`` is the clock (``time.perf_counter``).
    """
    if model is None and step is None:
        raise ValueError("paddle_unpad.balance.calibrate: pass a model or a step callable")
    lengths = [int(s) for s in lengths]
    if len(lengths) < 2 or min(lengths) <= 0:
        raise ValueError("paddle_unpad.balance.calibrate: need at least 2 positive lengths")

    if step is None:
        import paddle

        def step(s):  # noqa: F811 - default step around a Layer
            n = max(1, tokens_per_call // s)
            ids = paddle.randint(1, vocab_size, shape=[n, s], dtype="int64")
            out = model(ids)
            while isinstance(out, (tuple, list)):
                out = out[0]
            loss = out.astype("float32").sum()
            if backward:
                loss.backward()
                for p in model.parameters():
                    p.clear_gradient()
            else:
                float(loss)
            return n

    samples = []
    for s in lengths:
        for _ in range(warmup):
            step(s)
        ts = []
        for _ in range(max(1, repeats)):
            t0 = timer()
            n = step(s)
            ts.append((timer() - t0) / (n or 1))
        samples.append((s, float(np.median(ts))))
    arr = np.array(samples)
    a, b, c, resid = _fit(arr[:, 0], arr[:, 1])
    if a == 0 and b == 0:
        a = float(np.mean(arr[:, 1] / arr[:, 0]))
    cm = CostModel(a=a, b=b, c=c if keep_intercept else 0.0, name="calibrated")
    cm.samples = samples
    cm.residual = resid
    cm.intercept = c
    return cm
