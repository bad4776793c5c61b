"""TEST ONLY: a compromised process inside the inference backend.

Never part of meshfn: this folder is not a package of the wheel, and Python imports a
`sitecustomize` only from sys.path, where only the sandbox tests put this folder (PYTHONPATH) for
the `meshfn up` they start. In a backend process (`python -m meshfn.inference serve`) it adds
the route `POST /meshfn-test/attack`, which runs the attempt named in its JSON body in the
serving process, as code that escaped a model function would, and answers what the kernel said:

    {"attempt": "read", "path": "/etc/shadow"}       open and read a file
    {"attempt": "write", "path": "..."}               create and write a file
    {"attempt": "mmap_rwx"}                           map anonymous read-write-execute memory
    {"attempt": "exec", "argv": ["/bin/sh", ...]}     replace the process by a shell
    {"attempt": "connect", "host": ..., "port": ...}  TCP connect (IPv4 or IPv6 address)
    {"attempt": "sendto", "host": ..., "port": ...}   one UDP datagram
    {"attempt": "connect_unix", "path": ...}          connect to a unix socket

-> {"attempt": ..., "allowed": bool, "errno": "EACCES" | "EPERM" | ... | null, "error": str}.
A seccomp kill answers nothing: the process is gone.

MESHFN_TEST_KERNEL_WITHOUT=landlock,seccomp makes the backend meet a kernel without those
layers, with a seccomp filter of its own installed before anything else runs: the Landlock
syscalls answer ENOSYS (a kernel without Landlock), and PR_GET_SECCOMP, PR_SET_SECCOMP and
seccomp() answer EINVAL (a kernel without CONFIG_SECCOMP).
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import socket
import sys
from typing import Any


def _is_backend() -> bool:
    argv = getattr(sys, "orig_argv", [])
    return "meshfn.inference" in argv and "serve" in argv


def _without(layers: set[str]) -> None:
    from meshfn.inference import seccomp

    fake = seccomp.Filter(seccomp.ALLOW)
    if "landlock" in layers:
        for name in ("landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self"):
            fake.rule(seccomp.ERRNO(errno.ENOSYS), name)
    if "seccomp" in layers:
        for option in (21, 22):  # PR_GET_SECCOMP, PR_SET_SECCOMP
            fake.rule(seccomp.ERRNO(errno.EINVAL), "prctl", seccomp.Arg(0, "==", option))
        fake.rule(seccomp.ERRNO(errno.EINVAL), "seccomp")
    fake.load()


def attack(spec: dict[str, Any]) -> dict[str, Any]:
    what = spec["attempt"]
    try:
        if what == "read":
            with open(spec["path"], "rb") as f:
                f.read(64)
        elif what == "write":
            with open(spec["path"], "w") as f:
                f.write("written by a compromised backend\n")
        elif what == "mmap_rwx":
            prot = mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC
            mmap.mmap(-1, 4096, prot=prot).close()
        elif what == "exec":
            os.execv(spec["argv"][0], spec["argv"])
        elif what in ("connect", "sendto"):
            family = socket.AF_INET6 if ":" in spec["host"] else socket.AF_INET
            kind = socket.SOCK_STREAM if what == "connect" else socket.SOCK_DGRAM
            with socket.socket(family, kind) as sock:
                sock.settimeout(3)
                if what == "connect":
                    sock.connect((spec["host"], spec["port"]))
                else:
                    sock.sendto(b"from a compromised backend", (spec["host"], spec["port"]))
        elif what == "connect_unix":
            with socket.socket(socket.AF_UNIX) as sock:
                sock.settimeout(3)
                sock.connect(spec["path"])
        else:
            return {"attempt": what, "allowed": False, "errno": None, "error": "unknown attempt"}
    except OSError as exc:
        code = errno.errorcode.get(exc.errno or 0) if exc.errno else None
        return {"attempt": what, "allowed": False, "errno": code, "error": str(exc)}
    return {"attempt": what, "allowed": True, "errno": None, "error": ""}


def _install() -> None:
    from meshfn.inference import server
    from meshfn.inference.backend import Reply

    route = server.Router._route

    async def _route(self: server.Router, request: Any, path: str) -> Reply:
        if path == "/meshfn-test/attack":
            return Reply.json(attack(json.loads(request.body)))
        return await route(self, request, path)

    server.Router._route = _route  # type: ignore[method-assign]


def _main() -> None:
    from meshfn.common import env

    if env.TEST_SANDBOX_HOOK.get() != "1":
        return
    missing = {x for x in env.TEST_KERNEL_WITHOUT.get_or("").split(",") if x}
    if missing:
        _without(missing)
    # The attack route goes in once the sandbox's first layer is on: importing the server now
    # would import numpy, whose BLAS starts a thread, and Landlock needs a one-thread process.
    from meshfn.inference import sandbox

    at_start = sandbox.Sandbox.at_start

    def then_install(self: sandbox.Sandbox) -> None:
        at_start(self)
        _install()

    sandbox.Sandbox.at_start = then_install  # type: ignore[method-assign]


if _is_backend():
    _main()
