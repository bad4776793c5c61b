/* meshfn model router: routes an OpenAI request by the `model` named in its JSON body.
 *
 * For POST requests to the configured paths (/v1/chat/completions, /v1/completions,
 * /v1/embeddings and KServe's /openai/v1/... spelling) the request waits for its body (the
 * listener reads small bodies whole before any filter anyway), which is parsed strictly (a key
 * given twice is an error, so the body cannot name one model for this filter and another for
 * the backend). A `model` that is one of the configured names is written to the routing header
 * (which the listener strips from every client request before Envoy picks a route, so only
 * this filter can have set it) and the route cache is cleared: Envoy picks the route again,
 * and the translator's model routes, matching that header, rewrite the path to
 * /v2/models/{model}/openai/v1/..., the path the backend's sidecars authorise. Anything else is
 * answered here with OpenAI's error object: 400 (not JSON, not an object, no model, a model
 * that is not a string), 404 (a model this gateway does not serve: `model_not_found`), 413 (a
 * body over max_body_bytes). Only part of the combined plugin (meshfn/meshfn.c), which runs the
 * degrade part after it, on the route this filter chose.
 *
 * KServe gRPC (`grpc`: at a gateway that sheds by priority, where each Function's calls go to
 * its own circuit breakers): a unary call to one of grpc.paths (ModelInfer) waits for its
 * message, whose `model_name` (ModelInferRequest field 1; the last one, as protobuf parsers
 * read it) is written to the routing header when it is one of grpc.models. Nothing is refused
 * here: a compressed, malformed or oversized message (over max_body_bytes or GRPC_WAIT_MAX), or
 * another model, passes unrouted (the backend's own gRPC route) and the backend answers it as
 * it would. */
#include "route.h"

#include "../common/filter_base.h"

const char *const FILTER_LOG_PREFIX = "meshfn route: ";

#define MAX_PATHS 16
#define MAX_MODELS 4096
#define MAX_MODEL_LEN 63

enum { IDLE = 0, WAITING = 1, DONE = 2, WAITING_GRPC = 3 };

/* A gRPC message's 5-byte prefix (compressed flag, big-endian length). */
#define GRPC_PREFIX 5
/* The most of a gRPC call the router holds back: below Envoy's default buffer limit per stream
 * (per_connection_buffer_limit_bytes, 1 MiB, which meshfn keeps) by a read's worth, so a larger
 * message passes unrouted instead of Envoy answering 413 while the router waits. */
#define GRPC_WAIT_MAX (960u << 10)

struct root {
  char *header;
  char **paths;
  size_t n_paths;
  char **models;
  size_t n_models;
  char **grpc_paths;
  size_t n_grpc_paths;
  char **grpc_models;
  size_t n_grpc_models;
  uint64_t max_body;
  uint32_t m_routed, m_refused;
};

struct http {
  root_t *root;
  int state;
};

static void free_list(char **items, size_t n) {
  for (size_t i = 0; i < n; i++) mf_free(items[i]);
  mf_free(items);
}

root_t *filter_root_new(void) { return mf_calloc(sizeof(root_t)); }

void filter_root_free(root_t *r) {
  if (!r) return;
  mf_free(r->header);
  free_list(r->paths, r->n_paths);
  free_list(r->models, r->n_models);
  free_list(r->grpc_paths, r->n_grpc_paths);
  free_list(r->grpc_models, r->n_grpc_models);
  mf_free(r);
}

/* A model name as meshfn's Functions spell them: [a-z0-9] at both ends, [a-z0-9._-] between. */
static int model_ok(const char *p, size_t n) {
  if (n == 0 || n > MAX_MODEL_LEN) return 0;
  for (size_t i = 0; i < n; i++) {
    char c = p[i];
    int edge = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9');
    if (!edge && (i == 0 || i == n - 1 || !(c == '.' || c == '_' || c == '-'))) return 0;
  }
  return 1;
}

