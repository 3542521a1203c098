"""The graphed training step (`train.cuda_graphs`, moela.trainer.cuda_graphs).

CPU: the bookkeeping a capture depends on - document padding (trailing empty documents change nothing the model
computes), the static buffers with a device-side target count, filler count and loss scale, gradients left between
steps and cleared by an eager first micro-batch, the two graphs' roles (assign, then add), replay outputs copied
before reuse - runs eagerly (`capture=False`, or with stand-in graphs) and must train exactly like the plain step.
GPU: the captured step against the compiled eager step (same losses and gradient norms within bf16 tolerance), no
host synchronization in replayed steps, a micro-batch with more documents than the graph holds running eagerly,
and a capture that fails naming the fix.
"""

from __future__ import annotations

import pytest
import torch

from factories import graphed_on_cpu, packed_batch, steps_without_sync, tiny_config, tiny_overrides, two_micro_batch_cfg
from moela.batch import pad_batch, pad_documents
from moela.config import ConfigError, load_config
from moela.model import build_model
from moela.trainer import Trainer

GPU_MODEL = tiny_overrides(vocab_size=4096, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                           num_hidden_layers=2, n_routed_experts=8, q_lora_rank=64, kv_lora_rank=64,
                           qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_attention_heads=4)

# compiled blocks raise Dynamo's recompile limit and a compiled Trainer applies its Inductor settings, for the process
pytestmark = pytest.mark.usefixtures("compile_config_scope")


def test_pad_documents_appends_empty_documents_only_to_a_padded_batch():
    b = pad_batch(packed_batch(97, [5, 9, 3], seed=1), 40, 16)
    p = pad_documents(b, 9)
    p.validate()
    assert p.num_docs == 9 and p.num_tokens == 40 and p.targets_on_host == b.targets_on_host == 14
    assert (p.cu_seqlens[1:] - p.cu_seqlens[:-1]).tolist() == [5, 9, 3, 16, 7, 0, 0, 0, 0]
    assert pad_documents(b, b.num_docs).cu_seqlens.tolist() == b.cu_seqlens.tolist()
    with pytest.raises(ValueError, match="more than 4"):
        pad_documents(b, 4)
    with pytest.raises(ValueError, match="pad the tokens first"):
        pad_documents(packed_batch(97, [5, 9], seed=1), 4)
    inner = p.cu_seqlens.clone()
    inner[2] = inner[1]  # an empty document before real ones: not padding
    with pytest.raises(ValueError, match="no empty documents"):
        type(p)(p.input_ids, p.labels, p.position_ids, inner, p.max_seqlen, filler_tokens=p.filler_tokens).validate()


def test_trailing_empty_documents_change_no_objective_gradient_or_statistic():
    cfg = tiny_config(aux_loss_coef=1e-2, z_loss_coef=1e-3, attention_backend="reference",
                      moe_backend="reference")
    model = build_model(cfg)
    padded = pad_batch(packed_batch(cfg.vocab_size, [5, 9, 3, 12], seed=5), 61, 24)
    outs, grads = [], []
    for batch in (padded, pad_documents(padded, 23)):
        model.zero_grad()
        out = model(batch)
        out.loss.backward()
        outs.append(out)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    # float32 summation order (test_compile.py's padded-batch test)
    torch.testing.assert_close(outs[1].loss, outs[0].loss, rtol=1e-5, atol=0)
    for key in outs[0].metrics:
        torch.testing.assert_close(outs[1].metrics[key], outs[0].metrics[key], rtol=1e-5, atol=1e-9, msg=key)
    assert torch.equal(outs[1].expert_load, outs[0].expert_load)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-4, atol=1e-6, msg=name)


def make_cfg(run_dir, *extra):
    return two_micro_batch_cfg(run_dir, "train.steps=6", *extra)


@pytest.mark.parametrize("max_docs", [0, 1])
def test_the_static_buffer_step_trains_like_the_plain_step(tmp_path, max_docs):
    """Six optimizer steps of two micro-batches: losses, gradient norms and weights equal the plain trainer's.
    max_docs 1 sends every micro-batch (2+ documents of 128 tokens cut at 64) down the eager fallback instead."""
    plain = Trainer(make_cfg(tmp_path / "a"))
    graphed = Trainer(make_cfg(tmp_path / "b"))
    g = graphed_on_cpu(graphed, max_docs)
    for _ in range(6):
        rec, ref = graphed.train_step(), plain.train_step()
        for key in ("loss", "lm_loss", "mtp_loss", "aux_loss", "grad_norm", "expert_imbalance"):
            # as the compiled trainer's test: float32 rounding that grows over the steps and differs by CPU
            assert rec[key] == pytest.approx(ref[key], rel=2e-4, abs=1e-7), (rec["step"], key)
    # the step leaves its gradients (the next step's first micro-batch replaces them); the plain step unsets them
    assert all(p.grad is not None for p in graphed.model.parameters() if p.requires_grad)
    assert all(p.grad is None for p in plain.model.parameters())
    for (name, p), q in zip(graphed.model.named_parameters(), plain.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)
    if max_docs:
        assert g.eager_batches == 12 and g.static is None
    else:
        assert g.max_docs >= 64 and g.eager_batches == 0 and g.static.num_docs == g.max_docs
        assert g.static.targets_on_host is None and isinstance(g.static.filler_tokens, torch.Tensor)


