/* meshfn audit filter.
 *
 * Per request it derives the fields only a filter can: the subject as HMAC-SHA256(salt, JWT sub)
 * (never the raw subject), the tenant claim and a SHA-256 of the request body (opt-in, capped,
 * off for streaming bodies). It publishes them as one JSON object in the filter state
 * `wasm.meshfn_audit`; Envoy's access log joins that with what Envoy itself knows (request id,
 * trace headers, status, duration, upstream cluster, peer principal) and writes the record.
 * Nothing from the token, the salt or the body itself ever enters that object.
 *
 * Cost matters (every request pays it): the filter exports no response callback and makes 2-3
 * host calls per request. In jwt_authn mode it must therefore sit AFTER jwt_authn in the chain,
 * where the verified payload is already in dynamic metadata; requests jwt_authn rejects are
 * still recorded by the access log (status 401, no filter fields). */
#include "../common/filter_base.h"
#include "../common/sha256.h"

const char *const FILTER_LOG_PREFIX = "meshfn audit: ";

#define MAX_SALT 64
#define MAX_FIELD 128       /* tenant, request id: longer values are truncated, flagged */
#define MAX_TOKEN 16384     /* a bearer token longer than this is not parsed */
#define PROPERTY "meshfn_audit"
/* Subjects repeat (a caller reuses its token until it expires), so each configuration remembers
 * the HMAC of recent subjects: a direct-mapped table keyed by the subject's bytes. A longer
 * subject, or one whose slot another subject holds, is hashed as usual. */
#define SUBJECT_SLOTS 256
#define SUBJECT_SLOT_MAX 64

typedef struct {
  uint8_t len; /* 0: empty (an empty subject is never hashed) */
  char sub[SUBJECT_SLOT_MAX];
  uint8_t mac[32];
} subject_slot_t;

/* Where the subject comes from:
 *  jwt_authn   - the verified payload jwt_authn put in dynamic metadata (no extra config, but a
 *                metadata lookup is a CEL evaluation in Envoy: ~15 us per request)
 *  jwt_headers - headers jwt_authn's claim_to_headers wrote from the verified token (~1 us; the
 *                translator must also remove these headers from client requests before any
 *                filter runs: filters.early_header_mutation)
 *  header      - the bearer token itself, decoded but NOT verified (meshes without jwt_authn) */
enum { SRC_JWT_AUTHN = 0, SRC_HEADER = 1, SRC_JWT_HEADERS = 2 };

struct root {
  hmac_key_t salt; /* the subject salt, pre-hashed into HMAC key blocks */
  char *salt_id;
  int source;
  char *metadata_key;  /* jwt_authn payload_in_metadata name */
  char *token_header;  /* header mode: where the bearer token is */
  char *tenant_claim;  /* "" = none */
  char *sub_header, *tenant_header; /* jwt_headers mode */
  int body_hash;
  int bare; /* jwt_headers mode without body hashing: the filter state is the subject alone */
  uint64_t body_max;
  uint32_t m_hashed, m_body_skipped, m_emit_failed, m_bad_token;
  subject_slot_t *subjects; /* SUBJECT_SLOTS entries; NULL: out of memory, no cache */
};

enum { BODY_OFF, BODY_EMPTY, BODY_HASHING, BODY_HASHED, BODY_STREAMING, BODY_TOO_LARGE };
static const char *const BODY_NAMES[] = {"off",    "empty",     "incomplete",
                                         "hashed", "streaming", "too_large"};

struct http {
  root_t *root;
  char *tenant;
  size_t tenant_len;
  uint8_t subject[32];
  int have_subject;
  int body;
  sha256_t sha;
  uint64_t body_seen;
  uint8_t body_digest[32];
};

/* ------------------------------------------------------------------ configuration */

root_t *filter_root_new(void) { return mf_calloc(sizeof(root_t)); }

void filter_root_free(root_t *r) {
  if (!r) return;
  mf_free(r->salt_id);
  mf_free(r->metadata_key);
  mf_free(r->token_header);
  mf_free(r->tenant_claim);
  mf_free(r->sub_header);
  mf_free(r->tenant_header);
  if (r->subjects) mf_memset(r->subjects, 0, SUBJECT_SLOTS * sizeof(subject_slot_t));
  mf_free(r->subjects);
  mf_free(r);
}