static int path_ok(const jnode_t *v) {
  if (v->type != J_STR || v->len < 2 || v->len > 128 || v->str[0] != '/') return 0;
  for (size_t i = 0; i < v->len; i++)
    if (v->str[i] < 0x21 || v->str[i] > 0x7e || v->str[i] == '?') return 0;
  return 1;
}

/* `empty`: the array may be empty (OpenAI's paths and models, where gRPC is routed). */
static int read_list(const jnode_t *c, const char *key, size_t max, int (*ok)(const jnode_t *),
                     int empty, char ***out, size_t *count, char *err, size_t es) {
  const jnode_t *v = json_get(c, key);
  if (!v) return set_err(err, es, key, "required"), 0;
  if (v->type != J_ARR || (v->len == 0 && !empty) || v->len > max)
    return set_err(err, es, key, "must be a non-empty array (bounded)"), 0;
  if (v->len == 0) return 1;
  *out = mf_calloc(v->len * sizeof(char *));
  if (!*out) return set_err(err, es, key, "out of memory"), 0;
  for (const jnode_t *e = v->child; e; e = e->next) {
    if (!ok(e)) return set_err(err, es, key, "has an invalid entry"), 0;
    (*out)[*count] = str_dup((str_t){e->str, e->len});
    if (!(*out)[*count]) return set_err(err, es, key, "out of memory"), 0;
    (*count)++;
  }
  return 1;
}

static int model_entry_ok(const jnode_t *v) { return v->type == J_STR && model_ok(v->str, v->len); }

/* "grpc." in front of a gRPC list's error ("grpc.paths: ..."). */
static void prefix_grpc(char *err, size_t es) {
  char tmp[128];
  size_t n = mf_strlen(err);
  if (n + 6 > sizeof tmp) n = sizeof tmp - 6;
  mf_memcpy(tmp, "grpc.", 5);
  mf_memcpy(tmp + 5, err, n);
  tmp[5 + n] = 0;
  size_t total = 5 + n < es - 1 ? 5 + n : es - 1;
  mf_memcpy(err, tmp, total);
  err[total] = 0;
}

static int header_ok(const jnode_t *v) {
  if (v->type != J_STR || v->len == 0 || v->len > 64) return 0;
  for (size_t i = 0; i < v->len; i++) {
    char c = v->str[i];
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_')) return 0;
  }
  return 1;
}

/* {"paths": [...], "models": [...]}: KServe gRPC methods routed by the message's model_name. */
static int read_grpc(root_t *r, const jnode_t *g, char *err, size_t es) {
  static const char *const keys[] = {"paths", "models", 0};
  if (g->type != J_OBJ) return set_err(err, es, "grpc", "must be an object"), 0;
  const jnode_t *bad = json_unknown_key(g, keys);
  if (bad) return set_err(err, es, "grpc", "has an unknown field"), 0;
  if (!read_list(g, "paths", MAX_PATHS, path_ok, 0, &r->grpc_paths, &r->n_grpc_paths, err, es))
    return prefix_grpc(err, es), 0;
  if (!read_list(g, "models", MAX_MODELS, model_entry_ok, 0, &r->grpc_models,
                 &r->n_grpc_models, err, es))
    return prefix_grpc(err, es), 0;
  return 1;
}

