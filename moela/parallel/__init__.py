"""Parallelism applied to the model from the outside: DeviceMesh, FSDP2, expert, context and tensor parallelism."""
