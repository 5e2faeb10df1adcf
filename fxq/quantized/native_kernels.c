/* fxq native kernels: exact requantization of float accumulators in one pass.
 *
 * acc holds exact integers (float32 below 2**24, float64 below 2**53); the
 * multiplier r[c] = m[c] * 2**-shift[c] is exact in double, and |acc * m|
 * < 2**53, so acc * r is exact in double and rounding it is the integer
 * shift-with-rounding of docs/arithmetic.md. Layout: acc[outer][channels][inner].
 * Built and loaded by fxq/quantized/native.py; fxq.quantized.functional has
 * the same computation in torch and the tests compare the two bit for bit.
 */
#include <math.h>
#include <stdint.h>

#define REQUANT(NAME, IN_T, OUT_T)                                                       \
    void NAME(const IN_T *acc, int64_t outer, int64_t channels, int64_t inner,           \
              const double *r, double lo, double hi, int half_even, OUT_T *out,          \
              int threads) {                                                             \
        int64_t blocks = outer * channels;                                               \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")              \
        for (int64_t b = 0; b < blocks; ++b) {                                           \
            const double rc = r[b % channels];                                           \
            const IN_T *a = acc + b * inner;                                             \
            OUT_T *o = out + b * inner;                                                  \
            if (half_even) {                                                             \
                for (int64_t i = 0; i < inner; ++i) {                                    \
                    double v = nearbyint((double)a[i] * rc);                             \
                    v = v < lo ? lo : (v > hi ? hi : v);                                 \
                    o[i] = (OUT_T)v;                                                     \
                }                                                                        \
            } else {                                                                     \
                for (int64_t i = 0; i < inner; ++i) {                                    \
                    double v = floor((double)a[i] * rc + 0.5);                           \
                    v = v < lo ? lo : (v > hi ? hi : v);                                 \
                    o[i] = (OUT_T)v;                                                     \
                }                                                                        \
            }                                                                            \
        }                                                                                \
    }

REQUANT(fxq_requant_f32_i8, float, int8_t)
REQUANT(fxq_requant_f32_i16, float, int16_t)
REQUANT(fxq_requant_f64_i8, double, int8_t)
REQUANT(fxq_requant_f64_i16, double, int16_t)
REQUANT(fxq_requant_f32_f32, float, float)
REQUANT(fxq_requant_f64_f32, double, float)

int fxq_native_version(void) { return 3; }

/* Requantization with a fused residual: the residual (exact integers) is brought
 * into the accumulator's scale with its own rounding, t = round(res * rr[c]),
 * added, the sum saturated to int32, then requantized as above. */
#define REQUANT_ADD(NAME, IN_T, OUT_T)                                                  \
    void NAME(const IN_T *acc, const float *res, int64_t outer, int64_t channels,       \
              int64_t inner, const double *r, const double *rr, double lo, double hi,   \
              int half_even, OUT_T *out, int threads) {                                 \
        int64_t blocks = outer * channels;                                              \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")             \
        for (int64_t b = 0; b < blocks; ++b) {                                          \
            const double rc = r[b % channels], rrc = rr[b % channels];                  \
            const IN_T *a = acc + b * inner;                                            \
            const float *s = res + b * inner;                                           \
            OUT_T *o = out + b * inner;                                                 \
            for (int64_t i = 0; i < inner; ++i) {                                       \
                double t = half_even ? nearbyint((double)s[i] * rrc)                    \
                                     : floor((double)s[i] * rrc + 0.5);                 \
                double x = (double)a[i] + t;                                            \
                x = x < -2147483648.0 ? -2147483648.0 : (x > 2147483647.0 ? 2147483647.0 : x); \
                double v = half_even ? nearbyint(x * rc) : floor(x * rc + 0.5);         \
                v = v < lo ? lo : (v > hi ? hi : v);                                    \
                o[i] = (OUT_T)v;                                                        \
            }                                                                           \
        }                                                                               \
    }

REQUANT_ADD(fxq_requant_add_f32_f32, float, float)
REQUANT_ADD(fxq_requant_add_f64_f32, double, float)

/* QAT training's fake quantization of float32 in one pass (fxq.quantized.functional
 * fake_quantize with exact=False and HALF_UP): v = floor(x * r[c] + 0.5f),
 * q = clamp(v, lo, hi) (a NaN stays NaN, as torch's clamp), out = q * s[c], and
 * mask = (q == v) where mask is not NULL. Every operation is one float32 IEEE
 * operation, in torch's order; built with -ffp-contract=off, so x * r + 0.5f is never
 * fused into an FMA. Work is split into chunks of at most FQ_CHUNK values of one
 * channel, so a per-tensor scale (one block) is spread over the threads too. out may
 * be x (each value is read before it is written). */
#define FQ_CHUNK 16384

void fxq_fake_quant_f32(const float *x, int64_t outer, int64_t channels, int64_t inner,
                        const float *r, const float *s, float lo, float hi, float *out,
                        uint8_t *mask, int threads) {
    const int64_t per_block = (inner + FQ_CHUNK - 1) / FQ_CHUNK;
    const int64_t tasks = outer * channels * per_block;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
        const int64_t b = t / per_block, start = (t % per_block) * FQ_CHUNK;
        const int64_t n = inner - start < FQ_CHUNK ? inner - start : FQ_CHUNK;
        const float rc = r[b % channels], sc = s[b % channels];
        const float *xi = x + b * inner + start;
        float *o = out + b * inner + start;
        if (mask) {
            uint8_t *m = mask + b * inner + start;
            for (int64_t i = 0; i < n; ++i) {
                const float v = floorf(xi[i] * rc + 0.5f);
                const float q = v < lo ? lo : (v > hi ? hi : v);
                m[i] = q == v;
                o[i] = q * sc;
            }
        } else {
            for (int64_t i = 0; i < n; ++i) {
                const float v = floorf(xi[i] * rc + 0.5f);
                const float q = v < lo ? lo : (v > hi ? hi : v);
                o[i] = q * sc;
            }
        }
    }
}
