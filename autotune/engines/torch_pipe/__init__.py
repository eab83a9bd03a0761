"""torch.distributed.pipelining (`--engine torch`): the built-in workload's second engine (autotune/engines/)."""
