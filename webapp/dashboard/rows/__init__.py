"""Reading a run's rows back, in one place: the metric points, histograms, events and the
WebSocket's messages after a cursor (stream.py), the rollout inspector's samples (samples.py) and
the timeline's spans (timeline.py). Writing them is the actions layer's (actions/rows.py), which
calls samples.py and timeline.py to clean a row before it is stored."""
