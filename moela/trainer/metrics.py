"""Run metrics: the step line, metrics.jsonl, wandb, a tqdm bar, MFU and memory, and the loss-curve PNG.

Only rank 0 writes. Every record is one JSON object per line in `run_dir/metrics.jsonl` with a `kind` of
`train`, `eval` or `profile` (`moela.trainer.profiling`), so the file is easy to load with pandas
(`pd.read_json(path, lines=True)`); wandb gets the numbers under `<kind>/`.

Decisions:
- MFU = achieved model FLOP/s per device / the device's dense bf16 peak. Achieved FLOPs come from the model's
  `flops_per_token` estimate (training FLOPs incl. attention), the peak from a table of GPU names (datasheet
  dense numbers) or `logging.peak_tflops`; on CPU or an unknown GPU without that key MFU is not reported.
- Expert-load imbalance = max / mean tokens per expert, averaged over MoE layers (1.0 is perfectly balanced;
  computed on the device, `moela.trainer.step_metrics`);
  DP imbalance = max / mean micro-batch cost over data-parallel ranks, as the loader reports it.
- Like Megatron-LM, a logged line averages the loss terms (keys ending in `loss`) over the steps since the
  previous line, skipped non-finite steps excluded, and reports throughput and MFU over that window; `loss_step`
  is the logged step's own loss. Step 1 is always logged on its own. The window is part of the checkpoint, so a
  resumed run logs exactly what an uninterrupted one does.
- After a resume, records past the resumed step are dropped from metrics.jsonl, so the file and the plot show one
  consistent history; so is a line that is not a complete record (torn by a crash mid-write), with a warning.
- wandb is imported only when `logging.wandb.mode` is not `disabled`; offline runs write under `run_dir/wandb`.
  `online` needs a login: `check_wandb_login` looks for one before the run builds anything, and a failing
  `wandb.init` (no network) is a `TrainingError`, not a traceback.
"""

from __future__ import annotations

import inspect
import io
import json
import logging
import math
import os
import re
import resource
import sys
from pathlib import Path
from typing import Any

import torch

from moela.config import Config, LoggingConfig, WandbConfig, to_dict
from moela.model.params import flops_per_token
from moela.trainer.errors import TrainingError
from moela.trainer.safe_write import open_nofollow, write_atomic, writing

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"

# Dense bf16 peak TFLOP/s per device, by a substring of torch.cuda.get_device_name() (datasheet, no sparsity).
PEAK_BF16_TFLOPS = {
    "H200": 989.0, "H100": 989.0, "H800": 989.0, "H20": 148.0, "GH200": 989.0, "B200": 2250.0, "B100": 1750.0,
    "A100": 312.0, "A800": 312.0, "A10G": 125.0, "L40S": 362.0, "L4": 121.0, "4090": 165.0, "3090": 71.0,
}


def device_peak_flops(device: torch.device, cfg: LoggingConfig) -> float | None:
    """Peak FLOP/s of one device for MFU, or None when unknown (CPU, unlisted GPU)."""
    if cfg.peak_tflops is not None:
        return cfg.peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_TFLOPS[key] * 1e12
    return None


def memory_gib(device: torch.device) -> float:
    """Peak memory: CUDA max allocated on the device, else this process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


class LogWindow:
    """Accumulates step records between two logged lines and averages them (see the module docstring)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.finite_steps = 0
        self.time_s = 0.0
        self.tokens = 0.0
        self.mfu_time = 0.0  # sum of mfu * step time: MFU over the window is this / time_s
        self.sums: dict[str, float] = {}

    def add(self, rec: dict[str, Any]) -> None:
        self.steps += 1
        self.time_s += rec["step_time_s"]
        self.tokens += rec["tokens_per_s"] * rec["step_time_s"]
        if rec.get("mfu") is not None:
            self.mfu_time += rec["mfu"] * rec["step_time_s"]
        if math.isfinite(rec["loss"]):
            self.finite_steps += 1
            for key, value in rec.items():
                if key.endswith("loss"):
                    self.sums[key] = self.sums.get(key, 0.0) + value

    def summarize(self, rec: dict[str, Any]) -> dict[str, Any]:
        """The logged record: `rec` (the last step) with window averages in place of its loss terms."""
        out = dict(rec)
        out["loss_step"] = rec["loss"]
        if self.finite_steps:
            out.update({key: value / self.finite_steps for key, value in self.sums.items()})
        out["window_steps"] = self.steps
        if self.time_s > 0:
            out["tokens_per_s"] = self.tokens / self.time_s
            if rec.get("mfu") is not None:
                out["mfu"] = self.mfu_time / self.time_s
        self.reset()
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "finite_steps": self.finite_steps, "time_s": self.time_s, "tokens": self.tokens,
                "mfu_time": self.mfu_time, "sums": dict(self.sums)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.finite_steps = state["steps"], state["finite_steps"]
        self.time_s, self.tokens, self.mfu_time = state["time_s"], state["tokens"], state["mfu_time"]
        self.sums = dict(state["sums"])


