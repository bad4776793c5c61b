"""Host discovery for the eBPF accelerator: kernel headers, privileges, cgroup v2, the C text."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshfn.ebpf import AccelerationUnavailable, Accelerator, Host, Unavailable, programs
from meshfn.ebpf.host import cgroup2_mounts, check_privileges, find_headers


def fake_tree(root: Path, *, common: bool = True, generated: bool = True) -> Path:
    if common:
        (root / "include/linux").mkdir(parents=True)
        (root / "include/linux/kconfig.h").write_text("")
    if generated:
        (root / "include/generated").mkdir(parents=True)
        (root / "include/generated/autoconf.h").write_text("")
    return root


def empty_host(tmp_path: Path) -> Host:
    return Host(
        kernel_release="9.9.9-test",
        modules_dir=tmp_path / "modules",
        header_cache=tmp_path / "cache",
        kernel_source_env="",
    )


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


def test_this_machine_has_usable_headers() -> None:
    """ebpf/setup_host.sh must have run (./dev.sh calls it)."""
    tree = find_headers(Host())
    assert (tree / "include/generated/autoconf.h").is_file()


def test_no_headers_turns_auto_off_with_the_reason(tmp_path: Path) -> None:
    accel = Accelerator(tmp_path / "state", host=empty_host(tmp_path))
    status = accel.setup("auto")
    assert not status.attached
    assert status.reason.startswith("no kernel headers: ")
    assert accel.cgroup_path is None and accel.child_preexec() is None
    assert accel.add_pid(1) is False
    assert accel.stats() == dict.fromkeys(accel.stats(), 0)
    with pytest.raises(AccelerationUnavailable, match=r"^no kernel headers: "):
        accel.setup("ebpf")
    assert not (tmp_path / "state/ebpf/state.json").exists()
    assert not (tmp_path / "state/ebpf/bpffs").exists()


def test_unknown_mode_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="ebpf, off, auto"):
        Accelerator(tmp_path).setup("fast")  # type: ignore[arg-type]


def test_privileges_are_checked_from_the_effective_set() -> None:
    check_privileges()  # root here
    code = (
        "from meshfn.ebpf.host import check_privileges, Unavailable\n"
        "try:\n    check_privileges()\nexcept Unavailable as e:\n    print(e)\n"
    )
    out = subprocess.run(
        ["setpriv", "--inh-caps=-all", "--bounding-set=-all", sys.executable, "-P", "-c", code],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.startswith("no privileges: eBPF acceleration needs CAP_SYS_ADMIN and CAP_NET_ADMIN")
    assert "missing CAP_SYS_ADMIN, CAP_NET_ADMIN" in out


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
