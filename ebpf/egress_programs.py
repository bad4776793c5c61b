"""The egress control programs (cgroup sock_addr and sock_create), kept as C text like the
acceleration programs (programs.py), and what the loader child needs to load and pin them.

They run on the inference backends' cgroups (egress.py) and refuse, with EPERM, every
outbound connection or datagram that the policy does not name:
- `connect4`/`connect6` (TCP connect, and UDP connect) and `sendmsg4`/`sendmsg6` (UDP datagrams
  sent to an address): allowed only to an (address, port) in the allow map under the caller's
  cgroup id (each backend has its own cgroup, so its own peers). IPv4 is matched as ::ffff:a.b.c.d,
  so a dual-stack socket cannot slip through the other family;
- `connect_unix`/`sendmsg_unix` (Linux 6.7+): every unix socket connect or datagram (another
  workload's unix socket, once backends listen on those, included). The program cannot read
  a socket path, so none is allowed;
- `sock_create`: no socket other than TCP or UDP (raw, ICMP), which would bypass the address
  hooks.
Every denial counts under (cgroup id, reason), with the last destination and pid, which the
control plane turns into /metrics and rate-limited log lines.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

from .programs import IS_LOOPBACK_C

# Why a connection or datagram was refused. The C enum is generated from this tuple.
REASONS: Final = (
    "tcp_loopback",  # a TCP connect to a loopback port the policy does not name (a workload)
    "tcp_remote",  # a TCP connect to any other address the policy does not name
    "udp_loopback",  # a UDP datagram or connect to a loopback port the policy does not name
    "udp_remote",  # a UDP datagram or connect to any other address
    "unix",  # a unix socket connect or datagram
    "raw_socket",  # a socket other than TCP or UDP (raw IP, ICMP)
)

PIN_CONNECT4: Final = "connect4"
PIN_CONNECT6: Final = "connect6"
PIN_SENDMSG4: Final = "sendmsg4"
PIN_SENDMSG6: Final = "sendmsg6"
PIN_CONNECT_UNIX: Final = "connect_unix"
PIN_SENDMSG_UNIX: Final = "sendmsg_unix"
PIN_SOCK_CREATE: Final = "sock_create"
PIN_ALLOW: Final = "allow"
PIN_DENIED: Final = "denied"

# bcc's program types (bcc.BPFProgType) and the kernel's attach types (enum bpf_attach_type).
_CGROUP_SOCK: Final = 9
_CGROUP_SOCK_ADDR: Final = 18
ATTACH_INET_SOCK_CREATE: Final = 2
ATTACH_INET4_CONNECT: Final = 10
ATTACH_INET6_CONNECT: Final = 11
ATTACH_UDP4_SENDMSG: Final = 14
ATTACH_UDP6_SENDMSG: Final = 15
ATTACH_UNIX_CONNECT: Final = 49  # Linux 6.7
ATTACH_UNIX_SENDMSG: Final = 50


@dataclass(frozen=True)
class Program:
    function: str  # in SOURCE
    prog_type: int
    attach_type: int
    pin: str
    optional: bool = False  # a kernel without it runs the rest (unix hooks: Linux 6.7+)


PROGRAMS: Final = (
    Program("meshfn_eg_connect4", _CGROUP_SOCK_ADDR, ATTACH_INET4_CONNECT, PIN_CONNECT4),
    Program("meshfn_eg_connect6", _CGROUP_SOCK_ADDR, ATTACH_INET6_CONNECT, PIN_CONNECT6),
    Program("meshfn_eg_sendmsg4", _CGROUP_SOCK_ADDR, ATTACH_UDP4_SENDMSG, PIN_SENDMSG4),
    Program("meshfn_eg_sendmsg6", _CGROUP_SOCK_ADDR, ATTACH_UDP6_SENDMSG, PIN_SENDMSG6),
    Program("meshfn_eg_unix", _CGROUP_SOCK_ADDR, ATTACH_UNIX_CONNECT, PIN_CONNECT_UNIX, True),
    Program("meshfn_eg_unix_dg", _CGROUP_SOCK_ADDR, ATTACH_UNIX_SENDMSG, PIN_SENDMSG_UNIX, True),
    Program("meshfn_eg_sock_create", _CGROUP_SOCK, ATTACH_INET_SOCK_CREATE, PIN_SOCK_CREATE),
)
MAPS: Final = ((PIN_ALLOW, "meshfn_eg_allow"), (PIN_DENIED, "meshfn_eg_denied"))

ALLOW_ENTRIES: Final = 4096
DENIED_ENTRIES: Final = 4096
# struct allow_key / deny_key / deny_val below (native byte order, ports in host order).
ALLOW_KEY: Final = struct.Struct("=Q4III")
DENY_KEY: Final = struct.Struct("=QII")
DENY_VALUE: Final = struct.Struct("=QQ4III")

_BODY: Final = (
    r"""
#include <uapi/linux/bpf.h>

#define AF_UNIX 1
#define AF_INET 2
#define AF_INET6 10
#define SOCK_STREAM 1
#define SOCK_DGRAM 2
#define IPPROTO_TCP 6
#define IPPROTO_UDP 17

