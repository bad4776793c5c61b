/* Chaos core function: the request parameter "mode" picks a misbehaviour (core ABI v1). */
#include "meshfn_core.h"
#include "meshfn_metadata.h"

static u64 calls;

static int has(const char *req, u32 len, const char *needle) { return mf_find(req, req + len, needle) != 0; }

__attribute__((export_name("meshfn_infer"))) i64 meshfn_infer(const char *req, u32 len) {
  calls++;
  if (has(req, len, "\"spin\"")) {
    volatile u64 n = 0;
    for (;;) n++;
  }
  if (has(req, len, "\"trap\"")) __builtin_trap();
  if (has(req, len, "\"hog\"")) {
    for (;;) {
      if (!mf_alloc(1u << 20)) return mf_error(MF_OUT_OF_MEMORY, "memory cap reached");
    }
  }
  mf_buf out = mf_buf_new(256);
  mf_put(&out, "{\"outputs\":[{\"name\":\"y\",\"datatype\":\"FP32\",\"shape\":[1],\"data\":[");
  mf_put_u64(&out, has(req, len, "\"counter\"") ? calls : 0);
  mf_put(&out, "]}]}");
  return mf_result(MF_OK, out.p, out.len);
}
