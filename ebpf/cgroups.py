"""cgroup v2 and attachment helpers shared by the accelerator and the egress control: finding
(or mounting) a cgroup2 hierarchy, detaching without failing on what is gone already, and
removing a cgroup after handing its processes back to the parent."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from . import bpfsys
from .host import Unavailable, cgroup2_mounts, is_mounted


def cgroup2_root(own_mount: Path) -> tuple[Path, bool]:
    """An existing cgroup2 mount, else one mounted at `own_mount`; (root, mounted by us)."""
    for mount in cgroup2_mounts():
        if is_mounted(mount, bpfsys.CGROUP2_SUPER_MAGIC):
            return mount, False
    own_mount.mkdir(exist_ok=True)
    try:
        bpfsys.mount("cgroup2", own_mount, "cgroup2")
    except OSError as exc:
        own_mount.rmdir()
        raise Unavailable(
            f"no cgroup v2: none is mounted and mounting one at {own_mount} failed ({exc})"
        ) from None
    return own_mount, True


def unmount_own(own_mount: Path, problems: list[str]) -> None:
    """Unmount and remove `own_mount` if cgroup2_root mounted it."""
    if is_mounted(own_mount, bpfsys.CGROUP2_SUPER_MAGIC):
        with collect(problems, f"unmount {own_mount}"):
            bpfsys.umount(own_mount)
    with contextlib.suppress(OSError):
        own_mount.rmdir()


@contextlib.contextmanager
def open_dir(path: Path) -> Iterator[int]:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def collect(problems: list[str], what: str, ignore: tuple[int, ...] = ()) -> Iterator[None]:
    """Teardown goes on after a failed step, so one problem does not leave the rest attached.
    Errors whose errno is in `ignore` mean "already gone" and are no problem."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in ignore:
            problems.append(f"{what}: {exc.strerror or exc}")


def detach_quietly(prog_fd: int, target_fd: int, attach_type: int) -> None:
    try:
        bpfsys.prog_detach(prog_fd, target_fd, attach_type)
    except OSError as exc:
        if exc.errno != errno.ENOENT:  # ENOENT: not attached (crash before attach, or done)
            raise


def remove_cgroup(cgroup: Path, attach_types: Iterable[int]) -> list[str]:
    """Detach anything left on `cgroup` (of `attach_types`), hand its processes back to the
    parent, remove it."""
    problems: list[str] = []
    with open_dir(cgroup) as cgfd:
        for attach_type in attach_types:
            with collect(problems, f"query {cgroup}", ignore=(errno.EINVAL,)):
                for ident in bpfsys.prog_query(cgfd, attach_type):
                    with collect(problems, f"detach program {ident} from {cgroup}"):
                        prog_fd = bpfsys.prog_fd_by_id(ident)
                        try:
                            detach_quietly(prog_fd, cgfd, attach_type)
                        finally:
                            os.close(prog_fd)
    parent_procs = cgroup.parent / "cgroup.procs"
    for _ in range(10):  # a process may fork while we move it
        pids = (cgroup / "cgroup.procs").read_text().split()
        if not pids:
            break
        for pid in pids:
            with collect(problems, f"move pid {pid} out of {cgroup}", ignore=(errno.ESRCH,)):
                parent_procs.write_text(pid)
    with collect(problems, f"remove {cgroup}"):
        cgroup.rmdir()
    return problems
