#include "mf.h"

/* ------------------------------------------------------------------ allocator
 * Power-of-two size classes with one free list each. Simple, O(1), no coalescing: a proxy
 * filter allocates a handful of similar-sized buffers per request and frees them all, so the
 * free lists reach a steady state. A header in front of each block records its class and a magic
 * value, so a bad free traps instead of corrupting memory. */

#define HDR 16u
#define MAGIC 0x6d66a11cu
#define MIN_CLASS 4
#define MAX_CLASS 31

typedef struct block {
  uint32_t cls;
  uint32_t magic;
  struct block *next; /* only while free; overlaps the padding of the header */
} block_t;

static block_t *free_lists[MAX_CLASS + 1];
static char *heap_top, *heap_end;
static size_t live_bytes;

#ifdef __wasm__
extern char __heap_base;
static int grow(size_t need) {
  if (heap_top == 0) {
    heap_top = &__heap_base;
    heap_end = (char *)(__builtin_wasm_memory_size(0) * 65536u);
    if ((size_t)(heap_end - heap_top) >= need) return 1;
  }
  size_t pages = (need + 65535u) / 65536u;
  size_t old = __builtin_wasm_memory_grow(0, pages);
  if (old == (size_t)-1) return 0;
  char *old_end = (char *)(old * 65536u);
  if (old_end != heap_end) heap_top = old_end; /* someone else grew memory: start afresh */
  heap_end = (char *)((old + pages) * 65536u);
  return 1;
}
#else
/* Native harness: a fixed arena (paged in lazily by the OS) stands in for linear memory. */
#define ARENA (1u << 30)
static char arena[ARENA] __attribute__((aligned(16)));
static int grow(size_t need) {
  if (heap_top == 0) heap_top = heap_end = arena;
  size_t bytes = (need + 65535u) & ~(size_t)65535u;
  if ((size_t)(arena + ARENA - heap_end) < bytes) return 0;
  heap_end += bytes;
  return 1;
}
#endif

static void trap(void) { __builtin_trap(); }

#ifdef MF_SYSTEM_MALLOC
/* Fuzzing builds (wasm_filters/fuzz): every block from the C library's malloc, so
 * AddressSanitizer sees each one's bounds and lifetime (inside the arena it sees neither). The
 * header keeps the same magic check and the live-byte count the harness checks for leaks. */
#include <stdlib.h>
void *mf_alloc(size_t n) {
  if (n > ((size_t)1 << (MAX_CLASS - 1))) return 0;
  block_t *b = malloc(HDR + n);
  if (!b) return 0;
  b->cls = (uint32_t)n; /* the size, here */
  b->magic = MAGIC;
  live_bytes += n;
  return (char *)b + HDR;
}

void mf_free(void *p) {
  if (!p) return;
  block_t *b = (block_t *)((char *)p - HDR);
  if (b->magic != MAGIC) trap();
  b->magic = 0;
  live_bytes -= b->cls;
  free(b);
}

void *mf_calloc(size_t n) {
  void *p = mf_alloc(n);
  if (p) mf_memset(p, 0, n);
  return p;
}
#else
void *mf_alloc(size_t n) {
  if (n > ((size_t)1 << (MAX_CLASS - 1))) return 0;
  uint32_t cls = MIN_CLASS;
  while (((size_t)1 << cls) < n + HDR) cls++;
  size_t size = (size_t)1 << cls;
  block_t *b = free_lists[cls];
  if (b) {
    free_lists[cls] = b->next;
  } else {
    if (heap_top == 0 || (size_t)(heap_end - heap_top) < size) {
      if (heap_top != 0 && heap_end > heap_top) {
        /* keep the tail of the current region: hand it out to the free lists */
        while ((size_t)(heap_end - heap_top) >= ((size_t)1 << MIN_CLASS)) {
          uint32_t c = MAX_CLASS;
          while (((size_t)1 << c) > (size_t)(heap_end - heap_top)) c--;
          block_t *t = (block_t *)heap_top;
          t->cls = c;
          t->magic = 0;
          t->next = free_lists[c];
          free_lists[c] = t;
          heap_top += (size_t)1 << c;
        }
      }
      if (!grow(size)) return 0;
      if ((size_t)(heap_end - heap_top) < size) return 0;
    }
    b = (block_t *)heap_top;
    heap_top += size;
    b->cls = cls;
  }
  b->magic = MAGIC;
  live_bytes += size;
  return (char *)b + HDR;
}

