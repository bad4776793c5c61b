#include "filter_base.h"

#if defined(FILTER_LEAN) && (defined(FILTER_WANTS_BODY) || defined(FILTER_WANTS_RESPONSE))
#error "the lean build handles request headers only"
#endif

/* A configuration lives in a refcounted box: a stream keeps the configuration it started with
 * even if the root context is reconfigured (or deleted) before the stream ends. */
typedef struct {
  root_t *root;
  int refs;    /* streams using it + 1 while it is the root context's current one */
} box_t;

static box_t *box_new(root_t *root) {
  box_t *b = mf_calloc(sizeof(box_t));
  if (!b) {
    filter_root_free(root);
    return 0;
  }
  b->root = root;
  b->refs = 1;
  return b;
}

static void box_release(box_t *b) {
  if (b && --b->refs == 0) {
    filter_root_free(b->root);
    mf_free(b);
  }
}

/* A context is either a root (parent 0) or an HTTP stream; both live in one table, tagged. */
typedef struct {
  int is_root;
  box_t *box;   /* root: its current configuration; stream: the one it started with */
  http_t *http; /* stream only */
} entry_t;

void set_err(char *err, size_t err_size, const char *field, const char *problem) {
  sb_t b;
  sb_init(&b, 96);
  sb_lit(&b, field);
  sb_lit(&b, ": ");
  sb_lit(&b, problem);
  size_t n = b.oom ? 0 : (b.len < err_size - 1 ? b.len : err_size - 1);
  if (n) mf_memcpy(err, b.p, n);
  err[n] = 0;
  sb_free(&b);
}

/* A request this VM cannot serve correctly (its plugin's configuration was refused) gets 503,
 * never a pass-through: the filters fail closed. Envoy does create streams for a plugin whose
 * thread-local configure failed (measured: the listener stays up), so this is reachable. */
static uint32_t refuse_request(void) {
  static const char body[] =
      "{\"error\":\"meshfn filter not configured: see the proxy log\",\"status\":503}\n";
  /* serialized header map: count 1, key length 12, value length 16, key\0value\0 */
  static const char headers[] = "\x01\0\0\0\x0c\0\0\0\x10\0\0\0content-type\0application/json";
  static const char details[] = "meshfn_filter_unconfigured";
  proxy_send_local_response(503, details, sizeof details - 1, body, sizeof body - 1, headers,
                            sizeof headers, -1);
  return ACTION_PAUSE;
}

PW_EXPORT(proxy_abi_version_0_2_1) void proxy_abi_version_0_2_1(void) {}

PW_EXPORT(proxy_on_vm_start) uint32_t proxy_on_vm_start(uint32_t root_id, uint32_t size) {
  (void)root_id;
  (void)size;
  return 1;
}

#ifndef FILTER_LEAN
PW_EXPORT(proxy_on_context_create)
void proxy_on_context_create(uint32_t context_id, uint32_t parent_id) {
  entry_t *e = mf_calloc(sizeof(entry_t));
  if (!e) return;
  if (parent_id == 0) {
    e->is_root = 1;
  } else {
    entry_t *parent = ctx_get(parent_id);
    /* A stream under an unconfigured root (its configure failed) gets no state, and its
     * request is refused with 503 (refuse_request). */
    if (parent && parent->is_root && parent->box) {
      e->http = filter_http_new(parent->box->root, context_id);
      if (e->http) {
        e->box = parent->box;
        e->box->refs++;
      }
    }
  }
  ctx_put(context_id, e);
}
#endif

#ifdef FILTER_LEAN
/* The lean build keeps no per-request context: Envoy then skips proxy_on_context_create and
 * proxy_on_delete for every request (~2.5 us of Envoy CPU per request measured), and all the
 * work happens in proxy_on_request_headers. Without per-request contexts a request cannot say
 * which root context it belongs to, so a VM serves ONE configuration: a second, different one
 * is refused (fail closed). Envoy shares a VM between plugins with the same vm_id and code, so
 * whoever deploys this build gives each configuration its own vm_id (meshfn's translator puts
 * a hash of the configuration in it). */
static box_t *g_current;
static char *g_current_raw;
static size_t g_current_raw_n;
/* A second, different configuration was refused: Envoy may still run that plugin's streams in
 * this VM, and nothing tells them apart from the first plugin's, so every request is refused. */
static int g_conflict;