int filter_configure(root_t *r, const jnode_t *c, char *err, size_t es) {
  static const char *const keys[] = {"header", "paths", "models", "max_body_bytes", "grpc", 0};
  const jnode_t *bad = json_unknown_key(c, keys);
  if (bad) return set_err(err, es, bad->key, "unknown field"), 0;
  const jnode_t *h = json_get(c, "header");
  if (!h || !header_ok(h)) return set_err(err, es, "header", "must be a lowercase header name"), 0;
  r->header = str_dup((str_t){h->str, h->len});
  if (!r->header) return set_err(err, es, "header", "out of memory"), 0;
  const jnode_t *g = json_get(c, "grpc");
  if (g && g->type == J_NULL) g = 0;
  if (g && !read_grpc(r, g, err, es)) return 0;
  /* With gRPC routed, OpenAI's paths and models may be empty (together). */
  if (!read_list(c, "paths", MAX_PATHS, path_ok, g != 0, &r->paths, &r->n_paths, err, es))
    return 0;
  if (!read_list(c, "models", MAX_MODELS, model_entry_ok, g != 0, &r->models, &r->n_models, err,
                 es))
    return 0;
  if ((r->n_paths == 0) != (r->n_models == 0))
    return set_err(err, es, "models", "must be empty exactly when paths is"), 0;
  const jnode_t *m = json_get(c, "max_body_bytes");
  r->max_body = 1 << 20;
  if (m && (m->type != J_NUM || !m->is_int || m->num < 1 || m->num > (64 << 20)))
    return set_err(err, es, "max_body_bytes", "must be an integer in 1..67108864"), 0;
  if (m) r->max_body = (uint64_t)m->num;
  r->m_routed = define_counter("meshfn_route.routed");
  r->m_refused = define_counter("meshfn_route.refused");
  return 1;
}

http_t *filter_http_new(root_t *root, uint32_t context_id) {
  (void)context_id;
  http_t *h = mf_calloc(sizeof(http_t));
  if (h) h->root = root;
  return h;
}

void filter_http_free(http_t *h) { mf_free(h); }

/* OpenAI's error object as a local reply. */
static void refuse(http_t *h, uint32_t status, const char *message, const char *model,
                   size_t model_len, const char *param, const char *code) {
  sb_t body, hdrs;
  sb_init(&body, 256);
  sb_lit(&body, "{\"error\":{\"message\":");
  sb_t text;
  sb_init(&text, 128);
  sb_lit(&text, message);
  if (model) {
    sb_put(&text, model, model_len);
    sb_lit(&text, "' does not exist or you do not have access to it");
  }
  sb_json_str(&body, text.p ? text.p : "", text.oom ? 0 : text.len);
  sb_free(&text);
  sb_lit(&body, status == 413 || status == 400 || status == 404 ? ",\"type\":\"invalid_request_error\""
                                                                 : ",\"type\":\"server_error\"");
  sb_lit(&body, ",\"param\":");
  if (param) {
    sb_ch(&body, '"');
    sb_lit(&body, param);
    sb_ch(&body, '"');
  } else {
    sb_lit(&body, "null");
  }
  sb_lit(&body, ",\"code\":");
  if (code) {
    sb_ch(&body, '"');
    sb_lit(&body, code);
    sb_ch(&body, '"');
  } else {
    sb_lit(&body, "null");
  }
  sb_lit(&body, "}}\n");
  static const char k1[] = "content-type", v1[] = "application/json";
  uint32_t sizes[3] = {1, sizeof k1 - 1, sizeof v1 - 1};
  sb_init(&hdrs, 64);
  for (int i = 0; i < 3; i++) {
    uint8_t le[4] = {(uint8_t)sizes[i], (uint8_t)(sizes[i] >> 8), (uint8_t)(sizes[i] >> 16),
                     (uint8_t)(sizes[i] >> 24)};
    sb_put(&hdrs, (const char *)le, 4);
  }
  sb_put(&hdrs, k1, sizeof k1);
  sb_put(&hdrs, v1, sizeof v1);
  static const char details[] = "meshfn_model_route";
  if (!body.oom && !hdrs.oom)
    proxy_send_local_response(status, details, sizeof details - 1, body.p, body.len, hdrs.p,
                              hdrs.len, -1);
  counter_inc(h->root->m_refused);
  sb_free(&body);
  sb_free(&hdrs);
  h->state = DONE;
}

