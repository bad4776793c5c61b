"""The BPF C programs (sock_ops + sk_msg), kept here as text so every install mode ships them.

sock_ops records each established loopback TCP socket of the mesh's cgroup in a sockhash keyed by
its own 4-tuple; sk_msg, run on every sendmsg of those sockets, looks up the *peer's* key (the same
4-tuple seen from the other end) and moves the message straight onto the peer's receive queue with
bpf_msg_redirect_hash, skipping the TCP/IP stack and `lo`.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Final

# Counter slots of the per-CPU array, in order. The C enum is generated from this tuple, so
# Python and C cannot disagree on an index.
COUNTERS: Final = (
    "sockets_added",  # established loopback sockets recorded in the sockhash
    "sockets_add_failed",  # sockhash full, or the 4-tuple already present
    "sockets_skipped",  # established sockets of the cgroup that are not loopback
    "sockets_peer_outside",  # accepted from a client outside the cgroup: left alone
    "messages_redirected",  # sendmsg calls moved to the peer socket (one per sk_msg run)
    "bytes_redirected",
    "messages_no_peer",  # no peer socket in the map: sent by TCP, the socket stays on TCP
    "messages_tcp_path",  # sent by a socket that has sent by TCP before (keeps byte order)
    "messages_disabled",  # sent while detaching: left to TCP so nothing in flight is lost
)

# Pinned object names inside the private bpffs.
PIN_SOCK_OPS: Final = "sock_ops"
PIN_SK_MSG: Final = "sk_msg"
PIN_SOCKS: Final = "socks"
PIN_COUNTERS: Final = "counters"
PIN_CONFIG: Final = "config"
PIN_TCP_PATH: Final = "tcp_path"
PIN_CLIENTS: Final = "clients"
PROG_PINS: Final = (PIN_SOCK_OPS, PIN_SK_MSG)
MAP_PINS: Final = (PIN_SOCKS, PIN_COUNTERS, PIN_CONFIG, PIN_TCP_PATH, PIN_CLIENTS)
PINS: Final = PROG_PINS + MAP_PINS


# Function / map names in SOURCE (BPF object names are cut at 15 characters).
FN_SOCK_OPS: Final = "meshfn_sock_ops"
FN_SK_MSG: Final = "meshfn_sk_msg"
MAP_SOCKS: Final = "meshfn_socks"
MAP_COUNTERS: Final = "meshfn_counters"
MAP_CONFIG: Final = "meshfn_config"
MAP_TCP_PATH: Final = "meshfn_tcp_path"
MAP_CLIENTS: Final = "meshfn_clients"
# (pin, map name in SOURCE) of every map, in MAP_PINS order: what the loader pins.
MAP_PINS_NAMES: Final = (
    (PIN_SOCKS, MAP_SOCKS),
    (PIN_COUNTERS, MAP_COUNTERS),
    (PIN_CONFIG, MAP_CONFIG),
    (PIN_TCP_PATH, MAP_TCP_PATH),
    (PIN_CLIENTS, MAP_CLIENTS),
)

SOCK_KEY_SIZE: Final = 40  # struct sock_key below
SOCKHASH_ENTRIES: Final = 65536
CONFIG_ENABLED: Final = struct.pack("=I", 0)  # key of the "redirect enabled" flag

# 127.0.0.0/8 as ::ffff:127.x.y.z, or ::1 (addresses in IPv6 form, network byte order); the
# egress programs (egress_programs.py) use it too.
IS_LOOPBACK_C: Final = r"""static __always_inline int is_loopback(const __u32 ip[4]) {
    if (ip[0] != 0 || ip[1] != 0)
        return 0;
    if (ip[2] == bpf_htonl(0xffff))
        return (bpf_ntohl(ip[3]) >> 24) == 127;
    return ip[2] == 0 && ip[3] == bpf_htonl(1);
}
"""

_BODY: Final = (
    r"""
#include <uapi/linux/bpf.h>

#define AF_INET 2
#define AF_INET6 10

