"""Build bench/corpus/schemastore.jsonl.gz from a SchemaStore checkout (github.com/SchemaStore/schemastore).

Each line: {"name", "schema", "refs": [...], "valid": [...], "invalid": [...]}: the schema
src/schemas/json/<name>.json, up to MAX_PER_KIND instances from src/test/<name>/ (valid) and
src/negative_test/<name>/ (invalid), YAML and TOML tests converted to JSON, and the names of the other schema files
its `$ref`s reach (directly or through those files). Schemas with no test instance, or larger than MAX_SCHEMA bytes,
are left out. Each referenced file is stored once, on a line {"file": "<name>.json", "schema": ...}, so that the
benchmark can lay the schema out next to its siblings and load it through the spec loader as a user's file.

    python -m bench extract-schemastore /path/to/schemastore [--commit REV] [--out FILE]
(a bare git directory works too: files are read with `git show REV:path`).
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import posixpath
import re
import subprocess
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import yaml

MAX_SCHEMA = 96_000
MAX_INSTANCE = 12_000
MAX_PER_KIND = 4
MAX_REFERENCED = 1_500_000
SCHEMA_HOSTS = ("json.schemastore.org", "www.schemastore.org")
OUT = Path(__file__).parent / "corpus" / "schemastore.jsonl.gz"


def git(repo: str, *args: str) -> bytes:
    return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True).stdout


def plain(value):
    """YAML/TOML values as JSON would hold them (dates become the ISO strings the YAML/TOML text had)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    return value


class Yaml12Loader(yaml.SafeLoader):
    """YAML 1.2 booleans (true/false only), as SchemaStore's own test runner reads them: `Yes`, `on` stay strings."""


Yaml12Loader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:bool"]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.copy().items()}
for _first in "tTfF":
    Yaml12Loader.yaml_implicit_resolvers.setdefault(_first, []).append(
        ("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")))


def parse(name: str, data: bytes):
    text = data.decode("utf-8-sig")
    if name.endswith(".json"):
        return json.loads(text)
    if name.endswith((".yaml", ".yml")):
        docs = list(yaml.load_all(text, Loader=Yaml12Loader))
        if len(docs) != 1:
            raise ValueError("multi-document YAML")
        return plain(docs[0])
    if name.endswith(".toml"):
        return plain(tomllib.loads(text))
    raise ValueError("unknown test file type")


def ref_files(schema, folder: str = "src/schemas/json") -> set[str]:
    """Repository paths of the files `schema`'s `$ref`s name: relative refs, and refs to SchemaStore's own URLs
    (which the loader reads from the schema's folder when they share its `$id`'s host). A name without a suffix
    stands for `<name>.json`, as the SchemaStore site serves it."""
    out: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                url = urlsplit(ref)
                if not url.scheme:
                    path = posixpath.normpath(posixpath.join(folder, url.path))
                elif url.netloc in SCHEMA_HOSTS:
                    path = posixpath.join(folder, posixpath.basename(url.path))
                else:
                    path = ""
                if path:
                    out.add(path if path.endswith(".json") else path + ".json")
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench extract-schemastore", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("repo")
    ap.add_argument("--commit", default="HEAD")
    ap.add_argument("--out", type=Path, default=OUT, help="the corpus file to write")
    a = ap.parse_args(argv)
    rev = git(a.repo, "rev-parse", a.commit).decode().strip()
    listing = git(a.repo, "ls-tree", "-r", "-l", rev, "src/schemas/json", "src/test", "src/negative_test").decode()
    files: dict[str, int] = {}
    for line in listing.splitlines():
        meta, path = line.split("\t", 1)
        size = meta.split()[3]
        if size.isdigit():  # a blob missing from a partial clone has no size: left out
            files[path] = int(size)
    tests: dict[tuple[str, str], list[str]] = {}
    for path in sorted(files):
        parts = path.split("/")
        if parts[1] in ("test", "negative_test") and len(parts) == 4:
            tests.setdefault((parts[2], parts[1]), []).append(path)
    n = 0
    referenced: dict[str, object] = {}

    def load(path: str):
        if path not in referenced:
            referenced[path] = None
            if files.get(path, MAX_REFERENCED + 1) <= MAX_REFERENCED:
                try:
                    referenced[path] = json.loads(git(a.repo, "show", f"{rev}:{path}").decode("utf-8-sig"))
                except (ValueError, UnicodeDecodeError):
                    pass
        return referenced[path]

    def reach(schema) -> list[str]:
        """The files `schema` refers to, and those they refer to, that exist (cycles end: each is seen once)."""
        seen: set[str] = set()
        todo = sorted(ref_files(schema))
        while todo:
            path = todo.pop()
            if path in seen or load(path) is None:
                continue
            seen.add(path)
            todo.extend(sorted(ref_files(referenced[path], posixpath.dirname(path)) - seen))
        return sorted(seen)

    needed: set[str] = set()
    with gzip.open(a.out, "wt", compresslevel=9) as out:
        for path in sorted(files):
            if not path.startswith("src/schemas/json/") or not path.endswith(".json") or files[path] > MAX_SCHEMA:
                continue
            name = path.rsplit("/", 1)[1][:-5]
            try:
                schema = json.loads(git(a.repo, "show", f"{rev}:{path}").decode("utf-8-sig"))
            except (ValueError, UnicodeDecodeError):
                continue
            row = {"name": name, "schema": schema, "refs": [posixpath.relpath(p, "src/schemas/json") for p in reach(schema)],
                   "valid": [], "invalid": []}
            for kind, folder in (("valid", "test"), ("invalid", "negative_test")):
                for test in tests.get((name, folder), []):
                    if len(row[kind]) >= MAX_PER_KIND or files[test] > MAX_INSTANCE:
                        continue
                    try:
                        row[kind].append(parse(test, git(a.repo, "show", f"{rev}:{test}")))
                    except Exception:  # unparseable or multi-document test files are left out
                        continue
            if row["valid"] or row["invalid"]:
                out.write(json.dumps(row, separators=(",", ":"), sort_keys=True) + "\n")
                n += 1
                needed.update(row["refs"])
        for path in sorted(needed):
            line = {"file": path, "schema": referenced[f"src/schemas/json/{path}"]}
            out.write(json.dumps(line, separators=(",", ":"), sort_keys=True) + "\n")
    print(f"{n} schemas and {len(needed)} files they refer to from SchemaStore {rev} -> {a.out} "
          f"({a.out.stat().st_size / 1e6:.2f} MB)")
    return 0