class _RoleGraph:
    """A stand-in for one captured graph on the CPU, with a CUDA graph's effect on the gradients: the first
    micro-batch's graph writes the tensors autograd assigned at its capture (overwriting their values), a later
    micro-batch's graph adds into them; the outputs captured are updated in place."""

    def __init__(self, g, first: bool, log: list):
        self.g, self.log = g, log
        self.role = first
        self.first = first
        self.params = [p for p in g.model.parameters() if p.requires_grad]
        self.held = [p.grad for p in self.params]

    def replay(self):
        self.log.append(("replay", self.role))
        assert all(p.grad is h for p, h in zip(self.params, self.held)), "a captured gradient tensor was replaced"
        if self.first:
            for p in self.params:
                p.grad = None
        loss, metrics, num_targets, load = self.g._forward_backward()
        for p, h in zip(self.params, self.held):
            if self.first:
                h.copy_(p.grad)
            p.grad = h
        out = self.g.outputs[self.role]
        out[0].copy_(loss)
        for key, value in metrics.items():
            out[1][key].copy_(value)
        out[2].copy_(num_targets)
        out[3].copy_(load)


def test_the_first_graph_assigns_gradients_the_second_adds_and_eager_micro_batches_zero_them(tmp_path, monkeypatch):
    """The bookkeeping around two captured graphs (CPU stand-ins, `_RoleGraph`): captured at step 3 (first
    micro-batch, then a later one), replayed by role, the trainer never zeroing between steps; an eager first
    micro-batch after the capture (the profiler's eager_replay) zeroes the held gradients in place. Every step
    equals the plain trainer's."""
    plain = Trainer(make_cfg(tmp_path / "a"))
    graphed = Trainer(make_cfg(tmp_path / "b"))
    g = graphed_on_cpu(graphed)
    g.capture = True
    log = []

    def stand_in_capture(first):
        log.append(("capture", first, g.steps))
        params = [p for p in g.model.parameters() if p.requires_grad]
        if first:  # as the real capture: unset, so that autograd assigns the tensors it holds
            g.model.zero_grad(set_to_none=True)
            g.outputs[first] = g._forward_backward()
        else:  # a capture records, it does not add: the held values are put back
            before = [p.grad.clone() for p in params]
            g.outputs[first] = g._forward_backward()
            for p, b in zip(params, before):
                p.grad.copy_(b)
        g.graphs[first] = _RoleGraph(g, first, log)
    monkeypatch.setattr(g, "_capture", stand_in_capture)
    held = None
    for step in range(1, 7):
        g.eager_replay = step == 5
        rec, ref = graphed.train_step(), plain.train_step()
        for key in ("loss", "lm_loss", "mtp_loss", "aux_loss", "grad_norm", "expert_imbalance"):
            assert rec[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), (step, key)
        if step == 3:
            held = [p.grad for p in graphed.model.parameters()]
    assert all(p.grad is h for p, h in zip(graphed.model.parameters(), held))
    # step 3 captures each role before its first replay; steps 4 and 6 replay; step 5 runs eagerly
    assert log == ([("capture", True, 3), ("replay", True), ("capture", False, 3), ("replay", False)]
                   + [("replay", True), ("replay", False)] * 2)


def test_cuda_graphs_on_the_cpu_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cuda_graphs: CUDA graphs need train.device=cuda"):
        make_cfg(tmp_path, "train.device=cpu", "train.cuda_graphs=true")
    with pytest.raises(ConfigError, match="graph_max_docs: must be >= 0"):
        make_cfg(tmp_path, "train.graph_max_docs=-1")


# ----------------------------------------------------------------------------------------------------------------
def cuda_cfg(run_dir, *extra):
    return load_config(None, GPU_MODEL + [
        f"train.run_dir={run_dir}", "data.max_doc_len=256", "data.val_max_tokens=2048", "train.steps=100",
        "train.tokens_per_microbatch=1024", "train.grad_accum=2", "train.eval_every=0", "train.device=cuda",
        "train.compile=true", "schedule.warmup_steps=2", "optim.lr=3e-3", "logging.log_every=100",
        "logging.plot=false", "logging.progress_bar=never", "checkpoint.every=0", *extra])


