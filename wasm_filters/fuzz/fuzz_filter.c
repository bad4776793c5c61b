/* libFuzzer driver for the proxy-wasm filters' C code (audit, degrade, both in one), linked
 * with the native test harness's fake host (harness/fake_host.c) and built with AddressSanitizer
 * and UndefinedBehaviorSanitizer (wasm_filters/fuzz/build.sh). One input is a little script, so
 * that the fuzzer reaches every part of a filter's life, not just its JSON parser:
 *
 *   line 1          the plugin configuration (bytes, as Envoy hands them to proxy_on_configure)
 *   H<name>:<value> add a request header      P<path>=<value> set a property ('|' -> NUL)
 *   S / T           a new stream: proxy_on_context_create + proxy_on_request_headers (T: eos)
 *   B<bytes>        a request body chunk       E<bytes>  the last body chunk (end of stream)
 *   C<json>         reconfigure the root       N<json>   a new root context (streams use it)
 *   D               delete the stream          R         delete the root (streams keep theirs)
 *   F               toggle failing proxy_set_property          Z  clear headers and properties
 *
 * Beyond the sanitizers' findings, each input must leave the filter's allocator where it found
 * it once every context is deleted (no leak), every filter state it wrote must be JSON (or the
 * bare 64-hex-digit subject), and every local response body JSON: a violation aborts. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../common/json.h"
#include "../common/mf.h"

/* the filter's exports (filter_base.c) */
void proxy_on_context_create(uint32_t context_id, uint32_t parent_id);
uint32_t proxy_on_configure(uint32_t root_id, uint32_t size);
uint32_t proxy_on_request_headers(uint32_t context_id, uint32_t headers, uint32_t eos);
#ifdef FILTER_WANTS_BODY
uint32_t proxy_on_request_body(uint32_t context_id, uint32_t size, uint32_t eos);
#endif
void proxy_on_delete(uint32_t context_id);

/* the fake host's controls (harness/fake_host.c) */
void host_reset(void);
void host_set_config(const char *p, size_t n);
void host_set_body(const char *p, size_t n);
void host_header_add(uint32_t map, const char *k, size_t kn, const char *v, size_t vn);
size_t host_header_count(uint32_t map);
void host_property(const char *path, size_t pn, const char *v, size_t vn);
int host_state(const char *path, size_t pn, const char **v, size_t *vn);
int host_local_response(const char **b, size_t *bn, const char **h, size_t *hn);
void host_fail_set_property(int on);

#define MAX_CONTEXTS 64
#define MAX_OPS 256

static uint32_t contexts[MAX_CONTEXTS];
static size_t n_contexts;
static uint32_t next_id;

static void die(const char *what, const char *p, size_t n) {
  fprintf(stderr, "fuzz_filter: %s: %.*s\n", what, (int)(n > 300 ? 300 : n), p);
  abort();
}

static void track(uint32_t id) {
  if (n_contexts < MAX_CONTEXTS) contexts[n_contexts++] = id;
}

static void drop(uint32_t id) {
  for (size_t i = 0; i < n_contexts; i++)
    if (contexts[i] == id) {
      contexts[i] = contexts[--n_contexts];
      break;
    }
  proxy_on_delete(id);
}

static int all_hex(const char *p, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (!((p[i] >= '0' && p[i] <= '9') || (p[i] >= 'a' && p[i] <= 'f'))) return 0;
  return 1;
}

/* JSON by the filters' own strict parser (which refuses invalid UTF-8 and lone surrogates). */
static void must_be_json(const char *what, const char *p, size_t n) {
  char err[160];
  jnode_t *j = json_parse(p, n, err, sizeof err);
  if (!j) die(what, p, n);
  json_free(j);
}

static void check_outputs(void) {
  static const char key[] = "wasm.meshfn_audit";
  const char *v;
  size_t vn;
  if (host_state(key, sizeof key - 1, &v, &vn) && !(vn == 64 && all_hex(v, vn)))
    must_be_json("filter state is not JSON", v, vn);
  const char *b, *h;
  size_t bn, hn;
  if (host_local_response(&b, &bn, &h, &hn)) must_be_json("local response is not JSON", b, bn);
}

