"""Decode attention over the persistent rows in one small C kernel (`native_rows`), for CPUs.

Why: a decode step attends a few queries a row (the g query heads of each kv head, or a prompt
chunk's tokens) over that row's keys, a few thousand multiply-adds per (row, kv head). PyTorch's
CPU SDPA kernel runs each of those as small blocked GEMMs with their own set-up, bf16 conversions and
masking passes: on the 2-vCPU AMD EPYC (Zen 4, AVX-512 + bf16) it took 327 us a layer inside the
compiled bf16 decode step of the benchmark's 32 rows (4 kv heads x 2, hd 64, ~90 columns), a quarter
of the step, where streaming those rows from memory once takes ~60 us. This kernel does each
(row, kv head) as one pass over the row: every key and value read once (bf16 widened in registers),
fp32 scores, an online softmax over blocks of 64 columns, fp32 accumulation, one rounding at the end,
and columns the mask hides (-inf) neither read nor multiplied. Rows and heads are split over the
calling thread's OpenMP team (`cbuild`: torch's own libgomp and thread count).

It computes what `attention.sdpa_rows` does, with the same inputs (queries [R, kv, G, hd] over rows
[R, kv, L, hd], an additive mask broadcastable to [R, kv, G, L], strided views as they are), in a
different fp32 summation order and exp (a degree-6 polynomial, ~2 ulp): outputs agree to bf16's
rounding (fp32: ~1e-6). `attention.pick_decode_attention` times it against the others on the
machine and keeps the fastest. In a compiled step it is the opaque op `furlong::attend_rows` (the
kernel call is not traceable); its Python costs a few microseconds a layer.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from furlong.engine import cbuild, eager_ops

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#define BL 64

static inline float bf16_f32(uint16_t x) { uint32_t u = (uint32_t)x << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f32_bf16(float f) {  /* round to nearest even (no NaN reaches here) */
  uint32_t u; memcpy(&u, &f, 4); u += 0x7fffu + ((u >> 16) & 1u); return (uint16_t)(u >> 16); }
static inline float f32_f32(float x) { return x; }
static inline float f32_out(float f) { return f; }

/* 16 floats as one vector (GCC vector extensions: AVX-512 registers, or two AVX2 ones) */
typedef float vf __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
static inline vf ld_bf16(const uint16_t* p) {
  vh h; memcpy(&h, p, 32); vu u = __builtin_convertvector(h, vu) << 16; vf f; memcpy(&f, &u, 64); return f; }
static inline vf ld_f32(const float* p) { vf f; memcpy(&f, p, 64); return f; }
/* the sum of a vector's lanes as a tree (4 shuffles and adds), not a serial chain of 15 scalar adds */
static inline float hsum(vf a) {
  a += __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  a += __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  a += __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  a += __builtin_shufflevector(a, a, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return a[0];
}
/* the lane sums of two vectors at once: the first level merges them into one vector (half of each) */
static inline void hsum2(vf a, vf b, float* sa, float* sb) {
  vf c = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
       + __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  c += __builtin_shufflevector(c, c, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  c += __builtin_shufflevector(c, c, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  c += __builtin_shufflevector(c, c, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  *sa = c[0]; *sb = c[8];
}

/* exp(x) for x <= 0 (scores minus their running max): 2^n * p(r), |r| <= ln2/2, degree-6 polynomial;
   written branch-free so the loops that call it vectorise */
static inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : x;
  float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* round to nearest: 1.5 * 2^23 */
  float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.0f / 720, q;
  p = p * r + 1.0f / 120; p = p * r + 1.0f / 24; p = p * r + 1.0f / 6; p = p * r + 0.5f; p = p * r + 1.0f;
  q = p * r + 1.0f;
  int32_t e = ((int32_t)n + 127) << 23; float s; memcpy(&s, &e, 4);
  return q * s;
}

/* out[r, h, i, :] = softmax(q[r, h, i, :] . k[r, h, l, :] * scale + mask[r, h, i, l]) over l, times v[r, h, l, :].
   st: the strides in elements of q, k, v, mask and out, 4 each (the last dimension of q, k, v and out is
   contiguous; a mask stride is 0 where it broadcasts). A column whose mask is -inf is skipped. */
#define KERNEL(NAME, T, IN, OUT, LD, DC)                                                                              \
void NAME(const T* q, const T* k, const T* v, const T* mask, T* out, long R, long H, long G, long L, long D_,  \
          const long* st, float scale) {                                                                      \
  const long *qs = st, *ks = st + 4, *vs = st + 8, *ms = st + 12, *os = st + 16;                              \
  const long D = DC ? DC : D_;  /* a constant where the variant fixes it: the dot products unroll whole */       \
  _Pragma("omp parallel")                                                                                     \
  {                                                                                                           \
    float* buf = (float*)malloc(sizeof(float) * (size_t)G * (2 * D + BL + 2));                                \
    float *qf = buf, *acc = qf + G * D, *s = acc + G * D, *mx = s + G * BL, *sm = mx + G;                     \
    _Pragma("omp for schedule(static)")                                                                       \
    for (long t = 0; t < R * H; t++) {                                                                        \
      long r = t / H, h = t % H;                                                                              \
      const T* kb = k + r * ks[0] + h * ks[1]; const T* vb = v + r * vs[0] + h * vs[1];                         \
      const T* mb = mask + r * ms[0] + h * ms[1];                                                             \
      for (long i = 0; i < G; i++) {                                                                          \
        const T* qi = q + r * qs[0] + h * qs[1] + i * qs[2];                                                   \
        for (long d = 0; d < D; d++) { qf[i * D + d] = IN(qi[d]) * scale; acc[i * D + d] = 0.0f; }            \
        mx[i] = -INFINITY; sm[i] = 0.0f;                                                                      \
      }                                                                                                       \
      for (long l0 = 0; l0 < L; l0 += BL) {                                                                   \
        long n = L - l0 < BL ? L - l0 : BL;                                                                   \
        for (long j = 0; j < n; j++) {                                                                        \
          const T* kr = kb + (l0 + j) * ks[2];                                                                 \
          if (DC && DC % 16 == 0) {  /* the key row widened once, two queries a pass, tree sums */           \
            /* rows come from memory (a step reads every layer's once): fetch keys 16 columns ahead, and this \
               column's values, which the values pass reads right after this block */                          \
            for (long c = 0; c < DC * (long)sizeof(T); c += 64) {                                             \
              __builtin_prefetch((const char*)(kr + 16 * ks[2]) + c);                                          \
              __builtin_prefetch((const char*)(vb + (l0 + j) * vs[2]) + c); }                                 \
            vf kv[DC / 16 + 1];                                                                               \
            for (long c = 0; c < DC / 16; c++) kv[c] = LD(kr + 16 * c);                                       \
            for (long i = 0; i < G; i += 2) {                                                                 \
              long i1 = i + 1 < G ? i + 1 : i;                                                                \
              float m0 = IN(mb[i * ms[2] + (l0 + j) * ms[3]]), m1 = IN(mb[i1 * ms[2] + (l0 + j) * ms[3]]);     \
              vf a = {0}, b = {0};                                                                            \
              for (long c = 0; c < DC / 16; c++) {                                                            \
                a += ld_f32(qf + i * D + 16 * c) * kv[c]; b += ld_f32(qf + i1 * D + 16 * c) * kv[c]; }        \
              float d0, d1; hsum2(a, b, &d0, &d1);                                                            \
              s[i * BL + j] = m0 == -INFINITY ? -INFINITY : d0 + m0;                                          \
              s[i1 * BL + j] = m1 == -INFINITY ? -INFINITY : d1 + m1;                                         \
            }                                                                                                 \
            continue;                                                                                         \
          }                                                                                                   \
          for (long i = 0; i < G; i++) {                                                                      \
            float m = IN(mb[i * ms[2] + (l0 + j) * ms[3]]);                                                    \
            if (m == -INFINITY) { s[i * BL + j] = -INFINITY; continue; }                                      \
            const float* qi = qf + i * D; float dot = 0.0f;                                                   \
            _Pragma("omp simd reduction(+:dot)")                                                              \
            for (long d = 0; d < D; d++) dot += qi[d] * IN(kr[d]);                                            \
            s[i * BL + j] = dot + m;                                                                          \
          }                                                                                                   \
        }                                                                                                     \
        for (long i = 0; i < G; i++) {                                                                        \
          float* si = s + i * BL; float bm = -INFINITY;                                                       \
          for (long j = 0; j < n; j++) bm = si[j] > bm ? si[j] : bm;                                          \
          if (bm == -INFINITY) continue;                                                                      \
          float nm = bm > mx[i] ? bm : mx[i];                                                                 \
          if (mx[i] != -INFINITY && nm != mx[i]) {                                                            \
            float a = fast_exp(mx[i] - nm); sm[i] *= a;                                                       \
            for (long d = 0; d < D; d++) acc[i * D + d] *= a;                                                 \
          }                                                                                                   \
          mx[i] = nm; float tot = 0.0f;                                                                       \
          _Pragma("omp simd reduction(+:tot)")                                                                \
          for (long j = 0; j < n; j++) { float e = fast_exp(si[j] - nm); e = si[j] == -INFINITY ? 0.0f : e; si[j] = e; tot += e; } \
          sm[i] += tot;                                                                                       \
        }                                                                                                     \
        if (DC && DC % 16 == 0) {  /* two queries' accumulators held in registers over the block */         \
          for (long i = 0; i < G; i += 2) {                                                                   \
            long i1 = i + 1 < G ? i + 1 : i;                                                                  \
            vf a[DC / 16 + 1], b[DC / 16 + 1];                                                                \
            for (long c = 0; c < DC / 16; c++) { a[c] = ld_f32(acc + i * D + 16 * c); b[c] = (vf){0}; }      \
            for (long j = 0; j < n; j++) {                                                                    \
              float p0 = s[i * BL + j], p1 = i1 != i ? s[i1 * BL + j] : 0.0f;                                 \
              p0 = p0 > 0.0f ? p0 : 0.0f; p1 = p1 > 0.0f ? p1 : 0.0f;  /* -inf: a block hidden whole */      \
              if (p0 == 0.0f && p1 == 0.0f) continue;                                                         \
              const T* vr = vb + (l0 + j) * vs[2];                                                             \
              for (long c = 0; c < DC / 16; c++) { vf x = LD(vr + 16 * c); a[c] += p0 * x; b[c] += p1 * x; }  \
            }                                                                                                 \
            for (long c = 0; c < DC / 16; c++) {                                                              \
              memcpy(acc + i * D + 16 * c, &a[c], 64);                                                        \
              if (i1 != i) { vf y = ld_f32(acc + i1 * D + 16 * c) + b[c]; memcpy(acc + i1 * D + 16 * c, &y, 64); } \
            }                                                                                                 \
          }                                                                                                   \
          continue;                                                                                           \
        }                                                                                                     \
        for (long j = 0; j < n; j++) {                                                                        \
          const T* vr = vb + (l0 + j) * vs[2];                                                                 \
          for (long i = 0; i < G; i++) {                                                                      \
            float p = s[i * BL + j]; float* ai = acc + i * D;                                                 \
            if (!(p > 0.0f)) continue;  /* 0, or a block the mask hides whole (-inf) */                                                                    \
            _Pragma("omp simd")                                                                               \
            for (long d = 0; d < D; d++) ai[d] += p * IN(vr[d]);                                              \
          }                                                                                                   \
        }                                                                                                     \
      }                                                                                                       \
      for (long i = 0; i < G; i++) {                                                                          \
        T* oi = out + r * os[0] + h * os[1] + i * os[2]; float inv = sm[i] > 0.0f ? 1.0f / sm[i] : 0.0f;       \
        for (long d = 0; d < D; d++) oi[d] = OUT(acc[i * D + d] * inv);                                       \
      }                                                                                                       \
    }                                                                                                         \
    free(buf);                                                                                                \
  }                                                                                                           \
}
KERNEL(fl_rows_attn_bf16, uint16_t, bf16_f32, f32_bf16, ld_bf16, 0)
KERNEL(fl_rows_attn_f32, float, f32_f32, f32_out, ld_f32, 0)
KERNEL(fl_rows_attn_bf16_64, uint16_t, bf16_f32, f32_bf16, ld_bf16, 64)
KERNEL(fl_rows_attn_f32_64, float, f32_f32, f32_out, ld_f32, 64)
KERNEL(fl_rows_attn_bf16_128, uint16_t, bf16_f32, f32_bf16, ld_bf16, 128)
KERNEL(fl_rows_attn_f32_128, float, f32_f32, f32_out, ld_f32, 128)
"""
_FUNCTIONS = {torch.bfloat16: "fl_rows_attn_bf16", torch.float32: "fl_rows_attn_f32"}
_HEAD_DIMS = (64, 128)  # head dims with a variant of their own (constant D)
MAX_HEAD_DIM = 1024  # a row's scratch is G * (2 * hd + 66) floats, allocated per thread


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled kernel library (None: no compiler, a failed build, `FURLONG_NATIVE_KERNELS=0`)."""
    lib = cbuild.load("rows_attention", SOURCE, ("-fopenmp",))
    if lib is None:
        return None
    ptr, n = ctypes.c_void_p, ctypes.c_long
    strides = ctypes.POINTER(ctypes.c_long)
    for name in (f"{f}{d}" for f in _FUNCTIONS.values() for d in ("", *(f"_{n}" for n in _HEAD_DIMS))):
        getattr(lib, name).argtypes = [ptr] * 5 + [n] * 5 + [strides, ctypes.c_float]
        getattr(lib, name).restype = None
    return lib


def available(dtype: torch.dtype) -> bool:
    """Whether the kernel computes `dtype` on this machine (built, and a dtype it has)."""
    return dtype in _FUNCTIONS and kernel() is not None


def _fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether the kernel takes these inputs: one dtype it has on the CPU, each last dimension of q, k and
    v contiguous, a 4-d mask (the shapes are `attend_rows`'s, as SDPA would need them)."""
    return (
        q.dtype in _FUNCTIONS
        and q.dtype == k.dtype == v.dtype == mask.dtype
        and q.device.type == "cpu"
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        and mask.dim() == 4
        and q.shape[3] <= MAX_HEAD_DIM
    )


