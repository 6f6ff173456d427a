"""What a run shows of itself: metric names and sinks, where each process's time went (timeline.py),
GPU/CPU telemetry, the rollout inspector's record, and mirrors to TensorBoard, W&B, MLflow (trackers/)."""
