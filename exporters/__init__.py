"""Ways metrics leave a process.

- `exporters.prometheus_rank.RankExporter`: one Prometheus endpoint per training rank
  (a StepRecord sink + a custom Collector).
- `exporters.prometheus_controller.ControllerExporter`: trial-level metrics of `autotune run`.
- `exporters.devices`: device samplers (NVML, CPU busy fraction) and CUDA allocator stats.
- `exporters.alerts_gen`: Prometheus alert rules generated from `rules/builtin.toml`.

Nothing here imports torch, DeepSpeed or pynvml at import time.
"""
