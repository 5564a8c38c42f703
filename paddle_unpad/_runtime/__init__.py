"""The plugin's runtime plumbing, private: loading the compiled operators and how they are
built, Paddle's versions and internals, host memory, MKL's kernel choice, warn-once, and the
record of every change made to the process (``pu.info()``).

``paddle_unpad/__init__.py`` calls :func:`start` once; nothing here runs at import.
"""

__all__ = ["start"]


def start():
    """What ``import paddle_unpad`` does, in this order:

    1. MKL's kernel choice (``MKL_DEBUG_CPU_TYPE``): first, because MKL reads it once, at its
       first GEMM, which any Paddle code may run;
    2. the Paddle version check (a clear refusal of an unsupported Paddle);
    3. registering the compiled operators, so that an exported model loads in this process;
    4. the old module names (``paddle_unpad.cpu_gemm``, ...) kept importable, with a warning.

    Each is listed by ``pu.info()``."""
    from . import cpu_gemm

    cpu_gemm.configure()
    from . import native, paddle_compat

    paddle_compat.check_versions()
    native.load_at_import()
    from . import aliases

    aliases.install()
