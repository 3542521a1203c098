"""stream_start: training starts before the cache is complete, and the batches equal those of the prebuilt cache
(and of stream_start: false) however slow tokenization is, with one source or a mixture; a tokenization error
reaches the training thread. Elastic resume 1 -> 2 -> 4 data-parallel ranks continues the same global stream,
shard by shard, with a mixture, balanced or not."""

import json
import random
import time

import pytest

from moela.data import DataConfig, MixtureSource, ValLoader, build_loaders, held_out_parts, load_tokenizer
from moela.data import build as build_mod

SHARD = 1 << 16
WORDS = ["the", "king", "sea,", "night.", "and", "a", "42", "O!", "thee", "ünïcödé"]


def corpus(tmp_path, n=600, seed=0, name="docs.jsonl"):
    rng = random.Random(seed)
    f = tmp_path / name
    f.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 300)))})
                         + "\n" for _ in range(n)))
    return f


def stream_cfg(tmp_path, f, cache="c", **extra):
    settings = dict(source="jsonl", paths=[str(f)], cache_dir=str(tmp_path / cache), shard_bytes=SHARD,
                    stream_start=True, tokenize_workers=1, val_fraction=0.02, max_doc_len=200)
    return DataConfig(**{**settings, **extra})


def ids(batches):
    return [b.input_ids.tolist() for b in batches]


def test_stream_start_gives_the_batches_of_a_prebuilt_cache_whatever_the_speed(tmp_path, monkeypatch):
    f = corpus(tmp_path, n=300)
    real = build_mod.encode_documents

    def slow(*args):  # runs in the forked workers
        time.sleep(0.05)
        return real(*args)

    monkeypatch.setattr(build_mod, "encode_documents", slow)
    common = dict(tokens_per_microbatch=256, grad_accum=3, seed=7, show_progress=False)
    started = time.perf_counter()
    streamed, s_val, _ = build_loaders(stream_cfg(tmp_path, f), **common)
    first = ids(streamed.next_step())
    first_step_s = time.perf_counter() - started
    assert not streamed.feed.plan.complete(), "the first step must come before the cache is complete"
    steps = [first] + [ids(streamed.next_step()) for _ in range(260)]  # past one epoch
    assert streamed.epoch >= 1
    streamed.feed.thread.join(120)
    assert streamed.feed.plan.complete()
    monkeypatch.setattr(build_mod, "encode_documents", real)
    prebuilt, p_val, _ = build_loaders(stream_cfg(tmp_path, f), **common)
    assert prebuilt.feed.thread is None
    assert [ids(prebuilt.next_step()) for _ in range(261)] == steps
    assert ids(s_val) == ids(p_val) and len(p_val) > 0
    evaluated = ValLoader(held_out_parts(stream_cfg(tmp_path, f), load_tokenizer()), 262144, tokens_per_microbatch=256,
                          max_doc_len=200, dp_rank=0, dp_size=1)
    assert ids(evaluated) == ids(p_val), "`moela eval` holds out what training held out"
    whole, w_val, _ = build_loaders(stream_cfg(tmp_path, f, stream_start=False), **common)
    assert [ids(whole.next_step()) for _ in range(261)] == steps, "the same stream without stream_start"
    assert ids(w_val) == ids(p_val)
    fast, _, _ = build_loaders(stream_cfg(tmp_path, f, cache="fast", tokenize_workers=2), **common)
    assert [ids(fast.next_step()) for _ in range(261)] == steps
    assert first_step_s < 30


def mixture_cfg(tmp_path, cache="c", **extra):
    f, g = tmp_path / "docs.jsonl", tmp_path / "other.jsonl"
    if not g.exists():  # written once: rewriting would change the cache key
        corpus(tmp_path, n=400), corpus(tmp_path, n=150, seed=1, name="other.jsonl")
    settings = dict(cache_dir=str(tmp_path / cache), shard_bytes=SHARD, stream_start=True, tokenize_workers=2,
                    val_fraction=0.02, max_doc_len=200)
    return DataConfig(**{**settings, **extra}, mixture=[
                          MixtureSource(source="jsonl", paths=[str(f)], weight=2.0),
                          MixtureSource(source="jsonl", paths=[str(g)], weight=1.0)])