static int hexnib(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

/* A header name as Envoy stores it: lowercase token characters only. */
static int header_name_ok(const jnode_t *v) {
  if (v->len == 0 || v->len > 64) return 0;
  for (size_t i = 0; i < v->len; i++) {
    char c = v->str[i];
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_')) return 0;
  }
  return 1;
}

static int printable_ascii(const jnode_t *v, size_t max) {
  if (v->len > max) return 0;
  for (size_t i = 0; i < v->len; i++)
    if (v->str[i] < 0x21 || v->str[i] > 0x7e) return 0;
  return 1;
}

static char *dup_or(const jnode_t *v, const char *fallback) {
  return v ? str_dup((str_t){v->str, v->len}) : str_dup((str_t){fallback, mf_strlen(fallback)});
}

int filter_configure(root_t *r, const jnode_t *c, char *err, size_t es) {
  static const char *const keys[] = {"subject_salt",  "salt_id",      "subject_source",
                                     "jwt_metadata_key", "token_header", "tenant_claim",
                                     "sub_header",    "tenant_header", "body_hash",
                                     0};
  const jnode_t *bad = json_unknown_key(c, keys);
  if (bad) return set_err(err, es, bad->key, "unknown field"), 0;

  const jnode_t *v = json_get(c, "subject_salt");
  if (!v) return set_err(err, es, "subject_salt", "required"), 0;
  if (v->type != J_STR || v->len % 2 || v->len < 32 || v->len > 2 * MAX_SALT ||
      !is_hex((str_t){v->str, v->len}))
    return set_err(err, es, "subject_salt", "must be 32-128 hex digits (16-64 bytes)"), 0;
  uint8_t salt[MAX_SALT];
  size_t salt_len = v->len / 2;
  for (size_t i = 0; i < salt_len; i++)
    salt[i] = (uint8_t)(hexnib(v->str[2 * i]) << 4 | hexnib(v->str[2 * i + 1]));
  hmac_sha256_key(&r->salt, salt, salt_len);
  r->subjects = mf_calloc(SUBJECT_SLOTS * sizeof(subject_slot_t));
  mf_memset(salt, 0, sizeof salt);

  v = json_get(c, "salt_id");
  if (v && (v->type != J_STR || v->len == 0 || !printable_ascii(v, 64)))
    return set_err(err, es, "salt_id", "must be 1-64 printable ASCII characters"), 0;
  r->salt_id = dup_or(v, "default");

  v = json_get(c, "subject_source");
  r->source = SRC_JWT_AUTHN;
  if (v) {
    if (v->type == J_STR && str_eq_lit((str_t){v->str, v->len}, "jwt_authn")) r->source = SRC_JWT_AUTHN;
    else if (v->type == J_STR && str_eq_lit((str_t){v->str, v->len}, "header")) r->source = SRC_HEADER;
    else if (v->type == J_STR && str_eq_lit((str_t){v->str, v->len}, "jwt_headers"))
      r->source = SRC_JWT_HEADERS;
    else
      return set_err(err, es, "subject_source",
                     "must be \"jwt_authn\", \"jwt_headers\" or \"header\""),
             0;
  }

  v = json_get(c, "jwt_metadata_key");
  if (v && (v->type != J_STR || v->len == 0 || !printable_ascii(v, 128)))
    return set_err(err, es, "jwt_metadata_key", "must be 1-128 printable ASCII characters"), 0;
  r->metadata_key = dup_or(v, "jwt_payload");

  v = json_get(c, "token_header");
  if (v && (v->type != J_STR || !header_name_ok(v)))
    return set_err(err, es, "token_header", "must be a lowercase header name"), 0;
  r->token_header = dup_or(v, "authorization");

  v = json_get(c, "sub_header");
  if (v && (v->type != J_STR || !header_name_ok(v)))
    return set_err(err, es, "sub_header", "must be a lowercase header name"), 0;
  r->sub_header = dup_or(v, "x-meshfn-jwt-sub");
  v = json_get(c, "tenant_header");
  if (v && (v->type != J_STR || !header_name_ok(v)))
    return set_err(err, es, "tenant_header", "must be a lowercase header name"), 0;
  r->tenant_header = dup_or(v, "x-meshfn-jwt-tenant");

  v = json_get(c, "tenant_claim");
  if (v && (v->type != J_STR || !printable_ascii(v, 128)))
    return set_err(err, es, "tenant_claim", "must be a claim name (printable ASCII) or \"\""), 0;
  r->tenant_claim = dup_or(v, "tenant");

  r->body_hash = 0;
  r->body_max = 1 << 20;
  v = json_get(c, "body_hash");
  if (v) {
    static const char *const bkeys[] = {"enabled", "max_bytes", 0};
    if (v->type != J_OBJ) return set_err(err, es, "body_hash", "must be an object"), 0;
    bad = json_unknown_key(v, bkeys);
    if (bad) return set_err(err, es, "body_hash", "unknown field"), 0;
    const jnode_t *e = json_get(v, "enabled");
    if (e && e->type != J_BOOL) return set_err(err, es, "body_hash.enabled", "must be a boolean"), 0;
    r->body_hash = e ? e->boolean : 0;
    const jnode_t *m = json_get(v, "max_bytes");
    if (m && (m->type != J_NUM || !m->is_int || m->num < 1 || m->num > (1 << 30)))
      return set_err(err, es, "body_hash.max_bytes", "must be an integer in 1..1073741824"), 0;
    if (m) r->body_max = (uint64_t)m->num;
  }
#ifndef FILTER_WANTS_BODY
  if (r->body_hash)
    return set_err(err, es, "body_hash.enabled",
                   "needs the full build (audit.wasm or meshfn.wasm); this build sees request "
                   "headers only"), 0;
#endif
  /* Everything else a record needs is constant per configuration (salt_id, subject_source) or
   * logged by Envoy itself (the tenant, from jwt_authn's verified payload in dynamic metadata):
   * filters.access_log(settings) writes those next to the filter state. */
  r->bare = r->source == SRC_JWT_HEADERS && !r->body_hash;
  if (!r->salt_id || !r->metadata_key || !r->token_header || !r->tenant_claim || !r->sub_header ||
      !r->tenant_header)
    return set_err(err, es, "configuration", "out of memory"), 0;

  r->m_bad_token = define_counter("meshfn_audit.token_unreadable");
  r->m_hashed = define_counter("meshfn_audit.body_hashed");
  r->m_body_skipped = define_counter("meshfn_audit.body_not_hashed");
  r->m_emit_failed = define_counter("meshfn_audit.emit_failed");
  return 1;
}

/* ------------------------------------------------------------------ per request */

http_t *filter_http_new(root_t *root, uint32_t context_id) {
  (void)context_id;
  http_t *h = mf_calloc(sizeof(http_t));
  if (h) h->root = root;
  return h;
}

void filter_http_free(http_t *h) {
  if (!h) return;
  mf_free(h->tenant);
  mf_free(h);
}

static char *copy_capped(str_t s, size_t cap, size_t *len) {
  size_t n = s.n < cap ? s.n : cap;
  char *p = mf_alloc(n + 1);
  if (!p) return 0;
  mf_memcpy(p, s.p, n);
  *len = n;
  return p;
}

static void take_subject(http_t *h, str_t sub) {
  subject_slot_t *slot = 0;
  h->have_subject = 1;
  if (h->root->subjects && sub.n <= SUBJECT_SLOT_MAX) {
    uint32_t x = 2166136261u; /* FNV-1a */
    for (size_t i = 0; i < sub.n; i++) x = (x ^ (uint8_t)sub.p[i]) * 16777619u;
    slot = &h->root->subjects[x % SUBJECT_SLOTS];
    if (slot->len == sub.n && mf_memeq(slot->sub, sub.p, sub.n)) {
      mf_memcpy(h->subject, slot->mac, 32);
      return;
    }
  }
  hmac_sha256_with(&h->root->salt, sub.p, sub.n, h->subject);
  if (slot) {
    slot->len = (uint8_t)sub.n;
    mf_memcpy(slot->sub, sub.p, sub.n);
    mf_memcpy(slot->mac, h->subject, 32);
  }
}

static void take_tenant(http_t *h, str_t t) {
  mf_free(h->tenant);
  h->tenant = copy_capped(t, MAX_FIELD, &h->tenant_len);
}

/* ---- header mode: the claims of an (unverified) bearer token */

static int b64url_val(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '-') return 62;
  if (c == '_') return 63;
  return -1;
}

