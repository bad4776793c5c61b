/* tiny-lm's step function: one decode step of a byte-level GRU language model for a batch of
 * streams, as a core ABI v2 module (../../core/ABI.md, version 2). The inference backend owns
 * everything around it: each stream's recurrent state between steps, tokenisation (bytes),
 * sampling, stop sequences, deadlines, and batching the steps of concurrent streams into one
 * call. The step is a pure function of its inputs, so any instance can run any stream's step.
 *
 *   inputs:  tokens    INT32 [B]          the token each stream feeds in (0-255 bytes, 256 end)
 *            state     FP32  [B, HIDDEN]  each stream's state before the step
 *   outputs: logits    FP32  [B, VOCAB]   scores of the next token
 *            state_out FP32  [B, HIDDEN]  each stream's state after the step
 *
 * Weights come from train.py (weights.h). The same step as an ONNX graph (Gather, MatMul, Add,
 * Sigmoid, Tanh, Mul, Sub) compiled by meshfn's model compiler has these exports and this
 * table, so it can replace this file without any change to the backend. */
#include <wasm_simd128.h>

#include "meshfn_tensor.h"
#include "meshfn_metadata.h"
#include "weights.h"

#define H HIDDEN
#define V VOCAB
#define MAX_BATCH 256

static u32 table[8];      /* tokens, state, logits, state_out: (address, bytes) each */
static u32 capacity;      /* rows the buffers hold */
static i32 planned;       /* the batch meshfn_plan laid out last (0: none) */
static i32 *tokens;
static float *state, *logits, *state_out, *gates;

__attribute__((export_name("meshfn_plan"))) u32 meshfn_plan(i32 batch) {
  if (batch < 1 || batch > MAX_BATCH) return 0;
  if ((u32)batch > capacity) {
    i32 *t = mf_alloc(4u * batch);
    float *s = mf_alloc(4u * H * batch), *l = mf_alloc(4u * V * batch);
    float *o = mf_alloc(4u * H * batch), *g = mf_alloc(12u * H * batch);
    if (!t || !s || !l || !o || !g) return 0;
    tokens = t, state = s, logits = l, state_out = o, gates = g;
    capacity = (u32)batch;
  }
  u32 sizes[4] = {4u * batch, 4u * H * batch, 4u * V * batch, 4u * H * batch};
  void *addresses[4] = {tokens, state, logits, state_out};
  for (int i = 0; i < 4; i++) {
    table[2 * i] = (u32)addresses[i];
    table[2 * i + 1] = sizes[i];
  }
  planned = batch;
  return (u32)table;
}

/* w . x over H floats (a multiple of 4). One SIMD accumulator summed lane 0..3 at the end:
 * exactly the order dot4 below uses for each of its streams, so a stream's logits are the same
 * bits whether its step ran alone or in a batch (a seeded generation does not depend on load). */
static inline float dot(const float *w, const float *x) {
  v128_t a = wasm_f32x4_splat(0);
  for (int k = 0; k < H; k += 4)
    a = wasm_f32x4_add(a, wasm_f32x4_mul(wasm_v128_load(w + k), wasm_v128_load(x + k)));
  return wasm_f32x4_extract_lane(a, 0) + wasm_f32x4_extract_lane(a, 1) +
         wasm_f32x4_extract_lane(a, 2) + wasm_f32x4_extract_lane(a, 3);
}

/* e^x in float: x = k ln2 + r, |r| <= ln2/2, a degree-6 polynomial for e^r, 2^k by exponent
 * bits. Relative error ~2e-7; inputs clamped to [-87, 87] (no infinities or subnormals). */
static inline float expf_(float x) {
  if (x > 87.0f) x = 87.0f;
  if (x < -87.0f) x = -87.0f;
  float k = __builtin_rintf(x * 1.44269504f);
  float r = x - k * 0.693145752f - k * 1.42860677e-6f;
  float p = 1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f + r * (0.0416666679f +
                                                  r * (0.00833333377f + r * 0.00138888892f)))));
  union { float f; u32 u; } s = {.u = (u32)((i32)k + 127) << 23};
  return p * s.f;
}

/* The same for four streams at once against one weight row: each weight vector is loaded once
 * for four products (a step of a batch reads its weights once per four streams, not per
 * stream), which is what makes a batched step cheaper per token than single ones. */
static inline void dot4(const float *w, const float *x0, const float *x1, const float *x2,
                        const float *x3, float *out, int stride) {
  v128_t a0 = wasm_f32x4_splat(0), a1 = a0, a2 = a0, a3 = a0;
  for (int k = 0; k < H; k += 4) {
    v128_t wk = wasm_v128_load(w + k);
    a0 = wasm_f32x4_add(a0, wasm_f32x4_mul(wk, wasm_v128_load(x0 + k)));
    a1 = wasm_f32x4_add(a1, wasm_f32x4_mul(wk, wasm_v128_load(x1 + k)));
    a2 = wasm_f32x4_add(a2, wasm_f32x4_mul(wk, wasm_v128_load(x2 + k)));
    a3 = wasm_f32x4_add(a3, wasm_f32x4_mul(wk, wasm_v128_load(x3 + k)));
  }
  v128_t *acc[4] = {&a0, &a1, &a2, &a3};
  for (int i = 0; i < 4; i++)
    out[i * stride] = wasm_f32x4_extract_lane(*acc[i], 0) + wasm_f32x4_extract_lane(*acc[i], 1) +
                      wasm_f32x4_extract_lane(*acc[i], 2) + wasm_f32x4_extract_lane(*acc[i], 3);
}

/* out[b * stride + j] = rows[j] . x[b] + bias[j] for every row j < n and stream b < batch. */
static void project(const float *rows, const float *bias, int n, const float *x, i32 batch,
                    float *out, int stride) {
  for (int j = 0; j < n; j++) {
    const float *row = rows + j * H;
    i32 b = 0;
    for (; b + 4 <= batch; b += 4) {
      dot4(row, x + b * H, x + (b + 1) * H, x + (b + 2) * H, x + (b + 3) * H, out + b * stride + j,
           stride);
      for (int i = 0; i < 4; i++) out[(b + i) * stride + j] += bias[j];
    }
    for (; b < batch; b++) out[b * stride + j] = dot(row, x + b * H) + bias[j];
  }
}

static inline float sigmoid(float x) { return 1.0f / (1.0f + expf_(-x)); }
static inline float tanh_(float x) { return 1.0f - 2.0f / (expf_(2.0f * x) + 1.0f); }

__attribute__((export_name("meshfn_run"))) i32 meshfn_run(i32 batch) {
  if (!planned || batch != planned) return mf_fail(MF_BAD_REQUEST, "meshfn_run without meshfn_plan for this batch");
  for (i32 b = 0; b < batch; b++)
    if (tokens[b] < 0 || tokens[b] >= V) return mf_fail(MF_BAD_REQUEST, "a token id is outside the vocabulary");
  /* recurrent projections: one weight row at a time against every stream's state */
  project(WH, BH, 3 * H, state, batch, gates, 3 * H);
  for (i32 b = 0; b < batch; b++) {
    const float *x = X + tokens[b] * 3 * H, *g = gates + b * 3 * H, *h = state + b * H;
    float *out = state_out + b * H;
    for (int k = 0; k < H; k++) {
      float r = sigmoid(x[k] + g[k]);
      float z = sigmoid(x[H + k] + g[H + k]);
      float n = tanh_(x[2 * H + k] + r * g[2 * H + k]);
      out[k] = (1.0f - z) * n + z * h[k];
    }
  }
  project(WO, BO, V, state_out, batch, logits, V);
  return MF_OK;
}
