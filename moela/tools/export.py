"""`python -m moela export RUN_DIR OUT_DIR`: a Hugging Face `deepseek_v3` folder from a DCP checkpoint of any layout,
streamed tensor by tensor.

OUT_DIR gets `model-0000i-of-0000n.safetensors` shards of at most `--max-shard-size` bytes (a tensor larger than
that gets a shard of its own), `model.safetensors.index.json`, `config.json`, `generation_config.json`,
`tokenizer.json` and `tokenizer_config.json`; `transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads it.

Decisions:
- Never the whole model in memory: the checkpoint's metadata gives every tensor's name and shape; a planner reads
  one tensor (or a range of its rows) at a time through DCP, whatever the ranks that saved it, and each shard is
  written as soon as it is full. Stacked expert tensors ([E, 2F, D], [E, D, F]) larger than a shard are read in
  ranges of experts. What is held at once is one shard being filled plus one read buffer; `ExportReport.peak_bytes`
  records it. (DCP's file reader also decodes a whole saved chunk - one rank's shard of a tensor - per read.)
- The HF names and tensor splits are `moela.model.hf.to_hf_state_dict`'s own: it runs once over lightweight
  references that record which checkpoint tensor, which index and which cast produce each HF tensor, so the
  streamed export cannot drift from the in-memory one.
- Written into a hidden sibling of OUT_DIR and renamed at the end: an interrupted or failed export leaves no half
  folder behind; OUT_DIR may not touch a run directory, and `--overwrite` replaces only a previous export
  (`export_dir`).

Shapes: E routed experts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from moela.config import Config
from moela.data.tokenizer import Tokenizer
from moela.model import hf
from moela.tools import export_dir
from moela.tools.runs import (
    CHECKPOINTS,
    DTYPES,
    UsageError,
    find_checkpoint,
    load_run_config,
    load_run_tokenizer,
    single_process_dcp,
)
from moela.trainer import safe_load

MODEL_PREFIX = "model."
INDEX_FILE = "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """'2GB', '500MB', '64KiB' or a plain number of bytes -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise UsageError(f"--max-shard-size {text!r}: expected a size such as 2GB, 500MB or 64KiB")
    size = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if size < 1:
        raise UsageError(f"--max-shard-size {text!r}: must be at least one byte")
    return size


class _Ref:
    """Stands for a checkpoint tensor inside `to_hf_state_dict`: records indexing and casts instead of doing them."""

    def __init__(self, key: str, shape: torch.Size, index: tuple = (), cast: torch.dtype | None = None):
        self.key, self.base_shape, self.index, self.cast = key, shape, index, cast

    @property
    def shape(self) -> torch.Size:
        meta = torch.empty(self.base_shape, device="meta")
        for idx in self.index:
            meta = meta[idx]
        return meta.shape

    def __getitem__(self, idx) -> "_Ref":
        return _Ref(self.key, self.base_shape, self.index + (idx,), self.cast)

    def float(self) -> "_Ref":
        return self.to(torch.float32)

    def to(self, dtype: torch.dtype) -> "_Ref":
        return _Ref(self.key, self.base_shape, self.index, dtype)

    def detach(self) -> "_Ref":
        return self

    cpu = contiguous = clone = detach


def hf_plan(cfg, shapes: dict[str, torch.Size]) -> dict[str, _Ref]:
    """HF name -> the reference that produces it, from our parameter names and shapes."""
    fake = SimpleNamespace(cfg=cfg, state_dict=lambda: {k: _Ref(k, s) for k, s in shapes.items()})
    return hf.to_hf_state_dict(fake)


class _RangePlanner(safe_load.SafeLoadPlanner):
    """Reads rows [start, start + len(dest)) of one checkpoint tensor into `dest`, from whatever chunks hold them."""

    def __init__(self, checkpoint: Path, fqn: str, dest: torch.Tensor, start: int):
        super().__init__(checkpoint)
        self.fqn, self.dest, self.start = fqn, dest, start

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata.state_dict_metadata[self.fqn]
        offsets = torch.Size([self.start] + [0] * (self.dest.dim() - 1)) if self.dest.dim() else torch.Size([])
        return LoadPlan(create_read_items_for_chunk_list(self.fqn, md, [ChunkStorageMetadata(offsets,
                                                                                             self.dest.shape)]))

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.dest


@dataclass
class ExportReport:
    out_dir: Path
    tensors: int
    shards: int
    total_bytes: int
    peak_bytes: int  # the most tensor bytes the export held at once (shard being filled + read buffer)


