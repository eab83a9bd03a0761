"""Heavy imports done in a background thread while the first trial starts its ranks.

scikit-optimize (with scikit-learn and SciPy) and matplotlib take 2-4 s to import on
the CPU demo's cores, and the controller needs them only after the baseline (the
optimizer) or at the very end (report.html). `autotune run` starts the thread once the
study is open and the controller's own imports are done, so nothing else imports
these packages meanwhile; every place that needs one calls `wait()` first, which
returns at once when the thread is done (or was never started: tests, `advise`).
The thread only imports; a failed import is left for the real import to report.
"""

from __future__ import annotations

import importlib
import threading

RUN_MODULES = ("skopt", "scipy.optimize", "scipy.special", "matplotlib.pyplot")
"""What `autotune run` needs after its first trial (proposers/bayes.py, feasibility.py,
convergence.py; report_html/figures.py)."""

_thread: threading.Thread | None = None


def start(modules: tuple[str, ...] = RUN_MODULES) -> None:
    """Import `modules` in a daemon thread (once per process)."""
    global _thread
    if _thread is not None:
        return
    _thread = threading.Thread(target=_import_all, args=(modules,), name="preload", daemon=True)
    _thread.start()


def wait() -> None:
    """Block until the background imports are done (no-op when none were started)."""
    if _thread is not None:
        _thread.join()


def _import_all(modules: tuple[str, ...]) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an optional extra may be missing; the real import says so
            pass
