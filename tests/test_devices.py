"""Device detection and backend/device selection (workers/detect.py, workers.choose).

This machine has no GPU: NVML really is absent here, and that real path is tested as is. The
GPU paths (NVML answering, ROCm torch, Apple Silicon) are driven through small stand-ins for the
hardware's libraries; the code under test is the same code that runs on the real machines.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ROOT, drift_cmd

from drift.workers import BackendError, choose, make_worker
from drift.workers.detect import (
    BackendInfo,
    detect,
    detect_apple,
    detect_cpu,
    detect_nvidia,
    detect_rocm,
    status_renderables,
)

GIB = 2**30
try:
    import mlx.core  # noqa: F401

    HAVE_MLX = True
except ImportError:  # no mlx wheel for this platform
    HAVE_MLX = False
HERE = "cpu (torch, mlx, numpy)" if HAVE_MLX else "cpu (torch, numpy)"


# ---- hardware stand-ins ------------------------------------------------------------------------


class FakeNVMLError(Exception):
    pass


def fake_nvml(gpus: list[dict], init_error: str | None = None) -> SimpleNamespace:
    """The handful of pynvml calls detect_nvidia makes, answering like a machine with these GPUs."""
    calls: list[str] = []

    def init() -> None:
        calls.append("init")
        if init_error:
            raise FakeNVMLError(init_error)

    def mem(h: int) -> SimpleNamespace:
        if gpus[h].get("mem_error"):
            raise FakeNVMLError("Not Supported")
        return SimpleNamespace(total=gpus[h]["total"], free=gpus[h]["free"], used=0)

    return SimpleNamespace(
        NVMLError=FakeNVMLError,
        calls=calls,
        nvmlInit=init,
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlSystemGetDriverVersion=lambda: b"550.54.15",
        nvmlDeviceGetCount=lambda: len(gpus),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: gpus[h]["name"],
        nvmlDeviceGetMemoryInfo=mem,
        nvmlDeviceGetCudaComputeCapability=lambda h: gpus[h]["cc"],
    )


def infos(**devices: list[str]) -> dict[str, BackendInfo]:
    """BackendInfo for a machine where each named backend runs on these devices (others absent)."""
    detail = {"torch": "ROCm 6.1" if devices.pop("hip", None) else "CUDA 12.4"}
    return {
        b: BackendInfo(b, b in devices, "1.0", devices.get(b, []), detail.get(b, "")) for b in ("torch", "mlx", "numpy")
    }


# ---- detection ---------------------------------------------------------------------------------


def test_nvml_absent_here_is_a_note_not_an_error() -> None:
    gpus, why = detect_nvidia()  # the real nvidia-ml-py, on a machine without the NVIDIA driver
    if gpus:
        pytest.skip("this machine has an NVIDIA driver")
    assert why is not None and why.startswith("nvidia: ") and "NVML" in why


def test_nvidia_gpus_through_nvml() -> None:
    nvml = fake_nvml(
        [
            {"name": "NVIDIA H200", "total": 141 * GIB, "free": 140 * GIB, "cc": (9, 0)},
            {"name": b"NVIDIA GeForce RTX 3060", "total": 12 * GIB, "free": 11 * GIB, "cc": (8, 6), "mem_error": True},
        ]
    )
    gpus, why = detect_nvidia(nvml)
    assert why is None and nvml.calls == ["init", "shutdown"]
    assert [(g.vendor, g.index, g.name, g.compute_capability, g.driver) for g in gpus] == [
        ("nvidia", 0, "NVIDIA H200", "9.0", "550.54.15"),
        ("nvidia", 1, "NVIDIA GeForce RTX 3060", "8.6", "550.54.15"),
    ]
    assert (gpus[0].memory_total, gpus[0].memory_free) == (141 * GIB, 140 * GIB)
    assert gpus[1].memory_total is None  # one query failing loses that field, not the GPU

    gpus, why = detect_nvidia(fake_nvml([], init_error="Driver Not Loaded"))
    assert gpus == [] and "Driver Not Loaded" in why


def test_gpu_that_torch_cannot_use_is_shown_with_a_hint() -> None:
    from rich.console import Console

    nvml = fake_nvml([{"name": "NVIDIA GeForce RTX 4090", "total": 24 * GIB, "free": 23 * GIB, "cc": (8, 9)}])
    m = detect(nvml=nvml)  # the real torch here is a CPU build
    assert [g.name for g in m.gpus] == ["NVIDIA GeForce RTX 4090"]
    assert any("1 GPU(s) found, but torch here cannot use them" in n and "CUDA build" in n for n in m.notes)
    console = Console(width=200, record=True)
    for part in status_renderables(m):
        console.print(part)
    text = console.export_text()
    assert "NVIDIA GeForce RTX 4090" in text and "24.0 GiB (23.0 GiB free)" in text and "compute 8.9" in text


def test_rocm_gpus_through_torch_hip() -> None:
    import torch

    assert detect_rocm(torch) == ([], None) or torch.version.hip  # this CPU build is no ROCm build
    props = SimpleNamespace(name="AMD Instinct MI250X", total_memory=64 * GIB, gcnArchName="gfx90a:sramecc+:xnack-")
    fake = SimpleNamespace(
        version=SimpleNamespace(hip="6.1.40091"),
        cuda=SimpleNamespace(
            is_available=lambda: True,
            device_count=lambda: 1,
            get_device_properties=lambda i: props,
            mem_get_info=lambda i: (60 * GIB, 64 * GIB),
        ),
    )
    (gpu,), why = detect_rocm(fake)
    assert why is None
    assert (gpu.vendor, gpu.name, gpu.memory_total, gpu.memory_free, gpu.driver) == (
        "amd",
        "AMD Instinct MI250X",
        64 * GIB,
        60 * GIB,
        "ROCm 6.1.40091",
    )
    assert gpu.compute_capability.startswith("gfx90a")


def test_apple_silicon() -> None:
    assert detect_apple() is None or sys.platform == "darwin"

    def sysctl(cmd: list[str], **_: object) -> SimpleNamespace:
        out = {"machdep.cpu.brand_string": "Apple M2 Pro", "hw.memsize": str(32 * GIB)}[cmd[-1]]
        return SimpleNamespace(returncode=0, stdout=out + "\n")

    a = detect_apple("Darwin", "arm64", metal_via=["mlx", "torch-mps"], run=sysctl)
    assert (a.chip, a.unified_memory, a.metal, a.metal_via) == ("Apple M2 Pro", 32 * GIB, True, ["mlx", "torch-mps"])
    assert detect_apple("Darwin", "arm64", metal_via=[], run=sysctl).metal is False
    assert detect_apple("Darwin", "x86_64", run=sysctl) is None  # an Intel Mac: no Apple GPU to use


def test_cpu_and_the_whole_machine() -> None:
    import psutil

    cpu = detect_cpu()
    assert cpu.model and cpu.logical_cores == psutil.cpu_count() and cpu.ram_total > cpu.ram_available > 0
    m = detect()
    assert m.backends["numpy"].installed and m.backends["numpy"].devices == ["cpu"]
    assert m.backends["torch"].installed and "cpu" in m.backends["torch"].devices
    assert m.default is not None and m.default["device"] in m.backends[m.default["backend"]].devices
    json.dumps(m.to_dict())  # all plain data
    assert len(status_renderables(m)) >= 3


# ---- choosing a backend and device -------------------------------------------------------------


def test_auto_choice_prefers_gpus_then_apple_then_cpu() -> None:
    cuda = infos(torch=["cuda:0", "cuda:1", "cpu"], mlx=[], numpy=["cpu"])
    assert (choose(infos=cuda).backend, choose(infos=cuda).device) == ("torch", "cuda:0")
    assert choose(device="cuda", infos=cuda).device == "cuda:0"
    assert choose(device="cuda:1", infos=cuda).device == "cuda:1"
    with pytest.raises(BackendError, match=r"rocm.*available: cuda:0 \(torch\), cuda:1 \(torch\), cpu"):
        choose(device="rocm", infos=cuda)  # an NVIDIA machine is no ROCm machine
    amd = infos(torch=["cuda:0", "cpu"], numpy=["cpu"], hip=True)
    assert choose(device="rocm", infos=amd).device == "cuda:0"

    apple = infos(torch=["mps", "cpu"], mlx=["metal", "cpu"], numpy=["cpu"])
    assert (choose(infos=apple).backend, choose(infos=apple).device) == ("mlx", "metal")
    assert (choose(device="mps", infos=apple).backend, choose(device="mps", infos=apple).device) == ("torch", "mps")
    assert choose(supported=["torch", "numpy"], infos=apple).device == "mps"
    assert choose(device="cpu", infos=apple).backend == "torch"
    assert choose(device="cpu", supported=["mlx", "numpy"], infos=apple).backend == "mlx"
    assert choose("numpy", infos=apple).device == "cpu"


def test_bad_backend_or_device_names_what_is_available() -> None:
    with pytest.raises(BackendError) as e:
        choose(device="cuda")  # this machine, for real
    assert str(e.value) == f"--device cuda is not available here; available: {HERE}"
    for device in ("cuda:3", "rocm", "mps", "metal"):
        with pytest.raises(BackendError, match=f"--device {device} is not available here; available: cpu"):
            choose(device=device)
    with pytest.raises(BackendError, match=r"numpy runs on: cpu.*all devices here: cpu"):
        choose("numpy", "metal")
    with pytest.raises(BackendError, match="unknown backend; choose from auto, torch, mlx, numpy"):
        choose("jax")
    with pytest.raises(BackendError, match=r"mlx is not installed here .*pip install"):
        choose("mlx", infos=infos(torch=["cpu"], numpy=["cpu"]))


def test_task_without_the_backend_is_refused_naming_what_it_supports() -> None:
    torch_only = SimpleNamespace(make_dataset=lambda cfg: None, make_torch_model=lambda cfg, v: None)
    with pytest.raises(
        BackendError,
        match=r"task t\.py has no mlx implementation \(make_mlx_model\); "
        r"it supports: torch$",
    ):
        make_worker(torch_only, {}, {}, backend="mlx", task_name="task t.py")
    with pytest.raises(BackendError, match="supports torch, and none of these is installed"):
        choose(supported=["torch"], task_name="task t.py", infos=infos(numpy=["cpu"]))


# ---- the CLI -----------------------------------------------------------------------------------


def _live_ticket() -> str:
    from drift.transport import Endpoint

    async def ticket() -> str:
        ep = await Endpoint.bind("local")
        t = ep.ticket()
        await ep.close()
        return t

    return asyncio.run(ticket())


@pytest.mark.swarm
def test_drift_status_table_and_json() -> None:
    out = subprocess.run(drift_cmd("status", "--json"), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert {"host", "cpu", "gpus", "apple", "backends", "default", "notes"} <= set(info)
    assert info["backends"]["numpy"]["devices"] == ["cpu"] and info["cpu"]["logical_cores"] >= 1
    table = subprocess.run(
        drift_cmd("status"), capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "160"}
    )
    assert table.returncode == 0, table.stderr
    for word in ("device", "cpu", info["cpu"]["model"], "torch", "numpy", "drift join uses:"):
        assert word in table.stdout


@pytest.mark.swarm
def test_join_with_unavailable_device_or_backend_is_one_error_line() -> None:
    ticket = _live_ticket()
    for args, needle in (
        (["--device", "cuda"], f"--device cuda is not available here; available: {HERE}"),
        (["--backend", "numpy", "--device", "mps"], "numpy runs on: cpu"),
        (["--backend", "jax"], "--backend jax: unknown backend; choose from auto, torch, mlx, numpy"),
    ):
        out = subprocess.run(
            drift_cmd("join", "--repo", str(ROOT), "--ticket", ticket, *args),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("drift: error: ") and needle in lines[0], out.stderr


@pytest.mark.swarm
def test_no_torch_installed_falls_back_and_numpy_never_imports_torch(tmp_path: Path) -> None:
    """With torch unimportable, auto picks what is left; the numpy worker trains without it."""
    (tmp_path / "torch.py").write_text("raise ImportError('torch is not installed (blocked by this test)')\n")
    code = """
import sys, numpy as np
from drift.workers import choose, load_task, make_worker
from drift.workers.detect import detect
task = load_task(sys.argv[1])
assert not detect().backends["torch"].installed
print(choose().backend, choose(supported=["torch", "numpy"]).backend)
w = make_worker(task, {"block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 16}, {}, backend="numpy")
losses = [w.train_step(np.arange(8) + 8 * i) for i in range(3)]
print(w.backend, all(np.isfinite(losses)), "torch" in sys.modules and sys.modules["torch"] is not None)
"""
    out = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "recipes" / "shakespeare_char.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["mlx" if HAVE_MLX else "numpy", "numpy", "numpy", "True", "False"]
