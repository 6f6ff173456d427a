"""A run over several processes: torchrun's process group (distributed.py), rank 0 the controller
with every rank a share of the update (training_ranks.py), FSDP2 (sharding.py), launching (launch.py)."""
