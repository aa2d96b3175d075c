"""Scheduler, state pool, block manager and prefix cache: pure Python, property-based."""

import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyla.serve.block_manager import BlockManager
from hyla.serve.prefix_cache import PrefixCache, block_hashes
from hyla.serve.scheduler import Scheduler, SchedulerConfig, decode_widths
from hyla.serve.sequence import SamplingParams, Sequence
from hyla.serve.state_pool import StatePool


def test_policy_modules_import_no_torch():
    code = ("import sys, hyla.serve.scheduler, hyla.serve.prefix_cache, "
            "hyla.serve.speculative; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_state_pool_no_double_ownership():
    pool = StatePool(3)
    got = [pool.allocate() for _ in range(3)]
    assert sorted(got) == [0, 1, 2] and pool.allocate() is None
    pool.free(1)
    assert pool.allocate() == 1
    with pytest.raises(ValueError, match="double free"):
        pool.free(5)


def test_block_manager_reuses_cached_blocks_last():
    evicted = []
    bm = BlockManager(4, 2, on_evict=lambda b, h: evicted.append((b, h)))
    a = bm.allocate(2)
    bm.set_hash(a[0], 111)
    bm.free(a)
    assert bm.num_free == 4
    bm.share(a[0])                          # a prefix hit revives the cached block
    assert bm.ref_count[a[0]] == 1 and bm.num_free == 3
    bm.free([a[0]])
    bm.allocate(4)
    assert evicted == [(a[0], 111)]
    with pytest.raises(ValueError, match="only 0 free"):
        bm.allocate(1)


def test_a_growing_table_takes_no_cached_block_while_uncached_ones_are_free():
    """Two chats' blocks interleave; one growing must not take the other's cached block
    just because it follows its own last block (that evicted the other's previous turn)."""
    evicted = []
    bm = BlockManager(8, 2, on_evict=lambda b, h: evicted.append(b))
    a, b = bm.allocate(1), bm.allocate(1)           # blocks 0 and 1
    bm.set_hash(b[0], 222)
    bm.free(b)                                      # b's turn ended: cached, free
    grown = bm.allocate(2, after=a[0])
    assert b[0] not in grown and evicted == []
    bm.free(grown)
    assert bm.allocate(1, after=grown[0]) == [grown[1]]   # an uncached next block: first


def test_decode_widths_cover_every_batch():
    for n in (1, 5, 20, 64, 100, 256):
        w = decode_widths(n)
        assert w[-1] == n and list(w) == sorted(set(w))
    assert SchedulerConfig(max_num_seqs=64).decode_widths == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    with pytest.raises(ValueError, match="decode_widths"):
        SchedulerConfig(max_num_seqs=8, decode_widths=(1, 2, 4))


def test_prefix_cache_hybrid_needs_snapshot_at_boundary():
    bm = BlockManager(8, 4)
    pc = PrefixCache(4, bm, num_snapshots=1, snapshot_interval=8)
    toks = list(range(20))
    hs = block_hashes(toks, 4)
    blocks = bm.allocate(4)
    pc.insert_blocks(hs[:4], blocks)
    assert pc.match(toks).num_tokens == 0      # KV cached, but no GLA state anywhere
    assert pc.save_snapshot(hs[1]) == 0        # state after 8 tokens
    m = pc.match(toks)
    assert (m.num_tokens, m.kv_blocks, m.snapshot) == (8, blocks[:2], 0)
    assert pc.save_snapshot(hs[3]) == 0        # one slot: evicts the older boundary
    assert pc.match(toks).num_tokens == 16
    assert pc.match(toks[:10]).num_tokens == 0


def _check_invariants(s: Scheduler) -> None:
    slots = [q.slot for q in s.running]
    assert None not in slots and len(set(slots)) == len(slots)
    assert set(slots) == s.pool.used_slots()
    assert all(q.slot is None and not q.block_table for q in s.waiting)
    if s.blocks is not None:
        owners = Counter(b for q in s.running for b in q.block_table)
        assert all(s.blocks.ref_count[b] == owners.get(b, 0) for b in range(s.blocks.num_blocks))
        for q in s.running:
            assert len(q.block_table) * s.config.block_size >= q.num_computed_tokens


ops = st.lists(st.tuples(st.sampled_from(["add", "step", "step", "step", "abort"]),
                         st.integers(0, 10 ** 6)), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(ops=ops, blocks=st.sampled_from([0, 10, 40]), snaps=st.sampled_from([0, 2]),
       budget=st.sampled_from([5, 16, 64]))
def test_scheduler_never_leaks_or_double_owns(ops, blocks, snaps, budget):
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget,
                                  max_model_len=64, block_size=4, num_kv_blocks=blocks,
                                  num_state_snapshots=snaps, snapshot_interval=8))
    base = list(range(24))
    seqs, n = [], 0
    for op, r in ops:
        if op == "add":
            prompt = base[:r % 24 + 1] + [r % 97] * (r % 5)    # shared prefixes, some tails
            seq = Sequence(f"r{n}", prompt, SamplingParams(max_tokens=r % 7 + 1,
                                                            ignore_eos=True))
            n += 1
            s.add(seq)
            seqs.append(seq)
        elif op == "abort" and seqs:
            s.abort(seqs[r % len(seqs)].request_id)
        else:
            out = s.schedule()
            assert out.num_batched_tokens <= budget
            if out.decodes:
                assert len(out.decodes) <= out.decode_width
            sampled = {q.request_id: r % 50 for q in out.decodes}
            sampled |= {c.seq.request_id: r % 50 for c in out.prefills if c.samples}
            s.update(out, sampled)
        _check_invariants(s)
    for _ in range(10_000):                  # everything left runs to completion
        if not s.has_unfinished():
            break
        out = s.schedule()
        sampled = {q.request_id: 1 for q in out.decodes}
        sampled |= {c.seq.request_id: 1 for c in out.prefills if c.samples}
        s.update(out, sampled)
        _check_invariants(s)
    assert not s.has_unfinished()
    assert s.pool.num_used == 0
    if s.blocks is not None:
        assert all(c == 0 for c in s.blocks.ref_count) and s.blocks.num_free == blocks
    for q in seqs:
        assert q.is_finished
        if q.finish_reason == "length":
            assert len(q.output_ids) == q.params.max_tokens


def test_preempted_sequence_is_recomputed_first():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32,
                                  block_size=4, num_kv_blocks=5))
    a = Sequence("a", list(range(8)), SamplingParams(max_tokens=8, ignore_eos=True))
    b = Sequence("b", list(range(8)), SamplingParams(max_tokens=8, ignore_eos=True))
    s.add(a)
    s.add(b)
    preempted = []
    while s.has_unfinished():
        out = s.schedule()
        preempted += [q.request_id for q in out.preempted]
        sampled = {q.request_id: 0 for q in out.decodes}
        sampled |= {c.seq.request_id: 0 for c in out.prefills if c.samples}
        s.update(out, sampled)
    assert preempted and preempted[0] == "b"           # the newest goes first
    assert len(a.output_ids) == len(b.output_ids) == 8


def test_prefilled_sequence_goes_straight_to_decode():
    s = Scheduler(SchedulerConfig(max_num_seqs=2, block_size=4, num_kv_blocks=8))
    seq = Sequence("x", list(range(10)), SamplingParams(max_tokens=3, ignore_eos=True),
                   output_ids=[5], num_computed_tokens=10, external_state=object())
    s.add(seq)
    out = s.schedule()
    assert out.decodes == [seq] and out.loads == [seq] and not out.prefills
    assert len(seq.block_table) == 3                    # 11 tokens at 4 per block
