"""The plugin's once-per-process warnings: one helper, one record of what was shown.

A warning that would repeat every step (a slower path taken, an input the original model
reads differently) is shown the first time its ``key`` is met. The category says what kind
of news it is: ``RuntimeWarning`` for a slower path the run takes, ``UserWarning`` for an
output that differs from the original model's. Imports only the standard library.
"""

import warnings

_shown = set()


def warn_once(key, message: str, category=UserWarning, stacklevel: int = 3):
    """Warn with ``message`` unless a warning with ``key`` was shown before in this process.
    ``stacklevel`` counts from the caller of ``warn_once`` (2: the caller's caller)."""
    if key in _shown:
        return
    _shown.add(key)
    warnings.warn(message, category, stacklevel=stacklevel + 1)


def forget():
    """Show every warning again (tests)."""
    _shown.clear()
