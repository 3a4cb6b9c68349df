/* divtrace._native: the CPU fingerprint (scheme lane32-wsum128) and summary statistics in one pass.

   The same numbers as divtrace/trace/fingerprint.py computes with torch ops (the path accelerators and machines
   without a C compiler take); tests check the two against each other and against the plain-Python reference.

   The raw bytes of a tensor, in logical (row-major) order, are cut into lanes of w = 4, 2 or 1 bytes (the
   widest that divides the byte count), each read as a signed little-endian integer x. With the 1024 inner
   weights W_r[j] and the outer weights U_r[b] (odd 64-bit constants, passed in from Python):
       H_r = sum_b U_r[b] * S_r[b],   S_r[b] = sum_j x[1024 b + j] * W_r[j]   (mod 2**64), r = 0, 1.
   A 64x64-bit multiply has no vector instruction before AVX-512, so each weight is split as W = WL + 2**32 WH
   with WL its low half read as a signed int32 (and WH its high half plus WL's sign bit); for any int32 x
       x * W = x * WL + ((x * WH) mod 2**32) << 32   (mod 2**64)
   one signed 32x32->64 multiply and one 32-bit multiply, both vector instructions (pmuldq, pmulld): an AVX2
   kernel on x86-64, and plain C elsewhere. Where AVX-512DQ has the 64x64-bit multiply (vpmullq), a third
   kernel sign-extends each lane to 64 bits and multiplies by W whole. The fastest one the CPU runs is chosen
   at import; all three compute the same hash.

   Non-contiguous tensors are gathered into a small staging buffer (a multiple of every block size), never
   copied whole. The statistics (min, max, sum over finite values, NaN/Inf counts) are taken per block while
   the block is in cache; a tensor with any non-finite value gets a second, exact pass. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 1024
#define STAGE (64 * 1024) /* bytes; a multiple of 4 * BLOCK and of every element size */
#define MAXDIM 64
/* Bytes ahead of the block kernel's loads that it asks the cache for: the next lines into L1, and lines further
   on into L2, which holds more misses in flight. The hardware prefetcher alone kept a tensor streamed from
   memory at ~6 GB/s, one hint 2 KiB ahead into L1 at 8-10 GB/s; these two, 13 GB/s from L3 and 16.5 GB/s from
   memory, near torch.sum's 15 and 20 (AVX-512 kernel, variants interleaved in one process, AMD EPYC; data in
   L2 unchanged at 24 GB/s). The AVX2 kernel, bound by its multiplies at ~13 GB/s, reads the same either way. */
#define PREFETCH_NEAR 512
#define PREFETCH_FAR 8192
/* Helpers are inlined into each ISA's consume_*(), so each copy is compiled for that ISA. */
#define INLINE inline __attribute__((always_inline))
#pragma GCC diagnostic ignored "-Wpsabi" /* 64-byte vector values only pass between always-inlined helpers */

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define DIVTRACE_X86 1
#include <immintrin.h>
#endif

/* A scheme's 2 x 1024 inner weights in the three forms the kernels read: WL/WH for the split multiply, whole for
   vpmullq (AVX-512DQ). WT1: lane32-wsum128 (set from Python); WT2: lane-gsum128-v2 (made here by formula). */
typedef struct {
    int32_t wl[2][BLOCK];
    uint32_t wh[2][BLOCK];
    uint64_t w64[2][BLOCK];
} weights_t;
static weights_t WT1 __attribute__((aligned(64))), WT2 __attribute__((aligned(64)));
static int have_weights = 0;

/* The weights of one block piece starting at inner index j0 (0 for v1; v2 pieces start at any phase). */
typedef struct {
    const int32_t *wl0, *wl1;
    const uint32_t *wh0, *wh1;
    const uint64_t *w0, *w1;
} wptr_t;

static INLINE wptr_t wptr_at(const weights_t *W, size_t j0) {
    wptr_t w = {W->wl[0] + j0, W->wl[1] + j0, W->wh[0] + j0, W->wh[1] + j0, W->w64[0] + j0, W->w64[1] + j0};
    return w;
}

static void split_weight(weights_t *W, int r, int j, uint64_t w) {
    uint32_t lo = (uint32_t)w, hi = (uint32_t)(w >> 32);
    W->wl[r][j] = (int32_t)lo;
    W->wh[r][j] = hi + (lo >> 31); /* WL = lo - 2**32 when lo's top bit is set: carry it into WH */
    W->w64[r][j] = w;
}

enum { ST_NONE = 0, ST_F32 = 1, ST_F64 = 2, ST_F16 = 3, ST_BF16 = 4 };

typedef struct {
    /* hash */
    int lane;              /* bytes per lane (v1) */
    const uint64_t *u0, *u1;
    size_t n_outer, block; /* outer weights available; index of the next block (v1) */
    uint64_t gpos;         /* v2: the global byte position of the next byte consumed */
    int v2;
    uint64_t h0, h1;
    struct runs_s *pair; /* fingerprint2_pair: the global partial taken from the same bytes (else NULL) */
    /* stats */
    int kind, careful;
    double lo, hi, sum;
    int64_t finite, nan, inf;
} state_t;

/* Lanes j..n-1 of a block of 32-bit lanes, plain C: the reference form of the vector kernels, their tail,
   and the whole block on machines without them (compilers vectorize it there). */
static INLINE void block_sums32_tail(const uint8_t *p, size_t j, size_t n, uint64_t *r0, uint64_t *r1, uint32_t *c0,
                                     uint32_t *c1, const wptr_t *w) {
    for (; j < n; j++) {
        int32_t x;
        memcpy(&x, p + 4 * j, 4);
        *r0 += (uint64_t)((int64_t)x * w->wl0[j]);
        *r1 += (uint64_t)((int64_t)x * w->wl1[j]);
        *c0 += (uint32_t)x * w->wh0[j];
        *c1 += (uint32_t)x * w->wh1[j];
    }
}

static INLINE void block_sums32_generic(const uint8_t *p, size_t n, uint64_t *s0, uint64_t *s1, const wptr_t *w) {
    uint64_t r0 = 0, r1 = 0;
    uint32_t c0 = 0, c1 = 0;
    block_sums32_tail(p, 0, n, &r0, &r1, &c0, &c1, w);
    *s0 = r0 + ((uint64_t)c0 << 32);
    *s1 = r1 + ((uint64_t)c1 << 32);
}

static INLINE void block_sums_narrow(const uint8_t *p, size_t n, int lane, uint64_t *s0, uint64_t *s1,
                                     const wptr_t *w) {
    uint64_t a0 = 0, a1 = 0;
    uint32_t b0 = 0, b1 = 0;
    for (size_t j = 0; j < n; j++) {
        int32_t x;
        if (lane == 2) {
            int16_t v;
            memcpy(&v, p + 2 * j, 2);
            x = v;
        } else {
            x = (int8_t)p[j];
        }
        a0 += (uint64_t)((int64_t)x * w->wl0[j]);
        a1 += (uint64_t)((int64_t)x * w->wl1[j]);
        b0 += (uint32_t)x * w->wh0[j];
        b1 += (uint32_t)x * w->wh1[j];
    }
    *s0 = a0 + ((uint64_t)b0 << 32);
    *s1 = a1 + ((uint64_t)b1 << 32);
}

/* Branch-free, so the loops below vectorize: exponent rebias, infinities/NaNs rebiased twice, zero and
   subnormals through one float subtraction (exact). */
static INLINE float half_to_float(uint16_t h) {
    uint32_t o = (uint32_t)(h & 0x7fffu) << 13, e = o & 0x0f800000u, bits;
    uint32_t normal = o + (112u << 23) + (e == 0x0f800000u ? (112u << 23) : 0u);
    float magic, sub;
    uint32_t mbits = 113u << 23, sbits = o + mbits;
    memcpy(&magic, &mbits, 4);
    memcpy(&sub, &sbits, 4);
    sub -= magic;
    memcpy(&bits, &sub, 4);
    bits = (e == 0 ? bits : normal) | ((uint32_t)(h & 0x8000u) << 16);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static INLINE float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static INLINE float elem_as_float(const uint8_t *p, size_t i, int kind) {
    if (kind == ST_F32) {
        float f;
        memcpy(&f, p + 4 * i, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, p + 2 * i, 2);
    return kind == ST_F16 ? half_to_float(h) : bf16_to_float(h);
}

/* Statistics of one block for the generic kernel: min, max and sum. NaNs fall out of the compares and poison
   the sum, and infinities reach min/max: either one sends the tensor to the exact pass. GCC/Clang vector types
   of 16 bytes (wider ones are lowered badly where the target has no such registers), four in flight. */
typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));
typedef uint32_t v4u __attribute__((vector_size(16)));
typedef uint16_t v4h __attribute__((vector_size(8)));
typedef double v2d __attribute__((vector_size(16)));
typedef int64_t v2l __attribute__((vector_size(16)));