@pytest.mark.gpu
@pytest.mark.parametrize("moe_recipe,grad_accum", [("bf16", 2), ("fp8_blockwise", 2), ("bf16", 1)])
def test_graphed_cuda_training_matches_the_compiled_step_without_syncs(tmp_path, moe_recipe, grad_accum):
    """Losses and gradient norms of graphed steps (the first micro-batch's graph assigns the gradients, the
    second one's adds) against the compiled eager step: a lost or doubled micro-batch moves the norm by far more
    than the tolerance."""
    extra = [f"model.moe_recipe={moe_recipe}", f"train.grad_accum={grad_accum}",
             f"train.tokens_per_microbatch={2048 // grad_accum}"]
    plain = Trainer(cuda_cfg(tmp_path / "a", *extra))
    graphed = Trainer(cuda_cfg(tmp_path / "b", *extra, "train.cuda_graphs=true"))
    for step in range(5):  # steps 1-2 warm up eagerly, step 3 captures, then replays
        rec, ref = graphed.train_step(), plain.train_step()
        graphed._read_pending()  # the records' device values become numbers in place
        plain._read_pending()
        # bf16 autocast; the two runs differ only in the document padding and the order of a few reductions
        assert rec["loss"] == pytest.approx(ref["loss"], rel=2e-2), step
        assert rec["grad_norm"] == pytest.approx(ref["grad_norm"], rel=5e-2), step
    assert sorted(graphed.graphed.graphs) == ([False, True] if grad_accum > 1 else [True])  # the captured roles
    assert graphed.graphed.replays == grad_accum * 3  # steps 3-5
    steps_without_sync(graphed, 2)
    assert graphed.graphed.replays == grad_accum * 5
    before = graphed.graphed.max_docs
    big = pad_batch(packed_batch(4096, [3] * (before + 5), seed=2), 1024, 256)
    assert not graphed.graphed.fits(big)
    graphed.evaluate()  # eager, no graph; the graph still replays after it
    graphed.train_step()
    assert graphed.graphed.replays == grad_accum * 6


@pytest.mark.gpu
def test_a_step_that_synchronizes_fails_the_capture_with_the_fix(tmp_path, monkeypatch):
    from moela.trainer import TrainingError

    graphed = Trainer(cuda_cfg(tmp_path, "train.cuda_graphs=true", "train.compile=false"))
    graphed.train_step()
    graphed.train_step()
    model_forward = type(graphed.model).forward

    def syncing_forward(self, batch, **kwargs):
        out = model_forward(self, batch, **kwargs)
        float(out.loss)  # a host read: not capturable
        return out
    monkeypatch.setattr(type(graphed.model), "forward", syncing_forward)
    with pytest.raises(TrainingError, match="train.cuda_graphs=false"):
        graphed.train_step()


class _FakeGraph:
    def __init__(self, log):
        self.log = log

    def replay(self):
        self.log.append("replay")


def test_the_capture_waits_for_two_steps_of_this_process_also_after_a_resume(tmp_path, monkeypatch):
    """The warm-up counts the optimizer steps this process ran, not the run's step: a resumed run has compiled
    nothing yet, so capturing at its first step would compile inside the capture. The capture itself is replaced
    by a stand-in that records when it happens (CPU)."""
    trainer = Trainer(make_cfg(tmp_path / "a", "train.steps=3", "checkpoint.every=3"))
    trainer.fit()
    resumed = Trainer(make_cfg(tmp_path / "a", "train.steps=8"))
    g = graphed_on_cpu(resumed)
    g.capture = True
    log = []

    def fake_capture(first):
        log.append(f"capture {'first' if first else 'later'} at step {g.steps}")
        g.graphs[first] = _FakeGraph(log)
        g.outputs[first] = g._forward_backward()
    monkeypatch.setattr(g, "_capture", fake_capture)
    resumed._fit()
    assert resumed.step == 8
    # steps 4 and 5 (this process's first two) eager; step 6 captures each role (and replays it), then replays
    assert log == ["capture first at step 3", "replay", "capture later at step 3", "replay"] + ["replay"] * 4
    assert not g.graphs and all(p.grad is None for p in resumed.model.parameters())  # released for the evaluation
    # the next step captures again without a new warm-up (its kernels are built); in the profiler's mode
    # (bench/steplib/row.py) the captured work runs eagerly, no replay
    g.eager_replay = True
    resumed.train_step()
    assert log[8:] == ["capture first at step 6", "capture later at step 6"] and g.replays == 6
