"""Load a policy directory into a MeshModel, or report every error with file and line.

The loader keeps each file's parsed and validated documents keyed by the file's content hash, so a
change to one file of a thousand re-parses one file: that is what keeps policy-change-to-Envoy
latency flat as a mesh grows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from meshfn.ir import MeshModel

from . import qos, rollout
from .compile import compile_model, lower
from .errors import PolicyError, PolicyErrors
from .model import Mesh
from .references import check_references
from .source import Document, Loc, parse_documents
from .validate import Loaded, validate_document

POLICY_SUFFIXES = (".yaml", ".yml")


def policy_files(root: Path) -> list[str]:
    """YAML files under `root` (or `root` itself), skipping hidden files and folders. Plain
    strings: this runs on every reload over every file, and Path objects cost more than the walk."""
    if root.is_file():
        return [str(root)]
    found: list[str] = []
    pending = [str(root)]
    while pending:
        directory = pending.pop()
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.name.startswith("."):
                    continue
                if entry.is_dir():
                    pending.append(entry.path)
                elif entry.name.endswith(POLICY_SUFFIXES):
                    found.append(entry.path)
    found.sort()
    return found


@dataclass(frozen=True)
class _FileResult:
    stat: tuple[int, ...]
    digest: bytes
    items: tuple[Loaded, ...]
    errors: tuple[PolicyError, ...]


def _stat_key(path: str) -> tuple[int, ...]:
    """Changes whenever the file's content may have: any write or rename bumps ctime."""
    st = os.stat(path)
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class Provenance:
    """Where each loaded object was written. The IR carries no lines; a stage that reports on
    IR objects (the Istio renderer's warnings) names (kind, namespace, name, field path), and
    this maps that back to `file:line` for the user."""

    documents: dict[tuple[str, str, str], Document]

    def where(self, kind: str, namespace: str, name: str, loc: Loc = ()) -> str | None:
        """`file:line` of `loc` in that object (or of its closest ancestor); None if unknown."""
        doc = self.documents.get((kind, namespace, name))
        if doc is None:
            return None
        return f"{doc.file}:{doc.line_of(loc)}"


class PolicyLoader:
    """Loads one policy directory; reuse the instance across reloads to get per-file caching."""

    def __init__(self, root: Path | str, published: rollout.Published | None = None) -> None:
        """`published`: the versions the function registry holds of a function (Rollouts'
        versions are checked against it); None: no registry to ask."""
        self.root = Path(root)
        self.published = published
        self._files: dict[str, _FileResult] = {}

    def load(self) -> MeshModel:
        """Return the MeshModel or raise PolicyErrors listing every problem found."""
        return self.load_with_sources()[0]

    def load_with_sources(self) -> tuple[MeshModel, list[Loaded]]:
        """The MeshModel and the validated objects it was compiled from (their documents know
        every field's line: `meshfn analyze` points at them), or PolicyErrors."""
        items, errors = self._load_items()
        return build_model(items, errors, self.published), items

    def provenance(self) -> Provenance:
        """Where the objects of the last load() came from."""
        return Provenance(
            {
                (i.kind, i.namespace, i.name): i.doc
                for result in self._files.values()
                for i in result.items
            }
        )

    def _load_items(self) -> tuple[list[Loaded], list[PolicyError]]:
        if not self.root.exists():
            raise PolicyErrors([PolicyError(str(self.root), 0, "", "no such file or directory")])
        files = policy_files(self.root)
        if not files:
            raise PolicyErrors(
                [PolicyError(str(self.root), 0, "", "no policy files (*.yaml, *.yml) found")]
            )
        items: list[Loaded] = []
        errors: list[PolicyError] = []
        current = {}
        for path in files:
            result = self._load_file(path)
            current[path] = result
            items.extend(result.items)
            errors.extend(result.errors)
        self._files = current
        if not errors and not any(isinstance(i.obj, Mesh) for i in items):
            errors.append(
                PolicyError(
                    str(self.root), 0, "", "no Mesh found: a policy set needs one kind: Mesh"
                )
            )
        return items, errors

    def _load_file(self, path: str) -> _FileResult:
        display = path
        cached = self._files.get(path)
        try:
            stat = _stat_key(path)
            if cached is not None and cached.stat == stat:
                return cached
            with open(path, "rb") as handle:
                raw = handle.read()
        except OSError as exc:
            error = PolicyError(display, 0, "", f"cannot read: {exc.strerror}")
            return _FileResult((), b"", (), (error,))
        digest = hashlib.blake2b(raw, digest_size=16).digest()
        if cached is not None and cached.digest == digest:
            return dataclasses.replace(cached, stat=stat)
        items: list[Loaded] = []
        errors: list[PolicyError] = []
        try:
            docs = list(parse_documents(raw, display))
        except PolicyError as exc:
            return _FileResult(stat, digest, (), (exc,))
        for doc in docs:
            result = lowered(doc)
            if isinstance(result, Loaded):
                items.append(result)
            else:
                errors.extend(result)
        return _FileResult(stat, digest, tuple(items), tuple(errors))


def build_model(
    items: list[Loaded], errors: list[PolicyError], published: rollout.Published | None = None
) -> MeshModel:
    """Validated documents (and the errors found while validating them) -> the MeshModel, or
    PolicyErrors. Every policy source (files, Kubernetes) ends here: one path to the IR.
    `published`: the function registry's versions of a function, where there is one to ask."""
    if not errors:
        errors = check_references(items)
    if not errors:  # after the references: it follows them
        errors = qos.check(items)
    if not errors:
        errors = rollout.check(items, published)
    if not errors:
        result = compile_model(items)
        if isinstance(result, MeshModel):
            return result
        errors = result
    raise PolicyErrors(errors)


def lowered(doc: Document) -> Loaded | list[PolicyError]:
    """One document validated, with its own piece of IR computed (what the loader caches)."""
    result = validate_document(doc)
    if isinstance(result, Loaded):
        return dataclasses.replace(result, lowered=lower(result))
    return result


def load_policies(root: Path | str) -> MeshModel:
    return PolicyLoader(root).load()