void *mf_calloc(size_t n) {
  void *p = mf_alloc(n);
  if (p) mf_memset(p, 0, n);
  return p;
}

void mf_free(void *p) {
  if (!p) return;
  block_t *b = (block_t *)((char *)p - HDR);
  if (b->magic != MAGIC || b->cls < MIN_CLASS || b->cls > MAX_CLASS) trap();
  b->magic = 0;
  live_bytes -= (size_t)1 << b->cls;
  b->next = free_lists[b->cls];
  free_lists[b->cls] = b;
}
#endif

size_t mf_live_bytes(void) { return live_bytes; }

/* The host allocates through these when it hands us headers, bodies and properties. */
PW_EXPORT(proxy_on_memory_allocate) void *proxy_on_memory_allocate(size_t n) {
  return mf_alloc(n ? n : 1);
}
#ifdef __wasm__
PW_EXPORT(malloc) void *malloc(size_t n) { return mf_alloc(n ? n : 1); }
PW_EXPORT(free) void free(void *p) { mf_free(p); }
/* clang may emit calls to these for struct copies; LLVM does not turn a loop inside a function
 * named memcpy/memset back into a call to itself. */
void *memcpy(void *dst, const void *src, size_t n) { return mf_memcpy(dst, src, n); }
void *memset(void *dst, int c, size_t n) { return mf_memset(dst, c, n); }
void *memmove(void *dst, const void *src, size_t n) {
  unsigned char *d = dst;
  const unsigned char *s = src;
  if (d < s) {
    while (n--) *d++ = *s++;
  } else {
    while (n--) d[n] = s[n];
  }
  return dst;
}
#endif

void *mf_memcpy(void *dst, const void *src, size_t n) {
#if defined(__wasm__) && defined(__wasm_bulk_memory__)
  __builtin_memcpy(dst, src, n);
#else
  unsigned char *d = dst;
  const unsigned char *s = src;
  while (n--) *d++ = *s++;
#endif
  return dst;
}

void *mf_memset(void *dst, int c, size_t n) {
#if defined(__wasm__) && defined(__wasm_bulk_memory__)
  __builtin_memset(dst, c, n);
#else
  unsigned char *d = dst;
  while (n--) *d++ = (unsigned char)c;
#endif
  return dst;
}

int mf_memeq(const void *a, const void *b, size_t n) {
  const unsigned char *x = a, *y = b;
  for (size_t i = 0; i < n; i++)
    if (x[i] != y[i]) return 0;
  return 1;
}

size_t mf_strlen(const char *s) {
  size_t n = 0;
  while (s[n]) n++;
  return n;
}

/* ------------------------------------------------------------------ strings */
int str_eq(str_t a, str_t b) { return a.n == b.n && mf_memeq(a.p, b.p, a.n); }
int str_eq_lit(str_t a, const char *lit) { return str_eq(a, (str_t){lit, mf_strlen(lit)}); }

static char lower(char c) { return (c >= 'A' && c <= 'Z') ? (char)(c + 32) : c; }
int str_ieq_lit(str_t a, const char *lit) {
  size_t n = mf_strlen(lit);
  if (a.n != n) return 0;
  for (size_t i = 0; i < n; i++)
    if (lower(a.p[i]) != lower(lit[i])) return 0;
  return 1;
}

str_t str_trim(str_t s) {
  while (s.n && (s.p[0] == ' ' || s.p[0] == '\t')) s.p++, s.n--;
  while (s.n && (s.p[s.n - 1] == ' ' || s.p[s.n - 1] == '\t')) s.n--;
  return s;
}

char *str_dup(str_t s) {
  char *p = mf_alloc(s.n + 1);
  if (!p) return 0;
  mf_memcpy(p, s.p, s.n);
  p[s.n] = 0;
  return p;
}

int is_hex(str_t s) {
  for (size_t i = 0; i < s.n; i++) {
    char c = s.p[i];
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'))) return 0;
  }
  return 1;
}

/* Length of the valid UTF-8 sequence at p (1-4), or 0 if invalid (overlongs, surrogates and
 * code points above U+10FFFF are invalid, as RFC 3629 says). */
