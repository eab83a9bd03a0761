"""How long a rank holds torch's extension lock, and how long it holds it with no build process.

The pre-flight (autotune/trials/ext_locks.py) calls a lock stale when no process works in the op's
build folder and the lock is older than YOUNG_SECONDS. This measures the moments that rule
must not misjudge: a fresh process loads DeepSpeed's CPU ops (as every rank does at
start-up) while this one samples, every millisecond, whether each op's lock exists and
whether a process holds it (has it open, or works in its folder). It prints, over all
loads, the longest time a lock existed, the longest stretch with no holder at all (the
rule as root), and the longest with no process in its folder (what the age rule covers,
for holders whose descriptors cannot be read).

Runs on a copy of the machine's extension cache (its own TORCH_EXTENSIONS_DIR).

    .venv/bin/python benchmarks/ext_lock_window.py --loads 20
    .venv/bin/python benchmarks/ext_lock_window.py --loads 20 --burner   # a CPU burner beside it
    .venv/bin/python benchmarks/ext_lock_window.py --quick               # CI smoke run: 3 loads
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autotune.trials.ext_locks import (  # noqa: E402
    CPU_OPS,
    YOUNG_SECONDS,
    build_ops,
    extension_roots,
    holders,
    unbuilt_ops,
)
from autotune.trials.launcher import with_own_tools  # noqa: E402

LOAD = ("from deepspeed.accelerator import get_accelerator\nacc = get_accelerator()\n"
        "for name in ('ShareMemCommBuilder', 'FusedAdamBuilder'):\n    acc.create_op_builder(name).load(verbose=False)\n")


def _cwd(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", type=int, default=20)
    ap.add_argument("--burner", action="store_true", help="a busy loop on each core beside the loads")
    ap.add_argument("--quick", action="store_true", help="3 loads: a smoke run (CI)")
    args = ap.parse_args(argv)
    if args.quick:
        args.loads = 3
    # torch's own cache names the CPU folder py311_cpu; a TORCH_EXTENSIONS_DIR is used as it is
    roots = [r for r in extension_roots() if r.name.endswith("_cpu") or os.environ.get("TORCH_EXTENSIONS_DIR")]
    roots = [r for r in roots if any((r / op).is_dir() for op in CPU_OPS)]
    if not roots:
        print("no built CPU ops in the torch extension cache: run ./scripts/setup first")
        return 2
    work = Path(tempfile.mkdtemp(prefix="ext-lock-window-"))
    ext = work / "ext"
    shutil.copytree(roots[0], ext, symlinks=True, ignore=shutil.ignore_patterns("lock"))
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext), "DS_ACCELERATOR": "cpu",
           "PATH": with_own_tools(os.environ.get("PATH", ""))}
    if unbuilt_ops(env):  # built by another ninja or venv: build first, the loads are to be no-ops
        failed = build_ops(unbuilt_ops(env), env, lambda _text: None)
        if failed:
            print(f"could not build {', '.join(failed)} in the copy")
            return 1
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)] \
        if args.burner else []
    held = {op: 0.0 for op in CPU_OPS}
    bare = {op: 0.0 for op in CPU_OPS}
    unheld = {op: 0.0 for op in CPU_OPS}
    episodes = {op: 0 for op in CPU_OPS}
    try:
        for _ in range(args.loads):
            proc = subprocess.Popen([sys.executable, "-c", LOAD], env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            since: dict[str, float | None] = {op: None for op in CPU_OPS}
            bare_since: dict[str, float | None] = {op: None for op in CPU_OPS}
            unheld_since: dict[str, float | None] = {op: None for op in CPU_OPS}
            while proc.poll() is None:
                now = time.monotonic()
                for op in CPU_OPS:
                    if (ext / op / "lock").exists():
                        if since[op] is None:
                            since[op] = now
                            episodes[op] += 1
                        pids, _ = holders(ext / op / "lock")
                        in_folder = [p for p in pids if _cwd(p).startswith(str(ext / op))]
                        for seen, since_map, longest in ((pids, unheld_since, unheld),
                                                         (in_folder, bare_since, bare)):
                            if seen:
                                since_map[op] = None
                            elif since_map[op] is None:
                                since_map[op] = now
                            else:
                                longest[op] = max(longest[op], now - since_map[op])
                    else:
                        if since[op] is not None:
                            held[op] = max(held[op], now - since[op])
                        since[op], bare_since[op], unheld_since[op] = None, None, None
                time.sleep(0.001)
            if proc.returncode != 0:
                print(f"a load failed (exit {proc.returncode})")
                return 1
    finally:
        for b in burners:
            b.kill()
        shutil.rmtree(work, ignore_errors=True)
    print(f"ext_lock_window: {args.loads} loads in fresh processes{' beside a CPU burner' if burners else ''}")
    print(f"{'op':<20} {'seen held':>9} {'longest held s':>14} {'no holder s':>11} {'no process in folder s':>22}")
    for op in CPU_OPS:
        print(f"{op:<20} {episodes[op]:>9} {held[op]:>14.3f} {unheld[op]:>11.3f} {bare[op]:>22.3f}")
    print(f"YOUNG_SECONDS (where a holder could hide, a lock younger than this is kept) = {YOUNG_SECONDS:.1f}: "
          f"{YOUNG_SECONDS / max(max(bare.values()), 1e-3):.0f}x the longest stretch with no process in the folder")
    return 0


if __name__ == "__main__":
    sys.exit(main())
