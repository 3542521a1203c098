"""AdamW whose moments are stored in bf16 (`optim.moment_dtype: bfloat16`), as DeepSeek-V3 trains (its report,
section 3.3.2: the first and second AdamW moments in BF16, master weights and gradients in FP32).

Why: with fp32 master weights the fused fp32 AdamW moves 28 bytes per parameter a step (parameter read and write,
gradient read, both moments read and written): its kernel took 5.0-5.5 ms of the `small` step on an H200
(bench/results/step_32k_hf.json, step_32k_masked_cast.json), and its moments hold 8 bytes per parameter. bf16
moments make that 20 bytes moved and 4 held: for `small`'s 622M parameters 2.5 GB less memory (a byte count;
the kernel's time on a GPU is not measured yet).

Decisions:
- The update is computed in fp32 from the stored moments and the fp32 gradient; the new moments update the
  parameter before they are rounded (round to nearest) for storage, so rounding touches only what is carried to
  the next step. Same formula and order as `torch.optim.AdamW` (decoupled decay, bias corrections, eps added to
  sqrt(v) / sqrt(1 - beta2^t)); with `moment_dtype=float32` the result equals torch's AdamW to fp32 rounding (the
  tests' reference).
- bf16 keeps 8 significant bits: a stored second moment v moves by `(1 - beta2) * (g^2 - v)`, which rounds away
  when it is under half a bf16 step, i.e. when |g^2 - v| / v < 2^-9 / (1 - beta2): 4% at beta2 = 0.95 (DeepSeek's
  and moela's default), but a factor ~2 at beta2 = 0.999, where v would barely move. The recipe check refuses
  beta2 > 0.99 with bf16 moments.
- One Triton kernel per parameter tensor on CUDA (and in Triton's interpreter); the same math in torch elsewhere.
  Step counts are device tensors and a non-finite step is skipped by the `found_inf` flag the trainer sets, as
  with fused AdamW (`moela.trainer.step_metrics`): no host read. Sharded (DTensor) parameters update their local
  shards; the moments are DTensors like the parameters, so distributed checkpoints treat them as AdamW's.
- Loading a state dict gives the moments this optimizer's dtype (torch's loading casts optimizer state to the
  parameter's dtype), so a checkpoint of either kind resumes with either setting.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch.distributed.tensor import DTensor

from moela.ops.triton_env import INTERPRET

BLOCK = 2048  # elements per program
MOMENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@triton.jit
def _round_to_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), still as fp32: explicit, because Triton's interpreter
    truncates in `.to(tl.bfloat16)` where the GPU rounds to nearest."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, step_ptr, found_ptr, n, lr, beta1, beta2, log2_beta1, log2_beta2,
                  eps, weight_decay, HAS_FOUND: tl.constexpr, BF16_MOMENTS: tl.constexpr, BLOCK: tl.constexpr):
    """Program i: elements [i * BLOCK, (i + 1) * BLOCK) of one parameter; the step count is already incremented."""
    skip = False
    if HAS_FOUND:
        skip = tl.load(found_ptr) != 0
    if not skip:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        step = tl.load(step_ptr).to(tl.float32)
        bc1 = 1.0 - tl.exp2(step * log2_beta1)
        bc2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = m + (g - m) * (1.0 - beta1)
        v = v * beta2 + (1.0 - beta2) * g * g
        p = p * (1.0 - lr * weight_decay)
        p = p - (lr / bc1) * m / (tl.sqrt(v) / bc2_sqrt + eps)
        tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
        if BF16_MOMENTS:
            m = _round_to_bf16(m)
            v = _round_to_bf16(v)
        tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)


def adamw_reference(p, g, m, v, step, found, *, lr, beta1, beta2, eps, weight_decay) -> None:
    """The kernel's math on local tensors in torch (in place); `step` already incremented, `found` a 0-d flag or
    None (1: leave everything as it is)."""
    bc1 = 1 - beta1 ** step.float()
    bc2_sqrt = (1 - beta2 ** step.float()).sqrt()
    g32, m32, v32 = g.float(), m.float(), v.float()
    m32 = m32 + (g32 - m32) * (1 - beta1)
    v32 = v32 * beta2 + (1 - beta2) * g32 * g32
    p32 = p.float() * (1 - lr * weight_decay)
    p32 = p32 - (lr / bc1) * m32 / (v32.sqrt() / bc2_sqrt + eps)
    if found is not None:
        keep = found != 0
        p32, m32, v32 = (torch.where(keep, old.float(), new) for old, new in ((p, p32), (m, m32), (v, v32)))
    p.copy_(p32)
    m.copy_(m32)
    v.copy_(v32)


class AdamWMoments(torch.optim.Optimizer):
    """AdamW with moments stored in `moment_dtype` (see the module docstring). Set `found_inf` (a 0-d device
    tensor, 1 = skip) before `step()` to skip a step on the device, as with torch's fused AdamW."""

    skips_on_found_inf = True  # moela.trainer.step_metrics.skips_on_device

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, moment_dtype: str = "bfloat16"):
        if moment_dtype not in MOMENT_DTYPES:
            raise ValueError(f"moment_dtype must be one of {', '.join(MOMENT_DTYPES)}, got {moment_dtype!r}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, moment_dtype=moment_dtype)
        super().__init__(params, defaults)
        self.found_inf: torch.Tensor | None = None

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loading, then the recipe's moment dtype (torch casts optimizer state to the parameters' dtype,
        and a state dict saved by torch's AdamW has none) and step counts as fp32 tensors on the parameters'
        devices. bf16 -> fp32 -> bf16 is exact."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group["moment_dtype"] = self.defaults["moment_dtype"]
            dtype = MOMENT_DTYPES[group["moment_dtype"]]
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue
                state["step"] = torch.as_tensor(state["step"], dtype=torch.float32).to(_local(p).device)
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in state:
                        state[key] = state[key].to(dtype)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found = self.found_inf
        todo = []  # (the group's hyperparameters, parameter, state) of every parameter with a gradient
        for group in self.param_groups:
            dtype = MOMENT_DTYPES[group["moment_dtype"]]
            beta1, beta2 = group["betas"]
            hyper = dict(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                         weight_decay=group["weight_decay"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=_local(p).device)
                    state["exp_avg"] = torch.zeros_like(p, dtype=dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype)
                todo.append((hyper, p, state))
        if not todo:
            return loss
        # every step count in one launch; a flagged step is not counted
        steps = [state["step"] for _, _, state in todo]
        torch._foreach_add_(steps, 1.0 if found is None else 1.0 - found.to(torch.float32))
        for hyper, p, state in todo:
            args = (_local(p), _local(p.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]), state["step"])
            n = args[0].numel()
            if n == 0:
                continue
            if args[0].is_cuda or INTERPRET:
                b1, b2 = hyper["beta1"], hyper["beta2"]
                _adamw_kernel[(triton.cdiv(n, BLOCK),)](
                    *args, found if found is not None else state["step"], n, hyper["lr"], b1, b2,
                    math.log2(b1) if b1 > 0 else -math.inf, math.log2(b2) if b2 > 0 else -math.inf,
                    hyper["eps"], hyper["weight_decay"], HAS_FOUND=found is not None,
                    BF16_MOMENTS=args[2].dtype == torch.bfloat16, BLOCK=BLOCK, num_warps=4)
            else:
                adamw_reference(*args, found, **hyper)
        return loss
        # every step count in one launch; a flagged step is not counted
        steps = [state["step"] for _, _, state in todo]
        torch._foreach_add_(steps, 1.0 if found is None else 1.0 - found.to(torch.float32))
        for group, p, state in todo:
            beta1, beta2 = group["betas"]
            lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
            args = (_local(p), _local(p.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]), state["step"])
            n = args[0].numel()
            if n == 0:
                continue
            if args[0].is_cuda or INTERPRET:
                _adamw_kernel[(triton.cdiv(n, BLOCK),)](
                    *args, found if found is not None else state["step"], n, lr, beta1, beta2,
                    math.log2(beta1) if beta1 > 0 else -math.inf, math.log2(beta2) if beta2 > 0 else -math.inf,
                    eps, wd, HAS_FOUND=found is not None, BF16_MOMENTS=args[2].dtype == torch.bfloat16,
                    BLOCK=BLOCK, num_warps=4)
            else:
                adamw_reference(*args, found, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd)
        return loss
