"""``shardopt env``: one plain-text block with what a bug report needs.

The block names shardopt, Python and the platform; torch, its build (CUDA/CPU), the backends
torch.distributed can use here (gloo, NCCL and its version, MPI); the CPU kernels torch
dispatches (``torch.backends.cpu.get_cpu_capability()``, which ``ATEN_CPU_CAPABILITY`` can
lower: float rounding depends on it); the GPUs; and the installed versions of the
integrations and benchmark peers, read from the package metadata without importing them (a
broken DeepSpeed install must not hide the report). It prints plain text, not rich tables, so
that it pastes into an issue as it is, as ``ds_report`` and ``accelerate env`` do.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

import torch
import torch.distributed as dist

from shardopt import __version__

# Packages whose versions change what shardopt does or what a test compares against.
RELATED_PACKAGES = ("numpy", "rich", "lightning", "transformers", "accelerate", "deepspeed", "fairscale",
                    "pytest", "hypothesis")


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass  # not Linux: the machine type below
    return platform.machine() or "unknown"


def _platform() -> str:
    # Not platform.platform(): it asks for the processor, which runs `uname -p` in a subprocess.
    libc, libc_version = platform.libc_ver()
    libc_text = f", {libc} {libc_version}" if libc else ""
    return f"{platform.system()} {platform.release()} {platform.machine()}{libc_text}"


def _backends() -> list[tuple[str, str]]:
    if not dist.is_available():
        return [("torch.distributed", "not available in this build")]
    nccl = "no"
    if dist.is_nccl_available() and torch.cuda.is_available():
        nccl = "yes, " + ".".join(str(v) for v in torch.cuda.nccl.version())
    elif dist.is_nccl_available():
        nccl = "built, no CUDA device"
    return [("gloo", "yes" if dist.is_gloo_available() else "no"), ("nccl", nccl),
            ("mpi", "yes" if dist.is_mpi_available() else "no")]


def _gpus() -> list[tuple[str, str]]:
    if not torch.cuda.is_available():
        return [("gpus", "none visible to torch")]
    rows = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        rows.append((f"gpu {i}", f"{props.name}, {props.total_memory / 2**30:.1f} GiB, "
                                 f"compute {props.major}.{props.minor}"))
    return rows


def report_rows() -> list[tuple[str, str]]:
    """What ``shardopt env`` prints, as (name, value) rows.

    Returns:
        Rows in print order; every value is a string.
    """
    rows = [
        ("shardopt", __version__),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("platform", _platform()),
        ("cpu", f"{_cpu_model()}, {os.cpu_count()} logical cores"),
        ("torch", f"{torch.__version__} (git {torch.version.git_version[:12]})"),
        ("torch cuda build", torch.version.cuda or "none (CPU build)"),
        ("cpu capability", torch.backends.cpu.get_cpu_capability()),
        ("ATEN_CPU_CAPABILITY", os.environ.get("ATEN_CPU_CAPABILITY", "unset")),
        ("torch threads", f"{torch.get_num_threads()} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})"),
    ]
    rows += _backends()
    rows += _gpus()
    rows += [(name, _version(name)) for name in RELATED_PACKAGES]
    return rows


def report_text() -> str:
    """The block ``shardopt env`` prints: one ``name: value`` line per row, aligned.

    Returns:
        The text, ending without a newline.
    """
    rows = report_rows()
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name.ljust(width)} : {value}" for name, value in rows)
