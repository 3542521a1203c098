"""`python -m moela import HF_DIR DEST`: turn a Hugging Face `deepseek_v3` folder into a moela run directory.

DEST is a run directory (the checkpoint goes to `DEST/checkpoints/step-0`, or `--step N`) or a
`.../checkpoints/step-N` folder itself. The checkpoint holds the model weights only (DCP, the trainer's layout, in
the stored dtype), so `generate`, `eval` and `export` work on DEST at once. `DEST/config.yaml` is written when
absent: the model section from config.json, the folder's tokenizer.json (with its EOS / BOS tokens from
tokenizer_config.json) as the data tokenizer, and defaults elsewhere; when present, its model section must match.

To fine-tune, start a run from the weights with a fresh optimizer: `checkpoint.init_from=DEST/checkpoints/step-0`
(or directly `checkpoint.init_from=hf:HF_DIR`). A weights-only checkpoint is not a resumable training state, so
`train.py` with `train.run_dir=DEST` does not resume from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from moela.config import Config, dump_config
from moela.data.config import DataConfig
from moela.model import Transformer
from moela.model.hf import load_hf_config
from moela.model.hf_folder import config_differences, read_hf_weights
from moela.tools.runs import CHECKPOINTS, CONFIG_FILE, LATEST, UsageError, load_run_config, single_process_dcp
from moela.trainer.safe_write import write_atomic, writing

_STEP_DIR = re.compile(r"^step-(\d+)$")
IMPORT_FIX = "free space on that disk or import into a run directory on another one"


def special_token(value) -> str | None:
    """A tokenizer_config.json special token: a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _data_section(hf_dir: Path) -> tuple[DataConfig, str | None]:
    """The data section pointing at the folder's tokenizer, and a note when there is none."""
    tok = hf_dir / "tokenizer.json"
    if not tok.is_file():
        return DataConfig(), (f"{hf_dir} has no tokenizer.json: config.yaml keeps data.tokenizer: bundled; set it "
                              f"to the model's tokenizer before generating or training")
    tok_cfg_file = hf_dir / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_file.read_text()) if tok_cfg_file.is_file() else {}
    return DataConfig(tokenizer=str(tok.resolve()), eos_token=special_token(tok_cfg.get("eos_token")),
                      bos_token=special_token(tok_cfg.get("bos_token"))), None


def _check_shapes(state: dict[str, torch.Tensor], model_cfg) -> None:
    with torch.device("meta"):
        expected = {k: v.shape for k, v in Transformer(model_cfg).state_dict().items()}
    wrong = [f"{k}: {tuple(state[k].shape)} instead of {tuple(s)}" for k, s in expected.items()
             if k in state and state[k].shape != s]
    missing = sorted(set(expected) - set(state))
    if wrong or missing:
        raise UsageError(f"the weights do not fit config.json: {'; '.join(wrong[:3] + missing[:3])}")


def import_folder(hf_dir: str | Path, dest: str | Path, step: int = 0) -> Path:
    """Write the checkpoint (and config.yaml if absent) for HF folder `hf_dir`; returns the checkpoint folder."""
    hf_dir, dest = Path(hf_dir), Path(dest)
    if not hf_dir.is_dir():
        raise UsageError(f"{hf_dir}: no such folder; pass a Hugging Face model folder holding config.json and "
                         f"*.safetensors")
    try:
        model_cfg = load_hf_config(hf_dir)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e)) from None
    match = _STEP_DIR.match(dest.name)
    if match and dest.parent.name == CHECKPOINTS:
        run_dir, ckpt, step = dest.parent.parent, dest, int(match.group(1))
    else:
        run_dir, ckpt = dest, dest / CHECKPOINTS / f"step-{step}"
    if ckpt.exists():
        raise UsageError(f"{ckpt}: already exists; import into another run directory or remove it first")
    data, note = _data_section(hf_dir)
    if (run_dir / CONFIG_FILE).is_file():
        differences = config_differences(load_run_config(run_dir).model, model_cfg)
        if differences:
            raise UsageError(f"{run_dir / CONFIG_FILE}: its model section differs from {hf_dir}/config.json "
                             f"({'; '.join(differences)}); import into a fresh run directory")
        note = None
    try:
        state = read_hf_weights(hf_dir, model_cfg)
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise UsageError(str(e).strip('"')) from None
    _check_shapes(state, model_cfg)
    with writing("the imported run", run_dir, fix=IMPORT_FIX):
        run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / CONFIG_FILE).is_file():
        cfg = Config(model=model_cfg, data=data, train=dataclasses.replace(Config().train, run_dir=str(run_dir)))
        write_atomic(run_dir / CONFIG_FILE, dump_config(cfg), "the imported recipe", fix=IMPORT_FIX)
    tmp = ckpt.with_name(ckpt.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with writing("the imported checkpoint", ckpt, needed=sum(t.nbytes for t in state.values()), fix=IMPORT_FIX,
                 partial=tmp), single_process_dcp():
        dcp.save({"model": state}, checkpoint_id=str(tmp), no_dist=True)
    os.replace(tmp, ckpt)
    write_atomic(ckpt.parent / LATEST, ckpt.name + "\n", "the latest-checkpoint pointer", fix=IMPORT_FIX)
    if note:
        print(f"note: {note}", file=sys.stderr)
    return ckpt


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("hf_dir", help="Hugging Face deepseek_v3 folder (config.json, *.safetensors, tokenizer.json)")
    p.add_argument("dest", help="run directory to create or extend, or a .../checkpoints/step-N folder")
    p.add_argument("--step", type=int, default=0, help="step number of the checkpoint in a run directory (default 0)")


def run(args: argparse.Namespace) -> int:
    if args.step < 0:
        raise UsageError(f"--step {args.step}: must be >= 0")
    ckpt = import_folder(args.hf_dir, args.dest, args.step)
    print(f"imported {args.hf_dir} into {ckpt} (weights only); try: python -m moela generate {ckpt.parent.parent}",
          file=sys.stderr)
    return 0
