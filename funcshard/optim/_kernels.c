/* One-pass CPU step of fs.optim.adamw / sgd with moments stored narrow (funcshard.optim.kernels).
 *
 * Eight elements at a time: load the param and grad, decode the stored moments to fp32, step,
 * store the param and the moments, in one loop, so the memory traffic overlaps the divides
 * that bound torch's fused fp32 step too. 8-bit moments need the block's absmax of the new
 * values before they can be stored: a block is stepped into an L1 scratch, then encoded.
 *
 * The results must equal, bit for bit, funcshard's torch path (rules._chunked): decode with
 * torch ops, torch's fused fp32 CPU kernel, encode with torch ops. So:
 *  - each operation is the IEEE fp32 operation torch does, in torch's order; the file is
 *    compiled with -ffp-contract=off, and an FMA appears exactly where torch's binary has one:
 *    its explicit vec::fmadd (the lerp of mu, SGD's decay, momentum and Nesterov terms) and
 *    the two its compiler contracted (the second moment's update, SGD's param update), found
 *    by comparison with torch 2.13's AVX2 build (funcshard.optim.kernels checks it at load);
 *  - conversions round as torch's do (bf16 and fp16 to nearest even; 8-bit to nearest even);
 *  - torch.sqrt in the 8-bit encode is MKL's vmsSqrt, not IEEE's sqrt (within 1 ulp of it,
 *    differing in 17% of the floats in [0, 2^32], checked exhaustively on an AMD EPYC). The
 *    encode rounds a root of its own (int8: rsqrt and a Newton step on the FMA units; uint8:
 *    the root of the step's own sqrt(nu) times sqrt(factor), on the divider), and where that
 *    lies within 2^-11 of a half integer, so that the error of either root could move the
 *    rounding, it calls vmsSqrt itself (batched: ~1e-4 of the elements);
 *  - a block whose roots are not finite (a NaN or an inf in it) is encoded again element by
 *    element as torch does (encode_exact), so the vector loop tracks no NaNs; so is a block
 *    whose absmax is below 2^-64 (TINY: torch codes it shifted by 2^64, moments._shift).
 * NaN payloads are not matched (torch's own vector and scalar loops disagree on them).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include <immintrin.h>

enum { FS_F32 = 0, FS_BF16 = 1, FS_F16 = 2, FS_I8 = 3, FS_U8 = 4 };
enum { FS_ADAMW = 0, FS_SGD = 1 };

/* Elements per thread range unit: a multiple of every 8-bit block (powers of two <= 256). */
#define TILE 512
#define MAX_BLOCK 256

/* Mirrors funcshard.optim.kernels.Args field for field (int32 and float: no padding). */
typedef struct {
  int32_t rule;          /* FS_ADAMW or FS_SGD */
  int32_t param_dtype;   /* FS_F32, FS_BF16 or FS_F16; the grad has the param's dtype */
  int32_t moments;       /* 2 (adamw: mu, nu) or 1 (sgd: the momentum) */
  int32_t fmt[2];        /* storage of each moment */
  int32_t block[2];      /* elements per scale of an 8-bit moment */
  int32_t stochastic[2]; /* bf16 rounded stochastically, dithered by (param ^ grad) bits */
  int32_t scaled;        /* grads divided by inv_scale (the fused kernels' grad_scale) */
  int32_t write_grad;    /* and stored back, as the fused kernels do */
  int32_t decay;         /* weight_decay != 0 */
  int32_t lerp_small;    /* adamw: |1 - beta1| < 0.5: the lerp's base is mu, else the grad */
  int32_t nesterov;      /* sgd */
  float inv_scale;
  float decay_factor; /* adamw: 1 - lr * weight_decay; sgd: weight_decay */
  float lerp_weight;  /* adamw: 1 - beta1 if lerp_small, else -beta1 */
  float beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size; /* adamw */
  float momentum, neg_lr;                                      /* sgd */
} fs_args;

static const float I8_FACTOR = (float)(1.0 / 16129.0);      /* decode: 1 / 127^2 */
static const float U8_FACTOR = (float)(1.0 / 4228250625.0); /* decode: 1 / 255^4 */
static const float I8_TOP = 16129.0f;                       /* encode: 127^2 */
static const float U8_TOP = (float)4228250625.0;            /* encode: 255^4, as torch rounds it */
/* A block whose absmax is below TINY is coded at its values times UNTINY, then scaled back
 * (moments._shift): its factors would overflow or lose bits to the subnormals. */
static const float TINY = 0x1p-64f, UNTINY = 0x1p64f, UNTINY_INV = 0x1p-64f;

#define INLINE static inline __attribute__((always_inline))

