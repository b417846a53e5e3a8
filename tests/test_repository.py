"""Repository hygiene: no merge-conflict markers in any tracked text file."""

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^(<<<<<<< |>>>>>>> |=======$)", re.MULTILINE)
SUFFIXES = {".py", ".md", ".cpp", ".h", ".cu", ".txt", ".toml", ".cfg", ".sh", ".in", ""}


def _files():
    try:
        names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        paths = [ROOT / name for name in names.splitlines()]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file under the root
        paths = [p for p in ROOT.rglob("*") if ".git" not in p.parts and "build" not in p.parts]
    return [p for p in paths if p.is_file() and p.suffix in SUFFIXES]


def test_no_merge_conflict_markers():
    found = []
    for path in _files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for match in MARKER.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(f"{path.relative_to(ROOT)}:{line}: {match.group(0)!r}")
    assert not found, "merge-conflict markers left in tracked files:\n" + "\n".join(found)
