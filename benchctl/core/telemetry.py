"""Telemetry: wall-clock timers, peak memory (torch, NVML in a background thread, process RSS), environment.

Timers synchronise CUDA before reading the clock so GPU work is counted where it happens. Peak GPU memory
is read three ways on CUDA: torch's peak allocated and reserved (reset per phase), and NVML's device memory used,
sampled in a thread (what nvidia-smi shows, including the CUDA context). NVML is optional in every respect: any of its
calls may fail (no library in a container, NOT_SUPPORTED on a MIG slice), so each reading is taken on its own, a
missing one stays None and `NvmlSampler.note` says why; a training run never stops because of it. Without an NVIDIA
driver the same fields exist with GPU values None and the process peak RSS is recorded instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from benchctl import __version__
from benchctl.core.errors import ConfigError

PROJECT_DIR = Path(__file__).resolve().parents[2]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """Accumulates the time of the timed sections; `with sw: ...` (CUDA synchronised on both ends).

    Three clocks over the same sections: wall time (`total`), the process's CPU time (`cpu_total`: every thread of
    the process, so T busy threads count T seconds per second; a process descheduled by other load does not accrue
    it, which is why it survives a shared machine), and on CUDA with `cuda_events` the GPU's own time between two
    CUDA events (`cuda_total`), which excludes the host's launch gaps before the first kernel.
    """

    def __init__(self, device: torch.device, cuda_events: bool = False):
        self.device = device
        self.total = 0.0
        self.cpu_total = 0.0
        self.cuda_total: float | None = 0.0 if (cuda_events and device.type == "cuda") else None
        self.count = 0
        self._t0 = self._c0 = 0.0
        self._events: tuple[Any, Any] | None = None
        self.last = 0.0

    def __enter__(self) -> Stopwatch:
        sync(self.device)
        if self.cuda_total is not None:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self._c0 = time.process_time()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._events is not None:
            self._events[1].record()
        sync(self.device)
        self.last = time.perf_counter() - self._t0
        self.cpu_total += time.process_time() - self._c0
        self.total += self.last
        if self._events is not None and self.cuda_total is not None:
            self.cuda_total += self._events[0].elapsed_time(self._events[1]) / 1000.0  # ms; synchronised above
            self._events = None
        self.count += 1


def peak_rss_bytes() -> int | None:
    """Peak resident set size of this process (ru_maxrss is KiB on Linux, bytes on macOS); None where the `resource`
    module does not exist (native Windows)."""
    try:
        import resource  # POSIX only
    except ImportError:
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def current_rss_bytes() -> int | None:
    """This process's resident set size now (Linux /proc/self/statm); None where that file does not exist."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


_peak_rss_reset = False


def reset_peak_rss() -> bool:
    """Start a new peak-RSS phase for this process (Linux: writing 5 to /proc/self/clear_refs sets the high-water
    mark to the current RSS). Without it a process that trains several runs in turn (train-all) would report every
    run's peak as the largest of all earlier runs. False where the kernel does not offer it (the lifetime peak is
    then all there is)."""
    global _peak_rss_reset
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    _peak_rss_reset = True
    return True


def run_peak_rss_bytes() -> int | None:
    """The peak RSS since `reset_peak_rss` (VmHWM of /proc/self/status, or the current VmRSS where that is larger:
    the kernel raises the high-water mark lazily, so right after a reset it can lag the RSS that followed), else the
    process's lifetime peak."""
    if _peak_rss_reset:
        try:
            kb = {}
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith(("VmHWM:", "VmRSS:")):
                    kb[line.split(":")[0]] = int(line.split()[1])
            if "VmHWM" in kb:
                return max(kb.values()) * 1024
        except (OSError, IndexError, ValueError):
            pass
    return peak_rss_bytes()


