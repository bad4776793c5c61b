/* meshfn degrade filter.
 *
 * The control plane (the drift breaker) marks routes or clusters as degraded by pushing a new
 * plugin configuration. A degraded request is either rerouted (an internal routing header that
 * the translator's fallback routes match, then `clear_route_cache` so Envoy picks the route
 * again) or rejected with 503 and a JSON body. Callers named in `trigger.principals` (mTLS peer
 * URI SAN) may force degradation per request with a header, for drills and tests. The routing
 * header is stripped from every client request first, so nobody can pick a fallback themselves
 * (the translator also removes it before route matching: filters.early_header_mutation).
 * Cost: request headers only, 1-2 header reads per healthy request; route/cluster properties are
 * read only while something is degraded or a trigger was honoured. */
#include "../common/filter_base.h"

const char *const FILTER_LOG_PREFIX = "meshfn degrade: ";

#define MAX_RULES 256
#define MAX_NAMES 256
#define MAX_FALLBACKS 8
#define MAX_PRINCIPALS 256

enum { MODE_REROUTE = 0, MODE_REJECT = 1 };

typedef struct {
  char *name;
  char **routes, **clusters, **fallbacks;
  size_t n_routes, n_clusters, n_fallbacks;
  int mode;
  int depth;
} rule_t;

struct root {
  char *routing_header;
  /* The listener removes the routing header before Envoy picks a route (early header
   * mutation, as meshfn's translator configures it): no need to look for a spoofed one. */
  int listener_strips_routing_header;
  char *trigger_header; /* NULL: no trigger */
  char **principals;    /* mTLS peer URI SANs allowed to use the trigger */
  size_t n_principals;
  // Verified JWTs allowed to use the trigger ("*", "<iss>/*", "<iss>/<sub>"), read from the
  // headers jwt_authn writes (claim_to_headers; clients cannot set them: the listener strips
  // them before any filter runs).
  char **request_principals;
  size_t n_request_principals;
  char *issuer_header, *subject_header;
  rule_t *rules;
  size_t n_rules;
  /* Precomputed so a healthy request (nothing degraded, no trigger) costs no property reads:
   * each one is a CEL lookup in Envoy, several microseconds. */
  int any_active, uses_routes, uses_clusters;
  uint32_t m_rerouted, m_rejected, m_spoofed, m_trigger_ok, m_trigger_denied, m_trigger_bad;
};

struct http {
  root_t *root;
};

/* ------------------------------------------------------------------ configuration */

static void free_list(char **items, size_t n) {
  for (size_t i = 0; i < n; i++) mf_free(items[i]);
  mf_free(items);
}

root_t *filter_root_new(void) { return mf_calloc(sizeof(root_t)); }

void filter_root_free(root_t *r) {
  if (!r) return;
  mf_free(r->routing_header);
  mf_free(r->trigger_header);
  free_list(r->principals, r->n_principals);
  free_list(r->request_principals, r->n_request_principals);
  mf_free(r->issuer_header);
  mf_free(r->subject_header);
  for (size_t i = 0; i < r->n_rules; i++) {
    rule_t *u = &r->rules[i];
    mf_free(u->name);
    free_list(u->routes, u->n_routes);
    free_list(u->clusters, u->n_clusters);
    free_list(u->fallbacks, u->n_fallbacks);
  }
  mf_free(r->rules);
  mf_free(r);
}

static int header_name_ok(const jnode_t *v) {
  if (v->type != J_STR || v->len == 0 || v->len > 64) return 0;
  for (size_t i = 0; i < v->len; i++) {
    char c = v->str[i];
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_')) return 0;
  }
  return 1;
}

/* An optional header name at parent.key (`dflt` when absent) into *out, a copy. */
static int read_header(const jnode_t *parent, const char *key, const char *field,
                       const char *dflt, char **out, char *err, size_t es) {
  const jnode_t *v = json_get(parent, key);
  if (v && !header_name_ok(v))
    return set_err(err, es, field, "must be a lowercase header name"), 0;
  *out = v ? str_dup((str_t){v->str, v->len}) : str_dup((str_t){dflt, mf_strlen(dflt)});
  if (!*out) return set_err(err, es, field, "out of memory"), 0;
  return 1;
}

