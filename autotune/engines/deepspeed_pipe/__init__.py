"""DeepSpeed's PipelineEngine: the default engine of the built-in workload (autotune/engines/)."""
