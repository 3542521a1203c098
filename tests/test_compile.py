"""Compiled training (`train.compile`): padding to one shape changes nothing the model computes, compiled blocks
train like eager ones with no recompilation after the first step, and the only graph breaks in a block are the op
boundaries declared opaque (`moela.ops.dispatch`). CPU tests use Dynamo with the `eager` backend (the graphs
Dynamo captures, run by PyTorch): what they check - graph structure, guards, numerics of the traced code - does
not depend on Inductor, which the GPU test runs."""

from __future__ import annotations

import functools

import pytest
import torch
from torch._dynamo.utils import counters

from compile_checks import GPU_SHAPE, _assert_same_loss_and_grads, make_cfg
from factories import packed_batch, tiny_config
from moela.batch import FILLER_DOC, pad_batch
from moela.model import build_model
from moela.trainer import Trainer, evaluation
from moela.trainer import compile as trainer_compile
from moela.trainer import loop as trainer_loop
from moela.trainer.compile import compile_blocks

# compiled blocks raise Dynamo's recompile limit and a compiled Trainer applies its Inductor setting, for the process
pytestmark = pytest.mark.usefixtures("compile_config_scope")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def test_pad_batch_adds_filler_documents_and_keeps_the_targets():
    b = packed_batch(97, [5, 9, 3], seed=1)
    p = pad_batch(b, 300, 200)
    p.validate()
    assert p.num_tokens == 300 and p.filler_tokens == 283 and p.max_seqlen == 200
    assert p.targets_on_host == b.num_targets() == 14
    assert (p.cu_seqlens[1:] - p.cu_seqlens[:-1]).tolist() == [5, 9, 3] + [FILLER_DOC] * 2 + [27]
    assert torch.equal(p.labels[17:], torch.full((283,), -100)) and torch.equal(p.input_ids[:17], b.input_ids)
    assert p.position_ids[17:].tolist() == list(range(128)) * 2 + list(range(27))
    exact = pad_batch(b, 17, 9)
    assert exact.filler_tokens == 0 and exact.num_docs == 3
    with pytest.raises(ValueError, match="does not fit"):
        pad_batch(b, 16, 200)
    with pytest.raises(ValueError, match="does not fit"):
        pad_batch(b, 300, 8)


def test_a_padded_batch_gives_the_same_objective_gradients_and_statistics():
    cfg = tiny_config(aux_loss_coef=1e-2, z_loss_coef=1e-3, attention_backend="reference",
                      moe_backend="reference")
    model = build_model(cfg)  # float32: the references compute their losses in float32 whatever the model dtype
    b = packed_batch(cfg.vocab_size, [5, 9, 3, 12], seed=3)
    outs, grads = [], []
    for batch in (b, pad_batch(b, 301, 40)):
        model.zero_grad()
        out = model(batch)
        out.loss.backward()
        outs.append(out)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    plain, padded = outs
    # the same sums over more (zero) terms: equal up to float32 summation order, which the padding's blocking of the
    # sums changes by CPU vector unit (AVX2: a third of the old 1e-5 gradient tolerance)
    torch.testing.assert_close(padded.loss, plain.loss, rtol=1e-5, atol=0)
    for key in plain.metrics:
        torch.testing.assert_close(padded.metrics[key], plain.metrics[key], rtol=1e-5, atol=1e-9, msg=key)
    assert torch.equal(padded.expert_load, plain.expert_load)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_graph_breaks_of_a_compiled_block_are_only_the_opaque_ops():
    """On the CPU the ops run their references outside the graph: attention and the routed experts, one break each
    in a MoE block; everything else in the block (norms, projections, q/k assembly, RoPE, router, balance loss,
    shared expert, residuals) is traced."""
    cfg = tiny_config(attention_backend="reference", moe_backend="reference")
    model = build_model(cfg)
    batch = pad_batch(packed_batch(cfg.vocab_size, [5, 9, 3], seed=1), 64, 32)
    ctx = model._context(batch, batch.targets_on_host)
    x = model.embed(batch.input_ids)
    moe_block = model.layers[1]
    explained = torch._dynamo.explain(type(moe_block)._forward)(moe_block, x, ctx, None)
    reasons = [b.reason.splitlines()[0] for b in explained.break_reasons]
    assert reasons and all("torch.compiler.disable" in r for r in reasons), reasons
    # where the opaque op was called from: MLA's attention (`_attention`, through the batch's attend seam) and the
    # routed experts
    sites = {(b.user_stack[-2].filename.rsplit("/", 1)[-1], b.user_stack[-2].name) for b in explained.break_reasons}
    assert sites == {("attention.py", "_attention"), ("moe.py", "forward")}, sites


