/* Context bookkeeping shared by both filters: one root context per plugin configuration, one
 * HTTP context per request. Each filter implements the hooks declared at the bottom. */
#ifndef MESHFN_FILTER_BASE_H
#define MESHFN_FILTER_BASE_H

#include "json.h"
#include "mf.h"

typedef struct root root_t;  /* defined by each filter: its parsed configuration + counters */
typedef struct http http_t;  /* defined by each filter: per-request state */

/* Built into the combined module (meshfn/), a filter's hooks get a prefix (-DFILTER_NS=audit)
 * and meshfn/meshfn.c implements the unprefixed hooks by calling both filters. */
#ifdef FILTER_NS
#define FB_CAT2(a, b) a##_##b
#define FB_CAT(a, b) FB_CAT2(a, b)
#define FILTER_LOG_PREFIX FB_CAT(FILTER_NS, log_prefix)
#define filter_root_new FB_CAT(FILTER_NS, root_new)
#define filter_root_free FB_CAT(FILTER_NS, root_free)
#define filter_configure FB_CAT(FILTER_NS, configure)
#define filter_http_new FB_CAT(FILTER_NS, http_new)
#define filter_http_free FB_CAT(FILTER_NS, http_free)
#define filter_on_request_headers FB_CAT(FILTER_NS, on_request_headers)
#define filter_on_request_body FB_CAT(FILTER_NS, on_request_body)
#define filter_on_response_headers FB_CAT(FILTER_NS, on_response_headers)
#endif

/* Hooks each filter implements. */
extern const char *const FILTER_LOG_PREFIX;
root_t *filter_root_new(void);
void filter_root_free(root_t *root);
/* Parses and validates configuration into `root`; returns 0 and fills err on any problem. */
int filter_configure(root_t *root, const jnode_t *config, char *err, size_t err_size);
http_t *filter_http_new(root_t *root, uint32_t context_id);
void filter_http_free(http_t *http);
uint32_t filter_on_request_headers(http_t *http, uint32_t headers, uint32_t end_of_stream);
#ifdef FILTER_WANTS_BODY
uint32_t filter_on_request_body(http_t *http, uint32_t size, uint32_t end_of_stream);
#endif
#ifdef FILTER_WANTS_RESPONSE
uint32_t filter_on_response_headers(http_t *http, uint32_t headers, uint32_t end_of_stream);
#endif

/* Helper for configure errors: "field: problem". */
void set_err(char *err, size_t err_size, const char *field, const char *problem);

#endif
