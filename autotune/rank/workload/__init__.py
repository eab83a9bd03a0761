"""The built-in workload: a LLaMA-style decoder as a DeepSpeed PipelineModule."""