static INLINE v4f v4f_min(v4f a, v4f b) { v4i m = a < b; return (v4f)((m & (v4i)a) | (~m & (v4i)b)); }
static INLINE v4f v4f_max(v4f a, v4f b) { v4i m = a > b; return (v4f)((m & (v4i)a) | (~m & (v4i)b)); }
static INLINE v2d v2d_min(v2d a, v2d b) { v2l m = a < b; return (v2d)((m & (v2l)a) | (~m & (v2l)b)); }
static INLINE v2d v2d_max(v2d a, v2d b) { v2l m = a > b; return (v2d)((m & (v2l)a) | (~m & (v2l)b)); }

static INLINE v4f load4_floats(const uint8_t *p, int kind) { /* 4 elements as floats */
    if (kind == ST_F32) {
        v4f x;
        memcpy(&x, p, 16);
        return x;
    }
    v4h h16;
    memcpy(&h16, p, 8);
    v4u h = __builtin_convertvector(h16, v4u);
    if (kind == ST_BF16)
        return (v4f)(h << 16);
    v4u o = (h & 0x7fffu) << 13, e = o & 0x0f800000u; /* half_to_float, lane-wise */
    v4u normal = o + (112u << 23) + ((v4u)(e == 0x0f800000u) & (112u << 23));
    v4f sub = (v4f)(o + (113u << 23)) - (v4f)((v4u){0} + (113u << 23));
    v4u zero_exp = (v4u)(e == 0);
    return (v4f)(((zero_exp & (v4u)sub) | (~zero_exp & normal)) | ((h & 0x8000u) << 16));
}

static INLINE void stats_f_generic(state_t *st, const uint8_t *p, size_t n, int kind) {
    size_t es = kind == ST_F32 ? 4 : 2, i = 0;
    v4f lo[4], hi[4], s[4];
    for (int k = 0; k < 4; k++)
        lo[k] = (v4f){0} + INFINITY, hi[k] = (v4f){0} - INFINITY, s[k] = (v4f){0};
    for (; i + 4 * 4 <= n; i += 4 * 4)
        for (int k = 0; k < 4; k++) {
            v4f x = load4_floats(p + es * (i + 4 * k), kind);
            lo[k] = v4f_min(x, lo[k]), hi[k] = v4f_max(x, hi[k]), s[k] += x;
        }
    double sum = 0.0;
    for (int k = 0; k < 4; k++)
        for (int e = 0; e < 4; e++) {
            st->lo = lo[k][e] < st->lo ? lo[k][e] : st->lo;
            st->hi = hi[k][e] > st->hi ? hi[k][e] : st->hi;
            sum += s[k][e];
        }
    for (; i < n; i++) {
        float x = elem_as_float(p, i, kind);
        st->lo = x < st->lo ? x : st->lo;
        st->hi = x > st->hi ? x : st->hi;
        sum += x;
    }
    st->sum += sum;
}

static INLINE void stats_d_generic(state_t *st, const uint8_t *p, size_t n) {
    size_t i = 0;
    v2d lo[4], hi[4], s[4];
    for (int k = 0; k < 4; k++)
        lo[k] = (v2d){0} + INFINITY, hi[k] = (v2d){0} - INFINITY, s[k] = (v2d){0};
    for (; i + 2 * 4 <= n; i += 2 * 4)
        for (int k = 0; k < 4; k++) {
            v2d x;
            memcpy(&x, p + 8 * (i + 2 * k), 16);
            lo[k] = v2d_min(x, lo[k]), hi[k] = v2d_max(x, hi[k]), s[k] += x;
        }
    double sum = 0.0;
    for (int k = 0; k < 4; k++)
        for (int e = 0; e < 2; e++) {
            st->lo = lo[k][e] < st->lo ? lo[k][e] : st->lo;
            st->hi = hi[k][e] > st->hi ? hi[k][e] : st->hi;
            sum += s[k][e];
        }
    for (; i < n; i++) {
        double x;
        memcpy(&x, p + 8 * i, 8);
        st->lo = x < st->lo ? x : st->lo;
        st->hi = x > st->hi ? x : st->hi;
        sum += x;
    }
    st->sum += sum;
}

static INLINE void stats_fast_generic(state_t *st, const uint8_t *p, size_t nbytes) {
    switch (st->kind) {
    case ST_F64: stats_d_generic(st, p, nbytes / 8); break;
    case ST_F32: stats_f_generic(st, p, nbytes / 4, ST_F32); break;
    case ST_BF16: stats_f_generic(st, p, nbytes / 2, ST_BF16); break;
    case ST_F16: stats_f_generic(st, p, nbytes / 2, ST_F16); break;
    }
}

/* Fold a vector kernel's per-lane min/max/sum (stored to arrays) into the running statistics. */
#define DEFINE_FOLD(NAME, T)                                                                                   \
    static INLINE void NAME(state_t *st, const T *l, const T *h, const T *a, int n) {                          \
        double sum = 0.0;                                                                                      \
        for (int e = 0; e < n; e++) {                                                                          \
            st->lo = l[e] < st->lo ? l[e] : st->lo;                                                            \
            st->hi = h[e] > st->hi ? h[e] : st->hi;                                                            \
            sum += a[e];                                                                                       \
        }                                                                                                      \
        st->sum += sum;                                                                                        \
    }
DEFINE_FOLD(fold_lanes_f, float)
DEFINE_FOLD(fold_lanes_d, double)

#ifdef DIVTRACE_X86
/* The same statistics for the AVX2 kernel, where min/max are single instructions: _mm256_min_ps(x, lo) returns
   lo when x is NaN, as `x < lo ? x : lo` does. */
