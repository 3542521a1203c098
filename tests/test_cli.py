"""train.py: exit code 2 with every recipe error at once and no traceback; the usage when called bare;
--print-config; launcher env vars; torchrun with 2 gloo ranks that agree to stop when one gets SIGTERM; Ctrl-C
saves and exits with code 3; CI runs the README command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moela.config import load_config
from moela.trainer.distributed import init_distributed
from moela.trainer.errors import TrainingError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import train  # noqa: E402


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, **(env or {})})


def test_bad_recipe_exits_2_listing_all_errors_without_traceback(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(textwrap.dedent("""
        optim: {lr: fast, wieght_decay: 0.1}
        train: {stpes: 10}
    """))
    proc = run_cli(recipe, "logging.wandb.mode=ofline")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    err = proc.stderr
    assert "4 problems" in err
    assert f"{recipe}: optim.lr: expected a number, got 'fast'" in err
    assert f"{recipe}: optim.wieght_decay: unknown key" in err and "did you mean 'weight_decay'" in err
    assert f"{recipe}: train.stpes: unknown key" in err and "did you mean 'steps'" in err
    assert "command line: logging.wandb.mode" in err and "did you mean 'offline'" in err


def test_missing_file_bad_yaml_and_bad_override_exit_2(tmp_path, capsys):
    assert train.main([str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml: file not found" in capsys.readouterr().err
    broken = tmp_path / "broken.yaml"
    broken.write_text("train:\n  steps: [1\n")
    assert train.main([str(broken)]) == 2
    assert f"{broken}: invalid YAML at line" in capsys.readouterr().err
    assert train.main([str(ROOT / "recipes" / "tiny.yaml"), "train.steps"]) == 2
    assert "expected section.key=value" in capsys.readouterr().err


def test_no_arguments_prints_the_usage_and_the_first_command_exits_2():
    """`python train.py` alone: a short usage naming the tiny recipe to try (a file that exists), exit code 2, no
    argparse complaint about missing overrides and no traceback."""
    r = run_cli()
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("usage: python train.py RECIPE.yaml [section.key=value ...]")
    assert "Traceback" not in r.stderr and "required" not in r.stderr
    suggested = r.stderr.split("try:")[1].split()[2]
    assert suggested == "recipes/tiny.yaml" and (ROOT / suggested).is_file()


def test_print_config_prints_the_resolved_recipe(tmp_path, capsys):
    assert train.main([str(ROOT / "recipes" / "tiny.yaml"), "--print-config", "optim.lr=5e-4",
                       "train.steps=7"]) == 0
    printed = capsys.readouterr().out
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(printed)
    cfg = load_config(resolved)
    assert cfg == load_config(ROOT / "recipes" / "tiny.yaml", ["optim.lr=5e-4", "train.steps=7"])
    assert cfg.optim.lr == 5e-4 and cfg.train.steps == 7


def test_launcher_env_vars_single_process(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    env = init_distributed("cpu")
    assert (env.rank, env.world_size, env.local_rank, env.device.type, env.owns_process_group) == (0, 1, 0, "cpu",
                                                                                                   False)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(TrainingError, match="WORLD_SIZE='two' is not an integer"):
        init_distributed("cpu")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(TrainingError, match="cannot start the process group.*MASTER_ADDR.*launch with torchrun"):
        init_distributed("cpu")


def test_malformed_rank_exits_1_without_traceback(tmp_path):
    proc = run_cli("recipes/tiny.yaml", f"train.run_dir={tmp_path}", env={"RANK": "abc"})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "RANK='abc' is not an integer" in proc.stderr


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [line for line in readme.splitlines() if "pytest" in line and line.startswith("python3 -m pip")]
    assert len(commands) == 1, commands
    assert commands[0] in ci.splitlines()
    assert 'if [ "$rc" -eq 5 ]' in ci and "exit 1" in ci


def _worker_pid(agent_pid: int, rank: int) -> int:
    """The pid of torchrun's worker process with RANK=`rank` (a child of the agent)."""
    children = Path(f"/proc/{agent_pid}/task/{agent_pid}/children").read_text().split()
    for pid in map(int, children):
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in env:
            return pid
    raise AssertionError(f"no worker with RANK={rank} among {children}")


