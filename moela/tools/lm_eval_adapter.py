"""lm-eval-harness adapter: `MoelaLM` implements lm_eval's `LM` interface (loglikelihood, loglikelihood_rolling,
generate_until) over a moela checkpoint (a run directory) or a Hugging Face export of one.

    python -m moela eval runs/small --tasks hellaswag,arc_easy --limit 200     # needs pip install 'moela[eval]'

or from Python: `lm_eval.simple_evaluate(model=MoelaLM.from_path("runs/small"), tasks=[...])`; importing this module
also registers the model name "moela" (`model="moela", model_args="path=runs/small,device=cuda"`). Without lm_eval
installed the class still works on plain `(context, continuation)` tuples (what the tests call).

Decisions:
- Texts are encoded as training saw documents: the run's BOS token first when it has one. An empty context is the
  harness's convention: the prefix token (BOS, else EOS) conditions the first continuation token.
- A context's trailing spaces move to the continuation and the pair is encoded jointly, then split (the harness's
  rule for BPE tokenizers, so " word" keeps its merged token).
- Scoring runs the training forward on packed requests (several per batch, no padding), truncating the context on
  the left to `max_length` (the model's max_position_embeddings); rolling loglikelihood uses the harness's windows:
  the first predicts the text's first `max_length` tokens after the prefix token, each later one the next
  `max_length` tokens given the `max_length` tokens before them.
- generate_until decodes with the latent cache (greedy unless `do_sample`), stops at the first `until` string or
  the end-of-document token, and returns the text before the stop string.
"""

from __future__ import annotations

import argparse
import json
from contextlib import nullcontext
from pathlib import Path

import torch

from moela.batch import IGNORE_INDEX, PackedBatch
from moela.config import Config
from moela.data.tokenizer import Tokenizer, load_tokenizer
from moela.inference import generate
from moela.model import Transformer
from moela.tools.import_hf import special_token
from moela.tools.runs import (
    RunCheckpoint,
    UsageError,
    find_checkpoint,
    load_model,
    load_run_config,
    load_run_tokenizer,
    resolve_device,
)

try:
    from lm_eval.api.model import LM as _Base
    from lm_eval.api.registry import register_model
except ImportError:  # the adapter works without the harness; only the registration needs it
    _Base, register_model = object, None

DEFAULT_GEN_TOKENS = 256


def _args(request) -> tuple:
    """An lm_eval `Instance` (its `.args`) or a plain tuple."""
    return tuple(request.args) if hasattr(request, "args") else tuple(request)


def rolling_windows(tokens: list[int], prefix: int, max_length: int) -> list[tuple[list[int], list[int]]]:
    """(input, targets) pairs scoring every token of `tokens` once; targets align with the input's last positions."""
    if not tokens:
        return []
    first = min(max_length, len(tokens))
    windows = [([prefix] + tokens[:first - 1], tokens[:first])]
    done = first
    while done < len(tokens):
        end = min(done + max_length, len(tokens))
        windows.append((tokens[end - max_length - 1:end - 1], tokens[done:end]))
        done = end
    return windows


