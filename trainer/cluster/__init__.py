"""A run split over processes: torch.distributed under torchrun (distributed.py), rank 0 the
controller and every rank a share of the update (training_ranks.py), FSDP2 (sharding.py), and
torchrun as a child that dies with its parent (launch.py)."""
