"""One current table per benchmark: every bench script writes its results through `bench/results_io.write_results`
under its own name, every file in bench/results is such a script's `<script>.md` or `.json`, and the writer's
header holds the commit, the date, the device, the versions and the command."""

from __future__ import annotations

import ast
import datetime
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from bench import results_io

BENCH = Path(__file__).resolve().parents[1]
ROOT = BENCH.parent
# scripts that measure nothing: a profiler target and the summary of one training run (both only print)
NOT_BENCHMARKS = {"attention_once", "run_summary"}


def _is_script(tree: ast.Module) -> bool:
    """Whether the module has an `if __name__ == "__main__":` block."""
    return any(isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
               and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__" for node in tree.body)


def scripts() -> list[str]:
    return sorted(p.stem for p in BENCH.glob("*.py") if _is_script(ast.parse(p.read_text())))


def writes_named(tree: ast.Module) -> list:
    """The first argument of every `write_results(...)` call (a string, or None where it is not a literal)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name == "write_results":
                first = node.args[0] if node.args else None
                names.append(first.value if isinstance(first, ast.Constant) else None)
    return names


def test_the_script_finder_sees_the_benchmarks():
    found = set(scripts())
    assert {"attention", "balance", "scaling", "step", "run_summary"} <= found
    assert "results_io" not in found and "scaling_report" not in found  # modules without a command line
    assert NOT_BENCHMARKS <= found, "a listed script no longer exists: drop it from the list"


@pytest.mark.parametrize("script", [s for s in scripts() if s not in NOT_BENCHMARKS])
def test_every_benchmark_writes_its_own_results(script):
    names = writes_named(ast.parse((BENCH / f"{script}.py").read_text()))
    assert names == [script], f"bench/{script}.py must call write_results({script!r}, ...) once, found {names}"


@pytest.mark.parametrize("script", sorted(NOT_BENCHMARKS))
def test_helper_scripts_write_no_results(script):
    tree = ast.parse((BENCH / f"{script}.py").read_text())
    assert writes_named(tree) == []
    docstring = ast.get_docstring(tree, clean=False)
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
               and n.value != docstring]
    assert not any("results" in s for s in strings), f"bench/{script}.py names a results path"


def test_every_results_file_belongs_to_a_script():
    known = set(scripts()) - NOT_BENCHMARKS
    strays = [p.name for p in sorted((BENCH / "results").iterdir())
              if p.suffix not in (".md", ".json") or p.stem not in known]
    assert strays == [], f"bench/results holds files no bench script writes: {strays}"


def test_the_writer_heads_both_files_and_replaces_them(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(BENCH / "demo.py"), "--size", "two words", "--out-dir", str(tmp_path)])
    before = datetime.datetime.now(datetime.timezone.utc).replace(second=0, microsecond=0)
    payload = {"rows": [{"impl": "a", "ms": 1.25}, {"impl": "b", "ms": None}]}
    md = results_io.write_results("demo", "A demo table", "| impl | ms |\n| --- | --- |\n| a | 1.25 |\n", payload,
                                  out_dir=tmp_path)
    after = datetime.datetime.now(datetime.timezone.utc)
    assert md == tmp_path / "demo.md" and sorted(p.name for p in tmp_path.iterdir()) == ["demo.json", "demo.md"]

    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    commit = head.stdout.strip() if head.returncode == 0 else "unknown"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    command = f"python bench/demo.py --size 'two words' --out-dir {tmp_path}"

    header = json.loads((tmp_path / "demo.json").read_text())["header"]
    assert json.loads((tmp_path / "demo.json").read_text())["results"] == payload
    assert header["commit"] == commit and header["torch"] == torch.__version__
    assert header["triton"] == triton.__version__ and header["command"] == command
    assert header["device"].startswith(device)
    date = datetime.datetime.strptime(header["date"], "%Y-%m-%d %H:%M UTC").replace(tzinfo=datetime.timezone.utc)
    assert before <= date <= after

    lines = md.read_text().splitlines()
    assert lines[0] == "# A demo table" and lines[1] == ""
    assert lines[2].startswith(f"commit {commit[:12]}") and header["date"] in lines[2]
    assert f"torch {torch.__version__}, triton {triton.__version__}" in lines[2] and header["device"] in lines[2]
    assert lines[4] == f"`{command}`" and lines[6:] == ["| impl | ms |", "| --- | --- |", "| a | 1.25 |"]

    results_io.write_results("demo", "Again", "short", [], out_dir=tmp_path, device="2 x test GPU")
    again = md.read_text()
    assert again.startswith("# Again\n") and again.endswith("\n\nshort\n") and "| a |" not in again
    assert "2 x test GPU" in again and json.loads((tmp_path / "demo.json").read_text())["results"] == []


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                   capture_output=True)


def test_dirty_means_changed_code_not_rewritten_results(tmp_path, monkeypatch):
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "x.py").write_text("a = 1\n")
    (tmp_path / "bench" / "results" / "x.md").write_text("old\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "x")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True)
    monkeypatch.setattr(results_io, "ROOT", tmp_path)
    assert results_io.commit_state() == (head.stdout.strip(), False)
    (tmp_path / "bench" / "results" / "x.md").write_text("new\n")
    assert results_io.commit_state() == (head.stdout.strip(), False)
    (tmp_path / "bench" / "x.py").write_text("a = 2\n")
    assert results_io.commit_state() == (head.stdout.strip(), True)

    monkeypatch.setattr(results_io, "ROOT", tmp_path / "no-git-here")
    monkeypatch.setenv("BENCH_COMMIT", "abc123")
    assert results_io.commit_state() == ("abc123", None)


def test_scaling_rebuilds_its_tables_from_the_rows(tmp_path):
    """The committed rows through `bench/scaling.py --report-only`: the header names the rows' GPU and versions,
    not this machine's, and the current rows are the JSON payload."""
    rows = [json.loads(line) for line in (BENCH / "notes" / "scaling.jsonl").read_text().splitlines()
            if line.strip()][-4:]
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    subprocess.run([sys.executable, str(BENCH / "scaling.py"), "--report-only", "--jsonl", str(jsonl),
                    "--out-dir", str(tmp_path / "out")], check=True, cwd=ROOT, capture_output=True, timeout=300)
    data = json.loads((tmp_path / "out" / "scaling.json").read_text())
    assert data["header"]["device"] == ", ".join(sorted({r["gpu"] for r in data["results"]}))
    assert data["header"]["torch"] == ", ".join(sorted({r["torch"] for r in data["results"]}))
    assert data["header"]["command"].startswith("python bench/scaling.py --report-only")
    assert {r["date"] for r in data["results"]} <= {r["date"] for r in rows}
    md = (tmp_path / "out" / "scaling.md").read_text()
    assert md.startswith("# Weak scaling") and "| GPUs | layout |" in md
