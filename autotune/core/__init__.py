"""The data model every side shares: options, configs, the space, metrics columns, signals, the
rank plan. It imports nothing else of autotune (tests/test_architecture.py)."""
