/* A fake proxy-wasm host: implements the ABI 0.2.1 host calls the filters import, so the exact
 * filter C code runs natively under pytest (through ctypes). It behaves like Envoy where the
 * filters depend on it: buffers handed to the plugin are allocated with the plugin's own
 * proxy_on_memory_allocate, header lookups are case-insensitive and return the first value, a
 * missing header or property is WR_NOT_FOUND, set_property stores into "filter state". Test code
 * drives it with the host_* functions below. This is test-only code, never built into .wasm. */
#include <stdlib.h>
#include <string.h>

#include "../common/mf.h"
#include "../common/sha256.h"

#define API __attribute__((visibility("default")))

typedef struct {
  char *k, *v;
  size_t kn, vn;
} kv_t;

typedef struct {
  kv_t *items;
  size_t n, cap;
} list_t;

static list_t maps[4], props, state, logs, metrics;
static char *config, *body;
static size_t config_n, body_n;
static int local_status;
static char *local_body, *local_headers, *local_details;
static size_t local_body_n, local_headers_n, local_details_n;
static int foreign_calls;
static int fail_set_property;

static char *dup_bytes(const char *p, size_t n) {
  char *d = malloc(n + 1);
  memcpy(d, p, n);
  d[n] = 0;
  return d;
}

static void list_add(list_t *l, const char *k, size_t kn, const char *v, size_t vn) {
  if (l->n == l->cap) {
    l->cap = l->cap ? l->cap * 2 : 8;
    l->items = realloc(l->items, l->cap * sizeof(kv_t));
  }
  l->items[l->n++] = (kv_t){dup_bytes(k, kn), dup_bytes(v, vn), kn, vn};
}

static void list_clear(list_t *l) {
  for (size_t i = 0; i < l->n; i++) free(l->items[i].k), free(l->items[i].v);
  l->n = 0;
}

static int ieq(const char *a, size_t an, const char *b, size_t bn) {
  if (an != bn) return 0;
  for (size_t i = 0; i < an; i++) {
    char x = a[i], y = b[i];
    if (x >= 'A' && x <= 'Z') x += 32;
    if (y >= 'A' && y <= 'Z') y += 32;
    if (x != y) return 0;
  }
  return 1;
}

static kv_t *find(list_t *l, const char *k, size_t kn, int icase) {
  for (size_t i = 0; i < l->n; i++) {
    kv_t *e = &l->items[i];
    if (icase ? ieq(e->k, e->kn, k, kn) : (e->kn == kn && memcmp(e->k, k, kn) == 0)) return e;
  }
  return 0;
}

static void remove_all(list_t *l, const char *k, size_t kn) {
  size_t j = 0;
  for (size_t i = 0; i < l->n; i++) {
    if (ieq(l->items[i].k, l->items[i].kn, k, kn)) free(l->items[i].k), free(l->items[i].v);
    else l->items[j++] = l->items[i];
  }
  l->n = j;
}

void *proxy_on_memory_allocate(size_t n);
static WasmResult give(const char *p, size_t n, char **out, size_t *out_n) {
  char *d = proxy_on_memory_allocate(n ? n : 1);
  if (!d) return WR_INTERNAL_FAILURE;
  memcpy(d, p, n);
  *out = d;
  *out_n = n;
  return WR_OK;
}

/* ------------------------------------------------------------------ the ABI */

WasmResult proxy_log(uint32_t level, const char *msg, size_t size) {
  char lv[2] = {(char)('0' + level), 0};
  list_add(&logs, lv, 1, msg, size);
  return WR_OK;
}

WasmResult proxy_get_buffer_bytes(uint32_t type, size_t start, size_t max_size, char **ptr,
                                  size_t *size) {
  const char *src;
  size_t n;
  if (type == BUF_PLUGIN_CONFIGURATION) src = config, n = config_n;
  else if (type == BUF_REQUEST_BODY) src = body, n = body_n;
  else return WR_BAD_ARGUMENT;
  if (!src) return WR_NOT_FOUND;
  if (start > n) return WR_BAD_ARGUMENT;
  size_t take = n - start < max_size ? n - start : max_size;
  return give(src + start, take, ptr, size);
}

WasmResult proxy_get_header_map_value(uint32_t type, const char *key, size_t key_size,
                                      char **value, size_t *value_size) {
  if (type > 3) return WR_BAD_ARGUMENT;
  kv_t *e = find(&maps[type], key, key_size, 1);
  if (!e) return WR_NOT_FOUND;
  return give(e->v, e->vn, value, value_size);
}

WasmResult proxy_replace_header_map_value(uint32_t type, const char *key, size_t key_size,
                                          const char *value, size_t value_size) {
  if (type > 3) return WR_BAD_ARGUMENT;
  remove_all(&maps[type], key, key_size);
  list_add(&maps[type], key, key_size, value, value_size);
  return WR_OK;
}

WasmResult proxy_remove_header_map_value(uint32_t type, const char *key, size_t key_size) {
  if (type > 3) return WR_BAD_ARGUMENT;
  remove_all(&maps[type], key, key_size);
  return WR_OK;
}

WasmResult proxy_get_property(const char *path, size_t path_size, char **value,
                              size_t *value_size) {
  kv_t *e = find(&props, path, path_size, 0);
  if (!e) return WR_NOT_FOUND;
  return give(e->v, e->vn, value, value_size);
}

WasmResult proxy_set_property(const char *path, size_t path_size, const char *value,
                              size_t value_size) {
  if (fail_set_property) return WR_INTERNAL_FAILURE;
  kv_t *e = find(&state, path, path_size, 0);
  if (e) {
    free(e->v);
    e->v = dup_bytes(value, value_size);
    e->vn = value_size;
  } else {
    list_add(&state, path, path_size, value, value_size);
  }
  return WR_OK;
}