/* Names that end up in a header value or a log line: visible ASCII, no separators that could
 * smuggle a second value. */
static int name_ok(const jnode_t *v, size_t max) {
  if (v->type != J_STR || v->len == 0 || v->len > max) return 0;
  for (size_t i = 0; i < v->len; i++) {
    char c = v->str[i];
    if (c < 0x21 || c > 0x7e || c == ',' || c == '"' || c == '\\') return 0;
  }
  return 1;
}

/* Reads an optional array of names into a fresh list; returns 0 and sets err if invalid. */
static int read_names(const jnode_t *parent, const char *key, const char *field, size_t max_items,
                      size_t max_len, char ***out, size_t *count, char *err, size_t es) {
  *out = 0;
  *count = 0;
  const jnode_t *v = json_get(parent, key);
  if (!v) return 1;
  if (v->type != J_ARR) return set_err(err, es, field, "must be an array of strings"), 0;
  if (v->len > max_items) return set_err(err, es, field, "has too many entries"), 0;
  if (v->len == 0) return 1;
  *out = mf_calloc(v->len * sizeof(char *));
  if (!*out) return set_err(err, es, field, "out of memory"), 0;
  for (const jnode_t *c = v->child; c; c = c->next) {
    if (!name_ok(c, max_len))
      return set_err(err, es, field, "entries must be non-empty printable ASCII names"), 0;
    (*out)[*count] = str_dup((str_t){c->str, c->len});
    if (!(*out)[*count]) return set_err(err, es, field, "out of memory"), 0;
    (*count)++;
  }
  return 1;
}

static int read_rule(const jnode_t *j, rule_t *u, char *err, size_t es) {
  static const char *const keys[] = {"name", "routes", "clusters", "mode", "fallbacks", "depth", 0};
  if (j->type != J_OBJ) return set_err(err, es, "rules[]", "must be an object"), 0;
  const jnode_t *bad = json_unknown_key(j, keys);
  if (bad) return set_err(err, es, "rules[]", "unknown field"), 0;
  const jnode_t *v = json_get(j, "name");
  if (!v || !name_ok(v, 256)) return set_err(err, es, "rules[].name", "required name"), 0;
  u->name = str_dup((str_t){v->str, v->len});
  if (!u->name) return set_err(err, es, "rules[].name", "out of memory"), 0;
  if (!read_names(j, "routes", "rules[].routes", MAX_NAMES, 256, &u->routes, &u->n_routes, err,
                  es) ||
      !read_names(j, "clusters", "rules[].clusters", MAX_NAMES, 256, &u->clusters, &u->n_clusters,
                  err, es) ||
      !read_names(j, "fallbacks", "rules[].fallbacks", MAX_FALLBACKS, 256, &u->fallbacks,
                  &u->n_fallbacks, err, es))
    return 0;
  if (u->n_routes + u->n_clusters == 0)
    return set_err(err, es, "rules[]", "needs at least one entry in routes or clusters"), 0;
  v = json_get(j, "mode");
  if (v && v->type == J_STR && str_eq_lit((str_t){v->str, v->len}, "reroute")) u->mode = MODE_REROUTE;
  else if (v && v->type == J_STR && str_eq_lit((str_t){v->str, v->len}, "reject")) u->mode = MODE_REJECT;
  else return set_err(err, es, "rules[].mode", "must be \"reroute\" or \"reject\""), 0;
  if (u->mode == MODE_REROUTE && u->n_fallbacks == 0)
    return set_err(err, es, "rules[].fallbacks", "reroute needs 1-8 fallbacks"), 0;
  if (u->mode == MODE_REJECT && u->n_fallbacks)
    return set_err(err, es, "rules[].fallbacks", "not allowed with mode reject"), 0;
  v = json_get(j, "depth");
  u->depth = 0;
  if (v) {
    if (v->type != J_NUM || !v->is_int || v->num < 0 || v->num > MAX_FALLBACKS)
      return set_err(err, es, "rules[].depth", "must be an integer in 0..8"), 0;
    u->depth = (int)v->num;
    if (u->mode == MODE_REROUTE && (size_t)u->depth > u->n_fallbacks)
      return set_err(err, es, "rules[].depth", "is deeper than the fallback list"), 0;
  }
  return 1;
}

