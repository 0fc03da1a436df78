"""Schema files -> one schema: the files a JSON Schema refers to by relative `$ref`, bundled into it at load.

A schema file often refers to a sibling file (`"$ref": "common.json#/definitions/address"`). The grammar backends
take one document and jsonschema must never fetch anything while validating, so the loader copies each referenced
file into the schema (under `definitions`, or `$defs` from 2019-09 on) and points every `$ref` there: the grammar
and the validator then see the same single document. Files are only read from the local disk, never fetched.
`referencing` (jsonschema's own resolver) resolves each `$ref`, so `$id`s, anchors and each draft's rules are
honoured the way validation honours them.
"""

from __future__ import annotations

import copy
import json
import posixpath
import re
from pathlib import Path
from urllib.parse import urldefrag, urljoin, urlsplit
from urllib.request import url2pathname

from jsonschema_specifications import REGISTRY as META_SCHEMAS
from referencing import Registry, Resource
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT3, DRAFT4, DRAFT6, DRAFT7, DRAFT202012, specification_with

from batchjson.errors import SpecError
from batchjson.schema.shape import children, declared_draft, esc


class _Remote(Exception):
    """A `$ref` to a URL that maps to no local folder: it would have to be fetched."""


class _Missing(Exception):
    """A `$ref` to a local file that does not exist."""

    def __init__(self, path: Path):
        super().__init__(str(path))
        self.path = path


def _pointer(parts: list[str]) -> str:
    # A JSON pointer inside a URI fragment: '%' and '#' would be read as URI syntax.
    return "".join("/" + esc(p).replace("%", "%25").replace("#", "%23") for p in parts)


def _prune(node, path: list[str], reached: set[tuple], on_the_way: set[tuple]) -> None:
    """Keep of a referenced file only what its refs reach, and the objects on the way there (which pointers walk
    through but nothing evaluates): a file's unused definitions stay out of the job's schema."""
    if tuple(path) in reached:
        return
    if isinstance(node, dict):
        for k in list(node):
            if (*path, k) in on_the_way:
                _prune(node[k], [*path, k], reached, on_the_way)
            else:
                del node[k]
    elif isinstance(node, list):
        for i, v in enumerate(node):
            if (*path, str(i)) in on_the_way:
                _prune(v, [*path, str(i)], reached, on_the_way)
            elif isinstance(v, (dict, list)):
                node[i] = {}


# Before 2019-09 a `$ref` makes its sibling keywords ignored; from 2019-09 on they apply next to it.
_SIBLINGS_IGNORED = (DRAFT3, DRAFT4, DRAFT6, DRAFT7)


def _set_ref(node: dict, target: str | bool, from_legacy: bool, into_legacy: bool) -> None:
    """Point `node` at `target` (a root-relative ref, or a boolean schema, written in place), keeping what its
    sibling keywords meant in the file it came from once it sits in a schema of another draft."""
    if isinstance(target, str) and from_legacy == into_legacy:
        node["$ref"] = target
        return
    defs = {k: node[k] for k in ("definitions", "$defs") if k in node}
    siblings = {} if from_legacy else {k: v for k, v in node.items() if k not in ("$ref", "definitions", "$defs")}
    ref = {"$ref": target} if isinstance(target, str) else {} if target else {"not": {}}
    node.clear()
    node.update(defs)
    node.update(siblings)
    if siblings and ref:
        node["allOf"] = [ref, *siblings.get("allOf", [])]  # applies next to the siblings whatever the draft
    else:
        node.update(ref)