/* --- eight elements from and to storage ----------------------------------------------------- */
INLINE __m256 load8(int fmt, const void *base, int64_t i) {
  switch (fmt) {
    case FS_BF16: {
      const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    case FS_F16:
      return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)));
    default:
      return _mm256_loadu_ps((const float *)base + i);
  }
}

/* bf16 bits of x, rounded to nearest even (c10::BFloat16), NaN as 0x7fc0 */
INLINE __m128i bf16_bits(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

INLINE void store8(int fmt, void *base, int64_t i, __m256 x) {
  switch (fmt) {
    case FS_BF16:
      _mm_storeu_si128((__m128i *)((uint16_t *)base + i), bf16_bits(x));
      break;
    case FS_F16:
      _mm_storeu_si128((__m128i *)((uint16_t *)base + i),
                       _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      break;
    default:
      _mm256_storeu_ps((float *)base + i, x);
  }
}

/* bf16 rounded stochastically: x + ((p ^ g) & 0xffff) in the bits (int32 wrap), truncated:
 * the high half (torch's cast of the truncated value is exact; a NaN stays a NaN) */
INLINE void store8_dithered(void *base, int64_t i, __m256 x, __m256 p, __m256 g) {
  const __m256i dither = _mm256_and_si256(
      _mm256_xor_si256(_mm256_castps_si256(p), _mm256_castps_si256(g)), _mm256_set1_epi32(0xffff));
  const __m256i u = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), dither), 16);
  _mm_storeu_si128((__m128i *)((uint16_t *)base + i),
                   _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)));
}

/* --- 8-bit blocks (funcshard.optim.moments.MomentFormat.decode / encode) --------------------- */
/* factor: the block's (absmax * shift) / top, unshift: 1 / shift (decode_factor) */
INLINE __m256 load8_8bit(int fmt, const void *base, int64_t i, __m256 factor, __m256 unshift) {
  const __m128i b = _mm_loadl_epi64((const __m128i *)((const uint8_t *)base + i));
  if (fmt == FS_I8) { /* absmax * sign(q) * (q / 127)^2 */
    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    const __m256 absq = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), q);
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(q, absq), factor), unshift);
  }
  const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); /* absmax * (q / 255)^4 */
  const __m256 q2 = _mm256_mul_ps(q, q);
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(q2, q2), factor), unshift);
}

/* torch's shift of a block (moments._shift): NaN compares false */
static float shift_of(float absmax) { return absmax < TINY ? UNTINY : 1.0f; }

/* The decode factor of a block, (absmax * shift) * (1 / top), as torch forms it */
static float decode_factor(int fmt, float absmax) {
  return absmax * shift_of(absmax) * (fmt == FS_I8 ? I8_FACTOR : U8_FACTOR);
}

static float unshift_of(float absmax) { return absmax < TINY ? UNTINY_INV : 1.0f; }

typedef void (*fs_vml_fn)(int64_t n, const float *in, float *out, int64_t mode);
static fs_vml_fn vml_sqrt = 0;
static int64_t vml_mode = 0;

void fs_set_sqrt(void *fn, int64_t mode) {
  vml_sqrt = (fs_vml_fn)fn;
  vml_mode = mode;
}

static void torch_sqrt(float *x, int n) {
  if (vml_sqrt) {
    vml_sqrt(n, x, x, vml_mode);
  } else {
    for (int i = 0; i < n; i++) x[i] = sqrtf(x[i]);
  }
}

/* sqrt(y) within 2^-22.7 (relative; measured over every float in [2^-64, 2^32], and the bound
 * of rsqrtps's 1.5 * 2^-12 after one Newton step): rsqrt and FMAs, no divider. For y >= 2^-64
 * (below, rsqrt's inf makes a NaN); a NaN stays a NaN. */
INLINE __m256 sqrt_approx(__m256 y) {
  const __m256 r = _mm256_rsqrt_ps(y);
  const __m256 s = _mm256_mul_ps(y, r), h = _mm256_mul_ps(_mm256_set1_ps(0.5f), r);
  return _mm256_fmadd_ps(s, _mm256_fnmadd_ps(s, h, _mm256_set1_ps(0.5f)), s);
}

/* |s - q| at or above this (q: s rounded), s lies within 2^-11 of a half integer. For the
 * roots here (s < 256) torch's sqrt is within 1.5 ulp of the exact root (the fourth root: 2.5
 * ulp; < 2^-21.6 relative), the kernel's within 2^-22.4 (the fourth root): together under
 * 256 * 2^-20.96 < 2^-12.9, so elsewhere both round to the same integer. As int32 bits: the
 * distances are >= 0, whose bits order as their values, and a NaN's above them all. */
#define NEAR_HALF (0.5f - 0x1p-11f)
#define NEAR_HALF_BITS 0x3effe000
#define INF_BITS 0x7f800000

