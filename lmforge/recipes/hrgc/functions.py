"""``lmforge data go-functions``: (spec, plan, code) examples from every Go function in a source tree.

Each function or method with a body becomes one record::

    {"package": "net/http", "file": "net/http/client.go", "name": "(*Client).Do",
     "spec": "// Do sends an HTTP request ...\\nfunc (c *Client) Do(req *Request) (*Response, error)",
     "plan": "return call c.do",
     "code": "{\\n\\treturn c.do(req)\\n}"}

* spec — the doc comment (the comment lines right above the declaration) and the signature;
* plan — a deterministic outline of the body's top-level statements (``plan_of``), e.g.
  ``f, err := call os.Open | if err != nil → return | defer call f.Close | return call io.ReadAll``;
* code — the body, braces included, exactly as written.

Files are parsed with tree-sitter-go; a function whose syntax tree has an error or a missing node
is skipped. Where Go is installed, ``gofmt -e`` cross-checks each file and a file it rejects is
skipped whole (the two parsers disagree on a few edge cases; both must accept). Generated files,
``vendor/``, ``testdata/`` and (unless asked) ``_test.go`` files are skipped as ``data prepare``
skips them. The split is by package (directory), never by function, so near-copies inside a
package cannot leak from train into val/test.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from lmforge.data.sources import FilterStats, iter_tree
from lmforge.errors import LMForgeError
from lmforge.files import atomic_directory, remove_stale
from lmforge.go_syntax import PLAN_VERSION, go_parser, node_text, plan_of

SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class GoFunction:
    package: str
    file: str
    name: str
    spec: str
    plan: str
    code: str


# ---- functions ------------------------------------------------------------------------------------
def _doc_comment(decl, src: bytes) -> str:
    """The comment lines directly above ``decl`` (no blank line between), as written."""
    lines = []
    node, row = decl.prev_named_sibling, decl.start_point[0]
    while node is not None and node.type == "comment" and node.end_point[0] == row - 1:
        lines.append(src[node.start_byte:node.end_byte].decode("utf-8"))
        row = node.start_point[0]
        node = node.prev_named_sibling
    return "\n".join(reversed(lines))


def _function_name(decl) -> str:
    name = node_text(decl.child_by_field_name("name"))
    if decl.type != "method_declaration":
        return name
    receiver = decl.child_by_field_name("receiver").named_children
    rtype = receiver[0].child_by_field_name("type") if receiver else None
    rtype_text = re.sub(r"\[.*\]", "", node_text(rtype)) if rtype is not None else "?"  # drop type parameters
    return f"({rtype_text}).{name}"


def functions_in_file(parser, text: str, file: str, package: str, stats: Counter) -> list[GoFunction]:
    """Every function and method with a body in one Go file; the ones skipped are counted in ``stats``."""
    src = text.encode("utf-8")
    tree = parser.parse(src)
    out = []
    for decl in tree.root_node.named_children:
        if decl.type not in ("function_declaration", "method_declaration"):
            continue
        body = decl.child_by_field_name("body")
        if body is None:
            stats["no_body"] += 1  # implemented in assembly
            continue
        if decl.has_error:
            stats["does_not_parse"] += 1
            continue
        signature = src[decl.start_byte:body.start_byte].decode("utf-8").rstrip()
        doc = _doc_comment(decl, src)
        out.append(GoFunction(
            package=package, file=file, name=_function_name(decl),
            spec=f"{doc}\n{signature}" if doc else signature,
            plan=plan_of(body), code=src[body.start_byte:body.end_byte].decode("utf-8")))
    # Declarations the parser could not even recognise as functions.
    unrecognised = sum(1 for n in tree.root_node.named_children
                       if n.type == "ERROR" and node_text(n).lstrip().startswith("func"))
    if unrecognised:
        stats["does_not_parse"] += unrecognised
    return out


def gofmt_rejects(root: Path, files: list[str], batch: int = 200) -> dict[str, str]:
    """``{file: first error}`` for the files that ``gofmt -e`` cannot parse; {} without Go installed."""
    gofmt = shutil.which("gofmt")
    if gofmt is None:
        return {}
    rejected: dict[str, str] = {}
    for i in range(0, len(files), batch):
        chunk = files[i:i + batch]
        result = subprocess.run([gofmt, "-e", "-l", *chunk], cwd=root, capture_output=True, text=True)
        for line in result.stderr.splitlines():
            path = line.split(":", 1)[0]
            if path in chunk:
                rejected.setdefault(path, line)
    return rejected


# ---- the dataset --------------------------------------------------------------------------------
def split_packages(counts: dict[str, int], val_fraction: float, test_fraction: float) -> dict[str, str]:
    """``{package: split}``: packages in a fixed pseudo-random order (a hash of the name) fill test,
    then val, to their share of functions; the rest is train. With three or more packages, val and
    test get at least one each."""
    order = sorted(counts, key=lambda p: hashlib.sha1(p.encode()).hexdigest())
    total = sum(counts.values())
    assignment, filled = {}, Counter()
    for package in order:
        split = "train"
        for candidate, share in (("test", test_fraction), ("val", val_fraction)):
            if share > 0 and (filled[candidate] < share * total or (len(order) >= 3 and not filled[candidate])):
                split = candidate
                break
        if split != "train" and len(order) - len(assignment) <= 1 and not filled["train"]:
            split = "train"  # the last package: train must not be empty
        assignment[package] = split
        filled[split] += counts[package]
    return assignment


def extract_go_functions(src_dir: str | os.PathLike, out: str | os.PathLike, include_tests: bool = False,
                         val_fraction: float = 0.05, test_fraction: float = 0.05, max_code_chars: int = 20_000,
                         overwrite: bool = False, show_progress: bool = True) -> dict:
    """Write ``OUT/{train,val,test}.jsonl`` and ``OUT/meta.json``; returns the meta dict (counts,
    skip reasons, packages per split)."""
    from tqdm import tqdm

    root = Path(src_dir)
    if not root.is_dir():
        raise LMForgeError(f"{root} is not a directory; give the root of a Go source tree")
    for name, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if not 0 <= value < 0.5:
            raise LMForgeError(f"--{name.replace('_', '-')} must be in [0, 0.5), got {value}")
    if max_code_chars < 1:
        raise LMForgeError(f"--max-code-chars must be >= 1, got {max_code_chars}")
    out = Path(out).resolve()  # resolved so that "." still has a name for the temporary sibling
    remove_stale(out)  # a run killed mid-replacement may have moved the previous dataset aside
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not overwrite:
            raise LMForgeError(f"--out {out} exists and is not empty; pass --overwrite or choose another directory")
        if not (out / "meta.json").is_file():
            raise LMForgeError(f"--out {out} is not an earlier go-functions dataset (no meta.json); "
                               "choose another directory")

    parser = go_parser()
    file_stats = FilterStats()
    if next(root.glob("**/*.go"), None) is None:
        raise LMForgeError(f"no .go files under {root}; give the root of a Go source tree")
    docs = list(iter_tree(root, ("**/*.go",), not include_tests, file_stats))
    rejected = gofmt_rejects(root, [d.source_id for d in docs])
    skipped: Counter = Counter({f"file_{k}": v for k, v in file_stats.skipped.items()})
    functions: list[GoFunction] = []
    for doc in tqdm(docs, desc="parsing Go files", unit="file", disable=not show_progress):
        if doc.source_id in rejected:
            skipped["file_rejected_by_gofmt"] += 1
            continue
        package = Path(doc.source_id).parent.as_posix()
        for fn in functions_in_file(parser, doc.text, doc.source_id, package, skipped):
            if len(fn.code) > max_code_chars:
                skipped["code_too_long"] += 1
            else:
                functions.append(fn)
    if not functions:
        raise LMForgeError(f"no Go functions with a body were found under {root} (skipped: "
                           f"{dict(skipped) or 'nothing'}); check the path, or pass --include-tests")

    per_package = Counter(fn.package for fn in functions)
    assignment = split_packages(per_package, val_fraction, test_fraction)
    with atomic_directory(out) as tmp:
        handles = {split: open(tmp / f"{split}.jsonl", "w", encoding="utf-8") for split in SPLITS}
        counts = Counter()
        try:
            for fn in functions:
                split = assignment[fn.package]
                handles[split].write(json.dumps(asdict(fn), ensure_ascii=False) + "\n")
                counts[split] += 1
        finally:
            for h in handles.values():
                h.close()
        meta = {
            "source": str(root.resolve()), "plan_version": PLAN_VERSION, "include_tests": include_tests,
            "gofmt_checked": shutil.which("gofmt") is not None,
            "files_read": len(docs), "functions": {s: counts[s] for s in SPLITS},
            "packages": {s: sorted(p for p, x in assignment.items() if x == s) for s in SPLITS},
            "skipped": dict(sorted(skipped.items())), "gofmt_rejected": dict(sorted(rejected.items())),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    return meta


def read_go_functions(path: str | os.PathLike) -> Iterable[GoFunction]:
    """The records of one split file written by ``extract_go_functions``."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            try:
                yield GoFunction(**json.loads(line))
            except (ValueError, TypeError) as e:
                raise LMForgeError(f"{path}:{lineno}: not a go-functions record ({e}); re-create the dataset "
                                   "with `lmforge data go-functions`") from e
