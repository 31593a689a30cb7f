"""Across processes (torch.distributed): collectives of the schedule and sequence parallelism."""
