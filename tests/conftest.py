"""Shared test configuration.

The suite runs against the installed package (`scripts/setup` installs it as a user
would, not as an editable link), so what is tested is what a wheel ships. The
repository root is appended to sys.path, after site-packages, only so that tests can
import `benchmarks` and `grafana` helpers; `autotune` and `exporters` still come from
the installation. A stale installation (source edited since) stops the run with the
command that refreshes it, instead of testing old code.

Every process the tests start sees this environment's bin folder first on PATH, as in an
activated environment: a benchmark started as `.venv/bin/deepspeed ...` would otherwise run
its ranks with Debian's ninja, which reads the build log the environment's ninja wrote as
unusable and compiles DeepSpeed's ops again, minutes inside a rank (docs/robustness.md).

Hypothesis runs derandomized: the same examples every run, so CI cannot fail
on a case nobody can reproduce. `benchmarks/fuzz_loaders.py` explores fresh
random cases (10,000+) instead.
"""

from __future__ import annotations

import filecmp
import os
import signal
import sys
from pathlib import Path

import pytest
from hypothesis import settings

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

_OWN_BIN = os.path.dirname(sys.executable)
if os.environ.get("PATH", "").split(os.pathsep)[:1] != [_OWN_BIN]:
    os.environ["PATH"] = os.pathsep.join([_OWN_BIN, os.environ.get("PATH", "")])

settings.register_profile("autotune", derandomize=True, deadline=None)
settings.load_profile("autotune")


def _stale_files() -> list[str]:
    """Source files whose installed copy differs or is missing (empty for an editable install)."""
    import autotune
    import exporters

    stale = []
    for pkg in (autotune, exporters):
        installed = Path(pkg.__file__).resolve().parent
        source = REPO / installed.name
        if installed == source:
            continue
        for f in source.rglob("*"):
            if f.is_file() and f.suffix in (".py", ".toml") and "__pycache__" not in f.parts:
                twin = installed / f.relative_to(source)
                if not twin.is_file() or not filecmp.cmp(f, twin, shallow=False):
                    stale.append(str(f.relative_to(REPO)))
    return stale


def pytest_sessionstart(session: pytest.Session) -> None:
    stale = _stale_files()
    if stale:
        shown = ", ".join(stale[:3]) + (f" and {len(stale) - 3} more" if len(stale) > 3 else "")
        pytest.exit(f"the installed autotune is older than the source ({shown}): run ./scripts/setup "
                    "(or ./scripts/test, which runs it) to install it again", returncode=4)


@pytest.fixture(autouse=True)
def _stop_signals_restored():
    """A test that runs the tuner or `watch` in this process must leave Ctrl-C as it found it:
    a SIGINT left ignored made a later Ctrl-C of the whole suite print nothing at all."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    changed = {sig.name for sig, h in before.items() if signal.getsignal(sig) is not h}
    for sig, h in before.items():
        signal.signal(sig, h)
    assert not changed, f"the test left {sorted(changed)} handled differently"


# -- reference studies, each run once per session and read by many modules (tests/shared_studies.py)
@pytest.fixture(scope="session")
def builtin_study(tmp_path_factory):
    from shared_studies import run_builtin_study

    return run_builtin_study(tmp_path_factory.mktemp("builtin-study"))


@pytest.fixture(scope="session")
def fault_study(tmp_path_factory):
    from shared_studies import run_fault_study

    return run_fault_study(tmp_path_factory.mktemp("fault-study"))


@pytest.fixture(scope="session")
def zero_study(tmp_path_factory):
    from shared_studies import run_zero_study

    return run_zero_study(tmp_path_factory.mktemp("zero-study"))


@pytest.fixture(scope="session")
def usercmd_zero_study(tmp_path_factory):
    from shared_studies import run_usercmd_zero_study

    return run_usercmd_zero_study(tmp_path_factory.mktemp("usercmd-zero-study"))


@pytest.fixture(scope="session")
def hf_trainer_study(tmp_path_factory):
    from shared_studies import run_hf_trainer_study

    return run_hf_trainer_study(tmp_path_factory.mktemp("hf-trainer-study"))


@pytest.fixture(scope="session")
def usercmd_study(tmp_path_factory):
    from shared_studies import run_usercmd_study

    return run_usercmd_study(tmp_path_factory.mktemp("usercmd-study"))



@pytest.fixture(scope="session")
def torch_script_study(tmp_path_factory):
    from shared_studies import run_torch_script_study

    return run_torch_script_study(tmp_path_factory.mktemp("torch-script-study"))
