"""The user's training command: which launcher, which script, where the DeepSpeed config goes.

Accepted launchers (the command after `autotune run ... --`):

    deepspeed [launcher options] SCRIPT [script args]
    python -m deepspeed.launcher.runner [launcher options] SCRIPT [script args]
    torchrun [launcher options] SCRIPT [script args]
    python -m torch.distributed.run [launcher options] SCRIPT [script args]

The rule for the config (docs/user-script.md), looked for in the script args:

1. A literal `{config}` anywhere in a script argument (`--ds-config {config}`,
   `--cfg={config}`): every trial's config path replaces it; the starting config
   is `autotune run --config FILE`.
2. Otherwise exactly one `--deepspeed_config X` or `--deepspeed_config=X`
   (DeepSpeed's `add_config_arguments` name; `--deepscale_config` is its old alias), or
   HF Trainer's `--deepspeed X` (a TrainingArguments field that takes the file; DeepSpeed's own
   `--deepspeed` is a bare flag, so it counts only with a .json or .hjson file after it).
   X is the starting config and each trial's config path takes its place.
3. None of these: the script builds its config in code (`deepspeed.initialize(config=...)`).
4. Anything else is one UserError before any trial runs.

Launcher options are kept as written, except `--master_port`: each trial gets a
free port of its own (DeepSpeed's CPU comm op names its /dev/shm buffers by it,
and autotune removes them by it).
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from autotune.core.errors import UserError

PLACEHOLDER = "{config}"
CONFIG_FLAGS = ("--deepspeed_config", "--deepscale_config")
HF_CONFIG_FLAG = "--deepspeed"
"""HF Trainer's TrainingArguments field for the config file (DeepSpeed's own `--deepspeed` is a bare
flag: it counts as the config's only with a config file's name after it, `_hf_config_value`)."""
DEEPSPEED, TORCHRUN = "deepspeed", "torchrun"

# The launchers' own options, read from their argparse parsers (DeepSpeed 0.19.8,
# torch 2.13; tests/test_usercmd_parse.py pins them against the installed ones).
# Needed to tell where the launcher's options end and the script begins.
_LAUNCHER_FLAGS = {
    DEEPSPEED: frozenset({"--bind_cores_to_rank", "--force_multi", "--module", "--no_local_rank",
                          "--no_python", "--no_ssh", "--no_ssh_check", "--quiet", "--save_pid",
                          "-q"}),
    TORCHRUN: frozenset({"--module", "--no-python", "--no_python", "--run-path", "--run_path",
                         "--standalone", "--virtual-local-rank", "--virtual_local_rank", "-m"}),
}
_LAUNCHER_VALUED = {
    DEEPSPEED: frozenset({"--autotuning", "--bind_core_list", "--enable_each_rank_log", "--exclude",
                          "--hostfile", "--include", "--launcher", "--launcher_args", "--log_level",
                          "--master_addr", "--master_port", "--node_rank", "--num_accelerators",
                          "--num_gpus", "--num_nodes", "--ssh_port", "--venv_script", "-H", "-e",
                          "-i"}),
    TORCHRUN: frozenset({"--duplicate-stderr-filters", "--duplicate-stdout-filters",
                         "--duplicate_stderr_filters", "--duplicate_stdout_filters",
                         "--event-log-handler", "--event_log_handler", "--local-addr",
                         "--local-ranks-filter", "--local_addr", "--local_ranks_filter", "--log-dir",
                         "--log_dir", "--logs-specs", "--logs_specs", "--master-addr", "--master-port",
                         "--master_addr", "--master_port", "--max-restarts", "--max_restarts",
                         "--monitor-interval", "--monitor_interval", "--nnodes", "--node-rank",
                         "--node_rank", "--nproc-per-node", "--nproc_per_node", "--numa-binding",
                         "--numa_binding", "--rdzv-backend", "--rdzv-conf", "--rdzv-endpoint",
                         "--rdzv-id", "--rdzv_backend", "--rdzv_conf", "--rdzv_endpoint", "--rdzv_id",
                         "--redirects", "--role", "--shutdown-timeout", "--shutdown_timeout",
                         "--signals-to-handle", "--signals_to_handle", "--start-method",
                         "--start_method", "--tee", "-r", "-t"}),
}
_MASTER_PORT = frozenset({"--master_port", "--master-port"})
_NOT_A_FILE = frozenset({"--module", "-m", "--no_python", "--no-python"})
"""Launcher flags after which SCRIPT is a module or a program, not a file to check."""
_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")
_MODULES = {"deepspeed.launcher.runner": DEEPSPEED, "torch.distributed.run": TORCHRUN}
FORMS = ("deepspeed ...", "python -m deepspeed.launcher.runner ...", "torchrun ...",
         "python -m torch.distributed.run ...")


@dataclass(frozen=True, kw_only=True, slots=True)
class UserCommand:
    """A parsed training command; `argv_for` writes one trial's command line."""

    argv: tuple[str, ...]
    """The command exactly as the user gave it."""
    launcher: str
    """`deepspeed` or `torchrun` (whichever spelling started it)."""
    prefix: tuple[str, ...]
    """The tokens that start the launcher: ("deepspeed",) or ("python", "-m", "...")."""
    launcher_args: tuple[str, ...]
    script: str
    script_args: tuple[str, ...]
    config_at: int | None
    """Index in script_args of the `--deepspeed_config` value (None: the {config} placeholder, or
    a config built in code)."""
    user_config: str | None
    """The config path the command names; None with the placeholder (then --config gives it)."""
    config_in_code: bool = False
    """The command names no config: the script builds its own and hands it to
    `deepspeed.initialize` (`config=`), where the bootstrap reads it and gives each trial its own
    (autotune/rank/hook.py)."""

    @property
    def uses_placeholder(self) -> bool:
        return self.config_at is None and not self.config_in_code

    @property
    def config_flag(self) -> str | None:
        """The flag that names the config (`--deepspeed_config`, HF's `--deepspeed`); None: {config}
        or a config built in code."""
        if self.config_at is None:
            return None
        flag, eq, _ = self.script_args[self.config_at].partition("=")
        return flag if eq else self.script_args[self.config_at - 1]

    def config_path(self, given: str | None, cwd: Path, *, in_code: bool = False) -> Path | None:
        """The job's DeepSpeed config, absolute: the one the command names, or `--config` where
        the command takes it through {config}. Both, or neither: one line (`run` and `watch`).
        `in_code=True` (`run`): a command that names none builds its config in code: None."""
        if self.config_in_code:
            if not in_code:
                raise UserError(NO_CONFIG)
            if given:
                raise UserError(f"--config {given}: the command names no DeepSpeed config, so the script's "
                                "own (built in code) is the one it runs; drop --config, or pass the file to "
                                "the script as --deepspeed_config FILE")
            return None
        if self.uses_placeholder:
            if not given:
                raise UserError("the command takes the config through {config}; give the config file "
                                "with --config FILE")
            return (cwd / given).resolve()
        if given:
            raise UserError(f"the command already names the config ({self.user_config}); drop --config "
                            "or write {config} in the command")
        return (cwd / str(self.user_config)).resolve()

    def argv_for(self, ds_config: str | Path | None, master_port: int) -> list[str]:
        """This trial's command: its config path in the config's place (a config built in code
        is handed over by the bootstrap instead), its own master port."""
        script_args = list(self.script_args)
        if self.config_in_code:
            pass
        elif self.config_at is None:
            script_args = [a.replace(PLACEHOLDER, str(ds_config)) for a in script_args]
        else:
            i = self.config_at
            flag, eq, _ = script_args[i].partition("=")
            script_args[i] = f"{flag}={ds_config}" if eq and is_config_flag(flag) else str(ds_config)
        return [*self.prefix, *_without_master_port(self.launcher_args), "--master_port", str(master_port),
                self.script, *script_args]

    def cluster_options(self):
        """The command's own DeepSpeed launcher options that place the ranks (autotune/trials/multinode.py)."""
        from autotune.core.options import LauncherOptions

        if self.launcher != DEEPSPEED:
            return LauncherOptions()
        found = dict(_valued_options(self.launcher_args))
        ints = {}
        for name in ("num_nodes", "num_gpus", "ssh_port"):
            value = found.get(name)
            if value is not None:
                if not (value.isascii() and value.isdigit()):
                    raise UserError(f"--{name} {value!r} in the command is not a number")
                ints[name] = int(value)
        return LauncherOptions(hostfile=found.get("hostfile"), include=found.get("include", ""),
                               exclude=found.get("exclude", ""), master_addr=found.get("master_addr"),
                               launcher=found.get("launcher", "pdsh"), launcher_args=found.get("launcher_args", ""),
                               **ints)

    def with_launcher_options(self, argv: list[str]) -> UserCommand:
        """This command with autotune's own launcher options (`autotune run --hostfile ...`) added;
        an option the command already gives is kept as the user wrote it, a different value refused."""
        if not argv:
            return self
        if self.launcher != DEEPSPEED:
            raise UserError(f"{argv[0]} is an option of the deepspeed launcher; with {self.launcher}, "
                            "give the nodes in the command itself (--nnodes, --rdzv-endpoint, ...)")
        own = dict(_valued_options(self.launcher_args))
        added: list[str] = []
        for flag, value in zip(argv[::2], argv[1::2], strict=True):
            name = flag.lstrip("-")
            if name in own and own[name] != value:
                raise UserError(f"{flag} is given twice, {value!r} to autotune and {own[name]!r} in the "
                                "command; give it once")
            if name not in own:
                added += [flag, value]
        return dataclasses.replace(self, launcher_args=(*self.launcher_args, *added))

    def for_cluster(self, cluster) -> UserCommand:
        """The command as every trial on a multi-node `cluster` runs it: the master address and
        `--no_ssh_check` added as autotune.trials.multinode.cluster_args adds them for the built-in
        workload (autotune checked the hosts the way pdsh connects)."""
        from autotune.trials.multinode import cluster_args

        extra = cluster_args(cluster)
        flags = tuple(a for a in ("--no_ssh_check",) if a in extra and a not in self.launcher_args)
        merged = self.with_launcher_options([a for a in extra if a != "--no_ssh_check"])
        return dataclasses.replace(merged, launcher_args=(*merged.launcher_args, *flags))