class _Bundle:
    """One bundling: the files read so far, where each JSON node sits, and the rewrites to make."""

    def __init__(self, root: dict, folder: Path, name: str | None):
        self.root = root
        self.spec = specification_with(str(root.get("$schema", "")), default=DRAFT202012)
        self.defs = "definitions" if declared_draft(root) <= 7 else "$defs"
        self.taken = set(root[self.defs]) if isinstance(root.get(self.defs), dict) else set()
        path = (folder / name).resolve() if name else None
        uri = path.as_uri() if path else folder.resolve().as_uri() + "/"
        self.folders: dict[tuple[str, str, str], Path] = {}
        """(scheme, host, folder) of a file's absolute `$id` -> the local folder of that file: a relative `$ref`
        against an `$id` such as https://example.com/s/a.json is read from the folder of the file declaring it."""
        self.files: dict[Path, tuple[str, Resource]] = {}
        self.where: dict[str | None, str] = {None: "the JSON Schema"}
        self.nodes: dict[int, tuple[str | None, list[str]]] = {}
        """id() of every JSON object and array of every file -> (its file's key, its JSON pointer in that file)."""
        self.bases: dict[int, str] = {}
        """id() of every subschema -> the base URI its refs are resolved against (its file's, or an `$id`'s)."""
        self.specs: dict[str | None, object] = {None: self.spec}
        resource = self.spec.create_resource(root)
        self._add(None, resource, uri, folder)
        if path:
            self.files[path] = (None, resource)
        self.registry = Registry().with_resources([(uri, resource), (urljoin(uri, resource.id() or ""), resource)])
        self.registry = self.registry.crawl()
        self.embedded: list[tuple[str, Resource]] = []
        self.rewrites: list[tuple[dict, str | None, str | bool]] = []
        self.ids: list[dict] = []
        self.remote: list[str] = []

    def _add(self, key: str | None, resource: Resource, uri: str, folder: Path) -> None:
        """Index a file's nodes and the base URI of each subschema; map its `$id`'s folder to its local folder."""
        spec = self.specs[key]

        def index(node, path):
            if isinstance(node, (dict, list)):
                self.nodes[id(node)] = (key, path)
                for k, v in (node.items() if isinstance(node, dict) else enumerate(node)):
                    index(v, [*path, str(k)])

        def bases(node, base):
            base = urljoin(base, spec.id_of(node) or "")
            self.bases[id(node)] = base
            for _, sub in children(node):
                bases(sub, base)

        index(resource.contents, [])
        if isinstance(resource.contents, dict):
            bases(resource.contents, uri)
        declared = urlsplit(urljoin(uri, resource.id() or ""))
        if declared.scheme not in ("", "file"):
            self.folders.setdefault((declared.scheme, declared.netloc, posixpath.dirname(declared.path)), folder)

    def _local(self, uri: str) -> Path:
        parts = urlsplit(uri)
        if parts.scheme == "file":
            return Path(url2pathname(parts.path))
        same_host = [(where, folder) for (scheme, host, where), folder in self.folders.items()
                     if (scheme, host) == (parts.scheme, parts.netloc)]
        if not same_host:
            raise _Remote(uri)
        # The folder whose `$id` folder is the longest prefix of the URI's path, else the host's first.
        where, folder = min(same_host, key=lambda wf: (not parts.path.startswith(wf[0] + "/"), -len(wf[0])))
        return folder / posixpath.relpath(parts.path, where or "/")

    def _retrieve(self, uri: str) -> Resource:
        path = self._local(uri)
        candidates = [path]
        if path.suffix != ".json":
            # Schema hosts serve `name.json` as `name` too (json.schemastore.org/grunt-task): refs often omit it.
            candidates.append(path.with_name(path.name + ".json"))
        found = next((p.resolve() for p in candidates if p.name and p.is_file()), None)
        if found is None:
            raise _Missing(path)
        if found not in self.files:
            try:
                contents = json.loads(found.read_text())
            except (OSError, UnicodeDecodeError, ValueError) as e:
                raise SpecError(f"the JSON Schema file {found}, which a $ref refers to, cannot be read: {e}.") from None
            key = re.sub(r"[^A-Za-z0-9._-]", "_", found.name)
            while key in self.taken:
                key += "_"
            self.taken.add(key)
            declared = contents.get("$schema", "") if isinstance(contents, dict) else ""
            self.specs[key] = specification_with(str(declared), default=self.spec)
            resource = self.specs[key].create_resource(contents)
            self.where[key] = f"the JSON Schema file {found}"
            self.files[found] = (key, resource)
            self.embedded.append((key, resource))
            self._add(key, resource, found.as_uri(), found.parent)
        return self.files[found][1]

    def run(self) -> bool:
        """Resolve every ref of the schema, and of what they reach in other files (only that: a file's unused parts
        are never looked at); then, unless a ref is remote, rewrite the refs and copy the files in.
        Whether anything was bundled."""
        todo, seen = [self.root], set()
        while todo:  # a node reached twice (a cycle) is walked once
            node = todo.pop()
            if id(node) in seen or not isinstance(node, (dict, list)):
                continue
            seen.add(id(node))
            if isinstance(node, list):
                continue
            key = self.nodes[id(node)][0]
            if node is not self.root and self.specs[key].id_of(node) is not None:
                self.ids.append(node)
            if isinstance(node.get("$ref"), str):
                todo.append(self._rewrite(node, key))
            todo.extend(sub for _, sub in children(node))
        if self.remote or not self.embedded:
            return False
        into_legacy = self.spec in _SIBLINGS_IGNORED
        for node, key, new in self.rewrites:
            _set_ref(node, new, self.specs[key] in _SIBLINGS_IGNORED, into_legacy)
        # Every ref now points from the root: an `$id` left inside would make a '#/...' under it relative to itself.
        for node in self.ids:
            node.pop("$id" if "$id" in node else "id", None)
        defs = self.root.setdefault(self.defs, {})
        for key, resource in self.embedded:
            reached = [self.nodes[n][1] for n in seen if self.nodes[n][0] == key]
            _prune(resource.contents, [], {tuple(p) for p in reached}, {tuple(p[:i]) for p in reached
                                                                       for i in range(len(p) + 1)})
            if isinstance(resource.contents, dict):
                for k in ("$schema", "$id", "id"):
                    if isinstance(resource.contents.get(k), str):
                        del resource.contents[k]
            defs[key] = resource.contents
        return True

    def _rewrite(self, node: dict, key: str | None):
        """Record the root-relative ref for `node`'s `$ref`; returns its target, to be walked."""
        ref, where = node["$ref"], self.where[key]
        base = self.bases.get(id(node), "")
        uri = urldefrag(urljoin(base, ref)).url
        if uri.rstrip("#") in META_SCHEMAS:
            return None  # jsonschema ships the meta-schemas
        if uri not in self.registry:
            try:
                resource = self._retrieve(uri)
            except _Remote:
                self.remote.append(ref)
                return None
            except _Missing as e:
                raise SpecError(f"$ref {ref!r} in {where} refers to the file {e.path}, which does not exist. Put the "
                                "referenced schema file there (a ref is read relative to the folder of the file that "
                                "holds it), or fix the $ref.") from None
            # Crawled once per file (its `$id`s and anchors), not at every lookup.
            self.registry = self.registry.with_resource(uri, resource).crawl()
        try:
            target = self.registry.resolver(base_uri=base).lookup(ref).contents
        except Unresolvable as e:
            if key is None and ref.startswith("#"):
                return None  # the schema's own refs are validation's business, as when nothing is bundled
            raise SpecError(f"$ref {ref!r} in {where} points to nothing ({type(e).__name__}).") from None
        if id(target) not in self.nodes:  # a boolean schema: written in place
            self.rewrites.append((node, key, bool(target)))
            return None
        target_key, path = self.nodes[id(target)]
        self.rewrites.append((node, key, "#" + _pointer(([self.defs, target_key] if target_key else []) + path)))
        return target


def bundle(schema: dict, folder: Path, name: str | None = None) -> tuple[dict, list[str]]:
    """`schema` (read from `folder/name`, or written inline in a spec in `folder`) with every local file it refers to
    by `$ref`, and every file those refer to, copied under `definitions` (`$defs` from 2019-09 on) and the refs
    rewritten to point there; and the refs to URLs that would have to be fetched (then nothing is bundled).

    A ref is read relative to the file that holds it, or to its `$id`'s folder (an `$id` of
    https://example.com/s/a.json makes `b.json` the file `b.json` next to the one that declares the `$id`); a ref
    without a suffix also finds `<name>.json`. Raises SpecError naming the ref and the path of a missing file."""
    work = _Bundle(copy.deepcopy(schema), folder, name)
    return (work.root if work.run() else schema), work.remote
