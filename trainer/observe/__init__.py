"""What a run shows of itself: metric names and sinks (metric_names.py, metrics.py), where each
process's time went (timeline.py), GPU/CPU telemetry (system.py), the rollout inspector's record
(inspector.py) and mirrors to TensorBoard, W&B and MLflow (trackers/)."""
