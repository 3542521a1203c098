"""What the compiled-training tests share: the GPU test model's shape, and one forward + backward of models compared
loss by loss and gradient by gradient."""

from __future__ import annotations

import torch

from factories import two_micro_batch_cfg

# CUDA: a model whose every kernel path applies (the expert GEMMs need D and F multiples of 128)
GPU_SHAPE = dict(vocab_size=4096, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                 n_routed_experts=8, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                 v_head_dim=32, num_attention_heads=4)


def make_cfg(run_dir, *extra):
    return two_micro_batch_cfg(run_dir, *extra)


def _losses_and_grads(models, batch, autocast: str | None = None) -> list[tuple[torch.Tensor, dict]]:
    """One forward + backward of each model on `batch` (under bf16 autocast on device `autocast`): its loss and
    gradients."""
    results = []
    for m in models:
        with torch.autocast(autocast or "cpu", dtype=torch.bfloat16, enabled=autocast is not None):
            out = m(batch)
        out.loss.backward()
        results.append((out.loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    return results


def _assert_same_loss_and_grads(eager, compiled, batch) -> dict:
    """One forward + backward of each model on `batch`: the compiled model's loss and every gradient equal the eager
    model's within float32 rounding. Returns the gradients."""
    (ref, ref_grads), (loss, grads) = _losses_and_grads((eager, compiled), batch)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    return grads


def _consumers(root: torch.Tensor, tensors: list[torch.Tensor]) -> list[int]:
    """How many autograd edges of the graph behind `root` feed each tensor's gradient (2 or more: autograd adds
    them in a kernel of its own)."""
    edges, seen, stack = {}, set(), [root.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for nxt, index in node.next_functions:
            if nxt is not None:
                edges[(nxt, index)] = edges.get((nxt, index), 0) + 1
                stack.append(nxt)
    return [edges.get((t.grad_fn, t.output_nr), 0) for t in tensors]