__attribute__((target("avx2,f16c"))) static INLINE __m256 load_floats_avx2(const uint8_t *p, int kind) {
    if (kind == ST_F32)
        return _mm256_loadu_ps((const float *)p);
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (kind == ST_F16)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

__attribute__((target("avx2,f16c"))) static INLINE void stats_f_avx2(state_t *st, const uint8_t *p, size_t n,
                                                                     int kind) {
    size_t es = kind == ST_F32 ? 4 : 2, i = 0;
    __m256 lo[4], hi[4], s[4];
    for (int k = 0; k < 4; k++)
        lo[k] = _mm256_set1_ps(INFINITY), hi[k] = _mm256_set1_ps(-INFINITY), s[k] = _mm256_setzero_ps();
    for (; i + 32 <= n; i += 32)
        for (int k = 0; k < 4; k++) {
            __m256 x = load_floats_avx2(p + es * (i + 8 * k), kind);
            lo[k] = _mm256_min_ps(x, lo[k]), hi[k] = _mm256_max_ps(x, hi[k]), s[k] = _mm256_add_ps(s[k], x);
        }
    float l[32], h[32], a[32];
    for (int k = 0; k < 4; k++) {
        _mm256_storeu_ps(l + 8 * k, lo[k]);
        _mm256_storeu_ps(h + 8 * k, hi[k]);
        _mm256_storeu_ps(a + 8 * k, s[k]);
    }
    double sum = 0.0;
    for (int e = 0; e < 32; e++) {
        st->lo = l[e] < st->lo ? l[e] : st->lo;
        st->hi = h[e] > st->hi ? h[e] : st->hi;
        sum += a[e];
    }
    for (; i < n; i++) {
        float x = elem_as_float(p, i, kind);
        st->lo = x < st->lo ? x : st->lo;
        st->hi = x > st->hi ? x : st->hi;
        sum += x;
    }
    st->sum += sum;
}

__attribute__((target("avx2"))) static INLINE void stats_d_avx2(state_t *st, const uint8_t *p, size_t n) {
    size_t i = 0;
    __m256d lo[4], hi[4], s[4];
    for (int k = 0; k < 4; k++)
        lo[k] = _mm256_set1_pd(INFINITY), hi[k] = _mm256_set1_pd(-INFINITY), s[k] = _mm256_setzero_pd();
    for (; i + 16 <= n; i += 16)
        for (int k = 0; k < 4; k++) {
            __m256d x = _mm256_loadu_pd((const double *)(p + 8 * (i + 4 * k)));
            lo[k] = _mm256_min_pd(x, lo[k]), hi[k] = _mm256_max_pd(x, hi[k]), s[k] = _mm256_add_pd(s[k], x);
        }
    double l[16], h[16], a[16], sum = 0.0;
    for (int k = 0; k < 4; k++) {
        _mm256_storeu_pd(l + 4 * k, lo[k]);
        _mm256_storeu_pd(h + 4 * k, hi[k]);
        _mm256_storeu_pd(a + 4 * k, s[k]);
    }
    for (int e = 0; e < 16; e++) {
        st->lo = l[e] < st->lo ? l[e] : st->lo;
        st->hi = h[e] > st->hi ? h[e] : st->hi;
        sum += a[e];
    }
    for (; i < n; i++) {
        double x;
        memcpy(&x, p + 8 * i, 8);
        st->lo = x < st->lo ? x : st->lo;
        st->hi = x > st->hi ? x : st->hi;
        sum += x;
    }
    st->sum += sum;
}

__attribute__((target("avx2,f16c"))) static INLINE void stats_fast_avx2(state_t *st, const uint8_t *p,
                                                                        size_t nbytes) {
    switch (st->kind) {
    case ST_F64: stats_d_avx2(st, p, nbytes / 8); break;
    case ST_F32: stats_f_avx2(st, p, nbytes / 4, ST_F32); break;
    case ST_BF16: stats_f_avx2(st, p, nbytes / 2, ST_BF16); break;
    case ST_F16: stats_f_avx2(st, p, nbytes / 2, ST_F16); break;
    }
}

/* One block of 32-bit lanes, hash and statistics from the same loads (the statistics pass over a block in cache
   still cost a quarter of the time). KIND is a constant at each call site, so each dtype gets its own loop. */
__attribute__((target("avx2,f16c"))) static INLINE void block4_avx2_kind(state_t *st, const uint8_t *p, size_t n,
                                                                         uint64_t *s0, uint64_t *s1, int kind,
                                                                         const wptr_t *w) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, b0 = a0, b1 = a0;
    __m256 flo = _mm256_set1_ps(INFINITY), fhi = _mm256_set1_ps(-INFINITY), fs = _mm256_setzero_ps();
    __m256 flo2 = flo, fhi2 = fhi, fs2 = fs;
    __m256d dlo = _mm256_set1_pd(INFINITY), dhi = _mm256_set1_pd(-INFINITY), ds = _mm256_setzero_pd();
    const __m256i high16 = _mm256_set1_epi32((int)0xffff0000u);
    size_t j = 0;
    /* pmuldq reads the low half of each 64-bit lane: the odd lanes' data and weights are shifted down into it.
       Shifting the weights, not loading a second swapped table, and unrolling measured ~15% faster. */
#pragma GCC unroll 4
    for (; j + 8 <= n; j += 8) {
        if ((j & 15) == 0) { /* one cache line per 16 lanes; past the end it is harmless (a hint, never a fault) */
            _mm_prefetch((const char *)(p + 4 * j + PREFETCH_NEAR), _MM_HINT_T0);
            _mm_prefetch((const char *)(p + 4 * j + PREFETCH_FAR), _MM_HINT_T1);
        }
        __m256i x = _mm256_loadu_si256((const __m256i *)(p + 4 * j)), xo = _mm256_srli_epi64(x, 32);
        __m256i w0 = _mm256_loadu_si256((const __m256i *)(w->wl0 + j)),
                w1 = _mm256_loadu_si256((const __m256i *)(w->wl1 + j));
        a0 = _mm256_add_epi64(a0, _mm256_add_epi64(_mm256_mul_epi32(x, w0),
                                                   _mm256_mul_epi32(xo, _mm256_srli_epi64(w0, 32))));
        a1 = _mm256_add_epi64(a1, _mm256_add_epi64(_mm256_mul_epi32(x, w1),
                                                   _mm256_mul_epi32(xo, _mm256_srli_epi64(w1, 32))));
        b0 = _mm256_add_epi32(b0, _mm256_mullo_epi32(x, _mm256_loadu_si256((const __m256i *)(w->wh0 + j))));
        b1 = _mm256_add_epi32(b1, _mm256_mullo_epi32(x, _mm256_loadu_si256((const __m256i *)(w->wh1 + j))));
        if (kind == ST_F32) {
            __m256 f = _mm256_castsi256_ps(x);
            flo = _mm256_min_ps(f, flo), fhi = _mm256_max_ps(f, fhi), fs = _mm256_add_ps(fs, f);
        } else if (kind == ST_BF16 || kind == ST_F16) {
            __m256 f1, f2;
            if (kind == ST_BF16) { /* each lane holds two bf16 values: the low one shifted up, the high one masked */
                f1 = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
                f2 = _mm256_castsi256_ps(_mm256_and_si256(x, high16));
            } else {
                f1 = _mm256_cvtph_ps(_mm256_castsi256_si128(x));
                f2 = _mm256_cvtph_ps(_mm256_extracti128_si256(x, 1));
            }
            flo = _mm256_min_ps(f1, flo), fhi = _mm256_max_ps(f1, fhi), fs = _mm256_add_ps(fs, f1);
            flo2 = _mm256_min_ps(f2, flo2), fhi2 = _mm256_max_ps(f2, fhi2), fs2 = _mm256_add_ps(fs2, f2);
        } else if (kind == ST_F64) {
            __m256d d = _mm256_castsi256_pd(x);
            dlo = _mm256_min_pd(d, dlo), dhi = _mm256_max_pd(d, dhi), ds = _mm256_add_pd(ds, d);
        }
    }
    uint64_t ra[4], rb[4];
    uint32_t ca[8], cb[8];
    _mm256_storeu_si256((__m256i *)ra, a0);
    _mm256_storeu_si256((__m256i *)rb, a1);
    _mm256_storeu_si256((__m256i *)ca, b0);
    _mm256_storeu_si256((__m256i *)cb, b1);
    uint64_t r0 = ra[0] + ra[1] + ra[2] + ra[3], r1 = rb[0] + rb[1] + rb[2] + rb[3];
    uint32_t c0 = 0, c1 = 0;
    for (int k = 0; k < 8; k++)
        c0 += ca[k], c1 += cb[k];
    block_sums32_tail(p, j, n, &r0, &r1, &c0, &c1, w);
    *s0 = r0 + ((uint64_t)c0 << 32);
    *s1 = r1 + ((uint64_t)c1 << 32);
    if (kind == ST_NONE)
        return;
    if (kind == ST_F64) {
        double l[4], h[4], a[4];
        _mm256_storeu_pd(l, dlo), _mm256_storeu_pd(h, dhi), _mm256_storeu_pd(a, ds);
        fold_lanes_d(st, l, h, a, 4);
    } else {
        float l[16], h[16], a[16];
        _mm256_storeu_ps(l, flo), _mm256_storeu_ps(h, fhi), _mm256_storeu_ps(a, fs);
        _mm256_storeu_ps(l + 8, flo2), _mm256_storeu_ps(h + 8, fhi2), _mm256_storeu_ps(a + 8, fs2);
        fold_lanes_f(st, l, h, a, kind == ST_F32 ? 8 : 16);
    }
    if (j < n) /* the last few lanes of a tensor: their elements, one by one */
        stats_fast_generic(st, p + 4 * j, 4 * (n - j));
}

__attribute__((target("avx2,f16c"))) static INLINE void block4_avx2(state_t *st, const uint8_t *p, size_t n,
                                                                    uint64_t *s0, uint64_t *s1, const wptr_t *w) {
    switch (st->kind) {
    case ST_F32: block4_avx2_kind(st, p, n, s0, s1, ST_F32, w); break;
    case ST_BF16: block4_avx2_kind(st, p, n, s0, s1, ST_BF16, w); break;
    case ST_F16: block4_avx2_kind(st, p, n, s0, s1, ST_F16, w); break;
    case ST_F64: block4_avx2_kind(st, p, n, s0, s1, ST_F64, w); break;
    default: block4_avx2_kind(st, p, n, s0, s1, ST_NONE, w);
    }
}

/* AVX-512: 16 lanes per step, each sign-extended to 64 bits and multiplied by its whole weight (vpmullq), so
   x * W needs one multiply per row instead of three. On the project's AMD EPYC (Zen 4) 25 GB/s from cache
   against the AVX2 kernel's 15-20; an AVX-512 port of the AVX2 kernel's split multiplies was slower than AVX2. */
#define AVX512_TARGET __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,f16c")))
AVX512_TARGET static INLINE void block4_avx512_kind(state_t *st, const uint8_t *p, size_t n, uint64_t *s0,
                                                    uint64_t *s1, int kind, const wptr_t *w) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, b0 = a0, b1 = a0;
    __m512 flo = _mm512_set1_ps(INFINITY), fhi = _mm512_set1_ps(-INFINITY), fs = _mm512_setzero_ps();
    __m512 flo2 = flo, fhi2 = fhi, fs2 = fs;
    __m512d dlo = _mm512_set1_pd(INFINITY), dhi = _mm512_set1_pd(-INFINITY), ds = _mm512_setzero_pd();
    const __m512i high16 = _mm512_set1_epi32((int)0xffff0000u);
    size_t j = 0;