def _fmt_count(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def loss_legend(model_cfg) -> str | None:
    """The one-line reading of the step line's two losses, printed at start when the objective has terms beyond the
    LM loss (None otherwise: then `loss` is the LM loss)."""
    terms = []
    if model_cfg.num_nextn_predict_layers:
        terms.append(f"{model_cfg.mtp_loss_weight:g} x MTP loss")
    if model_cfg.aux_loss_coef > 0 and model_cfg.num_moe_blocks:
        terms.append("balance loss")
    if model_cfg.z_loss_coef > 0:
        terms.append("z-loss")
    if not terms:
        return None
    return (f"loss = training objective (lm + {' + '.join(terms)}), so it runs above val_loss; lm = the next-token "
            f"loss alone, the one comparable to val_loss")


def format_step_line(rec: dict[str, Any], total_steps: int) -> str:
    parts = [f"step {rec['step']}/{total_steps}", f"loss {rec['loss']:.4f}"]
    if "lm_loss" in rec and rec["lm_loss"] != rec["loss"]:
        parts.append(f"lm {rec['lm_loss']:.4f}")
    parts += [f"lr {rec['lr']:.2e}", f"gnorm {rec['grad_norm']:.3f}", f"tok/s {_fmt_count(rec['tokens_per_s'])}"]
    if rec.get("mfu") is not None:
        parts.append(f"mfu {100 * rec['mfu']:.1f}%")
    parts.append(f"mem {rec['mem_gib']:.2f}G")
    if rec.get("expert_imbalance") is not None:
        parts.append(f"load max/mean {rec['expert_imbalance']:.2f}")
    if rec.get("dp_imbalance") is not None:
        before = rec.get("dp_imbalance_unbalanced")
        parts.append(f"dp cost max/mean {rec['dp_imbalance']:.3f}"
                     + (f" (round robin {before:.3f})" if before is not None and before != rec["dp_imbalance"] else ""))
    if rec.get("skipped"):
        parts.append(f"skipped {rec['skipped']}")
    return " | ".join(parts)


def format_eval_line(rec: dict[str, Any]) -> str:
    return f"eval step {rec['step']} | val_loss {rec['val_loss']:.4f} | val_ppl {rec['val_ppl']:.2f}"


def format_profile_line(rec: dict[str, Any]) -> str:
    shares = " ".join(f"{k[len('share_'):]} {100 * v:.1f}%" for k, v in rec.items() if k.startswith("share_"))
    busy = f" | GPU compute busy {100 * rec['busy']:.1f}%" if "busy" in rec else ""
    return (f"profile steps {rec['first_step']}-{rec['step']} | {rec['wall_s']:.2f} s{busy} | collectives' device "
            f"time share: {shares} | traces in {rec['trace_dir']}")


class MetricsWriter:
    """Rank-0 sink for step and eval records: stdout line (or tqdm), metrics.jsonl, wandb."""

    def __init__(self, cfg: Config, run_dir: Path, enabled: bool, start_step: int):
        self.enabled = enabled
        self.total_steps = cfg.train.steps
        self.path = run_dir / METRICS_FILE
        self.bar = None
        self.wandb_run = None
        if not enabled:
            return
        _truncate_after(self.path, start_step)
        self.file = open_nofollow(self.path, "a")
        show_bar = cfg.logging.progress_bar == "always" or (
            cfg.logging.progress_bar == "auto" and sys.stdout.isatty())
        if show_bar:
            from tqdm import tqdm
            self.bar = tqdm(total=cfg.train.steps, initial=start_step, unit="step", dynamic_ncols=True)
        wb = cfg.logging.wandb
        if wb.mode != "disabled":
            import wandb
            try:
                self.wandb_run = wandb.init(
                    mode=wb.mode, project=wb.project, entity=wb.entity, name=wb.name or run_dir.name, tags=wb.tags,
                    dir=str(run_dir), config=to_dict(cfg), resume="allow", id=_wandb_id(run_dir),
                )
            except Exception as e:  # wandb raises its own types (CommError, UsageError, ...): all mean "no run"
                self.close()
                fix = ("check the network and `wandb login`, or use logging.wandb.mode=offline (upload later with "
                       "`wandb sync`)") if wb.mode == "online" else (
                       f"check that {run_dir / 'wandb'} can be written, or set logging.wandb.mode=disabled")
                raise TrainingError(f"wandb could not start a run (logging.wandb.mode={wb.mode}): "
                                    f"{type(e).__name__}: {e}. Fix: {fix}") from None

    def echo(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def advance(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def log(self, rec: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with writing("metrics", self.path):
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()
        if rec["kind"] == "train":
            self.echo(format_step_line(rec, self.total_steps))
        elif rec["kind"] == "profile":
            self.echo(format_profile_line(rec))
        else:
            self.echo(format_eval_line(rec))
        if self.wandb_run is not None:
            prefix = rec["kind"] + "/"
            values = {prefix + k: v for k, v in rec.items()
                      if k not in ("kind", "step") and isinstance(v, (int, float))}
            self.wandb_run.log(values, step=rec["step"])

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        with writing("metrics", self.path):
            self.file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def check_wandb_login(cfg: WandbConfig) -> None:
    """`mode: online` needs wandb credentials (WANDB_API_KEY, or `wandb login`'s entry in ~/.netrc); checked
    before anything heavy, without the network, so a missing login fails in seconds."""
    if cfg.mode != "online":
        return
    import wandb

    kwargs = {"prompt": False} if "prompt" in inspect.signature(wandb.login).parameters else {}
    try:
        logged_in = wandb.login(verify=False, **kwargs)
    except Exception:  # wandb versions without `prompt` raise UsageError when there is no terminal to ask on
        logged_in = False
    if not logged_in:
        raise TrainingError("logging.wandb.mode=online needs a wandb login, and none is configured (no "
                            "WANDB_API_KEY, no `wandb login` entry in ~/.netrc). Run `wandb login` or set "
                            "WANDB_API_KEY; or use logging.wandb.mode=offline and upload later with `wandb sync`, or "
                            "logging.wandb.mode=disabled")


def _wandb_id(run_dir: Path) -> str:
    """A stable wandb run id per run directory, so a resumed run continues the same wandb run. A file that does not
    hold an id (empty, damaged) is replaced by a new one, with a warning: the run continues in a new wandb run."""
    id_file = run_dir / "wandb_id"
    if id_file.exists():
        try:
            run_id = id_file.read_bytes()[:128].decode("ascii").strip()
        except UnicodeDecodeError:
            run_id = ""
        if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", run_id):
            return run_id
        log.warning("%s does not hold a wandb run id (empty or damaged): logging to a new wandb run", id_file)
    run_id = os.urandom(6).hex()
    write_atomic(id_file, run_id + "\n", "the wandb run id")
    return run_id


def _parse_records(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """The records of a metrics file and the numbers of the lines that are not one (a line torn by a crash
    mid-write, or bytes that are not UTF-8 JSON)."""
    records, bad = [], []
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:  # JSONDecodeError and UnicodeDecodeError
            bad.append(number)
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
        else:
            bad.append(number)
    return records, bad


def _truncate_after(path: Path, step: int) -> None:
    """Drop records with step > `step` (logged after the checkpoint a run resumes from), and lines that are not
    records (a torn last line from a crash mid-write), with a warning."""
    if not path.exists():
        return
    records, bad = _parse_records(path)
    if bad:
        log.warning("%s: dropped line%s %s: not a complete JSON record (torn by an interrupted write)", path,
                    "s" if len(bad) > 1 else "", ", ".join(map(str, bad)))
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in records if r["step"] <= step), "metrics")


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of run_dir/metrics.jsonl, skipping lines that are not complete records."""
    path = Path(run_dir) / METRICS_FILE
    return _parse_records(path)[0] if path.exists() else []


def plot_losses(run_dir: str | Path) -> Path | None:
    """Write run_dir/loss.png: the training objective, its LM part and the validation LM loss against the step.
    matplotlib is an optional extra (`moela[plot]`): without it the plot is skipped with a message on stderr."""
    records = read_metrics(run_dir)
    train = [(r["step"], r["loss"]) for r in records if r["kind"] == "train" and math.isfinite(r["loss"])]
    train_lm = [(r["step"], r["lm_loss"]) for r in records
                if r["kind"] == "train" and "lm_loss" in r and math.isfinite(r["lm_loss"])]
    val = [(r["step"], r["val_loss"]) for r in records if r["kind"] == "eval"]
    if not train and not val:
        return None
    logging.getLogger("matplotlib").setLevel(logging.ERROR)  # its first-use notice (building the font cache)
    try:
        import matplotlib
    except ImportError:
        print(f"{PLOT_FILE} not written: matplotlib is not installed; pip install 'moela[plot]' (or set "
              f"logging.plot=false)", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    if train:
        ax.plot(*zip(*train), label="train objective (loss)", linewidth=1.2)
    if train_lm:
        ax.plot(*zip(*train_lm), label="train LM loss", linewidth=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation LM loss", linewidth=1.2, markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(Path(run_dir).name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(run_dir) / PLOT_FILE
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    write_atomic(out, buffer.getvalue(), "the loss plot")
    return out


def mfu(model_cfg, peak_flops: float | None, tokens: float, sum_sq_len: float, dt: float,
        world_size: int) -> float | None:
    """Model FLOPs utilization of a step: the whole model's training FLOPs for `tokens` tokens (at their
    token-weighted mean document length) over `dt` seconds of `world_size` devices of `peak_flops` each; the
    model counts once however it is split (pipeline stages included). None without a known peak."""
    if peak_flops is None or tokens == 0:
        return None
    seq_len = max(1, round(sum_sq_len / tokens))  # token-weighted mean document length
    return flops_per_token(model_cfg, seq_len) * tokens / dt / world_size / peak_flops
