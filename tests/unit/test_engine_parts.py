"""Pure pieces of the engine: block pool, sampler transforms, shared-memory tensors, request validation."""

from __future__ import annotations

import pytest
import torch

from furlong.core import api as P
from furlong.engine import validate as V
from furlong.engine.kv_cache import BlockPool
from furlong.engine.sampler import SamplingParams, sample
from furlong.weights.tensors import checksum, shm_views, write_shm


def test_block_pool_prefix_match_evict_and_flush():
    pool = BlockPool(num_blocks=4, block_size=2)
    toks = [1, 2, 3, 4, 5]
    blocks = [pool.alloc() for _ in range(3)]
    hashes: list[int] = []
    pool.register(blocks, hashes, toks, n_cached=5)
    assert len(hashes) == 2  # two full blocks named, the partial third is not
    pool.release(blocks)
    assert pool.available == 4 and len(pool.evictable) == 2
    got, _, n, _ = pool.match([1, 2, 3, 4, 9])
    assert got == blocks[:2] and n == 4 and pool.hit_tokens == 4
    assert pool.match([1, 2, 3, 4])[0] == blocks[:1]  # the last token is always recomputed
    pool.release(got + blocks[:1])
    assert [pool.alloc() for _ in range(4)] and pool.alloc() is None  # evictable blocks were reused
    assert pool.by_hash == {}
    pool.flush()
    assert pool.epoch == 1