static int install(uint32_t root_id, root_t *fresh, char *buf, size_t n, char *err, size_t es) {
  (void)root_id;
  if (g_current && !(n == g_current_raw_n && mf_memeq(buf, g_current_raw, n))) {
    g_conflict = 1;
    filter_root_free(fresh);
    set_err(err, es, "configuration",
            "differs from the one this VM already serves; the lean build serves one "
            "configuration per VM: give each configuration its own vm_id");
    return 0;
  }
  box_t *box = box_new(fresh);
  if (!box) return set_err(err, es, "configuration", "out of memory"), 0;
  char *raw = mf_alloc(n ? n : 1);
  if (!raw) {
    box_release(box);
    return set_err(err, es, "configuration", "out of memory"), 0;
  }
  mf_memcpy(raw, buf, n);
  box_release(g_current);
  mf_free(g_current_raw);
  g_current = box;
  g_current_raw = raw;
  g_current_raw_n = n;
  return 1;
}
#else
static int install(uint32_t root_id, root_t *fresh, char *buf, size_t n, char *err, size_t es) {
  (void)buf;
  (void)n;
  entry_t *e = ctx_get(root_id);
  if (!e || !e->is_root) {
    filter_root_free(fresh);
    return set_err(err, es, "configuration", "for an unknown root context"), 0;
  }
  box_t *box = box_new(fresh);
  if (!box) return set_err(err, es, "configuration", "out of memory"), 0;
  box_release(e->box);
  e->box = box;
  return 1;
}
#endif

PW_EXPORT(proxy_on_configure) uint32_t proxy_on_configure(uint32_t root_id, uint32_t size) {
  char *buf = 0;
  size_t n = 0;
  char err[160];
  err[0] = 0;
  jnode_t *config = 0;
  int ok = 0;
  if (size == 0 || proxy_get_buffer_bytes(BUF_PLUGIN_CONFIGURATION, 0, size, &buf, &n) != WR_OK ||
      !buf) {
    set_err(err, sizeof err, "configuration", "missing (a JSON object is required)");
  } else if ((config = json_parse(buf, n, err, sizeof err)) == 0) {
    /* err set by the parser */
  } else if (config->type != J_OBJ) {
    set_err(err, sizeof err, "configuration", "must be a JSON object");
  } else {
    root_t *fresh = filter_root_new();
    if (!fresh) {
      set_err(err, sizeof err, "configuration", "out of memory");
    } else if (filter_configure(fresh, config, err, sizeof err)) {
      ok = install(root_id, fresh, buf, n, err, sizeof err);
    } else {
      filter_root_free(fresh);
    }
  }
  if (!ok) {
    sb_t b;
    sb_init(&b, 200);
    sb_lit(&b, "invalid plugin configuration, rejected: ");
    sb_lit(&b, err);
    if (!b.oom) log_msg(LOG_ERROR, FILTER_LOG_PREFIX, b.p, b.len);
    sb_free(&b);
  }
  json_free(config);
  mf_free(buf);
  return (uint32_t)ok;
}

#ifdef FILTER_LEAN
PW_EXPORT(proxy_on_request_headers)
uint32_t proxy_on_request_headers(uint32_t context_id, uint32_t headers, uint32_t eos) {
  if (!g_current || g_conflict) return refuse_request();
  http_t *h = filter_http_new(g_current->root, context_id);
  if (!h) return refuse_request(); /* out of memory */
  uint32_t action = filter_on_request_headers(h, headers, eos);
  filter_http_free(h);
  return action;
}
#else
static http_t *http_of(uint32_t context_id) {
  entry_t *e = ctx_get(context_id);
  return (e && !e->is_root) ? e->http : 0;
}

PW_EXPORT(proxy_on_request_headers)
uint32_t proxy_on_request_headers(uint32_t context_id, uint32_t headers, uint32_t eos) {
  http_t *h = http_of(context_id);
  return h ? filter_on_request_headers(h, headers, eos) : refuse_request();
}

/* Each callback Envoy makes into the VM costs a few microseconds per request, whether or not
 * the filter does anything in it: a filter exports only what it uses (see build.sh). */
#ifdef FILTER_WANTS_BODY
PW_EXPORT(proxy_on_request_body)
uint32_t proxy_on_request_body(uint32_t context_id, uint32_t size, uint32_t eos) {
  http_t *h = http_of(context_id);
  return h ? filter_on_request_body(h, size, eos) : ACTION_CONTINUE;
}
#endif

#ifdef FILTER_WANTS_RESPONSE
PW_EXPORT(proxy_on_response_headers)
uint32_t proxy_on_response_headers(uint32_t context_id, uint32_t headers, uint32_t eos) {
  http_t *h = http_of(context_id);
  return h ? filter_on_response_headers(h, headers, eos) : ACTION_CONTINUE;
}
#endif

PW_EXPORT(proxy_on_delete) void proxy_on_delete(uint32_t context_id) {
  entry_t *e = ctx_take(context_id);
  if (!e) return;
  if (e->http) filter_http_free(e->http);
  box_release(e->box);
  mf_free(e);
}
#endif