/* Decodes unpadded base64url (padding tolerated); NULL on any invalid character. */
static char *b64url_decode(str_t s, size_t *out_len) {
  while (s.n && s.p[s.n - 1] == '=') s.n--;
  if (s.n % 4 == 1) return 0;
  char *out = mf_alloc(s.n * 3 / 4 + 3);
  if (!out) return 0;
  size_t o = 0;
  uint32_t acc = 0;
  int bits = 0;
  for (size_t i = 0; i < s.n; i++) {
    int v = b64url_val(s.p[i]);
    if (v < 0) {
      mf_free(out);
      return 0;
    }
    acc = (acc << 6) | (uint32_t)v;
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out[o++] = (char)(acc >> bits);
      acc &= (1u << bits) - 1;
    }
  }
  *out_len = o;
  return out;
}

static void claims_from_token(http_t *h) {
  str_t v;
  if (!get_header(MAP_REQUEST_HEADERS, h->root->token_header, &v)) return;
  str_t t = str_trim(v);
  int readable = 0;
  if (t.n > 7 && t.n <= MAX_TOKEN && str_ieq_lit((str_t){t.p, 7}, "bearer ")) {
    str_t tok = str_trim((str_t){t.p + 7, t.n - 7});
    size_t d1 = 0, d2 = 0, dots = 0;
    for (size_t i = 0; i < tok.n; i++) {
      if (tok.p[i] == '.') {
        if (dots == 0) d1 = i;
        else if (dots == 1) d2 = i;
        dots++;
      }
    }
    if (dots == 2 && d2 > d1 + 1) {
      size_t len = 0;
      char *payload = b64url_decode((str_t){tok.p + d1 + 1, d2 - d1 - 1}, &len);
      char err[64];
      jnode_t *claims = payload ? json_parse(payload, len, err, sizeof err) : 0;
      if (claims && claims->type == J_OBJ) {
        readable = 1;
        jnode_t *sub = json_get(claims, "sub");
        if (sub && sub->type == J_STR && sub->len) take_subject(h, (str_t){sub->str, sub->len});
        if (h->root->tenant_claim[0]) {
          jnode_t *ten = json_get(claims, h->root->tenant_claim);
          if (ten && ten->type == J_STR) take_tenant(h, (str_t){ten->str, ten->len});
        }
      }
      json_free(claims);
      mf_free(payload);
    }
  }
  if (!readable) counter_inc(h->root->m_bad_token);
  mf_free((void *)v.p);
}

