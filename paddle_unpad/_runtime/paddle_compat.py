"""Every use of Paddle internals, and every difference between supported Paddle versions.

Supported: Paddle 2.6.x and 3.x, CPU and GPU builds. The rest of the package uses
public Paddle API and calls into this module for anything else, so a new Paddle
release is adapted here and nowhere else. Each helper says which versions differ.
The patches of Paddle's distributed runtime (per-group stores, TCP_NODELAY, exit order)
are the one other place that deals with Paddle's internals, through the helpers here:
:mod:`paddle_unpad.distributed.workarounds` (tests/test_paddle_internals.py keeps it so).

This module imports only paddle and the standard library (``_build_config`` uses it
at build time, before the package exists).
"""

import contextlib
import functools
import re
import warnings

import numpy as np
import paddle

# (major, minor) of the running Paddle; develop builds report "0.0.0" and are treated
# as the newest.
_m = re.match(r"(\d+)\.(\d+)", paddle.__version__)
PADDLE_VERSION = (int(_m.group(1)), int(_m.group(2))) if _m else (0, 0)
if PADDLE_VERSION == (0, 0):
    PADDLE_VERSION = (99, 0)

# Versions this release was built and tested with; others get one warning at import.
SUPPORTED_PADDLE = ((2, 6), (3, 0), (3, 1), (3, 2), (3, 3))
SUPPORTED_PADDLENLP = ("2.8", "3.0")


def check_versions():
    """Warn once when the running Paddle is not one this release was tested with, or when it
    meets a protobuf it does not work with."""
    if PADDLE_VERSION not in SUPPORTED_PADDLE and PADDLE_VERSION != (99, 0):
        tested = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_PADDLE)
        warnings.warn(
            f"paddle_unpad: Paddle {paddle.__version__} has not been tested with this release (tested: {tested}); see the supported-versions table in docs/gpu.md",
            RuntimeWarning,
            stacklevel=3,
        )
    problem = protobuf_problem()
    if problem:
        warnings.warn(f"paddle_unpad: {problem}", RuntimeWarning, stacklevel=3)


def protobuf_problem(paddle_version=None, protobuf_version=None):
    """Paddle 2.6's fleet.DistributedStrategy fails with protobuf 7 (its hybrid_configs reads
    FieldDescriptor.label, which protobuf 7 removed); 6.33 and 5.29 work. A sentence, or None."""
    paddle_version = PADDLE_VERSION if paddle_version is None else paddle_version
    if protobuf_version is None:
        try:
            from google import protobuf

            protobuf_version = protobuf.__version__
        except ImportError:
            return None
    major = re.match(r"(\d+)", protobuf_version)
    if paddle_version < (3, 0) and major and int(major.group(1)) >= 7:
        return f"Paddle {'.'.join(map(str, paddle_version))} with protobuf {protobuf_version}: fleet's DistributedStrategy fails (hybrid_configs: no attribute 'label'); install \"protobuf<7\""
    return None


_checked_paddlenlp = []
_PADDLENLP_INSTALL = 'pip install "paddlenlp>=2.8.1,<3.1", or paddle_unpad\'s extra: pip install --no-build-isolation ".[paddlenlp]" in its checkout'


def require_paddlenlp():
    """Import PaddleNLP's transformers for ``convert``, the model families and ``UnpadTrainer`` (the
    only parts that need it: it is an extra, not a requirement), and check its version once. Missing,
    or failing to import, it is one ImportError naming the versions needed and how to install them."""
    try:
        import paddlenlp.transformers  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"paddle_unpad: convert, the model families and UnpadTrainer need PaddleNLP 2.8.1 or 3.0 ({_PADDLENLP_INSTALL}), and importing paddlenlp.transformers failed: {e}"
        ) from None
    check_paddlenlp_version()


def check_paddlenlp_version(version=None):
    """Warn once when ``convert``/the Trainer meet a PaddleNLP outside the tested series."""
    if version is None:
        if _checked_paddlenlp:
            return
        import paddlenlp

        version = paddlenlp.__version__
        _checked_paddlenlp.append(version)
    if not any(version.startswith(v + ".") or version == v for v in SUPPORTED_PADDLENLP):
        warnings.warn(
            f"paddle_unpad: PaddleNLP {version} has not been tested with this release (tested: {', '.join(s + '.x' for s in SUPPORTED_PADDLENLP)})",
            RuntimeWarning,
            stacklevel=3,
        )