def load_average() -> float | None:
    """The machine's 1-minute load average (runnable plus uninterruptible threads, exponentially averaged over about
    a minute); None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def _env_count(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"{name}={raw!r} must be a whole number >= 1")
    return n


def threads_used() -> int:
    """The threads a run computes with: BENCHCTL_THREADS when a parallel executor set it for the process, else
    torch's intra-op threads."""
    return _env_count("BENCHCTL_THREADS") or torch.get_num_threads()


def concurrent_jobs() -> int:
    """How many benchctl jobs share the machine on purpose (BENCHCTL_CONCURRENT_JOBS, set by a parallel executor
    for each job it starts); 1 when unset."""
    return _env_count("BENCHCTL_CONCURRENT_JOBS") or 1


class _Periodic:
    """A reading taken every `interval` seconds in a daemon thread, once when it starts and once when it stops (so
    even a run of a few seconds has readings). Subclasses define `_read`, which must never raise."""

    interval: float
    _stop: threading.Event
    _thread: threading.Thread | None

    def _read(self) -> None:
        raise NotImplementedError

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._read()

    def _start_thread(self, name: str) -> None:
        self._read()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _stop_thread(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=2.0)
            self._thread = None
            self._read()


class LoadSampler(_Periodic):
    """Samples the 1-minute load average every `interval` seconds in a daemon thread, once more at start and stop
    (so even a run of a few seconds has readings); `total` and `n` add up the readings. Never raises."""

    def __init__(self, interval: float = 2.0):
        self.interval = interval
        self.total = 0.0
        self.n = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> None:
        v = load_average()
        if v is not None:
            self.total += v
            self.n += 1

    def start(self) -> LoadSampler:
        self._start_thread("benchctl-load")
        return self

    def stop(self) -> None:
        self._stop_thread()