/* Elements whose rounding needs torch's own sqrt, patched in batches (one vmsSqrt call for
 * many blocks: they are rare, ~1e-4 of the elements). */
#define NEAR_BATCH 256
typedef struct {
  int fmt, n;
  float y[NEAR_BATCH];       /* the sqrt's input */
  uint8_t *at[NEAR_BATCH];   /* the stored byte */
  float sign[NEAR_BATCH];    /* int8: the value whose sign the byte takes */
} fs_near;

/* torch's conversion of a rounded root to the stored byte: a C cast's low byte; NaN as 0 */
static uint8_t byte_of(float q) {
  return q == q && fabsf(q) < 0x1p31f ? (uint8_t)(int32_t)q : 0;
}

static void flush_near(fs_near *b) {
  if (!b->n) return;
  torch_sqrt(b->y, b->n);
  if (b->fmt == FS_U8) torch_sqrt(b->y, b->n);
  for (int k = 0; k < b->n; k++) {
    const float q = nearbyintf(b->y[k]); /* torch.round_: half to even */
    *b->at[k] = byte_of(b->fmt == FS_I8 ? copysignf(q, b->sign[k]) : q);
  }
  b->n = 0;
}

/* Near-half lanes of 8 elements x (at out) go to the batch for torch's sqrt. */
static void __attribute__((noinline)) defer_near(fs_near *near, int fmt, int lanes, __m256 x,
                                                 float f, uint8_t *out) {
  float xs[8];
  _mm256_storeu_ps(xs, x);
  while (lanes) {
    const int k = __builtin_ctz(lanes);
    lanes &= lanes - 1;
    if (near->n == NEAR_BATCH) flush_near(near);
    near->y[near->n] = (fmt == FS_I8 ? fabsf(xs[k]) : xs[k]) * f;
    near->at[near->n] = out + k;
    near->sign[near->n++] = xs[k];
  }
}

/* 8 elements x of a block as int8 codes in int32 lanes: round(sqrt(|x| * f)) with x's sign,
 * f = 127^2 / the block's absmax. The root is sqrt_approx's of |x| * f + 2^-64 (one FMA: at
 * most an ulp from torch's product, and >= 2^-64, whose root rounds to 0 as torch's root of a
 * 0 or a denormal does). *d: the bits of |root - code|, a NaN where the root is not finite
 * (its code is then wrong, and the block is encoded again by encode_exact). */
INLINE __m256i code8_i8(__m256 x, __m256 f, __m256i *d) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 y = _mm256_fmadd_ps(_mm256_andnot_ps(sign, x), f, _mm256_set1_ps(0x1p-64f));
  const __m256 s = sqrt_approx(y);
  const __m256 q = _mm256_round_ps(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  *d = _mm256_castps_si256(_mm256_andnot_ps(sign, _mm256_sub_ps(s, q)));
  return _mm256_sign_epi32(_mm256_cvttps_epi32(q), _mm256_castps_si256(x)); /* x's sign */
}

/* uint8 codes of x from r = sqrt(x), the root the step took for its denominator:
 * round(sqrt(r * sqrt(f))), f = 255^4 / the block's absmax, on the divider (idle in the
 * encode). Three roundings to sqrt(x * f) (2^-22.4), halved by the last root, and its own:
 * within 2^-22.8 of the exact fourth root. *d as code8_i8's. */
INLINE __m256i code8_u8(__m256 r, __m256 sqrt_f, __m256i *d) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 s = _mm256_sqrt_ps(_mm256_mul_ps(r, sqrt_f));
  const __m256 q = _mm256_round_ps(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  *d = _mm256_castps_si256(_mm256_andnot_ps(sign, _mm256_sub_ps(s, q)));
  return _mm256_cvttps_epi32(q);
}

/* Four vectors of codes (32 elements) stored as int8 / uint8 at out; d: their distances to
 * the rounding (code8), x the elements (f their factor), for the batch of torch's sqrt.
 * Returns 1 where a root was not finite (the caller encodes the block again). */
