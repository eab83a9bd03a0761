"""The tuning run: its assembly, the loop, the proposers, the setting steps and the callbacks."""
