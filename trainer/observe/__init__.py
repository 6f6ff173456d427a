"""What a run records of itself as it goes: metric names and sinks (metrics.py, metric_names.py),
where each process's time went (timeline.py, clock.py), GPU/CPU telemetry (system.py), and mirrors
to TensorBoard, W&B, MLflow (trackers/). The accounts kept from these records (cost, forecast,
estimate, the inspector's record) are trainer/accounting/."""
