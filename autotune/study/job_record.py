"""The study's record of what it ran: the user's command (meta key `user_command`, written by
autotune/usercmd/job.py) or the built-in workload's options (`workload`), and that job in words.

The record's reader lives with the study, so `run`'s output, summary.json, report.md and
report.html describe a study without importing the feature that wrote it.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from typing import Any

META_KEY = "user_command"
COMMAND_SHOWN = 160
"""Characters of the command the run's header and the reports show; a longer one is cut after a word."""


def short_command(argv: list[str], limit: int = COMMAND_SHOWN) -> str:
    """The command as typed (shell-quoted where a word needs it); past `limit` characters cut after a
    word, with how many arguments were left out. The first word is always shown."""
    words = [shlex.quote(str(w)) for w in argv]
    text = " ".join(words)
    if len(text) <= limit:
        return text
    kept: list[str] = []
    for word in words:
        if kept and len(" ".join([*kept, word])) > limit - 24:  # room for " ... (NN more arguments)"
            break
        kept.append(word)
    left = len(words) - len(kept)
    if not left:  # one long word
        return text
    return " ".join(kept) + f" ... ({left} more argument{'' if left == 1 else 's'})"


def describe_job(user_command: dict[str, Any] | None, workload: dict[str, Any] | None,
                 quote: Callable[[str], str] = str) -> str:
    """What a study ran, in words: the user's command and what its start-up check read, or the
    built-in workload's preset; for the run's header, summary.json, report.md and report.html.

    `user_command` is the study's stored meta (`META_KEY`), `workload` its workload options. A
    study stored before a field says what it has (stages and dp are then the workload's, which
    the check set); `quote` marks the command (report.md: as code).
    """
    wl = workload or {}
    uc = user_command or {}
    stages = uc.get("pipeline_stages") or wl.get("pipeline_stages")
    dp = uc.get("data_parallel_size") or wl.get("data_parallel_size")
    layout = ""
    if isinstance(stages, int) and isinstance(dp, int):
        layout = (f"{stages} pipeline stages x {dp} data-parallel = {stages * dp} ranks" if stages > 1
                  else f"{dp} data-parallel ranks, not a pipeline job")
    if not uc.get("argv"):
        return ", ".join(p for p in (f"workload {wl['preset']}" if wl.get("preset") else "", layout) if p)
    facts = []
    if isinstance(uc.get("parameters"), int):
        facts.append(f"{uc['parameters']:,} parameters")
    facts.append(layout)
    micro, gas = uc.get("micro_batch_size"), uc.get("gradient_accumulation_steps")
    if uc.get("engine") == "torch_pipelining":  # autotune/usercmd/torch_job.py: no DeepSpeed config
        facts.append(f"torch.distributed.pipelining, schedule {uc.get('schedule')}, n_microbatches {gas} "
                     f"of the step's batch {uc.get('step_batch')}")
    elif micro and gas:
        facts.append(f"micro-batch {micro} x GAS {gas} in its config"
                     + (" (built in code)" if uc.get("script_config") is not None else ""))
    facts = [f for f in facts if f]
    checked = f" (start-up check: {', '.join(facts)})" if facts else ""
    return f"the command {quote(short_command(uc['argv']))}{checked}"