INLINE int store32(fs_near *near, int fmt, const __m256i *codes, const __m256i *d,
                   const float *x, float f, uint8_t *out) {
  /* the codes fit: packing saturates nothing; packs interleave the 128-bit lanes, undone by
   * the permutation */
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  __m256i b;
  if (fmt == FS_I8)
    b = _mm256_packs_epi16(_mm256_packs_epi32(codes[0], codes[1]),
                           _mm256_packs_epi32(codes[2], codes[3]));
  else
    b = _mm256_packus_epi16(_mm256_packus_epi32(codes[0], codes[1]),
                            _mm256_packus_epi32(codes[2], codes[3]));
  _mm256_storeu_si256((__m256i *)out, _mm256_permutevar8x32_epi32(b, order));
  const __m256i edge = _mm256_set1_epi32(NEAR_HALF_BITS - 1);
  const __m256i dmax = _mm256_max_epi32(_mm256_max_epi32(d[0], d[1]), _mm256_max_epi32(d[2], d[3]));
  if (__builtin_expect(!_mm256_testz_si256(_mm256_cmpgt_epi32(dmax, edge), _mm256_cmpgt_epi32(dmax, edge)), 0)) {
    if (_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(dmax, _mm256_set1_epi32(INF_BITS)))))
      return 1;
    for (int t = 0; t < 4; t++) {
      const int lanes = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(d[t], edge)));
      if (lanes) defer_near(near, fmt, lanes, _mm256_loadu_ps(x + 8 * t), f, out + 8 * t);
    }
  }
  return 0;
}

/* top / safe (torch: safe = absmax * shift where absmax > 0, else 1) */
static float encode_factor(int fmt, float absmax) {
  const float safe = absmax > 0.0f ? absmax * shift_of(absmax) : 1.0f;
  return (1.0f / safe) * (fmt == FS_I8 ? I8_TOP : U8_TOP);
}

/* A block the vector encode leaves to encode_exact: a tiny absmax, whose values it would
 * have to shift first */
static int tiny(float absmax) { return absmax > 0.0f && absmax < TINY; }

/* A block of an 8-bit moment stored as torch's encode does, one element at a time, NaN
 * propagating into its scale: for blocks with a NaN or an inf, which the vector encode (whose
 * absmax ignores NaNs) finds by a root that is not finite, and tiny blocks (absmax < TINY,
 * shifted as torch's encode does). Drops what the batch of torch's sqrt holds for the block. */
static void __attribute__((noinline)) encode_exact(fs_near *near, int fmt, const float *x,
                                                   int block, float *scale, uint8_t *out) {
  int keep = 0;
  for (int k = 0; k < near->n; k++) {
    if (near->at[k] >= out && near->at[k] < out + block) continue;
    near->y[keep] = near->y[k];
    near->at[keep] = near->at[k];
    near->sign[keep++] = near->sign[k];
  }
  near->n = keep;
  float m = 0.0f, y[MAX_BLOCK];
  int nan = 0;
  for (int k = 0; k < block; k++) {
    const float a = fmt == FS_I8 ? fabsf(x[k]) : x[k];
    if (a != a) nan = 1;
    else if (a > m) m = a;
  }
  *scale = nan ? NAN : m;
  const float f = encode_factor(fmt, *scale), shift = shift_of(*scale);
  for (int k = 0; k < block; k++) y[k] = (fmt == FS_I8 ? fabsf(x[k]) : x[k]) * shift * f;
  torch_sqrt(y, block);
  if (fmt == FS_U8) torch_sqrt(y, block);
  for (int k = 0; k < block; k++) {
    const float q = nearbyintf(y[k]);
    out[k] = byte_of(fmt == FS_I8 ? copysignf(q, x[k]) : q);
  }
}

/* 32 elements of a block of an 8-bit moment stored at out: x (fp32) and, for uint8, their
 * roots r; vf the factor (uint8: its root) the codes take, f the factor for torch's sqrt.
 * Returns 1 where a root was not finite. */
INLINE int encode32(fs_near *near, int fmt, const float *x, const float *r, __m256 vf, float f,
                    uint8_t *out) {
  __m256i codes[4], d[4];
  for (int t = 0; t < 4; t++)
    codes[t] = fmt == FS_I8 ? code8_i8(_mm256_loadu_ps(x + 8 * t), vf, &d[t])
                            : code8_u8(_mm256_loadu_ps(r + 8 * t), vf, &d[t]);
  return store32(near, fmt, codes, d, x, f, out);
}

static float hmax(__m256 absmax) {
  float lanes[8], m = 0.0f;
  _mm256_storeu_ps(lanes, absmax);
  for (int k = 0; k < 8; k++) m = lanes[k] > m ? lanes[k] : m;
  return m;
}

/* --- the fp32 steps: torch's fused vector bodies ----------------------------------------------- */
typedef struct {
  __m256 inv, df, w, b2, c2, bc, eps, ns, mom, nlr;
} fs_consts;

static fs_consts consts_of(const fs_args *a) {
  fs_consts c;
  c.inv = _mm256_set1_ps(a->inv_scale);
  c.df = _mm256_set1_ps(a->decay_factor);
  c.w = _mm256_set1_ps(a->lerp_weight);
  c.b2 = _mm256_set1_ps(a->beta2);
  c.c2 = _mm256_set1_ps(a->one_minus_beta2);
  c.bc = _mm256_set1_ps(a->bc2_sqrt);
  c.eps = _mm256_set1_ps(a->eps);
  c.ns = _mm256_set1_ps(a->neg_step_size);
  c.mom = _mm256_set1_ps(a->momentum);
  c.nlr = _mm256_set1_ps(a->neg_lr);
  return c;
}

