"""Crashes before any DeepSpeed code runs."""

import no_such_module_for_autotune  # noqa: F401
