"""What this machine can train with: GPUs (NVIDIA via NVML, AMD via ROCm torch), Apple Silicon,
the CPU, and which backends (torch, mlx, numpy) are installed and on which devices they run.

Every probe is best effort and never raises: a missing driver, library or framework becomes a
note ("nvidia: NVML unavailable: NVML Shared Library Not Found"), not an exception. Importing
this module imports neither torch nor mlx; the probes import them only when asked.
"""

from __future__ import annotations

import importlib
import platform
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Any

import psutil

from .base import BACKENDS

# --- the pieces ---------------------------------------------------------------------------------


@dataclass
class GpuInfo:
    vendor: str  # "nvidia", "amd"
    index: int
    name: str
    memory_total: int | None = None  # bytes
    memory_free: int | None = None  # bytes
    compute_capability: str | None = None  # NVIDIA "9.0"; AMD: the gfx arch, e.g. "gfx90a"
    driver: str | None = None


@dataclass
class AppleInfo:
    chip: str  # "Apple M2 Pro"
    unified_memory: int  # bytes, shared by CPU and GPU
    metal: bool  # a Metal GPU usable by mlx or torch MPS
    metal_via: list[str] = field(default_factory=list)  # "mlx", "torch-mps"


@dataclass
class CpuInfo:
    model: str
    physical_cores: int | None
    logical_cores: int | None
    ram_total: int
    ram_available: int
    arch: str


@dataclass
class BackendInfo:
    name: str  # "torch", "mlx", "numpy"
    installed: bool
    version: str | None = None
    devices: list[str] = field(default_factory=list)  # usable devices, best first
    detail: str = ""  # "CUDA 12.4", "ROCm 6.1", "Metal", "not installed", ...


