"""Which devices run moela's FP8 kernels, asked before a kernel fails to compile.

The kernels multiply e4m3 codes on FP8 tensor cores, which GPUs of compute capability 8.9 (Ada) and newer have; they
are written for and measured on Hopper (sm_90: TMA loads and wgmma; the Gluon kernels only there). On an older GPU
(an A100 is 8.0) Triton would stop inside the first FP8 GEMM's compilation with a message about its own internals;
the callers ask `fp8_device_problem` first and name the fix. The CPU runs the reference (simulated quantization in
torch) or, under TRITON_INTERPRET=1, the Triton kernels interpreted: no problem there.
"""

from __future__ import annotations

import torch

FP8_MIN_CAPABILITY = (8, 9)


def fp8_device_problem(device: torch.device) -> str | None:
    """Why this device cannot run the FP8 kernels, or None if it can."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) >= FP8_MIN_CAPABILITY:
        return None
    return (f"FP8 needs a GPU with FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper); "
            f"{torch.cuda.get_device_name(device)} is compute capability {major}.{minor}")
