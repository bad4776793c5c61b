"""Host discovery for the eBPF accelerator: kernel headers, cgroup v2, the C text (what needs
root or this machine's kernel headers is in e2e/test_ebpf_host_machine.py)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from meshfn.ebpf import Accelerator, Host, Unavailable, programs
from meshfn.ebpf.host import cgroup2_mounts, find_headers
from meshfn.testing.ebpf import empty_host


def fake_tree(root: Path, *, common: bool = True, generated: bool = True) -> Path:
    if common:
        (root / "include/linux").mkdir(parents=True)
        (root / "include/linux/kconfig.h").write_text("")
    if generated:
        (root / "include/generated").mkdir(parents=True)
        (root / "include/generated/autoconf.h").write_text("")
    return root


def test_no_headers_names_every_place_looked(tmp_path: Path) -> None:
    with pytest.raises(Unavailable) as err:
        find_headers(empty_host(tmp_path))
    message = str(err.value)
    assert message.startswith("no kernel headers: ")
    assert str(tmp_path / "modules/9.9.9-test/build") in message
    assert str(tmp_path / "cache/current") in message
    assert "ebpf/setup_host.sh" in message


@pytest.mark.parametrize(
    ("common", "generated", "missing"),
    [
        (True, False, "include/generated/autoconf.h"),  # Debian's -common package alone
        (False, True, "include/linux/kconfig.h"),  # Debian's -amd64 package alone
    ],
)
def test_half_a_header_tree_is_refused(
    tmp_path: Path, common: bool, generated: bool, missing: str
) -> None:
    tree = fake_tree(tmp_path / "tree", common=common, generated=generated)
    host = Host(kernel_release="x", modules_dir=tmp_path, kernel_source_env=str(tree))
    with pytest.raises(Unavailable, match=f"BCC_KERNEL_SOURCE={tree}: .*lacks {missing}"):
        find_headers(host)


def test_header_search_order(tmp_path: Path) -> None:
    host = empty_host(tmp_path)
    cached = fake_tree(tmp_path / "cache/v1")
    (tmp_path / "cache/current").symlink_to("v1")
    assert find_headers(host) == cached.resolve()
    build = fake_tree(tmp_path / "modules/9.9.9-test/build")
    assert find_headers(host) == build  # the running kernel's own headers win
    explicit = fake_tree(tmp_path / "explicit")
    assert find_headers(dataclasses.replace(host, kernel_source_env=str(explicit))) == explicit


def test_unknown_mode_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="ebpf, off, auto"):
        Accelerator(tmp_path).setup("fast")  # type: ignore[arg-type]


def test_cgroup2_mounts_are_read_from_the_mount_table() -> None:
    table = Path("/proc/self/mounts").read_text()
    expected = [line.split()[1] for line in table.splitlines() if line.split()[2] == "cgroup2"]
    assert [str(p) for p in cgroup2_mounts()] == expected


def test_counter_slots_are_generated_into_the_c_text() -> None:
    text = programs.source()
    for slot, name in enumerate(programs.COUNTERS):
        assert f"#define MESHFN_C_{name} {slot}\n" in text
    used = set(re.findall(r"MESHFN_C_(\w+)", text.split("#define SOCKHASH_ENTRIES")[1]))
    assert used == set(programs.COUNTERS)
    assert programs.digest(text) != programs.digest(text + "\n")