#pragma GCC unroll 2
    for (; j + 16 <= n; j += 16) {
        _mm_prefetch((const char *)(p + 4 * j + PREFETCH_NEAR), _MM_HINT_T0);
        _mm_prefetch((const char *)(p + 4 * j + PREFETCH_FAR), _MM_HINT_T1);
        __m512i x = _mm512_loadu_si512((const void *)(p + 4 * j));
        __m512i xl = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(x));
        __m512i xh = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(x, 1));
        a0 = _mm512_add_epi64(a0, _mm512_mullo_epi64(xl, _mm512_loadu_si512((const void *)(w->w0 + j))));
        b0 = _mm512_add_epi64(b0, _mm512_mullo_epi64(xh, _mm512_loadu_si512((const void *)(w->w0 + j + 8))));
        a1 = _mm512_add_epi64(a1, _mm512_mullo_epi64(xl, _mm512_loadu_si512((const void *)(w->w1 + j))));
        b1 = _mm512_add_epi64(b1, _mm512_mullo_epi64(xh, _mm512_loadu_si512((const void *)(w->w1 + j + 8))));
        /* min/max return their second operand when the first is NaN, as the AVX2 kernel's do */
        if (kind == ST_F32) {
            __m512 f = _mm512_castsi512_ps(x);
            flo = _mm512_min_ps(f, flo), fhi = _mm512_max_ps(f, fhi), fs = _mm512_add_ps(fs, f);
        } else if (kind == ST_BF16 || kind == ST_F16) {
            __m512 f1, f2;
            if (kind == ST_BF16) {
                f1 = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
                f2 = _mm512_castsi512_ps(_mm512_and_si512(x, high16));
            } else {
                f1 = _mm512_cvtph_ps(_mm512_castsi512_si256(x));
                f2 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(x, 1));
            }
            flo = _mm512_min_ps(f1, flo), fhi = _mm512_max_ps(f1, fhi), fs = _mm512_add_ps(fs, f1);
            flo2 = _mm512_min_ps(f2, flo2), fhi2 = _mm512_max_ps(f2, fhi2), fs2 = _mm512_add_ps(fs2, f2);
        } else if (kind == ST_F64) {
            __m512d d = _mm512_castsi512_pd(x);
            dlo = _mm512_min_pd(d, dlo), dhi = _mm512_max_pd(d, dhi), ds = _mm512_add_pd(ds, d);
        }
    }
    uint64_t r0 = (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(a0, b0));
    uint64_t r1 = (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(a1, b1));
    uint32_t c0 = 0, c1 = 0;
    block_sums32_tail(p, j, n, &r0, &r1, &c0, &c1, w);
    *s0 = r0 + ((uint64_t)c0 << 32);
    *s1 = r1 + ((uint64_t)c1 << 32);
    if (kind == ST_NONE)
        return;
    if (kind == ST_F64) {
        double l[8], h[8], a[8];
        _mm512_storeu_pd(l, dlo), _mm512_storeu_pd(h, dhi), _mm512_storeu_pd(a, ds);
        fold_lanes_d(st, l, h, a, 8);
    } else {
        float l[32], h[32], a[32];
        _mm512_storeu_ps(l, flo), _mm512_storeu_ps(h, fhi), _mm512_storeu_ps(a, fs);
        _mm512_storeu_ps(l + 16, flo2), _mm512_storeu_ps(h + 16, fhi2), _mm512_storeu_ps(a + 16, fs2);
        fold_lanes_f(st, l, h, a, kind == ST_F32 ? 16 : 32);
    }
    if (j < n) /* the last few lanes of a tensor: their elements, one by one */
        stats_fast_generic(st, p + 4 * j, 4 * (n - j));
}

AVX512_TARGET static INLINE void block4_avx512(state_t *st, const uint8_t *p, size_t n, uint64_t *s0,
                                               uint64_t *s1, const wptr_t *w) {
    switch (st->kind) {
    case ST_F32: block4_avx512_kind(st, p, n, s0, s1, ST_F32, w); break;
    case ST_BF16: block4_avx512_kind(st, p, n, s0, s1, ST_BF16, w); break;
    case ST_F16: block4_avx512_kind(st, p, n, s0, s1, ST_F16, w); break;
    case ST_F64: block4_avx512_kind(st, p, n, s0, s1, ST_F64, w); break;
    default: block4_avx512_kind(st, p, n, s0, s1, ST_NONE, w);
    }
}
#endif

static void stats_exact(state_t *st, const uint8_t *p, size_t nbytes) {
    size_t es = st->kind == ST_F64 ? 8 : st->kind == ST_F32 ? 4 : 2, n = nbytes / es;
    for (size_t i = 0; i < n; i++) {
        double x;
        if (st->kind == ST_F64)
            memcpy(&x, p + 8 * i, 8);
        else
            x = elem_as_float(p, i, st->kind);
        if (isnan(x))
            st->nan++;
        else if (isinf(x))
            st->inf++;
        else {
            st->lo = x < st->lo ? x : st->lo;
            st->hi = x > st->hi ? x : st->hi;
            st->sum += x;
            st->finite++;
        }
    }
}

static INLINE void block4_generic(state_t *st, const uint8_t *p, size_t n, uint64_t *s0, uint64_t *s1,
                                  const wptr_t *w) {
    block_sums32_generic(p, n, s0, s1, w);
    if (st->kind != ST_NONE)
        stats_fast_generic(st, p, 4 * n);
}

/* Consume bytes of the logical stream: whole blocks, and a partial one only at the very end. One copy per
   ISA, each with its own block kernel and the statistics compiled for that ISA. */
#define DEFINE_CONSUME(NAME, ATTR, BLOCK4, STATS)                                                                  \
    ATTR static void NAME(state_t *st, const uint8_t *p, size_t nbytes) {                                     \
        size_t bbytes = (size_t)BLOCK * st->lane;                                                              \
        const wptr_t w = wptr_at(&WT1, 0);                                                                     \
        while (nbytes) {                                                                                       \
            size_t take = nbytes < bbytes ? nbytes : bbytes, n = take / st->lane;                              \
            uint64_t s0, s1;                                                                                   \
            if (st->lane == 4) {                                                                               \
                BLOCK4(st, p, n, &s0, &s1, &w);                                                                \
            } else {                                                                                           \
                block_sums_narrow(p, n, st->lane, &s0, &s1, &w);                                               \
                if (st->kind != ST_NONE)                                                                       \
                    STATS(st, p, take);                                                                        \
            }                                                                                                  \
            st->h0 += s0 * st->u0[st->block];                                                                  \
            st->h1 += s1 * st->u1[st->block];                                                                  \
            st->block++;                                                                                       \
            p += take;                                                                                         \
            nbytes -= take;                                                                                    \
        }                                                                                                      \
    }



/* ---- lane-gsum128-v2 (divtrace/hashing, docs/trace-format.md "Fingerprint schemes") ----
   Lanes are always 4 bytes, numbered by their position in the GLOBAL (unsharded) logical byte stream, so a shard
   adds its bytes at their global positions: a lane the shard holds only part of counts as the int32 of its bytes
   with the others zero ("masked"), and the masked parts of a lane held by several shards sum to the lane (their
   bits are disjoint and exactly one part holds bit 31). Weights: W_r(i) = w_r[i mod 1024] * u_r[i div 1024], with
   w and u splitmix64 streams (made here and in Python by the same formula, not stored). */
#define GOLDEN 0x9E3779B97F4A7C15ULL
static const uint64_t SEED_W[2] = {0x5EED0, 0x5EED1}, SEED_U[2] = {0xB10C0, 0xB10C1};

static INLINE uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static INLINE uint64_t outer2(int r, uint64_t q) { return mix64(SEED_U[r] + (q + 1) * GOLDEN) | 1; }

static void make_weights_v2(void) {
    for (int r = 0; r < 2; r++)
        for (int j = 0; j < BLOCK; j++)
            split_weight(&WT2, r, j, mix64(SEED_W[r] + (uint64_t)(j + 1) * GOLDEN) | 1);
}

/* k bytes that sit at byte positions ph..ph+k-1 of their lane, the lane's other bytes zero, as an int32. */
static INLINE int32_t masked_lane(const uint8_t *p, size_t k, size_t ph) {
    uint32_t v = 0;
    for (size_t b = 0; b < k; b++)
        v |= (uint32_t)p[b] << (8 * (ph + b));
    return (int32_t)v;
}