/* One vector: p, g in; m, v (sgd: m only) updated in place; returns the new p. g is the
 * (scaled) grad afterwards, as the fused kernels leave it. */
INLINE __m256 step8(const fs_args *a, const fs_consts *c, int rule, __m256 p, __m256 *g, __m256 *m,
                    __m256 *v, __m256 *root) {
  __m256 gi = *g;
  if (a->scaled) gi = _mm256_div_ps(gi, c->inv);
  *g = gi;
  if (rule == FS_ADAMW) {
    if (a->decay) p = _mm256_mul_ps(p, c->df);
    const __m256 mi = *m;
    *m = _mm256_fmadd_ps(c->w, _mm256_sub_ps(gi, mi), a->lerp_small ? mi : gi);
    *v = _mm256_fmadd_ps(_mm256_mul_ps(c->c2, gi), gi, _mm256_mul_ps(*v, c->b2));
    *root = _mm256_sqrt_ps(*v);
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(*root, c->bc), c->eps);
    return _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(c->ns, *m), denom));
  }
  if (a->decay) gi = _mm256_fmadd_ps(p, c->df, gi);
  *m = _mm256_fmadd_ps(_mm256_set1_ps(1.0f), gi, _mm256_mul_ps(*m, c->mom)); /* 1 - dampening */
  gi = a->nesterov ? _mm256_fmadd_ps(*m, c->mom, gi) : *m;
  return _mm256_fmadd_ps(gi, c->nlr, p);
}

/* Elements [lo, hi) of buffers with no 8-bit moment (hi - lo a multiple of 8). The format
 * arguments are constants where inlined into the specializations below. */
INLINE void plain8(const fs_args *a, const fs_consts *c, int rule, int pdt, int f0, int f1,
                   int sr0, int sr1, void *pp, void *gp, void *mp, void *vp, int64_t i) {
  const int two = rule == FS_ADAMW;
  __m256 g = load8(pdt, gp, i), m = load8(f0, mp, i);
  __m256 v = two ? load8(f1, vp, i) : _mm256_setzero_ps();
  __m256 root = _mm256_setzero_ps();
  const __m256 p = step8(a, c, rule, load8(pdt, pp, i), &g, &m, &v, &root);
  store8(pdt, pp, i, p);
  if (a->write_grad) store8(pdt, gp, i, g);
  if (sr0)
    store8_dithered(mp, i, m, p, g);
  else
    store8(f0, mp, i, m);
  if (two) {
    if (sr1)
      store8_dithered(vp, i, v, p, g);
    else
      store8(f1, vp, i, v);
  }
}

INLINE void run_plain(const fs_args *args, int rule, int pdt, int f0, int f1, int sr0, int sr1,
                      void *pp, void *gp, void *mp, void *vp, int64_t lo, int64_t hi) {
  const fs_args local = *args; /* a copy no store can alias: its flags stay in registers */
  const fs_args *a = &local;
  const fs_consts c = consts_of(a);
  int64_t i = lo;
  for (; i + 16 <= hi; i += 16) { /* two independent chains of divides in flight */
    plain8(a, &c, rule, pdt, f0, f1, sr0, sr1, pp, gp, mp, vp, i);
    plain8(a, &c, rule, pdt, f0, f1, sr0, sr1, pp, gp, mp, vp, i + 8);
  }
  for (; i < hi; i += 8) plain8(a, &c, rule, pdt, f0, f1, sr0, sr1, pp, gp, mp, vp, i);
}

#define PLAIN(name, rule, pdt, f0, f1, sr0, sr1)                                            \
  static void name(const fs_args *a, void *p, void *g, void *m, void *v, int64_t lo,        \
                   int64_t hi) {                                                            \
    run_plain(a, rule, pdt, f0, f1, sr0, sr1, p, g, m, v, lo, hi);                          \
  }
PLAIN(adamw_bf16, FS_ADAMW, FS_F32, FS_BF16, FS_BF16, 0, 0)
PLAIN(adamw_bf16_sr, FS_ADAMW, FS_F32, FS_BF16, FS_BF16, 1, 1)
PLAIN(adamw_f32, FS_ADAMW, FS_F32, FS_F32, FS_F32, 0, 0)
PLAIN(sgd_bf16, FS_SGD, FS_F32, FS_BF16, FS_BF16, 0, 0)
PLAIN(sgd_bf16_sr, FS_SGD, FS_F32, FS_BF16, FS_BF16, 1, 1)
PLAIN(sgd_f32, FS_SGD, FS_F32, FS_F32, FS_F32, 0, 0)

