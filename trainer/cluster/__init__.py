"""A run over several processes: torchrun's process group (distributed.py), FSDP2 (sharding.py),
launching (launch.py). What each rank does in a run (rank 0 the controller, every rank a share of
the update) is the run's: trainer/run/training_ranks.py."""