def _valued_options(args: tuple[str, ...]):
    """(name, value) of the launcher options written `--name value` or `--name=value`."""
    short = {"-H": "hostfile", "-i": "include", "-e": "exclude"}
    i = 0
    while i < len(args):
        name, eq, value = args[i].partition("=")
        key = short.get(name, name.lstrip("-").replace("-", "_"))
        if eq:
            yield key, value
            i += 1
        elif name in _LAUNCHER_VALUED[DEEPSPEED] and i + 1 < len(args):
            yield key, args[i + 1]
            i += 2
        else:
            i += 1


def parse_command(argv: list[str] | tuple[str, ...], *, cwd: Path) -> UserCommand:
    """Read a training command; every problem is one UserError that says how to write it."""
    argv = tuple(argv)
    if not argv or not any(a.strip() for a in argv):
        raise UserError("no training command after `--`; write it as: autotune run -- deepspeed "
                        "train.py --deepspeed_config ds_config.json")
    launcher, prefix = _launcher(argv)
    rest = argv[len(prefix):]
    launcher_args, script_at, not_a_file = _launcher_options(launcher, rest)
    if script_at is None:
        raise UserError(f"the command names no training script after {' '.join(argv)!r}; "
                        f"write it as: {argv[0]} [launcher options] train.py [script args]")
    script, script_args = rest[script_at], rest[script_at + 1:]
    if not not_a_file and not (cwd / script).is_file():
        raise UserError(f"training script {script!r} not found (relative to {cwd}); "
                        "run autotune from the folder you would launch the job from")
    config_at, user_config, in_code = _find_config(script_args)
    return UserCommand(argv=argv, launcher=launcher, prefix=prefix, launcher_args=launcher_args,
                       script=script, script_args=script_args, config_at=config_at,
                       user_config=user_config, config_in_code=in_code)