/* Consume bytes at global byte position st->gpos: a lane cut by the start or end of the bytes as its masked
   part; whole lanes in pieces that end at block boundaries, each through the block kernel at its phase. Any cut
   of the stream gives the same sums (linearity), so staging chunks and runs need no alignment. */
#define DEFINE_CONSUME2(NAME, ATTR, BLOCK4, STATS)                                                                \
    ATTR static void NAME(state_t *st, const uint8_t *p, size_t nbytes) {                                     \
        while (nbytes) {                                                                                       \
            uint64_t lane = st->gpos >> 2;                                                                     \
            size_t ph = (size_t)(st->gpos & 3), take;                                                          \
            if (ph || nbytes < 4) {                                                                            \
                take = 4 - ph < nbytes ? 4 - ph : nbytes;                                                      \
                uint64_t x = (uint64_t)(int64_t)masked_lane(p, take, ph);                                      \
                size_t j = (size_t)(lane % BLOCK);                                                             \
                st->h0 += x * WT2.w64[0][j] * outer2(0, lane / BLOCK);                                         \
                st->h1 += x * WT2.w64[1][j] * outer2(1, lane / BLOCK);                                         \
                if (st->kind != ST_NONE)                                                                       \
                    STATS(st, p, take);                                                                        \
            } else {                                                                                           \
                size_t j0 = (size_t)(lane % BLOCK), n = BLOCK - j0;                                            \
                if (n > nbytes / 4)                                                                            \
                    n = nbytes / 4;                                                                            \
                const wptr_t w = wptr_at(&WT2, j0);                                                            \
                uint64_t s0, s1;                                                                               \
                BLOCK4(st, p, n, &s0, &s1, &w);                                                                \
                st->h0 += s0 * outer2(0, lane / BLOCK);                                                        \
                st->h1 += s1 * outer2(1, lane / BLOCK);                                                        \
                take = 4 * n;                                                                                  \
            }                                                                                                  \
            p += take, st->gpos += take, nbytes -= take;                                                       \
        }                                                                                                      \
    }

/* Both schemes' consumers for each ISA. */
#define DEFINE_CONSUMERS(ISA, ATTR, BLOCK4, STATS)                                                               \
    DEFINE_CONSUME(consume_##ISA, ATTR, BLOCK4, STATS)                                                         \
    DEFINE_CONSUME2(consume2_##ISA, ATTR, BLOCK4, STATS)
DEFINE_CONSUMERS(generic, , block4_generic, stats_fast_generic)
#ifdef DIVTRACE_X86
DEFINE_CONSUMERS(avx2, __attribute__((target("avx2,f16c"))), block4_avx2, stats_fast_avx2)
DEFINE_CONSUMERS(avx512, AVX512_TARGET, block4_avx512, stats_fast_avx2)
#endif

/* ---- row-gsum64-v2: one 64-bit sum per token row, sum_c rotl32(lane_c, 1) * W_0(c) (mod 2**64), lanes numbered
   from the row's first byte in its global (unsharded) row. The rotation puts each lane's bit 31 (the sign of an
   fp32, of the odd bf16 of a pair, of an fp64's high half) at bit 0: a difference made only of sign flips then
   has odd lane differences, which one 64-bit sum sees like any other (without it, 2**31 * (sum of the weights)). */
static INLINE uint32_t rotl1(uint32_t x) { return (x << 1) | (x >> 31); }

static uint64_t rowsum_generic(const uint8_t *p, size_t n, const wptr_t *w) {
    uint64_t s = 0;
    for (size_t j = 0; j < n; j++) {
        uint32_t x;
        memcpy(&x, p + 4 * j, 4);
        s += (uint64_t)(int64_t)(int32_t)rotl1(x) * w->w0[j];
    }
    return s;
}

#ifdef DIVTRACE_X86
/* pmuldq multiplies the low halves of 64-bit slots: the odd lanes' data are shifted down into them, and their
   weights loaded one lane later (the table goes on past any piece: the next row or table of weights_t). */
__attribute__((target("avx2"))) static INLINE void rowsum8_avx2(const uint8_t *p, const wptr_t *w, size_t j, __m256i *a,
                                                               __m256i *c) {
    __m256i x = _mm256_loadu_si256((const __m256i *)(p + 4 * j));
    x = _mm256_or_si256(_mm256_slli_epi32(x, 1), _mm256_srli_epi32(x, 31));
    __m256i even = _mm256_mul_epi32(x, _mm256_loadu_si256((const __m256i *)(w->wl0 + j)));
    __m256i odd = _mm256_mul_epi32(_mm256_srli_epi64(x, 32), _mm256_loadu_si256((const __m256i *)(w->wl0 + j + 1)));
    *a = _mm256_add_epi64(*a, _mm256_add_epi64(even, odd));
    *c = _mm256_add_epi32(*c, _mm256_mullo_epi32(x, _mm256_loadu_si256((const __m256i *)(w->wh0 + j))));
}

__attribute__((target("avx2"))) static uint64_t rowsum_avx2(const uint8_t *p, size_t n, const wptr_t *w) {
    __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
    size_t j = 0;
    for (; j + 16 <= n; j += 16) {
        rowsum8_avx2(p, w, j, &a, &c);
        rowsum8_avx2(p, w, j + 8, &b, &d);
    }
    if (j + 8 <= n)
        rowsum8_avx2(p, w, j, &a, &c), j += 8;
    uint64_t ra[4];
    uint32_t ca[8];
    _mm256_storeu_si256((__m256i *)ra, _mm256_add_epi64(a, b));
    _mm256_storeu_si256((__m256i *)ca, _mm256_add_epi32(c, d));
    uint64_t r = ra[0] + ra[1] + ra[2] + ra[3];
    uint32_t hi = 0;
    for (int k = 0; k < 8; k++)
        hi += ca[k];
    for (; j < n; j++) {
        uint32_t x;
        memcpy(&x, p + 4 * j, 4);
        x = rotl1(x);
        r += (uint64_t)((int64_t)(int32_t)x * w->wl0[j]);
        hi += x * w->wh0[j];
    }
    return r + ((uint64_t)hi << 32);
}

AVX512_TARGET static uint64_t rowsum_avx512(const uint8_t *p, size_t n, const wptr_t *w) {
    __m512i a = _mm512_setzero_si512(), b = a;
    size_t j = 0;
    for (; j + 16 <= n; j += 16) {
        __m512i x = _mm512_rol_epi32(_mm512_loadu_si512((const void *)(p + 4 * j)), 1);
        __m512i xl = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(x));
        __m512i xh = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(x, 1));
        a = _mm512_add_epi64(a, _mm512_mullo_epi64(xl, _mm512_loadu_si512((const void *)(w->w0 + j))));
        b = _mm512_add_epi64(b, _mm512_mullo_epi64(xh, _mm512_loadu_si512((const void *)(w->w0 + j + 8))));
    }
    uint64_t s = (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(a, b));
    wptr_t rest = *w;
    rest.w0 += j;
    return s + rowsum_generic(p + 4 * j, n - j, &rest);
}
#endif

typedef uint64_t (*rowsum_fn)(const uint8_t *, size_t, const wptr_t *);
static rowsum_fn rowsum_fast = rowsum_generic;

/* One row's (or one run's) sum for nbytes at global row byte position g. */
static uint64_t row_segment(const uint8_t *p, size_t nbytes, uint64_t g) {
    uint64_t h = 0;
    while (nbytes) {
        uint64_t lane = g >> 2;
        size_t ph = (size_t)(g & 3), take;
        if (ph || nbytes < 4) {
            take = 4 - ph < nbytes ? 4 - ph : nbytes;
            uint32_t v = (uint32_t)masked_lane(p, take, ph);
            h += (uint64_t)(int64_t)(int32_t)rotl1(v) * WT2.w64[0][lane % BLOCK] * outer2(0, lane / BLOCK);
        } else {
            size_t j0 = (size_t)(lane % BLOCK), n = BLOCK - j0;
            if (n > nbytes / 4)
                n = nbytes / 4;
            const wptr_t w = wptr_at(&WT2, j0);
            h += rowsum_fast(p, n, &w) * outer2(0, lane / BLOCK);
            take = 4 * n;
        }
        p += take, g += take, nbytes -= take;
    }
    return h;
}

typedef void (*consume_fn)(state_t *, const uint8_t *, size_t);
static consume_fn consume_fast = consume_generic, consume2_fast = consume2_generic;
static const char *isa = "generic";

/* fingerprint2_pair: a block's bytes, in its local logical order, cut into the runs it holds of its global value:
   each index of the outer dims (lexicographic) is the next run_bytes of the local stream, at global element
   gbase + sum idx * gstride. */
