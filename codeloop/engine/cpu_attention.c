/* Attention of one query token per row over a span of a KV cache slot, on a CPU: the steps of
   codeloop's in-process engine (cpu_attention.py compiles and calls it).

   For row b and KV head h, the `group` queries q[b, h] attend to the keys and values of columns
   starts[b] <= c < ends[b] of slot s = slots[b] (keys + s * row_stride + h * head_stride +
   c * dim; slots NULL: s = b), softmax in float32; the result goes to out[b, h]. Several rows
   may read one slot: the tokens of one prompt's chunk, each with its causal span. q and out are [rows, kv_heads, group, dim],
   contiguous. Each (row, head) pair is one task of an OpenMP loop over `threads` threads: it
   reads its keys once for the scores and its values once for the sum, with no mask and nothing
   outside its span. Vectors of 16 floats (GCC/clang vector extensions, which the compiler maps
   to the CPU's SIMD registers), so dim is a multiple of 16; a task's body is inlined for head
   sizes 64, 128 and 256 as constants (a column's key in registers, its loops unrolled: ~1.1x
   the generic body's speed in float32 and ~1.3x in bfloat16 at SmolLM2's shapes on a 2-core
   AMD EPYC). Returns 0; 1 when dim or group is out of range; 2 when a buffer could not be
   allocated. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DIM 512
#define MAX_GROUP 16
#define LANES 16

typedef float vec __attribute__((vector_size(4 * LANES)));
typedef uint16_t half_vec __attribute__((vector_size(2 * LANES)));
typedef uint32_t word_vec __attribute__((vector_size(4 * LANES)));

static inline vec load_f32(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vec load_bf16(const uint16_t *p) { /* bfloat16 is float32's upper half */
    half_vec h;
    memcpy(&h, p, sizeof h);
    word_vec w = __builtin_convertvector(h, word_vec) << 16;
    vec v;
    memcpy(&v, &w, sizeof v);
    return v;
}

static inline float store_f32(float f) { return f; }

static inline uint16_t store_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float lane_sum(vec v) { /* a tree, not a chain of 15 dependent additions */
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
}

/* e^x for x <= 0 (a score minus the row's largest), relative error under 2e-7: 2^n e^r with
   |r| <= ln2/2, e^r by its degree-6 Taylor polynomial; n rounded by adding and subtracting
   1.5 * 2^23, so that the loop over scores vectorises. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (0.16666667f + r * (0.041666668f +
              r * (0.008333334f + r * 0.0013888889f)))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

typedef int32_t int_vec __attribute__((vector_size(4 * LANES)));

static inline vec vmax(vec a, vec b) { /* lane-wise; a comparison's lanes are all ones or 0 */
    const int_vec a_wins = a > b;
    return (vec)(((int_vec)a & a_wins) | ((int_vec)b & ~a_wins));
}

/* exp_nonpositive on 16 lanes at once: the same steps, written on vectors (the compiler does
   not vectorise the scalar one's bit casts) */