def nvml_target(device: torch.device) -> tuple[str, str | int] | None:
    """How to find `device` in NVML: ('uuid', 'GPU-...') or ('pci', bus id), else ('index', n) when no devices are
    hidden. NVML numbers GPUs in PCI order and ignores CUDA_VISIBLE_DEVICES, so torch's index alone may name another
    GPU. None off CUDA."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        text = str(uuid)
        return "uuid", text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"
    # the PCI fields exist only in some torch builds (and not in its type stubs)
    domain, bus, dev = (getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device"))
    if domain is not None and bus is not None and dev is not None:
        return "pci", f"{domain:08x}:{bus:02x}:{dev:02x}.0"
    if os.environ.get("CUDA_VISIBLE_DEVICES") is None:
        return "index", device.index or 0
    return None


def _nvml_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip().rstrip(":")


class NvmlSampler(_Periodic):
    """Samples NVML device memory used and utilisation (peak and mean) every `interval` seconds in a daemon thread.

    Every NVML call is guarded: `available` is False when NVML cannot be started or the device not found, and each
    metric that cannot be read stays None, with the reason in `note` (stored with the run). Nothing here raises.
    """

    def __init__(self, device: torch.device | None = None, interval: float = 0.1):
        self.interval = interval
        self.available = False
        self.peak_used: int | None = None
        self.max_util: int | None = None
        self.util_total = 0  # utilisation readings (percent) added up, and how many: their mean is the run's
        self.util_n = 0
        self.driver_version: str | None = None
        self.absent: dict[str, str] = {}  # metric -> why it has no value
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle = None
        self._nvml: Any = None
        target = nvml_target(device) if device is not None else None
        if target is None:
            return
        try:
            import pynvml  # NVIDIA GPUs only; without the package the run has no NVML readings
        except ImportError:
            self.absent["nvml"] = "pynvml is not installed"
            return
        try:
            pynvml.nvmlInit()
        except Exception as e:  # any failure (no library, no driver) only means no NVML readings
            self.absent["nvml"] = f"nvmlInit failed ({_nvml_error(e)})"
            return
        self._nvml = pynvml
        self._handle = self._call(f"device {target[1]}", _HANDLE_BY[target[0]], target[1])
        if self._handle is None:
            self.shutdown()
            return
        drv = self._call("driver_version", "nvmlSystemGetDriverVersion")
        self.driver_version = drv.decode() if isinstance(drv, bytes) else (str(drv) if drv is not None else None)
        self.available = True

    def _call(self, metric: str, fn: str, *args: Any) -> Any:
        """One NVML call; on failure None, with `metric` marked absent (first reason kept)."""
        try:
            return getattr(self._nvml, fn)(*args)
        except Exception as e:  # NVMLError_NotSupported on MIG slices, lost GPUs, anything else: the value is absent
            self.absent.setdefault(metric, f"{fn} failed ({_nvml_error(e)})")
            return None

    @property
    def note(self) -> str | None:
        """Why GPU readings are missing ('metric: reason; ...'), None when nothing is."""
        return "; ".join(f"{k}: {v}" for k, v in self.absent.items()) or None

    def _read(self) -> None:
        mem = self._call("nvml_mem", "nvmlDeviceGetMemoryInfo", self._handle)
        if mem is not None:
            self.peak_used = max(self.peak_used or 0, int(mem.used))
        util = self._call("gpu_util", "nvmlDeviceGetUtilizationRates", self._handle)
        if util is not None:
            self.max_util = max(self.max_util or 0, int(util.gpu))
            self.util_total += int(util.gpu)
            self.util_n += 1

    def start(self) -> NvmlSampler:
        if self.available:
            self._start_thread("benchctl-nvml")
        return self

    def stop(self) -> None:
        self._stop_thread()
        self.shutdown()

    def shutdown(self) -> None:
        """Release NVML (nvmlInit is reference counted: every init needs its shutdown)."""
        if self._nvml is not None:
            nvml, self._nvml, self.available = self._nvml, None, False
            try:
                nvml.nvmlShutdown()
            except Exception:  # nothing left to release
                pass


_HANDLE_BY = {
    "uuid": "nvmlDeviceGetHandleByUUID",
    "pci": "nvmlDeviceGetHandleByPciBusId",
    "index": "nvmlDeviceGetHandleByIndex",
}


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory phase. The cache is emptied first: memory the previous run of the same process left
    reserved would otherwise count in this run's reserved peak."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def torch_peaks(device: torch.device) -> tuple[int | None, int | None]:
    """(peak allocated, peak reserved) bytes since the last reset; (None, None) off CUDA."""
    if device.type != "cuda":
        return None, None
    return int(torch.cuda.max_memory_allocated(device)), int(torch.cuda.max_memory_reserved(device))


def git_commit() -> str | None:
    """The project's git commit, with '-dirty' when tracked files differ; None outside a checkout."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=PROJECT_DIR, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=PROJECT_DIR,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("-dirty" if dirty else "")


