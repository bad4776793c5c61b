#include "json.h"

typedef struct {
  const unsigned char *p;
  size_t n, i;
  int depth;
  char *err;
  size_t err_size;
  int failed;
} parser_t;

static void fail(parser_t *ps, const char *msg) {
  if (ps->failed) return;
  ps->failed = 1;
  sb_t b;
  sb_init(&b, 64);
  sb_lit(&b, "offset ");
  sb_u64(&b, ps->i);
  sb_lit(&b, ": ");
  sb_lit(&b, msg);
  size_t n = b.oom ? 0 : (b.len < ps->err_size - 1 ? b.len : ps->err_size - 1);
  if (n) mf_memcpy(ps->err, b.p, n);
  ps->err[n] = 0;
  sb_free(&b);
}

static void skip_ws(parser_t *ps) {
  while (ps->i < ps->n) {
    unsigned char c = ps->p[ps->i];
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
    ps->i++;
  }
}

static jnode_t *new_node(parser_t *ps, jtype_t t) {
  jnode_t *node = mf_calloc(sizeof(jnode_t));
  if (!node) fail(ps, "out of memory");
  else node->type = t;
  return node;
}

static int hexval(unsigned char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

static int read_u4(parser_t *ps, uint32_t *out) {
  if (ps->i + 4 > ps->n) return 0;
  uint32_t v = 0;
  for (int k = 0; k < 4; k++) {
    int h = hexval(ps->p[ps->i + k]);
    if (h < 0) return 0;
    v = v * 16 + (uint32_t)h;
  }
  ps->i += 4;
  *out = v;
  return 1;
}

static void put_utf8(sb_t *b, uint32_t cp) {
  char t[4];
  if (cp < 0x80) {
    t[0] = (char)cp;
    sb_put(b, t, 1);
  } else if (cp < 0x800) {
    t[0] = (char)(0xc0 | (cp >> 6));
    t[1] = (char)(0x80 | (cp & 0x3f));
    sb_put(b, t, 2);
  } else if (cp < 0x10000) {
    t[0] = (char)(0xe0 | (cp >> 12));
    t[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
    t[2] = (char)(0x80 | (cp & 0x3f));
    sb_put(b, t, 3);
  } else {
    t[0] = (char)(0xf0 | (cp >> 18));
    t[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    t[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
    t[3] = (char)(0x80 | (cp & 0x3f));
    sb_put(b, t, 4);
  }
}

/* Parses a string starting at the opening quote into a fresh NUL-terminated buffer. */
static char *parse_string(parser_t *ps, size_t *len) {
  ps->i++; /* opening quote */
  sb_t b;
  sb_init(&b, 32);
  while (!ps->failed) {
    if (ps->i >= ps->n) {
      fail(ps, "unterminated string");
      break;
    }
    unsigned char c = ps->p[ps->i];
    if (c == '"') {
      ps->i++;
      sb_ch(&b, 0);
      if (b.oom) {
        fail(ps, "out of memory");
        break;
      }
      *len = b.len - 1;
      return b.p;
    }
    if (c < 0x20) {
      fail(ps, "control character in string");
      break;
    }
    if (c == '\\') {
      ps->i++;
      if (ps->i >= ps->n) {
        fail(ps, "unterminated escape");
        break;
      }
      unsigned char e = ps->p[ps->i++];
      switch (e) {
        case '"': sb_ch(&b, '"'); break;
        case '\\': sb_ch(&b, '\\'); break;
        case '/': sb_ch(&b, '/'); break;
        case 'b': sb_ch(&b, '\b'); break;
        case 'f': sb_ch(&b, '\f'); break;
        case 'n': sb_ch(&b, '\n'); break;
        case 'r': sb_ch(&b, '\r'); break;
        case 't': sb_ch(&b, '\t'); break;
        case 'u': {
          uint32_t cp;
          if (!read_u4(ps, &cp)) {
            fail(ps, "bad \\u escape");
            break;
          }
          if (cp >= 0xd800 && cp <= 0xdbff) {
            uint32_t lo;
            if (ps->i + 2 > ps->n || ps->p[ps->i] != '\\' || ps->p[ps->i + 1] != 'u') {
              fail(ps, "lone surrogate");
              break;
            }
            ps->i += 2;
            if (!read_u4(ps, &lo) || lo < 0xdc00 || lo > 0xdfff) {
              fail(ps, "lone surrogate");
              break;
            }
            cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
          } else if (cp >= 0xdc00 && cp <= 0xdfff) {
            fail(ps, "lone surrogate");
            break;
          }
          put_utf8(&b, cp);
          break;
        }
        default: fail(ps, "bad escape");
      }
      continue;
    }
    /* raw bytes: copy a run of valid UTF-8 */
    size_t j = ps->i;
    while (j < ps->n && ps->p[j] != '"' && ps->p[j] != '\\' && ps->p[j] >= 0x20) j++;
    if (!utf8_valid((const char *)ps->p + ps->i, j - ps->i)) {
      fail(ps, "invalid UTF-8");
      break;
    }
    sb_put(&b, (const char *)ps->p + ps->i, j - ps->i);
    ps->i = j;
  }
  sb_free(&b);
  return 0;
}

static void parse_number(parser_t *ps, jnode_t *node) {
  size_t start = ps->i;
  int neg = 0, frac = 0, overflow = 0;
  uint64_t v = 0;
  if (ps->p[ps->i] == '-') neg = 1, ps->i++;
  if (ps->i >= ps->n) return fail(ps, "bad number");
  if (ps->p[ps->i] == '0') {
    ps->i++;
  } else if (ps->p[ps->i] >= '1' && ps->p[ps->i] <= '9') {
    while (ps->i < ps->n && ps->p[ps->i] >= '0' && ps->p[ps->i] <= '9') {
      uint64_t d = ps->p[ps->i] - '0';
      if (v > (UINT64_C(9223372036854775807) - d) / 10) overflow = 1;
      else v = v * 10 + d;
      ps->i++;
    }
  } else {
    return fail(ps, "bad number");
  }
  if (ps->i < ps->n && ps->p[ps->i] == '.') {
    frac = 1;
    ps->i++;
    if (ps->i >= ps->n || ps->p[ps->i] < '0' || ps->p[ps->i] > '9') return fail(ps, "bad number");
    while (ps->i < ps->n && ps->p[ps->i] >= '0' && ps->p[ps->i] <= '9') ps->i++;
  }
  if (ps->i < ps->n && (ps->p[ps->i] == 'e' || ps->p[ps->i] == 'E')) {
    frac = 1;
    ps->i++;
    if (ps->i < ps->n && (ps->p[ps->i] == '+' || ps->p[ps->i] == '-')) ps->i++;
    if (ps->i >= ps->n || ps->p[ps->i] < '0' || ps->p[ps->i] > '9') return fail(ps, "bad number");
    while (ps->i < ps->n && ps->p[ps->i] >= '0' && ps->p[ps->i] <= '9') ps->i++;
  }
  (void)start;
  node->is_int = !frac && !overflow;
  node->num = neg ? -(int64_t)v : (int64_t)v;
}

static int lit(parser_t *ps, const char *word) {
  size_t n = mf_strlen(word);
  if (ps->i + n > ps->n || !mf_memeq(ps->p + ps->i, word, n)) return 0;
  ps->i += n;
  return 1;
}

static jnode_t *parse_value(parser_t *ps);

static jnode_t *parse_container(parser_t *ps, int is_obj) {
  jnode_t *node = new_node(ps, is_obj ? J_OBJ : J_ARR);
  if (!node) return 0;
  if (++ps->depth > JSON_MAX_DEPTH) {
    fail(ps, "nested too deeply");
    return node;
  }
  ps->i++; /* [ or { */
  jnode_t **tail = &node->child;
  skip_ws(ps);
  char close = is_obj ? '}' : ']';
  if (ps->i < ps->n && ps->p[ps->i] == (unsigned char)close) {
    ps->i++;
    ps->depth--;
    return node;
  }
  while (!ps->failed) {
    char *key = 0;
    size_t key_len = 0;
    if (is_obj) {
      skip_ws(ps);
      if (ps->i >= ps->n || ps->p[ps->i] != '"') {
        fail(ps, "expected a string key");
        break;
      }
      key = parse_string(ps, &key_len);
      if (!key) break;
      for (jnode_t *c = node->child; c; c = c->next) {
        if (c->key_len == key_len && mf_memeq(c->key, key, key_len)) {
          fail(ps, "duplicate key");
          break;
        }
      }
      skip_ws(ps);
      if (!ps->failed && (ps->i >= ps->n || ps->p[ps->i] != ':')) fail(ps, "expected ':'");
      if (ps->failed) {
        mf_free(key);
        break;
      }
      ps->i++;
    }
    jnode_t *child = parse_value(ps);
    if (!child) {
      mf_free(key);
      break;
    }
    child->key = key;
    child->key_len = key_len;
    *tail = child;
    tail = &child->next;
    node->len++;
    if (ps->failed) break;
    skip_ws(ps);
    if (ps->i >= ps->n) {
      fail(ps, "unterminated container");
      break;
    }
    if (ps->p[ps->i] == ',') {
      ps->i++;
      continue;
    }
    if (ps->p[ps->i] == (unsigned char)close) {
      ps->i++;
      break;
    }
    fail(ps, is_obj ? "expected ',' or '}'" : "expected ',' or ']'");
  }
  ps->depth--;
  return node;
}

static jnode_t *parse_value(parser_t *ps) {
  skip_ws(ps);
  if (ps->i >= ps->n) {
    fail(ps, "unexpected end of input");
    return 0;
  }
  unsigned char c = ps->p[ps->i];
  jnode_t *node;
  if (c == '{' || c == '[') return parse_container(ps, c == '{');
  if (c == '"') {
    node = new_node(ps, J_STR);
    if (node) node->str = parse_string(ps, &node->len);
    return node;
  }
  if (c == '-' || (c >= '0' && c <= '9')) {
    node = new_node(ps, J_NUM);
    if (node) parse_number(ps, node);
    return node;
  }
  if (lit(ps, "true") || lit(ps, "false")) {
    node = new_node(ps, J_BOOL);
    if (node) node->boolean = ps->p[ps->i - 1] == 'e' && ps->p[ps->i - 2] == 'u';
    return node;
  }
  if (lit(ps, "null")) return new_node(ps, J_NULL);
  fail(ps, "unexpected character");
  return 0;
}

jnode_t *json_parse(const char *p, size_t n, char *err, size_t err_size) {
  parser_t ps = {(const unsigned char *)p, n, 0, 0, err, err_size, 0};
  err[0] = 0;
  jnode_t *root = parse_value(&ps);
  if (!ps.failed) {
    skip_ws(&ps);
    if (ps.i != ps.n) fail(&ps, "trailing data after the JSON value");
  }
  if (ps.failed) {
    json_free(root);
    return 0;
  }
  return root;
}

void json_free(jnode_t *node) {
  while (node) {
    jnode_t *next = node->next;
    json_free(node->child);
    mf_free(node->str);
    mf_free(node->key);
    mf_free(node);
    node = next;
  }
}

jnode_t *json_get(const jnode_t *obj, const char *key) {
  if (!obj || obj->type != J_OBJ) return 0;
  size_t n = mf_strlen(key);
  for (jnode_t *c = obj->child; c; c = c->next)
    if (c->key_len == n && mf_memeq(c->key, key, n)) return c;
  return 0;
}

const jnode_t *json_unknown_key(const jnode_t *obj, const char *const *allowed) {
  for (const jnode_t *c = obj->child; c; c = c->next) {
    int ok = 0;
    for (const char *const *a = allowed; *a; a++)
      if (c->key_len == mf_strlen(*a) && mf_memeq(c->key, *a, c->key_len)) ok = 1;
    if (!ok) return c;
  }
  return 0;
}