static inline vec exp_nonpositive_vec(vec x) {
    x = vmax(x, (vec){0} - 87.0f);
    const vec n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const vec r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    const vec p = 1.0f + r * (1.0f + r * (0.5f + r * (0.16666667f + r * (0.041666668f +
                  r * (0.008333334f + r * 0.0013888889f)))));
    const int_vec bits = (__builtin_convertvector(n, int_vec) + 127) << 23;
    vec scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* softmax of scores[0..len) in place, 16 lanes at a time (the tail one by one) */
static inline void softmax(float *scores, int64_t len) {
    const int64_t whole = len / LANES * LANES;
    float top = scores[0];
    if (whole) {
        vec most = load_f32(scores);
        for (int64_t t = LANES; t < whole; t += LANES) {
            const vec v = load_f32(scores + t);
            most = vmax(v, most);
        }
        for (int64_t l = 0; l < LANES; l++) top = most[l] > top ? most[l] : top;
    }
    for (int64_t t = whole; t < len; t++) top = scores[t] > top ? scores[t] : top;
    vec sums = (vec){0};
    for (int64_t t = 0; t < whole; t += LANES) {
        const vec e = exp_nonpositive_vec(load_f32(scores + t) - top);
        memcpy(scores + t, &e, sizeof e);
        sums += e;
    }
    float total = lane_sum(sums);
    for (int64_t t = whole; t < len; t++) {
        scores[t] = exp_nonpositive(scores[t] - top);
        total += scores[t];
    }
    const float inv = 1.0f / total;
    for (int64_t t = 0; t < whole; t += LANES) {
        const vec v = load_f32(scores + t) * inv;
        memcpy(scores + t, &v, sizeof v);
    }
    for (int64_t t = whole; t < len; t++) scores[t] *= inv;
}

/* One (row, KV head) task: the `group` queries qh attend to the `len` keys kh and values vh
   (consecutive columns of `dim` = width * LANES); the result to oh. Inlined with a constant
   `width` for the common head sizes (64, 128, 256), so that a column's key stays in registers
   and the loops over it unroll. */
#define TASK(NAME, T, LOAD, STORE)                                                             \
static inline __attribute__((always_inline)) void NAME(                                       \
        const T *qh, const T *kh, const T *vh, T *oh, int64_t len, int64_t group,             \
        const int64_t width, float scale, float *scores) {                                     \
    const int64_t dim = width * LANES;                                                         \
    vec qs[MAX_GROUP * MAX_DIM / LANES], acc[MAX_GROUP * MAX_DIM / LANES];                     \
    vec row[MAX_DIM / LANES];                                                                  \
    for (int64_t i = 0; i < group * width; i++) {                                              \
        qs[i] = LOAD(qh + i * LANES) * scale;                                                  \
        acc[i] = (vec){0};                                                                     \
    }                                                                                          \
    for (int64_t t = 0; t < len; t++) {                                                        \
        for (int64_t v = 0; v < width; v++) row[v] = LOAD(kh + t * dim + v * LANES);           \
        for (int64_t g = 0; g < group; g++) {                                                  \
            vec s = qs[g * width] * row[0];                                                    \
            for (int64_t v = 1; v < width; v++) s += qs[g * width + v] * row[v];               \
            scores[g * len + t] = lane_sum(s);                                                 \
        }                                                                                      \
    }                                                                                          \
    for (int64_t g = 0; g < group; g++) softmax(scores + g * len, len);                        \
    for (int64_t t = 0; t < len; t++) {                                                        \
        for (int64_t v = 0; v < width; v++) row[v] = LOAD(vh + t * dim + v * LANES);           \
        for (int64_t g = 0; g < group; g++) {                                                  \
            const float p = scores[g * len + t];                                               \
            for (int64_t v = 0; v < width; v++) acc[g * width + v] += p * row[v];              \
        }                                                                                      \
    }                                                                                          \
    for (int64_t i = 0; i < group * dim; i++) oh[i] = STORE(acc[i / LANES][i % LANES]);        \
}

TASK(task_bf16, uint16_t, load_bf16, store_bf16)
TASK(task_f32, float, load_f32, store_f32)

#define KERNEL(NAME, T, TASK_FN, STORE)                                                        \
int NAME(const T *q, const T *keys, const T *values, T *out, const int64_t *slots,            \
         const int64_t *starts, const int64_t *ends, int64_t rows, int64_t kv_heads,          \
         int64_t group, int64_t dim, int64_t row_stride, int64_t head_stride, float scale, int threads) {                 \
    if (dim % LANES || dim > MAX_DIM || group < 1 || group > MAX_GROUP) return 1;             \
    const int64_t width = dim / LANES;                                                         \
    int64_t longest = 1;                                                                       \
    for (int64_t b = 0; b < rows; b++)                                                         \
        if (ends[b] - starts[b] > longest) longest = ends[b] - starts[b];                     \
    int failed = 0;                                                                            \
    _Pragma("omp parallel num_threads(threads)")                                               \
    {                                                                                          \
        float *scores = malloc(sizeof(float) * (size_t)(group * longest));                    \
        if (!scores) {                                                                         \
            _Pragma("omp atomic write") failed = 2;                                            \
        }                                                                                      \
        _Pragma("omp for collapse(2) schedule(static)")                                        \
        for (int64_t b = 0; b < rows; b++) {                                                   \
            for (int64_t h = 0; h < kv_heads; h++) {                                           \
                const int64_t start = starts[b], len = ends[b] - starts[b];                   \
                T *oh = out + (b * kv_heads + h) * group * dim;                                \
                if (!scores || len <= 0) { /* nothing to attend to: zeros */                   \
                    for (int64_t i = 0; i < group * dim; i++) oh[i] = STORE(0.0f);             \
                    continue;                                                                  \
                }                                                                              \
                const T *qh = q + (b * kv_heads + h) * group * dim;                            \
                const int64_t base = (slots ? slots[b] : b) * row_stride + h * head_stride;   \
                const T *kh = keys + base + start * dim, *vh = values + base + start * dim;   \
                switch (width) {                                                               \
                case 4: TASK_FN(qh, kh, vh, oh, len, group, 4, scale, scores); break;          \
                case 8: TASK_FN(qh, kh, vh, oh, len, group, 8, scale, scores); break;          \
                case 16: TASK_FN(qh, kh, vh, oh, len, group, 16, scale, scores); break;        \
                default: TASK_FN(qh, kh, vh, oh, len, group, width, scale, scores);            \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        free(scores);                                                                          \
    }                                                                                          \
    return failed;                                                                             \
}

KERNEL(decode_attention_bf16, uint16_t, task_bf16, store_bf16)
KERNEL(decode_attention_f32, float, task_f32, store_f32)

/* Attention of the tokens of prompt chunks, each chunk consecutive rows of one slot: rows
   firsts[c] <= b < lasts[c] read slot chunk_slots[c], row b its columns starts[b] <= col <
   ends[b]. Where the kernel above reads a row's keys once a token, this one takes TILE tokens
   (x group queries) of a chunk and a KV head as one task and reads the keys and values of
   their span once: keys transposed in blocks of 16 columns and values in float32, then each
   block's scores for QUADS queries at a time as 16-lane multiply-adds (independent chains, no
   horizontal sums), softmax in float32 as above, and the weighted sums of values for 4
   queries x 4 vectors of dimensions at a time (16 sums held in registers, each value vector
   loaded once for 4 queries). */
#define TILE 32
#define QUADS 8

static inline float load_f32_one(float f) { return f; }
static inline float load_bf16_one(uint16_t h) {
    uint32_t w = (uint32_t)h << 16;
    float f;
    memcpy(&f, &w, sizeof f);
    return f;
}

#define CHUNK_KERNEL(NAME, T, LOAD, STORE)                                                     \
int NAME(const T *q, const T *keys, const T *values, T *out, const int64_t *firsts,           \
         const int64_t *lasts, const int64_t *chunk_slots, const int64_t *starts,             \
         const int64_t *ends, int64_t chunks, int64_t kv_heads, int64_t group, int64_t dim,   \
         int64_t row_stride, int64_t head_stride, float scale, int threads) {                 \
    if (dim % LANES || dim > MAX_DIM || group < 1 || group > MAX_GROUP) return 1;             \
    int64_t tiles = 0, longest = 1;                                                            \
    for (int64_t c = 0; c < chunks; c++) {                                                     \
        tiles += (lasts[c] - firsts[c] + TILE - 1) / TILE;                                     \
        for (int64_t b = firsts[c]; b < lasts[c]; b++)                                         \
            if (ends[b] - starts[b] + TILE > longest) longest = ends[b] - starts[b] + TILE;   \
    }                                                                                          \
    int64_t *tile_chunk = malloc(sizeof(int64_t) * (size_t)(tiles + 1));                      \
    int64_t *tile_first = malloc(sizeof(int64_t) * (size_t)(tiles + 1));                      \
    if (!tile_chunk || !tile_first) { free(tile_chunk); free(tile_first); return 2; }          \
    int64_t k = 0;                                                                             \
    for (int64_t c = 0; c < chunks; c++)                                                       \
        for (int64_t b = firsts[c]; b < lasts[c]; b += TILE) {                                 \
            tile_chunk[k] = c;                                                                 \
            tile_first[k++] = b;                                                               \
        }                                                                                      \
    const int64_t width = dim / LANES, most = TILE * group + QUADS;                            \
    const int64_t widest = (longest + 2 * LANES - 1) / LANES * LANES;                          \
    int failed = 0;                                                                            \
    _Pragma("omp parallel num_threads(threads)")                                               \
    {                                                                                          \
        float *qs = calloc((size_t)(most * dim), sizeof(float));                               \
        float *scores = malloc(sizeof(float) * (size_t)(most * widest));                       \
        float *kt = malloc(sizeof(float) * (size_t)(widest * dim));                            \
        float *vf = malloc(sizeof(float) * (size_t)(widest * dim + 4 * LANES));                \
        const int ok = qs && scores && kt && vf;                                               \
        if (!ok) {                                                                             \
            _Pragma("omp atomic write") failed = 2;                                            \
        }                                                                                      \
        _Pragma("omp for collapse(2) schedule(dynamic)")                                       \
        for (int64_t task = 0; task < tiles; task++) {                                         \
            for (int64_t h = 0; h < kv_heads; h++) {                                           \
                if (!ok) continue;                                                             \
                const int64_t c = tile_chunk[task], first = tile_first[task];                 \
                const int64_t last = first + TILE < lasts[c] ? first + TILE : lasts[c];        \
                const int64_t count = (last - first) * group;                                  \
                const int64_t base = chunk_slots[c] * row_stride + h * head_stride;            \
                int64_t low = starts[first], high = ends[first];                               \
                for (int64_t b = first; b < last; b++) {                                       \
                    low = starts[b] < low ? starts[b] : low;                                   \
                    high = ends[b] > high ? ends[b] : high;                                    \
                }                                                                              \
                const int64_t span = high - low, blocks = (span + LANES - 1) / LANES;          \
                const int64_t stride = blocks * LANES;                                         \
                for (int64_t i = 0; i < count + QUADS; i++) {                                  \
                    float *dst = qs + i * dim;                                                 \
                    const int64_t b = first + i / group, g = i % group;                        \
                    if (i >= count) { memset(dst, 0, sizeof(float) * (size_t)dim); continue; } \
                    const T *src = q + ((b * kv_heads + h) * group + g) * dim;                 \
                    for (int64_t d = 0; d < dim; d++) dst[d] = LOAD##_one(src[d]) * scale;     \
                }                                                                              \
                for (int64_t j = 0; j < stride; j++) {                                         \
                    const int64_t t = low + j, block = j / LANES, lane = j % LANES;            \
                    float *kb = kt + block * dim * LANES + lane;                               \
                    if (t >= high) {                                                           \
                        for (int64_t d = 0; d < dim; d++) kb[d * LANES] = 0.0f;                \
                        continue;                                                              \
                    }                                                                          \
                    const T *key = keys + base + t * dim, *value = values + base + t * dim;    \
                    for (int64_t d = 0; d < dim; d++) kb[d * LANES] = LOAD##_one(key[d]);      \
                    for (int64_t w = 0; w < width; w++) {                                      \
                        vec v = LOAD(value + w * LANES);                                       \
                        memcpy(vf + j * dim + w * LANES, &v, sizeof v);                        \
                    }                                                                          \
                }                                                                              \
                for (int64_t i0 = 0; i0 < count; i0 += QUADS) {                                \
                    const float *qq = qs + i0 * dim;                                           \
                    for (int64_t block = 0; block < blocks; block++) {                         \
                        const float *kb = kt + block * dim * LANES;                            \
                        vec acc[QUADS];                                                        \
                        for (int u = 0; u < QUADS; u++) acc[u] = (vec){0};                     \
                        for (int64_t d = 0; d < dim; d++) {                                    \
                            const vec key = load_f32(kb + d * LANES);                          \
                            for (int u = 0; u < QUADS; u++) acc[u] += qq[u * dim + d] * key;   \
                        }                                                                      \
                        for (int u = 0; u < QUADS; u++)                                        \
                            memcpy(scores + (i0 + u) * stride + block * LANES, &acc[u],        \
                                   sizeof(vec));                                               \
                    }                                                                          \
                }                                                                              \
                for (int64_t i = 0; i < count + QUADS; i++) { /* weights; 0 outside a span */ \
                    float *p = scores + i * stride;                                            \
                    if (i >= count) { memset(p, 0, sizeof(float) * (size_t)stride); continue; } \
                    const int64_t b = first + i / group;                                       \
                    const int64_t lo = starts[b] - low, hi = ends[b] - low;                    \
                    softmax(p + lo, hi - lo);                                                  \
                    for (int64_t t = 0; t < lo; t++) p[t] = 0.0f;                              \
                    for (int64_t t = hi; t < stride; t++) p[t] = 0.0f;                         \
                }                                                                              \
                for (int64_t i0 = 0; i0 < count; i0 += 4) { /* 4 queries x 4 vectors a pass */ \
                    const float *p = scores + i0 * stride;                                     \
                    for (int64_t w0 = 0; w0 < width; w0 += 4) {                                \
                        vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0};         \
                        vec b2 = {0}, b3 = {0}, c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0};         \
                        vec d0 = {0}, d1 = {0}, d2 = {0}, d3 = {0};                            \
                        const float *pa = p, *pb = p + stride, *pc = p + 2 * stride;           \
                        const float *pd = p + 3 * stride;                                      \
                        for (int64_t t = 0; t < span; t++) {                                   \
                            const float *vt = vf + t * dim + w0 * LANES;                       \
                            const vec v0 = load_f32(vt), v1 = load_f32(vt + LANES);            \
                            const vec v2 = load_f32(vt + 2 * LANES), v3 = load_f32(vt + 3 * LANES); \
                            const float ta = pa[t], tb = pb[t], tc = pc[t], td = pd[t];        \
                            a0 += ta * v0; a1 += ta * v1; a2 += ta * v2; a3 += ta * v3;        \
                            b0 += tb * v0; b1 += tb * v1; b2 += tb * v2; b3 += tb * v3;        \
                            c0 += tc * v0; c1 += tc * v1; c2 += tc * v2; c3 += tc * v3;        \
                            d0 += td * v0; d1 += td * v1; d2 += td * v2; d3 += td * v3;        \
                        }                                                                      \
                        const vec a[4][4] = {{a0, a1, a2, a3}, {b0, b1, b2, b3},               \
                                             {c0, c1, c2, c3}, {d0, d1, d2, d3}};              \
                        for (int64_t u = 0; u < 4 && i0 + u < count; u++) {                   \
                            const int64_t b = first + (i0 + u) / group, g = (i0 + u) % group;  \
                            T *dst = out + ((b * kv_heads + h) * group + g) * dim;             \
                            for (int64_t x = 0; x < 4 && w0 + x < width; x++)                  \
                                for (int64_t l = 0; l < LANES; l++)                            \
                                    dst[(w0 + x) * LANES + l] = STORE(a[u][x][l]);             \
                        }                                                                      \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        free(qs);                                                                              \
        free(scores);                                                                          \
        free(kt);                                                                              \
        free(vf);                                                                              \
    }                                                                                          \
    free(tile_chunk);                                                                          \
    free(tile_first);                                                                          \
    return failed;                                                                             \
}

CHUNK_KERNEL(chunk_attention_bf16, uint16_t, load_bf16, store_bf16)
CHUNK_KERNEL(chunk_attention_f32, float, load_f32, store_f32)
