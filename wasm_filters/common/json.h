/* A strict JSON parser (RFC 8259) for plugin configuration and JWT payloads. Strict because
 * configuration is security policy: duplicate keys, invalid UTF-8, lone surrogates, trailing
 * garbage and nesting deeper than JSON_MAX_DEPTH are errors, never guesses. */
#ifndef MESHFN_JSON_H
#define MESHFN_JSON_H

#include "mf.h"

#define JSON_MAX_DEPTH 32

typedef enum { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ } jtype_t;

typedef struct jnode {
  jtype_t type;
  int boolean;
  int is_int;    /* number without fraction/exponent that fits in int64 */
  int64_t num;   /* valid when is_int */
  char *str;     /* J_STR: decoded UTF-8 (NUL-terminated; may contain NUL) */
  size_t len;    /* J_STR: byte length; J_ARR/J_OBJ: element count */
  char *key;     /* member key when inside an object */
  size_t key_len;
  struct jnode *child, *next;
} jnode_t;

/* Returns the root or NULL; on error `err` (>= 64 bytes) holds "offset N: problem". */
jnode_t *json_parse(const char *p, size_t n, char *err, size_t err_size);
void json_free(jnode_t *node);
jnode_t *json_get(const jnode_t *obj, const char *key);
/* First member of `obj` whose key is not in the NULL-terminated list, or NULL. */
const jnode_t *json_unknown_key(const jnode_t *obj, const char *const *allowed);

#endif