static int listed(char **items, size_t n, const char *p, size_t len) {
  for (size_t i = 0; i < n; i++)
    if (mf_strlen(items[i]) == len && mf_memeq(items[i], p, len)) return 1;
  return 0;
}

/* A gRPC call to a routed method waits for its message (a call without one passes). */
static uint32_t grpc_request_headers(http_t *h, uint32_t eos) {
  str_t type;
  if (eos || !get_header(MAP_REQUEST_HEADERS, "content-type", &type)) return ROUTE_PASS;
  int is_grpc = type.n >= 16 && mf_memeq(type.p, "application/grpc", 16);
  mf_free((void *)type.p);
  if (!is_grpc) return ROUTE_PASS;
  h->state = WAITING_GRPC;
  return ROUTE_WAIT;
}

/* A base-128 varint at *p (before end), at most 10 bytes; 0 if truncated or too long. */
static int varint(const uint8_t **p, const uint8_t *end, uint64_t *out) {
  uint64_t v = 0;
  for (int shift = 0; shift < 70; shift += 7) {
    if (*p >= end) return 0;
    uint8_t b = *(*p)++;
    v |= (uint64_t)(b & 0x7f) << shift;
    if (!(b & 0x80)) {
      *out = v;
      return 1;
    }
  }
  return 0;
}

/* The model_name (field 1, a string) of a ModelInferRequest that is the whole body: exactly one
 * uncompressed gRPC message, every field well formed; the last occurrence wins, as in any
 * protobuf parser (one given with another wire type is an unknown field to them: skipped).
 * 0: no such name (the call passes unrouted). */
static int grpc_model(const char *data, size_t n, const char **name, size_t *len) {
  const uint8_t *p = (const uint8_t *)data, *end = p + n;
  if (n < GRPC_PREFIX || p[0] != 0) return 0; /* compressed (or no message): not read here */
  uint64_t size = ((uint64_t)p[1] << 24) | ((uint64_t)p[2] << 16) | ((uint64_t)p[3] << 8) | p[4];
  if (size != n - GRPC_PREFIX) return 0;
  p += GRPC_PREFIX;
  int found = 0;
  while (p < end) {
    uint64_t key, value;
    if (!varint(&p, end, &key) || key >> 3 == 0) return 0;
    switch (key & 7) {
      case 0: /* varint */
        if (!varint(&p, end, &value)) return 0;
        break;
      case 1: /* 64-bit */
        if (end - p < 8) return 0;
        p += 8;
        break;
      case 2: /* length-delimited */
        if (!varint(&p, end, &value) || value > (uint64_t)(end - p)) return 0;
        if (key >> 3 == 1) {
          *name = (const char *)p;
          *len = (size_t)value;
          found = 1;
        }
        p += value;
        break;
      case 5: /* 32-bit */
        if (end - p < 4) return 0;
        p += 4;
        break;
      default: /* groups, and wire types that do not exist */
        return 0;
    }
  }
  return found;
}

/* The routing header from the model `name`, and Envoy picks the route again. */
static void route_to(http_t *h, const char *name, size_t len) {
  root_t *r = h->root;
  proxy_replace_header_map_value(MAP_REQUEST_HEADERS, r->header, mf_strlen(r->header), name, len);
  clear_route_cache(FILTER_LOG_PREFIX);
  counter_inc(r->m_routed);
  h->state = DONE;
}

/* A gRPC call's message so far: routed by its model at its end; ROUTE_PASS (unrouted) when it
 * cannot be (too large to wait for, unreadable, another model). */
