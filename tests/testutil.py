"""Small helpers shared by test modules (importable by name; conftest.py is not, since
tests/gpu has a conftest of its own)."""
import os


def in_ci():
    """True under CI (env CI = true/1/yes/on): tests of native code fail there instead of skipping."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes", "on")
