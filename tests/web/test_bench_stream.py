"""`manage.py bench_stream` runs end to end at a toy size (its figures are measured, never
asserted): a real tiny run, daphne, and a WebSocket viewer that sees every step."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# not imported from conftest: importing it again under another name would run it again and
# point this session's environment (var dir, queues) somewhere else
ROOT = Path(__file__).resolve().parents[2]
SETUP = os.environ.get("RLPILOT_TEST_SETUP", "embedded")

pytestmark = pytest.mark.slow


def test_bench_stream_smoke(tmp_path):
    # a var dir, broker folders and queue names of its own: nothing shared with this test
    # session's worker (the filesystem broker keeps its queue bindings in files)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLPILOT_")}
    env["RLPILOT_VAR_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "manage.py", "bench_stream", "--setups", SETUP,
                          "--viewers", "1", "--steps", "3", "--json"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    one = json.loads(out.stdout)[SETUP]["1"]
    assert one["viewers_finished"] == 1 and one["samples"] >= 3 and one["steps"] == 3
    assert one["p50_ms"] > 0 and 0 < one["trainer_overhead_pct"] < 100
