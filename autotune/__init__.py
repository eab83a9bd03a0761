"""autotune: profiling and auto-tuning advisor for DeepSpeed pipeline-parallel training."""

__version__ = "0.1.0"
