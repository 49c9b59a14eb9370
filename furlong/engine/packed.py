"""oneDNN-packed weights written in place: a weight update is one pass, straight into the packed layout.

Why: on CPU the engine multiplies by weights pre-packed into oneDNN's blocked layout
(`core.onednn.pick_linear`; 10-17% more decode tokens/s than plain weights on the measured Xeon, fp32 and
bf16). A sync used to copy each tensor into its HF parameter and then re-pack every touched matrix with
`_reorder_linear_weight` into freshly allocated memory: two passes over the weights, the second into
memory that must first be faulted in, and ~5 GB/s at best where memcpy reaches ~12. Here the packed
tensor's own memory is viewed as a strided tensor (`torch.ops.mkldnn.data_ptr`), so a new weight is
written straight into it with one permuting copy: no re-pack, no allocation, and the tensor the forward
(or a captured graph) reads keeps its identity. Whole row blocks go through `engine/blockcopy.py`'s
compiled transpose (12-14 GB/s from memory on the measured 2-vCPU AMD EPYC, where PyTorch's strided
`copy_` does 3-7); partial blocks at the ends of a range, a dtype conversion, or a machine without a C
compiler take `copy_`.

The layouts are the ones oneDNN picks for a linear weight [out, in]: `AB<ib*k>b<ob>a<k>b`-style blocks,
i.e. memory [out/ob][in/(ib*k)][ib][ob][k] (fp32 on AVX-512: ob=64, ib=16, k=1; bf16 with AMX: ob=32,
ib=16, k=2; plain `ab` is ob=1, ib=in). `Packed.of` does not assume one: it packs two probes of the same
shape and dtype (row index and column index, mod 256, exact in every float type), finds the block sizes
that explain every element of both, and checks the real weight against the result; a layout it cannot
explain (padding, an unknown format, a build without the ops) returns None and that weight keeps the old
copy-then-re-pack path. The bytes written are then exactly those a fresh `_reorder_linear_weight` gives
(tests/unit/test_engine_packed.py), so a synced engine computes exactly what a freshly loaded one does.

Why the HF parameters go: with the packed weight updated in place, an HF copy would be a second full
pass that nothing in the forward reads. A held projection's HF parameter is therefore replaced by a
*meta* placeholder of the same name, shape and dtype (as `engine.quantization` does): the update schema
stays, the memory of a second weight copy is freed, and the placeholder names its `Rows` (`rows_of`),
through which `weight_update.apply_named_tensors` writes and `quantized.held_state_dict` reads back
(the inverse permutation, 1-3 GB/s here: paid by checksum requests only, never by a sync).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Iterator

import torch

from furlong.engine.blockcopy import transpose_blocks

HOLDER = "furlong_packed"  # attribute of a held HF parameter's meta placeholder: its `Rows`
_CANDIDATES = [(ob, ib, k) for k in (1, 2, 4) for ob in (64, 32, 16, 48, 24, 8) for ib in (16, 32, 64, 8, 4)]


def memory(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """A flat strided tensor over an opaque oneDNN tensor's buffer (None where the build cannot say where
    it is). It does not keep `packed` alive: the caller holds both."""
    ops = torch.ops.mkldnn
    if not (packed.is_mkldnn and hasattr(ops, "data_ptr") and hasattr(ops, "_nbytes")):
        return None
    n, ptr = int(ops._nbytes(packed)), int(ops.data_ptr(packed))
    if n == 0 or ptr == 0:
        return None
    return torch.frombuffer((ctypes.c_uint8 * n).from_address(ptr), dtype=torch.uint8).view(dtype)


def _blocked(mem: torch.Tensor, shape: tuple[int, int], blocks: tuple[int, int, int]) -> torch.Tensor:
    """`mem` as [out/ob, ob, in/(ib*k), ib, k], indexed like the plain weight viewed the same way."""
    (oc, ic), (ob, ib, k) = shape, blocks
    return mem.view(oc // ob, ic // (ib * k), ib, ob, k).permute(0, 3, 1, 2, 4)


@functools.cache
def _layout(shape: tuple[int, int], dtype: torch.dtype, pack: Callable) -> tuple[int, int, int] | None:
    """(ob, ib, k) of `pack`'s layout for a [out, in] weight of `dtype`, found from two probes (None: unknown)."""
    oc, ic = shape
    fits = [b for b in [*_CANDIDATES, (1, ic, 1)] if not (oc % b[0] or ic % (b[1] * b[2]))]
    for index in ((torch.arange(oc) % 256)[:, None], (torch.arange(ic) % 256)[None, :]):
        probe = index.to(dtype).expand(oc, ic).contiguous()  # one at a time: each costs a weight's memory twice
        packed = pack(probe)
        mem = memory(packed, dtype)
        if mem is None or mem.numel() != oc * ic:
            return None  # padded (or not oneDNN's): no plain view covers it
        fits = [b for b in fits if torch.equal(_blocked(mem, shape, b), probe.view(oc // b[0], b[0], -1, b[1], b[2]))]
        del packed, mem
    return fits[0] if fits else None


class Packed:
    """One packed weight [out, in] and a writable view of its memory; rows are written and read in place."""

    def __init__(self, packed: torch.Tensor, mem: torch.Tensor, shape: tuple[int, int], blocks: tuple[int, int, int]):
        self.packed = packed  # the tensor the forward multiplies by; owns the memory `view` writes
        self.shape, self.dtype = shape, mem.dtype
        self.ob, self.ib, self.k = blocks
        self.mem = mem  # flat: row block a is mem[a*ob*in : (a+1)*ob*in], that block transposed (in units of k)
        self.view = _blocked(mem, shape, blocks)
        # k elements of one block row travel as one wider integer (bf16 pairs as int32): 2x fewer elements to move
        self.wide = (
            {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(self.k * mem.element_size()) if self.k > 1 else None
        )

    @classmethod
    def of(cls, packed: torch.Tensor, weight: torch.Tensor, pack: Callable) -> Packed | None:
        """`packed` (= `pack(weight)`) as a `Packed`, or None where its layout is not understood."""
        if weight.dim() != 2 or not packed.is_mkldnn:
            return None
        shape = (int(weight.shape[0]), int(weight.shape[1]))
        blocks = _layout(shape, weight.dtype, pack)
        mem = memory(packed, weight.dtype) if blocks is not None else None
        if mem is None or mem.numel() != weight.numel():
            return None
        out = cls(packed, mem, shape, blocks)
        # the real weight agrees, checked on its first and last row blocks (a full read-back is a slow pass)
        edge = min(out.ob, shape[0])
        ends = ((0, edge), (shape[0] - edge, shape[0]))
        return out if all(torch.equal(out.read(a, b), weight[a:b]) for a, b in ends) else None

    def _pieces(self, lo: int, hi: int) -> Iterator[tuple[torch.Tensor, int, int]]:
        """(view of packed rows, first row, last row + 1) covering rows [lo, hi): whole row blocks in one piece,
        a partial block at either end in its own."""
        ob = self.ob
        a0, a1 = -(-lo // ob), hi // ob
        if a0 > a1:  # inside one block
            yield self.view[lo // ob, lo % ob : hi - (lo // ob) * ob], lo, hi
            return
        if lo < a0 * ob:
            yield self.view[a0 - 1, lo % ob :], lo, a0 * ob
        if a1 > a0:
            yield self.view[a0:a1], a0 * ob, a1 * ob
        if hi > a1 * ob:
            yield self.view[a1, : hi - a1 * ob], a1 * ob, hi

    def _pair(self, dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.wide is not None and dst.dtype == src.dtype:
            return dst.view(self.wide), src.view(self.wide)
        return dst, src

    def _blocks(self, a: int, b: int) -> torch.Tensor:
        """The packed memory of whole row blocks covering rows [a, b) (a, b multiples of ob), flat."""
        step = self.ob * self.shape[1]
        return self.mem[a // self.ob * step : b // self.ob * step]

    def _transposed(self, dst: torch.Tensor, src: torch.Tensor, rows: int) -> bool:
        """Whole blocks through the C kernel (False: not this dtype pair, or no kernel)."""
        if dst.dtype != src.dtype:
            return False
        dst, src = self._pair(dst, src)
        return transpose_blocks(src.reshape(-1), dst.reshape(-1), rows, self.ob * self.shape[1] // self.k // rows)

    @torch.no_grad()
    def write(self, lo: int, t: torch.Tensor) -> None:
        """Rows [lo, lo + len(t)) of the weight := `t` ([n, in], any float dtype: converted as `copy_` does)."""
        t = t.detach().to("cpu").contiguous()
        for piece, a, b in self._pieces(lo, lo + t.shape[0]):
            src = t[a - lo : b - lo]
            if piece.dim() == 5 and self._transposed(self._blocks(a, b), src, rows=self.ob):
                continue
            dst, src = self._pair(piece, src.view(piece.shape))
            dst.copy_(src)

    @torch.no_grad()
    def read(self, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) of the weight, plain ([hi - lo, in], a new tensor)."""
        out = torch.empty(hi - lo, self.shape[1], dtype=self.dtype)
        for piece, a, b in self._pieces(lo, hi):
            dst = out[a - lo : b - lo]
            if piece.dim() == 5 and self._transposed(dst, self._blocks(a, b), rows=self.shape[1] // self.k):
                continue
            dst, src = self._pair(dst.view(piece.shape), piece)
            dst.copy_(src)
        return out


class Rows:
    """The rows [lo, hi) of a `Packed` weight that one HF parameter is (q of a fused q|k|v, or all of o)."""

    def __init__(self, packed: Packed, lo: int, hi: int):
        self.packed, self.lo, self.hi = packed, lo, hi

    def write(self, t: torch.Tensor) -> None:
        self.packed.write(self.lo, t)

    def read(self) -> torch.Tensor:
        return self.packed.read(self.lo, self.hi)


def rows_of(param: torch.Tensor) -> Rows | None:
    """The packed rows a held HF parameter's placeholder stands for (None: an ordinary parameter)."""
    return getattr(param, HOLDER, None)


def placeholder(param: torch.Tensor, rows: Rows) -> torch.nn.Parameter:
    """A meta parameter of `param`'s shape and dtype that names `rows` (the memory of `param` is let go)."""
    meta = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=False)
    setattr(meta, HOLDER, rows)
    return meta