typedef struct runs_s {
    state_t *st; /* the global partial's state (no statistics) */
    int k;
    int64_t size[MAXDIM], gstride[MAXDIM], idx[MAXDIM], gbase;
    uint64_t run_bytes, left;
    size_t es;
} runs_t;

static void runs_consume(runs_t *R, const uint8_t *p, size_t nbytes) {
    while (nbytes) {
        if (!R->left) { /* the next run: its global position, and the outer index moved on */
            int64_t g = R->gbase;
            for (int d = 0; d < R->k; d++)
                g += R->idx[d] * R->gstride[d];
            R->st->gpos = (uint64_t)g * R->es;
            R->left = R->run_bytes;
            int d = R->k - 1;
            while (d >= 0 && ++R->idx[d] == R->size[d])
                R->idx[d--] = 0;
        }
        size_t take = R->left < nbytes ? (size_t)R->left : nbytes;
        consume2_fast(R->st, p, take);
        p += take, nbytes -= take, R->left -= take;
    }
}

/* Both sums from each piece while it is in L1: the whole value's (with the statistics) and the global partial's.
   Pieces end at multiples of PAIR_PIECE bytes of the local stream (a multiple of a block's 4 KiB), where the
   local kernel cuts its blocks anyway: it makes the same block calls, so the same statistics, as
   fingerprint2_summary over the whole value. */
#define PAIR_PIECE (16 * 1024)
static void consume_pair(state_t *st, const uint8_t *p, size_t nbytes) {
    while (nbytes) {
        size_t take = PAIR_PIECE - (size_t)(st->gpos % PAIR_PIECE);
        if (take > nbytes)
            take = nbytes;
        consume2_fast(st, p, take);
        runs_consume(st->pair, p, take);
        p += take, nbytes -= take;
    }
}

static void consume(state_t *st, const uint8_t *p, size_t nbytes) {
    if (st->careful) /* (the exact statistics' second pass: the sums, the pair's too, are taken) */
        stats_exact(st, p, nbytes);
    else if (st->pair)
        consume_pair(st, p, nbytes);
    else if (st->v2)
        consume2_fast(st, p, nbytes);
    else
        consume_fast(st, p, nbytes);
}

/* The fastest kernel this CPU runs, or the one asked for (tests run every kernel against the reference). */
static int select_isa(const char *want) {
#ifdef DIVTRACE_X86
    __builtin_cpu_init();
    if ((!want || !strcmp(want, "avx512")) && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
        consume_fast = consume_avx512, consume2_fast = consume2_avx512, rowsum_fast = rowsum_avx512;
        isa = "avx512";
        return 0;
    }
    if ((!want || !strcmp(want, "avx2")) && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
        consume_fast = consume_avx2, consume2_fast = consume2_avx2, rowsum_fast = rowsum_avx2, isa = "avx2";
        return 0;
    }
#endif
    if (!want || !strcmp(want, "generic")) {
        consume_fast = consume_generic, consume2_fast = consume2_generic, rowsum_fast = rowsum_generic;
        isa = "generic";
        return 0;
    }
    return -1;
}

typedef struct {
    const uint8_t *base;
    size_t es;
    int nd;
    int64_t size[MAXDIM], stride[MAXDIM]; /* stride in bytes, dims of size 1 dropped, contiguous dims merged */
} layout_t;

static void walk(state_t *st, const layout_t *L, uint8_t *stage) {
    if (L->nd == 0 || (L->nd == 1 && L->stride[0] == (int64_t)L->es)) {
        consume(st, L->base, (L->nd ? (size_t)L->size[0] : 1) * L->es);
        return;
    }
    int outer = L->nd - 1;
    int64_t idx[MAXDIM] = {0};
    int64_t n = L->size[outer], sb = L->stride[outer];
    size_t es = L->es, fill = 0;
    for (;;) {
        const uint8_t *row = L->base;
        for (int d = 0; d < outer; d++)
            row += idx[d] * L->stride[d];
        if (sb == (int64_t)es) {
            size_t left = (size_t)n * es;
            while (left) {
                size_t take = STAGE - fill < left ? STAGE - fill : left;
                memcpy(stage + fill, row, take);
                row += take, left -= take, fill += take;
                if (fill == STAGE)
                    consume(st, stage, fill), fill = 0;
            }
        } else {
            for (int64_t i = 0; i < n; i++) {
                const uint8_t *src = row + i * sb;
                switch (es) {
                case 4: memcpy(stage + fill, src, 4); break;
                case 2: memcpy(stage + fill, src, 2); break;
                case 8: memcpy(stage + fill, src, 8); break;
                case 1: stage[fill] = *src; break;
                default: memcpy(stage + fill, src, es);
                }
                fill += es;
                if (fill == STAGE)
                    consume(st, stage, fill), fill = 0;
            }
        }
        int d = outer - 1;
        while (d >= 0 && ++idx[d] == L->size[d])
            idx[d--] = 0;
        if (d < 0)
            break;
    }
    if (fill)
        consume(st, stage, fill);
}

static int read_int64_seq(PyObject *seq, int64_t *out, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(seq, i);
        long long v = PyLong_AsLongLong(o);
        if (v == -1 && PyErr_Occurred())
            return -1;
        out[i] = v;
    }
    return 0;
}

/* The sequence `seq` of exactly n non-negative ints into out[]: 0, or -1 with an exception set. */
static int read_dims(PyObject *seq, int64_t *out, Py_ssize_t n, const char *what) {
    PyObject *f = PySequence_Fast(seq, what);
    if (!f)
        return -1;
    int bad = PySequence_Fast_GET_SIZE(f) != n ? 1 : read_int64_seq(f, out, n) ? -1 : 0;
    Py_DECREF(f);
    for (Py_ssize_t d = 0; !bad && d < n; d++)
        bad = out[d] < 0;
    if (bad == 1)
        PyErr_Format(PyExc_ValueError, "%s: unsupported layout (length or a negative entry)", what);
    return bad ? -1 : 0;
}

/* shape and strides of a call: nd, or -1 with an exception set. */
static Py_ssize_t read_shape(PyObject *shape, PyObject *strides, Py_ssize_t es, int64_t *size, int64_t *stride) {
    Py_ssize_t nd = PySequence_Size(shape);
    if (nd < 0)
        return -1;
    if (nd > MAXDIM || es <= 0) {
        PyErr_SetString(PyExc_ValueError, "unsupported layout");
        return -1;
    }
    if (read_dims(shape, size, nd, "shape") || read_dims(strides, stride, nd, "strides"))
        return -1;
    return nd;
}

/* Append a dim (stride in bytes) to a layout, merged with the one before it where they are contiguous. */
static void layout_add(layout_t *L, int64_t size, int64_t sb) {
    if (size == 1)
        return;
    if (L->nd && L->stride[L->nd - 1] == sb * size) {
        L->size[L->nd - 1] *= size;
        L->stride[L->nd - 1] = sb;
    } else {
        L->size[L->nd] = size, L->stride[L->nd] = sb, L->nd++;
    }
}

/* v2 runs: the outer dims (sizes, local byte strides, global element strides) whose every index gives one run of
   the inner layout, at global element gbase + sum idx * gstride. v1 has none (one run). */
typedef struct {
    int nd;
    int64_t size[MAXDIM], lstride[MAXDIM], gstride[MAXDIM], gbase;
} outer_t;

static void walk_runs(state_t *st, const layout_t *L, const outer_t *O, uint8_t *stage) {
    int64_t idx[MAXDIM] = {0};
    layout_t R = *L;
    for (;;) {
        int64_t loff = 0, g = O->gbase;
        for (int d = 0; d < O->nd; d++)
            loff += idx[d] * O->lstride[d], g += idx[d] * O->gstride[d];
        R.base = L->base + loff;
        st->gpos = (uint64_t)g * L->es;
        walk(st, &R, stage);
        int d = O->nd - 1;
        while (d >= 0 && ++idx[d] == O->size[d])
            idx[d--] = 0;
        if (d < 0)
            break;
    }
}

/* Run the kernel over every run into *st (initialized by the caller): 1, or -1 with an exception set. */
static int execute(state_t *st, const layout_t *L, const outer_t *O, uint64_t numel) {
    st->lo = INFINITY, st->hi = -INFINITY;
    uint8_t *stage = NULL;
    if (!(L->nd == 0 || (L->nd == 1 && L->stride[0] == (int64_t)L->es))) {
        stage = (uint8_t *)malloc(STAGE);
        if (!stage)
            return PyErr_NoMemory(), -1;
    }
    Py_BEGIN_ALLOW_THREADS
    walk_runs(st, L, O, stage);
    if (st->kind != ST_NONE) {
        if (isfinite(st->lo) && isfinite(st->hi) && isfinite(st->sum)) {
            st->finite = (int64_t)numel;
        } else { /* a NaN or an infinity (or a float sum that overflowed): count exactly */
            st->careful = 1;
            st->lo = INFINITY, st->hi = -INFINITY, st->sum = 0.0;
            walk_runs(st, L, O, stage);
        }
    }
    Py_END_ALLOW_THREADS
    free(stage);
    return 1;
}

