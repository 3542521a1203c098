"""AdamW whose moments are stored in bf16 (`optim.moment_dtype: bfloat16`), as DeepSeek-V3 trains (its report,
section 3.3.2: the first and second AdamW moments in BF16, master weights and gradients in FP32).

Why: with fp32 master weights the fused fp32 AdamW moves 28 bytes per parameter a step (parameter read and write,
gradient read, both moments read and written): its kernel took 5.0-5.5 ms of the `small` step on an H200, and its
moments hold 8 bytes per parameter. bf16 moments make that 20 bytes moved and 4 held: for `small`'s 622M parameters
2.5 GB less memory. Measured in one H200 run of the `small` step: this kernel 3.59 ms against the fused kernel's
5.45, peak 25.7 against 28.2 GiB.

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
- One Triton launch per parameter group updates every parameter of the group (CUDA, and Triton's interpreter):
  the program reads its parameter's tensors' addresses from a device table (rebuilt only when an address changes),
  because one launch per tensor cost ~40 us of host time each, 8.7 ms a step for `small`'s ~200 tensors, more than
  the kernels' 3.7 ms on the GPU. The same math in torch elsewhere.
- Gradient clipping's factor is applied as the step reads each gradient (`grad_scale`), so clipping costs no pass
  that reads and writes every gradient (1.48 ms of `small`'s step as `_foreach_mul_`); the gradients themselves stay
  unclipped (nothing reads them after the step).
- Step counts are device tensors and a non-finite step is skipped by the `found_inf` flag the trainer sets, as
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

from moela.ops.triton_env import INTERPRET
from moela.parallel.mesh import local_shard

# elements per program; under the interpreter, whose time goes per program rather than per element, larger
# blocks (the tests still span two of them)
BLOCK = 32768 if INTERPRET else 2048
MOMENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _round_to_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), still as fp32: explicit, because Triton's interpreter
    truncates in `.to(tl.bfloat16)` where the GPU rounds to nearest."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _update(p, g, m, v, step, scale, lr, beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay,
            BF16_MOMENTS: tl.constexpr):
    """One AdamW update in fp32 -> (p, m, v) with m and v as they are stored."""
    bc1 = 1.0 - tl.exp2(step * log2_beta1)
    bc2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
    g = g * scale
    m = m + (g - m) * (1.0 - beta1)
    v = v * beta2 + (1.0 - beta2) * g * g
    p = p * (1.0 - lr * weight_decay)
    p = p - (lr / bc1) * m / (tl.sqrt(v) / bc2_sqrt + eps)
    if BF16_MOMENTS:
        m = _round_to_bf16(m)
        v = _round_to_bf16(v)
    return p, m, v


@triton.jit
def _adamw_kernel(table_ptr, work_ptr, found_ptr, scale_ptr, lr, beta1, beta2, log2_beta1, log2_beta2, eps,
                  weight_decay, HAS_FOUND: tl.constexpr, HAS_SCALE: tl.constexpr, P_DTYPE: tl.constexpr,
                  G_DTYPE: tl.constexpr, M_DTYPE: tl.constexpr, BF16_MOMENTS: tl.constexpr, BLOCK: tl.constexpr):
    """Program w: block `work[w, 1]` (BLOCK elements) of parameter `work[w, 0]`, whose tensors' addresses and size
    are row `work[w, 0]` of the table (every address 16-byte aligned, the launcher checks). The step count is
    already incremented. Whole blocks load and store unmasked (vectorized); the tail block is masked."""
    skip = False
    if HAS_FOUND:
        skip = tl.load(found_ptr) != 0
    if not skip:
        w = tl.program_id(0).to(tl.int64)
        row = table_ptr + tl.load(work_ptr + 2 * w).to(tl.int64) * 6
        start = tl.load(work_ptr + 2 * w + 1).to(tl.int64) * BLOCK
        p_ptr = tl.multiple_of(tl.load(row).to(tl.pointer_type(P_DTYPE)), 16)
        g_ptr = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(G_DTYPE)), 16)
        m_ptr = tl.multiple_of(tl.load(row + 2).to(tl.pointer_type(M_DTYPE)), 16)
        v_ptr = tl.multiple_of(tl.load(row + 3).to(tl.pointer_type(M_DTYPE)), 16)
        step = tl.load(tl.load(row + 4).to(tl.pointer_type(tl.float32)))
        n = tl.load(row + 5)
        scale = 1.0
        if HAS_SCALE:
            scale = tl.load(scale_ptr).to(tl.float32)
        offs = start + tl.arange(0, BLOCK)
        if start + BLOCK <= n:
            p, m, v = _update(tl.load(p_ptr + offs).to(tl.float32), tl.load(g_ptr + offs).to(tl.float32),
                              tl.load(m_ptr + offs).to(tl.float32), tl.load(v_ptr + offs).to(tl.float32), step,
                              scale, lr, beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay, BF16_MOMENTS)
            tl.store(p_ptr + offs, p.to(P_DTYPE))
            tl.store(m_ptr + offs, m.to(M_DTYPE))
            tl.store(v_ptr + offs, v.to(M_DTYPE))
        else:
            mask = offs < n
            p, m, v = _update(tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32),
                              tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32),
                              tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32),
                              tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32), step, scale, lr, beta1,
                              beta2, log2_beta1, log2_beta2, eps, weight_decay, BF16_MOMENTS)
            tl.store(p_ptr + offs, p.to(P_DTYPE), mask=mask)
            tl.store(m_ptr + offs, m.to(M_DTYPE), mask=mask)
            tl.store(v_ptr + offs, v.to(M_DTYPE), mask=mask)


def adamw_reference(p, g, m, v, step, found, scale=None, *, lr, beta1, beta2, eps, weight_decay) -> None:
    """The kernel's math on local tensors in torch (in place); `step` already incremented, `found` a 0-d flag or
    None (1: leave everything as it is), `scale` a 0-d factor of the gradient or None (1)."""
    bc1 = 1 - beta1 ** step.float()
    bc2_sqrt = (1 - beta2 ** step.float()).sqrt()
    g32, m32, v32 = g.float(), m.float(), v.float()
    if scale is not None:
        g32 = g32 * scale.float()
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


class _LaunchTable:
    """The device tables of one launch: a row per parameter (6 int64: the addresses of its parameter, gradient,
    both moments and step count, then its size) and a work item per block (int32 pairs: row, block). The address table
    is rebuilt only when an address changes (the first step, a load, new gradient tensors: FSDP2's every step), the
    work list only when a size does; each costs one host-to-device copy from pinned memory, not a synchronization."""

    def __init__(self) -> None:
        self.addresses: tuple = ()
        self.sizes: tuple = ()
        self.table = self.work = None
        self._host: dict[str, torch.Tensor] = {}  # the pinned sources, kept until the next rebuild of each

    def _to_device(self, name: str, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        if device.type == "cuda":
            host = host.pin_memory()
            self._host[name] = host
        return host.to(device, non_blocking=True)

    def get(self, tensors: list[tuple], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        sizes = tuple(tup[0].numel() for tup in tensors)
        addresses = tuple(t.data_ptr() for tup in tensors for t in tup)
        if sizes != self.sizes:
            blocks = torch.tensor([triton.cdiv(n, BLOCK) for n in sizes], dtype=torch.int64)  # [N]
            owner = torch.repeat_interleave(torch.arange(len(sizes)), blocks)  # [W]
            first = torch.cumsum(blocks, 0) - blocks  # [N]
            work = torch.stack([owner, torch.arange(owner.numel()) - first[owner]], dim=1).to(torch.int32)  # [W, 2]
            self.work, self.sizes = self._to_device("work", work, device), sizes
            self.addresses = ()
        if addresses != self.addresses:
            rows = [[t.data_ptr() for t in tup] + [n] for tup, n in zip(tensors, sizes)]
            self.table = self._to_device("table", torch.tensor(rows, dtype=torch.int64), device)  # [N, 6]
            self.addresses = addresses
        return self.table, self.work


class AdamWMoments(torch.optim.Optimizer):
    """AdamW with moments stored in `moment_dtype` (see the module docstring). Set `found_inf` (a 0-d device
    tensor, 1 = skip) before `step()` to skip a step on the device, as with torch's fused AdamW, and `grad_scale`
    (a 0-d device tensor) to multiply every gradient by it as the step reads it (gradient clipping's factor,
    without a pass that writes the gradients)."""

    skips_on_found_inf = True  # moela.trainer.step_metrics.skips_on_device
    scales_grads_in_step = True  # moela.trainer.loop: clipping hands its factor to the step

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, moment_dtype: str = "bfloat16"):
        if moment_dtype not in MOMENT_DTYPES:
            raise ValueError(f"moment_dtype must be one of {', '.join(MOMENT_DTYPES)}, got {moment_dtype!r}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, moment_dtype=moment_dtype)
        super().__init__(params, defaults)
        self.found_inf: torch.Tensor | None = None
        self.grad_scale: torch.Tensor | None = None
        self._tables: dict[tuple, _LaunchTable] = {}

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
                state["step"] = torch.as_tensor(state["step"], dtype=torch.float32).to(local_shard(p).device)
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in state:
                        state[key] = state[key].to(dtype)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found, scale = self.found_inf, self.grad_scale
        steps = []
        launches: dict[tuple, list[tuple]] = {}  # (group, dtypes, device, kernel?) -> local (p, g, m, v, step)
        for gi, group in enumerate(self.param_groups):
            dtype = MOMENT_DTYPES[group["moment_dtype"]]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=local_shard(p).device)
                    state["exp_avg"] = torch.zeros_like(p, dtype=dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype)
                steps.append(state["step"])
                tup = (*(local_shard(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])), state["step"])
                if tup[0].numel():
                    key = (gi, tup[0].dtype, tup[1].dtype, tup[2].dtype, tup[0].device, _kernel_can_run(tup))
                    launches.setdefault(key, []).append(tup)
        if not steps:
            return loss
        # every step count in one launch; a flagged step is not counted
        if found is None:
            torch._foreach_add_(steps, 1.0)
        else:
            torch._foreach_add_(steps, [1.0 - found.to(torch.float32)] * len(steps))
        for key, tensors in launches.items():
            group = self.param_groups[key[0]]
            beta1, beta2 = group["betas"]
            hyper = dict(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                         weight_decay=group["weight_decay"])
            if key[-1]:
                self._launch(key, tensors, found, scale, hyper)
            else:
                for tup in tensors:
                    adamw_reference(*tup, found, scale, **hyper)
        return loss

    def _launch(self, key: tuple, tensors: list[tuple], found, scale, hyper: dict) -> None:
        """One kernel launch for every parameter of `tensors` (one group, one set of dtypes, one device)."""
        table, work = self._tables.setdefault(key, _LaunchTable()).get(tensors, key[4])
        b1, b2 = hyper["beta1"], hyper["beta2"]
        _adamw_kernel[(work.shape[0],)](
            table, work, found if found is not None else table, scale if scale is not None else table, hyper["lr"],
            b1, b2, math.log2(b1) if b1 > 0 else -math.inf, math.log2(b2) if b2 > 0 else -math.inf, hyper["eps"],
            hyper["weight_decay"], HAS_FOUND=found is not None, HAS_SCALE=scale is not None,
            P_DTYPE=TL_DTYPES[key[1]], G_DTYPE=TL_DTYPES[key[2]], M_DTYPE=TL_DTYPES[key[3]],
            BF16_MOMENTS=key[3] == torch.bfloat16, BLOCK=BLOCK, num_warps=4)


def _kernel_can_run(tup: tuple) -> bool:
    """Whether the Triton kernel takes this parameter (CUDA or the interpreter; contiguous, 16-byte aligned
    tensors of dtypes it knows); the torch path takes the rest."""
    p, g, m, _, _ = tup
    if not (p.is_cuda or INTERPRET):
        return False
    return (all(t.dtype in TL_DTYPES for t in (p, g, m)) and all(t.is_contiguous() for t in tup[:4])
            and all(t.data_ptr() % 16 == 0 for t in tup[:4]))