int filter_configure(root_t *r, const jnode_t *c, char *err, size_t es) {
  static const char *const keys[] = {"routing_header", "listener_strips_routing_header",
                                     "trigger", "rules", 0};
  const jnode_t *bad = json_unknown_key(c, keys);
  if (bad) return set_err(err, es, bad->key, "unknown field"), 0;

  if (!read_header(c, "routing_header", "routing_header", "x-meshfn-degrade-route",
                   &r->routing_header, err, es))
    return 0;
  const jnode_t *v = json_get(c, "listener_strips_routing_header");
  if (v && v->type != J_BOOL)
    return set_err(err, es, "listener_strips_routing_header", "must be a boolean"), 0;
  r->listener_strips_routing_header = v ? v->boolean : 0;

  v = json_get(c, "trigger");
  if (v) {
    static const char *const tkeys[] = {"header",         "principals",     "request_principals",
                                        "issuer_header",  "subject_header", 0};
    if (v->type != J_OBJ) return set_err(err, es, "trigger", "must be an object"), 0;
    bad = json_unknown_key(v, tkeys);
    if (bad) return set_err(err, es, "trigger", "unknown field"), 0;
    if (!read_header(v, "header", "trigger.header", "x-meshfn-degrade", &r->trigger_header, err,
                     es))
      return 0;
    if (!read_names(v, "principals", "trigger.principals", MAX_PRINCIPALS, 2048, &r->principals,
                    &r->n_principals, err, es))
      return 0;
    if (!read_names(v, "request_principals", "trigger.request_principals", MAX_PRINCIPALS, 2048,
                    &r->request_principals, &r->n_request_principals, err, es))
      return 0;
    if (r->n_principals == 0 && r->n_request_principals == 0)
      return set_err(err, es, "trigger.principals",
                     "principals or request_principals must name at least one caller"), 0;
    if (!read_header(v, "issuer_header", "trigger.issuer_header", "x-meshfn-jwt-iss",
                     &r->issuer_header, err, es) ||
        !read_header(v, "subject_header", "trigger.subject_header", "x-meshfn-jwt-sub",
                     &r->subject_header, err, es))
      return 0;
    if (str_eq_lit((str_t){r->trigger_header, mf_strlen(r->trigger_header)}, r->routing_header))
      return set_err(err, es, "trigger.header", "must differ from routing_header"), 0;
  }

  v = json_get(c, "rules");
  if (!v || v->type != J_ARR) return set_err(err, es, "rules", "required array"), 0;
  if (v->len > MAX_RULES) return set_err(err, es, "rules", "too many rules (max 256)"), 0;
  if (v->len) {
    r->rules = mf_calloc(v->len * sizeof(rule_t));
    if (!r->rules) return set_err(err, es, "rules", "out of memory"), 0;
  }
  for (const jnode_t *j = v->child; j; j = j->next) {
    rule_t *u = &r->rules[r->n_rules++];
    if (!read_rule(j, u, err, es)) return 0;
    r->any_active |= u->depth > 0;
    r->uses_routes |= u->n_routes > 0;
    r->uses_clusters |= u->n_clusters > 0;
  }

  r->m_rerouted = define_counter("meshfn_degrade.rerouted");
  r->m_rejected = define_counter("meshfn_degrade.rejected");
  r->m_spoofed = define_counter("meshfn_degrade.routing_header_stripped");
  r->m_trigger_ok = define_counter("meshfn_degrade.trigger_honoured");
  r->m_trigger_denied = define_counter("meshfn_degrade.trigger_denied");
  r->m_trigger_bad = define_counter("meshfn_degrade.trigger_invalid");
  return 1;
}