static PyObject *py_set_weights(PyObject *self, PyObject *args) {
    unsigned long long ptr;
    if (!PyArg_ParseTuple(args, "K", &ptr))
        return NULL;
    const uint64_t *w = (const uint64_t *)(uintptr_t)ptr; /* int64 tensor (2, BLOCK), contiguous */
    for (int r = 0; r < 2; r++)
        for (int j = 0; j < BLOCK; j++)
            split_weight(&WT1, r, j, w[r * BLOCK + j]);
    have_weights = 1;
    Py_RETURN_NONE;
}

/* The arguments of fingerprint() and fingerprint_summary() (lane32-wsum128), run through the kernel into *st: 1,
   or 0 when there are no bytes (*st untouched), or -1 with an exception set. */
static int run_kernel(PyObject *args, state_t *st) {
    unsigned long long ptr, optr;
    Py_ssize_t es, orow, olen;
    int kind;
    PyObject *shape, *strides;
    int64_t size[MAXDIM], stride[MAXDIM];
    if (!PyArg_ParseTuple(args, "KnOOKnni", &ptr, &es, &shape, &strides, &optr, &orow, &olen, &kind))
        return -1;
    if (!have_weights) {
        PyErr_SetString(PyExc_RuntimeError, "set_weights() was not called");
        return -1;
    }
    Py_ssize_t nd = read_shape(shape, strides, es, size, stride);
    if (nd < 0)
        return -1;
    layout_t L = {(const uint8_t *)(uintptr_t)ptr, (size_t)es, 0, {0}, {0}};
    uint64_t numel = 1;
    for (Py_ssize_t d = 0; d < nd; d++) {
        numel *= (uint64_t)size[d];
        layout_add(&L, size[d], stride[d] * es);
    }
    if (numel == 0)
        return 0;
    uint64_t nbytes = numel * (uint64_t)es;
    memset(st, 0, sizeof *st);
    st->lane = nbytes % 4 == 0 ? 4 : nbytes % 2 == 0 ? 2 : 1;
    uint64_t blocks = (nbytes / st->lane + BLOCK - 1) / BLOCK;
    if ((uint64_t)olen < blocks) {
        PyErr_SetString(PyExc_ValueError, "not enough outer weights");
        return -1;
    }
    st->u0 = (const uint64_t *)(uintptr_t)optr;
    st->u1 = st->u0 + orow;
    st->n_outer = (size_t)olen;
    st->kind = kind;
    outer_t O = {0};
    return execute(st, &L, &O, numel);
}

/* The arguments of fingerprint2(), fingerprint2_summary() and fingerprint2_pair() (lane-gsum128-v2): ptr, elem_size,
   shape, strides (the local tensor, strides in elements), gbase and gstrides (global element index of element
   (0, ..., 0) and of one step along each dim; None: the tensor is the whole value, row-major), stats_kind. */
typedef struct {
    const uint8_t *ptr;
    size_t es;
    int n, kind; /* n: dims left once those of size 1 are dropped */
    int64_t size[MAXDIM], stride[MAXDIM], gstride[MAXDIM], gbase;
    uint64_t numel;
} args2_t;

/* Parse them into *a: 1, 0 (no bytes) or -1 with an exception set. */
static int parse2(PyObject *args, args2_t *a) {
    unsigned long long ptr;
    Py_ssize_t es;
    long long gbase;
    int kind;
    PyObject *shape, *strides, *gstrides_arg;
    if (!PyArg_ParseTuple(args, "KnOOLOi", &ptr, &es, &shape, &strides, &gbase, &gstrides_arg, &kind))
        return -1;
    Py_ssize_t nd = read_shape(shape, strides, es, a->size, a->stride);
    if (nd < 0)
        return -1;
    uint64_t numel = 1;
    for (Py_ssize_t d = 0; d < nd; d++)
        numel *= (uint64_t)a->size[d];
    if (gstrides_arg == Py_None) {
        int64_t g = 1;
        for (Py_ssize_t d = nd - 1; d >= 0; d--)
            a->gstride[d] = g, g *= a->size[d];
    } else if (read_dims(gstrides_arg, a->gstride, nd, "gstrides")) {
        return -1;
    }
    if (gbase < 0) {
        PyErr_SetString(PyExc_ValueError, "gbase < 0");
        return -1;
    }
    a->ptr = (const uint8_t *)(uintptr_t)ptr, a->es = (size_t)es, a->gbase = gbase, a->kind = kind, a->numel = numel;
    if (numel == 0)
        return 0;
    int n = 0;
    for (Py_ssize_t d = 0; d < nd; d++)
        if (a->size[d] != 1)
            a->size[n] = a->size[d], a->stride[n] = a->stride[d], a->gstride[n] = a->gstride[d], n++;
    a->n = n;
    return 1;
}

/* Dims k.. of *a are contiguous in the global order: each index of dims ..k-1 is one run. */
static int outer_dims(const args2_t *a) {
    int k = a->n;
    for (int64_t expect = 1; k > 0 && a->gstride[k - 1] == expect; k--)
        expect *= a->size[k - 1];
    return k;
}

/* parse2, then the layout of dims `whole ? 0 : *k`.. into *L, where *k is the number of outer dims (outer_dims). */
static int start2(PyObject *args, args2_t *a, layout_t *L, int *k, int whole) {
    int r = parse2(args, a);
    if (r <= 0)
        return r;
    *k = outer_dims(a);
    memset(L, 0, sizeof *L);
    L->base = a->ptr, L->es = a->es;
    for (int d = whole ? 0 : *k; d < a->n; d++)
        layout_add(L, a->size[d], a->stride[d] * (int64_t)a->es);
    return 1;
}

/* fingerprint2() and fingerprint2_summary() run through the kernel into *st: 1, 0 (no bytes) or -1. */
static int run_kernel2(PyObject *args, state_t *st) {
    args2_t a;
    layout_t L;
    int k, r = start2(args, &a, &L, &k, 0);
    if (r <= 0)
        return r;
    outer_t O = {k, {0}, {0}, {0}, a.gbase};
    for (int d = 0; d < k; d++)
        O.size[d] = a.size[d], O.lstride[d] = a.stride[d] * (int64_t)a.es, O.gstride[d] = a.gstride[d];
    memset(st, 0, sizeof *st);
    st->v2 = 1;
    st->kind = a.kind;
    return execute(st, &L, &O, a.numel);
}

/* fingerprint2_pair(): one walk over the local tensor in its logical order into *st (the whole value's sums from
   lane 0, as fingerprint2_summary(..., 0, None, kind), and its statistics) and *gs (the sums at the global
   positions, as fingerprint2(..., gbase, gstrides, 0)): 1, 0 (no bytes) or -1. */
static int run_kernel2_pair(PyObject *args, state_t *st, state_t *gs, runs_t *R) {
    args2_t a;
    layout_t L;
    int k, r = start2(args, &a, &L, &k, 1);
    if (r <= 0)
        return r;
    memset(R, 0, sizeof *R);
    R->st = gs, R->k = k, R->gbase = a.gbase, R->es = a.es;
    R->run_bytes = a.es;
    for (int d = 0; d < a.n; d++)
        if (d < k)
            R->size[d] = a.size[d], R->gstride[d] = a.gstride[d];
        else
            R->run_bytes *= (uint64_t)a.size[d];
    memset(gs, 0, sizeof *gs);
    gs->v2 = 1;
    memset(st, 0, sizeof *st);
    st->v2 = 1;
    st->kind = a.kind;
    st->pair = R;
    outer_t O = {0};
    return execute(st, &L, &O, a.numel);
}

static PyObject *stats_tuple(const state_t *st) {
    return Py_BuildValue("(dddLLL)", st->lo, st->hi, st->sum, (long long)st->finite, (long long)st->nan,
                         (long long)st->inf);
}

/* (h0, h1, stats) with stats None or (min, max, sum, finite, nan, inf), from a kernel run's result r. */
static PyObject *raw_result(int r, const state_t *st) {
    if (r < 0)
        return NULL;
    if (r == 0 || st->kind == ST_NONE)
        return Py_BuildValue("(KKO)", r ? (unsigned long long)st->h0 : 0ULL, r ? (unsigned long long)st->h1 : 0ULL,
                             Py_None);
    PyObject *stats = stats_tuple(st);
    return stats ? Py_BuildValue("(KKN)", (unsigned long long)st->h0, (unsigned long long)st->h1, stats) : NULL;
}

