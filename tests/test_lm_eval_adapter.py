"""The lm-eval-harness adapter against references computed from the model's own logits, one request at a time:
loglikelihood (with the harness's empty-context and trailing-space rules), loglikelihood_rolling (its windows),
generate_until (greedy, cut at the stop string). Runs without lm_eval; the registration test needs it."""

from __future__ import annotations

import math

import pytest
import torch

from moela.batch import PackedBatch
from moela.data.tokenizer import load_tokenizer
from moela.inference import generate_uncached
from moela.model import build_model, preset
from moela.tools.lm_eval_adapter import MoelaLM, rolling_windows


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    cfg = preset("tiny", hidden_size=32, num_hidden_layers=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                 v_head_dim=8, num_attention_heads=2, intermediate_size=40, moe_intermediate_size=16,
                 n_routed_experts=4, num_experts_per_tok=2, q_lora_rank=16, initializer_range=0.1)
    return MoelaLM(build_model(cfg).eval(), load_tokenizer("bundled"), batch_tokens=24)


def _logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(next token) at every position of `ids` alone: [len, V]."""
    t = torch.tensor(ids)
    n = len(ids)
    with torch.no_grad():
        logits = model(PackedBatch(t, t, torch.arange(n, dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32),
                                   n), return_logits=True).logits
    return logits.double().log_softmax(-1)


def _reference(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    lp = _logprobs(model, context + continuation)[len(context) - 1:-1]  # rows predicting the continuation
    want = torch.tensor(continuation)
    return float(lp.gather(1, want[:, None]).sum()), bool((lp.argmax(-1) == want).all())


def test_loglikelihood_matches_the_models_logits(lm):
    tok = lm.tokenizer
    requests = [("To be, or not", " to be"), ("", "Hello there"), ("ROMEO: ", "What, art thou mad?"),
                ("a", "b"), ("The king is dead; long live", " the king")]
    got = lm.loglikelihood(requests)
    for (context, continuation), (lp, greedy) in zip(requests, got):
        if not context:
            ctx, cont = [tok.eos_id], tok.encode(continuation)  # no BOS: the harness's prefix token is EOS
        else:
            stripped = context.rstrip()
            moved = context[len(stripped):] + continuation
            whole, ctx = tok.encode(stripped + moved), tok.encode(stripped)
            cont = whole[len(ctx):]
        ref_lp, ref_greedy = _reference(lm.model, ctx, cont)
        assert math.isclose(lp, ref_lp, rel_tol=1e-5), (context, continuation)
        assert greedy == ref_greedy


def test_greedy_flag_is_true_for_the_models_own_greedy_continuation(lm):
    tok = lm.tokenizer
    prompt = tok.encode("ROMEO:")
    own = generate_uncached(lm.model, prompt, max_new_tokens=3, temperature=0)
    continuation = tok.decode(own)
    assert tok.encode("ROMEO:" + continuation)[len(prompt):] == own  # the text encodes back to the same tokens
    [(lp, greedy)] = lm.loglikelihood([("ROMEO:", continuation)])
    assert greedy and lp < 0


def test_rolling_loglikelihood_scores_every_token_once(lm):
    tok = lm.tokenizer
    text = "Now is the winter of our discontent made glorious summer by this sun of York."
    ids = tok.encode(text)
    [whole] = lm.loglikelihood_rolling([(text,)])  # the text fits max_length: one window after the prefix
    lp = _logprobs(lm.model, [tok.eos_id] + ids)[:-1]
    assert math.isclose(whole, float(lp.gather(1, torch.tensor(ids)[:, None]).sum()), rel_tol=1e-5)

    short = MoelaLM(lm.model, tok, max_length=6)
    windows = rolling_windows(ids, tok.eos_id, 6)
    assert sum(len(t) for _, t in windows) == len(ids)
    assert [t for _, t in windows] == [ids[i:i + 6] for i in range(0, len(ids), 6)]
    expected = 0.0
    for inputs, targets in windows:
        assert len(inputs) <= 6
        lp = _logprobs(lm.model, inputs)[-len(targets):]
        expected += float(lp.gather(1, torch.tensor(targets)[:, None]).sum())
    assert math.isclose(short.loglikelihood_rolling([(text,)])[0], expected, rel_tol=1e-5)


def test_rolling_windows_are_the_harness_windows():
    utils = pytest.importorskip("lm_eval.utils")
    tokens = list(range(100, 137))
    for max_length in (1, 4, 8, 36, 37, 50):
        theirs = [(list(i), list(t)) for i, t in utils.get_rolling_token_windows(tokens, 7, max_length, 1)]
        assert rolling_windows(tokens, 7, max_length) == theirs, max_length


def test_generate_until_is_greedy_and_stops_at_the_stop_string(lm):
    tok = lm.tokenizer
    prompt = tok.encode("ROMEO:")
    full = tok.decode(generate_uncached(lm.model, prompt, max_new_tokens=12, temperature=0))
    stop = full[3:5] if len(full) > 5 else "\n"
    [got] = lm.generate_until([("ROMEO:", {"until": [stop], "max_gen_toks": 12})])
    assert got == full[:full.index(stop)] if stop in full else got == full
    [plain] = lm.generate_until([("ROMEO:", {"until": ["\x00never"], "max_gen_toks": 12})])
    assert plain == full


def test_registered_with_the_harness_when_installed(lm):
    pytest.importorskip("lm_eval.api")
    from lm_eval.api.model import LM
    from lm_eval.api.registry import get_model
    assert isinstance(lm, LM)
    assert get_model("moela") is MoelaLM