def test_a_compiled_block_holds_its_attention_kernels_and_query_rope_in_its_graph(monkeypatch):
    """With a backend that has separate forward and backward kernels (the Triton kernels, under the interpreter
    here; flash-attn-4 on a GPU) the attention and the in-place query RoPE are ops of the block's graph
    (`moela.ops.attention.graph`): on the CPU only the routed experts' reference still breaks it, and the compiled
    model's loss and gradients equal the eager model's."""
    from moela.model import attention as mla
    from moela.ops.triton_env import INTERPRET

    if not INTERPRET:
        pytest.skip("set TRITON_INTERPRET=1 to run the Triton kernels on CPU")
    monkeypatch.setattr(mla, "rotate_q_in_place", lambda q: True)  # the CUDA path's in-place RoPE, interpreted
    cfg = tiny_config(attention_backend="triton", moe_backend="reference", z_loss_coef=1e-3, aux_loss_coef=1e-2)
    eager = build_model(cfg)
    batch = pad_batch(packed_batch(cfg.vocab_size, [21, 9, 30], seed=5), 96, 48)
    ctx = eager._context(batch, batch.targets_on_host)
    x = eager.embed(batch.input_ids)

    def break_files(block):
        torch._dynamo.reset()
        explained = torch._dynamo.explain(type(block)._forward)(block, x, ctx, None)
        return {s.filename.rsplit("/", 1)[-1] for b in explained.break_reasons for s in b.user_stack[-2:]}

    assert break_files(eager.layers[1]) == {"moe.py", "layers.py"}  # the experts, through call_op
    torch._dynamo.reset()
    model = build_model(cfg)
    model.load_state_dict(eager.state_dict())
    compile_blocks(model, backend="aot_eager")
    _assert_same_loss_and_grads(eager, model, batch)


def test_a_compiled_block_holds_its_fp8_linears_in_its_graph(monkeypatch):
    """`precision: fp8` with the FP8 kernels (the Triton path, under the interpreter here; the CUDA default where the
    features tile): the linears are the op pair `moela::fp8_linear_fwd` / `_bwd` inside the block's graph, so with
    the attention's kernels traced too only the experts' CPU reference breaks a MoE block, and the compiled model's
    loss and every gradient equal the eager model's. Linears the kernels cannot
    tile (MLA's 128 -> 80 wkv_a here) train in bf16 (`fp8_linear`'s auto path; off here, since the CPU's auto is the
    reference)."""
    from moela.model import attention as mla
    from moela.model.layers import Linear
    from moela.ops.fp8_linear import fp8_tileable
    from moela.ops.triton_env import INTERPRET

    if not INTERPRET:
        pytest.skip("set TRITON_INTERPRET=1 to run the Triton kernels on CPU")
    monkeypatch.setattr(mla, "rotate_q_in_place", lambda q: True)
    cfg = tiny_config(**{**GPU_SHAPE, "q_lora_rank": 128}, num_hidden_layers=2, attention_backend="triton",
                      moe_backend="reference", precision="fp8")

    def fp8_kernels_where_they_tile(model):
        on = []
        for name, m in model.named_modules():
            if isinstance(m, Linear) and m.fp8:
                m.fp8 = fp8_tileable(m.in_features, m.out_features)
                m.fp8_backend = "triton"
                on += [name] if m.fp8 else []
        return on

    eager = build_model(cfg)
    on = fp8_kernels_where_they_tile(eager)
    assert {"layers.0.attn.wq_a", "layers.0.attn.wo", "layers.1.ffn.shared_experts.w2", "mtp.0.eh_proj"} <= set(on)
    batch = pad_batch(packed_batch(cfg.vocab_size, [21, 9, 30], seed=5), 96, 48)
    ctx = eager._context(batch, batch.targets_on_host)
    x = eager.embed(batch.input_ids)
    explained = torch._dynamo.explain(type(eager.layers[1])._forward)(eager.layers[1], x, ctx, None)
    sites = {(b.user_stack[-2].filename.rsplit("/", 1)[-1], b.user_stack[-2].name, b.user_stack[-1].name)
             for b in explained.break_reasons}
    assert sites == {("moe.py", "forward", "call_op")}, sites  # only the experts (MoE.forward -> call_op)
    torch._dynamo.reset()
    model = build_model(cfg)
    fp8_kernels_where_they_tile(model)
    model.load_state_dict(eager.state_dict())
    compile_blocks(model, backend="aot_eager")
    assert "layers.0.attn.wo.weight" in _assert_same_loss_and_grads(eager, model, batch)


def _block_graphs(model, batch) -> int:
    """Graphs Dynamo captures from `model`'s compiled blocks in one forward and backward under bf16 autocast."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compile_blocks(model, backend=backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(batch)
    out.loss.backward()
    return len(graphs)


def test_an_mtp_block_reuses_the_main_stacks_compiled_graphs():
    """Under autocast the MTP block's residual stream is in the main stack's dtype (float32 here), so the block is
    the compiled variant the main stack's MoE blocks already made: MTP adds no graph."""
    cfgs = {depth: tiny_config(num_hidden_layers=3, num_nextn_predict_layers=depth) for depth in (0, 1)}
    batch = pad_batch(packed_batch(cfgs[1].vocab_size, [21, 9, 30], seed=5), 96, 48)
    counts = {}
    for depth, cfg in cfgs.items():
        torch.manual_seed(0)
        counts[depth] = _block_graphs(build_model(cfg), batch)
    assert counts[1] == counts[0] > 0


