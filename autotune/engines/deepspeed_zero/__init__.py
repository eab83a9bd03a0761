"""DeepSpeed's plain engine with ZeRO (`--engine zero`): the built-in workload's third engine (autotune/engines/)."""
