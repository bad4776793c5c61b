/* The combined meshfn filter: audit and degrade in ONE proxy-wasm plugin.
 *
 * Envoy pays a fixed price per wasm filter and request (a C++ context, VM entries to create it,
 * run its callbacks and delete it) whatever the filter does; with both features in one plugin
 * that price is paid once. The logic is exactly audit/audit.c and degrade/degrade.c, compiled
 * with prefixed hooks (-DFILTER_NS=...). Configuration: {"audit": {...}, "degrade": {...}},
 * each part as for the separate filter, at least one of them. Per request the audit part runs
 * first (so a request the degrade part rejects is still audited), then the degrade part. */
#include "../common/filter_base.h"

const char *const FILTER_LOG_PREFIX = "meshfn: ";

/* The two filters' hooks (their root/http types are opaque here). */
typedef struct audit_root audit_root;
typedef struct audit_http audit_http;
typedef struct degrade_root degrade_root;
typedef struct degrade_http degrade_http;
audit_root *audit_root_new(void);
void audit_root_free(audit_root *r);
int audit_configure(audit_root *r, const jnode_t *config, char *err, size_t es);
audit_http *audit_http_new(audit_root *r, uint32_t context_id);
void audit_http_free(audit_http *h);
uint32_t audit_on_request_headers(audit_http *h, uint32_t headers, uint32_t eos);
uint32_t audit_on_request_body(audit_http *h, uint32_t size, uint32_t eos);
degrade_root *degrade_root_new(void);
void degrade_root_free(degrade_root *r);
int degrade_configure(degrade_root *r, const jnode_t *config, char *err, size_t es);
degrade_http *degrade_http_new(degrade_root *r, uint32_t context_id);
void degrade_http_free(degrade_http *h);
uint32_t degrade_on_request_headers(degrade_http *h, uint32_t headers, uint32_t eos);

struct root {
  audit_root *audit;     /* NULL: audit part not configured */
  degrade_root *degrade; /* NULL: degrade part not configured */
};

struct http {
  audit_http *audit;
  degrade_http *degrade;
};

root_t *filter_root_new(void) { return mf_calloc(sizeof(root_t)); }

void filter_root_free(root_t *r) {
  if (!r) return;
  audit_root_free(r->audit);
  degrade_root_free(r->degrade);
  mf_free(r);
}

/* "audit." or "degrade." in front of the part's own error message. */
static void prefix_err(char *err, size_t es, const char *part) {
  char tmp[160];
  size_t n = mf_strlen(err), p = mf_strlen(part);
  if (n + p + 1 >= sizeof tmp) n = sizeof tmp - p - 2;
  mf_memcpy(tmp, part, p);
  tmp[p] = '.';
  mf_memcpy(tmp + p + 1, err, n);
  tmp[p + 1 + n] = 0;
  size_t total = p + 1 + n < es - 1 ? p + 1 + n : es - 1;
  mf_memcpy(err, tmp, total);
  err[total] = 0;
}

int filter_configure(root_t *r, const jnode_t *c, char *err, size_t es) {
  static const char *const keys[] = {"audit", "degrade", 0};
  const jnode_t *bad = json_unknown_key(c, keys);
  if (bad) return set_err(err, es, bad->key, "unknown field"), 0;
  const jnode_t *a = json_get(c, "audit"), *d = json_get(c, "degrade");
  if (!a && !d) return set_err(err, es, "configuration", "needs \"audit\" or \"degrade\""), 0;
  if (a) {
    if (a->type != J_OBJ) return set_err(err, es, "audit", "must be an object"), 0;
    r->audit = audit_root_new();
    if (!r->audit) return set_err(err, es, "audit", "out of memory"), 0;
    if (!audit_configure(r->audit, a, err, es)) return prefix_err(err, es, "audit"), 0;
  }
  if (d) {
    if (d->type != J_OBJ) return set_err(err, es, "degrade", "must be an object"), 0;
    r->degrade = degrade_root_new();
    if (!r->degrade) return set_err(err, es, "degrade", "out of memory"), 0;
    if (!degrade_configure(r->degrade, d, err, es)) return prefix_err(err, es, "degrade"), 0;
  }
  return 1;
}

http_t *filter_http_new(root_t *r, uint32_t context_id) {
  http_t *h = mf_calloc(sizeof(http_t));
  if (!h) return 0;
  if (r->audit) h->audit = audit_http_new(r->audit, context_id);
  if (r->degrade) h->degrade = degrade_http_new(r->degrade, context_id);
  return h;
}

void filter_http_free(http_t *h) {
  if (!h) return;
  audit_http_free(h->audit);
  degrade_http_free(h->degrade);
  mf_free(h);
}

uint32_t filter_on_request_headers(http_t *h, uint32_t headers, uint32_t eos) {
  if (h->audit) audit_on_request_headers(h->audit, headers, eos);
  return h->degrade ? degrade_on_request_headers(h->degrade, headers, eos) : ACTION_CONTINUE;
}

uint32_t filter_on_request_body(http_t *h, uint32_t size, uint32_t eos) {
  return h->audit ? audit_on_request_body(h->audit, size, eos) : ACTION_CONTINUE;
}