static size_t utf8_seq(const unsigned char *p, size_t n) {
  unsigned char c = p[0];
  if (c < 0x80) return 1;
  if (c >= 0xc2 && c <= 0xdf) return (n >= 2 && (p[1] & 0xc0) == 0x80) ? 2 : 0;
  if (c >= 0xe0 && c <= 0xef) {
    if (n < 3 || (p[1] & 0xc0) != 0x80 || (p[2] & 0xc0) != 0x80) return 0;
    if (c == 0xe0 && p[1] < 0xa0) return 0;  /* overlong */
    if (c == 0xed && p[1] >= 0xa0) return 0; /* surrogate */
    return 3;
  }
  if (c >= 0xf0 && c <= 0xf4) {
    if (n < 4 || (p[1] & 0xc0) != 0x80 || (p[2] & 0xc0) != 0x80 || (p[3] & 0xc0) != 0x80)
      return 0;
    if (c == 0xf0 && p[1] < 0x90) return 0; /* overlong */
    if (c == 0xf4 && p[1] >= 0x90) return 0; /* > U+10FFFF */
    return 4;
  }
  return 0;
}

int utf8_valid(const char *p, size_t n) {
  const unsigned char *u = (const unsigned char *)p;
  size_t i = 0;
  while (i < n) {
    size_t k = utf8_seq(u + i, n - i);
    if (!k) return 0;
    i += k;
  }
  return 1;
}

/* ------------------------------------------------------------------ string builder */
void sb_init(sb_t *b, size_t cap) {
  b->len = 0;
  b->oom = 0;
  b->cap = cap ? cap : 64;
  b->p = mf_alloc(b->cap);
  if (!b->p) b->oom = 1, b->cap = 0;
}

void sb_free(sb_t *b) {
  mf_free(b->p);
  b->p = 0;
  b->len = b->cap = 0;
}

static int sb_reserve(sb_t *b, size_t extra) {
  if (b->oom) return 0;
  if (b->len + extra <= b->cap) return 1;
  size_t cap = b->cap ? b->cap : 64;
  while (cap < b->len + extra) {
    if (cap > ((size_t)1 << 29)) return b->oom = 1, 0;
    cap *= 2;
  }
  char *p = mf_alloc(cap);
  if (!p) return b->oom = 1, 0;
  if (b->p) mf_memcpy(p, b->p, b->len);
  mf_free(b->p);
  b->p = p;
  b->cap = cap;
  return 1;
}

void sb_put(sb_t *b, const char *p, size_t n) {
  if (!sb_reserve(b, n)) return;
  mf_memcpy(b->p + b->len, p, n);
  b->len += n;
}
void sb_lit(sb_t *b, const char *s) { sb_put(b, s, mf_strlen(s)); }
void sb_ch(sb_t *b, char c) { sb_put(b, &c, 1); }

void sb_u64(sb_t *b, uint64_t v) {
  char tmp[20];
  int i = 20;
  do {
    tmp[--i] = (char)('0' + v % 10);
    v /= 10;
  } while (v);
  sb_put(b, tmp + i, (size_t)(20 - i));
}

static const char HEX[] = "0123456789abcdef";
void sb_hex(sb_t *b, const uint8_t *p, size_t n) {
  if (!sb_reserve(b, 2 * n)) return;
  for (size_t i = 0; i < n; i++) {
    b->p[b->len++] = HEX[p[i] >> 4];
    b->p[b->len++] = HEX[p[i] & 15];
  }
}

void sb_json_str(sb_t *b, const char *p, size_t n) {
  const unsigned char *u = (const unsigned char *)p;
  sb_ch(b, '"');
  size_t i = 0;
  while (i < n) {
    unsigned char c = u[i];
    if (c == '"' || c == '\\') {
      char esc[2] = {'\\', (char)c};
      sb_put(b, esc, 2);
      i++;
    } else if (c < 0x20 || c == 0x7f) {
      char esc[6] = {'\\', 'u', '0', '0', HEX[c >> 4], HEX[c & 15]};
      sb_put(b, esc, 6);
      i++;
    } else if (c < 0x80) {
      size_t j = i;
      while (j < n && u[j] >= 0x20 && u[j] < 0x7f && u[j] != '"' && u[j] != '\\') j++;
      sb_put(b, p + i, j - i);
      i = j;
    } else {
      size_t k = utf8_seq(u + i, n - i);
      if (k) {
        sb_put(b, p + i, k);
        i += k;
      } else {
        sb_lit(b, "\\ufffd");
        i++;
      }
    }
  }
  sb_ch(b, '"');
}

