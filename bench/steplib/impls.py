"""The implementations a row can time, each behind `step() -> lm loss of the step` (a float or a device scalar;
the caller reads it only where a host sync does not matter):

- `moela`: the real `moela.trainer.Trainer` built from the recipe, its `train_loader` replaced by the synthetic
  source, and `Trainer.train_step()` called as `fit()` calls it: forward (MTP, balance, z-loss as configured),
  backward, clipping, fused AdamW, router-bias update, LR schedule, the trainer's own logging reads.
- `titan-eager` / `titan-compile`: torchtitan's DeepSeek-V3 model (see `titan`), each block compiled whole for
  `titan-compile`; the same tokens as [rows, row_len] batches with per-document positions (its packed-document
  FlexAttention mask), its own cross-entropy.
- `hf`: transformers' `DeepseekV3ForCausalLM` loaded with `from_pretrained` from moela's HF export of the same
  weights, SDPA attention, the same batches with `position_ids` and `use_cache=False` (transformers then builds
  its packed-sequence mask from the positions), the model's own loss.
The peers train bf16 parameters (fp32 on CPU) with fused AdamW (the recipe's hyperparameters, no LR schedule)
and `clip_grad_norm_`; their micro-batch losses are weighted by labelled tokens exactly as the trainer does.
Every peer starts from moela's initial weights: `seed_everything(train.seed)` then `build_model`, as the
trainer does, so the first-step losses of one config must agree.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.steplib.source import MicroBatch, PackedDocs, TrainerLoader
from moela.batch import IGNORE_INDEX
from moela.config import Config
from moela.model import build_model
from moela.trainer.distributed import seed_everything

PEERS = ("titan-eager", "titan-compile", "hf")
IMPLS = ("moela",) + PEERS


class MoelaStep:
    def __init__(self, cfg: Config, source: PackedDocs):
        from moela.trainer import Trainer

        self.trainer = Trainer(cfg)
        self.trainer.train_loader = TrainerLoader(source)
        self.model = self.trainer.model
        self.notes: list[str] = []
        self.records: list[dict] = []  # train_step's records; their device numbers are read at logging steps

    def step(self) -> float:
        record = self.trainer.train_step()
        if not self.records:  # as fit() does after the first step
            line = self.trainer.stop_prebuild()
            if line:
                self.notes.append(line)
        self.records.append(record)
        return record["lm_loss"]

    def expert_imbalance(self, first: int) -> list[float]:
        """The trainer's expert imbalance (mean over MoE layers of the most loaded expert's tokens over the mean) of
        the steps since record `first`: the k-grouped weight-gradient GEMM's tiles take as long as their expert's
        rows, so the step's speed depends on it. Reads the pending records (one device read)."""
        self.trainer._read_pending()
        return [r["expert_imbalance"] for r in self.records[first:] if r.get("expert_imbalance") is not None]


class PeerStep:
    """The peers' training step around `loss_sum(micro_batch)` (summed CE over the micro-batch's targets)."""

    def __init__(self, model: torch.nn.Module, cfg: Config, source: PackedDocs, device: torch.device):
        self.model, self.source, self.device = model, source, device
        self.grad_clip = cfg.optim.grad_clip
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                           eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay,
                                           fused=True if device.type == "cuda" else None)
        self.notes: list[str] = []

    def grid(self, batch: MicroBatch, name: str) -> torch.Tensor:
        return batch.grid(name).to(self.device, non_blocking=True)

    def loss_sum(self, batch: MicroBatch) -> torch.Tensor:
        raise NotImplementedError

    def step(self) -> torch.Tensor:
        batches = self.source.next_step()
        total = sum(b.num_targets for b in batches)
        summed = None
        self.model.train()
        for batch in batches:
            loss = self.loss_sum(batch)
            (loss / total).backward()
            summed = loss.detach() if summed is None else summed + loss.detach()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return summed / total


def peer_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def cast_real_tensors(model: torch.nn.Module, dtype: torch.dtype, keep: tuple[str, ...] = ()) -> None:
    """Cast the real floating-point parameters and buffers to `dtype`, except the buffers named in `keep`
    (`Module.to(dtype)` would also cast complex buffers such as torchtitan's RoPE table, dropping their imaginary
    part)."""
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if p.is_floating_point():
                p.data = p.data.to(dtype)
        for name, b in module.named_buffers(recurse=False):
            if b.is_floating_point() and name not in keep:
                setattr(module, name, b.to(dtype))


