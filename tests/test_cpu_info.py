"""py-cpuinfo asked once per CPU, not twice per rank (autotune/rank/cpu_info.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from autotune.rank import cpu_info

CPU_A = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 106
model name\t: Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz
cpu MHz\t\t: 2899.970
flags\t\t: fpu vme avx2 avx512f

processor\t: 1
vendor_id\t: GenuineIntel
cpu MHz\t\t: 1200.000
"""


def test_the_key_names_the_cpu_not_its_clock():
    assert cpu_info.cpu_key(CPU_A) == cpu_info.cpu_key(CPU_A.replace("2899.970", "3100.000"))
    assert cpu_info.cpu_key(CPU_A) != cpu_info.cpu_key(CPU_A.replace(" avx512f", ""))  # AMD EPYC without AVX-512
    assert cpu_info.cpu_key(CPU_A) != cpu_info.cpu_key(CPU_A.replace("8375C", "8480C"))
    assert cpu_info.cpu_key("") is None
    assert cpu_info.cpu_key(cpu_info.CPUINFO.read_text()) == cpu_info.cpu_key()


def test_the_cache_folder_follows_the_conventions(tmp_path):
    assert cpu_info.cache_dir({"AUTOTUNE_CACHE_DIR": str(tmp_path)}) == tmp_path
    assert cpu_info.cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "autotune"
    assert cpu_info.cache_dir({"HOME": str(tmp_path)}) == tmp_path / ".cache" / "autotune"


def test_the_first_answer_is_kept_and_read_back(tmp_path):
    calls = []

    def ask():
        calls.append(1)
        return {"arch": "X86_64", "flags": ["avx2"]}

    path = tmp_path / "c" / "cpu-info-k.json"
    assert cpu_info.cached_answer(ask, path) == {"arch": "X86_64", "flags": ["avx2"]}
    assert cpu_info.cached_answer(ask, path) == {"arch": "X86_64", "flags": ["avx2"]}
    assert len(calls) == 1
    assert json.loads(path.read_text())["flags"] == ["avx2"]


def test_ranks_starting_together_ask_once(tmp_path):
    calls = []

    def ask():
        calls.append(1)
        time.sleep(0.3)  # py-cpuinfo's subprocess: the others must wait, not ask too
        return {"arch": "X86_64", "flags": ["avx2"]}

    path = tmp_path / "cpu-info-k.json"
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(cpu_info.cached_answer(ask, path)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert answers == [{"arch": "X86_64", "flags": ["avx2"]}] * 4


@pytest.mark.parametrize("stored", ["{not json", "[]", '{"arch": "X86_64"}'])
def test_a_broken_or_empty_entry_is_asked_again(tmp_path, stored):
    path = tmp_path / "cpu-info-k.json"
    path.write_text(stored)
    assert cpu_info.cached_answer(lambda: {"flags": ["sse2"]}, path) == {"flags": ["sse2"]}
    assert json.loads(path.read_text()) == {"flags": ["sse2"]}


def test_a_failed_answer_is_not_kept(tmp_path):
    path = tmp_path / "cpu-info-k.json"
    assert cpu_info.cached_answer(lambda: {}, path) == {}  # py-cpuinfo's answer when it failed
    assert not path.exists()


def test_an_unwritable_cache_still_answers(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cpu_info.cached_answer(lambda: {"flags": ["sse2"]}, blocker / "sub" / "x.json") == {"flags": ["sse2"]}


def _python(code: str, cache, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "AUTOTUNE_CACHE_DIR": str(cache), "DS_ACCELERATOR": "cpu", **env})


def test_deepspeed_op_builder_reads_the_cached_answer(tmp_path):
    """The real py-cpuinfo answers the first process; in the next one, whose py-cpuinfo is made to
    fail if asked, DeepSpeed's builder trips that trap without the cache (so the check can fail)
    and, with it, reads the same flags from the cache."""
    flags = ("from deepspeed.ops.op_builder.cpu import FusedAdamBuilder as B; b = B(); "
             "print(repr((b.cpu_arch(), b.simd_width())))")
    first = _python(f"from autotune.rank import cpu_info; assert cpu_info.install(); {flags}", tmp_path)
    assert first.returncode == 0, first.stderr
    [entry] = tmp_path.glob("cpu-info-*.json")
    import cpuinfo

    assert json.loads(entry.read_text())["flags"] == cpuinfo.get_cpu_info()["flags"]
    second = _python(
        "import cpuinfo\n"
        "class Asked(BaseException): pass\n"  # not an Exception: DeepSpeed's fallback to lscpu must not catch it
        "def refuse(): raise Asked()\n"
        "cpuinfo.get_cpu_info = cpuinfo.cpuinfo.get_cpu_info = refuse\n"
        "from deepspeed.ops.op_builder.cpu import FusedAdamBuilder as B\n"
        "try:\n    B().cpu_arch()\nexcept Asked:\n    print('trap fired')\n"
        f"from autotune.rank import cpu_info; assert cpu_info.install(); {flags}", tmp_path)
    assert second.returncode == 0, second.stderr
    assert second.stdout.splitlines()[-2:] == ["trap fired", first.stdout.splitlines()[-1]]


@pytest.mark.parametrize(("mode", "cached"), [("trial", True), ("probe", True), ("watch", False)])
def test_the_users_command_gets_the_cache_in_trials_but_not_when_watched(tmp_path, monkeypatch, mode, cached):
    """The bootstrap installs it when the script imports deepspeed, except in `autotune watch`,
    which leaves the user's own run as it is. In this process: py-cpuinfo is restored afterwards,
    and the parts hook (which would patch the real DeepSpeed) is left out."""
    import types

    import cpuinfo

    from autotune.core.rank_plan import RankPlan
    from autotune.rank import hook, wiring

    monkeypatch.setattr(cpuinfo, "get_cpu_info", cpuinfo.get_cpu_info)
    monkeypatch.setattr(cpuinfo.cpuinfo, "get_cpu_info", cpuinfo.cpuinfo.get_cpu_info)
    monkeypatch.setattr(wiring, "force_parts", lambda plan: None)
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path))
    settings = hook.BootstrapSettings(plan=RankPlan(trial_dir=str(tmp_path)), mode=mode)
    hook._patch(types.SimpleNamespace(initialize=lambda *a, **k: None), hook._RankState(settings))
    assert getattr(cpuinfo.get_cpu_info, "autotune_cached", False) is cached