/* ------------------------------------------------------------------ per request */

http_t *filter_http_new(root_t *root, uint32_t context_id) {
  (void)context_id;
  http_t *h = mf_calloc(sizeof(http_t));
  if (h) h->root = root;
  return h;
}

void filter_http_free(http_t *h) { mf_free(h); }

static int listed(char **items, size_t n, str_t s) {
  for (size_t i = 0; i < n; i++)
    if (str_eq_lit(s, items[i])) return 1;
  return 0;
}

// A verified JWT's iss and sub against request_principals, with the semantics of RBAC's
// requestPrincipals: "*" (any verified token), "<iss>/*" (any subject of that issuer) or
// "<iss>/<sub>", split at the last "/" (issuers are URLs; subjects have no "/").
static int request_principal_listed(const root_t *r, str_t iss, str_t sub) {
  for (size_t i = 0; i < r->n_request_principals; i++) {
    const char *want = r->request_principals[i];
    size_t n = mf_strlen(want), slash = n;
    if (n == 1 && want[0] == '*') return 1;
    while (slash > 0 && want[slash - 1] != '/') slash--;
    if (slash == 0) continue; /* no "/": never matches (the policy model refuses it) */
    str_t want_iss = {want, slash - 1}, want_sub = {want + slash, n - slash};
    if (!str_eq(want_iss, iss)) continue;
    if ((want_sub.n == 1 && want_sub.p[0] == '*') || str_eq(want_sub, sub)) return 1;
  }
  return 0;
}

/* Whether the caller may use the trigger: a listed mTLS peer or a listed verified JWT. */
static int caller_allowed(const root_t *r) {
  str_t v, w;
  int allowed = 0;
  if (r->n_principals) {
    static const char path[] = "connection\0uri_san_peer_certificate";
    if (get_property(path, sizeof path - 1, &v)) {
      allowed = listed(r->principals, r->n_principals, v);
      mf_free((void *)v.p);
    }
  }
  if (!allowed && r->n_request_principals && get_header(MAP_REQUEST_HEADERS, r->issuer_header, &v)) {
    if (get_header(MAP_REQUEST_HEADERS, r->subject_header, &w)) {
      allowed = request_principal_listed(r, v, w);
      mf_free((void *)w.p);
    }
    mf_free((void *)v.p);
  }
  return allowed;
}

/* Depth the trigger header asks for (1-8), 0 if absent, -1 if present but not honoured. */
static int trigger_depth(http_t *h) {
  root_t *r = h->root;
  if (!r->trigger_header) return 0;
  str_t v;
  if (!get_header(MAP_REQUEST_HEADERS, r->trigger_header, &v)) return 0;
  proxy_remove_header_map_value(MAP_REQUEST_HEADERS, r->trigger_header,
                                mf_strlen(r->trigger_header));
  str_t t = str_trim(v);
  int depth = (t.n == 1 && t.p[0] >= '1' && t.p[0] <= '8') ? t.p[0] - '0' : -1;
  mf_free((void *)v.p);
  if (depth < 0) {
    counter_inc(r->m_trigger_bad);
    return -1;
  }
  if (!caller_allowed(r)) {
    counter_inc(r->m_trigger_denied);
    return -1;
  }
  counter_inc(r->m_trigger_ok);
  return depth;
}