static void __attribute__((noinline)) plain_generic(const fs_args *a, void *p, void *g, void *m,
                                                    void *v, int64_t lo, int64_t hi) {
  run_plain(a, a->rule, a->param_dtype, a->fmt[0], a->fmt[1], a->stochastic[0],
            a->stochastic[1], p, g, m, v, lo, hi);
}

typedef void (*plain_fn)(const fs_args *, void *, void *, void *, void *, int64_t, int64_t);

static plain_fn plain_of(const fs_args *a) {
  const int two = a->rule == FS_ADAMW, sr = a->stochastic[0];
  if (a->param_dtype != FS_F32 || (two && a->stochastic[1] != sr)) return plain_generic;
  const int f0 = a->fmt[0], f1 = two ? a->fmt[1] : f0;
  if (f0 == FS_BF16 && f1 == FS_BF16)
    return a->rule == FS_ADAMW ? (sr ? adamw_bf16_sr : adamw_bf16) : (sr ? sgd_bf16_sr : sgd_bf16);
  if (f0 == FS_F32 && f1 == FS_F32 && !sr) return a->rule == FS_ADAMW ? adamw_f32 : sgd_f32;
  return plain_generic;
}

/* The step of 8 elements at i of a buffer with an 8-bit moment: the param stored; an 8-bit
 * moment's new values into its scratch at j (uint8: their roots too, which the step takes
 * anyway) and the maxima of their magnitudes into max (NaNs drop out: the encode finds
 * them); another moment stored. Format arguments are constants where inlined. */
INLINE void block_step8(const fs_args *a, const fs_consts *c, int rule, int pdt, int f0, int f1,
                        void *pp, void *gp, void *mp, void *vp, int64_t i, int j, __m256 mf,
                        __m256 vf, __m256 mu, __m256 vu, float (*tile)[MAX_BLOCK], __m256 *max) {
  const int two = rule == FS_ADAMW;
  const int q0 = f0 == FS_I8, q1 = two && f1 == FS_U8;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 g = load8(pdt, gp, i);
  __m256 m = q0 ? load8_8bit(f0, mp, i, mf, mu) : load8(f0, mp, i);
  __m256 v = !two ? _mm256_setzero_ps() : q1 ? load8_8bit(f1, vp, i, vf, vu) : load8(f1, vp, i);
  __m256 root = _mm256_setzero_ps();
  const __m256 p = step8(a, c, rule, load8(pdt, pp, i), &g, &m, &v, &root);
  store8(pdt, pp, i, p);
  if (a->write_grad) store8(pdt, gp, i, g);
  if (q0) {
    max[0] = _mm256_max_ps(max[0], _mm256_and_ps(m, abs_mask));
    _mm256_storeu_ps(tile[0] + j, m);
  } else if (a->stochastic[0]) {
    store8_dithered(mp, i, m, p, g);
  } else {
    store8(f0, mp, i, m);
  }
  if (q1) {
    max[1] = _mm256_max_ps(max[1], v);
    _mm256_storeu_ps(tile[1] + j, v);
    _mm256_storeu_ps(tile[2] + j, root);
  } else if (two && a->stochastic[1]) {
    store8_dithered(vp, i, v, p, g);
  } else if (two) {
    store8(f1, vp, i, v);
  }
}

/* Elements [lo, hi) with an 8-bit moment (int8 mu, uint8 nu; whole blocks), software-pipelined
 * by one block: the step of a block into an L1 scratch and, in the same loop, 32 elements at
 * a time, the encode of the previous one, whose ALU work fills the step's waits on the
 * divider. A block with a value that is not finite is encoded again by encode_exact. */