/* Read a ctx field through volatile: if clang merges the loads of two branches into one load
 * through a computed ctx pointer, the verifier refuses the program ("dereference of modified ctx
 * ptr"). Every field is therefore read unconditionally, in order, before any branch. */
#define CTX(ptr, field) (*(volatile __u32 *)&(ptr)->field)

/* Addresses in IPv6 form; IPv4 as ::ffff:a.b.c.d, so an AF_INET client and its peer accepted on
 * a dual-stack (AF_INET6) listener produce matching keys. Ports in host byte order. */
struct sock_key {
    __u32 local_ip[4];
    __u32 remote_ip[4];
    __u32 local_port;
    __u32 remote_port;
};

BPF_SOCKHASH(meshfn_socks, struct sock_key, SOCKHASH_ENTRIES);
BPF_PERCPU_ARRAY(meshfn_counters, u64, MESHFN_NCOUNTERS);
BPF_ARRAY(meshfn_config, u32, 1);
/* Connecting sockets of the mesh, so the accepting side can tell whether its client is in the
 * mesh. (A sockhash lookup would do, but it takes a socket reference that sock_ops programs may
 * not release.) LRU: entries of clients whose server is outside the mesh age out. */
BPF_TABLE("lru_hash", struct sock_key, u32, meshfn_clients, SOCKHASH_ENTRIES);
/* Marks a socket that has sent a message the TCP way. Such a socket must never redirect again:
 * its peer reads the redirected queue before the TCP one, so a later redirected message would
 * overtake the earlier TCP bytes. (It happens when a client writes before the kernel has
 * completed the accept side, or while redirection is off during a detach.) */
BPF_SK_STORAGE(meshfn_tcp_path, u32);

static __always_inline void count(int slot, u64 n) {
    u64 *value = meshfn_counters.lookup(&slot);
    if (value)  /* atomic: a preempted program on the same CPU must not lose an update */
        __sync_fetch_and_add(value, n);
}

"""
    + IS_LOOPBACK_C
    + r"""
/* Fill key with (a, b) taken from either the IPv4 or the IPv6 fields, by family. */
static __always_inline int fill(struct sock_key *key, __u32 family, __u32 a4, __u32 b4,
                                const __u32 a6[4], const __u32 b6[4]) {
    if (family == AF_INET) {
        key->local_ip[2] = bpf_htonl(0xffff);
        key->local_ip[3] = a4;
        key->remote_ip[2] = bpf_htonl(0xffff);
        key->remote_ip[3] = b4;
        return 1;
    }
    if (family == AF_INET6) {
        #pragma unroll
        for (int i = 0; i < 4; i++) {
            key->local_ip[i] = a6[i];
            key->remote_ip[i] = b6[i];
        }
        return 1;
    }
    return 0;
}