class _Exporter:
    def __init__(self, checkpoint: Path, out_dir: Path, max_shard_bytes: int, dtype: torch.dtype | None):
        self.checkpoint = checkpoint
        self.reader = safe_load.SafeReader(checkpoint)
        self.metadata = self.reader.metadata
        self.out_dir, self.max_shard_bytes, self.dtype = out_dir, max_shard_bytes, dtype
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = self.reading = self.peak = self.total = 0
        self.files: list[list[str]] = []

    def shapes(self) -> dict[str, TensorStorageMetadata]:
        for key in self.metadata.state_dict_metadata:
            if key.startswith(MODEL_PREFIX):
                safe_load.expect_tensor(self.metadata, key, self.checkpoint)
        return {k[len(MODEL_PREFIX):]: md for k, md in self.metadata.state_dict_metadata.items()
                if k.startswith(MODEL_PREFIX) and isinstance(md, TensorStorageMetadata)}

    def _note_peak(self) -> None:
        self.peak = max(self.peak, self.pending_bytes + self.reading)

    def read(self, key: str, start: int, rows: int | None) -> torch.Tensor:
        md = self.metadata.state_dict_metadata[MODEL_PREFIX + key]
        shape = md.size if rows is None else torch.Size([rows, *md.size[1:]])
        dest = torch.empty(shape, dtype=md.properties.dtype)
        self.reading = dest.nbytes
        self._note_peak()
        with single_process_dcp():
            safe_load.load({MODEL_PREFIX + key: dest}, self.checkpoint, reader=self.reader,
                           planner=_RangePlanner(self.checkpoint, MODEL_PREFIX + key, dest, start))
        return dest

    def add(self, name: str, ref: _Ref, source: torch.Tensor, start: int, owned: bool) -> None:
        """Queue HF tensor `name` = `ref` applied to `source` (rows from `start`). `owned`: the tensor may be
        `source` itself (its first whole use); otherwise a copy, so no two shard entries share memory and no
        slice keeps a whole read buffer alive."""
        t = source
        for i, idx in enumerate(ref.index):
            if i == 0 and start:
                idx = (idx[0] - start, *idx[1:]) if isinstance(idx, tuple) else idx - start
            t = t[idx]
        dtype = ref.cast or self.dtype or t.dtype
        if ref.index or not owned:
            t = t.clone(memory_format=torch.contiguous_format)
        elif t.dtype == dtype:
            self.reading -= t.nbytes  # the read buffer itself goes into the shard
        t = t.to(dtype)
        if self.pending and self.pending_bytes + t.nbytes > self.max_shard_bytes:
            self.flush()
        self.pending[name] = t
        self.pending_bytes += t.nbytes
        self.total += t.nbytes
        self._note_peak()

    def flush(self) -> None:
        if not self.pending:
            return
        save_file(self.pending, str(self.out_dir / f"shard-{len(self.files):05d}.safetensors"),
                  metadata={"format": "pt"})
        self.files.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def run(self, plan: dict[str, _Ref]) -> None:
        """Emit the plan's tensors in order; consecutive entries of one checkpoint tensor share its reads."""
        names = list(plan)
        i = 0
        while i < len(names):
            key = plan[names[i]].key
            j = i
            while j < len(names) and plan[names[j]].key == key:
                j += 1
            self._emit_source(key, [(n, plan[n]) for n in names[i:j]])
            i = j
        self.flush()

    def _emit_source(self, key: str, entries: list[tuple[str, _Ref]]) -> None:
        md = self.metadata.state_dict_metadata[MODEL_PREFIX + key]
        shape = md.size
        itemsize = torch.empty((), dtype=md.properties.dtype).element_size()
        nbytes = shape.numel() * itemsize
        by_row = all(r.index and isinstance(_first(r.index[0]), int) for _, r in entries)
        if nbytes <= self.max_shard_bytes or not by_row or len(shape) < 1:
            if self.pending_bytes + nbytes > self.max_shard_bytes:
                self.flush()  # before the read: the full shard and the buffer need not coexist
            source = self.read(key, 0, None)
            for i, (name, ref) in enumerate(entries):
                self.add(name, ref, source, 0, owned=i == 0)
            self.reading = 0
            return
        row_bytes = nbytes // shape[0]
        step = max(1, self.max_shard_bytes // row_bytes)
        for start in range(0, shape[0], step):
            rows = min(step, shape[0] - start)
            if self.pending_bytes + rows * row_bytes > self.max_shard_bytes:
                self.flush()
            source = self.read(key, start, rows)
            for name, ref in entries:
                if start <= _first(ref.index[0]) < start + rows:
                    self.add(name, ref, source, start, owned=False)
            self.reading = 0
            del source

    def finish(self) -> int:
        """Rename the shards to HF's `-0000i-of-0000n` names and write the index; returns the shard count."""
        n = len(self.files)
        weight_map = {}
        for i, names in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.out_dir / f"shard-{i:05d}.safetensors", self.out_dir / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return n


def _first(idx):
    return idx[0] if isinstance(idx, tuple) else idx


def write_tokenizer_files(tokenizer: Tokenizer, out_dir: Path, max_length: int) -> None:
    """tokenizer.json (with a post-processor that prepends BOS, as training did, when the run uses one) and a
    tokenizer_config.json for `transformers.AutoTokenizer`."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.processors import TemplateProcessing

    tok = HFTokenizer.from_str(tokenizer.hf.to_str())
    if tokenizer.bos_id is not None:
        tok.post_processor = TemplateProcessing(single=f"{tokenizer.bos_token} $A",
                                                pair=f"{tokenizer.bos_token} $A $B",
                                                special_tokens=[(tokenizer.bos_token, tokenizer.bos_id)])
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tokenizer.eos_token,
              "bos_token": tokenizer.bos_token, "pad_token": tokenizer.eos_token, "model_max_length": max_length,
              "clean_up_tokenization_spaces": False}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def export_checkpoint(checkpoint: Path, cfg: Config, tokenizer: Tokenizer, out_dir: Path, *,
                      max_shard_bytes: int = 2 * 10**9, dtype: torch.dtype | None = None,
                      mtp: bool = True) -> ExportReport:
    """Write the HF folder for `checkpoint` (a DCP step folder) of a run with recipe `cfg` into `out_dir` (new, or
    a previous export, which is replaced; `export_dir`). `mtp=False` leaves out the multi-token-prediction layers
    (transformers' DeepseekV3 does not run them)."""
    model_cfg = cfg.model if mtp else dataclasses.replace(cfg.model, num_nextn_predict_layers=0)
    try:
        hf_config = hf.to_hf_config(model_cfg)
    except ValueError as e:
        raise UsageError(str(e)) from None
    export_dir.check_out(out_dir, checkpoint.parent.parent if checkpoint.parent.name == CHECKPOINTS else checkpoint)
    with export_dir.staged(out_dir) as partial:
        exporter = _Exporter(checkpoint, partial, max_shard_bytes, dtype)
        shapes = {k: md.size for k, md in exporter.shapes().items()}
        try:
            plan = hf_plan(model_cfg, shapes)
        except KeyError as e:
            raise UsageError(f"{checkpoint}: lacks the model tensor {e} that the run's config.yaml implies; was "
                             f"config.yaml edited after training?") from None
        exporter.run(plan)
        shards = exporter.finish()
        out_dtype = dtype or exporter.shapes()["embed.weight"].properties.dtype
        hf_config.update(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
                         torch_dtype=str(out_dtype).replace("torch.", ""))
        (partial / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        generation = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
                      "pad_token_id": tokenizer.eos_id, "do_sample": True, "temperature": 0.8, "top_p": 0.95}
        (partial / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        write_tokenizer_files(tokenizer, partial, cfg.model.max_position_embeddings)
    return ExportReport(out_dir, len(plan), shards, exporter.total, exporter.peak)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run directory (train.run_dir) or a checkpoints/step-N folder")
    p.add_argument("out", help="output folder (Hugging Face layout); must not exist unless --overwrite")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    p.add_argument("--max-shard-size", default="2GB", help="largest safetensors shard, e.g. 2GB, 500MB (default 2GB)")
    p.add_argument("--dtype", default="keep", help="keep (the checkpoint's, float32) | bfloat16 | float16 | float32")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it holds a previous export (and nothing "
                   "else)")
    p.add_argument("--no-mtp", action="store_true", help="leave out the multi-token-prediction layers, which "
                   "transformers' DeepseekV3 does not run (it lists their weights as unexpected keys when loading)")


def run(args: argparse.Namespace) -> int:
    max_bytes = parse_size(args.max_shard_size)
    if args.dtype != "keep" and args.dtype not in DTYPES:
        raise UsageError(f"--dtype {args.dtype!r}: use keep, {', '.join(DTYPES)}")
    out = Path(args.out)
    ckpt = find_checkpoint(args.run, args.step)
    export_dir.check_out(out, ckpt.run_dir)
    export_dir.check_overwrite(out, args.overwrite)
    cfg = load_run_config(ckpt.run_dir)
    tokenizer = load_run_tokenizer(cfg)
    report = export_checkpoint(ckpt.path, cfg, tokenizer, out, max_shard_bytes=max_bytes,
                               dtype=None if args.dtype == "keep" else DTYPES[args.dtype], mtp=not args.no_mtp)
    print(f"exported {ckpt.path} to {report.out_dir}: {report.tensors} tensors in {report.shards} shard(s), "
          f"{report.total_bytes / 1e9:.3f} GB (at most {report.peak_bytes / 1e9:.3f} GB held at once)",
          file=sys.stderr)
    layers = cfg.model.num_nextn_predict_layers
    if layers and not args.no_mtp:
        print(f"note: the {layers} multi-token-prediction layer(s) are exported as model.layers."
              f"{cfg.model.num_hidden_layers}+; transformers does not run them and lists their weights as unexpected "
              f"keys when loading, which is harmless (--no-mtp leaves them out)", file=sys.stderr)
    print(f"load it with: transformers.AutoModelForCausalLM.from_pretrained({str(report.out_dir)!r})",
          file=sys.stderr)
    return 0
