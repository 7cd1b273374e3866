"""The driver's KV bookkeeping: block pool (ref counts, LRU eviction), prefix keys, the manager, preemption."""

import pytest

from tpguide.engine.block_pool import BlockPool
from tpguide.engine.kv_cache_manager import KVCacheManager
from tpguide.engine.prefix_hash import extend_block_hashes
from tpguide.engine.request import Request, SamplingParams
from tpguide.engine.scheduler import Scheduler

BS = 4


def _req(i, tokens, **params):
    r = Request(request_id=str(i), index=i, sampling_params=SamplingParams(max_tokens=8, **params))
    r.prompt_token_ids = list(tokens)
    return r


def test_prefix_keys_chain_the_parent():
    a = extend_block_hashes([], [1, 2, 3, 4, 5, 6, 7, 8], BS, 2)
    b = extend_block_hashes([], [9, 9, 9, 9, 5, 6, 7, 8], BS, 2)
    assert a[0] != b[0] and a[1] != b[1]  # same second block, other parent: another key
    assert extend_block_hashes([], [1, 2, 3, 4, 0, 0, 0, 0], BS, 1) == a[:1]
    with pytest.raises(ValueError, match="need 12 tokens"):
        extend_block_hashes([], [1] * 8, BS, 3)


def test_pool_evicts_least_recently_freed_cached_block_and_reuses_uncached_first():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, b"ka")
    pool.cache(b, b"kb")
    pool.release([a, b])  # last block first: b is evicted before a
    pool.release([c])  # no key: reused first
    assert pool.num_free == 3 and pool.lookup(b"ka") == a
    assert pool.allocate(1) == [c]
    assert pool.allocate(1) == [b] and pool.lookup(b"kb") is None and pool.lookup(b"ka") == a
    with pytest.raises(ValueError, match="cannot allocate 2 KV blocks: 1 of 3 are free"):
        pool.allocate(2)


def test_manager_reuses_the_longest_cached_prefix_and_always_computes_the_last_token():
    kv = KVCacheManager(8, BS)
    first = _req(0, range(10))
    assert kv.allocate(first, 10)
    first.num_computed_tokens = 10
    kv.cache_final_blocks(first)  # 2 full blocks cached, the partial third not
    assert first.num_cached_blocks == 2
    blocks = list(first.block_ids)
    kv.free(first)
    same = _req(1, range(10))
    assert kv.cached_prefix(same, 10) == (blocks[:2], 8)
    exact = _req(2, range(8))  # the whole prompt is cached: its last block is recomputed
    assert kv.cached_prefix(exact, 8)[1] == 4
    other = _req(3, [5] + list(range(1, 10)))
    assert kv.cached_prefix(other, 10) == ([], 0)
    wants_prompt_logprobs = _req(4, range(10), prompt_logprobs=0)
    assert kv.cached_prefix(wants_prompt_logprobs, 10) == ([], 0)
    off = KVCacheManager(8, BS, enable_prefix_caching=False)
    assert off.cached_prefix(same, 10) == ([], 0)


def test_a_hit_shares_blocks_and_counts_them_once_in_the_free_check():
    kv = KVCacheManager(4, BS)
    a = _req(0, range(9))
    assert kv.allocate(a, 9)
    a.num_computed_tokens = 9
    kv.cache_final_blocks(a)
    b = _req(1, range(9))
    blocks, n = kv.cached_prefix(b, 9)
    assert n == 8 and blocks == a.block_ids[:2]
    assert kv.allocate(b, 9, blocks)  # 1 new block: the pool has exactly one left
    assert b.block_ids[:2] == a.block_ids[:2] and kv.pool.num_free == 0
    kv.free(a)
    assert kv.pool.num_free == 1  # the shared blocks stay referenced by b


def test_blocks_holding_drafts_are_not_cached():
    kv = KVCacheManager(8, BS)
    r = _req(0, range(6))
    r.output_token_ids = [7]
    assert kv.allocate(r, 7 + 4)  # decode with 4 drafts: positions up to 10
    r.num_computed_tokens = 7  # the drafts were rejected
    kv.cache_final_blocks(r)
    assert r.num_cached_blocks == 1


def test_blocks_of_generated_tokens_are_cached_once_full():
    """A decode step's allocation must not mark the partly filled last block as cached (it was, and then never was)."""
    kv = KVCacheManager(8, BS)
    r = _req(0, range(6))  # blocks: [0 1 2 3] [4 5 . .]
    assert kv.allocate(r, 6)
    r.num_computed_tokens = 6
    kv.cache_final_blocks(r)
    assert r.num_cached_blocks == 1
    for token in (50, 51, 52, 53):  # decode steps: 6 -> 10 tokens, the second block fills with output tokens
        r.output_token_ids.append(token)
        assert kv.allocate(r, r.num_tokens)
        r.num_computed_tokens = r.num_tokens
        kv.cache_final_blocks(r)
    assert r.num_cached_blocks == 2
    blocks = list(r.block_ids)
    kv.free(r)
    follow_up = _req(1, [0, 1, 2, 3, 4, 5, 50, 51, 52, 60])  # the next turn's prompt: prompt + output + more
    assert kv.cached_prefix(follow_up, 10) == (blocks[:2], 8)


def test_refusal_names_the_numbers():
    with pytest.raises(ValueError, match=r"prompt = 70 tokens need 18 KV blocks of 4 tokens, but the KV cache "
                                         r"holds 16 blocks \(64 tokens"):
        KVCacheManager(16, BS).check_fits(70, "prompt")


def _advance(scheduled, kv, token=7):
    for s in scheduled:
        s.request.num_computed_tokens += len(s.token_ids)
        if s.samples:
            s.request.output_token_ids.append(token)
        kv.cache_final_blocks(s.request)


def test_newest_request_is_preempted_and_recomputes_all_its_tokens():
    kv = KVCacheManager(4, BS, enable_prefix_caching=False)
    sched = Scheduler(max_num_seqs=2, max_num_batched_tokens=32, kv=kv)
    old, new = _req(0, range(7)), _req(1, range(100, 107))
    sched.add(old)
    sched.add(new)
    step = sched.schedule()  # 2 blocks each: the pool is full
    assert [s.request.index for s in step] == [0, 1] and kv.pool.num_free == 0
    _advance(step, kv)
    step = sched.schedule()  # both decode at position 7 (within block 2); old decodes, then needs nothing new
    _advance(step, kv)
    step = sched.schedule()  # position 8 needs a third block: the newest request goes
    assert [s.request.index for s in step] == [0] and sched.num_preemptions == 1
    assert sched.preempted == [new] and new.block_ids == [] and new.num_prefill_tokens == 9
    _advance(step, kv)
    sched.release(old)  # old finishes
    step = sched.schedule()
    (s,) = step
    assert s.request is new and s.is_prefill and s.samples and not s.is_new
    assert s.token_ids == new.prompt_token_ids + [7, 7] and s.start_position == 0
