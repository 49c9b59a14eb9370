"""Batched block transposes in a small C kernel, compiled for this CPU on first use.

Why: a weight sync writes each new matrix into the engine's oneDNN-packed weight (`engine/packed.py`),
whose memory is, per block of `ob` output rows, the block transposed ([in, ob] instead of [ob, in]).
PyTorch's strided `copy_` does that permutation element by element at 3-7 GB/s on the measured
2-vCPU AMD EPYC (Zen 4, AVX-512), where a plain memcpy reaches 18 GB/s from memory and ~40 GB/s in
cache. 16x16 tiles transposed in AVX-512 registers (16 loads, 64 shuffles, 16 stores) run at
12-14 GB/s from memory and 25-35 GB/s in cache on the same machine, one thread, because every cache
line read and written is used whole. Without AVX-512, AVX2 transposes 16x8 tiles as two 8x8 ones
(8 loads, 24 shuffles and 8 stores each), so each output row's whole 64-byte line is stored at once.

The kernel is compiled for this CPU on first use (`cbuild.load`: the system C compiler,
`-march=native`, cached per source and CPU). A machine without a compiler, or one where the build
fails, gets None from `kernel()` and the caller keeps PyTorch's copy: the bytes are the same either way
(tests/unit/test_engine_packed.py). The ctypes call releases the GIL; one thread is used because
the copy is memory-bound (a second thread measured no faster).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from furlong.engine import cbuild

SOURCE = r"""
#include <stdint.h>
#define TILE 16
/* dst[b][c][r] = src[b][r][c] for b < blocks, r < rows, c < cols: a batch of [rows, cols] transposes */
#define SCALAR(NAME, TY) \
void NAME(const TY* restrict src, TY* restrict dst, long blocks, long rows, long cols) { \
  for (long b = 0; b < blocks; b++) { \
    const TY* s = src + b * rows * cols; TY* d = dst + b * rows * cols; \
    for (long r0 = 0; r0 < rows; r0 += TILE) { long r1 = r0 + TILE < rows ? r0 + TILE : rows; \
      for (long c0 = 0; c0 < cols; c0 += TILE) { long c1 = c0 + TILE < cols ? c0 + TILE : cols; \
        for (long c = c0; c < c1; c++) for (long r = r0; r < r1; r++) d[c * rows + r] = s[r * cols + c]; } } } }
SCALAR(fl_transpose16, uint16_t)
SCALAR(fl_transpose64, uint64_t)
SCALAR(fl_transpose32_scalar, uint32_t)

#ifdef __AVX512F__
#include <immintrin.h>
/* one 16x16 tile of 32-bit elements: rows of s (stride ss) become rows of d (stride ds) */
static inline void tile16(const uint32_t* s, long ss, uint32_t* d, long ds, int stream) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512((const void*)(s + i * ss));
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]); t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]); }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]); r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]); r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]); }
  for (int i = 0; i < 16; i += 8) for (int k = 0; k < 4; k++) {
    t[i + k] = _mm512_shuffle_i32x4(r[i + k], r[i + k + 4], 0x88);
    t[i + k + 4] = _mm512_shuffle_i32x4(r[i + k], r[i + k + 4], 0xdd); }
  for (int k = 0; k < 8; k++) {
    r[k] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0x88); r[k + 8] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0xdd); }
  if (stream) for (int i = 0; i < 16; i++) _mm512_stream_si512((void*)(d + i * ds), r[i]);
  else for (int i = 0; i < 16; i++) _mm512_storeu_si512((void*)(d + i * ds), r[i]);
}
#elif defined(__AVX2__)
#include <immintrin.h>
/* one 8x8 tile of 32-bit elements in AVX2 registers (bit moves only: any 32-bit data) */
static inline void tile8(const uint32_t* s, long ss, __m256 o[8]) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps((const float*)(s + i * ss));
  for (int i = 0; i < 8; i += 2) { t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]); t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]); }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44); r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44); r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee); }
  for (int k = 0; k < 4; k++) { o[k] = _mm256_permute2f128_ps(r[k], r[k + 4], 0x20); o[k + 4] = _mm256_permute2f128_ps(r[k], r[k + 4], 0x31); }
}
/* a 16-row x 8-column tile: two 8x8 tiles one above the other, so each output row's two 32-byte halves
   (one whole 64-byte line) are stored back to back */
