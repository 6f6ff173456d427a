"""The command line, `python -m trainer COMMAND`: main.py parses and dispatches (run, control,
knobs, presets, warmup); each larger command has its own module (samples, reward, advise, docs)."""