class MoelaLM(_Base):
    def __init__(self, model: Transformer, tokenizer: Tokenizer, *, max_length: int | None = None,
                 batch_tokens: int = 8192, autocast_dtype: torch.dtype | None = None):
        if _Base is not object:
            super().__init__()
        self.model, self.tokenizer = model.eval(), tokenizer
        self.max_length = max_length or model.cfg.max_position_embeddings
        self.batch_tokens, self.autocast_dtype = batch_tokens, autocast_dtype
        self.bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
        self.prefix = tokenizer.eos_id if tokenizer.bos_id is None else tokenizer.bos_id

    @classmethod
    def from_path(cls, path: str | Path, *, device: str = "auto", step: int | None = None,
                  dtype: torch.dtype = torch.float32) -> "MoelaLM":
        """A run directory / checkpoint folder, or a Hugging Face folder written by `python -m moela export`."""
        path = Path(path)
        dev = resolve_device(device)
        autocast = torch.bfloat16 if dev.type == "cuda" else None
        if (path / "config.json").is_file():
            from moela.model.hf import import_hf
            tok_cfg_file = path / "tokenizer_config.json"
            tok_cfg = json.loads(tok_cfg_file.read_text()) if tok_cfg_file.is_file() else {}
            tokenizer = load_tokenizer(str(path / "tokenizer.json"), special_token(tok_cfg.get("eos_token")),
                                       special_token(tok_cfg.get("bos_token")))
            return cls(import_hf(path, dev).to(dtype).eval(), tokenizer, autocast_dtype=autocast)
        ckpt = find_checkpoint(path, step)
        cfg = load_run_config(ckpt.run_dir)
        return cls(load_model(cfg.model, ckpt.path, dev, dtype), load_run_tokenizer(cfg), autocast_dtype=autocast)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "MoelaLM":
        """lm_eval's `model_args`: `path=RUN_DIR[,device=cuda][,step=N]`."""
        args = dict(kv.split("=", 1) for kv in arg_string.split(",") if kv)
        if "path" not in args:
            raise ValueError("moela model_args need path=RUN_DIR (a run directory or an exported HF folder)")
        step = int(args["step"]) if "step" in args else None
        return cls.from_path(args["path"], device=args.get("device", "auto"), step=step)

    # ----- encoding -----
    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        if not context:
            return [self.prefix], self.tokenizer.encode(continuation)
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.tokenizer.encode(context + continuation)
        ctx = self.tokenizer.encode(context)
        return self.bos + ctx, whole[len(ctx):]

    # ----- scoring -----
    @torch.no_grad()
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(input, targets) -> (sum log p(targets), greedy); targets align with the input's last positions."""
        results: list[tuple[float, bool]] = []
        batch: list[tuple[list[int], list[int]]] = []
        for inputs, targets in pairs:
            inputs = inputs[-self.max_length:]
            if len(targets) > len(inputs):
                raise ValueError(f"moela lm-eval: {len(targets)} target tokens exceed max_length={self.max_length}")
            if batch and sum(len(i) for i, _ in batch) + len(inputs) > self.batch_tokens:
                results += self._score_batch(batch)
                batch = []
            batch.append((inputs, targets))
        return results + (self._score_batch(batch) if batch else [])

    def _score_batch(self, batch: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        device = self.model.embed.weight.device
        lengths = [len(i) for i, _ in batch]
        ids = torch.tensor([t for i, _ in batch for t in i], device=device)  # [T]
        positions = torch.cat([torch.arange(n, dtype=torch.int32) for n in lengths]).to(device)  # [T]
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
        packed = PackedBatch(ids, torch.full_like(ids, IGNORE_INDEX), positions, cu, max(lengths), targets_on_host=0)
        ctx = torch.autocast(device.type, dtype=self.autocast_dtype) if self.autocast_dtype else nullcontext()
        with ctx:
            logits = self.model(packed, return_logits=True).logits  # [T, V]
        logprobs = logits.float().log_softmax(dim=-1)  # [T, V]
        out, start = [], 0
        for (_, targets), n in zip(batch, lengths):
            rows = logprobs[start + n - len(targets):start + n]  # [n_targets, V]
            want = torch.tensor(targets, device=device)
            total = float(rows.gather(1, want[:, None]).sum())
            out.append((total, bool((rows.argmax(dim=-1) == want).all())))
            start += n
        return out

    # ----- the LM interface -----
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = []
        for request in requests:
            context, continuation = _args(request)
            ctx, cont = self._encode_pair(context, continuation)
            pairs.append(((ctx + cont)[:-1], cont))
        return self._score(pairs)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for request in requests:
            (text,) = _args(request)[:1]
            windows = rolling_windows(self.tokenizer.encode(text), self.prefix, self.max_length)
            out.append(sum(lp for lp, _ in self._score(windows)))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        return [self._generate_one(*_args(request)) for request in requests]

    def _generate_one(self, context: str, kwargs: dict | None) -> str:
        kwargs = dict(kwargs or {})
        until = kwargs.get("until") or [self.tokenizer.decode([self.tokenizer.eos_id])]
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(kwargs.get("max_gen_toks", DEFAULT_GEN_TOKENS))
        temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
        prompt = (self.bos + self.tokenizer.encode(context))[-max(1, self.max_length - max_new):]
        produced: list[int] = []

        def stop(tokens: list[int], finished: list[bool]) -> bool:
            if not finished[0]:
                produced.append(tokens[0])
            return any(s in self.tokenizer.decode(produced) for s in until)

        generate(self.model, [prompt], max_new_tokens=max_new, temperature=temperature, eos_id=self.tokenizer.eos_id,
                 on_step=stop)
        text = self.tokenizer.decode(produced)
        return text[:min((text.index(s) for s in until if s in text), default=len(text))]


if register_model is not None:
    register_model("moela")(MoelaLM)


def run_tasks(ckpt: RunCheckpoint, cfg: Config, device: torch.device, args: argparse.Namespace) -> int:
    """`python -m moela eval RUN --tasks ...`: lm-eval-harness tasks on the checkpoint; prints the results table."""
    if _Base is object:
        raise UsageError("--tasks needs the lm-eval harness: pip install 'moela[eval]' (or pip install lm-eval)")
    import lm_eval
    from lm_eval.utils import make_table

    autocast = torch.bfloat16 if device.type == "cuda" else None
    lm = MoelaLM(load_model(cfg.model, ckpt.path, device, torch.float32), load_run_tokenizer(cfg),
                 autocast_dtype=autocast)
    results = lm_eval.simple_evaluate(model=lm, tasks=args.tasks.split(","), limit=args.limit,
                                      num_fewshot=args.num_fewshot)
    print(make_table(results))
    return 0
