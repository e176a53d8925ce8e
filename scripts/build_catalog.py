"""Regenerate every `spec` in src/memplan/inputs/catalog.json from its `config` (real model on the meta device).

    python scripts/build_catalog.py            # rewrite the catalog
    python scripts/build_catalog.py --check    # exit 1 if a stored spec is stale

The `config` blocks are the hand-checked numbers (see each entry's `source`); `spec` is derived, never edited.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

from memplan.inputs.hf import spec_from_config

CATALOG = Path(__file__).resolve().parent.parent / "src" / "memplan" / "inputs" / "catalog.json"
ENTRY_KEYS = ("name", "hf_id", "aliases", "source", "config", "spec")


def build_spec(entry: dict) -> dict:
    spec = spec_from_config(entry["config"], entry["name"], hf_id=entry["hf_id"])
    return spec.model_dump(mode="json")


def dumps(doc: dict) -> str:
    """indent=1 JSON, but short innermost lists/objects (shapes, param rows) on one line: one row per line."""
    text = json.dumps(doc, indent=1, ensure_ascii=False)
    flat = lambda m: re.sub(r"\s*\n\s*", " ", m.group(0)).replace("[ ", "[").replace(" ]", "]").replace("{ ", "{").replace(" }", "}")
    text = re.sub(r"\[[^\[\]{}]*\]", flat, text)  # innermost lists, e.g. shapes
    text = re.sub(r"\{[^{}]*\}", lambda m: flat(m) if len(flat(m)) <= 200 else m.group(0), text)  # param rows
    return text + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only report stale specs")
    args = ap.parse_args()

    doc = json.loads(CATALOG.read_text())
    stale = []
    for entry in doc["models"]:
        spec = build_spec(entry)
        if entry.get("spec") != spec:
            stale.append(entry["name"])
        entry["spec"] = spec
        print(f"{entry['name']:<16} {sum(p['count'] * _prod(p['shape']) for p in spec['params']):>16,}", file=sys.stderr)
    doc["models"] = [{k: e[k] for k in ENTRY_KEYS} for e in doc["models"]]
    if args.check:
        print("stale: " + (", ".join(stale) or "none"))
        return 1 if stale else 0

    # Atomic rewrite: a crash mid-write must never leave a truncated catalog behind.
    fd, tmp = tempfile.mkstemp(dir=CATALOG.parent, prefix=".catalog.", suffix=".json")
    with os.fdopen(fd, "w") as f:
        f.write(dumps(doc))
    os.chmod(tmp, 0o644)  # mkstemp makes 0600; the catalog is package data everyone reads
    os.replace(tmp, CATALOG)
    print(f"wrote {CATALOG} ({len(doc['models'])} models; changed: {', '.join(stale) or 'none'})", file=sys.stderr)
    return 0


def _prod(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    sys.exit(main())
