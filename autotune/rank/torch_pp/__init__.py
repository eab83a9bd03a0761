"""The built-in workload under torch.distributed.pipelining (`--engine torch`, issue 28)."""