static uint32_t grpc_request_body(http_t *h, uint32_t size, uint32_t eos) {
  root_t *r = h->root;
  if (size > r->max_body + GRPC_PREFIX || size > GRPC_WAIT_MAX) {
    h->state = DONE;
    return ROUTE_PASS;
  }
  if (!eos) return ROUTE_WAIT;
  h->state = DONE;
  char *data = 0;
  size_t n = 0;
  if (!size || proxy_get_buffer_bytes(BUF_REQUEST_BODY, 0, size, &data, &n) != WR_OK || !data) {
    mf_free(data);
    return ROUTE_PASS;
  }
  const char *name = 0;
  size_t len = 0;
  uint32_t out = ROUTE_PASS;
  if (grpc_model(data, n, &name, &len) && listed(r->grpc_models, r->n_grpc_models, name, len)) {
    route_to(h, name, len);
    out = ROUTE_DONE;
  }
  mf_free(data);
  return out;
}

/* ROUTE_PASS: not a request this filter routes; ROUTE_WAIT: wait for the body; ROUTE_REPLIED:
 * answered here. */
uint32_t route_request_headers(http_t *h, uint32_t eos) {
  root_t *r = h->root;
  str_t method, path;
  if (!get_header(MAP_REQUEST_HEADERS, ":method", &method)) return ROUTE_PASS;
  int post = str_eq_lit(method, "POST");
  mf_free((void *)method.p);
  if (!post || !get_header(MAP_REQUEST_HEADERS, ":path", &path)) return ROUTE_PASS;
  size_t n = 0;
  while (n < path.n && path.p[n] != '?' && path.p[n] != '#') n++;
  int routed = listed(r->paths, r->n_paths, path.p, n);
  int grpc = !routed && listed(r->grpc_paths, r->n_grpc_paths, path.p, n);
  mf_free((void *)path.p);
  if (grpc) return grpc_request_headers(h, eos);
  if (!routed) return ROUTE_PASS;
  if (eos) {
    refuse(h, 400, "you must provide a model parameter", 0, 0, "model", 0);
    return ROUTE_REPLIED;
  }
  h->state = WAITING;
  return ROUTE_WAIT;
}

/* The body so far (`size` bytes buffered), `eos` at its end: ROUTE_WAIT for more, ROUTE_DONE
 * with the routing header set, ROUTE_REPLIED when refused, ROUTE_PASS when not waiting. */
uint32_t route_request_body(http_t *h, uint32_t size, uint32_t eos) {
  root_t *r = h->root;
  if (h->state == WAITING_GRPC) return grpc_request_body(h, size, eos);
  if (h->state != WAITING) return ROUTE_PASS;
  if (size > r->max_body) {
    refuse(h, 413, "the request body is too large", 0, 0, 0, 0);
    return ROUTE_REPLIED;
  }
  if (!eos) return ROUTE_WAIT;
  char *data = 0;
  size_t n = 0;
  if (size && (proxy_get_buffer_bytes(BUF_REQUEST_BODY, 0, size, &data, &n) != WR_OK || !data)) {
    mf_free(data);
    refuse(h, 400, "the request body could not be read", 0, 0, 0, 0);
    return ROUTE_REPLIED;
  }
  char err[96];
  jnode_t *body = data ? json_parse(data, n, err, sizeof err) : 0;
  mf_free(data);
  uint32_t out = ROUTE_REPLIED;
  const jnode_t *model = body && body->type == J_OBJ ? json_get(body, "model") : 0;
  if (!body) {
    refuse(h, 400, "the request body is not valid JSON", 0, 0, 0, 0);
  } else if (body->type != J_OBJ) {
    refuse(h, 400, "the request body must be a JSON object", 0, 0, 0, 0);
  } else if (!model) {
    refuse(h, 400, "you must provide a model parameter", 0, 0, "model", 0);
  } else if (model->type != J_STR) {
    refuse(h, 400, "model must be a string", 0, 0, "model", 0);
  } else if (!listed(r->models, r->n_models, model->str, model->len)) {
    refuse(h, 404, "the model '", model->str, model->len > 128 ? 128 : model->len, "model",
           "model_not_found");
  } else {
    route_to(h, model->str, model->len);
    out = ROUTE_DONE;
  }
  json_free(body);
  return out;
}
