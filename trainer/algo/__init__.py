"""The learning side of a step: what the loss trains on (objective.py), the GRPO/DAPO loss
(grpo.py), AReaL's decoupled PPO loss (decoupled.py), and the micro-batched update (learner.py)."""
