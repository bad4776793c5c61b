/* SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104): there is no libc or crypto library inside a
 * -nostdlib wasm32 module, so the filters carry their own. Tested against Python's hashlib and
 * hmac in the native harness. */
#ifndef MESHFN_SHA256_H
#define MESHFN_SHA256_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
  uint32_t h[8];
  uint64_t bytes;
  uint8_t buf[64];
  size_t used;
} sha256_t;

void sha256_init(sha256_t *s);
void sha256_update(sha256_t *s, const void *data, size_t n);
void sha256_final(sha256_t *s, uint8_t out[32]);
void sha256(const void *data, size_t n, uint8_t out[32]);
void hmac_sha256(const void *key, size_t key_len, const void *msg, size_t msg_len,
                 uint8_t out[32]);

/* HMAC with a fixed key: the key blocks are hashed once (at configure time), each message then
 * costs two compressions fewer. */
typedef struct {
  sha256_t inner, outer;
} hmac_key_t;
void hmac_sha256_key(hmac_key_t *k, const void *key, size_t key_len);
void hmac_sha256_with(const hmac_key_t *k, const void *msg, size_t msg_len, uint8_t out[32]);

#endif
