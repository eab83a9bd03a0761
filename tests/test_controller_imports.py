"""The controller imports only what it needs, when it needs it (issue 11: a run's own cost).

torch (1-3 s) is imported by the controller only to ask about a GPU or a reduced precision;
scikit-optimize, SciPy and matplotlib (2-4 s) arrive in a background thread
(autotune/tuning/preload.py) while the baseline starts its ranks. Each check runs in a fresh
interpreter, since pytest's own process has imported everything long ago.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from robust_helpers import FAST_CONFIG


def fresh_python(code: str, **env: str) -> dict:
    """Run `code` in a new interpreter; it prints one JSON object as its last line."""
    environ = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    environ.update(env)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         env=environ, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_no_gpu_device_means_cpu_ranks_without_importing_torch():
    got = fresh_python("""
        import json, sys
        from autotune.trials import launcher
        launcher.GPU_DEVICE_NODES = ("/nonexistent/nvidia0",)
        env = launcher.accelerator_env()
        print(json.dumps({"env": env, "torch": "torch" in sys.modules}))
    """)
    assert got["env"]["DS_ACCELERATOR"] == "cpu"
    assert got["torch"] is False


def test_a_gpu_device_file_makes_torch_decide(tmp_path):
    node = tmp_path / "nvidia0"
    node.write_text("")
    got = fresh_python(f"""
        import json, sys
        from autotune.trials import launcher
        launcher.GPU_DEVICE_NODES = ({str(node)!r},)
        env = launcher.accelerator_env()
        import torch
        print(json.dumps({{"env": env, "torch": "torch" in sys.modules, "cuda": torch.cuda.is_available()}}))
    """)
    assert got["torch"] is True  # asked, because a device file is there
    # torch's own answer decides: the CPU build here has no CUDA, so the ranks run on the CPU
    assert ("DS_ACCELERATOR" in got["env"]) == (not got["cuda"])


def test_an_fp32_config_is_checked_without_asking_the_devices():
    got = fresh_python(f"""
        import json, sys
        from autotune.core.dsconfig import DsConfig
        from autotune.trials.precision import check_precision
        check_precision(DsConfig.from_dict({FAST_CONFIG!r}))
        print(json.dumps({{"torch": "torch" in sys.modules}}))
    """)
    assert got["torch"] is False


def test_the_optimizer_imports_skopt_only_when_it_fits_and_after_the_preload():
    got = fresh_python("""
        import json, sys
        from autotune.tuning import preload
        from autotune.core.trial_result import STATUS_OK, TrialResult
        from autotune.tuning.proposers.registry import make_proposer
        from autotune.core.space import SearchSpace
        space = SearchSpace.build(pipeline_stages=2, data_parallel_size=2, zero_stage=1, micro_max=16,
                                  gas_max=16, max_global_batch=256)
        p = make_proposer("hybrid", space, seed=0, moves=lambda *a, **k: [])
        built = "skopt" in sys.modules
        preload.start()
        preload.wait()
        loaded = {m: m in sys.modules for m in preload.RUN_MODULES}
        for n in range(7):  # past the initial points: the GP is fitted
            prop = p.ask()
            p.tell(prop.config, TrialResult(status=STATUS_OK,
                                            samples_per_second=10.0 + prop.config.micro_batch_size))
        print(json.dumps({"built": built, "loaded": loaded, "source": p.ask().source}))
    """)
    assert got["built"] is False  # building the proposer did not pay for skopt
    assert all(got["loaded"].values()), got["loaded"]
    assert got["source"]  # and the proposer still works once it has


def test_a_missing_module_leaves_the_preload_quiet():
    got = fresh_python("""
        import json
        from autotune.tuning import preload
        preload.start(("no_such_module_for_autotune", "json"))
        preload.wait()
        preload.start(("another_one",))  # once per process: a second start is a no-op
        preload.wait()
        print(json.dumps({"ok": True}))
    """)
    assert got == {"ok": True}
