/* meshfn core ABI v1 helpers for model functions written in C (no libc: clang --target=wasm32
 * -nostdlib). The ABI itself is documented in ABI.md next to this file; this header implements
 * its allocation and result-packing rules plus the little JSON reading and writing a model needs.
 *
 * Memory model: one bump arena. meshfn_alloc() (called by the host once per request) resets it,
 * so a reused instance never leaks and nothing is ever freed individually. */
#ifndef MESHFN_CORE_H
#define MESHFN_CORE_H

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

/* 8-byte aligned bump allocation; grows linear memory on demand, 0 when the store's memory cap
 * (or the 1 GiB ABI ceiling) refuses. */
static __attribute__((unused)) void *mf_alloc(u32 size) {
  if (!mf_top) mf_top = (u32)&__heap_base;
  u32 start = (mf_top + 7u) & ~7u;
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

__attribute__((export_name("meshfn_abi_version"))) i32 meshfn_abi_version(void) { return 1; }

__attribute__((export_name("meshfn_alloc"))) u32 meshfn_alloc(u32 size) {
  mf_top = (u32)&__heap_base; /* a new request: everything from the last one is garbage */
  return (u32)mf_alloc(size);
}

static __attribute__((unused)) i64 mf_result(int status, const char *ptr, u32 len) {
  return (i64)(((u64)status << 62) | ((u64)(u32)ptr << 32) | (u64)len);
}

static __attribute__((unused)) u32 mf_strlen(const char *s) {
  u32 n = 0;
  while (s[n]) n++;
  return n;
}

static __attribute__((unused)) i64 mf_error(int status, const char *message) {
  return mf_result(status, message, mf_strlen(message));
}

/* ---- writing JSON into an arena buffer ---- */
typedef struct {
  char *p;
  u32 len, cap;
  int overflow;
} mf_buf;

static __attribute__((unused)) mf_buf mf_buf_new(u32 cap) {
  mf_buf b = {(char *)mf_alloc(cap), 0, cap, 0};
  if (!b.p) b.overflow = 1;
  return b;
}

static __attribute__((unused)) void mf_put(mf_buf *b, const char *s) {
  for (; *s; s++) {
    if (b->len >= b->cap) { b->overflow = 1; return; }
    b->p[b->len++] = *s;
  }
}

static __attribute__((unused)) void mf_put_u64(mf_buf *b, u64 v) {
  char tmp[21];
  int n = 0;
  do { tmp[n++] = (char)('0' + v % 10); v /= 10; } while (v);
  while (n--) {
    if (b->len >= b->cap) { b->overflow = 1; return; }
    b->p[b->len++] = tmp[n];
  }
}

/* Fixed 6 decimals: enough for probabilities and scores, and exact to parse back. */
static __attribute__((unused)) void mf_put_f64(mf_buf *b, double v) {
  if (v != v) { mf_put(b, "null"); return; }
  if (v < 0) { mf_put(b, "-"); v = -v; }
  if (v > 1e15) v = 1e15;
  u64 scaled = (u64)(v * 1000000.0 + 0.5);
  mf_put_u64(b, scaled / 1000000u);
  u64 frac = scaled % 1000000u;
  char digits[8] = {'.', 0, 0, 0, 0, 0, 0, 0};
  for (int i = 6; i >= 1; i--) { digits[i] = (char)('0' + frac % 10); frac /= 10; }
  mf_put(b, digits);
}

/* ---- reading the numbers of one input's "data" (the host already validated the request) ---- */

/* Pointer just after the first occurrence of `key` ("\"data\"" etc.) at or after `from`. */
static __attribute__((unused)) const char *mf_find(const char *from, const char *end, const char *key) {
  u32 k = mf_strlen(key);
  for (const char *p = from; p + k <= end; p++) {
    u32 i = 0;
    while (i < k && p[i] == key[i]) i++;
    if (i == k) return p + k;
  }
  return 0;
}

static __attribute__((unused)) int mf_digit(char c) { return c >= '0' && c <= '9'; }

/* Reads every number of the (possibly nested) JSON array that starts at the first '[' after p
 * into out[0..max); returns how many it read, or -1 on malformed input or more than max. */
static __attribute__((unused)) i32 mf_read_numbers(const char *p, const char *end, double *out, u32 max) {
  while (p < end && *p != '[') p++;
  if (p >= end) return -1;
  i32 depth = 0;
  u32 n = 0;
  while (p < end) {
    char c = *p;
    if (c == '[') { depth++; p++; continue; }
    if (c == ']') { depth--; p++; if (!depth) return (i32)n; continue; }
    if (c == ',' || c == ' ' || c == '\n' || c == '\t' || c == '\r') { p++; continue; }
    double sign = 1.0, value = 0.0;
    if (c == '-') { sign = -1.0; p++; }
    if (p >= end || !mf_digit(*p)) return -1;
    while (p < end && mf_digit(*p)) value = value * 10.0 + (*p++ - '0');
    if (p < end && *p == '.') {
      double scale = 0.1;
      for (p++; p < end && mf_digit(*p); p++, scale *= 0.1) value += (*p - '0') * scale;
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
      p++;
      int esign = 1, e = 0;
      if (p < end && (*p == '+' || *p == '-')) esign = (*p++ == '-') ? -1 : 1;
      while (p < end && mf_digit(*p)) e = e * 10 + (*p++ - '0');
      for (; e > 0; e--) value = esign > 0 ? value * 10.0 : value / 10.0;
    }
    if (n >= max) return -1;
    out[n++] = sign * value;
  }
  return -1;
}

/* ---- reading an input's values whichever way the host sent them ---- */

static __attribute__((unused)) int mf_b64(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

/* The first input's FP32 values as doubles into out[0..max): from its base64 "raw" bytes
 * (little-endian float32, what the host sends when function.toml says raw_inputs = true) or
 * from its JSON "data". Returns how many, or -1 if malformed or more than max. */
static __attribute__((unused)) i32 mf_read_f32(const char *req, const char *end, double *out, u32 max) {
  const char *p = mf_find(req, end, "\"raw\":\"");
  if (!p) {
    const char *data = mf_find(req, end, "\"data\"");
    return data ? mf_read_numbers(data, end, out, max) : -1;
  }
  u32 n = 0, bits = 0, have = 0;
  union { u32 u; float f; } word = {0};
  u32 got = 0; /* bytes of the current float */
  for (; p < end && *p != '"'; p++) {
    if (*p == '=') continue;
    int v = mf_b64(*p);
    if (v < 0) return -1;
    bits = (bits << 6) | (u32)v;
    have += 6;
    if (have >= 8) {
      have -= 8;
      word.u |= ((bits >> have) & 0xFFu) << (8 * got);
      if (++got == 4) {
        if (n >= max) return -1;
        out[n++] = (double)word.f;
        word.u = 0;
        got = 0;
      }
    }
  }
  return (p < end && !got) ? (i32)n : -1;
}

static __attribute__((unused)) double mf_exp(double x) { /* exp by range reduction + Taylor: no libm here */
  if (x < -700) return 0.0;
  int k = 0;
  while (x > 0.5) { x -= 0.6931471805599453; k++; }
  while (x < -0.5) { x += 0.6931471805599453; k--; }
  double term = 1.0, sum = 1.0;
  for (int i = 1; i < 18; i++) { term *= x / i; sum += term; }
  while (k > 0) { sum *= 2.0; k--; }
  while (k < 0) { sum *= 0.5; k++; }
  return sum;
}

#endif
