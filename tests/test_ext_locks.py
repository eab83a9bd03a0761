"""Torch extension locks before a launch (autotune/trials/ext_locks.py): stale ones go, live ones wait.

Every lock here is planted under the test's own TORCH_EXTENSIONS_DIR, never in the
machine's own cache."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from autotune.trials import ext_locks
from autotune.trials.ext_locks import (
    ExtensionLockBusy,
    Preflight,
    clear_stale_locks,
    extension_roots,
    unbuilt_ops,
)


def plant(root, op: str, age: float) -> os.PathLike:
    folder = root / op
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / "lock"
    lock.write_text("")
    old = time.time() - age
    os.utime(lock, (old, old))
    return lock


def env_for(root) -> dict[str, str]:
    return {"TORCH_EXTENSIONS_DIR": str(root), "DS_ACCELERATOR": "cpu", "HOME": os.environ.get("HOME", "/"),
            "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ.get('PATH', '')}"}


def test_roots_follow_torch_extensions_dir_and_the_users_cache(tmp_path):
    assert extension_roots({"TORCH_EXTENSIONS_DIR": str(tmp_path / "x")}) == [tmp_path / "x"]
    tag = f"py{sys.version_info.major}{sys.version_info.minor}"
    (tmp_path / "cache" / "torch_extensions" / f"{tag}_cpu").mkdir(parents=True)
    (tmp_path / "cache" / "torch_extensions" / "py27_cpu").mkdir()  # another Python's: not ours
    roots = extension_roots({"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert [r.name for r in roots] == [f"{tag}_cpu"]


def test_a_stale_lock_is_removed_and_the_run_says_so(tmp_path):
    lock = plant(tmp_path, "deepspeed_shm_comm", age=3600)
    said: list[str] = []
    removed = clear_stale_locks(env_for(tmp_path), said.append)
    assert removed == [lock] and not lock.exists()
    assert len(said) == 1 and str(lock) in said[0] and "stale" in said[0]


def test_a_lock_its_creator_still_holds_open_is_live_wherever_the_creator_works(tmp_path):
    """torch's FileBaton keeps the descriptor of the lock it created until it removes the file."""
    lock = tmp_path / "fused_adam" / "lock"
    lock.parent.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import os, sys, time; fd = os.open(sys.argv[1], "
                               "os.O_CREAT | os.O_EXCL); print('held', flush=True); time.sleep(60)", str(lock)],
                              stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert holder.stdout.readline().strip() == "held"
        state = ext_locks.inspect(lock)
        assert state is not None and state.builders == [holder.pid] and not state.stale
        with pytest.raises(ExtensionLockBusy):
            clear_stale_locks(env_for(tmp_path), lambda _: None, wait_limit=0.5)
        assert lock.exists()
    finally:
        holder.kill()
        holder.wait()
    assert ext_locks.inspect(lock).stale  # its creator is gone: nothing holds it (age does not matter)


def test_where_a_holder_could_hide_a_young_lock_is_waited_for_then_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(ext_locks, "YOUNG_SECONDS", 1.5)
    monkeypatch.setattr(ext_locks, "holders", lambda lock: ([], False))  # another user's processes
    lock = plant(tmp_path, "fused_adam", age=0)
    started = time.monotonic()
    clear_stale_locks(env_for(tmp_path), lambda _: None)
    waited = time.monotonic() - started
    assert not lock.exists()
    assert waited >= 1.2  # not removed while its holder may still be about to start ninja


def test_a_lock_whose_build_is_running_is_never_removed(tmp_path):
    lock = plant(tmp_path, "deepspeed_shm_comm", age=3600)
    # a build in progress: a process working in the op's build folder, as ninja and the compiler do
    builder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=lock.parent)
    try:
        time.sleep(0.2)
        said: list[str] = []
        started = time.monotonic()
        with pytest.raises(ExtensionLockBusy) as err:
            clear_stale_locks(env_for(tmp_path), said.append, wait_limit=1.0)
        assert time.monotonic() - started < 10
        assert str(lock) in str(err.value) and str(builder.pid) in str(err.value)
        assert "\n" not in str(err.value) and err.value.exit_code == 2
        assert lock.exists() and builder.poll() is None  # nothing of the build was touched
        assert any("waiting for a running build" in s for s in said)
    finally:
        builder.kill()
        builder.wait()


def test_a_live_build_of_an_op_the_ranks_do_not_load_is_left_alone(tmp_path):
    lock = plant(tmp_path, "someone_elses_op", age=3600)
    builder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=lock.parent)
    try:
        time.sleep(0.2)
        started = time.monotonic()
        assert clear_stale_locks(env_for(tmp_path), lambda _: None, wait_limit=30) == []
        assert time.monotonic() - started < 5 and lock.exists()
    finally:
        builder.kill()
        builder.wait()


def test_the_build_ends_and_the_launch_goes_on(tmp_path):
    lock = plant(tmp_path, "fused_adam", age=3600)
    builder = subprocess.Popen([sys.executable, "-c", "import time, os; time.sleep(1.5); os.unlink('lock')"],
                               cwd=lock.parent)
    try:
        time.sleep(0.2)
        assert clear_stale_locks(env_for(tmp_path), lambda _: None, wait_limit=30) == []
        assert not lock.exists()
    finally:
        builder.wait()


def test_unbuilt_ops_are_the_ones_ninja_would_build(tmp_path):
    env = env_for(tmp_path)
    assert unbuilt_ops(env) == ["deepspeed_shm_comm", "fused_adam"]
    built = tmp_path / "fused_adam"
    built.mkdir()
    (built / "src.c").write_text("")
    (built / "build.ninja").write_text("rule cp\n  command = cp $in $out\nbuild fused_adam.so: cp src.c\n")
    assert unbuilt_ops(env) == ["deepspeed_shm_comm", "fused_adam"]  # no library yet
    (built / "fused_adam.so").write_text("")
    subprocess.run(["ninja", "-C", str(built)], check=True, capture_output=True, env={**os.environ, **env})
    assert unbuilt_ops(env) == ["deepspeed_shm_comm"]  # up to date
    os.utime(built / "src.c", (time.time() + 5, time.time() + 5))  # what a killed compile leaves: work to do
    assert unbuilt_ops(env) == ["deepspeed_shm_comm", "fused_adam"]
    assert unbuilt_ops({**env, "DS_ACCELERATOR": "cuda"}) == ["fused_adam"]  # a GPU rank loads fused_adam only


def test_preflight_builds_what_is_not_built_and_does_not_retry_a_failed_build(tmp_path, monkeypatch):
    calls: list[list[str]] = []
    monkeypatch.setattr(ext_locks, "build_ops", lambda ops, env, note, **_: calls.append(ops) or ["fused_adam"])
    lock = plant(tmp_path, "deepspeed_shm_comm", age=3600)
    pre = Preflight(note=lambda _: None)
    pre(env_for(tmp_path))
    pre(env_for(tmp_path))
    assert not lock.exists()
    assert calls == [["deepspeed_shm_comm", "fused_adam"], ["deepspeed_shm_comm"]]
