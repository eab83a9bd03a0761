"""What runs inside a training rank: the probe, the watchdog, the records, the built-in workload and
the bootstrap of a user's script. It imports only autotune.core, itself and exporters' rank endpoints."""
