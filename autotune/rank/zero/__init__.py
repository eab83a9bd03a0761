"""The plain DeepSpeedEngine (ZeRO stage 0-3) as the rank side reads an engine (`--engine zero`)."""
