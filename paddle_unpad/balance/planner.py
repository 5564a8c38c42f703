"""The load-balance planner: which rank trains on which sample in one global step.

Algorithm (identical in the C++ core ``_planner`` and the Python fallback here; both
work on the same integer costs, so they return the same plan bit for bit):

1. Costs.  Each sample's cost (float, from the cost model) is quantised to an integer:
   ``q = rint(cost * 2**40 / (max_cost * N))``.  All later arithmetic is exact int64,
   so every rank, whatever its CPU or compiler, computes the same plan.
2. Target counts.  ``counts="equal"`` (default): every rank gets ``N // R`` samples, the
   ``N % R`` extra ones go to the ranks holding most samples (ties: lower rank).  This is
   what keeps per-rank mean losses identical to plain data parallel.  ``"source"`` keeps
   each rank's own count; a list gives explicit counts.
3. Start from "everyone keeps their samples".  Ranks holding more than their target
   count hand their highest-index surplus samples, in (rank, index) order, to ranks
   short of their count, in rank order.
4. Swap descent.  Take the most loaded rank ``H`` (ties: lower rank); for partners ``P``
   from the least loaded up, find the pair (x on H, y on P) whose cost difference
   ``d = c_x - c_y`` is closest to ``(L_H - L_P) / 2`` with ``0 < d < L_H - L_P`` (a
   two-pointer sweep over both cost-sorted lists), swap it, repeat.  Every swap strictly
   lowers the sum of squared loads, so this ends; it stops when the most loaded rank has
   no improving swap with any partner, when ``R * L_max - total <= tol * total``, or after
   ``max_swaps`` swaps.  Starting from the identity and moving only what improves the
   balance keeps most samples where they are (few bytes moved); ties are broken by
   (cost, source rank, source index).

Sort-and-deal (the paper's and NVIDIA's method) and "no balancing" are here as well,
for comparison (:func:`sort_and_deal`, :func:`no_balance`).
"""

from __future__ import annotations

import bisect
import gc
import itertools
import hashlib
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

from .cost import as_cost_fn

__all__ = [
    "plan",
    "plan_dest",
    "quantize_costs",
    "target_counts",
    "sort_and_deal",
    "no_balance",
    "rank_loads",
    "imbalance",
    "plan_hash",
    "native_available",
    "moved_samples",
]

try:  # the C++ core (built by setup.py from custom_ops/planner/planner.cc)
    from . import _planner as _native  # type: ignore
except Exception:  # pragma: no cover - depends on the build
    _native = None

Plan = List[List[Tuple[int, int]]]

_QSCALE = float(2**40)

#: default stopping tolerance of the swap descent (max/mean - 1)
DEFAULT_TOL = 1e-4


def native_available() -> bool:
    """True when the compiled planner core is importable."""
    return _native is not None


_MAX_EXACT = 2**53  # lengths are read as float64 first (to refuse fractions): exact below this


def _bad_length(flat, counts, why):
    k = int(np.argmax(why))
    r = int(np.searchsorted(np.cumsum(counts), k, side="right"))
    i = k - int(np.sum(counts[:r]))
    v = flat[k]
    text = repr(int(v)) if np.isfinite(v) and float(v).is_integer() else repr(float(v))
    return ValueError(
        f"paddle_unpad.balance.plan: sample lengths must be non-negative integers, got lengths_per_rank[{r}][{i}] = {text}"
    )