/* ---- jwt_authn mode: the verified payload jwt_authn put in dynamic metadata */

static int metadata_claim(http_t *h, const char *claim, str_t *out) {
  sb_t path;
  sb_init(&path, 128);
  sb_lit(&path, "metadata");
  sb_ch(&path, 0);
  sb_lit(&path, "filter_metadata");
  sb_ch(&path, 0);
  sb_lit(&path, "envoy.filters.http.jwt_authn");
  sb_ch(&path, 0);
  sb_lit(&path, h->root->metadata_key);
  sb_ch(&path, 0);
  sb_lit(&path, claim);
  int found = !path.oom && get_property(path.p, path.len, out);
  sb_free(&path);
  return found;
}

static void claims_from_metadata(http_t *h) {
  str_t v;
  if (!metadata_claim(h, "sub", &v)) return; /* no verified token: no tenant either */
  if (v.n) take_subject(h, v);
  mf_free((void *)v.p);
  if (h->root->tenant_claim[0] && metadata_claim(h, h->root->tenant_claim, &v)) {
    take_tenant(h, v);
    mf_free((void *)v.p);
  }
}

/* ---- jwt_headers mode: headers jwt_authn's claim_to_headers set from the verified token */

static void claims_from_headers(http_t *h) {
  str_t v;
  if (!get_header(MAP_REQUEST_HEADERS, h->root->sub_header, &v)) return;
  if (v.n) take_subject(h, v);
  mf_free((void *)v.p);
  if (h->root->bare) return; /* the access log records the tenant */
  if (h->root->tenant_claim[0] && get_header(MAP_REQUEST_HEADERS, h->root->tenant_header, &v)) {
    take_tenant(h, v);
    mf_free((void *)v.p);
  }
}

/* ---- the filter state */

static void set_state(http_t *h, const char *p, size_t n) {
  if (proxy_set_property(PROPERTY, sizeof PROPERTY - 1, p, n) != WR_OK) {
    counter_inc(h->root->m_emit_failed);
    log_msg(LOG_ERROR, FILTER_LOG_PREFIX, "could not set filter state wasm." PROPERTY, 37);
  }
}

/* Bare shape (jwt_headers mode, body hashing off): the 64 hex digits of the subject, or `null`
 * when the request has none (still set: the record says the filter ran). Full shape: one JSON
 * object with every field. record.from_log_line reads both. */
