"""autotune's start-up hook for the ranks of a user's training job (autotune/rank/hook.py).

This folder is put first on the ranks' PYTHONPATH; Python's `site` imports the
first `sitecustomize` it finds, this one. So that a sitecustomize the
environment already had (Debian's, a site's own) still runs, the next one on
sys.path is run first, as it would have been without us.

Only a rank (RANK is set by the launcher, or mapped from mpirun's or srun's own
variables: autotune/rank/launcher_ranks.py) of an autotune trial (AUTOTUNE_USERCMD
is set by the controller) installs the hook; the launcher processes, which see
the same PYTHONPATH, do nothing.
"""

from __future__ import annotations

import os
import sys


def _chain_next_sitecustomize() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - as site.py does: a broken sitecustomize is a warning
        print(f"autotune: the environment's sitecustomize ({spec.origin}) failed: {exc!r}", file=sys.stderr)


def _install_hook() -> None:
    settings = os.environ.get("AUTOTUNE_USERCMD")
    if not settings and os.environ.get("AUTOTUNE_USERCMD_FILE"):
        # multi-node: DeepSpeed's env file cannot carry JSON, so the nodes get its path
        try:
            with open(os.environ["AUTOTUNE_USERCMD_FILE"], encoding="utf-8") as f:
                settings = f.read()
        except OSError as exc:
            print(f"autotune: cannot instrument this rank: {exc}", file=sys.stderr, flush=True)
            return
    if not settings:
        return
    if "RANK" not in os.environ:  # mpirun/srun set only their own rank variables
        try:
            from autotune.rank.launcher_ranks import adopt
        except ImportError:
            return  # not autotune's Python: said below only for a rank, which this is not
        if not adopt():
            return
    try:
        from autotune.rank.hook import BootstrapSettings, install
    except ImportError as exc:  # the job's Python is not the one autotune is installed in
        print(f"autotune: cannot instrument this rank: {exc}; run the job with the Python "
              "autotune is installed in", file=sys.stderr, flush=True)
        return
    install(BootstrapSettings.from_env(settings))


_chain_next_sitecustomize()
_install_hook()
