"""YAML reading: line numbers for every field, and hostile YAML refused with a clear error."""

from __future__ import annotations

import pytest

from meshfn.policy.errors import PolicyError
from meshfn.policy.source import MAX_FILE_BYTES, format_loc, parse_documents


def test_lines_are_recorded_per_field() -> None:
    text = "a: 1\nb:\n  c: [x, y]\n  d:\n    - e: 2\n---\nz: 3\n"
    first, second = parse_documents(text, "f.yaml")
    assert first.data == {"a": 1, "b": {"c": ["x", "y"], "d": [{"e": 2}]}}
    assert first.line_of(("a",)) == 1
    assert first.line_of(("b", "c")) == 3
    assert first.line_of(("b", "d", 0, "e")) == 5
    # A field that does not exist falls back to its closest ancestor.
    assert first.line_of(("b", "d", 0, "missing")) == 5
    assert second.line == 7 and second.index == 1


def test_empty_documents_are_skipped() -> None:
    docs = list(parse_documents("---\n---\na: 1\n---\n", "f.yaml"))
    assert [d.data for d in docs] == [{"a": 1}]


@pytest.mark.parametrize(
    ("text", "line", "needle"),
    [
        ("a: 1\na: 2\n", 2, "duplicate key 'a' (first at line 1)"),
        ("a: [1, 2\n", 2, "malformed YAML"),
        ("a:\n  - b\n c: d\n", 3, "malformed YAML"),
        ("? [1, 2]\n: x\n", 1, "mapping keys must be strings"),
        ("1: x\n", 1, "mapping keys must be strings"),
        ("base: &b {x: 1}\nother:\n  <<: *b\n", 3, "merge keys"),
        ("a: !!python/object:os.system x\n", 1, "could not determine a constructor"),
        ("a: *missing\n", 1, "malformed YAML"),
    ],
)
def test_bad_yaml_is_refused_with_a_line(text: str, line: int, needle: str) -> None:
    with pytest.raises(PolicyError) as caught:
        list(parse_documents(text, "bad.yaml"))
    assert caught.value.file == "bad.yaml"
    assert caught.value.line == line
    assert needle in caught.value.message


def test_alias_bomb_is_refused() -> None:
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for i in range(1, 9):
        refs = ", ".join([f"*a{i - 1}"] * 10)
        lines.append(f"a{i}: &a{i} [{refs}]")
    with pytest.raises(PolicyError, match="alias bomb"):
        list(parse_documents("\n".join(lines) + "\n", "bomb.yaml"))


def test_invalid_utf8_names_the_line() -> None:
    with pytest.raises(PolicyError) as caught:
        list(parse_documents(b"a: 1\nb: \xff\xfe\n", "bin.yaml"))
    assert caught.value.line == 2
    assert "UTF-8" in caught.value.message


def test_oversized_file_is_refused() -> None:
    with pytest.raises(PolicyError, match="larger than"):
        list(parse_documents(b"#" * (MAX_FILE_BYTES + 1), "huge.yaml"))


def test_format_loc() -> None:
    assert format_loc(("spec", "endpoints", 0, "port")) == "spec.endpoints[0].port"
    assert format_loc(()) == ""