def hardware_name(device: torch.device) -> str:
    """The device's model name without the thread count (what a checkpoint compares on resume)."""
    name = device_name(device)
    return name.split(" (", 1)[0] if device.type == "cpu" else name


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return "Apple MPS"
    try:
        cpu = cpu_model(Path("/proc/cpuinfo").read_text())
    except OSError:
        cpu = None
    cpu = cpu or platform.processor() or platform.machine()
    return f"{cpu} ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def cpu_model(cpuinfo: str) -> str | None:
    """The first processor's model name from /proc/cpuinfo text, with its CPU family and model numbers when the name
    carries no model number of its own.

    Cloud machines often report a generic name ("AMD EPYC", "Intel(R) Xeon(R) Processor") for CPU generations whose
    speed differs by twice or more (bf16 units, AVX-512 width), and the name is what timings, cost estimates and
    benchmark files are grouped by; family and model tell those generations apart (AMD family 25 model 1 is Zen 3,
    model 17 Zen 4). None when the text has no model name."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the end of the first processor's block
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name")
    if not name:
        return None
    if not re.search(r"\d", name) and fields.get("cpu family") and fields.get("model"):
        name = f"{name} family {fields['cpu family']} model {fields['model']}"
    return name


@functools.cache
def tune_cpu_allocator() -> str | None:
    """Let glibc's malloc keep freed memory for reuse instead of returning it to the OS after every step.

    A CPU training step allocates and frees its activations (over a gigabyte at the paper preset); with glibc's
    defaults tensors above its mmap threshold are fresh mappings every step and the heap is trimmed between steps, so
    every step page-faults and zero-fills its memory again, in system time paid on every step. Raising the mmap
    threshold to its maximum (32 MiB) and the trim threshold to 1 GiB removes almost all of it; peak memory is
    unchanged. Process-wide, once (cached); not applied when the user set MALLOC_MMAP_THRESHOLD_ /
    MALLOC_TRIM_THRESHOLD_ or the C library is not glibc. Returns what was set, or None.
    """
    if platform.libc_ver()[0] != "glibc" or any(
        k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    ):
        return None
    try:
        libc = ctypes.CDLL(None)
        m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
        ok = libc.mallopt(m_mmap_threshold, 32 << 20) == 1 and libc.mallopt(m_trim_threshold, 1 << 30) == 1
    except (OSError, AttributeError):
        return None
    return "glibc malloc: mmap threshold 32 MiB, trim threshold 1 GiB" if ok else None


def environment(device: torch.device, driver_version: str | None = None) -> dict[str, Any]:
    """Device, versions and commit, with the same keys everywhere (GPU values None off CUDA)."""
    return {
        "device": device.type,
        "device_name": device_name(device),
        "device_count": torch.cuda.device_count() if device.type == "cuda" else None,
        "driver_version": driver_version,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda if device.type == "cuda" else None,
        "python_version": platform.python_version(),
        "benchctl_version": __version__,
        "git_commit": git_commit(),
        "hostname": socket.gethostname(),
    }


# ---- a run's telemetry across processes ------------------------------------------------------------------------------

# What a checkpoint carries from one process of a run to the next: sums and peaks over every process so far. A sum a
# checkpoint written before it existed lacks is unknown (None), not zero: adding only the later processes' share to it
# would understate it.
FRESH_RUN_TELEMETRY: dict[str, Any] = {
    "train_seconds": 0.0,
    "warmup_seconds": 0.0,
    "eval_seconds": 0.0,
    "step_times": [],
    "peak_rss": 0,
    "peak_alloc": None,
    "peak_reserved": None,
    "peak_nvml": None,
    "initial_val_loss": None,
    "cpu_seconds": 0.0,
    "cuda_seconds": 0.0,
    "timed_steps": 0,
    "load_total": 0.0,
    "load_n": 0,
    "util_total": 0,
    "util_n": 0,
    "baseline_rss": None,
    "step_mem": None,
}
ADDED_LATER = ("cpu_seconds", "cuda_seconds", "timed_steps")


def carried_from(saved: dict[str, Any]) -> dict[str, Any]:
    """The telemetry a checkpoint carries, with the sums it predates marked unknown."""
    return {**FRESH_RUN_TELEMETRY, **{k: None for k in ADDED_LATER}, **saved}


def add(a: float | None, b: float | None) -> float | None:
    """a + b where both are known; None (unknown) otherwise."""
    return None if a is None or b is None else a + b


def max_of(a: int | None, b: int | None) -> int | None:
    vals = [v for v in (a, b) if v is not None]
    return max(vals) if vals else None


def run_columns(tel: dict[str, Any], tokens_per_step: int) -> dict[str, Any]:
    """The runs-table columns of a run's cumulative telemetry."""
    times = tel["step_times"]
    train_s = tel["train_seconds"]
    load_n, util_n = tel.get("load_n") or 0, tel.get("util_n") or 0
    return {
        "train_seconds": train_s,
        "warmup_seconds": tel["warmup_seconds"],
        "eval_seconds": tel["eval_seconds"],
        "step_seconds": statistics.median(times) if times else None,
        # tokens/s over the timed steps (warm-up steps excluded from both numerator and denominator)
        "tokens_per_s": (len(times) * tokens_per_step / sum(times)) if times else None,
        "cpu_seconds": tel.get("cpu_seconds"),
        "cuda_seconds": tel.get("cuda_seconds"),
        "timed_steps": tel.get("timed_steps"),
        "load_avg": tel["load_total"] / load_n if load_n else None,
        "gpu_util": tel["util_total"] / util_n if util_n else None,
        "peak_rss_bytes": tel["peak_rss"],
        "baseline_rss_bytes": tel.get("baseline_rss"),
        "step_mem_bytes": tel.get("step_mem"),
        "peak_gpu_mem_bytes": tel["peak_alloc"],
        "peak_gpu_reserved_bytes": tel["peak_reserved"],
        "peak_nvml_mem_bytes": tel["peak_nvml"],
    }


