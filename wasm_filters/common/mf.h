/* Small runtime shared by the meshfn filters: allocator, byte helpers, a growable string
 * builder with JSON escaping, a context table and host-call wrappers. No libc: wasm32 is built
 * with -nostdlib, and the native harness compiles exactly this code. */
#ifndef MESHFN_MF_H
#define MESHFN_MF_H

#include <stddef.h>
#include <stdint.h>

#include "proxy_wasm.h"

typedef int bool_t;

/* ---- memory */
void *mf_alloc(size_t n);
void *mf_calloc(size_t n);
void mf_free(void *p);
void *mf_memcpy(void *dst, const void *src, size_t n);
void *mf_memset(void *dst, int c, size_t n);
int mf_memeq(const void *a, const void *b, size_t n);
size_t mf_strlen(const char *s);
/* Bytes currently handed out by the allocator; the harness checks it for leaks. */
size_t mf_live_bytes(void);

/* ---- byte strings */
typedef struct {
  const char *p;
  size_t n;
} str_t;
#define STR(lit) ((str_t){(lit), sizeof(lit) - 1})
int str_eq(str_t a, str_t b);
int str_eq_lit(str_t a, const char *lit);
int str_ieq_lit(str_t a, const char *lit); /* ASCII case-insensitive */
str_t str_trim(str_t s);
char *str_dup(str_t s); /* NUL-terminated copy */

/* ---- string builder; `oom` is sticky, callers check once at the end */
typedef struct {
  char *p;
  size_t len, cap;
  int oom;
} sb_t;
void sb_init(sb_t *b, size_t cap);
void sb_free(sb_t *b);
void sb_put(sb_t *b, const char *p, size_t n);
void sb_lit(sb_t *b, const char *s);
void sb_ch(sb_t *b, char c);
void sb_u64(sb_t *b, uint64_t v);
void sb_hex(sb_t *b, const uint8_t *p, size_t n);
/* JSON string literal with quotes. Valid UTF-8 passes through, every invalid byte becomes
 * U+FFFD, control characters are \u-escaped: the output is always valid JSON in UTF-8. */
void sb_json_str(sb_t *b, const char *p, size_t n);

/* ---- context table: context id -> filter state */
void ctx_put(uint32_t id, void *p);
void *ctx_get(uint32_t id);
void *ctx_take(uint32_t id);

/* ---- host wrappers (results are owned by the caller: mf_free them) */
void log_msg(uint32_t level, const char *prefix, const char *msg, size_t n);
void clear_route_cache(const char *prefix);
int get_header(uint32_t map, const char *key, str_t *out); /* 1 found, 0 absent */
int get_property(const char *path, size_t path_size, str_t *out);
#define NO_METRIC 0xffffffffu
uint32_t define_counter(const char *name); /* NO_METRIC if the host refused */
void counter_inc(uint32_t id);

/* ---- misc */
int is_hex(str_t s);
int utf8_valid(const char *p, size_t n);

#endif