def _long_run_overrides(tmp_path, run) -> list[str]:
    """A tiny CPU model set to train (almost) forever: the signal tests stop it."""
    return [
        "model.hidden_size=32", "model.num_hidden_layers=2", "model.n_routed_experts=4", "model.num_attention_heads=2",
        "model.q_lora_rank=16", "model.kv_lora_rank=16", "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8",
        "model.v_head_dim=8", "model.intermediate_size=48", "model.moe_intermediate_size=16", "train.device=cpu",
        "train.steps=100000", "train.tokens_per_microbatch=128", "data.max_doc_len=64", "data.val_max_tokens=256",
        f"data.cache_dir={tmp_path / 'cache'}", f"train.run_dir={run}", "logging.log_every=1", "logging.plot=false"]


@pytest.mark.skipif(not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists(),
                    reason="finds the worker pid through /proc/PID/task/PID/children (Linux)")
def test_torchrun_two_cpu_processes_agree_to_stop_on_one_ranks_sigterm(tmp_path):
    """The unchanged CLI under torchrun: 2 gloo ranks, FSDP2. SIGTERM reaches rank 1 only; both ranks stop after
    the same step and write one checkpoint with a trainer file per rank."""
    run = tmp_path / "run"
    overrides = [*_long_run_overrides(tmp_path, run), "schedule.warmup_steps=1"]
    stderr = tmp_path / "stderr.txt"  # a file, not a pipe: unread warnings must not fill a pipe and block the ranks
    with stderr.open("w") as err_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
             str(ROOT / "train.py"), str(ROOT / "recipes" / "tiny.yaml"), *overrides],
            stdout=subprocess.PIPE, stderr=err_file, text=True, cwd=ROOT)
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("step 2/"):
                os.kill(_worker_pid(proc.pid, 1), signal.SIGTERM)
                break
        out, _ = proc.communicate(timeout=300)
    out, err = "".join(seen) + out, stderr.read_text()
    # the workers exit 3 (stopped with a checkpoint); torchrun reports the first one's code, stops the others and
    # exits 1
    assert proc.returncode == 1 and "exitcode  : 3" in err, err[-3000:]
    assert "on 2 x cpu" in out and "dp cost max/mean" in out
    assert "stopped by SIGTERM after step" in out  # printed by rank 0, which did not receive the signal
    (saved,) = (run / "checkpoints").glob("step-*")
    assert sorted(p.name for p in saved.glob("trainer-rank*.pt")) == ["trainer-rank0.pt", "trainer-rank1.pt"]
    assert (run / "checkpoints" / "latest").read_text().strip() == saved.name


def test_ctrl_c_saves_a_checkpoint_and_exits_3(tmp_path):
    run = tmp_path / "run"
    overrides = _long_run_overrides(tmp_path, run)
    stderr = tmp_path / "stderr.txt"  # a file, not a pipe (see above)
    with stderr.open("w") as err_file:
        proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), str(ROOT / "recipes" / "tiny.yaml"),
                                 *overrides], stdout=subprocess.PIPE, stderr=err_file, text=True, cwd=ROOT)
        for line in proc.stdout:
            if line.startswith("step 3/"):
                proc.send_signal(signal.SIGINT)
                break
        out, _ = proc.communicate(timeout=120)
    err = stderr.read_text()
    assert proc.returncode == 3, err[-3000:]  # stopped with a checkpoint: not 0, so `train.py && next` stops too
    assert "Traceback" not in err and "stopped by SIGINT after step" in out
    assert "received SIGINT: saving a checkpoint after this step" in err
    (saved,) = (run / "checkpoints").glob("step-*")
    assert int(saved.name.split("-")[1]) >= 3 and (run / "checkpoints" / "latest").read_text().strip() == saved.name