# ---- a training step's own memory -----------------------------------------------------------------------------------
# What `benchctl bench` reports as a step's peak memory and `train` records per run: parameters and optimizer state
# plus the peak growth of torch's own allocations during one optimizer step (activations, gradients, temporaries).
# CUDA's allocator keeps the peak; on the CPU torch's profiler records every allocation and free. Unlike a process's
# RSS, it counts only the step's tensors: models trained one after another in one process (train-all, study), or
# sharing it, do not see each other's memory, and what the C allocator keeps of freed pages does not count.


class PeakMemory:
    """CUDA: the growth of torch's allocated memory over a phase (its peak minus its start)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._base = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc: Any) -> None:
        sync(self.device)

    @property
    def growth(self) -> int:
        if self.device.type != "cuda":
            return 0
        return max(0, torch.cuda.max_memory_allocated(self.device) - self._base)


_PROFILER_NOTICE = re.compile(rb"^USDT:.*\] profiler_(start|stop)\s*$")


@contextlib.contextmanager
def memory_profile() -> Iterator[Any]:
    """torch's CPU profiler with memory events, without the notice its C++ side prints on the process's stderr as
    it starts and stops ("USDT: ... profiler_start"), which would land in the middle of a training's output. Every
    other line written to stderr meanwhile (a warning from the profiled step) is passed on."""
    from torch.profiler import ProfilerActivity, profile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                yield prof
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().splitlines(keepends=True) if not _PROFILER_NOTICE.match(line)]
            if kept:
                os.write(2, b"".join(kept))


def allocation_peak(prof: Any) -> int | None:
    """The peak growth of live torch allocations in what a `torch.profiler.profile(profile_memory=True)` recorded
    (the CPU analogue of CUDA's max_memory_allocated); None when this PyTorch's profiler has no memory events."""
    results = getattr(prof.profiler, "kineto_results", None)
    if results is None:
        return None
    events = sorted((e for e in results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()  # + allocation, - free
        peak = max(peak, live)
    return peak


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters and optimizer state (what a step keeps resident besides its activations and gradients)."""
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for st in optimizer.state.values():
        n += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
    return n


def step_memory(
    step: Any, device: torch.device, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> int | None:
    """Run `step` (one optimizer step, after the optimizer's state exists) once and return its memory as `benchctl
    bench` measures it: parameters + optimizer state + the peak growth of torch allocations during the step. None on
    a device where it cannot be measured (a CPU whose PyTorch profiler has no memory events, MPS)."""
    if device.type == "cuda":
        with PeakMemory(device) as mem:
            step()
        growth: int | None = mem.growth
    elif device.type == "cpu":
        with memory_profile() as prof:
            step()
        growth = allocation_peak(prof)
    else:
        step()
        growth = None
    return None if growth is None else growth + state_bytes(model, optimizer)
