"""YAML documents with a line number for every field.

PyYAML's libyaml composer keeps a start mark on every node at C speed, so we compose nodes and
build plain Python values ourselves, recording where each field path came from. Anything that would
make the later error messages lie (duplicate keys, non-string keys, alias bombs) is refused here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import yaml

from .errors import PolicyError

Loc = tuple[str | int, ...]

MAX_FILE_BYTES = 8 * 1024 * 1024
MAX_NODES_PER_FILE = 500_000

_Loader: type[Any] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_constructor = yaml.constructor.SafeConstructor()


@dataclass(frozen=True)
class Document:
    """One YAML document: its plain data and the line of every field path in it."""

    file: str
    index: int
    line: int
    data: Any
    lines: dict[Loc, int] = field(repr=False, compare=False)

    def line_of(self, loc: Loc) -> int:
        """Line of `loc`, or of its closest ancestor that has one (pydantic locs may point at
        fields that are missing, or at synthetic union tags)."""
        for end in range(len(loc), -1, -1):
            line = self.lines.get(loc[:end])
            if line is not None:
                return line
        return self.line

    def error(self, loc: Loc, message: str) -> PolicyError:
        return PolicyError(
            file=self.file, line=self.line_of(loc), path=format_loc(loc), message=message
        )


def format_loc(loc: Loc) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


class _Builder:
    def __init__(self, file: str) -> None:
        self.file = file
        self.budget = MAX_NODES_PER_FILE
        self.lines: dict[Loc, int] = {}

    def build(self, node: yaml.Node, loc: Loc) -> Any:
        self.budget -= 1
        if self.budget < 0:
            raise PolicyError(
                self.file,
                node.start_mark.line + 1,
                format_loc(loc),
                f"document expands to more than {MAX_NODES_PER_FILE} nodes (alias bomb?)",
            )
        self.lines[loc] = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            out: dict[str, Any] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    raise PolicyError(
                        self.file,
                        key_node.start_mark.line + 1,
                        format_loc(loc),
                        "YAML merge keys (<<) are not supported",
                    )
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != (
                    "tag:yaml.org,2002:str"
                ):
                    raise PolicyError(
                        self.file,
                        key_node.start_mark.line + 1,
                        format_loc(loc),
                        f"mapping keys must be strings, got {key_node.tag.rsplit(':', 1)[-1]}",
                    )
                key = key_node.value
                if key in out:
                    raise PolicyError(
                        self.file,
                        key_node.start_mark.line + 1,
                        format_loc((*loc, key)),
                        f"duplicate key {key!r} (first at line {self.lines[(*loc, key)]})",
                    )
                child = (*loc, key)
                out[key] = self.build(value_node, child)
                self.lines[child] = key_node.start_mark.line + 1
            return out
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, (*loc, i)) for i, item in enumerate(node.value)]
        try:
            return _constructor.construct_object(node, deep=True)
        except yaml.YAMLError as exc:
            raise PolicyError(
                self.file, node.start_mark.line + 1, format_loc(loc), str(exc).splitlines()[0]
            ) from None


def parse_documents(text: str | bytes, file: str) -> Iterator[Document]:
    """Yield the non-empty documents of one file; raise PolicyError on malformed YAML."""
    if len(text) > MAX_FILE_BYTES:
        raise PolicyError(file, 1, "", f"file is larger than {MAX_FILE_BYTES} bytes")
    if isinstance(text, bytes):
        raw = text
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = raw[: exc.start].count(b"\n") + 1
            raise PolicyError(file, line, "", "file is not valid UTF-8") from None
    try:
        nodes = list(yaml.compose_all(text, Loader=_Loader))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        problem = exc.problem or exc.context or "malformed YAML"
        raise PolicyError(file, line, "", f"malformed YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise PolicyError(file, 1, "", f"malformed YAML: {exc}") from None
    builder = _Builder(file)
    for index, node in enumerate(nodes):
        if node is None or (isinstance(node, yaml.ScalarNode) and node.tag.endswith(":null")):
            continue
        builder.lines = {}
        data = builder.build(node, ())
        yield Document(
            file=file, index=index, line=node.start_mark.line + 1, data=data, lines=builder.lines
        )