static inline void tile16x8(const uint32_t* s, long ss, uint32_t* d, long ds, int stream) {
  __m256 a[8], b[8];
  tile8(s, ss, a); tile8(s + 8 * ss, ss, b);
  if (stream) for (int i = 0; i < 8; i++) { _mm256_stream_ps((float*)(d + i * ds), a[i]); _mm256_stream_ps((float*)(d + i * ds + 8), b[i]); }
  else for (int i = 0; i < 8; i++) { _mm256_storeu_ps((float*)(d + i * ds), a[i]); _mm256_storeu_ps((float*)(d + i * ds + 8), b[i]); }
}
#endif

void fl_transpose32(const uint32_t* restrict src, uint32_t* restrict dst, long blocks, long rows, long cols) {
#ifdef __AVX512F__
  if (rows % 16 == 0 && cols % 16 == 0) {
    /* every 64-byte store fills one whole, aligned cache line exactly once: stream it past the cache
       (no read for ownership), as a large memcpy does */
    int stream = ((uintptr_t)dst % 64) == 0;
    for (long b = 0; b < blocks; b++) {
      const uint32_t* s = src + b * rows * cols; uint32_t* d = dst + b * rows * cols;
      for (long r0 = 0; r0 < rows; r0 += 16)
        for (long c0 = 0; c0 < cols; c0 += 16) tile16(s + r0 * cols + c0, cols, d + c0 * rows + r0, rows, stream);
    }
    if (stream) _mm_sfence();
    return;
  }
#elif defined(__AVX2__)
  if (rows % 16 == 0 && cols % 8 == 0) {
    int stream = ((uintptr_t)dst % 64) == 0;  /* then every output row's 16 elements are one aligned line */
    for (long b = 0; b < blocks; b++) {
      const uint32_t* s = src + b * rows * cols; uint32_t* d = dst + b * rows * cols;
      for (long r0 = 0; r0 < rows; r0 += 16)
        for (long c0 = 0; c0 < cols; c0 += 8) tile16x8(s + r0 * cols + c0, cols, d + c0 * rows + r0, rows, stream);
    }
    if (stream) _mm_sfence();
    return;
  }
#endif
  fl_transpose32_scalar(src, dst, blocks, rows, cols);
}
"""
_FUNCTIONS = {2: "fl_transpose16", 4: "fl_transpose32", 8: "fl_transpose64"}


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled kernel library, built on first use (None: no compiler, a failed build, or
    `FURLONG_NATIVE_KERNELS=0`; `cbuild.load`)."""
    lib = cbuild.load("blockcopy", SOURCE)
    if lib is None:
        return None
    for name in _FUNCTIONS.values():
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long]
        getattr(lib, name).restype = None
    return lib


def transpose_blocks(src: torch.Tensor, dst: torch.Tensor, rows: int, cols: int) -> bool:
    """dst := src viewed as [blocks, rows, cols], each block transposed to [cols, rows]. Both are contiguous
    CPU tensors of one element size (2, 4 or 8 bytes) and `rows * cols` divides their length. False (nothing
    written) where there is no kernel: the caller copies with PyTorch instead."""
    lib = kernel()
    size = src.element_size()
    if lib is None or size not in _FUNCTIONS or dst.element_size() != size or src.numel() != dst.numel():
        return False
    if not (src.is_contiguous() and dst.is_contiguous()) or src.device.type != "cpu" or dst.device.type != "cpu":
        return False
    blocks, rest = divmod(src.numel(), rows * cols)
    if rest:
        raise ValueError(f"transpose_blocks: {src.numel()} elements are not whole [{rows}, {cols}] blocks")
    getattr(lib, _FUNCTIONS[size])(src.data_ptr(), dst.data_ptr(), blocks, rows, cols)
    return True