# ----------------------------------------------------------------------------- losses


@functools.lru_cache(maxsize=None)
def mean_cross_entropy_divides_by_all_rows():
    """Whether Paddle's mean cross entropy with ``ignore_index`` divides the sum by every
    row, ignored ones included (3.3.1), or by the rows it does not ignore (2.6.2).

    PaddleNLP's original token-classification and masked-LM losses inherit this, so the
    plugin's ``token_loss="stock"`` must follow it. Probed once on a 2-row example (eager);
    inside a program being traced, where no probe can run, the 3.x answer is assumed."""
    import math

    if not paddle.in_dynamic_mode():
        return PADDLE_VERSION >= (3, 0)
    with paddle.no_grad():
        v = float(
            paddle.nn.functional.cross_entropy(
                paddle.zeros([2, 2]), paddle.to_tensor([0, -100], dtype="int64"), ignore_index=-100
            )
        )
    return abs(v - math.log(2.0) / 2) < 1e-4


# ----------------------------------------------------------------------------- empty tensors

# Paddle 2.6's own add and matmul fail on tensors with no elements, and a custom op's
# empty output counts as "not initialized" there: a batch with no tokens cannot run
# through a 2.6 model at all. The plugin's ops refuse it with words instead.
EMPTY_TENSORS_SUPPORTED = PADDLE_VERSION >= (3, 0)


def refuse_empty(op, name, t):
    """Raise on Paddle versions that cannot compute on empty tensors, naming op and argument."""
    if EMPTY_TENSORS_SUPPORTED or not paddle.in_dynamic_mode():
        return
    shape = list(t.shape)
    if any(d == 0 for d in shape):
        version = paddle.__version__
        raise ValueError(
            f"paddle_unpad.{op}: {name} has no elements (shape {shape}); Paddle {version} cannot compute on empty tensors (its own add and matmul fail on them): skip empty batches, or use Paddle 3.x"
        )


# ----------------------------------------------------------------------------- custom ops


@functools.lru_cache(maxsize=None)
def custom_op_function(op_name):
    """The Python function Paddle generates for a registered custom op.

    ``paddle.utils.cpp_extension.load`` builds these functions for a JIT-compiled
    library; for a prebuilt one (``load_op_meta_info_and_register_op``) Paddle has no
    public way to get them, so the same generator is called here. The generated code is
    what differs between versions (3.x: ``_C_ops._run_custom_op`` and PIR; 2.6:
    ``core.eager._run_custom_op`` and the legacy static graph), which is why it is asked
    for instead of written out. The returned callable always gives a list of outputs.
    """
    from paddle.utils.cpp_extension import extension_utils

    source = extension_utils._custom_api_content(op_name)
    namespace = {}
    exec(compile(source, f"<paddle custom op {op_name}>", "exec"), namespace)
    generated = namespace[op_name]

    def call(*args):
        if _LEGACY_STATIC_GRAD_WORKAROUND and not paddle.in_dynamic_mode():
            args = [_differentiable_copy(a) for a in args]
        out = generated(*args)
        return list(out) if isinstance(out, (list, tuple)) else [out]

    call.__name__ = op_name
    return call


# Paddle 2.6's legacy static graph: when a float input of a custom op does not need a
# gradient, the backward pass prunes that output of the grad op and then its var-type
# inference indexes the empty list (IndexError in append_backward). Feeding the op a copy
# that asks for a gradient keeps every grad output; the copy's gradient stops at the
# copy, so results and the gradients of real parameters are unchanged.
_LEGACY_STATIC_GRAD_WORKAROUND = PADDLE_VERSION < (3, 0)


def _differentiable_copy(a):
    if (
        getattr(a, "stop_gradient", False)
        and hasattr(a, "dtype")
        and a.dtype in (paddle.float16, paddle.bfloat16, paddle.float32, paddle.float64)
    ):
        a = paddle.assign(a)
        a.stop_gradient = False
    return a


def is_tensor(x):
    """A dygraph Tensor, or a value of a program being traced (PIR ``Value`` in 3.x,
    ``Variable`` in 2.6's legacy static graph)."""
    kinds = [paddle.Tensor]
    pir = getattr(paddle, "pir", None)
    if pir is not None and hasattr(pir, "Value"):
        kinds.append(pir.Value)
    static = getattr(paddle, "static", None)
    if static is not None and hasattr(static, "Variable"):
        kinds.append(static.Variable)
    return isinstance(x, tuple(kinds))