/* ------------------------------------------------------------------ context table
 * Open addressing with linear probing; ids are small sequential integers from the host. */
typedef struct {
  uint32_t id;
  void *p;
} slot_t;
static slot_t *slots;
static size_t nslots, used;

static void ctx_insert(slot_t *tab, size_t n, uint32_t id, void *p) {
  size_t i = (id * 2654435761u) & (n - 1);
  while (tab[i].p && tab[i].id != id) i = (i + 1) & (n - 1);
  tab[i].id = id;
  tab[i].p = p;
}

void ctx_put(uint32_t id, void *p) {
  if ((used + 1) * 2 > nslots) {
    size_t n = nslots ? nslots * 2 : 64;
    slot_t *tab = mf_calloc(n * sizeof(slot_t));
    if (!tab) trap();
    for (size_t i = 0; i < nslots; i++)
      if (slots[i].p) ctx_insert(tab, n, slots[i].id, slots[i].p);
    mf_free(slots);
    slots = tab;
    nslots = n;
  }
  ctx_insert(slots, nslots, id, p);
  used++;
}

void *ctx_get(uint32_t id) {
  if (!nslots) return 0;
  size_t i = (id * 2654435761u) & (nslots - 1);
  while (slots[i].p) {
    if (slots[i].id == id) return slots[i].p;
    i = (i + 1) & (nslots - 1);
  }
  return 0;
}

void *ctx_take(uint32_t id) {
  if (!nslots) return 0;
  size_t i = (id * 2654435761u) & (nslots - 1);
  while (slots[i].p) {
    if (slots[i].id == id) break;
    i = (i + 1) & (nslots - 1);
  }
  if (!slots[i].p) return 0;
  void *p = slots[i].p;
  slots[i].p = 0;
  used--;
  /* re-insert the rest of the cluster so later probes still find their entries */
  size_t j = (i + 1) & (nslots - 1);
  while (slots[j].p) {
    slot_t s = slots[j];
    slots[j].p = 0;
    ctx_insert(slots, nslots, s.id, s.p);
    j = (j + 1) & (nslots - 1);
  }
  return p;
}

/* ------------------------------------------------------------------ host wrappers */
void log_msg(uint32_t level, const char *prefix, const char *msg, size_t n) {
  sb_t b;
  sb_init(&b, 128);
  sb_lit(&b, prefix);
  sb_put(&b, msg, n);
  if (!b.oom) proxy_log(level, b.p, b.len);
  sb_free(&b);
}

/* Envoy picks the route again (a foreign function: Envoy 1.40 has no
 * proxy_clear_route_cache); a failure is logged under `prefix`. */
void clear_route_cache(const char *prefix) {
  char *res = 0;
  size_t n = 0;
  static const char name[] = "clear_route_cache";
  if (proxy_call_foreign_function(name, sizeof name - 1, "", 0, &res, &n) != WR_OK)
    log_msg(LOG_ERROR, prefix, "clear_route_cache failed", 24);
  mf_free(res);
}

int get_header(uint32_t map, const char *key, str_t *out) {
  char *v = 0;
  size_t n = 0;
  out->p = 0;
  out->n = 0;
  if (proxy_get_header_map_value(map, key, mf_strlen(key), &v, &n) != WR_OK || !v) {
    mf_free(v);
    return 0;
  }
  out->p = v;
  out->n = n;
  return 1;
}

int get_property(const char *path, size_t path_size, str_t *out) {
  char *v = 0;
  size_t n = 0;
  out->p = 0;
  out->n = 0;
  if (proxy_get_property(path, path_size, &v, &n) != WR_OK || !v) {
    mf_free(v);
    return 0;
  }
  out->p = v;
  out->n = n;
  return 1;
}

uint32_t define_counter(const char *name) {
  uint32_t id = 0;
  if (proxy_define_metric(METRIC_COUNTER, name, mf_strlen(name), &id) != WR_OK) return NO_METRIC;
  return id;
}

void counter_inc(uint32_t id) {
  if (id != NO_METRIC) proxy_increment_metric(id, 1);
}