@dataclass
class MachineInfo:
    host: str
    os: str
    python: str
    cpu: CpuInfo
    gpus: list[GpuInfo]
    apple: AppleInfo | None
    backends: dict[str, BackendInfo]
    default: dict[str, str] | None  # what `drift join` picks with no --backend/--device
    notes: list[str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- probes -------------------------------------------------------------------------------------


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def detect_nvidia(nvml: ModuleType | None = None) -> tuple[list[GpuInfo], str | None]:
    """NVIDIA GPUs through NVML (the nvidia-ml-py package); ([], why) when there are none to see."""
    if nvml is None:
        try:
            nvml = importlib.import_module("pynvml")
        except ImportError:
            return [], "nvidia: nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        return [], f"nvidia: NVML unavailable (no NVIDIA driver?): {e}"
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        gpus = []
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            gpu = GpuInfo("nvidia", i, _text(nvml.nvmlDeviceGetName(h)), driver=driver)
            try:
                mem = nvml.nvmlDeviceGetMemoryInfo(h)
                gpu.memory_total, gpu.memory_free = int(mem.total), int(mem.free)
            except nvml.NVMLError:
                pass
            try:
                major, minor = nvml.nvmlDeviceGetCudaComputeCapability(h)
                gpu.compute_capability = f"{major}.{minor}"
            except nvml.NVMLError:
                pass
            gpus.append(gpu)
        return gpus, None
    except nvml.NVMLError as e:
        return [], f"nvidia: NVML error: {e}"
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass


def detect_rocm(torch: ModuleType | None) -> tuple[list[GpuInfo], str | None]:
    """AMD GPUs through a ROCm build of torch (torch.version.hip set; torch calls them "cuda")."""
    if torch is None:
        return [], None
    hip = getattr(torch.version, "hip", None)
    if not hip:
        return [], None
    try:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as e:
        return [], f"amd: ROCm torch cannot see a GPU: {e}"
    gpus = []
    for i in range(n):
        props = torch.cuda.get_device_properties(i)
        gpu = GpuInfo(
            "amd",
            i,
            props.name,
            memory_total=int(props.total_memory),
            compute_capability=getattr(props, "gcnArchName", None) or None,
            driver=f"ROCm {hip}",
        )
        try:
            gpu.memory_free = int(torch.cuda.mem_get_info(i)[0])
        except Exception:
            pass
        gpus.append(gpu)
    return gpus, (None if gpus else "amd: ROCm torch is installed but sees no GPU")


def _sysctl(key: str, run: Callable[..., Any] = subprocess.run) -> str | None:
    try:
        out = run(["sysctl", "-n", key], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def detect_apple(
    system: str | None = None,
    machine: str | None = None,
    metal_via: list[str] | None = None,
    run: Callable[..., Any] = subprocess.run,
) -> AppleInfo | None:
    """Apple Silicon: chip name, unified memory, and whether Metal is usable (by mlx / torch MPS)."""
    system = system or platform.system()
    machine = machine or platform.machine()
    if system != "Darwin" or machine != "arm64":
        return None
    chip = _sysctl("machdep.cpu.brand_string", run) or "Apple Silicon"
    mem = _sysctl("hw.memsize", run)
    via = list(metal_via or [])
    return AppleInfo(chip, int(mem) if mem and mem.isdigit() else psutil.virtual_memory().total, bool(via), via)


def _cpu_model() -> str:
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    if key.strip() in ("model name", "Model", "Hardware", "cpu model"):
                        return value.strip()
        except OSError:
            pass
    elif sys.platform == "darwin":
        name = _sysctl("machdep.cpu.brand_string")
        if name:
            return name
    return platform.processor() or platform.machine() or "unknown CPU"


def detect_cpu() -> CpuInfo:
    vm = psutil.virtual_memory()
    return CpuInfo(
        _cpu_model(),
        psutil.cpu_count(logical=False),
        psutil.cpu_count(logical=True),
        int(vm.total),
        int(vm.available),
        platform.machine(),
    )


def import_torch() -> ModuleType | None:
    try:
        return importlib.import_module("torch")
    except Exception:
        return None


def import_mlx() -> ModuleType | None:
    try:
        return importlib.import_module("mlx.core")
    except Exception:
        return None


def backend_info(name: str) -> BackendInfo:
    """Is this backend installed here, and on which devices can it run (best first)?"""
    if name == "torch":
        torch = import_torch()
        if torch is None:
            return BackendInfo("torch", False, detail="not installed")
        from .torch_worker import available_devices

        hip, cuda = getattr(torch.version, "hip", None), getattr(torch.version, "cuda", None)
        devices = available_devices()
        detail = (
            f"ROCm {hip}" if hip else f"CUDA {cuda}" if cuda else "MPS (Metal)" if "mps" in devices else "CPU build"
        )
        return BackendInfo("torch", True, torch.__version__, devices, detail)
    if name == "mlx":
        mx = import_mlx()
        if mx is None:
            return BackendInfo("mlx", False, detail="not installed")
        from .mlx_worker import available_devices as mlx_devices

        devices = mlx_devices()
        return BackendInfo(
            "mlx", True, getattr(mx, "__version__", None), devices, "Metal" if "metal" in devices else "CPU only"
        )
    if name == "numpy":
        import numpy

        return BackendInfo("numpy", True, numpy.__version__, ["cpu"], "hand-written models")
    raise ValueError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")


def device_name(backend: str, device: str) -> str:
    """A human name for a (backend, device) pair: the GPU's model, the Apple chip, or the CPU's."""
    try:
        if device.startswith("cuda"):
            import torch

            return str(torch.cuda.get_device_name(int(device.partition(":")[2] or 0)))
        if device in ("mps", "metal"):
            apple = detect_apple(metal_via=[device])
            return apple.chip if apple else device
    except Exception:
        return device
    return _cpu_model()


def detect(backends: tuple[str, ...] = BACKENDS, nvml: ModuleType | None = None) -> MachineInfo:
    """Everything above in one record (`drift status` prints it). nvml: pynvml or a stand-in."""
    notes: list[str] = []
    infos = {b: backend_info(b) for b in backends}
    nvidia, why = detect_nvidia(nvml)
    if why:
        notes.append(why)
    torch = import_torch() if infos.get("torch") and infos["torch"].installed else None
    amd, why = detect_rocm(torch)
    if why:
        notes.append(why)
    via = (["mlx"] if "metal" in infos.get("mlx", BackendInfo("mlx", False)).devices else []) + (
        ["torch-mps"] if "mps" in infos.get("torch", BackendInfo("torch", False)).devices else []
    )
    apple = detect_apple(metal_via=via)
    torch_info = infos.get("torch")
    if nvidia and torch_info is not None and not any(d.startswith("cuda") for d in torch_info.devices):
        notes.append(
            f"nvidia: {len(nvidia)} GPU(s) found, but torch here cannot use them "
            f"({torch_info.detail if torch_info.installed else 'torch not installed'}): "
            "install a CUDA build of torch (https://pytorch.org/get-started/locally/)"
        )
    from . import choose  # late: workers/__init__ imports this module

    default: dict[str, str] | None = None
    try:
        c = choose("auto", "auto", infos=infos)
        default = {"backend": c.backend, "device": c.device}
    except ValueError as e:
        notes.append(str(e))
    return MachineInfo(
        socket.gethostname(),
        f"{platform.system()} {platform.release()}",
        platform.python_version(),
        detect_cpu(),
        nvidia + amd,
        apple,
        infos,
        default,
        notes,
    )


# --- presentation (`drift status`) --------------------------------------------------------------


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def status_renderables(info: MachineInfo) -> list[Any]:
    """Rich tables for `drift status`: the devices, the backends, the default choice and notes."""
    from rich.table import Table

    users: dict[str, list[str]] = {}
    for b in info.backends.values():
        for d in b.devices:
            users.setdefault(d, []).append(b.name)

    devices = Table(title=f"{info.host}: {info.os}, Python {info.python}", title_justify="left")
    for col in ("device", "hardware", "memory", "details", "backends"):
        devices.add_column(col)
    for g in info.gpus:
        dev = f"cuda:{g.index}"
        mem = _gib(g.memory_total) + (f" ({_gib(g.memory_free)} free)" if g.memory_free is not None else "")
        cc = ("compute " if g.vendor == "nvidia" else "arch ") + g.compute_capability if g.compute_capability else ""
        details = ", ".join(x for x in (cc, f"driver {g.driver}" if g.driver else "") if x)
        devices.add_row(
            dev,
            f"{g.vendor.upper()} {g.name}" if g.vendor == "amd" else g.name,
            mem,
            details,
            ", ".join(users.get(dev, [])) or "-",
        )
    if info.apple:
        a = info.apple
        apple_devs = [d for d in ("metal", "mps") if d in users]
        devices.add_row(
            " / ".join(apple_devs) or "-",
            a.chip,
            f"{_gib(a.unified_memory)} unified",
            f"Metal via {', '.join(a.metal_via)}" if a.metal else "Metal not usable (install mlx)",
            ", ".join(b for d in apple_devs for b in users[d]) or "-",
        )
    c = info.cpu
    devices.add_row(
        "cpu",
        c.model,
        f"{_gib(c.ram_total)} ({_gib(c.ram_available)} free)",
        f"{c.physical_cores} cores, {c.logical_cores} threads, {c.arch}",
        ", ".join(users.get("cpu", [])) or "-",
    )

    backends = Table(title="backends", title_justify="left")
    for col in ("backend", "version", "devices", "details"):
        backends.add_column(col)
    for b in info.backends.values():
        backends.add_row(b.name, b.version or "-", ", ".join(b.devices) or "-", b.detail)

    out: list[Any] = [devices, backends]
    if info.default:
        out.append(
            f"drift join uses: {info.default['backend']} on {info.default['device']} (force with --backend / --device)"
        )
    out += [f"note: {n}" for n in info.notes]
    return out
