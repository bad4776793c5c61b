"""eBPF test support: an accelerator attached for a test (and checked to detach cleanly), and
a host description that finds nothing installed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from meshfn.ebpf import AccelerationStatus, Accelerator, Host


@contextmanager
def attached(state_dir: Path) -> Iterator[tuple[Accelerator, AccelerationStatus]]:
    """Redirection attached (mode "ebpf": root, bcc and kernel headers needed) for the block;
    afterwards everything must detach without a problem, also when the block failed."""
    accelerator = Accelerator(state_dir)
    try:
        status = accelerator.setup("ebpf")
        assert status.attached
        yield accelerator, status
    finally:
        assert accelerator.shutdown() == []


def empty_host(root: Path) -> Host:
    """A kernel release with no headers anywhere below `root` and no BCC_KERNEL_SOURCE."""
    return Host(
        kernel_release="9.9.9-test",
        modules_dir=root / "modules",
        header_cache=root / "cache",
        kernel_source_env="",
    )