static void emit(http_t *h) {
  if (h->root->bare) {
    static const char digits[] = "0123456789abcdef";
    char hex[64];
    if (!h->have_subject) {
      set_state(h, "null", 4);
      return;
    }
    for (int i = 0; i < 32; i++) {
      hex[2 * i] = digits[h->subject[i] >> 4];
      hex[2 * i + 1] = digits[h->subject[i] & 15];
    }
    set_state(h, hex, sizeof hex);
    return;
  }
  sb_t b;
  sb_init(&b, 384);
  sb_lit(&b, "{\"v\":1,\"subject\":");
  if (h->have_subject) {
    sb_ch(&b, '"');
    sb_hex(&b, h->subject, 32);
    sb_ch(&b, '"');
  } else {
    sb_lit(&b, "null");
  }
  sb_lit(&b, ",\"salt_id\":");
  sb_json_str(&b, h->root->salt_id, mf_strlen(h->root->salt_id));
  static const char *const SOURCES[] = {",\"subject_source\":\"jwt_authn\"",
                                        ",\"subject_source\":\"header\"",
                                        ",\"subject_source\":\"jwt_headers\""};
  sb_lit(&b, SOURCES[h->root->source]);
  sb_lit(&b, ",\"tenant\":");
  if (h->tenant) sb_json_str(&b, h->tenant, h->tenant_len);
  else sb_lit(&b, "null");
  sb_lit(&b, ",\"body\":\"");
  sb_lit(&b, BODY_NAMES[h->body]);
  sb_lit(&b, "\",\"body_sha256\":");
  if (h->body == BODY_HASHED) {
    sb_ch(&b, '"');
    sb_hex(&b, h->body_digest, 32);
    sb_ch(&b, '"');
  } else {
    sb_lit(&b, "null");
  }
  sb_ch(&b, '}');
  if (b.oom) {
    counter_inc(h->root->m_emit_failed);
    log_msg(LOG_ERROR, FILTER_LOG_PREFIX, "could not set filter state wasm." PROPERTY, 37);
  } else {
    set_state(h, b.p, b.len);
  }
  sb_free(&b);
}

static void body_done(http_t *h, int state) {
  h->body = state;
  counter_inc(state == BODY_HASHED ? h->root->m_hashed : h->root->m_body_skipped);
}

uint32_t filter_on_request_headers(http_t *h, uint32_t headers, uint32_t eos) {
  (void)headers;
  root_t *r = h->root;
  str_t v;
  if (r->source == SRC_HEADER) claims_from_token(h);
  else if (r->source == SRC_JWT_HEADERS) claims_from_headers(h);
  else claims_from_metadata(h);

  h->body = BODY_OFF;
  if (r->body_hash) {
    if (eos) {
      h->body = BODY_EMPTY;
    } else if (!get_header(MAP_REQUEST_HEADERS, "content-length", &v)) {
      body_done(h, BODY_STREAMING); /* chunked or HTTP/2 without a length: a stream */
    } else {
      uint64_t len = 0;
      int ok = v.n > 0 && v.n <= 19;
      for (size_t i = 0; ok && i < v.n; i++) {
        if (v.p[i] < '0' || v.p[i] > '9') ok = 0;
        else len = len * 10 + (uint64_t)(v.p[i] - '0');
      }
      mf_free((void *)v.p);
      if (!ok || len > r->body_max) {
        body_done(h, BODY_TOO_LARGE);
      } else {
        h->body = BODY_HASHING;
        sha256_init(&h->sha);
      }
    }
  }
  emit(h);
  return ACTION_CONTINUE;
}

uint32_t filter_on_request_body(http_t *h, uint32_t size, uint32_t eos) {
  if (h->body != BODY_HASHING) return ACTION_CONTINUE;
  if (size) {
    char *chunk = 0;
    size_t n = 0;
    h->body_seen += size;
    if (h->body_seen > h->root->body_max) {
      body_done(h, BODY_TOO_LARGE);
      emit(h);
      return ACTION_CONTINUE;
    }
    if (proxy_get_buffer_bytes(BUF_REQUEST_BODY, 0, size, &chunk, &n) != WR_OK || !chunk) {
      mf_free(chunk);
      return ACTION_CONTINUE; /* stays "incomplete": never claim a hash we did not compute */
    }
    sha256_update(&h->sha, chunk, n);
    mf_free(chunk);
  }
  if (eos) {
    sha256_final(&h->sha, h->body_digest);
    body_done(h, BODY_HASHED);
    emit(h);
  }
  return ACTION_CONTINUE;
}