def _flatten(lengths_per_rank) -> Tuple[np.ndarray, np.ndarray]:
    if isinstance(lengths_per_rank, np.ndarray):
        arr = lengths_per_rank
        if arr.ndim != 2:
            raise ValueError(
                f"paddle_unpad.balance.plan: a numpy lengths_per_rank must be 2-D [ranks, samples per rank], got shape {list(arr.shape)}"
            )
        if arr.shape[0] == 0:
            raise ValueError("paddle_unpad.balance.plan: lengths_per_rank is empty (need at least one rank)")
        counts = np.full(arr.shape[0], arr.shape[1], dtype=np.int64)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(
                f"paddle_unpad.balance.plan: sample lengths must be integers, got a numpy array of dtype {arr.dtype}"
            )
        flat = arr.astype(np.int64).reshape(-1)
        if np.any(flat < 0):
            raise _bad_length(flat, counts, flat < 0)
        return counts, flat
    if isinstance(lengths_per_rank, (str, bytes)) or not hasattr(lengths_per_rank, "__iter__"):
        raise TypeError(
            f"paddle_unpad.balance.plan: lengths_per_rank must be a list over ranks of lists of sample lengths, got {type(lengths_per_rank).__name__}"
        )
    rows = lengths_per_rank if isinstance(lengths_per_rank, (list, tuple)) else list(lengths_per_rank)
    if len(rows) == 0:
        raise ValueError("paddle_unpad.balance.plan: lengths_per_rank is empty (need at least one rank)")
    for r, row in enumerate(rows):
        if isinstance(row, np.ndarray):
            if row.ndim != 1 or (row.size and not np.issubdtype(row.dtype, np.integer)):
                error = ValueError if row.ndim != 1 else TypeError
                raise error(
                    f"paddle_unpad.balance.plan: lengths_per_rank[{r}] must be a 1-D array of integer lengths, got shape {list(row.shape)}, dtype {row.dtype}"
                )
        elif isinstance(row, (str, bytes)) or not hasattr(row, "__len__"):
            raise TypeError(
                f"paddle_unpad.balance.plan: lengths_per_rank[{r}] must be a list of sample lengths, got {type(row).__name__}"
            )
    counts_l = [len(r) for r in rows]
    counts = np.array(counts_l, dtype=np.int64)
    if all(isinstance(row, np.ndarray) for row in rows):  # integer rows (checked above): no per-element read
        flat = np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, np.int64)
        bad = (flat < 0) | (flat >= _MAX_EXACT)
        if np.any(bad):
            raise _bad_length(flat, counts, bad)
        return counts, flat
    total = sum(counts_l)
    try:
        # float64 first: np.fromiter(..., int64) would truncate 2.5 to 2 without a word
        flat_f = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.float64, count=total)
    except (TypeError, ValueError) as e:
        raise TypeError(f"paddle_unpad.balance.plan: sample lengths must be non-negative integers ({e})") from None
    bad = ~np.isfinite(flat_f) | (flat_f < 0) | (flat_f != np.floor(flat_f)) | (flat_f >= _MAX_EXACT)
    if np.any(bad):
        raise _bad_length(flat_f, counts, bad)
    return counts, flat_f.astype(np.int64)


def quantize_costs(lengths, cost=None) -> np.ndarray:
    """int64 costs of a flat array of lengths (see the module docstring, step 1)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = lengths.size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    c = np.asarray(as_cost_fn(cost, "balance.plan")(lengths), dtype=np.float64).reshape(-1)
    if c.shape[0] != n or not np.all(np.isfinite(c)) or np.any(c < 0):
        raise ValueError("paddle_unpad.balance.plan: the cost model must return finite costs >= 0 for every length")
    mx = float(c.max())
    if mx <= 0.0:
        return np.zeros(n, dtype=np.int64)
    # relative to the largest cost first: 2**40 / (mx * n) overflows to inf for tiny costs
    # (every sample would then quantise to the same integer and nothing would be balanced)
    return np.rint((c / mx) * (_QSCALE / float(n))).astype(np.int64)


COUNTS_RULE = "'equal', 'source' or a list of ints >= 0"


def check_counts(mode, name: str = "counts", where: str = "balance.plan", ranks: Optional[int] = None):
    """The ``counts`` rule, for every entry that takes it: ``'equal'``, ``'source'``, or a
    sequence of ints >= 0 (returned as a list of Python ints). A value of the wrong type raises
    TypeError (a float count is never rounded), a bad value ValueError, naming ``where`` (the
    public name, after ``paddle_unpad.``), ``name`` and the value. ``ranks``: the number of ranks
    the counts are for, where it is known (a list needs one count per rank); whether a list sums
    to a step's samples is checked when the step is planned."""
    if isinstance(mode, str):
        if mode not in ("equal", "source"):
            raise ValueError(f"paddle_unpad.{where}: {name} must be {COUNTS_RULE}, got {mode!r}")
        return mode
    items = mode.tolist() if isinstance(mode, np.ndarray) and mode.ndim == 1 else mode
    if not isinstance(items, (list, tuple)) or not all(
        isinstance(c, (int, np.integer)) and not isinstance(c, (bool, np.bool_)) for c in items
    ):
        raise TypeError(f"paddle_unpad.{where}: {name} must be {COUNTS_RULE}, got {mode!r}")
    if any(c < 0 for c in items):
        raise ValueError(f"paddle_unpad.{where}: {name} must be {COUNTS_RULE}, got {mode!r}")
    if ranks is not None and len(items) != ranks:
        raise ValueError(
            f"paddle_unpad.{where}: {name} must hold one count per rank ({ranks} ranks in this job), got {len(items)}: {mode!r}"
        )
    return [int(c) for c in items]