static const rule_t *match_rule(root_t *r) {
  if (!r->n_rules) return 0;
  str_t route = {0, 0}, cluster = {0, 0};
  static const char route_path[] = "xds\0route_name";
  static const char cluster_path[] = "xds\0cluster_name";
  if (r->uses_routes) get_property(route_path, sizeof route_path - 1, &route);
  if (r->uses_clusters) get_property(cluster_path, sizeof cluster_path - 1, &cluster);
  const rule_t *found = 0;
  for (size_t i = 0; i < r->n_rules && !found; i++) {
    const rule_t *u = &r->rules[i];
    if ((route.n && listed(u->routes, u->n_routes, route)) ||
        (cluster.n && listed(u->clusters, u->n_clusters, cluster)))
      found = u;
  }
  mf_free((void *)route.p);
  mf_free((void *)cluster.p);
  return found;
}

static void reject(http_t *h, const rule_t *u) {
  sb_t body, hdrs;
  sb_init(&body, 128);
  sb_lit(&body, "{\"error\":\"service degraded\",\"rule\":");
  sb_json_str(&body, u->name, mf_strlen(u->name));
  sb_lit(&body, ",\"status\":503}\n");
  /* serialized header map: count, (key len, value len)*, then key\0value\0 pairs */
  static const char k1[] = "content-type", v1[] = "application/json";
  static const char k2[] = "x-meshfn-degraded", v2[] = "reject";
  uint32_t sizes[5] = {2, sizeof k1 - 1, sizeof v1 - 1, sizeof k2 - 1, sizeof v2 - 1};
  sb_init(&hdrs, 96);
  for (int i = 0; i < 5; i++) {
    uint8_t le[4] = {(uint8_t)sizes[i], (uint8_t)(sizes[i] >> 8), (uint8_t)(sizes[i] >> 16),
                     (uint8_t)(sizes[i] >> 24)};
    sb_put(&hdrs, (const char *)le, 4);
  }
  sb_put(&hdrs, k1, sizeof k1);
  sb_put(&hdrs, v1, sizeof v1);
  sb_put(&hdrs, k2, sizeof k2);
  sb_put(&hdrs, v2, sizeof v2);
  static const char details[] = "meshfn_degraded";
  if (!body.oom && !hdrs.oom)
    proxy_send_local_response(503, details, sizeof details - 1, body.p, body.len, hdrs.p,
                              hdrs.len, -1);
  counter_inc(h->root->m_rejected);
  sb_free(&body);
  sb_free(&hdrs);
}

uint32_t filter_on_request_headers(http_t *h, uint32_t headers, uint32_t eos) {
  (void)headers;
  (void)eos;
  root_t *r = h->root;
  str_t v;
  int dirty = 0;
  /* Envoy chose the route before any filter ran, so a spoofed header may already have picked a
   * fallback route: strip it and make Envoy choose again. */
  if (!r->listener_strips_routing_header && get_header(MAP_REQUEST_HEADERS, r->routing_header, &v)) {
    mf_free((void *)v.p);
    proxy_remove_header_map_value(MAP_REQUEST_HEADERS, r->routing_header,
                                  mf_strlen(r->routing_header));
    counter_inc(r->m_spoofed);
    dirty = 1;
  }
  int forced = trigger_depth(h);
  if (dirty) clear_route_cache(FILTER_LOG_PREFIX);
  if (!r->any_active && forced <= 0) return ACTION_CONTINUE;
  const rule_t *u = match_rule(r);
  if (!u) return ACTION_CONTINUE;
  int depth = u->depth;
  if (forced > depth) depth = forced;
  if (depth == 0) return ACTION_CONTINUE;
  if (u->mode == MODE_REJECT) {
    reject(h, u);
    return ACTION_PAUSE;
  }
  size_t index = (size_t)depth > u->n_fallbacks ? u->n_fallbacks - 1 : (size_t)depth - 1;
  const char *target = u->fallbacks[index];
  proxy_replace_header_map_value(MAP_REQUEST_HEADERS, r->routing_header,
                                 mf_strlen(r->routing_header), target, mf_strlen(target));
  clear_route_cache(FILTER_LOG_PREFIX);
  counter_inc(r->m_rerouted);
  return ACTION_CONTINUE;
}