/* Read ctx fields through volatile (see programs.py: "dereference of modified ctx ptr"). */
#define CTX(ptr, field) (*(volatile __u32 *)&(ptr)->field)

struct allow_key {
    __u64 cgroup;
    __u32 addr[4];   /* IPv6, or IPv4 as ::ffff:a.b.c.d */
    __u32 port;      /* host byte order */
    __u32 pad;
};
struct deny_key {
    __u64 cgroup;
    __u32 reason;
    __u32 pad;
};
struct deny_val {
    __u64 count;
    __u64 last_ns;
    __u32 addr[4];
    __u32 port;
    __u32 pid;
};

BPF_HASH(meshfn_eg_allow, struct allow_key, u32, ALLOW_ENTRIES);
BPF_HASH(meshfn_eg_denied, struct deny_key, struct deny_val, DENIED_ENTRIES);

static __always_inline int deny(__u32 reason, const __u32 addr[4], __u32 port) {
    struct deny_key key = {};
    key.cgroup = bpf_get_current_cgroup_id();
    key.reason = reason;
    struct deny_val zero = {};
    struct deny_val *value = meshfn_eg_denied.lookup_or_try_init(&key, &zero);
    if (value) {
        __sync_fetch_and_add(&value->count, 1);
        value->last_ns = bpf_ktime_get_ns();
        value->addr[0] = addr[0];
        value->addr[1] = addr[1];
        value->addr[2] = addr[2];
        value->addr[3] = addr[3];
        value->port = port;
        value->pid = bpf_get_current_pid_tgid() >> 32;
    }
    return 0;  /* the caller gets EPERM */
}

"""
    + IS_LOOPBACK_C
    + r"""
static __always_inline int check(__u32 addr[4], __u32 port, int datagram) {
    struct allow_key key = {};
    key.cgroup = bpf_get_current_cgroup_id();
    key.addr[0] = addr[0];
    key.addr[1] = addr[1];
    key.addr[2] = addr[2];
    key.addr[3] = addr[3];
    key.port = port;
    if (meshfn_eg_allow.lookup(&key))
        return 1;
    int loopback = is_loopback(addr);
    __u32 reason = datagram ? (loopback ? MESHFN_R_udp_loopback : MESHFN_R_udp_remote)
                            : (loopback ? MESHFN_R_tcp_loopback : MESHFN_R_tcp_remote);
    return deny(reason, addr, port);
}

int meshfn_eg_connect4(struct bpf_sock_addr *ctx) {
    __u32 ip = CTX(ctx, user_ip4);
    __u32 port = bpf_ntohs(CTX(ctx, user_port));
    __u32 type = CTX(ctx, type);
    __u32 addr[4] = {0, 0, bpf_htonl(0xffff), ip};
    return check(addr, port, type == SOCK_DGRAM);
}

int meshfn_eg_connect6(struct bpf_sock_addr *ctx) {
    __u32 addr[4] = {CTX(ctx, user_ip6[0]), CTX(ctx, user_ip6[1]), CTX(ctx, user_ip6[2]),
                     CTX(ctx, user_ip6[3])};
    __u32 port = bpf_ntohs(CTX(ctx, user_port));
    __u32 type = CTX(ctx, type);
    return check(addr, port, type == SOCK_DGRAM);
}

int meshfn_eg_sendmsg4(struct bpf_sock_addr *ctx) {
    __u32 ip = CTX(ctx, user_ip4);
    __u32 port = bpf_ntohs(CTX(ctx, user_port));
    __u32 addr[4] = {0, 0, bpf_htonl(0xffff), ip};
    return check(addr, port, 1);
}

int meshfn_eg_sendmsg6(struct bpf_sock_addr *ctx) {
    __u32 addr[4] = {CTX(ctx, user_ip6[0]), CTX(ctx, user_ip6[1]), CTX(ctx, user_ip6[2]),
                     CTX(ctx, user_ip6[3])};
    __u32 port = bpf_ntohs(CTX(ctx, user_port));
    return check(addr, port, 1);
}

int meshfn_eg_unix(struct bpf_sock_addr *ctx) {
    __u32 none[4] = {};
    return deny(MESHFN_R_unix, none, 0);
}

int meshfn_eg_unix_dg(struct bpf_sock_addr *ctx) {
    __u32 none[4] = {};
    return deny(MESHFN_R_unix, none, 0);
}

int meshfn_eg_sock_create(struct bpf_sock *ctx) {
    __u32 type = CTX(ctx, type);
    __u32 protocol = CTX(ctx, protocol);
    if ((type == SOCK_STREAM && protocol == IPPROTO_TCP)
        || (type == SOCK_DGRAM && protocol == IPPROTO_UDP))
        return 1;
    __u32 none[4] = {};
    return deny(MESHFN_R_raw_socket, none, protocol);
}
"""
)


def source(body: str = _BODY) -> str:
    """The C text with the generated reason enum and sizes prepended."""
    lines = [f"#define MESHFN_R_{name} {i}" for i, name in enumerate(REASONS)]
    lines.append(f"#define ALLOW_ENTRIES {ALLOW_ENTRIES}")
    lines.append(f"#define DENIED_ENTRIES {DENIED_ENTRIES}")
    return "\n".join(lines) + "\n" + body