def target_counts(counts: Sequence[int], mode: Union[str, Sequence[int], None] = "equal") -> np.ndarray:
    """Number of samples each destination rank trains on (module docstring, step 2)."""
    counts = np.asarray(counts, dtype=np.int64)
    R, N = len(counts), int(counts.sum())
    mode = "equal" if mode is None else check_counts(mode)
    if mode == "equal":
        base, extra = divmod(N, R)
        t = np.full(R, base, dtype=np.int64)
        if extra:
            order = sorted(range(R), key=lambda r: (-int(counts[r]), r))
            t[order[:extra]] += 1
        return t
    if mode == "source":
        return counts.copy()
    t = np.asarray(mode, dtype=np.int64)
    if len(t) != R or int(t.sum()) != N:
        raise ValueError(
            f"paddle_unpad.balance.plan: explicit counts {mode} must be {R} non-negative ints summing to {N}"
        )
    return t


TOL_RULE = "a finite number >= 0 (0: no early stop)"


def check_tol(tol, name: str = "tol", where: str = "balance.plan") -> float:
    """The ``tol`` rule, for every entry that takes it (the planner, the exchange's options):
    a finite number >= 0, Python's or numpy's; 0 runs the swap descent until no swap improves
    the balance. A value of the wrong type (None, a string, a bool) raises TypeError, a bad
    value ValueError, naming ``where`` (the public name, after ``paddle_unpad.``), ``name`` and
    the value."""
    number = not isinstance(tol, (bool, np.bool_)) and isinstance(tol, (int, float, np.integer, np.floating))
    if not number or not np.isfinite(tol) or tol < 0:
        raise (ValueError if number else TypeError)(f"paddle_unpad.{where}: {name} must be {TOL_RULE}, got {tol!r}")
    return tol if isinstance(tol, (int, float)) else float(tol)


def _tol_threshold(q: np.ndarray, tol: float) -> int:
    tol = check_tol(tol)
    if tol == 0:
        return -1
    return int(float(tol) * float(int(q.sum())))