static void configure(uint32_t root, const char *p, size_t n) {
  host_set_config(n ? p : 0, n);
  (void)proxy_on_configure(root, (uint32_t)n);
}

static void unescape_path(char *p, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (p[i] == '|') p[i] = 0;
}

/* The context table grows (and never shrinks) on demand: grow it once to what any input can
 * need, so that its growth is not mistaken for a leak. */
int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  for (uint32_t i = 1; i <= 2 * MAX_CONTEXTS + 2; i++) proxy_on_context_create(i, 0);
  for (uint32_t i = 1; i <= 2 * MAX_CONTEXTS + 2; i++) proxy_on_delete(i);
  next_id = 1000;
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const size_t live_before = mf_live_bytes();
  char *buf = malloc(size + 1);
  if (!buf) return 0;
  memcpy(buf, data, size);
  buf[size] = 0;
  host_reset();
  host_fail_set_property(0);
  n_contexts = 0;

  char *line = buf, *end = buf + size;
  char *nl = memchr(line, '\n', (size_t)(end - line));
  size_t len = nl ? (size_t)(nl - line) : (size_t)(end - line);
  uint32_t root = ++next_id;
  proxy_on_context_create(root, 0);
  track(root);
  configure(root, line, len);
  uint32_t stream = 0;
  int failing = 0, ops = 0;
  line = nl ? nl + 1 : end;

  while (line < end && ops++ < MAX_OPS) {
    nl = memchr(line, '\n', (size_t)(end - line));
    len = nl ? (size_t)(nl - line) : (size_t)(end - line);
    char op = len ? line[0] : 0;
    char *arg = line + 1;
    size_t an = len ? len - 1 : 0;
    switch (op) {
      case 'H':
      case 'P': {
        char *sep = memchr(arg, op == 'H' ? ':' : '=', an);
        size_t kn = sep ? (size_t)(sep - arg) : an;
        char *v = sep ? sep + 1 : arg + an;
        size_t vn = sep ? an - kn - 1 : 0;
        if (op == 'H') {
          host_header_add(0, arg, kn, v, vn);
        } else {
          unescape_path(arg, kn);
          unescape_path(v, vn);
          host_property(arg, kn, v, vn);
        }
        break;
      }
      case 'S':
      case 'T':
        if (stream) drop(stream);
        if (n_contexts >= MAX_CONTEXTS) {
          stream = 0;
          break;
        }
        stream = ++next_id;
        proxy_on_context_create(stream, root);
        track(stream);
        (void)proxy_on_request_headers(stream, (uint32_t)host_header_count(0), op == 'T');
        check_outputs();
        break;
#ifdef FILTER_WANTS_BODY
      case 'B':
      case 'E':
        if (stream) {
          host_set_body(arg, an);
          (void)proxy_on_request_body(stream, (uint32_t)an, op == 'E');
          check_outputs();
        }
        break;
#endif
      case 'C':
        configure(root, arg, an);
        break;
      case 'N':
        if (n_contexts >= MAX_CONTEXTS - 1) break; /* room for a stream under it */
        root = ++next_id;
        proxy_on_context_create(root, 0);
        track(root);
        configure(root, arg, an);
        break;
      case 'D':
        if (stream) drop(stream), stream = 0;
        break;
      case 'R':
        drop(root);
        break;
      case 'F':
        failing = !failing;
        host_fail_set_property(failing);
        break;
      case 'Z':
        host_reset();
        host_fail_set_property(failing);
        break;
      default:
        break;
    }
    line = nl ? nl + 1 : end;
  }
  while (n_contexts) drop(contexts[n_contexts - 1]);
  host_reset();
  host_set_config(0, 0);
  free(buf);
  if (mf_live_bytes() != live_before) {
    fprintf(stderr, "fuzz_filter: leak: %zu bytes live after the input, %zu before\n",
            mf_live_bytes(), live_before);
    abort();
  }
  return 0;
}
