"""Tune the user's own training command: `autotune run -- deepspeed train.py --deepspeed_config X`.

- command.py: read the command (launcher, script, where the config goes) and
  write each trial's command line.
- hook.py + bootstrap/sitecustomize.py: instrument the script's PipelineEngine
  from outside, and end the rank after the trial's steps.
- runner.py: run one trial (or the start-up shape probe) and classify it.
- prepare.py: turn `autotune run` options with a command into a tunable study.

Kept import-light: the ranks import autotune.rank.hook at interpreter start.
"""
