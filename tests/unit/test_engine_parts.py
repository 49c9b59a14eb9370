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
    got, _ = pool.match([1, 2, 3, 4, 9])
    assert got == blocks[:2] and pool.hit_tokens == 4
    assert pool.match([1, 2, 3, 4])[0] == blocks[:1]  # the last token is always recomputed
    pool.release(got + blocks[:1])
    assert [pool.alloc() for _ in range(4)] and pool.alloc() is None  # evictable blocks were reused
    assert pool.by_hash == {}
    pool.flush()
    assert pool.epoch == 1


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
