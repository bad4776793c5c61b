/* meshfn core ABI v2 helpers for tensor functions written by hand in C (no libc: clang
 * --target=wasm32 -nostdlib). v2 is the ABI meshfn's model compiler emits for ONNX models: raw
 * tensors in an I/O table instead of JSON (ABI.md, "Version 2"). A hand-written v2 module, such
 * as the tiny-lm example's step function, is served exactly like a compiled one, so a compiled
 * replacement is a drop-in: same exports, same metadata, same table.
 *
 * Memory model: one bump arena that only grows (meshfn_plan lays the table out per batch size;
 * nothing is freed). */
#ifndef MESHFN_TENSOR_H
#define MESHFN_TENSOR_H

typedef unsigned char u8;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;
typedef long long i64;

#define MF_OK 0
#define MF_BAD_REQUEST 1
#define MF_OUT_OF_MEMORY 2
#define MF_INTERNAL 3
#define MF_PAGE 65536u

extern u8 __heap_base;
static u32 mf_top;

/* 16-byte aligned bump allocation (SIMD loads); grows linear memory on demand, 0 when the
 * store's memory cap (or the 1 GiB ABI ceiling) refuses. */
static __attribute__((unused)) void *mf_alloc(u32 size) {
  if (!mf_top) mf_top = (u32)&__heap_base;
  u32 start = (mf_top + 15u) & ~15u;
  if (size > 0x3FFFFFFFu - start) return 0;
  u32 end = start + size;
  u32 have = (u32)__builtin_wasm_memory_size(0) * MF_PAGE;
  if (end > have) {
    u32 pages = (end - have + MF_PAGE - 1) / MF_PAGE;
    if (__builtin_wasm_memory_grow(0, pages) == (unsigned long)-1) return 0;
  }
  mf_top = end;
  return (void *)start;
}

static __attribute__((unused)) i64 mf_result(int status, const char *ptr, u32 len) {
  return (i64)(((u64)status << 62) | ((u64)(u32)ptr << 32) | (u64)len);
}

static __attribute__((unused)) u32 mf_strlen(const char *s) {
  u32 n = 0;
  while (s[n]) n++;
  return n;
}

static const char *mf_err_ptr = "";
static u32 mf_err_len;

/* Record `message` as the last error (a string constant) and return `status` for meshfn_run. */
static __attribute__((unused)) i32 mf_fail(i32 status, const char *message) {
  mf_err_ptr = message;
  mf_err_len = mf_strlen(message);
  return status;
}

__attribute__((export_name("meshfn_abi_version"))) i32 meshfn_abi_version(void) { return 2; }

__attribute__((export_name("meshfn_error"))) i64 meshfn_error(void) {
  return mf_result(MF_OK, mf_err_ptr, mf_err_len);
}

#endif
