/* Digits classifier: logistic regression over FEATURES pixels (0-16), core ABI v1
 * (../../core/ABI.md). weights.h (train.py) sets FEATURES: 64 for 8x8 images, 784 for 28x28. */
#include "meshfn_core.h"
#include "meshfn_metadata.h"
#include "weights.h"

#define CLASSES 10
#define MAX_ROWS 4096

__attribute__((export_name("meshfn_infer"))) i64 meshfn_infer(const char *req, u32 len) {
  const char *end = req + len;
  /* A value takes at least two characters of JSON and more than one of base64. */
  u32 max = len / 2 + 1 < FEATURES * MAX_ROWS ? len / 2 + 1 : FEATURES * MAX_ROWS;
  double *x = (double *)mf_alloc(sizeof(double) * max);
  if (!x) return mf_error(MF_OUT_OF_MEMORY, "cannot allocate the input buffer");
  i32 n = mf_read_f32(req, end, x, max);
  if (n < 0 || n % FEATURES) return mf_error(MF_BAD_REQUEST, "pixels must be whole rows of the image (at most 4096 rows)");
  u32 rows = (u32)n / FEATURES;
  mf_buf out = mf_buf_new(256 + rows * (CLASSES * 12 + 8));
  mf_put(&out, "{\"outputs\":[{\"name\":\"label\",\"datatype\":\"INT64\",\"shape\":[");
  mf_put_u64(&out, rows);
  mf_put(&out, "],\"data\":[");
  double *probs = (double *)mf_alloc(sizeof(double) * CLASSES * (rows ? rows : 1));
  if (!probs) return mf_error(MF_OUT_OF_MEMORY, "cannot allocate the output buffer");
  for (u32 r = 0; r < rows; r++) {
    const double *row = x + r * FEATURES;
    double logits[CLASSES], top = -1e300, total = 0.0;
    u32 best = 0;
    for (u32 k = 0; k < CLASSES; k++) {
      double z = B[k];
      for (u32 i = 0; i < FEATURES; i++) z += W[k][i] * (row[i] / 16.0);
      logits[k] = z;
      if (z > top) { top = z; best = k; }
    }
    for (u32 k = 0; k < CLASSES; k++) { logits[k] = mf_exp(logits[k] - top); total += logits[k]; }
    for (u32 k = 0; k < CLASSES; k++) probs[r * CLASSES + k] = logits[k] / total;
    if (r) mf_put(&out, ",");
    mf_put_u64(&out, best);
  }
  mf_put(&out, "]},{\"name\":\"probabilities\",\"datatype\":\"FP32\",\"shape\":[");
  mf_put_u64(&out, rows);
  mf_put(&out, ",10],\"data\":[");
  for (u32 i = 0; i < rows * CLASSES; i++) {
    if (i) mf_put(&out, ",");
    mf_put_f64(&out, probs[i]);
  }
  mf_put(&out, "]}]}");
  if (out.overflow) return mf_error(MF_INTERNAL, "response buffer overflow");
  return mf_result(MF_OK, out.p, out.len);
}