# ----------------------------------------------------------------------------------------
# Pure-Python core (mirror of custom_ops/planner/planner.cc; keep the two in step)
# ----------------------------------------------------------------------------------------
def _plan_core_py(
    counts: np.ndarray, q: np.ndarray, targets: np.ndarray, thr: int, max_swaps: int
) -> Tuple[np.ndarray, int]:
    R = len(counts)
    N = int(counts.sum())
    starts = np.zeros(R + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    ql = q.tolist()

    # step 3: identity, surplus -> deficit
    members: List[List[int]] = [list(range(int(starts[r]), int(starts[r + 1]))) for r in range(R)]
    pool: List[int] = []
    for r in range(R):
        extra = int(counts[r]) - int(targets[r])
        if extra > 0:
            keep = int(targets[r])
            pool.extend(members[r][keep:])
            del members[r][keep:]
    p = 0
    for r in range(R):
        need = int(targets[r]) - len(members[r])
        if need > 0:
            members[r].extend(pool[p : p + need])
            p += need

    # per-rank lists sorted by (cost, flat index): flat index order == (src rank, src index)
    lists: List[List[Tuple[int, int]]] = [sorted((ql[i], i) for i in m) for m in members]
    loads = [sum(c for c, _ in lst) for lst in lists]
    total = sum(loads)
    order = sorted((loads[r], r) for r in range(R))  # ascending (load, rank)

    swaps = 0
    while swaps < max_swaps and R > 1:
        # most loaded rank, ties -> lowest rank: max load, then smallest r
        top = order[-1][0]
        k = bisect.bisect_left(order, (top, -1))
        H = order[k][1]
        LH = top
        if thr >= 0 and R * LH - total <= thr:
            break
        a = lists[H]
        done = False
        for LP, P in order:
            if P == H:
                continue
            D = LH - LP
            if D < 2:
                break
            b = lists[P]
            na, nb = len(a), len(b)
            i = j = 0
            best = -1
            bi = bj = -1
            while i < na and j < nb:
                d = a[i][0] - b[j][0]
                if 0 < d < D:
                    e = abs(2 * d - D)
                    if best < 0 or e < best:
                        best, bi, bj = e, i, j
                        if e == 0:
                            break
                if 2 * d < D:
                    i += 1
                else:
                    j += 1
            if best < 0:
                continue
            # swap a[bi] (H -> P) with b[bj] (P -> H)
            x = a.pop(bi)
            y = b.pop(bj)
            bisect.insort(a, y)
            bisect.insort(b, x)
            d = x[0] - y[0]
            order.pop(bisect.bisect_left(order, (LH, H)))
            order.pop(bisect.bisect_left(order, (LP, P)))
            loads[H] = LH - d
            loads[P] = LP + d
            bisect.insort(order, (loads[H], H))
            bisect.insort(order, (loads[P], P))
            swaps += 1
            done = True
            break
        if not done:
            break

    dest = np.empty(N, dtype=np.int32)
    for r in range(R):
        for _, i in lists[r]:
            dest[i] = r
    return dest, swaps


def _prepare(lengths_per_rank, cost, counts, tol, max_swaps, backend):
    cnt, flat = _flatten(lengths_per_rank)
    q = quantize_costs(flat, cost)
    targets = target_counts(cnt, counts)
    thr = _tol_threshold(q, tol)
    if max_swaps is None:
        max_swaps = 16 * int(flat.size) + 64
    elif isinstance(max_swaps, (bool, np.bool_)) or not isinstance(max_swaps, (int, np.integer)):
        raise TypeError(f"paddle_unpad.balance.plan: max_swaps must be an int >= 0 (or None), got {max_swaps!r}")
    elif max_swaps < 0:
        raise ValueError(f"paddle_unpad.balance.plan: max_swaps must be an int >= 0 (or None), got {max_swaps!r}")
    if backend not in ("auto", "native", "python"):
        raise ValueError(f"paddle_unpad.balance.plan: backend must be 'auto', 'native' or 'python', got {backend!r}")
    if backend == "native" and _native is None:
        raise RuntimeError("paddle_unpad.balance.plan: the C++ planner (paddle_unpad.balance._planner) is not built")
    use_native = backend == "native" or (backend == "auto" and _native is not None)
    args = (
        np.ascontiguousarray(cnt, dtype=np.int64),
        np.ascontiguousarray(q, dtype=np.int64),
        np.ascontiguousarray(targets, dtype=np.int64),
        int(thr),
        int(max_swaps),
    )
    return use_native, args


def plan_dest(lengths_per_rank, cost=None, counts="equal", tol=DEFAULT_TOL, max_swaps=None, backend="auto"):
    """Like :func:`plan` (the same arguments and types), but returns ``(dest, counts_per_source)``: ``dest[i]`` is the
    destination rank of the i-th sample in (source rank, source index) order (int32)."""
    use_native, args = _prepare(lengths_per_rank, cost, counts, tol, max_swaps, backend)
    if use_native:
        dest = np.asarray(_native.plan_core(*args), dtype=np.int32)
    else:
        dest, _ = _plan_core_py(*args)
    return dest, args[0]


def _dest_to_plan(dest: np.ndarray, cnt: np.ndarray, R: int) -> Plan:
    n = int(cnt.sum())
    if n == 0:
        return [[] for _ in range(R)]
    order = np.argsort(dest, kind="stable")  # stable: (src rank, src index) order kept
    src_r = np.repeat(np.arange(len(cnt), dtype=np.int64), cnt)
    starts = np.zeros(len(cnt), dtype=np.int64)
    np.cumsum(cnt[:-1], out=starts[1:])
    src_k = np.arange(n, dtype=np.int64) - np.repeat(starts, cnt)
    pairs = list(zip(src_r[order].tolist(), src_k[order].tolist()))
    bounds = np.zeros(R + 1, dtype=np.int64)
    np.cumsum(np.bincount(dest, minlength=R), out=bounds[1:])
    b = bounds.tolist()
    return [pairs[b[d] : b[d + 1]] for d in range(R)]


def plan(
    lengths_per_rank,
    cost=None,
    counts="equal",
    tol: float = DEFAULT_TOL,
    max_swaps: Optional[int] = None,
    backend: str = "auto",
) -> Plan:
    """Balance one global batch across ranks.

    Args:
        lengths_per_rank: list over ranks of lists of sample lengths (what the
            all-gather returns); a rank may have zero samples.
        cost: a :class:`~paddle_unpad.balance.CostModel`, any callable
            ``length -> float``, ``'tokens'``, or None for the BERT-large FLOP model
            (linear + quadratic attention term).
        counts: ``'equal'`` (default; per-rank counts differ by at most one),
            ``'source'`` (keep each rank's count) or a list of per-rank counts.
        tol: stop as soon as ``max_load / mean_load - 1 <= tol`` (default 1e-4, i.e.
            0.01%; 0 runs to a local optimum).  Plans within ``tol`` of each other count
            as equally good, and the planner then keeps more samples where they are.
        max_swaps: safety cap on swaps (default ``16 * N + 64``).
        backend: ``'auto'`` (C++ core when built), ``'native'`` or ``'python'``; both
            give the identical plan.

    Returns:
        list over destination ranks of lists of ``(source_rank, source_index)``, each
        sorted by (source rank, source index).  Same input -> same plan, on every rank.
    """
    use_native, args = _prepare(lengths_per_rank, cost, counts, tol, max_swaps, backend)
    if use_native:
        # building ~N small tuples would trigger the cyclic GC many times over (it
        # doubles the time at 1024 x 64); they are acyclic, so pause it meanwhile
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return _native.plan_lists(*args)
        finally:
            if was_enabled:
                gc.enable()
    dest, _ = _plan_core_py(*args)
    return _dest_to_plan(dest, args[0], len(args[0]))


# ----------------------------------------------------------------------------------------
# baselines and metrics
# ----------------------------------------------------------------------------------------
def no_balance(lengths_per_rank, cost=None) -> Plan:
    """Every rank keeps its own samples."""
    return [[(r, k) for k in range(len(row))] for r, row in enumerate(lengths_per_rank)]


def sort_and_deal(lengths_per_rank, cost=None) -> Plan:
    """The paper's / NVIDIA's method: sort the global batch by length (longest first,
    ties by rank and index) and deal the samples round-robin to the ranks."""
    R = len(lengths_per_rank)
    items = [(-int(s), r, k) for r, row in enumerate(lengths_per_rank) for k, s in enumerate(row)]
    items.sort()
    out: Plan = [[] for _ in range(R)]
    for j, (_, r, k) in enumerate(items):
        out[j % R].append((r, k))
    for lst in out:
        lst.sort()
    return out


def rank_loads(plan_: Plan, lengths_per_rank, cost=None) -> np.ndarray:
    """float64 cost of each destination rank under ``plan_``."""
    fn = as_cost_fn(cost)
    loads = np.zeros(len(plan_), dtype=np.float64)
    for d, lst in enumerate(plan_):
        if lst:
            ls = np.array([lengths_per_rank[r][k] for r, k in lst], dtype=np.int64)
            loads[d] = float(np.sum(fn(ls)))
    return loads


def imbalance(plan_: Plan, lengths_per_rank, cost=None) -> float:
    """``max rank cost / mean rank cost - 1`` (0 = perfectly balanced)."""
    loads = rank_loads(plan_, lengths_per_rank, cost)
    m = loads.mean()
    return float(loads.max() / m - 1.0) if m > 0 else 0.0


def moved_samples(plan_: Plan) -> int:
    """Number of samples that leave their source rank."""
    return sum(1 for d, lst in enumerate(plan_) for r, _ in lst if r != d)


def plan_hash(plan_) -> int:
    """A 63-bit hash of where each sample goes, to compare across ranks: ``plan_`` is a
    :func:`plan` (``plan_[dst] == [(src_rank, src_index), ...]``) or the ``dest`` array of
    :func:`plan_dest`; the two forms of one plan hash alike, and a balanced loader's
    ``batch["plan_hash"]`` is this hash of its step's plan."""
    dest = plan_ if isinstance(plan_, np.ndarray) else _plan_to_dest(plan_)
    if dest.ndim != 1 or not np.issubdtype(dest.dtype, np.integer):
        raise ValueError(
            f"paddle_unpad.balance.plan_hash: plan_ as an array must be plan_dest's 1-D integer dest, got shape {list(dest.shape)} dtype {dest.dtype}"
        )
    h = hashlib.blake2b(np.ascontiguousarray(dest, dtype=np.int32).tobytes(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def _plan_to_dest(plan_: Plan) -> np.ndarray:
    """Each sample's destination in (source rank, source index) order."""
    pairs = [(int(r), int(k), d) for d, lst in enumerate(plan_) for r, k in lst]
    cnt = np.zeros(len(plan_), dtype=np.int64)
    for r, k, _ in pairs:
        if not 0 <= r < len(plan_) or k < 0:
            raise ValueError(
                f"paddle_unpad.balance.plan_hash: plan_ names sample ({r}, {k}), outside {len(plan_)} ranks"
            )
        cnt[r] = max(cnt[r], k + 1)
    starts = np.concatenate([[0], np.cumsum(cnt)[:-1]])
    dest = np.full(int(cnt.sum()), -1, dtype=np.int32)
    for r, k, d in pairs:
        if dest[starts[r] + k] != -1:
            raise ValueError(f"paddle_unpad.balance.plan_hash: plan_ sends sample ({r}, {k}) twice")
        dest[starts[r] + k] = d
    if np.any(dest < 0):
        r = int(np.searchsorted(starts, int(np.argmax(dest < 0)), side="right") - 1)
        raise ValueError(
            f"paddle_unpad.balance.plan_hash: plan_ leaves out a sample of rank {r} (a plan sends every sample once)"
        )
    return dest
