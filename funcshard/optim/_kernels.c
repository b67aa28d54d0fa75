/* One-pass CPU step of fs.optim.adamw / sgd with moments stored narrow (funcshard.optim.kernels).
 *
 * Per tile of TILE elements: load the param and grad, decode the stored moments to fp32, step,
 * store the param, encode the moments; the tile stays in L1, so memory is read and written once.
 *
 * The results must equal, bit for bit, funcshard's torch path: decode with torch ops, torch's
 * fused fp32 CPU kernel (the vector body of aten/src/ATen/native/cpu/FusedAdamKernel.cpp and
 * FusedSGDKernel.cpp as torch's AVX2 build compiles them), encode with torch ops. So:
 *  - every operation is one IEEE fp32 operation in torch's order, and the file is compiled
 *    with -ffp-contract=off: a fused multiply-add appears exactly where torch's binary has one,
 *    as an explicit fmaf (its explicit vec::fmadd, and the two places where the compiler of
 *    torch's build contracted a multiply and an add: the second moment's update and SGD's
 *    param update; tests/test_kernels.py checks all of them against torch);
 *  - conversions round as torch's do (bf16 and fp16: to nearest even; 8-bit: nearest even).
 * NaN payloads are not matched (torch's own vector and scalar loops disagree on them).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include <immintrin.h>

enum { FS_F32 = 0, FS_BF16 = 1, FS_F16 = 2, FS_I8 = 3, FS_U8 = 4 };
enum { FS_ADAMW = 0, FS_SGD = 1 };

/* Elements per tile: a multiple of every 8-bit block (powers of two <= 256) and of 8 lanes. */
#define TILE 512

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

static const float I8_FACTOR = (float)(1.0 / 16129.0);        /* 1 / 127^2 */
static const float U8_FACTOR = (float)(1.0 / 4228250625.0);   /* 1 / 255^4 */
static const float I8_TOP = 16129.0f;                         /* 127^2 */
static const float U8_TOP = (float)4228250625.0;              /* 255^4, rounded as torch does */

static inline uint32_t bits_of(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}

static inline float float_of(uint32_t u) {
  float x;
  memcpy(&x, &u, 4);
  return x;
}

