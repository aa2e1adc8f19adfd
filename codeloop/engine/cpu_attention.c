/* Attention of one query token per row over each row's span of a KV cache, on a CPU: the
   decoding step of codeloop's in-process engine (cpu_attention.py compiles and calls it).

   For row b and KV head h, the `group` queries q[b, h] attend to the keys and values of columns
   starts[b] <= c < ends[b] of that row's cache (keys + b * row_stride + h * head_stride + c * dim),
   softmax in float32; the result goes to out[b, h]. q and out are [rows, kv_heads, group, dim],
   contiguous. Each (row, head) pair is one task of an OpenMP loop over `threads` threads: it
   reads its keys once for the scores and its values once for the sum, with no mask and nothing
   outside its span. Vectors of 16 floats (GCC/clang vector extensions, which the compiler maps
   to the CPU's SIMD registers), so dim is a multiple of 16. Returns 0; 1 when dim or group is
   out of range; 2 when a buffer could not be allocated. */
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

/* softmax of scores[0..len) in place */
static inline void softmax(float *scores, int64_t len) {
    float top = scores[0];
    for (int64_t t = 1; t < len; t++) top = scores[t] > top ? scores[t] : top;
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < len; t++) {
        scores[t] = exp_nonpositive(scores[t] - top);
        total += scores[t];
    }
    const float inv = 1.0f / total;
#pragma omp simd
    for (int64_t t = 0; t < len; t++) scores[t] *= inv;
}

#define KERNEL(NAME, T, LOAD, STORE)                                                           \
int NAME(const T *q, const T *keys, const T *values, T *out, const int64_t *starts,           \
         const int64_t *ends, int64_t rows, int64_t kv_heads, int64_t group, int64_t dim,     \
         int64_t row_stride, int64_t head_stride, float scale, int threads) {                 \
    if (dim % LANES || dim > MAX_DIM || group < 1 || group > MAX_GROUP) return 1;             \
    const int64_t width = dim / LANES;                                                         \
    int64_t longest = 1;                                                                       \
    for (int64_t b = 0; b < rows; b++)                                                         \
        if (ends[b] - starts[b] > longest) longest = ends[b] - starts[b];                     \
    int failed = 0;                                                                            \
    _Pragma("omp parallel num_threads(threads)")                                               \
    {                                                                                          \
        float *scores = malloc(sizeof(float) * (size_t)(group * longest));                    \
        vec qs[MAX_GROUP * MAX_DIM / LANES], acc[MAX_GROUP * MAX_DIM / LANES];                 \
        vec row[MAX_DIM / LANES];                                                              \
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
                const T *kh = keys + b * row_stride + h * head_stride + start * dim;           \
                const T *vh = values + b * row_stride + h * head_stride + start * dim;         \
                for (int64_t i = 0; i < group * width; i++) {                                  \
                    qs[i] = LOAD(qh + i * LANES) * scale;                                      \
                    acc[i] = (vec){0};                                                         \
                }                                                                              \
                for (int64_t t = 0; t < len; t++) {                                            \
                    for (int64_t v = 0; v < width; v++) row[v] = LOAD(kh + t * dim + v * LANES); \
                    for (int64_t g = 0; g < group; g++) {                                      \
                        vec s = qs[g * width] * row[0];                                        \
                        for (int64_t v = 1; v < width; v++) s += qs[g * width + v] * row[v];   \
                        scores[g * len + t] = lane_sum(s);                                     \
                    }                                                                          \
                }                                                                              \
                for (int64_t g = 0; g < group; g++) softmax(scores + g * len, len);            \
                for (int64_t t = 0; t < len; t++) {                                            \
                    for (int64_t v = 0; v < width; v++) row[v] = LOAD(vh + t * dim + v * LANES); \
                    for (int64_t g = 0; g < group; g++) {                                      \
                        const float p = scores[g * len + t];                                   \
                        for (int64_t v = 0; v < width; v++) acc[g * width + v] += p * row[v];  \
                    }                                                                          \
                }                                                                              \
                for (int64_t i = 0; i < group * dim; i++)                                      \
                    oh[i] = STORE(acc[i / LANES][i % LANES]);                                  \
            }                                                                                  \
        }                                                                                      \
        free(scores);                                                                          \
    }                                                                                          \
    return failed;                                                                             \
}

KERNEL(decode_attention_bf16, uint16_t, load_bf16, store_bf16)
KERNEL(decode_attention_f32, float, load_f32, store_f32)
