"""Child of tests/faults/test_eval_memory.py (needs CUDA): train a graphed run, cap this process's device memory just
above what training reserved, then evaluate and train on. Prints one JSON line: the training peak, the cap, the
evaluation's peak, its outcome (None: it fit, else the error line) and the replays after it.

argv[1]: run dir; argv[2]: "release" (what the trainer does) or "beside" (the evaluation allocates beside the
graphs' pool, as before: the control).
"""

import json
import sys
from types import SimpleNamespace

import torch

from factories import tiny_overrides
from moela.config import load_config
from moela.trainer import Trainer, TrainingError

HEADROOM = 256 * 2**20


def main(run_dir: str, mode: str) -> None:
    cfg = load_config(None, tiny_overrides(
        vocab_size=4096, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
        n_routed_experts=8, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, num_attention_heads=4) + [
        f"train.run_dir={run_dir}", "data.max_doc_len=1024", "data.val_max_tokens=65536", "train.steps=100",
        "train.tokens_per_microbatch=16384", "train.eval_every=0", "train.device=cuda", "train.compile=true",
        "train.cuda_graphs=true", "train.prebuild_kernels=false", "logging.log_every=100", "logging.plot=false",
        "logging.progress_bar=never"])
    trainer = Trainer(cfg)
    trainer.writer = SimpleNamespace(log=lambda record: None, echo=print)
    for _ in range(4):  # two eager warm-up steps, then the captured graph replays
        trainer.train_step()
    torch.cuda.synchronize()
    device = trainer.device
    train_peak = torch.cuda.max_memory_reserved(device)
    total = torch.cuda.get_device_properties(device).total_memory
    cap = train_peak + HEADROOM
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)  # training fills this "device"
    torch.cuda.reset_peak_memory_stats(device)
    if mode == "beside":
        trainer.graphed.release = lambda: None
    outcome = None
    try:
        trainer._evaluate_and_log()
    except TrainingError as e:
        outcome = str(e)
    eval_peak = torch.cuda.max_memory_reserved(device)
    replays = trainer.graphed.replays
    if outcome is None:
        trainer.train_step()
        trainer.train_step()
    print(json.dumps({"train_peak": train_peak, "cap": cap, "eval_peak": eval_peak, "outcome": outcome,
                      "replays_after_eval": trainer.graphed.replays - replays}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
