"""Packing and loader invariants on a synthetic token cache whose token ids are their own global positions.

With token == index into the flat token stream, every check has an independent answer: a token's document is
found by bisecting the offsets, its correct label is token + 1 unless it ends its document, and coverage is a set
comparison.
"""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from moela.batch import IGNORE_INDEX
from moela.data.balance import round_robin_assign
from moela.data.cache import ShardWriter, TokenCache, finish_cache
from moela.data.loader import Part, ValLoader, split_train_val
from moela.data.packing import make_batch, pack, split_into_pieces
from moela.data.stream import TrainLoader


def synthetic_cache(tmp_path, doc_lengths, key="synthetic", base=0, shards=2) -> TokenCache:
    """A cache whose token values are their positions (+ base), split into `shards` shards."""
    offsets = np.concatenate([[0], np.cumsum(doc_lengths)]).astype(np.int64)
    path = tmp_path / key
    path.mkdir()
    bounds = np.linspace(0, len(doc_lengths), shards + 1).astype(int)
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        writer = ShardWriter(path, i, np.uint32)
        writer.write(np.arange(base + offsets[a], base + offsets[b], dtype=np.uint32))
        writer.end_docs(doc_lengths[a:b])
        writer.commit()
    finish_cache(path, key, shards, {})
    return TokenCache(path)


def random_lengths(rng, n, hi):
    return rng.integers(1, hi, size=n)


def make_train(cache, budget, *, dp_rank=0, dp_size=1, grad_accum=1, seed=0, max_doc_len=None, shuffle=True,
               assign=round_robin_assign, val_fraction=0.0):
    return TrainLoader([cache], [1.0], tokens_per_microbatch=budget, max_doc_len=max_doc_len, dp_rank=dp_rank,
                       dp_size=dp_size, grad_accum=grad_accum, seed=seed, shuffle=shuffle, assign=assign,
                       cost_coefficients=(1.0, 1 / 64), settings={"tokens_per_microbatch": budget},
                       val_fraction=val_fraction, val_max_tokens=10**9)


def epoch_plan(loader, epoch, source=0):
    """The micro-batches of one epoch of a source's stream: (shard, [(document, start, length) per piece])."""
    stream = loader.sources[source]
    units = [stream._pack(epoch, k, 0) for k in range(stream.num_shards)]
    return [(u.shard, list(zip(u.doc[b].tolist(), u.start[b].tolist(), u.length[b].tolist())))
            for u in units for b in u.bins]


def check_batch(batch, offsets, budget):
    """Every PackedBatch invariant, checked against the offsets (the independent truth)."""
    batch.validate()
    assert batch.input_ids.dtype == torch.int64 and batch.labels.dtype == torch.int64
    assert batch.position_ids.dtype == torch.int32 and batch.cu_seqlens.dtype == torch.int32
    assert batch.num_tokens <= budget
    tok = batch.input_ids.numpy()
    cu = batch.cu_seqlens.tolist()
    doc_of = np.searchsorted(offsets, tok, side="right") - 1
    for a, b in zip(cu[:-1], cu[1:]):
        seg = tok[a:b]
        assert np.all(np.diff(seg) == 1), "a segment must be a contiguous run of one document"
        assert doc_of[a] == doc_of[b - 1], "a segment must not cross a document boundary"
        assert batch.position_ids[a:b].tolist() == list(range(b - a))
    is_last = tok + 1 == offsets[doc_of + 1]
    expected = np.where(is_last, IGNORE_INDEX, tok + 1)
    assert np.array_equal(batch.labels.numpy(), expected), "label = next token of the same document, else -100"
    assert batch.targets_on_host == int((~is_last).sum()), "the producer's labelled-token count"
    return tok


def test_split_into_pieces_matches_loop():
    rng = np.random.default_rng(1)
    lengths = random_lengths(rng, 37, 50)
    doc_ids = np.sort(rng.choice(1000, size=37, replace=False))
    pd, ps, pl = split_into_pieces(doc_ids, lengths, 7)
    ref = [(d, s, min(7, n - s)) for d, n in zip(doc_ids, lengths) for s in range(0, n, 7)]
    assert list(zip(pd.tolist(), ps.tolist(), pl.tolist())) == [tuple(int(x) for x in r) for r in ref]


@pytest.mark.parametrize("budget", [1, 13, 64])
def test_pack_partitions_within_budget(budget):
    rng = np.random.default_rng(budget)
    lengths = rng.integers(1, budget + 1, size=301)
    bins = pack(lengths, budget)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(b and sum(lengths[i] for i in b) <= budget for b in bins)
    assert bins == pack(lengths, budget)
    if budget == 64:
        offline = pack(sorted(lengths, reverse=True), budget, max_open=len(lengths))  # best-fit decreasing
        assert len(bins) <= 1.05 * len(offline), "online packing should be close to best-fit decreasing"


