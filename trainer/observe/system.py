"""System telemetry, sampled in a background thread once a second.

With an NVIDIA GPU (NVML through nvidia-ml-py): `system/gpu_util` (%), `system/gpu_mem_gb`,
`system/gpu_power_w` (means over devices) and the same per device (`system/gpu0/util`, ...).
Without one: `system/cpu_util` (% of all cores) and `system/ram_gb` (this process's resident
memory). `summary()` returns the mean of the samples taken since the previous call, so each
training step reports the utilisation during that step; the CPU share is measured over exactly
that window (busy CPU time / elapsed CPU time between two calls).

Per process (`ProcessMeter`): `proc/<lane>/cpu_pct` and `proc/<lane>/rss_gb` for each process
of the run (the timeline's lanes: rank 0, the other training ranks, an engine process).
"""
from __future__ import annotations

import threading

import psutil


class _Nvml:
    def __init__(self):
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        self.nv = pynvml
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                        for i in range(pynvml.nvmlDeviceGetCount())]
        if not self.handles:
            raise RuntimeError("no NVIDIA device")

    def read(self) -> dict[str, float]:
        out: dict[str, float] = {}
        utils, mems, powers = [], [], []
        for i, h in enumerate(self.handles):
            util = float(self.nv.nvmlDeviceGetUtilizationRates(h).gpu)
            mem = self.nv.nvmlDeviceGetMemoryInfo(h).used / 2**30
            try:
                power = self.nv.nvmlDeviceGetPowerUsage(h) / 1000.0
            except self.nv.NVMLError:
                power = float("nan")
            out[f"system/gpu{i}/util"], out[f"system/gpu{i}/mem_gb"] = util, mem
            out[f"system/gpu{i}/power_w"] = power
            utils.append(util), mems.append(mem), powers.append(power)
        out["system/gpu_util"] = sum(utils) / len(utils)
        out["system/gpu_mem_gb"] = sum(mems) / len(mems)
        out["system/gpu_power_w"] = sum(powers) / len(powers)
        return out

    def close(self):
        try:
            self.nv.nvmlShutdown()
        except Exception:
            pass


def _open_nvml():
    try:
        return _Nvml()
    except Exception:  # no driver, no device, no library: fall back to CPU telemetry
        return None


class SystemSampler:
    def __init__(self, interval_s: float = 1.0, use_gpu: bool = True):
        self.interval = interval_s
        self.nvml = _open_nvml() if use_gpu else None
        self.proc = psutil.Process()
        # the window's start. Not psutil.cpu_percent(interval=None): its reference point is
        # module-global (any caller in the process moves it) and a call right after another one
        # returns 0 or noise, which drew false dips on the CPU chart after a resume
        self._cpu_mark = psutil.cpu_times()
        self._lock = threading.Lock()
        self._samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rlpilot-system", daemon=True)

    @property
    def has_gpu(self) -> bool:
        return self.nvml is not None

    def start(self) -> "SystemSampler":
        self._cpu_mark = psutil.cpu_times()
        self._thread.start()
        return self

    def sample(self) -> dict[str, float]:
        if self.nvml is not None:
            return self.nvml.read()
        return {"system/ram_gb": self.proc.memory_info().rss / 2**30}

    def _cpu_util(self) -> float | None:
        """% of all cores busy since the previous call (None: too short a window to say)."""
        now = psutil.cpu_times()
        before, self._cpu_mark = self._cpu_mark, now
        total = sum(now) - sum(before)
        idle = (now.idle - before.idle) + (getattr(now, "iowait", 0.0) - getattr(before, "iowait", 0.0))
        if total <= 0.02:   # cpu_times ticks at 10 ms
            return None
        return min(100.0, max(0.0, 100.0 * (total - idle) / total))

    def _loop(self):
        while not self._stop.wait(self.interval):
            s = self.sample()
            with self._lock:
                self._samples.append(s)

    def summary(self) -> dict[str, float]:
        with self._lock:
            samples, self._samples = self._samples, []
        if not samples:
            samples = [self.sample()]
        keys = samples[-1].keys()
        out = {k: sum(s.get(k, 0.0) for s in samples) / len(samples) for k in keys}
        if self.nvml is None:
            cpu = self._cpu_util()
            if cpu is not None:
                out["system/cpu_util"] = cpu
        return out

    def close(self):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self.nvml is not None:
            self.nvml.close()


def process_usage(pid: int | None = None) -> tuple[float, int] | None:
    """(CPU seconds used so far, resident bytes) of a process (default: this one); None when
    it is gone."""
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            t = p.cpu_times()
            return t.user + t.system, p.memory_info().rss
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def lane_key(lane: str) -> str:
    """A timeline lane as a metric name part: "rank 0" -> "rank0"."""
    return "".join(c for c in lane if c.isalnum() or c in "_-")


class ProcessMeter:
    """CPU and memory per process of the run, one series per timeline lane (trainer/observe/timeline.py):
    `proc/<lane>/cpu_pct` (% of one core, 100 = one core busy, as `top` counts) over the time
    since that lane's previous reading, and `proc/<lane>/rss_gb`. Readings come from psutil for
    processes on this machine (`local`) or from the process itself (`observe`: a training rank
    sends its own with its report, so it works across machines)."""

    def __init__(self):
        self._last: dict[str, tuple[float, float]] = {}   # lane -> (clock.now(), CPU seconds)

    def observe(self, lane: str, cpu_s: float, rss_bytes: int, now: float) -> dict[str, float]:
        key = lane_key(lane)
        out = {f"proc/{key}/rss_gb": rss_bytes / 2**30}
        last = self._last.get(lane)
        if last is not None and now - last[0] <= 0.05:
            return out   # too short a window to say (CPU time counts in ticks): the next one will
        self._last[lane] = (now, cpu_s)
        if last is not None:
            out[f"proc/{key}/cpu_pct"] = max(0.0, 100.0 * (cpu_s - last[1]) / (now - last[0]))
        return out

    def local(self, lanes: dict[str, int], now: float) -> dict[str, float]:
        """Readings of {lane: pid} on this machine (a process gone is left out)."""
        out: dict[str, float] = {}
        for lane, pid in lanes.items():
            usage = process_usage(pid)
            if usage is not None:
                out.update(self.observe(lane, *usage, now))
        return out