# ----------------------------------------------------------------------------- layers


def layer_norm_epsilon(norm):
    """The epsilon of a ``paddle.nn.LayerNorm`` (kept as ``_epsilon`` in 2.6 and 3.x; no public
    attribute)."""
    return norm._epsilon


def data_parallel_inner(model):
    """The layer a ``paddle.DataParallel`` wraps (``_layers`` in 2.6 and 3.x), or ``model``."""
    while isinstance(model, paddle.DataParallel):
        model = model._layers
    return model


def own_sublayer(layer, name):
    """The direct sub-layer ``name`` of ``layer`` (None when it has none of that name), read from
    the layer's own table (``_sub_layers``, 2.6 and 3.x): never an attribute of the class that
    a subclass defines under the same name."""
    return layer.__dict__.get("_sub_layers", {}).get(name)


def embedding_is_sparse(layer):
    """Whether ``paddle.nn.Embedding`` ``layer`` was built with ``sparse=True`` (its gradient is a
    SelectedRows; kept as ``_sparse`` in 2.6 and 3.x)."""
    return bool(getattr(layer, "_sparse", False))


# ----------------------------------------------------------------------------- random state


def default_generator(place):
    """Paddle's default generator of ``place`` (the one ``paddle.seed`` seeds)."""
    core = paddle.framework.core
    # 3.x places and a tensor's place have is_gpu_place(); 2.6's paddle.CPUPlace() does not
    on_gpu = place.is_gpu_place() if hasattr(place, "is_gpu_place") else isinstance(place, paddle.CUDAPlace)
    if on_gpu:
        return core.default_cuda_generator(place.gpu_device_id())
    return core.default_cpu_generator()


# ----------------------------------------------------------------------------- distributed


def user_defined_strategy():
    """The strategy given to ``fleet.init`` (None before it); fleet keeps it privately."""
    from paddle.distributed import fleet

    return getattr(fleet.fleet, "_user_defined_strategy", None)


# ----------------------------------------------------------------------------- gradients


def register_grad_ready_hook(param, hook):
    """Call ``hook()`` each time the backward has finished ``param``'s gradient (after
    accumulation into ``param.grad``). Paddle's DataParallel uses the same private hook
    (``Tensor._register_backward_hook``, 2.6 and 3.x); there is no public equivalent."""
    param._register_backward_hook(hook)


def host_view(t):
    """A numpy array sharing the memory of the CPU tensor ``t`` (no copy), or None where numpy
    cannot view it (a device tensor, a dtype numpy lacks such as bfloat16). Paddle 3.x tensors
    speak ``__dlpack__``; Paddle 2.6's do not, but its ``paddle.utils.dlpack.to_dlpack`` capsule
    does the same once wrapped."""
    if not t.place.is_cpu_place():
        return None
    try:
        return np.from_dlpack(t) if hasattr(t, "__dlpack__") else np.from_dlpack(_Capsule(t))
    except (TypeError, RuntimeError, BufferError, ValueError, AttributeError):
        return None


class _Capsule:
    """``__dlpack__`` over Paddle 2.6's capsule (a CPU tensor: device type 1)."""

    def __init__(self, t):
        from paddle.utils import dlpack

        self._capsule = dlpack.to_dlpack(t)

    def __dlpack__(self, stream=None, **_):
        return self._capsule

    def __dlpack_device__(self):
        return (1, 0)


def set_grad(param, grad):
    """Give ``param`` a gradient where the backward produced none (2.6 and 3.x)."""
    param._set_grad_ivar(grad)


# ----------------------------------------------------------------------------- data loading


def dataloader_thread(it):
    """The loading thread of a single-process ``paddle.io.DataLoader`` iterator, or None.

    When its dataset or ``collate_fn`` raises, that thread dies without waking the reader
    (Paddle 2.6 and 3.3), so the exchange watches it to report the error instead of
    waiting for ever."""
    import threading

    th = getattr(it, "_thread", None)
    return th if isinstance(th, threading.Thread) else None