int meshfn_sock_ops(struct bpf_sock_ops *skops) {
    __u32 op = CTX(skops, op);
    if (op != BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB && op != BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB)
        return 1;
    __u32 family = CTX(skops, family);
    __u32 l4 = CTX(skops, local_ip4);
    __u32 r4 = CTX(skops, remote_ip4);
    __u32 l6[4] = {CTX(skops, local_ip6[0]), CTX(skops, local_ip6[1]),
                   CTX(skops, local_ip6[2]), CTX(skops, local_ip6[3])};
    __u32 r6[4] = {CTX(skops, remote_ip6[0]), CTX(skops, remote_ip6[1]),
                   CTX(skops, remote_ip6[2]), CTX(skops, remote_ip6[3])};
    __u32 lport = CTX(skops, local_port);             /* host byte order */
    __u32 rport = bpf_ntohl(CTX(skops, remote_port)); /* network order in the upper half */

    struct sock_key key = {};
    if (!fill(&key, family, l4, r4, l6, r6))
        return 1;
    if (!is_loopback(key.local_ip) || !is_loopback(key.remote_ip)) {
        count(MESHFN_C_sockets_skipped, 1);
        return 1;
    }
    key.local_port = lport;
    key.remote_port = rport;
    if (op == BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB) {
        /* The client's ACTIVE_ESTABLISHED ran before our final ACK arrived: if the client is in
         * the mesh, it is in meshfn_clients now. If not (a user's curl, say), leave this socket on
         * plain TCP rather than pay the sk_msg path for replies that cannot be redirected. */
        struct sock_key peer = {};
        fill(&peer, family, r4, l4, r6, l6);
        peer.local_port = rport;
        peer.remote_port = lport;
        if (!meshfn_clients.lookup(&peer)) {
            count(MESHFN_C_sockets_peer_outside, 1);
            return 1;
        }
        meshfn_clients.delete(&peer);
    } else {
        u32 one = 1;
        meshfn_clients.update(&key, &one);
    }
    /* BPF_NOEXIST: never evict a socket already in the map; eviction drops its unread data. */
    /* (bcc's rewriter breaks a map method call used inside an expression: assign it first.) */
    long rc = meshfn_socks.sock_hash_update(skops, &key, BPF_NOEXIST);
    if (rc == 0)
        count(MESHFN_C_sockets_added, 1);
    else
        count(MESHFN_C_sockets_add_failed, 1);
    return 1;
}

int meshfn_sk_msg(struct sk_msg_md *msg) {
    struct bpf_sock *sk = msg->sk;
    __u32 family = CTX(msg, family);
    __u32 l4 = CTX(msg, local_ip4);
    __u32 r4 = CTX(msg, remote_ip4);
    __u32 l6[4] = {CTX(msg, local_ip6[0]), CTX(msg, local_ip6[1]),
                   CTX(msg, local_ip6[2]), CTX(msg, local_ip6[3])};
    __u32 r6[4] = {CTX(msg, remote_ip6[0]), CTX(msg, remote_ip6[1]),
                   CTX(msg, remote_ip6[2]), CTX(msg, remote_ip6[3])};
    __u32 lport = CTX(msg, local_port);
    __u32 rport = bpf_ntohl(CTX(msg, remote_port));
    __u32 size = CTX(msg, size);

    if (!sk)
        return SK_PASS;
    if (meshfn_tcp_path.sk_storage_get(sk, 0, 0)) {
        count(MESHFN_C_messages_tcp_path, 1);
        return SK_PASS;
    }
    int zero = 0;
    u32 *enabled = meshfn_config.lookup(&zero);
    if (!enabled || !*enabled) {
        meshfn_tcp_path.sk_storage_get(sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
        count(MESHFN_C_messages_disabled, 1);
        return SK_PASS;
    }
    /* The peer's key is our 4-tuple seen from the other end. */
    struct sock_key peer = {};
    if (!fill(&peer, family, r4, l4, r6, l6))
        return SK_PASS;
    peer.local_port = rport;
    peer.remote_port = lport;
    /* On failure (no such peer) the helper returns SK_DROP and sets no redirect: returning
     * SK_PASS then sends the message the normal TCP way. */
    long verdict = meshfn_socks.msg_redirect_hash(msg, &peer, BPF_F_INGRESS);
    if (verdict == SK_PASS) {
        count(MESHFN_C_messages_redirected, 1);
        count(MESHFN_C_bytes_redirected, size);
    } else {
        meshfn_tcp_path.sk_storage_get(sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
        count(MESHFN_C_messages_no_peer, 1);
    }
    return SK_PASS;
}
"""
)


def source(body: str = _BODY) -> str:
    """The C text with the generated counter enum and sizes prepended."""
    lines = [f"#define MESHFN_C_{name} {i}" for i, name in enumerate(COUNTERS)]
    lines.append(f"#define MESHFN_NCOUNTERS {len(COUNTERS)}")
    lines.append(f"#define SOCKHASH_ENTRIES {SOCKHASH_ENTRIES}")
    return "\n".join(lines) + "\n" + body


def digest(text: str) -> str:
    """Identifies a program build: pinned objects from another build are replaced, not reused."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]