WasmResult proxy_send_local_response(uint32_t status, const char *details, size_t details_size,
                                     const char *b, size_t body_size, const char *headers,
                                     size_t headers_size, int32_t grpc_status) {
  (void)grpc_status;
  local_status = (int)status;
  free(local_body);
  free(local_headers);
  free(local_details);
  local_body = dup_bytes(b, body_size);
  local_body_n = body_size;
  local_headers = dup_bytes(headers, headers_size);
  local_headers_n = headers_size;
  local_details = dup_bytes(details, details_size);
  local_details_n = details_size;
  return WR_OK;
}

WasmResult proxy_call_foreign_function(const char *name, size_t name_size, const char *args,
                                       size_t args_size, char **result, size_t *result_size) {
  (void)args;
  (void)args_size;
  (void)result;
  (void)result_size;
  /* Envoy 1.40 knows clear_route_cache; anything else is NotFound there too. */
  if (name_size == 17 && memcmp(name, "clear_route_cache", 17) == 0) {
    foreign_calls++;
    return WR_OK;
  }
  return WR_NOT_FOUND;
}

WasmResult proxy_define_metric(uint32_t type, const char *name, size_t name_size,
                               uint32_t *metric_id) {
  if (type != METRIC_COUNTER) return WR_BAD_ARGUMENT;
  kv_t *e = find(&metrics, name, name_size, 0);
  if (!e) {
    list_add(&metrics, name, name_size, "0", 1);
    e = &metrics.items[metrics.n - 1];
  }
  *metric_id = (uint32_t)(e - metrics.items) * 4 + 16; /* like Envoy: not 0-based */
  return WR_OK;
}

WasmResult proxy_increment_metric(uint32_t metric_id, int64_t offset) {
  size_t i = (metric_id - 16) / 4;
  if (metric_id < 16 || i >= metrics.n) return WR_NOT_FOUND;
  long long v = atoll(metrics.items[i].v) + offset;
  char buf[32];
  int n = 0;
  char tmp[32];
  int t = 0;
  if (v == 0) tmp[t++] = '0';
  while (v > 0) tmp[t++] = (char)('0' + v % 10), v /= 10;
  while (t) buf[n++] = tmp[--t];
  free(metrics.items[i].v);
  metrics.items[i].v = dup_bytes(buf, (size_t)n);
  metrics.items[i].vn = (size_t)n;
  return WR_OK;
}

/* ------------------------------------------------------------------ test controls */

API void host_reset(void) {
  for (int i = 0; i < 4; i++) list_clear(&maps[i]);
  list_clear(&props);
  list_clear(&state);
  list_clear(&logs);
  free(body);
  body = 0;
  body_n = 0;
  local_status = 0;
  foreign_calls = 0;
  fail_set_property = 0;
}
API void host_set_config(const char *p, size_t n) {
  free(config);
  config = p ? dup_bytes(p, n) : 0;
  config_n = n;
}
API void host_set_body(const char *p, size_t n) {
  free(body);
  body = p ? dup_bytes(p, n) : 0;
  body_n = n;
}
API void host_header_add(uint32_t map, const char *k, size_t kn, const char *v, size_t vn) {
  list_add(&maps[map], k, kn, v, vn);
}
API void host_headers_clear(uint32_t map) { list_clear(&maps[map]); }
API size_t host_header_count(uint32_t map) { return maps[map].n; }
API int host_header_at(uint32_t map, size_t i, const char **k, size_t *kn, const char **v,
                       size_t *vn) {
  if (i >= maps[map].n) return 0;
  *k = maps[map].items[i].k;
  *kn = maps[map].items[i].kn;
  *v = maps[map].items[i].v;
  *vn = maps[map].items[i].vn;
  return 1;
}
API void host_property(const char *path, size_t pn, const char *v, size_t vn) {
  list_add(&props, path, pn, v, vn);
}
API int host_state(const char *path, size_t pn, const char **v, size_t *vn) {
  kv_t *e = find(&state, path, pn, 0);
  if (!e) return 0;
  *v = e->v;
  *vn = e->vn;
  return 1;
}
API size_t host_log_count(void) { return logs.n; }
API int host_log_at(size_t i, const char **msg, size_t *n) {
  if (i >= logs.n) return -1;
  *msg = logs.items[i].v;
  *n = logs.items[i].vn;
  return logs.items[i].k[0] - '0';
}
API long long host_metric(const char *name) {
  kv_t *e = find(&metrics, name, strlen(name), 0);
  return e ? atoll(e->v) : -1;
}
API int host_local_response(const char **b, size_t *bn, const char **h, size_t *hn) {
  *b = local_body;
  *bn = local_body_n;
  *h = local_headers;
  *hn = local_headers_n;
  return local_status;
}
API int host_foreign_calls(void) { return foreign_calls; }
API void host_fail_set_property(int on) { fail_set_property = on; }
API size_t host_live_bytes(void) { return mf_live_bytes(); }

/* Direct access to the filters' own SHA-256 / HMAC, to compare with Python's hashlib/hmac. */
API void host_sha256(const char *p, size_t n, uint8_t *out) { sha256(p, n, out); }
API void host_sha256_chunked(const char *p, size_t n, size_t step, uint8_t *out) {
  sha256_t s;
  sha256_init(&s);
  for (size_t i = 0; i < n; i += step) sha256_update(&s, p + i, n - i < step ? n - i : step);
  sha256_final(&s, out);
}
API void host_hmac_sha256(const char *k, size_t kn, const char *m, size_t mn, uint8_t *out) {
  hmac_sha256(k, kn, m, mn, out);
}