def moela_initial_model(cfg: Config, device: torch.device) -> torch.nn.Module:
    """The weights the trainer starts from (same seed, same device, same order of draws)."""
    seed_everything(cfg.train.seed)
    return build_model(cfg.model, device)


class TitanStep(PeerStep):
    def __init__(self, cfg: Config, source: PackedDocs, device: torch.device, compiled: bool):
        from torchtitan.components.loss import cross_entropy_loss

        from bench.steplib.titan import (
            build_titan_model,
            compile_blocks,
            dense_document_mask,
            import_torchtitan,
            load_moela_weights,
            use_dense_attention,
        )

        stand_ins = import_torchtitan()
        initial = moela_initial_model(cfg, device).to(peer_dtype(device))  # the peers' weights: moela's, rounded
        model, config = build_titan_model(cfg.model, max(cfg.model.max_position_embeddings, source.row_len), device)
        load_moela_weights(model, config, initial)
        del initial
        cast_real_tensors(model, peer_dtype(device), keep=("expert_bias_E", "tokens_per_expert_E"))
        self.dense_mask = dense_document_mask if device.type == "cpu" else None
        if self.dense_mask is not None:  # FlexAttention has no backward on the CPU
            use_dense_attention(model)
        if compiled:
            compile_blocks(model)
        super().__init__(model, cfg, source, device)
        self.cross_entropy = cross_entropy_loss
        self.notes = [f"torch stand-ins: {', '.join(stand_ins)}"] if stand_ins else []
        if self.dense_mask is not None:
            self.notes.append("CPU: SDPA with a dense packed-document mask in place of FlexAttention")

    def loss_sum(self, batch: MicroBatch) -> torch.Tensor:
        ids, labels = self.grid(batch, "input_ids"), self.grid(batch, "labels")  # [R, S]
        positions = self.grid(batch, "position_ids").long()  # [R, S]
        masks = (self.dense_mask(positions) if self.dense_mask is not None
                 else self.model.get_attention_masks(positions))
        logits = self.model(ids, positions=positions, attention_masks=masks)  # [R, S, V]
        return self.cross_entropy(logits, labels)


class HFStep(PeerStep):
    def __init__(self, cfg: Config, source: PackedDocs, device: torch.device):
        import transformers

        from moela.model.hf import export_hf

        initial = moela_initial_model(cfg, device).to(peer_dtype(device))
        size = sum(t.numel() * t.element_size() for t in initial.state_dict().values())
        shm = Path("/dev/shm")
        in_memory = shm.is_dir() and shutil.disk_usage(shm).free > 2 * size
        with tempfile.TemporaryDirectory(dir=shm if in_memory else None) as tmp:
            export_hf(initial, tmp)
            del initial
            model = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp, dtype=peer_dtype(device),
                                                                       attn_implementation="sdpa")
        model.to(device)
        super().__init__(model, cfg, source, device)
        experts = getattr(model.config, "_experts_implementation", None)
        self.notes = [f"transformers {transformers.__version__}, experts implementation {experts}"]

    def loss_sum(self, batch: MicroBatch) -> torch.Tensor:
        ids = self.grid(batch, "input_ids")  # [R, S]
        positions = self.grid(batch, "position_ids").long()  # [R, S]
        labels = self.grid(batch, "labels")  # [R, S], moela's: labels[t] is the target of position t
        shifted = F.pad(labels[:, :-1], (1, 0), value=IGNORE_INDEX)  # transformers shifts them back itself
        # no KV cache: with one, transformers skips the packed-sequence mask and documents would see each other
        out = self.model(input_ids=ids, position_ids=positions, labels=shifted, use_cache=False)
        return out.loss * batch.num_targets  # its loss is the mean over this micro-batch's targets


def build_impl(name: str, cfg: Config, source: PackedDocs, device: torch.device):
    if name == "moela":
        return MoelaStep(cfg, source)
    if name in ("titan-eager", "titan-compile"):
        return TitanStep(cfg, source, device, compiled=name == "titan-compile")
    if name == "hf":
        return HFStep(cfg, source, device)
    raise ValueError(f"unknown implementation {name!r}; choose one of {', '.join(IMPLS)}")