def wake_dataloader_reader(it):
    """Close a DataLoader iterator's queue so that a blocked ``next()`` returns what was
    ready and then stops (False when this iterator has no such hook)."""
    wake = getattr(it, "_exit_thread_expectedly", None)
    if wake is None:
        return False
    wake()
    return True


# ----------------------------------------------------------------------------- threads, memory


def set_num_threads(n):
    """Paddle's CPU math threads (``paddle.set_num_threads`` where it exists, else the
    core setter both 2.6 and 3.x have)."""
    setter = getattr(paddle, "set_num_threads", None) or getattr(paddle.framework.core, "set_num_threads", None)
    if setter is None:
        return False
    setter(int(n))
    return True


def host_memory_stats():
    """(current, reset_peak, peak) callables for Paddle's host allocator statistics, or None
    where this build does not keep them."""
    core = paddle.framework.core
    if not hasattr(core, "host_memory_stat_peak_value"):
        return None
    return (
        lambda: core.host_memory_stat_current_value("Allocated", 0),
        lambda: core.host_memory_stat_reset_peak_value("Allocated", 0),
        lambda: core.host_memory_stat_peak_value("Allocated", 0),
    )


# ----------------------------------------------------------------------------- build


def extension_build_paths(use_cuda):
    """(include dirs, library dirs, libpaddle file name, CUDA home or None) for compiling
    and linking against the running Paddle, as ``paddle.utils.cpp_extension`` finds them."""
    with warnings.catch_warnings():  # paddle warns about ccache on import; irrelevant here
        warnings.simplefilter("ignore")
        from paddle.utils.cpp_extension import extension_utils as eu

    incs = eu.find_paddle_includes(use_cuda) + eu.find_python_includes()
    libs = eu.find_paddle_libraries(use_cuda)
    return incs, libs, eu._get_core_name(), paddle_cuda_home() if use_cuda else None


def paddle_has_cuda():
    return bool(paddle.is_compiled_with_cuda())


def paddle_cuda_home():
    """The CUDA home ``paddle.utils.cpp_extension`` would use (may be a guess), or None."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from paddle.utils.cpp_extension import extension_utils as eu
    try:
        return eu.find_cuda_home()
    except Exception:  # some versions raise when nothing is found
        return None


# ----------------------------------------------------------------------------- process groups and stores


def job_store():
    """The job's TCP store (``core.create_or_get_global_tcp_store``, Paddle 2.6 and 3.x): one per
    process, made from the launcher's environment (``PADDLE_MASTER`` or the first of
    ``PADDLE_TRAINER_ENDPOINTS``, ``PADDLE_TRAINER_ID``, ``PADDLE_TRAINERS_NUM``); the same object
    ``init_parallel_env`` (and so ``fleet.init``) takes later, so it may be made before them."""
    from paddle.base import core

    return core.create_or_get_global_tcp_store()


def tcp_store(host, port, is_master, timeout_s):
    """A TCP store of Paddle's (``core.TCPStore``, 2.6 and 3.x) with no workers to wait for."""
    from paddle.base import core

    return core.TCPStore(host, int(port), bool(is_master), 0, int(timeout_s))


def process_group_factory():
    """The function ``paddle.distributed.new_group`` makes each process group with
    (``collective._new_process_group_impl``, 2.6 and 3.x), or None where it is missing."""
    from paddle.distributed import collective

    return getattr(collective, "_new_process_group_impl", None)


def set_process_group_factory(fn):
    from paddle.distributed import collective

    collective._new_process_group_impl = fn


def can_choose_group_id():
    """Whether :func:`chosen_group_id` can give a group the id the caller picks (``collective._custom_gid``,
    which ``new_group`` takes instead of its per-process counter when set: 2.6 and 3.x)."""
    from paddle.distributed import collective

    return hasattr(collective, "_custom_gid")


@contextlib.contextmanager
def chosen_group_id(gid):
    """Within it, ``paddle.distributed.new_group`` gives its group the id ``gid`` (when not None
    and :func:`can_choose_group_id`) instead of the next of its per-process counter, which then
    does not move: a group made by some ranks only would otherwise shift the ids of every later
    group on those ranks, and ranks that disagree on a group's id meet under different store
    keys."""
    from paddle.distributed import collective

    if gid is None or not can_choose_group_id():
        yield
        return
    saved = collective._custom_gid
    collective._custom_gid = int(gid)
    try:
        yield
    finally:
        collective._custom_gid = saved
