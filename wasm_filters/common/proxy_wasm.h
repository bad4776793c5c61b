/* proxy-wasm ABI 0.2.1: the host calls we import and the enums we use.
 *
 * Pointers and sizes are i32 in wasm32; the native test harness compiles the same declarations
 * against fake_host.c, where they are 64-bit. Filter code must therefore never assume
 * sizeof(void*) == 4. */
#ifndef MESHFN_PROXY_WASM_H
#define MESHFN_PROXY_WASM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __wasm__
#define PW_IMPORT(name) __attribute__((import_module("env"), import_name(#name)))
#define PW_EXPORT(name) __attribute__((export_name(#name)))
#else
#define PW_IMPORT(name)
#define PW_EXPORT(name) __attribute__((visibility("default")))
#endif

typedef uint32_t WasmResult;
enum {
  WR_OK = 0,
  WR_NOT_FOUND = 1,
  WR_BAD_ARGUMENT = 2,
  WR_SERIALIZATION_FAILURE = 3,
  WR_PARSE_FAILURE = 4,
  WR_EMPTY = 7,
  WR_INTERNAL_FAILURE = 10,
  WR_UNIMPLEMENTED = 12,
};

enum { LOG_TRACE = 0, LOG_DEBUG = 1, LOG_INFO = 2, LOG_WARN = 3, LOG_ERROR = 4, LOG_CRITICAL = 5 };

enum {
  MAP_REQUEST_HEADERS = 0,
  MAP_REQUEST_TRAILERS = 1,
  MAP_RESPONSE_HEADERS = 2,
  MAP_RESPONSE_TRAILERS = 3,
};

enum {
  BUF_REQUEST_BODY = 0,
  BUF_RESPONSE_BODY = 1,
  BUF_VM_CONFIGURATION = 6,
  BUF_PLUGIN_CONFIGURATION = 7,
};

enum { METRIC_COUNTER = 0, METRIC_GAUGE = 1, METRIC_HISTOGRAM = 2 };

/* FilterHeadersStatus / FilterDataStatus as returned from the HTTP callbacks. */
enum { ACTION_CONTINUE = 0, ACTION_PAUSE = 1 };

PW_IMPORT(proxy_log)
WasmResult proxy_log(uint32_t level, const char *msg, size_t size);

PW_IMPORT(proxy_get_buffer_bytes)
WasmResult proxy_get_buffer_bytes(uint32_t type, size_t start, size_t max_size, char **ptr,
                                  size_t *size);

PW_IMPORT(proxy_get_header_map_value)
WasmResult proxy_get_header_map_value(uint32_t type, const char *key, size_t key_size,
                                      char **value, size_t *value_size);

PW_IMPORT(proxy_replace_header_map_value)
WasmResult proxy_replace_header_map_value(uint32_t type, const char *key, size_t key_size,
                                          const char *value, size_t value_size);

PW_IMPORT(proxy_remove_header_map_value)
WasmResult proxy_remove_header_map_value(uint32_t type, const char *key, size_t key_size);

PW_IMPORT(proxy_get_property)
WasmResult proxy_get_property(const char *path, size_t path_size, char **value,
                              size_t *value_size);

PW_IMPORT(proxy_set_property)
WasmResult proxy_set_property(const char *path, size_t path_size, const char *value,
                              size_t value_size);

PW_IMPORT(proxy_send_local_response)
WasmResult proxy_send_local_response(uint32_t status, const char *details, size_t details_size,
                                     const char *body, size_t body_size, const char *headers,
                                     size_t headers_size, int32_t grpc_status);

PW_IMPORT(proxy_call_foreign_function)
WasmResult proxy_call_foreign_function(const char *name, size_t name_size, const char *args,
                                       size_t args_size, char **result, size_t *result_size);

PW_IMPORT(proxy_define_metric)
WasmResult proxy_define_metric(uint32_t type, const char *name, size_t name_size,
                               uint32_t *metric_id);

PW_IMPORT(proxy_increment_metric)
WasmResult proxy_increment_metric(uint32_t metric_id, int64_t offset);

#endif