def test_pack_rejects_oversized_item():
    with pytest.raises(ValueError, match="outside"):
        pack([3, 9], 8)


def test_make_batch_labels_positions(tmp_path):
    rng = np.random.default_rng(2)
    lengths = random_lengths(rng, 11, 30)
    cache = synthetic_cache(tmp_path, lengths)
    pd, ps, pl = split_into_pieces(np.arange(11), lengths, 9)
    pick = rng.permutation(len(pd))[:7]
    batch = make_batch([cache], np.zeros(7, dtype=np.int64), pd[pick], ps[pick], pl[pick])
    check_batch(batch, cache.offsets, int(pl[pick].sum()))
    assert batch.max_seqlen == int(pl[pick].max())


@pytest.mark.parametrize("dp_size,grad_accum,budget,max_doc_len", [(1, 1, 61, None), (3, 2, 47, 20), (2, 3, 16, None)])
def test_every_token_once_per_epoch(tmp_path, dp_size, grad_accum, budget, max_doc_len):
    rng = np.random.default_rng(budget)
    lengths = random_lengths(rng, 83, 90)  # many documents longer than the budget: they get split
    cache = synthetic_cache(tmp_path, lengths)
    ranks = [make_train(cache, budget, dp_rank=r, dp_size=dp_size, grad_accum=grad_accum, max_doc_len=max_doc_len,
                        seed=5, val_fraction=0.1) for r in range(dp_size)]
    val_docs = ranks[0].val_docs  # held out of shard 0, whose documents come first
    assert np.array_equal(val_docs, split_train_val(cache.shards[0].doc_lengths, 0.1, 10**9)[1]) and len(val_docs)
    train_docs = np.setdiff1d(np.arange(83), val_docs)
    per_epoch = len(epoch_plan(ranks[0], 0))
    steps = -(-per_epoch // (dp_size * grad_accum))
    by_index = {}  # global micro-batch index -> its tokens (round robin: rank r, micro-step i -> i * dp + r)
    m = dp_size * grad_accum
    for step in range(steps):
        step_batches = [ld.next_step() for ld in ranks]
        targets, tokens, sum_sq = 0, 0, 0.0
        for r, batches in enumerate(step_batches):
            assert len(batches) == grad_accum
            for i, b in enumerate(batches):
                by_index[step * m + i * dp_size + r] = check_batch(b, cache.offsets, budget)
                targets += int((b.labels != IGNORE_INDEX).sum())
                tokens += b.num_tokens
                sum_sq += float(((b.cu_seqlens[1:] - b.cu_seqlens[:-1]).double() ** 2).sum())
                if max_doc_len:
                    assert b.max_seqlen <= max_doc_len
        assert all(ld.last_global_counts == (targets, tokens, sum_sq) for ld in ranks)  # identical on every rank
        assert 0 < ranks[0].epoch <= 1 + m / per_epoch, "fractional epochs for the log"
    expected = np.concatenate([np.arange(cache.offsets[d], cache.offsets[d + 1]) for d in train_docs])
    epoch0 = np.concatenate([by_index[j] for j in range(per_epoch)])
    assert np.array_equal(np.sort(epoch0), expected), "each training token exactly once per epoch"
    seen = np.concatenate(list(by_index.values()))
    assert not np.isin(seen, np.concatenate([np.arange(cache.offsets[d], cache.offsets[d + 1])
                                             for d in val_docs])).any(), "no held-out token in training"


def test_epochs_reshuffle_deterministically(tmp_path):
    cache = synthetic_cache(tmp_path, random_lengths(np.random.default_rng(3), 50, 40))
    a, b, c = make_train(cache, 64, seed=1), make_train(cache, 64, seed=1), make_train(cache, 64, seed=2)
    plans = [epoch_plan(a, e) for e in range(2)]
    assert plans == [epoch_plan(b, e) for e in range(2)]
    assert plans[0] != plans[1], "a new epoch must reshuffle"
    assert plans[0] != epoch_plan(c, 0), "the seed must change the order"
    assert sorted(plans[0]) != plans[0] or sorted(plans[1]) != plans[1], "the shards' order is shuffled too"
    ordered = epoch_plan(make_train(cache, 64, shuffle=False, seed=1), 0)
    assert ordered == epoch_plan(make_train(cache, 64, shuffle=False, seed=7), 3)
    assert ordered != plans[0]


def test_resume_mid_epoch_and_across_epochs(tmp_path):
    cache = synthetic_cache(tmp_path, random_lengths(np.random.default_rng(4), 40, 50))
    full = make_train(cache, 57, dp_rank=1, dp_size=2, grad_accum=2, seed=9)
    per_epoch = len(epoch_plan(full, 0))
    total_steps = 2 * per_epoch // 4 + 3  # crosses at least one epoch boundary
    reference = [[b.input_ids.tolist() for b in full.next_step()] for _ in range(total_steps)]
    for stop in (1, per_epoch // 4, per_epoch // 4 + 1, total_steps - 1):
        first = make_train(cache, 57, dp_rank=1, dp_size=2, grad_accum=2, seed=9)
        for _ in range(stop):
            first.next_step()
        state = json.loads(json.dumps(first.state_dict()))  # must survive serialization
        resumed = make_train(cache, 57, dp_rank=1, dp_size=2, grad_accum=2, seed=9)
        resumed.load_state_dict(state)
        assert resumed.step == stop
        got = [[b.input_ids.tolist() for b in resumed.next_step()] for _ in range(total_steps - stop)]
        assert got == reference[stop:], f"resume after step {stop} diverged"


def test_resume_with_other_dp_layout_continues_the_stream(tmp_path):
    cache = synthetic_cache(tmp_path, random_lengths(np.random.default_rng(10), 45, 30))
    single = make_train(cache, 40, grad_accum=4, seed=2)
    stream = [b.input_ids.tolist() for _ in range(4) for b in single.next_step()]  # global micro-batches 0..15
    first = make_train(cache, 40, grad_accum=4, seed=2)
    first.next_step()
    state = first.state_dict()
    ranks = [make_train(cache, 40, dp_rank=r, dp_size=2, grad_accum=2, seed=2) for r in range(2)]
    for ld in ranks:
        ld.load_state_dict(state)
    got = [ld.next_step() for ld in ranks]
    assert [b.input_ids.tolist() for b in (got[0][0], got[1][0], got[0][1], got[1][1])] == stream[4:8]


def test_resume_rejects_other_settings(tmp_path):
    cache = synthetic_cache(tmp_path, [5, 9, 7])
    a, b = make_train(cache, 16, seed=1), make_train(cache, 16, seed=2)
    with pytest.raises(ValueError, match="seed"):
        b.load_state_dict(a.state_dict())


def test_same_global_stream_for_any_dp_layout(tmp_path):
    cache = synthetic_cache(tmp_path, random_lengths(np.random.default_rng(6), 60, 30))
    single = make_train(cache, 40, grad_accum=6, seed=3)
    ranks = [make_train(cache, 40, dp_rank=r, dp_size=3, grad_accum=2, seed=3) for r in range(3)]
    for _ in range(4):
        one = sorted(b.input_ids.tolist() for b in single.next_step())
        many = sorted(b.input_ids.tolist() for ld in ranks for b in ld.next_step())
        assert one == many


def test_pluggable_assignment_and_imbalance(tmp_path):
    cache = synthetic_cache(tmp_path, random_lengths(np.random.default_rng(7), 70, 60))

    def reverse_assign(costs, dp_size, grad_accum):
        order = list(range(len(costs)))[::-1]
        return [order[r * grad_accum:(r + 1) * grad_accum] for r in range(dp_size)]

    loaders = [make_train(cache, 50, dp_rank=r, dp_size=2, grad_accum=3, assign=reverse_assign) for r in range(2)]
    got = [ld.next_step() for ld in loaders]
    plain = make_train(cache, 50, dp_size=2, grad_accum=3)
    layouts = [plain.sources[0].locate(j) for j in range(6)]  # (shard's packing, piece indices)
    costs = [float(sum(u.length[p]) + sum(u.length[p] ** 2) / 64) for u, p in layouts]
    tokens = [make_batch([cache.get(u.shard)], np.zeros(len(p), dtype=np.int64), u.doc[p], u.start[p],
                         u.length[p]).input_ids.tolist() for u, p in layouts]
    expected_batches = [[5, 4, 3], [2, 1, 0]]
    for r in range(2):
        assert [b.input_ids.tolist() for b in got[r]] == [tokens[j] for j in expected_batches[r]]
    rank_costs = [sum(costs[j] for j in g) for g in expected_batches]
    assert loaders[0].last_imbalance["after"] == pytest.approx(max(rank_costs) / (sum(rank_costs) / 2))
    rr = [sum(costs[j] for j in (0, 2, 4)), sum(costs[j] for j in (1, 3, 5))]
    assert loaders[0].last_imbalance["before"] == pytest.approx(max(rr) / (sum(rr) / 2))

    def broken(costs, dp_size, grad_accum):
        return [[0, 0, 1], [2, 3, 4]]

    bad = make_train(cache, 50, dp_size=2, grad_accum=3, assign=broken)
    with pytest.raises(ValueError, match="distinct"):
        bad.next_step()


@pytest.mark.parametrize("dp_size", [1, 4])
def test_val_split_fixed_disjoint_and_even(tmp_path, dp_size):
    lengths = random_lengths(np.random.default_rng(8), 97, 40)
    cache = synthetic_cache(tmp_path, lengths)
    train_docs, val_docs = split_train_val(cache.doc_lengths, 0.1, 10**9)
    cap = 10**9
    assert len(val_docs) == 10 and not set(train_docs) & set(val_docs)
    assert sorted([*train_docs, *val_docs]) == list(range(97))
    assert np.array_equal(split_train_val(cache.doc_lengths, 0.1, 10**9)[1], val_docs)
    assert len(split_train_val(cache.doc_lengths, 0.1, 100)[1]) < 10, "the token cap limits the held-out docs"
    vals = [ValLoader([Part(cache, val_docs)], cap, tokens_per_microbatch=33, max_doc_len=None, dp_rank=r,
                      dp_size=dp_size) for r in range(dp_size)]
    assert len({len(v) for v in vals}) == 1 and len(vals[0]) >= 1
    first = [[b.input_ids.tolist() for b in v] for v in vals]
    assert first == [[b.input_ids.tolist() for b in v] for v in vals], "the held-out set is the same every pass"
    seen = np.concatenate([check_batch(b, cache.offsets, 33) for v in vals for b in v])
    val_tokens = np.concatenate([np.arange(cache.offsets[d], cache.offsets[d + 1]) for d in val_docs])
    assert len(np.unique(seen)) == len(seen) and np.isin(seen, val_tokens).all()
    if dp_size == 1:
        assert len(seen) == len(val_tokens)


def test_val_token_cap_truncates(tmp_path):
    cache = synthetic_cache(tmp_path, [50, 60, 70, 80, 90])
    train_docs, val_docs = split_train_val(cache.doc_lengths, 0.5, 75)
    assert len(val_docs) == 1
    val = ValLoader([Part(cache, val_docs)], 40, tokens_per_microbatch=16, max_doc_len=None, dp_rank=0, dp_size=1)
    seen = np.concatenate([check_batch(b, cache.offsets, 16) for b in val])
    assert len(seen) == 40


def test_mixture_weights_repeat_small_and_walk_large_sources(tmp_path):
    small = synthetic_cache(tmp_path, [100] * 10, key="small")  # 1000 tokens
    large = synthetic_cache(tmp_path, [100] * 30, key="large", base=10**6)  # 3000 tokens
    loader = TrainLoader([small, large], [3.0, 1.0], tokens_per_microbatch=256, max_doc_len=None, dp_rank=0,
                         dp_size=1, grad_accum=1, seed=3, shuffle=True, assign=round_robin_assign,
                         cost_coefficients=(1.0, 0.0), settings={"tokens_per_microbatch": 256}, val_fraction=0.0,
                         val_max_tokens=0)
    seen = {"small": [], "large": []}
    for _ in range(140):
        (batch,) = loader.next_step()
        tok = batch.input_ids.numpy()
        is_large = tok >= 10**6
        assert is_large.all() or not is_large.any(), "a micro-batch comes from one source"
        base = 10**6 if is_large.any() else 0
        check_batch(replace(batch, input_ids=torch.from_numpy(tok - base),
                            labels=torch.where(batch.labels >= 0, batch.labels - base, batch.labels)),
                    np.arange(0, 3001, 100), 256)
        seen["large" if base else "small"].append(tok - base)
    assert abs(len(seen["small"]) - 105) <= 2, "weight 0.75: three quarters of the micro-batches"
    assert loader.sources[0].consumed == len(seen["small"]) and loader.state_dict()["consumed"] == 140
    for name, tokens, source in (("small", 1000, 0), ("large", 3000, 1)):
        per_epoch = [len(epoch_plan(loader, e, source)) for e in range(2)]
        epochs = [np.concatenate(seen[name][:per_epoch[0]]),
                  np.concatenate(seen[name][per_epoch[0]:sum(per_epoch)])]
        assert all(np.array_equal(np.sort(e), np.arange(tokens)) for e in epochs), f"{name}: each token once an epoch"
    assert len(seen["small"]) > 5 * len(epoch_plan(loader, 0, 0)), "the small source is repeated"
    assert epoch_plan(loader, 1, 1) != epoch_plan(loader, 0, 1)