def _attend_rows_shape(q, k, v, mask, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@eager_ops.op(
    "attend_rows", "(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor", fake=_attend_rows_shape
)
def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """[R, kv, G, hd] queries over [R, kv, L, hd] rows, additive mask broadcastable to [R, kv, G, L]; SDPA
    where the kernel is missing or cannot take these inputs."""
    lib = kernel()
    if lib is None or not _fits(q, k, v, mask):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).contiguous()
    R, H, G, D = q.shape
    L = k.shape[2]
    out = torch.empty(R, H, G, D, dtype=q.dtype)
    if R * H * G == 0:
        return out
    fn = getattr(lib, _FUNCTIONS[q.dtype] + (f"_{D}" if D in _HEAD_DIMS else ""))
    # Strides as one array: building it is most of this function's own time (~10 us a layer), the kernel's
    # call the rest. A mask dimension of size 1 broadcasts: stride 0.
    mst = (0 if n == 1 else st for n, st in zip(mask.shape, mask.stride()))
    strides = (ctypes.c_long * 20)(*q.stride(), *k.stride(), *v.stride(), *mst, H * G * D, G * D, D, 1)
    fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), mask.data_ptr(), out.data_ptr(), R, H, G, L, D, strides, scale)
    return out


def native_rows(qd: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """`attention.sdpa_rows`'s attention through this kernel (the opaque op, so a compiled step can call it);
    a dtype it lacks goes to SDPA here, a missing kernel or a layout it cannot read inside the op."""
    if qd.dtype in _FUNCTIONS:
        return attend_rows(qd, kd, vd, mask, scale)
    return torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
