/* The combined meshfn filter: audit, model routing and degrade in ONE proxy-wasm plugin.
 *
 * Envoy pays a fixed price per wasm filter and request (a C++ context, VM entries to create it,
 * run its callbacks and delete it) whatever the filter does; with the features in one plugin
 * that price is paid once. The logic is exactly audit/audit.c, route/route.c and
 * degrade/degrade.c, compiled with prefixed hooks (-DFILTER_NS=...). Configuration:
 * {"audit": {...}, "route": {...}, "degrade": {...}}, each part as for the separate filter, at
 * least one of them. Per request the audit part runs first (so a request the others refuse is
 * still audited), then the model router (which may wait for the body and change the route),
 * then the degrade part, on the route the router chose. The router needs the request body: the
 * full build only. */
#include "../common/filter_base.h"
#include "../route/route.h"

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
typedef struct route_root route_root;
typedef struct route_http route_http;
route_root *route_root_new(void);
void route_root_free(route_root *r);
int route_configure(route_root *r, const jnode_t *config, char *err, size_t es);
route_http *route_http_new(route_root *r, uint32_t context_id);
void route_http_free(route_http *h);
uint32_t route_request_headers(route_http *h, uint32_t eos);
uint32_t route_request_body(route_http *h, uint32_t size, uint32_t eos);

struct root {
  audit_root *audit;     /* NULL: audit part not configured */
  degrade_root *degrade; /* NULL: degrade part not configured */
  route_root *route;     /* NULL: no model routing */
};

struct http {
  audit_http *audit;
  degrade_http *degrade;
  route_http *route;
  int routing; /* the router waits for the body: degrade (and the audit's hash) come after */
};

root_t *filter_root_new(void) { return mf_calloc(sizeof(root_t)); }

void filter_root_free(root_t *r) {
  if (!r) return;
  audit_root_free(r->audit);
  degrade_root_free(r->degrade);
  route_root_free(r->route);
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
  static const char *const keys[] = {"audit", "degrade", "route", 0};
  const jnode_t *bad = json_unknown_key(c, keys);
  if (bad) return set_err(err, es, bad->key, "unknown field"), 0;
  const jnode_t *a = json_get(c, "audit"), *d = json_get(c, "degrade"), *m = json_get(c, "route");
  if (!a && !d && !m)
    return set_err(err, es, "configuration", "needs \"audit\", \"route\" or \"degrade\""), 0;
  if (m) {
#ifndef FILTER_WANTS_BODY
    return set_err(err, es, "route",
                   "needs the full build (meshfn.wasm): it reads request bodies"), 0;
#else
    if (m->type != J_OBJ) return set_err(err, es, "route", "must be an object"), 0;
    r->route = route_root_new();
    if (!r->route) return set_err(err, es, "route", "out of memory"), 0;
    if (!route_configure(r->route, m, err, es)) return prefix_err(err, es, "route"), 0;
#endif
  }
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
  if (r->route) h->route = route_http_new(r->route, context_id);
  return h;
}

void filter_http_free(http_t *h) {
  if (!h) return;
  audit_http_free(h->audit);
  degrade_http_free(h->degrade);
  route_http_free(h->route);
  mf_free(h);
}

uint32_t filter_on_request_headers(http_t *h, uint32_t headers, uint32_t eos) {
  if (h->audit) audit_on_request_headers(h->audit, headers, eos);
  if (h->route) {
    uint32_t verdict = route_request_headers(h->route, eos);
    if (verdict == ROUTE_REPLIED) return ACTION_PAUSE;
    if (verdict == ROUTE_WAIT) {
      h->routing = 1;
      return ACTION_PAUSE; /* the headers wait for the body (and the route it names) */
    }
  }
  return h->degrade ? degrade_on_request_headers(h->degrade, headers, eos) : ACTION_CONTINUE;
}

#ifdef FILTER_WANTS_BODY
uint32_t filter_on_request_body(http_t *h, uint32_t size, uint32_t eos) {
  if (!h->routing) return h->audit ? audit_on_request_body(h->audit, size, eos) : ACTION_CONTINUE;
  /* While the router waits, Envoy buffers the body and calls again with all of it so far:
   * the audit part hashes it once, whole, at its end. */
  if (eos && h->audit) audit_on_request_body(h->audit, size, eos);
  uint32_t verdict = route_request_body(h->route, size, eos);
  if (verdict == ROUTE_WAIT || verdict == ROUTE_REPLIED) return ACTION_PAUSE;
  /* The router gave up before the end (a gRPC message too large to route by): the audit part
   * hashes what was held back, then each further chunk as it comes. */
  if (!eos && h->audit) audit_on_request_body(h->audit, size, eos);
  h->routing = 0;
  return h->degrade ? degrade_on_request_headers(h->degrade, 0, 0) : ACTION_CONTINUE;
}
#endif