def test_stream_start_mixture_gives_the_batches_of_prebuilt_caches_in_weight_shares(tmp_path, monkeypatch):
    real = build_mod.encode_documents

    def slow(*args):  # runs in the forked workers
        time.sleep(0.05)
        return real(*args)

    monkeypatch.setattr(build_mod, "encode_documents", slow)
    common = dict(tokens_per_microbatch=256, grad_accum=3, seed=5, show_progress=False)
    streamed, s_val, _ = build_loaders(mixture_cfg(tmp_path), **common)
    steps = [ids(streamed.next_step()) for _ in range(120)]
    assert not all(s.feed.plan.complete() for s in streamed.sources), "the first steps come before the caches"
    for s in streamed.sources:
        s.feed.thread.join(120)
        assert s.feed.plan.complete()
    monkeypatch.setattr(build_mod, "encode_documents", real)
    prebuilt, p_val, _ = build_loaders(mixture_cfg(tmp_path), **common)
    assert all(s.feed.thread is None for s in prebuilt.sources)
    assert [ids(prebuilt.next_step()) for _ in range(120)] == steps
    assert ids(s_val) == ids(p_val) and len(p_val) > 0
    counts = [s.consumed for s in prebuilt.sources]
    assert sum(counts) == 360 and abs(counts[0] - 240) <= 2, f"micro-batches in the 2:1 weight shares: {counts}"
    evaluated = ValLoader(held_out_parts(mixture_cfg(tmp_path), load_tokenizer()), 262144, tokens_per_microbatch=256,
                          max_doc_len=200, dp_rank=0, dp_size=1)
    assert ids(evaluated) == ids(p_val), "`moela eval` holds out what training held out"
    whole, _, _ = build_loaders(mixture_cfg(tmp_path, stream_start=False), **common)
    assert [ids(whole.next_step()) for _ in range(120)] == steps, "the same stream without stream_start"
    other_seed, _, _ = build_loaders(mixture_cfg(tmp_path), **{**common, "seed": 6})
    assert [ids(other_seed.next_step()) for _ in range(3)] != steps[:3]


def test_a_tokenization_error_reaches_the_training_thread(tmp_path):
    f = corpus(tmp_path)
    with open(f, "a") as out:
        out.write("{broken\n")
    train, _, _ = build_loaders(stream_cfg(tmp_path, f), tokens_per_microbatch=256, show_progress=False)
    with pytest.raises(ValueError, match=r"docs\.jsonl:601: not valid JSON"):
        for _ in range(1000):
            train.next_step()


def global_steps(make, layouts, steps_each):
    """Run `steps_each` steps with each (dp_size, grad_accum) layout in turn, resuming from the previous state;
    per step, the set of micro-batches all ranks together received."""
    out, state = [], None
    for dp, ga in layouts:
        ranks = [make(r, dp, ga) for r in range(dp)]
        for loader in ranks:
            if state is not None:
                loader.load_state_dict(state)
        for _ in range(steps_each):
            out.append(sorted(tuple(x) for loader in ranks for x in ids(loader.next_step())))
        state = ranks[0].state_dict()
        assert all(r.state_dict() == state for r in ranks)
    return out


@pytest.mark.parametrize("kind,balance", [("stream", True), ("stream", False), ("mixture", True),
                                          ("stream mixture", True), ("stream mixture", False)])
def test_elastic_resume_1_2_4_ranks_continues_the_global_stream(tmp_path, kind, balance):
    f = corpus(tmp_path)
    if kind == "stream":
        cfg = stream_cfg(tmp_path, f, balance=balance)
    elif kind == "stream mixture":
        cfg = mixture_cfg(tmp_path, balance=balance)
    else:
        g = corpus(tmp_path, n=200, seed=1, name="other.jsonl")
        cfg = DataConfig(cache_dir=str(tmp_path / "c"), shard_bytes=SHARD, balance=True, max_doc_len=200, mixture=[
            MixtureSource(source="jsonl", paths=[str(f)], weight=2.0),
            MixtureSource(source="jsonl", paths=[str(g)], weight=1.0)])

    def make(rank, dp, ga):
        return build_loaders(cfg, tokens_per_microbatch=300, dp_rank=rank, dp_size=dp, grad_accum=ga, seed=3,
                             show_progress=False)[0]

    reference = global_steps(make, [(1, 4)], 45)
    assert global_steps(make, [(1, 4), (2, 2), (4, 1)], 15) == reference
    assert len({tuple(map(tuple, s)) for s in reference}) == len(reference), "steps differ from each other"
    assert all(len(s) == 4 and all(0 < len(x) <= 300 for x in s) for s in reference)
