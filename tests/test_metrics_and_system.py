"""Histogram binning, percentiles, the system sampler without a GPU, and CPU and memory per
process."""
import os
import time

from trainer.observe.metrics import histogram, length_edges, percentile
from trainer.observe.system import SystemSampler


def test_histogram_counts_every_value_in_fixed_bins():
    edges = length_edges(256, bins=32)
    assert edges[0] == 0 and edges[-1] == 256 and len(edges) == 33
    h = histogram([0, 7, 8, 255, 256, 900, -3], edges)
    assert sum(h["counts"]) == 7
    assert h["counts"][0] == 3  # 0, 7 and the clamped -3
    assert h["counts"][1] == 1 and h["counts"][-1] == 3  # 8; 255, 256 and the clamped 900


def test_percentile_interpolates():
    assert percentile([1, 2, 3, 4], 0.5) == 2.5 and percentile([], 0.9) == 0.0
    assert percentile([5], 0.9) == 5


def test_system_sampler_reports_cpu_and_ram_without_a_gpu():
    s = SystemSampler(interval_s=0.05, use_gpu=False).start()
    try:
        import time
        time.sleep(0.2)
        m = s.summary()
    finally:
        s.close()
    assert set(m) == {"system/cpu_util", "system/ram_gb"}
    assert 0 <= m["system/cpu_util"] <= 100 and 0 < m["system/ram_gb"] < 64
    assert not s._thread.is_alive()


def test_cpu_utilisation_is_the_steps_own_window():
    """A step that keeps one core busy reports at least most of one core's share, whatever else
    in the process called psutil meanwhile; a window too short to measure reports no CPU figure
    (a gap on the chart), never a false 0."""
    import os
    import time

    import psutil

    s = SystemSampler(interval_s=10.0, use_gpu=False).start()   # no loop sample in the window
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.5:
            psutil.cpu_percent(interval=None)   # another caller moving psutil's global mark
        busy = s.summary()["system/cpu_util"]
        assert busy >= 0.7 * 100 / os.cpu_count(), busy
        assert "system/cpu_util" not in s.summary() and "system/ram_gb" in s.summary()
    finally:
        s.close()


def test_process_meter_counts_cpu_seconds_per_lane():
    from trainer.observe.system import ProcessMeter, lane_key

    meter = ProcessMeter()
    assert meter.observe("rank 1", 10.0, 2**30, now=100.0) == {"proc/rank1/rss_gb": 1.0}   # no window yet
    assert meter.observe("rank 1", 11.5, 2**29, now=102.0) == {"proc/rank1/rss_gb": 0.5,
                                                                "proc/rank1/cpu_pct": 75.0}
    assert lane_key("gen 3") == "gen3"
    busy = meter.local({"rank 0": os.getpid()}, now=time.time())
    assert set(busy) == {"proc/rank0/rss_gb"} and busy["proc/rank0/rss_gb"] > 0
    assert meter.local({"gone": 2**22 + 12345}, now=time.time()) == {}   # no such process