static inline uint16_t bf16_of(float x) { /* c10::BFloat16's round to nearest even */
  uint32_t u = bits_of(x);
  return x != x ? (uint16_t)0x7fc0 : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* --- fp32 tiles from and to storage ------------------------------------------------------ */
static void load(int dtype, const void *src, int64_t i0, int len, float *dst) {
  int i = 0;
  switch (dtype) {
    case FS_F32:
      memcpy(dst, (const float *)src + i0, (size_t)len * 4);
      break;
    case FS_BF16: {
      const uint16_t *s = (const uint16_t *)src + i0;
      for (i = 0; i < len; i++) dst[i] = float_of((uint32_t)s[i] << 16);
      break;
    }
    case FS_F16: {
      const uint16_t *s = (const uint16_t *)src + i0;
      for (; i + 8 <= len; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
      for (; i < len; i++) dst[i] = _cvtsh_ss(s[i]);
      break;
    }
  }
}

static void store(int dtype, void *dst, int64_t i0, int len, const float *src) {
  int i = 0;
  switch (dtype) {
    case FS_F32:
      memcpy((float *)dst + i0, src, (size_t)len * 4);
      break;
    case FS_BF16: {
      uint16_t *d = (uint16_t *)dst + i0;
      for (i = 0; i < len; i++) d[i] = bf16_of(src[i]);
      break;
    }
    case FS_F16: {
      uint16_t *d = (uint16_t *)dst + i0;
      for (; i + 8 <= len; i += 8)
        _mm_storeu_si128((__m128i *)(d + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
      for (; i < len; i++) d[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
      break;
    }
  }
}

/* --- 8-bit blocks (funcshard.optim.moments.MomentFormat.decode / encode) ------------------- */
static void decode_i8(const int8_t *q, float scale, int len, float *dst) {
  const float factor = scale * I8_FACTOR;
  for (int i = 0; i < len; i++) {
    const float x = (float)q[i];
    dst[i] = (x * fabsf(x)) * factor;
  }
}

static void decode_u8(const uint8_t *q, float scale, int len, float *dst) {
  const float factor = scale * U8_FACTOR;
  for (int i = 0; i < len; i++) {
    const float x = (float)q[i];
    const float x2 = x * x;
    dst[i] = (x2 * x2) * factor;
  }
}

static float absmax(const float *x, int len, int signed_) {
  /* max is exact, so the order of the reduction does not matter; a NaN anywhere makes the
   * block's scale NaN, as torch.amax does (its bits are not matched) */
  const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(signed_ ? 0x7fffffff : -1));
  __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= len; i += 16) {
    const __m256 u = _mm256_and_ps(_mm256_loadu_ps(x + i), mask);
    const __m256 v = _mm256_and_ps(_mm256_loadu_ps(x + i + 8), mask);
    a = _mm256_max_ps(a, u);
    b = _mm256_max_ps(b, v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(u, v, _CMP_UNORD_Q));
  }
  float lanes[8], m = 0.0f;
  int any_nan = _mm256_movemask_ps(nan) != 0;
  _mm256_storeu_ps(lanes, _mm256_max_ps(a, b));
  for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
  for (; i < len; i++) {
    const float v = signed_ ? fabsf(x[i]) : x[i];
    m = v > m ? v : m;
    any_nan |= v != v;
  }
  return any_nan ? NAN : m;
}

/* round half to even of 0 <= y < 2^23 (torch.round_), as an add and a subtract */
static inline float round_even(float y) { return (y + 8388608.0f) - 8388608.0f; }

/* torch.sqrt_ on the CPU is MKL's vmsSqrt (ATen/cpu/vml.h), which is not IEEE's correctly
 * rounded sqrt (on an AMD EPYC it differs in ~20% of [0, 65025]): the 8-bit encode calls the
 * very function torch calls, found in libtorch_cpu by funcshard.optim.kernels. */
typedef void (*fs_vml_fn)(int64_t n, const float *in, float *out, int64_t mode);
static fs_vml_fn vml_sqrt = 0;
static int64_t vml_mode = 0;

void fs_set_sqrt(void *fn, int64_t mode) {
  vml_sqrt = (fs_vml_fn)fn;
  vml_mode = mode;
}

static void torch_sqrt(float *x, int len) {
  if (vml_sqrt) {
    vml_sqrt(len, x, x, vml_mode);
  } else {
    for (int i = 0; i < len; i++) x[i] = sqrtf(x[i]);
  }
}

/* A tile of 8-bit blocks: scales, then |x| * (top / scale) per block, torch's sqrt (twice for
 * the fourth root of uint8), round half to even, the sign back for int8. */
static void encode_8bit(int fmt, int block, const float *x, int len, void *values, float *scales) {
  float y[TILE];
  const int signed_ = fmt == FS_I8;
  const float top = signed_ ? I8_TOP : U8_TOP;
  for (int b = 0; b < len; b += block) {
    const float m = absmax(x + b, block, signed_);
    scales[b / block] = m;
    const float factor = (1.0f / (m > 0.0f ? m : 1.0f)) * top; /* torch: top / safe */
    if (signed_)
      for (int i = b; i < b + block; i++) y[i] = fabsf(x[i]) * factor;
    else
      for (int i = b; i < b + block; i++) y[i] = x[i] * factor;
  }
  torch_sqrt(y, len);
  if (signed_) {
    int8_t *q = (int8_t *)values;
    for (int i = 0; i < len; i++) q[i] = (int8_t)copysignf(round_even(y[i]), x[i]);
  } else {
    torch_sqrt(y, len);
    uint8_t *q = (uint8_t *)values;
    for (int i = 0; i < len; i++) q[i] = (uint8_t)round_even(y[i]);
  }
}

static void decode(int fmt, int block, const void *values, const float *scales, int64_t i0,
                   int len, float *dst) {
  if (fmt == FS_I8 || fmt == FS_U8) {
    for (int b = 0; b < len; b += block) {
      const float s = scales[(i0 + b) / block];
      if (fmt == FS_I8)
        decode_i8((const int8_t *)values + i0 + b, s, block, dst + b);
      else
        decode_u8((const uint8_t *)values + i0 + b, s, block, dst + b);
    }
    return;
  }
  load(fmt, values, i0, len, dst);
}

static void encode(int fmt, int block, int stochastic, void *values, float *scales, int64_t i0,
                   int len, const float *x, const float *p, const float *g) {
  if (fmt == FS_I8 || fmt == FS_U8) {
    encode_8bit(fmt, block, x, len, (int8_t *)values + i0, scales + i0 / block);
    return;
  }
  if (stochastic) { /* x + (p ^ g) & 0xffff, truncated: already a bf16, so stored exactly */
    uint16_t *d = (uint16_t *)values + i0;
    for (int i = 0; i < len; i++) {
      const uint32_t u = (bits_of(x[i]) + ((bits_of(p[i]) ^ bits_of(g[i])) & 0xffffu)) &
                         0xffff0000u;
      d[i] = bf16_of(float_of(u));
    }
    return;
  }
  store(fmt, values, i0, len, x);
}

/* --- the fp32 steps: torch's fused vector bodies, element by element ------------------------ */
static void adamw_tile(const fs_args *a, float *restrict p, float *restrict g, float *restrict m,
                       float *restrict v, int len) {
  const float inv = a->inv_scale, df = a->decay_factor, w = a->lerp_weight, b2 = a->beta2;
  const float c2 = a->one_minus_beta2, bc = a->bc2_sqrt, eps = a->eps, ns = a->neg_step_size;
  const int scaled = a->scaled, decay = a->decay, small = a->lerp_small;
  for (int i = 0; i < len; i++) {
    float gi = g[i], pi = p[i], mi = m[i];
    if (scaled) gi = gi / inv;
    if (decay) pi = pi * df;
    mi = fmaf(w, gi - mi, small ? mi : gi);          /* exp_avg.lerp_(grad, 1 - beta1) */
    const float vi = fmaf(c2 * gi, gi, v[i] * b2);   /* contracted in torch's build */
    const float denom = sqrtf(vi) / bc + eps;
    p[i] = pi + (ns * mi) / denom;
    g[i] = gi;
    m[i] = mi;
    v[i] = vi;
  }
}

static void sgd_tile(const fs_args *a, float *restrict p, float *restrict g, float *restrict m,
                     int len) {
  const float inv = a->inv_scale, wd = a->decay_factor, mom = a->momentum, nlr = a->neg_lr;
  const int scaled = a->scaled, decay = a->decay, nesterov = a->nesterov;
  for (int i = 0; i < len; i++) {
    float gi = g[i];
    const float pi = p[i];
    if (scaled) gi = gi / inv;
    g[i] = gi;
    if (decay) gi = fmaf(pi, wd, gi);
    const float mi = fmaf(1.0f, gi, m[i] * mom); /* 1 - dampening, dampening 0 */
    m[i] = mi;
    gi = nesterov ? fmaf(mi, mom, gi) : mi;
    p[i] = fmaf(gi, nlr, pi); /* contracted in torch's build */
  }
}

/* --- a range of elements, and the threads ----------------------------------------------- */
typedef struct {
  const fs_args *a;
  void *p, *g, *m, *v;
  float *ms, *vs;
  int64_t lo, hi;
} fs_job;

static void run(const fs_job *j) {
  const fs_args *a = j->a;
  float P[TILE], G[TILE], M[TILE], V[TILE];
  void *values[2] = {j->m, j->v};
  float *scales[2] = {j->ms, j->vs};
  float *moment[2] = {M, V};
  for (int64_t i0 = j->lo; i0 < j->hi; i0 += TILE) {
    const int len = (int)(j->hi - i0 < TILE ? j->hi - i0 : TILE);
    load(a->param_dtype, j->p, i0, len, P);
    load(a->param_dtype, j->g, i0, len, G);
    for (int k = 0; k < a->moments; k++)
      decode(a->fmt[k], a->block[k], values[k], scales[k], i0, len, moment[k]);
    if (a->rule == FS_ADAMW)
      adamw_tile(a, P, G, M, V, len);
    else
      sgd_tile(a, P, G, M, len);
    store(a->param_dtype, j->p, i0, len, P);
    if (a->write_grad) store(a->param_dtype, j->g, i0, len, G);
    for (int k = 0; k < a->moments; k++)
      encode(a->fmt[k], a->block[k], a->stochastic[k], values[k], scales[k], i0, len, moment[k],
             P, G);
  }
}

static void *run_thread(void *job) {
  run((const fs_job *)job);
  return NULL;
}

#define MAX_THREADS 256

/* Steps n elements in place on `threads` threads (ranges of whole tiles, so never a split
 * block). Returns 0. */
int fs_step(const fs_args *a, void *p, void *g, void *m, float *ms, void *v, float *vs, int64_t n,
            int threads) {
  const int64_t tiles = (n + TILE - 1) / TILE;
  if (threads > MAX_THREADS) threads = MAX_THREADS;
  if (threads > tiles) threads = (int)tiles;
  if (threads < 1) threads = 1;
  const int64_t per = (tiles + threads - 1) / threads * TILE;
  fs_job jobs[MAX_THREADS];
  pthread_t ids[MAX_THREADS];
  int started[MAX_THREADS];
  for (int t = 0; t < threads; t++) {
    const int64_t lo = t * per, hi = (t + 1) * per < n ? (t + 1) * per : n;
    jobs[t] = (fs_job){a, p, g, m, v, ms, vs, lo < n ? lo : n, hi};
    started[t] = t > 0 && pthread_create(&ids[t], NULL, run_thread, &jobs[t]) == 0;
  }
  for (int t = 0; t < threads; t++)
    if (!started[t]) run(&jobs[t]); /* the caller's share, and any thread that did not start */
  for (int t = 1; t < threads; t++)
    if (started[t]) pthread_join(ids[t], NULL);
  return 0;
}