INLINE void run_blocks_impl(const fs_args *args, int rule, int pdt, int f0, int f1, void *pp,
                            void *gp, void *mp, float *ms, void *vp, float *vs, int64_t lo,
                            int64_t hi) {
  const fs_args local = *args; /* a copy no store can alias: its flags stay in registers */
  const fs_args *a = &local;
  const fs_consts c = consts_of(a);
  const int two = rule == FS_ADAMW;
  if (!two) f1 = FS_F32;
  const int q0 = f0 == FS_I8, q1 = two && f1 == FS_U8; /* mu is signed, nu unsigned */
  const int block = q0 ? a->block[0] : a->block[1];
  float tiles[2][3][MAX_BLOCK]; /* [block parity][mu, nu, sqrt(nu) (uint8)] */
  fs_near near[2] = {{.fmt = f0}, {.fmt = f1}};
  float fprev[2] = {0.0f, 0.0f}, fprev_scale[2] = {0.0f, 0.0f};
  float *sprev[2] = {0, 0};
  uint8_t *oprev[2] = {0, 0};
  int cur = 0;
  for (int64_t b0 = lo; b0 <= hi; b0 += block) {
    const int step = b0 < hi, encode = b0 > lo;
    const int64_t blk = b0 / block;
    /* decode factors of this block, encode factors of the previous one (uint8: its root) */
    const __m256 mf = _mm256_set1_ps(q0 && step ? decode_factor(f0, ms[blk]) : 0.0f);
    const __m256 vf = _mm256_set1_ps(q1 && step ? decode_factor(f1, vs[blk]) : 0.0f);
    const __m256 mu = _mm256_set1_ps(q0 && step ? unshift_of(ms[blk]) : 1.0f);
    const __m256 vu = _mm256_set1_ps(q1 && step ? unshift_of(vs[blk]) : 1.0f);
    const __m256 ef0 = _mm256_set1_ps(fprev[0]), ef1 = _mm256_set1_ps(sqrtf(fprev[1]));
    float(*tc)[MAX_BLOCK] = tiles[cur], (*tp)[MAX_BLOCK] = tiles[cur ^ 1];
    __m256 max[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    int bad0 = encode && tiny(fprev_scale[0]), bad1 = encode && tiny(fprev_scale[1]);
    for (int j = 0; j < block; j += 32) {
      if (step)
        for (int k = j; k < j + 32; k += 8)
          block_step8(a, &c, rule, pdt, f0, f1, pp, gp, mp, vp, b0 + k, k, mf, vf, mu, vu, tc, max);
      if (encode && q0)
        bad0 |= encode32(&near[0], f0, tp[0] + j, 0, ef0, fprev[0], oprev[0] + j);
      if (encode && q1)
        bad1 |= encode32(&near[1], f1, tp[1] + j, tp[2] + j, ef1, fprev[1], oprev[1] + j);
    }
    if (__builtin_expect(bad0, 0)) encode_exact(&near[0], f0, tp[0], block, sprev[0], oprev[0]);
    if (__builtin_expect(bad1, 0)) encode_exact(&near[1], f1, tp[1], block, sprev[1], oprev[1]);
    if (!step) break;
    if (q0) {
      ms[blk] = hmax(max[0]);
      fprev[0] = encode_factor(f0, ms[blk]);
      fprev_scale[0] = ms[blk];
      sprev[0] = ms + blk;
      oprev[0] = (uint8_t *)mp + b0;
    }
    if (q1) {
      vs[blk] = hmax(max[1]);
      fprev[1] = encode_factor(f1, vs[blk]);
      fprev_scale[1] = vs[blk];
      sprev[1] = vs + blk;
      oprev[1] = (uint8_t *)vp + b0;
    }
    cur ^= 1;
  }
  flush_near(&near[0]);
  flush_near(&near[1]);
}

/* The usual case, its flags constants the compiler folds: no grad_scale, the lerp's base mu
 * (beta1 > 0.5), weight decay on or off. */
#define BLOCKS_ADAMW(name, decay_on)                                                           \
  static void name(const fs_args *args, void *p, void *g, void *m, float *ms, void *v,       \
                   float *vs, int64_t lo, int64_t hi) {                                     \
    fs_args a = *args;                                                                       \
    a.scaled = a.write_grad = 0;                                                             \
    a.lerp_small = 1;                                                                        \
    a.decay = decay_on;                                                                      \
    a.stochastic[0] = a.stochastic[1] = 0;                                                   \
    run_blocks_impl(&a, FS_ADAMW, FS_F32, FS_I8, FS_U8, p, g, m, ms, v, vs, lo, hi);         \
  }
BLOCKS_ADAMW(blocks_adamw_i8_u8_decay, 1)
BLOCKS_ADAMW(blocks_adamw_i8_u8_plain, 0)

static void blocks_adamw_i8_u8(const fs_args *a, void *p, void *g, void *m, float *ms, void *v,
                               float *vs, int64_t lo, int64_t hi) {
  if (!a->scaled && a->lerp_small)
    (a->decay ? blocks_adamw_i8_u8_decay : blocks_adamw_i8_u8_plain)(a, p, g, m, ms, v, vs, lo, hi);
  else
    run_blocks_impl(a, FS_ADAMW, FS_F32, FS_I8, FS_U8, p, g, m, ms, v, vs, lo, hi);
}

static void blocks_sgd_i8(const fs_args *a, void *p, void *g, void *m, float *ms, void *v,
                          float *vs, int64_t lo, int64_t hi) {
  run_blocks_impl(a, FS_SGD, FS_F32, FS_I8, FS_F32, p, g, m, ms, v, vs, lo, hi);
}

static void __attribute__((noinline)) blocks_generic(const fs_args *a, void *p, void *g, void *m,
                                                     float *ms, void *v, float *vs, int64_t lo,
                                                     int64_t hi) {
  run_blocks_impl(a, a->rule, a->param_dtype, a->fmt[0], a->fmt[1], p, g, m, ms, v, vs, lo, hi);
}

static void run_blocks(const fs_args *a, void *p, void *g, void *m, float *ms, void *v, float *vs,
                       int64_t lo, int64_t hi) {
  if (a->param_dtype == FS_F32 && a->fmt[0] == FS_I8 && !a->stochastic[0]) {
    if (a->rule == FS_ADAMW && a->fmt[1] == FS_U8) {
      blocks_adamw_i8_u8(a, p, g, m, ms, v, vs, lo, hi);
      return;
    }
    if (a->rule == FS_SGD) {
      blocks_sgd_i8(a, p, g, m, ms, v, vs, lo, hi);
      return;
    }
  }
  blocks_generic(a, p, g, m, ms, v, vs, lo, hi);
}

/* --- a range of elements, and the threads ---------------------------------------------------- */
typedef struct {
  const fs_args *a;
  void *p, *g, *m, *v;
  float *ms, *vs;
  int64_t lo, hi;
} fs_job;

static const int SIZES[] = {4, 2, 2, 1, 1}; /* bytes per element of each format */

/* The last n < 8 elements: copied into zero-padded vectors, stepped, copied back. */
static void run_tail(const fs_job *j, int64_t i0, int n) {
  const fs_args *a = j->a;
  float pb[8] = {0}, gb[8] = {0}, mb[8] = {0}, vb[8] = {0};
  const int ps = SIZES[a->param_dtype], s0 = SIZES[a->fmt[0]], s1 = SIZES[a->fmt[1]];
  const int two = a->moments == 2;
  memcpy(pb, (char *)j->p + i0 * ps, (size_t)n * ps);
  memcpy(gb, (char *)j->g + i0 * ps, (size_t)n * ps);
  memcpy(mb, (char *)j->m + i0 * s0, (size_t)n * s0);
  if (two) memcpy(vb, (char *)j->v + i0 * s1, (size_t)n * s1);
  plain_generic(a, pb, gb, mb, vb, 0, 8);
  memcpy((char *)j->p + i0 * ps, pb, (size_t)n * ps);
  memcpy((char *)j->g + i0 * ps, gb, (size_t)n * ps);
  memcpy((char *)j->m + i0 * s0, mb, (size_t)n * s0);
  if (two) memcpy((char *)j->v + i0 * s1, vb, (size_t)n * s1);
}

static void run(const fs_job *j) {
  const fs_args *a = j->a;
  const int q = a->fmt[0] >= FS_I8 || (a->moments == 2 && a->fmt[1] >= FS_I8);
  if (q) { /* 8-bit buffers are whole blocks, and blocks are multiples of 8 */
    run_blocks(a, j->p, j->g, j->m, j->ms, j->v, j->vs, j->lo, j->hi);
    return;
  }
  const int64_t body = j->lo + (j->hi - j->lo) / 8 * 8;
  plain_of(a)(a, j->p, j->g, j->m, j->v, j->lo, body);
  if (body < j->hi) run_tail(j, body, (int)(j->hi - body));
}

static void *run_thread(void *job) {
  run((const fs_job *)job);
  return NULL;
}

#define MAX_THREADS 256
#define MIN_TILES_PER_THREAD 64 /* 32768 elements: a thread's start costs ~20 us */

/* Steps n elements in place on `threads` threads (ranges of whole tiles: a block never
 * straddles two). Returns 0. */
int fs_step(const fs_args *a, void *p, void *g, void *m, float *ms, void *v, float *vs, int64_t n,
            int threads) {
  const int64_t tiles = (n + TILE - 1) / TILE;
  if (threads > MAX_THREADS) threads = MAX_THREADS;
  if (threads > tiles / MIN_TILES_PER_THREAD) threads = (int)(tiles / MIN_TILES_PER_THREAD);
  if (threads < 1) threads = 1;
  const int64_t per = (tiles + threads - 1) / threads * TILE;
  fs_job jobs[MAX_THREADS];
  pthread_t ids[MAX_THREADS];
  int started[MAX_THREADS];
  for (int t = 0; t < threads; t++) {
    const int64_t lo = t * per < n ? t * per : n, hi = (t + 1) * per < n ? (t + 1) * per : n;
    jobs[t] = (fs_job){a, p, g, m, v, ms, vs, lo, hi};
    started[t] = t > 0 && pthread_create(&ids[t], NULL, run_thread, &jobs[t]) == 0;
  }
  for (int t = 0; t < threads; t++)
    if (!started[t]) run(&jobs[t]); /* the caller's share, and any thread that did not start */
  for (int t = 1; t < threads; t++)
    if (started[t]) pthread_join(ids[t], NULL);
  return 0;
}