def test_block_pool_hands_a_kept_tail_block_to_the_request_that_continues_it():
    pool = BlockPool(num_blocks=6, block_size=4)
    toks = [1, 2, 3, 4, 5, 6, 7]  # KV of the first 6: one full block, a tail holding [5, 6]
    blocks, hashes = [pool.alloc(), pool.alloc()], []
    pool.register(blocks, hashes, toks, n_cached=6)
    pool.keep_tail(blocks, hashes, toks, n_cached=6)
    pool.release(blocks)
    assert pool.available == 6 and set(pool.evictable) == set(blocks)
    assert pool.match([1, 2, 3, 4, 5, 9, 9])[2] == 4  # other tokens after the full block: no tail
    pool.release([blocks[0]])
    assert pool.match([1, 2, 3, 4, 5, 6])[2] == 4  # the tail would leave no token to compute
    pool.release([blocks[0]])
    got, got_hashes, n, _ = pool.match([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert (got, n, len(got_hashes)) == (blocks, 6, 1) and pool.ref[blocks[1]] == 1
    assert pool.tails == {} and blocks[1] not in pool.evictable  # adopted, so it is the adopter's alone
    assert pool.match([1, 2, 3, 4, 5, 6, 7])[2] == 4  # a second request finds the full block only
    pool.release(got + [blocks[0]])
    # Tails of other tokens after the same full block are kept side by side (a GRPO group's samples); the same
    # tokens again replace the older (freed); a tail someone else still holds is never kept.
    a = [blocks[0], pool.alloc()]
    pool.share([blocks[0]])
    pool.keep_tail(a, hashes, [1, 2, 3, 4, 5], n_cached=5)
    pool.release(a)
    b = [blocks[0], pool.alloc()]
    pool.share([blocks[0]])
    pool.keep_tail(b, hashes, [1, 2, 3, 4, 8, 8], n_cached=6)
    pool.release(b)
    assert pool.tails == {(hashes[0], (5,)): a[1], (hashes[0], (8, 8)): b[1]}
    c = [blocks[0], pool.alloc()]
    pool.share([blocks[0]])
    pool.keep_tail(c, hashes, [1, 2, 3, 4, 8, 8, 8], n_cached=6)
    pool.release(c)
    assert pool.tails[(hashes[0], (8, 8))] == c[1] and b[1] in pool.free
    d = [blocks[0], pool.alloc()]
    pool.share([blocks[0], d[1]])  # its tail held twice (a fork's would be copied, but say it were not)
    pool.keep_tail(d, hashes, [1, 2, 3, 4, 7], n_cached=5)
    pool.release(d + [d[1]])
    assert (hashes[0], (7,)) not in pool.tails and d[1] in pool.free
    assert pool.match([1, 2, 3, 4, 8, 8, 1])[2] == 6 and pool.match([1, 2, 3, 4, 5, 1])[2] == 5
    assert pool.tails == {} and min(pool.ref) >= 0
    pool.flush()  # new weights: a kept tail's KV is as stale as a full block's
    assert pool.tails == {} and pool.tail_of == {}


def test_block_pool_carries_prefixes_one_update_and_no_further():
    """An update in place keeps the prefixes of the epoch that ends for one more epoch (an agent's next turn
    reuses its context); the next update forgets them, and KV matched through them names its blocks with
    the older epoch, so nothing served from the cache is ever more than one update behind."""
    pool = BlockPool(num_blocks=8, block_size=2)
    toks = [1, 2, 3, 4, 5, 6, 7]
    blocks, hashes = [pool.alloc() for _ in range(4)], []
    pool.register(blocks, hashes, toks, n_cached=6)
    pool.release(blocks)
    pool.flush()  # a plain update: everything goes
    assert pool.match(toks).n == 0 and pool.available == 8 and not pool.named_epoch

    blocks, hashes = [pool.alloc() for _ in range(4)], []
    pool.register(blocks, hashes, toks, n_cached=6)  # named in epoch 1
    pool.release(blocks)
    pool.flush(carry=True)  # epoch 2: epoch 1's prefixes stay
    assert pool.may_name(1) and not pool.may_name(0)
    m = pool.match(toks + [8])
    assert m.n == 6 and m.epoch == 1  # served, and marked as KV of epoch 1
    more = m.blocks + [pool.alloc()]
    pool.register(more, m.hashes, toks + [8, 9], n_cached=8, epoch=m.epoch)  # the extension inherits epoch 1
    pool.release(more)
    assert set(pool.named_epoch.values()) == {1}
    pool.flush(carry=True)  # epoch 3: epoch 1's KV is two updates behind: forgotten, blocks free again
    assert pool.match(toks + [8, 9, 10]).n == 0 and not pool.named_epoch and pool.available == 8
    assert not pool.by_hash and not pool.evictable


def test_block_pool_evicts_a_kept_tail_like_any_cached_block():
    pool = BlockPool(num_blocks=2, block_size=4)
    blocks, hashes = [pool.alloc(), pool.alloc()], []
    pool.register(blocks, hashes, [1, 2, 3, 4, 5, 6], n_cached=5)
    pool.keep_tail(blocks, hashes, [1, 2, 3, 4, 5, 6], n_cached=5)
    pool.release(blocks)
    assert pool.alloc() == blocks[0] and pool.alloc() == blocks[1]  # least recently released first
    assert pool.tails == {} and pool.tail_of == {} and pool.by_hash == {}


def test_sampler_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = set()
    for seed in range(200):
        g = torch.Generator().manual_seed(seed)
        toks, lp = sample(logits, [SamplingParams(top_p=0.7)], [g])
        seen.add(toks[0])
    assert seen == {0, 1}
    assert torch.allclose(lp, torch.log_softmax(logits, -1))  # reported log-probs are the raw model's
    toks, _ = sample(logits, [SamplingParams(temperature=0)], [None])
    assert toks == [0]


def test_shared_memory_views_round_trip_and_checks():
    named = {
        "a": torch.arange(6.0).view(2, 3),
        "b": torch.tensor([1, 2], dtype=torch.int64),
        "c": torch.ones(3, dtype=torch.bfloat16),
    }
    shm, handle = write_shm(named)
    try:
        with shm_views(handle) as views:
            assert all(torch.equal(views[k], v) and views[k].dtype == v.dtype for k, v in named.items())
            shm.buf[11] = 0  # a view, not a copy: the segment's bytes show through
            assert views["a"].view(-1)[2].item() != 2.0
        assert handle["tensors"][0]["crc32"] == checksum(named["a"])
        with pytest.raises(ValueError, match=r"tensors\[a\]: checksum mismatch"):  # corrupted tensor "a"
            with shm_views(handle):
                pass
        specs = handle["tensors"]
        for bad, why in [
            ({**specs[1], "shape": [100]}, r"tensors\[b\]: offset/nbytes"),
            ({**specs[1], "dtype": "float99"}, r"tensors\[b\]\.dtype"),
            ({**specs[1], "offset": 1, "nbytes": 8, "shape": [1]}, r"tensors\[b\]: offset 1 is not aligned"),
            ({**specs[1], "offset": shm.size}, r"tensors\[b\]: offset/nbytes"),
        ]:
            with pytest.raises(ValueError, match=why):
                with shm_views({**handle, "tensors": [bad]}):
                    pass
        with pytest.raises(ValueError, match=r"tensors\[b\]: given twice"):
            with shm_views({**handle, "tensors": [specs[1], specs[1]]}):
                pass
    finally:
        shm.close()
        shm.unlink()
    with pytest.raises(ValueError, match="shm_name"):
        with shm_views({"shm_name": "furlong-does-not-exist"}):
            pass


def test_shared_memory_mappings_are_kept_but_never_stale():
    """A reused segment keeps its mapping across calls; a replaced or unlinked one is dropped."""
    import furlong.weights.tensors as T

    shm, handle = write_shm({"w": torch.zeros(4)}, with_checksum=False)
    try:
        with shm_views(handle):
            pass
        kept = T._mapped[handle["shm_name"]][0]
        shm.buf[:16] = torch.ones(4).numpy().tobytes()  # the sender rewrites the same segment
        with shm_views(handle) as views:
            assert torch.equal(views["w"], torch.ones(4))
        assert T._mapped[handle["shm_name"]][0] is kept and T._mapped[handle["shm_name"]][2] == 0
    finally:
        shm.close()
        shm.unlink()
    others = [write_shm({"w": torch.full((4,), float(i))}) for i in range(T.MAPPINGS + 1)]
    try:
        for i, (_, h) in enumerate(others):
            with shm_views(h) as views:
                assert torch.equal(views["w"], torch.full((4,), float(i)))
        assert handle["shm_name"] not in T._mapped  # unlinked: its mapping went
        assert len(T._mapped) <= T.MAPPINGS
    finally:
        for seg, _ in others:
            seg.close()
            seg.unlink()


def test_receive_buffers_follow_the_backend():
    """NCCL moves device memory: buffers go to the engine's device; gloo keeps host buffers."""
    from furlong.engine.weight_update import receive_device

    class Group:
        def __init__(self, name: str):
            self._name = name

        def name(self) -> str:
            return self._name

    assert receive_device(Group("nccl"), "meta") == torch.device("meta")
    assert receive_device(Group("gloo"), "meta") == torch.device("cpu")


def test_protocol_names_the_field():
    with pytest.raises(P.BadRequest, match=r"^sampling_params.top_k"):
        P.parse(P.GenerateIn, {"input_ids": [1], "sampling_params": {"top_k": 1.5}})
    with pytest.raises(P.BadRequest, match="input_ids: token id 7"):
        V.check_prompt([1, 7], "input_ids", vocab=5, max_context=10, kv_tokens=100)
    with pytest.raises(P.BadRequest, match="KV cache"):
        V.check_prompt([1, 2, 3], "input_ids", vocab=5, max_context=10, kv_tokens=3)
    sp = V.to_sampling(P.SamplingParamsIn(sampling_seed=4, stop="x"), prompt_len=3, max_context=10, default_max=128)
    assert sp.seed == 4 and sp.stop == ["x"] and sp.max_new_tokens == 7
