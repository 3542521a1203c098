"""`python -m moela` after training, on a tiny model trained in-process: generate equals transformers' greedy decoding
of the export; the streamed export is the in-memory one (also from a 2-rank FSDP2 + EP checkpoint), loads in
transformers with the same logits and never holds more than a shard and a read buffer; eval equals the trainer's
val_loss; import round-trips; checkpoint.init_from starts training from the weights; the run ends with its summary;
user errors exit with code 2 and a message."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import shutil

import pytest
import torch
import torch.distributed as dist

from factories import VISIBLE_TRAINING, tiny_config, tiny_overrides
from moela.config import Config, dump_config, load_config
from moela.inference import generate
from moela.model.hf import to_hf_state_dict
from moela.tools.cli import main
from moela.tools.evaluate import token_byte_lengths
from moela.tools.export import export_checkpoint
from moela.tools.runs import UsageError, find_checkpoint, load_model, load_run_config, load_run_tokenizer
from moela.trainer import Trainer
from parallel_harness import spawn

transformers = pytest.importorskip("transformers")

MODEL = tiny_overrides(vocab_size=4096, max_position_embeddings=256)  # the bundled tokenizer's vocabulary


def _cfg(run_dir, cache_dir, *extra):
    return load_config(None, MODEL + [
        f"train.run_dir={run_dir}", f"data.cache_dir={cache_dir}", "data.max_doc_len=64", "data.val_max_tokens=384",
        "train.tokens_per_microbatch=256", "train.steps=12", "train.cpu_threads=1", "train.eval_every=6",
        "schedule.warmup_steps=2", "optim.lr=1e-2", "logging.log_every=4", "logging.progress_bar=never",
        "logging.samples=2", "logging.sample_tokens=4", "logging.sample_prompt='ROMEO:'", *extra])


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tokens")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache_dir):
    """(run_dir, everything the run printed)."""
    run_dir = tmp_path_factory.mktemp("run") / "tiny"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        Trainer(_cfg(run_dir, cache_dir)).fit()
    return run_dir, out.getvalue()


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "hf"
    assert main(["export", str(trained[0]), str(out), "--max-shard-size", "40KB"]) == 0
    return out


def _hf_model(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def test_run_prints_the_loss_legend_lm_loss_samples_and_ends_with_the_summary(trained):
    run_dir, text = trained
    lines = [line for line in text.splitlines() if line.strip()]
    assert any(line.startswith("loss = training objective (lm + 0.3 x MTP loss") for line in lines)
    steps = [line for line in lines if line.startswith("step ")]
    assert steps and all(re.search(r"\| loss \d+\.\d+ \| lm \d+\.\d+ \|", line) for line in steps)
    assert sum(line.startswith("samples at step") for line in lines) == 2  # steps 6 and 12
    assert sum(line.lstrip().startswith(("[1] ROMEO:", "[2] ROMEO:")) for line in lines) == 4
    summary = lines[lines.index(f"run summary | {run_dir}"):]
    records = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in records if r["kind"] == "eval"][-1]
    assert any(f"final {final['val_loss']:.4f}" in line for line in summary)
    assert any(line.strip() == f"checkpoint  {run_dir / 'checkpoints' / 'step-12'}" for line in summary)
    assert summary[-1].strip() == f"python -m moela export {run_dir} {run_dir.parent / (run_dir.name + '-hf')}"
    assert lines[-1] == summary[-1]  # nothing (e.g. matplotlib) after the summary


def test_commands_verify_checkpoints_and_fall_back_to_an_intact_one(trained, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(trained[0], run_dir)
    newest = run_dir / "checkpoints" / "step-12"
    shutil.copytree(newest, run_dir / "checkpoints" / "step-6")  # an older, intact checkpoint
    shard = sorted(newest.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte inside a saved tensor
    shard.write_bytes(bytes(data))
    chosen = find_checkpoint(run_dir)  # chosen by default: falls back, saying why
    assert chosen.step == 6
    assert f"{shard.name}: its sha256 differs" in capsys.readouterr().err
    with pytest.raises(UsageError, match=shard.name):  # named by the user: an error naming the damaged file
        find_checkpoint(newest)
    with pytest.raises(UsageError, match="damaged"):
        find_checkpoint(run_dir, 12)
    assert main(["generate", str(newest), "--max-new-tokens", "2"]) == 2


def test_summary_command_prints_the_same_summary(trained, capsys):
    run_dir, text = trained
    assert main(["summary", str(run_dir)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-4:] == [line for line in text.splitlines() if line.strip()][-4:]


def test_generate_equals_transformers_greedy_decoding_of_the_export(trained, exported, capsys):
    run_dir, _ = trained
    assert main(["generate", str(run_dir), "--prompt", "ROMEO:", "--temperature", "0", "--max-new-tokens", "12"]) == 0
    streamed = capsys.readouterr().out
    cfg = load_run_config(run_dir)
    tok = load_run_tokenizer(cfg)
    prompt = tok.encode("ROMEO:")
    hf = _hf_model(exported)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                          pad_token_id=tok.eos_id)[0, len(prompt):].tolist()
    ref = ref[:ref.index(tok.eos_id)] if tok.eos_id in ref else ref
    model = load_model(cfg.model, find_checkpoint(run_dir).path, torch.device("cpu"), torch.float32)
    ours = generate(model, [prompt], max_new_tokens=12, temperature=0, eos_id=tok.eos_id)[0]
    assert ours == ref
    assert streamed == "ROMEO:" + tok.decode(ref) + "\n"


def test_export_is_the_in_memory_export_loads_in_transformers_and_streams(trained, exported, tmp_path):
    run_dir, _ = trained
    ckpt = find_checkpoint(run_dir)
    cfg = load_run_config(run_dir)
    model = load_model(cfg.model, ckpt.path, torch.device("cpu"), torch.float32)
    expected = to_hf_state_dict(model)
    from safetensors.torch import load_file
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and all(re.fullmatch(rf"model-\d{{5}}-of-{len(shards):05d}\.safetensors", s) for s in shards)
    got = {}
    for shard in shards:
        got.update(load_file(str(exported / shard)))
    assert got.keys() == expected.keys() == index["weight_map"].keys()
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in expected.values())
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (exported / name).is_file()
    hf_tok = transformers.AutoTokenizer.from_pretrained(exported)
    tok = load_run_tokenizer(cfg)
    assert hf_tok("ROMEO: hello")["input_ids"] == tok.encode("ROMEO: hello")
    assert json.loads((exported / "generation_config.json").read_text())["eos_token_id"] == tok.eos_id

    ids = torch.tensor(tok.encode("ROMEO: What, art thou mad?"))
    hf = _hf_model(exported)
    with torch.no_grad():
        ref = hf(input_ids=ids[None]).logits[0]
        n = ids.numel()
        from moela.batch import PackedBatch
        ours = model(PackedBatch(ids, ids, torch.arange(n, dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32),
                                 n), return_logits=True).logits
    assert (ref - ours).abs().max() < 1e-4

    # streamed: what is held at once is bounded by one shard plus the largest unsplittable tensor
    limit = 20_000
    report = export_checkpoint(ckpt.path, cfg, tok, tmp_path / "small", max_shard_bytes=limit)
    largest = max(v.nbytes for k, v in expected.items() if ".experts." not in k)
    total = sum(v.nbytes for v in expected.values())
    assert report.peak_bytes <= limit + largest and report.peak_bytes < total / 4
    assert report.total_bytes == total and report.shards > 10


def _save_two_ranks(rank, world_size, run_dir, expected_file):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from moela.model import build_model
    from moela.parallel import apply_parallelism, build_mesh
    from moela.parallel.config import ParallelConfig
    from moela.trainer.checkpoint import save_checkpoint

    torch.manual_seed(0)
    pcfg = ParallelConfig(ep=2)
    model = build_model(tiny_config(**VISIBLE_TRAINING), "cpu")
    model = apply_parallelism(model, build_mesh(pcfg, world_size, "cpu"), pcfg)
    with torch.no_grad():
        for moe in model.moe_layers():
            moe.gate.e_score_correction_bias.add_(0.01 * torch.arange(moe.n_experts))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    save_checkpoint(run_dir, 1, model, optimizer, {}, keep_last_k=1)
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in get_model_state_dict(model).items()}
    if rank == 0:
        torch.save(full, expected_file)
    dist.barrier()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_generate_and_export_read_a_two_rank_fsdp_ep_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(dump_config(Config(model=tiny_config(**VISIBLE_TRAINING))))
    spawn(_save_two_ranks, 2, str(run_dir), str(tmp_path / "expected.pt"))
    expected = torch.load(tmp_path / "expected.pt")
    cfg = load_run_config(run_dir)
    model = load_model(cfg.model, find_checkpoint(run_dir).path, torch.device("cpu"), torch.float32)
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    report = export_checkpoint(find_checkpoint(run_dir).path, cfg, load_run_tokenizer(cfg), tmp_path / "hf",
                               max_shard_bytes=4096)
    from safetensors.torch import load_file
    got = {}
    for shard in sorted((tmp_path / "hf").glob("model-*.safetensors")):
        got.update(load_file(str(shard)))
    want = to_hf_state_dict(model)
    assert got.keys() == want.keys() and report.tensors == len(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_eval_equals_the_trainers_val_loss(trained, capsys, tmp_path):
    run_dir, _ = trained
    assert main(["eval", str(run_dir)]) == 0
    line = capsys.readouterr().out
    loss = float(re.search(r"loss (\d+\.\d+)", line).group(1))
    records = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if r["kind"] == "eval"][-1]
    assert math.isclose(loss, val["val_loss"], rel_tol=0, abs_tol=6e-5)  # 4 printed decimals
    assert f"{val['val_targets']} tokens" in line

    from moela.tools.evaluate import evaluate_batches, held_out_loader
    cfg = load_run_config(run_dir)
    tok = load_run_tokenizer(cfg)
    model = load_model(cfg.model, find_checkpoint(run_dir).path, torch.device("cpu"), torch.float32)
    result = evaluate_batches(model, held_out_loader(cfg, tok, None), token_byte_lengths(tok, cfg.model.vocab_size))
    assert math.isclose(result.loss, val["val_loss"], rel_tol=1e-5)
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["To be, or not to be.", "Ay, marry — ’tis."]))
    assert main(["eval", str(run_dir), "--data", str(docs)]) == 0
    assert "bits/byte" in capsys.readouterr().out


def test_token_byte_lengths_count_the_utf8_bytes_of_the_text():
    from moela.data.tokenizer import load_tokenizer
    tok = load_tokenizer("bundled")
    table = token_byte_lengths(tok, 4100)
    for text in ["Hello, world", "naïve café — ’tis ✓ 😀", "  spaced\n\ttabs"]:
        assert int(table[tok.encode(text)].sum()) == len(text.encode("utf-8"))
    assert table[tok.eos_id] == 0 and table[4096:].eq(0).all()


def test_import_round_trips_and_init_from_starts_training_from_the_weights(trained, exported, cache_dir, tmp_path,
                                                                            capsys):
    run_dir, _ = trained
    cfg = load_run_config(run_dir)
    original = load_model(cfg.model, find_checkpoint(run_dir).path, torch.device("cpu"), torch.float32).state_dict()
    imported = tmp_path / "imported"
    assert main(["import", str(exported), str(imported)]) == 0
    ckpt = find_checkpoint(imported)
    assert ckpt.path == imported / "checkpoints" / "step-0"
    back_cfg = load_run_config(imported)
    assert back_cfg.data.tokenizer == str((exported / "tokenizer.json").resolve())
    back = load_model(back_cfg.model, ckpt.path, torch.device("cpu"), torch.float32).state_dict()
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in original)
    assert main(["import", str(exported), str(imported)]) == 2  # the checkpoint exists
    assert "already exists" in capsys.readouterr().err
    assert main(["import", str(exported), str(imported / "checkpoints" / "step-7")]) == 0  # a step folder
    assert [p.name for p in sorted((imported / "checkpoints").glob("step-*"))] == ["step-0", "step-7"]
    assert find_checkpoint(imported).step == 7  # the newest import is `latest`

    for spec in (f"hf:{exported}", str(ckpt.path)):
        fresh = tmp_path / f"fresh{len(spec)}"
        trainer = Trainer(_cfg(fresh, cache_dir, "train.steps=1", "optim.lr=1e-12", "model.bias_update_rate=0",
                               "logging.samples=0", "train.eval_every=0", "checkpoint.save_at_end=false",
                               f"checkpoint.init_from={spec}"))
        trainer.fit()
        assert f"weights from {spec}" in capsys.readouterr().out
        now = trainer.model.state_dict()
        for name, value in original.items():
            torch.testing.assert_close(now[name], value, rtol=0, atol=1e-9, msg=name)


def test_init_from_refuses_a_mismatched_model(exported, cache_dir, tmp_path):
    from moela.trainer import TrainingError
    trainer = Trainer(_cfg(tmp_path, cache_dir, "model.kv_lora_rank=8", f"checkpoint.init_from=hf:{exported}"))
    with pytest.raises(TrainingError, match="kv_lora_rank: 8 vs 16"):
        trainer.fit()


def test_user_errors_exit_2_with_a_message(trained, tmp_path, capsys):
    run_dir, _ = trained
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    cases = [
        (["generate", str(tmp_path / "nope")], "no such directory"),
        (["generate", str(tmp_path)], "not a run directory"),
        (["export", str(empty), str(tmp_path / "x")], "no checkpoint in"),
        (["eval", str(run_dir), "--step", "5"], "no step-5; available steps: 12"),
        (["generate", str(run_dir), "--device", "gpu"], "unknown device"),
        (["generate", str(run_dir), "--top-p", "0"], "--top-p"),
        (["export", str(run_dir), str(empty)], "already exists"),
        (["export", str(run_dir), str(tmp_path / "y"), "--max-shard-size", "lots"], "--max-shard-size"),
        (["eval", str(run_dir), "--max-tokens", "100000"], "at most data.val_max_tokens"),
        (["eval", str(run_dir), "--data", str(tmp_path / "missing*.jsonl")], "matches no file"),
        (["summary", str(empty)], "no metrics.jsonl"),
    ]
    if not torch.cuda.is_available():
        cases.append((["generate", str(run_dir), "--device", "cuda"], "no CUDA device"))
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
    with pytest.raises(SystemExit) as exc:  # argparse's own usage errors also exit 2
        main(["generate", str(run_dir), "--cache", "int3"])
    assert exc.value.code == 2


@pytest.mark.parametrize("yarn", [False, True])
def test_batched_greedy_decoding_equals_transformers_on_varied_weights(yarn, tmp_path):
    """Random weights (large init) give varied greedy continuations, unlike the briefly trained model."""
    from moela.model import RopeScaling, build_model, preset
    from moela.model.hf import export_hf

    torch.manual_seed(5 + yarn)
    rope = RopeScaling(factor=4.0, original_max_position_embeddings=8, mscale=1.0, mscale_all_dim=0.7) if yarn else None
    cfg = preset("tiny", vocab_size=131, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
                 num_hidden_layers=3, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                 num_attention_heads=2, initializer_range=0.15, max_position_embeddings=64, rope_scaling=rope)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for moe in model.moe_layers():
            moe.gate.e_score_correction_bias.normal_(0.0, 0.05)
    export_hf(model, tmp_path)
    hf = _hf_model(tmp_path)
    prompts = [torch.randint(0, 131, (n,)).tolist() for n in (5, 2, 9)]
    ours = generate(model, prompts, max_new_tokens=16, temperature=0)
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            ids = torch.tensor([prompt])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                              eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        top2 = torch.cat(out.logits).topk(2, dim=-1).values
        assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-4  # no near-tie that float rounding could flip
        assert got == out.sequences[0, len(prompt):].tolist()
        assert len(set(got)) > 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_generate_and_eval_match_the_cpu(trained, capsys):
    run_dir, _ = trained
    args = ["generate", str(run_dir), "--prompt", "ROMEO:", "--temperature", "0", "--max-new-tokens", "12"]
    assert main(args + ["--device", "cpu"]) == 0
    cpu = capsys.readouterr().out
    assert main(args + ["--device", "cuda", "--dtype", "float32"]) == 0
    assert capsys.readouterr().out == cpu
    assert main(args + ["--device", "cuda", "--cache", "int8"]) == 0  # bf16 + int8 latent: runs and streams
    assert capsys.readouterr().out.startswith("ROMEO:")
    losses = []
    for device in ("cpu", "cuda"):
        assert main(["eval", str(run_dir), "--device", device]) == 0
        losses.append(float(re.search(r"loss (\d+\.\d+)", capsys.readouterr().out).group(1)))
    assert abs(losses[0] - losses[1]) < 2e-2  # CUDA evaluates under bf16 autocast, like training there


def test_python_dash_m_moela_runs_and_exits_2_on_a_user_error(tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "moela", "generate", str(tmp_path / "missing")], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no such directory" in proc.stderr and "Traceback" not in proc.stderr