/* (hex hash, stats): stats None without a stats kind, the summary dict divtrace.trace.fingerprint gives when some value
   is finite and their mean is too, else raw_result's tuple for Python to finish. */
static PyObject *summary_result(int r, const state_t *st) {
    if (r < 0)
        return NULL;
    char hex[33];
    snprintf(hex, sizeof hex, "%016llx%016llx", r ? (unsigned long long)st->h0 : 0ULL,
             r ? (unsigned long long)st->h1 : 0ULL);
    if (r == 0 || st->kind == ST_NONE)
        return Py_BuildValue("(s#O)", hex, (Py_ssize_t)32, Py_None);
    double mean = st->finite ? st->sum / (double)st->finite : NAN;
    if (!st->finite || !isfinite(mean)) {
        PyObject *stats = stats_tuple(st);
        return stats ? Py_BuildValue("(s#N)", hex, (Py_ssize_t)32, stats) : NULL;
    }
    double absmax = st->hi > -st->lo ? st->hi : -st->lo; /* Python's max(-lo, hi) */
    return Py_BuildValue("(s#{s:d,s:d,s:d,s:d,s:L,s:L})", hex, (Py_ssize_t)32, "min", st->lo, "max", st->hi, "mean",
                         mean, "absmax", absmax, "nan", (long long)st->nan, "inf", (long long)st->inf);
}

/* fingerprint(ptr, elem_size, shape, strides, outer_ptr, outer_row_stride, outer_len, stats_kind)
   -> (h0, h1, stats). Strides are in elements. The raw numbers: divtrace uses fingerprint_summary; tests build
   the summary from these to check it. */
static PyObject *py_fingerprint(PyObject *self, PyObject *args) {
    state_t st;
    int r = run_kernel(args, &st);
    return raw_result(r, &st);
}

/* fingerprint_summary(the same arguments) -> (hex hash, stats): the same numbers as fingerprint(), less Python
   around each call (a recording makes one per value, each with caches cold from the forward: ~8 us of formatting
   apiece). */
static PyObject *py_fingerprint_summary(PyObject *self, PyObject *args) {
    state_t st;
    int r = run_kernel(args, &st);
    return summary_result(r, &st);
}

static PyObject *py_fingerprint2(PyObject *self, PyObject *args) {
    state_t st;
    int r = run_kernel2(args, &st);
    return raw_result(r, &st);
}

static PyObject *py_fingerprint2_summary(PyObject *self, PyObject *args) {
    state_t st;
    int r = run_kernel2(args, &st);
    return summary_result(r, &st);
}

/* fingerprint2_pair(the arguments of fingerprint2) -> (hex hash, stats, hex partial): fingerprint2_summary of the
   whole local tensor (gbase 0, row-major) and the hex of fingerprint2's sums at gbase/gstrides, from one read of
   its bytes (a recording rank fingerprints each block it makes and takes its global partial). */
static PyObject *py_fingerprint2_pair(PyObject *self, PyObject *args) {
    state_t st, gs;
    runs_t R;
    int r = run_kernel2_pair(args, &st, &gs, &R);
    PyObject *s = summary_result(r, &st);
    if (!s)
        return NULL;
    char hex[33];
    snprintf(hex, sizeof hex, "%016llx%016llx", r ? (unsigned long long)gs.h0 : 0ULL, r ? (unsigned long long)gs.h1 : 0ULL);
    PyObject *out = Py_BuildValue("(OOs#)", PyTuple_GET_ITEM(s, 0), PyTuple_GET_ITEM(s, 1), hex, (Py_ssize_t)32);
    Py_DECREF(s);
    return out;
}

/* row_fingerprints2(ptr, rows, row_stride_bytes, run_bytes, starts, out_ptr[, run_stride_bytes]): rows at ptr + r *
   row_stride, each holding len(starts) / 8 runs of run_bytes contiguous bytes, run k at byte starts[k] (int64, native
   order) of the global row and at ptr + r * row_stride + k * run_stride in memory (run_stride: run_bytes when left
   out or negative, the runs back to back; a [B, H, T, d] block of local heads read in place gives each head's d
   elements as a run, one head's stride apart). out_ptr 0: returns the fingerprints as bytes (rows little-endian
   uint64, what rows.bin holds); else writes rows uint64 there and returns None. */
static PyObject *py_row_fingerprints2(PyObject *self, PyObject *args) {
    unsigned long long ptr, optr;
    Py_ssize_t rows, stride, run_bytes, run_stride = -1;
    Py_buffer starts;
    if (!PyArg_ParseTuple(args, "Knnny*K|n", &ptr, &rows, &stride, &run_bytes, &starts, &optr, &run_stride))
        return NULL;
    if (run_stride < 0)
        run_stride = run_bytes;
    Py_ssize_t runs = starts.len / 8;
    const int64_t *g = (const int64_t *)starts.buf;
    int bad = rows < 0 || run_bytes < 0 || starts.len % 8;
    for (Py_ssize_t k = 0; !bad && k < runs; k++)
        bad = g[k] < 0;
    if (bad) {
        PyBuffer_Release(&starts);
        return PyErr_Format(PyExc_ValueError, "row_fingerprints2: negative rows, run size or start");
    }
    PyObject *res = NULL;
    uint64_t *out = (uint64_t *)(uintptr_t)optr;
    if (!optr) {
        res = PyBytes_FromStringAndSize(NULL, rows * 8);
        if (!res) {
            PyBuffer_Release(&starts);
            return NULL;
        }
        out = (uint64_t *)PyBytes_AS_STRING(res); /* (bytes data is aligned for any scalar) */
    }
    const uint8_t *base = (const uint8_t *)(uintptr_t)ptr;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < rows; r++) {
        uint64_t h = 0;
        for (Py_ssize_t k = 0; k < runs; k++)
            h += row_segment(base + r * stride + k * run_stride, (size_t)run_bytes, (uint64_t)g[k]);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        if (res)
            h = __builtin_bswap64(h);
#endif
        out[r] = h;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&starts);
    if (res)
        return res;
    Py_RETURN_NONE;
}

static PyObject *py_use_isa(PyObject *self, PyObject *args) {
    const char *want = NULL;
    if (!PyArg_ParseTuple(args, "|z", &want))
        return NULL;
    if (select_isa(want)) {
        PyErr_Format(PyExc_ValueError, "kernel %s is not available on this CPU", want);
        return NULL;
    }
    return PyUnicode_FromString(isa);
}

static PyMethodDef methods[] = {
    {"use_isa", py_use_isa, METH_VARARGS,
     "use_isa(name=None): pick the kernel ('avx512', 'avx2', 'generic'; None: the fastest this CPU runs); "
     "returns the one in use. Every kernel computes the same numbers."},
    {"set_weights", py_set_weights, METH_VARARGS, "set_weights(ptr): the (2, 1024) int64 inner weights"},
    {"fingerprint", py_fingerprint, METH_VARARGS,
     "fingerprint(ptr, elem_size, shape, strides, outer_ptr, outer_row_stride, outer_len, stats_kind)"},
    {"fingerprint_summary", py_fingerprint_summary, METH_VARARGS,
     "fingerprint_summary(the arguments of fingerprint) -> (hex hash, stats dict, tuple or None)"},
    {"fingerprint2", py_fingerprint2, METH_VARARGS,
     "fingerprint2(ptr, elem_size, shape, strides, gbase, gstrides or None, stats_kind) -> (h0, h1, stats): "
     "lane-gsum128-v2, the local tensor's part of the global value's fingerprint"},
    {"fingerprint2_summary", py_fingerprint2_summary, METH_VARARGS,
     "fingerprint2_summary(the arguments of fingerprint2) -> (hex hash, stats dict, tuple or None)"},
    {"fingerprint2_pair", py_fingerprint2_pair, METH_VARARGS,
     "fingerprint2_pair(the arguments of fingerprint2) -> (hex hash, stats, hex partial): fingerprint2_summary of "
     "the whole local tensor and the partial at gbase/gstrides, in one read"},
    {"row_fingerprints2", py_row_fingerprints2, METH_VARARGS,
     "row_fingerprints2(ptr, rows, row_stride_bytes, run_bytes, starts, out_ptr[, run_stride_bytes]): row-gsum64-v2 "
     "per row"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "divtrace's CPU fingerprint kernel", -1,
                                    methods};

PyMODINIT_FUNC PyInit__native(void) {
    select_isa(NULL);
    make_weights_v2();
    return PyModule_Create(&module);
}
