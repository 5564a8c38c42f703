"""Every use of Paddle internals, and every difference between supported Paddle versions.

Supported: Paddle 2.6.x and 3.x, CPU and GPU builds. The rest of the package uses
public Paddle API and calls into this module for anything else, so a new Paddle
release is adapted here and nowhere else. Each helper says which versions differ.

This module imports only paddle and the standard library (``_build_config`` uses it
at build time, before the package exists).
"""
import atexit
import functools
import re
import warnings

import paddle

# (major, minor) of the running Paddle; develop builds report "0.0.0" and are treated
# as the newest.
_m = re.match(r"(\d+)\.(\d+)", paddle.__version__)
PADDLE_VERSION = (int(_m.group(1)), int(_m.group(2))) if _m else (0, 0)
if PADDLE_VERSION == (0, 0):
    PADDLE_VERSION = (99, 0)

# Versions this release was built and tested with; others get one warning at import.
SUPPORTED_PADDLE = ((2, 6), (3, 0), (3, 1), (3, 2), (3, 3))
SUPPORTED_PADDLENLP = ("2.8",)


def check_versions():
    """Warn once when the running Paddle is not one this release was tested with, or when it
    meets a protobuf it does not work with."""
    if PADDLE_VERSION not in SUPPORTED_PADDLE and PADDLE_VERSION != (99, 0):
        tested = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_PADDLE)
        warnings.warn(
            f"paddle_unpad: Paddle {paddle.__version__} has not been tested with this release "
            f"(tested: {tested}); see the supported-versions table in docs/gpu.md",
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
        return (f"Paddle {'.'.join(map(str, paddle_version))} with protobuf {protobuf_version}: fleet's "
                "DistributedStrategy fails (hybrid_configs: no attribute 'label'); install \"protobuf<7\"")
    return None


_checked_paddlenlp = []


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
            f"paddle_unpad: PaddleNLP {version} has not been tested with this release "
            f"(tested: {', '.join(s + '.x' for s in SUPPORTED_PADDLENLP)})",
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
        v = float(paddle.nn.functional.cross_entropy(
            paddle.zeros([2, 2]), paddle.to_tensor([0, -100], dtype="int64"), ignore_index=-100))
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
        raise ValueError(
            f"{op}: {name} has no elements (shape {shape}); Paddle {paddle.__version__} cannot "
            "compute on empty tensors (its own add and matmul fail on them): skip empty batches, "
            "or use Paddle 3.x"
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
    if getattr(a, "stop_gradient", False) and hasattr(a, "dtype") and a.dtype in (
        paddle.float16, paddle.bfloat16, paddle.float32, paddle.float64
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


# ----------------------------------------------------------------------------- gloo group rendezvous

_GROUP_STORE_KEY = "paddle_unpad/gloo_group_store"
_group_stores = []  # each group's own store, alive as long as the process (its group holds it too)
_group_store_uses = {}  # gid -> groups created with it so far (a reused custom gid gets a new key)


def isolate_gloo_group_stores(enabled=True):
    """Give every gloo process group after the default one a rendezvous store of its own.

    Why: ``ProcessGroupGloo.create`` (Paddle 2.6 and 3.x) connects the group's gloo context
    through the job's TCP store under the keys ``"0"`` .. ``"n-1"``, with no per-group
    prefix, so each new group overwrites the keys of the one before. A rank that reads a
    peer's key before the peer has rewritten it gets the peer's address in an earlier
    group and fails: ``pair.cc ... connect ...: Connection refused`` (that listener is
    closed), or ``address.cc ... 136 vs 68`` when the two groups differ in size. It hits
    ``fleet.init`` (its data-parallel group follows the default one) and any job that
    creates groups one after the other, more often the more loaded the machine; creating
    40 groups of 3 and 2 ranks on 3 ranks failed in 3 of 3 launches on a 2-core host.

    With this, ``paddle.distributed.new_group`` on gloo gives the group a TCP store served by
    its first member (address passed through the job's store under a key unique to the
    group), so no key it reads can be stale. The default group (gid 0, created first) and
    other backends are left as they are. Installed at ``import paddle_unpad``;
    the ``GLOO_GROUP_STORES`` setting off leaves Paddle as it ships. Returns whether the
    rendezvous is now isolated."""
    from paddle.distributed import collective

    impl = getattr(collective, "_new_process_group_impl", None)
    if impl is None:  # a Paddle without this hook: leave it alone
        return False
    original = getattr(impl, "_paddle_unpad_original", impl)
    if not enabled:
        collective._new_process_group_impl = original
        return False
    if impl is not original:
        return True

    @functools.wraps(original)
    def new_process_group_impl(backend, store, rank, world_size, group_name, pg_options, group_id=0,
                               *args, **kwargs):
        if backend == "gloo" and group_id != 0 and world_size > 1:
            store = _group_store(store, rank, world_size, group_id)
        return original(backend, store, rank, world_size, group_name, pg_options, group_id, *args, **kwargs)

    new_process_group_impl._paddle_unpad_original = original
    collective._new_process_group_impl = new_process_group_impl
    return True


def _group_store(job_store, rank, size, gid):
    """The fresh TCP store of group ``gid``: served by its rank 0, joined by the others."""
    import os
    import socket

    from paddle.base import core  # 2.6 and 3.x

    uses = _group_store_uses.get(gid, 0)
    _group_store_uses[gid] = uses + 1
    key = f"{_GROUP_STORE_KEY}/{gid}/{uses}"
    timeout = 900  # seconds, Paddle's default for its own store
    if rank == 0:
        # the address the other members reach this process at: the launcher's endpoint
        host = os.environ.get("PADDLE_CURRENT_ENDPOINT", "").rpartition(":")[0] or "127.0.0.1"
        error = None
        for _ in range(5):  # the port is picked free, but another process could take it first
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
            try:
                own = core.TCPStore(host, port, True, 0, timeout)  # 0 workers: returns at once
                break
            except Exception as e:  # noqa: BLE001 - retried on another port, then reported
                error = e
        else:
            job_store.set(key, f"error: {error}".encode())
            raise RuntimeError(f"paddle_unpad: could not start the rendezvous store of gloo group {gid}: {error}")
        job_store.set(key, f"{host}:{port}".encode())
    else:
        value = job_store.get(key).decode()  # waits for the key (2.6 and 3.x)
        if value.startswith("error: "):
            raise RuntimeError(f"paddle_unpad: the first member of gloo group {gid} could not start its "
                               f"rendezvous store ({value[7:]})")
        host, _, port = value.rpartition(":")
        own = core.TCPStore(host, int(port), False, 0, timeout)
    _group_stores.append(own)
    return own


# ----------------------------------------------------------------------------- gradients


def register_grad_ready_hook(param, hook):
    """Call ``hook()`` each time the backward has finished ``param``'s gradient (after
    accumulation into ``param.grad``). Paddle's DataParallel uses the same private hook
    (``Tensor._register_backward_hook``, 2.6 and 3.x); there is no public equivalent."""
    param._register_backward_hook(hook)


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


# ----------------------------------------------------------------------------- exit order of the ranks

_EXIT_KEY = "paddle_unpad/ranks_leaving"
_EXIT_COUNT_WAIT_S = 5.0  # how long rank 0 waits for its peers to count themselves out
_exit_order = {}  # rank, {peer: gloo group holding ranks 0 and peer} (one per peer)


def order_rank_exit(rank, peer_groups):
    """Make rank 0 leave a clean multi-rank CPU job after its peers (once per process).

    Rank 0 hosts the job's TCP store; in Paddle 3.x a libuv thread serves it, and when a
    peer's connection closes while rank 0 is already in its C++ teardown (the static
    destructors after ``exit()``), that thread aborts rank 0 -- SIGABRT, no message, the
    job's work already done, the launcher reporting a failed job (seen in about one of 15
    two-rank Trainer runs on a loaded 2-core host; the core dump shows
    ``LibUVClient::readCallback`` under ``LibUVMasterDaemon::run``). So at interpreter
    exit each peer counts itself out in the store, and rank 0, once all have, waits until
    every peer's process is gone (a receive on the pair's gloo group fails when the peer's
    sockets close) before its own teardown. Skipped in a process that dies of an exception,
    and when a peer has not counted itself out within a few seconds (a failed job: rank 0
    must not hold up its peers' errors). ``peer_groups``: for each peer (rank >= 1), a gloo
    group of ranks 0 and that peer, as the exchange holds them; NCCL groups are not used."""
    if _exit_order or not peer_groups:
        return
    _exit_order.update(rank=rank, peer_groups=dict(peer_groups))


def _tcp_store():
    try:
        from paddle.base import core  # 2.6 and 3.x

        return core.create_or_get_global_tcp_store()
    except Exception:  # noqa: BLE001 - no store, no ordering
        return None


def _leave_in_order():
    import sys
    import time

    o = _exit_order
    if not o or getattr(sys, "last_value", None) is not None:  # dying of an exception
        return
    store = _tcp_store()
    if store is None:
        return
    try:
        if o["rank"] != 0:
            store.add(_EXIT_KEY, 1)
            return
        deadline = time.monotonic() + _EXIT_COUNT_WAIT_S
        while store.add(_EXIT_KEY, 0) < len(o["peer_groups"]):
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)
        buf = paddle.to_tensor([0], dtype="int64", place=paddle.CPUPlace())
        for peer, group in sorted(o["peer_groups"].items()):
            try:  # nobody sends: this returns when the peer's connection closes
                paddle.distributed.irecv(buf, peer, group=group).wait()
            except Exception:  # noqa: BLE001 - the expected end of the wait
                pass
        time.sleep(0.1)  # the store's thread takes the peers' hang-ups while rank 0 is whole
    except Exception:  # noqa: BLE001 - ordering is best effort; never fail an exit
        return


atexit.register(_leave_in_order)  # after the exchange's own exit handler (registered later)


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