def test_compiled_training_matches_eager_and_never_recompiles_after_the_first_step(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_loop, "compile_blocks", functools.partial(compile_blocks, backend="eager"))
    eager = Trainer(make_cfg(tmp_path / "a"))
    compiled = Trainer(make_cfg(tmp_path / "b", "train.compile=true"))
    assert compiled.static_shapes is not None and all(b.compile_backend == "eager" for b in compiled.model.layers)
    first = compiled.train_step()
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    records = [first] + [compiled.train_step() for _ in range(3)]
    assert counters["stats"]["unique_graphs"] == graphs  # steps 2-4: no compilation
    for rec in records:
        ref = eager.train_step()
        for key in ("loss", "lm_loss", "mtp_loss", "aux_loss", "grad_norm", "expert_imbalance"):
            # the compiled blocks add gradients in another order: float32 rounding that grows over the steps and
            # differs by CPU (4.4e-5 of the grad norm at step 2 on a Xeon of the GPU machine)
            assert rec[key] == pytest.approx(ref[key], rel=2e-4), (rec["step"], key)
    before_eval = counters["stats"]["unique_graphs"]
    evaluation.evaluate(compiled)
    after_first = counters["stats"]["unique_graphs"]
    evaluation.evaluate(compiled)
    compiled.train_step()
    assert counters["stats"]["unique_graphs"] == after_first >= before_eval


def test_prepare_inductor_tunes_no_pointwise_kernel_at_its_first_launch():
    from torch._inductor import config as inductor_config

    with inductor_config.patch({"triton.autotune_pointwise": True}):  # torch's default; restored after
        trainer_compile.prepare_inductor()
        assert inductor_config.triton.autotune_pointwise is False


@pytest.mark.parametrize("compiled", [True, False])
def test_a_compiled_run_says_what_its_first_step_does_and_what_it_took(tmp_path, monkeypatch, capsys, compiled):
    """Before the first step a compiled run names the wait and the cache root; after it, the step's seconds; once.
    An eager run prints neither. Only a compiled run prepares Inductor."""
    monkeypatch.setattr(trainer_loop, "compile_blocks", functools.partial(compile_blocks, backend="eager"))
    prepared = []
    monkeypatch.setattr(trainer_loop, "prepare_inductor", lambda: prepared.append(True))
    monkeypatch.setenv("MOELA_CACHE_DIR", str(tmp_path / "kernels"))
    extra = ["train.compile=true"] if compiled else []
    Trainer(make_cfg(tmp_path / "run", "train.steps=3", "train.eval_every=0", *extra)).fit()
    assert prepared == ([True] if compiled else [])
    out = capsys.readouterr().out
    notices = [line for line in out.splitlines() if line.startswith("train.compile: the first step compiles")]
    firsts = [line for line in out.splitlines() if line.startswith("step 1 done ")]
    if compiled:
        assert len(notices) == 1 and str(tmp_path / "kernels") in notices[0]
        assert len(firsts) == 1 and float(firsts[0].split()[3]) > 0
        assert out.index(notices[0]) < out.index(firsts[0])
    else:
        assert notices == [] and firsts == []


def test_the_kernel_caches_share_one_root_on_disk_unless_set(tmp_path):
    """Importing moela.ops points Inductor's, Triton's and flash-attn-4's caches under MOELA_CACHE_DIR
    (flash-attn-4's is off by default), also after torch._dynamo wrote Inductor's /tmp default into the
    environment; a variable the user set wins. A fresh interpreter, so that nothing imported earlier has read the
    environment."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json, os, torch, torch._dynamo\nimport moela.ops\nfrom moela.model import build_model\n"
            "from moela.trainer.compile import compile_blocks\n"
            "from factories import tiny_config\n"
            "compile_blocks(build_model(tiny_config()), backend='eager')\n"
            "print(json.dumps({k: os.environ.get(k) for k in ('TRITON_CACHE_DIR', 'TRITON_CACHE_AUTOTUNING', "
            "'FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED', 'FLASH_ATTENTION_CUTE_DSL_CACHE_DIR', "
            "'TORCHINDUCTOR_CACHE_DIR')}))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_CACHE", "FLASH_ATTENTION_CUTE",
                                                                       "TORCHINDUCTOR_CACHE", "MOELA_CACHE"))}
    env.update(MOELA_CACHE_DIR=str(tmp_path / "root"), TRITON_CACHE_AUTOTUNING="0",
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    root = tmp_path / "root"
    assert got == {"TRITON_CACHE_DIR": str(root / "triton"), "TRITON_CACHE_AUTOTUNING": "0",
                   "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1",
                   "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": str(root / "flash_attn"),
                   "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor")}