def check_launcher_installed(cmd: UserCommand) -> None:
    """`deepspeed`/`torchrun` (or the python) must be on PATH: one line, not N failed trials."""
    exe = cmd.prefix[0]
    if shutil.which(exe) is None:
        raise UserError(f"{exe!r} not found on PATH; activate the environment the job runs in, "
                        "or give the launcher's full path")


def _launcher(argv: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    name = Path(argv[0]).name
    if name in (DEEPSPEED, TORCHRUN):
        return name, argv[:1]
    if _PYTHON.match(name) and len(argv) >= 3 and argv[1] == "-m" and argv[2] in _MODULES:
        return _MODULES[argv[2]], argv[:3]
    raise UserError(f"autotune starts the ranks through a launcher; {argv[0]!r} is not one: "
                    f"write the command as {', '.join(FORMS[:-1])} or {FORMS[-1]}")


def _launcher_options(launcher: str, rest: tuple[str, ...]) -> tuple[tuple[str, ...], int | None, bool]:
    """(launcher options, index of the script in `rest` or None, script is a module/program)."""
    flags, valued = _LAUNCHER_FLAGS[launcher], _LAUNCHER_VALUED[launcher]
    i, not_a_file = 0, False
    while i < len(rest):
        tok = rest[i]
        if not tok.startswith("-") or tok == "-":
            return rest[:i], i, not_a_file
        name, eq, _ = tok.partition("=")
        if name in flags and not eq:
            not_a_file = not_a_file or name in _NOT_A_FILE
            i += 1
        elif name in valued:
            if not eq and i + 1 >= len(rest):
                raise UserError(f"launcher option {name} needs a value")
            i += 1 if eq else 2
        else:
            raise UserError(f"{tok!r} is not an option of the {launcher} launcher, so autotune cannot "
                            "tell where the training script starts; spell the launcher's options out "
                            "in full (no abbreviations) before the script")
    return rest, None, not_a_file


NO_CONFIG = ("autotune cannot find the DeepSpeed config in the command: pass it to the script as "
             "--deepspeed_config FILE, or write {config} where the script takes it and give the starting "
             "config with --config FILE")


def _find_config(script_args: tuple[str, ...]) -> tuple[int | None, str | None, bool]:
    """(where the config's value is, the file named, whether the script builds its own in code)."""
    if any(PLACEHOLDER in a for a in script_args):
        return None, None, False
    hits = [i for i, a in enumerate(script_args) if a.partition("=")[0] in CONFIG_FLAGS
            or _hf_config_value(script_args, i) is not None]
    if not hits:
        return None, None, True
    if len(hits) > 1:
        raise UserError(f"the command names the DeepSpeed config {len(hits)} times; name it once "
                        "(--deepspeed_config FILE, or HF Trainer's --deepspeed FILE)")
    i = hits[0]
    flag, eq, value = script_args[i].partition("=")
    if eq:
        if not value:
            raise UserError(f"{flag}= has no file; write {flag}=ds_config.json")
        return i, value, False
    if i + 1 >= len(script_args) or script_args[i + 1].startswith("-"):
        raise UserError(f"{flag} has no file after it; write {flag} ds_config.json")
    return i + 1, script_args[i + 1], False


def is_config_flag(flag: str) -> bool:
    return flag in CONFIG_FLAGS or flag == HF_CONFIG_FLAG


def _hf_config_value(script_args: tuple[str, ...], i: int) -> str | None:
    """The file of HF Trainer's `--deepspeed FILE` (or `--deepspeed=FILE`) at `i`, else None."""
    flag, eq, value = script_args[i].partition("=")
    if flag != HF_CONFIG_FLAG:
        return None
    if not eq:
        value = script_args[i + 1] if i + 1 < len(script_args) else ""
    return value if value.endswith((".json", ".hjson")) else None


def _without_master_port(args: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        name, eq, _ = a.partition("=")
        if name in _MASTER_PORT:
            skip = not eq
            continue
        out.append(a)
    return out
