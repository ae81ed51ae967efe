"""The default model's corpus: the King James Bible from Debian's pinned bible-kjv packages, split into chapters.

The text is public domain (the 1611 translation; in the United Kingdom the Crown's letters patent still govern
printing it). Debian ships it compressed for its `bible` program, so the packages are fetched with
`apt-get download` (no root needed), checked against pinned hashes, unpacked with `dpkg -x` and read out by their
own program: the same packages give the same text, checked by its hash too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from amoe import envs
from amoe.errors import ConfigError

logger = logging.getLogger(__name__)

# (package, version, sha256 of the .deb): Debian bookworm's bible-kjv 4.38 (GPL-2+ program, public-domain text).
PACKAGES = (
    ("bible-kjv", "4.38", "75a49c032a6efa9faa2beb4a9acb70974380122906329d0e100de36cc88ff02d"),
    ("bible-kjv-text", "4.38", "d61b6aad4c51ba9e2800b825325fa6a09e99a0d02a9bb6dc4724fcc4995a1b7a"),
)
# What the program prints for every verse, Genesis 1:1 to Revelation 22:21, one reference and verse a line.
TEXT_SHA256 = "cd45f0c9cedab8e4439bd6486c8952c77cc8b0ecc5d1f6ae3513f2039f47229d"
_WHOLE_BIBLE = "gen1:1-rev22:21"
_VERSE = re.compile(r"^(?P<book>\d?[A-Za-z]+)(?P<chapter>\d+):(?P<verse>\d+) (?P<text>.*)$")
# Every HELD_OUT_EVERY-th chapter (counted through the whole Bible from the first) is held out of training.
HELD_OUT_EVERY = 20


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Chapters as plain prose (one chapter's verses joined by spaces), split into training and held-out."""

    train: list[str]
    held_out: list[str]


def load_corpus(cache_dir: Path | None = None) -> Corpus:
    """The corpus, fetched and unpacked on first use under the cache directory, split into chapters."""
    chapters = split_chapters(bible_text(cache_dir or envs.AMOE_CACHE_DIR / "corpus"))
    held = [c for i, c in enumerate(chapters) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    train = [c for i, c in enumerate(chapters) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    return Corpus(train=train, held_out=held)


def split_chapters(text: str) -> list[str]:
    """One string per chapter, its verses joined by single spaces, references dropped."""
    chapters: list[list[str]] = []
    current = None
    for line in text.splitlines():
        match = _VERSE.match(line)
        if match is None:
            raise ConfigError(f"corpus: unexpected line {line[:60]!r}")
        key = (match["book"], match["chapter"])
        if key != current:
            chapters.append([])
            current = key
        chapters[-1].append(match["text"].strip())
    return [" ".join(verses) for verses in chapters]


def bible_text(cache_dir: Path) -> str:
    """The whole text as the pinned packages' `bible` program prints it, cached after the first read."""
    text_file = cache_dir / f"kjv-{PACKAGES[0][1]}.txt"
    if not text_file.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
            text = _read_packages(Path(tmp))
            part = Path(tmp) / text_file.name
            part.write_text(text, encoding="utf-8")
            part.replace(text_file)  # atomic: a reader never sees half the text
    text = text_file.read_text(encoding="utf-8")
    digest = hashlib.sha256(text.encode()).hexdigest()
    if digest != TEXT_SHA256:
        raise ConfigError(
            f"corpus: {text_file} has sha256 {digest}, expected {TEXT_SHA256}; delete it to refetch"
        )
    return text


def _read_packages(work: Path) -> str:
    for tool in ("apt-get", "dpkg"):
        if shutil.which(tool) is None:
            raise ConfigError(f"corpus: needs Debian's {tool} to fetch the bible-kjv packages")
    root = work / "root"
    for name, version, sha256 in PACKAGES:
        deb = _download(work, name, version)
        digest = hashlib.sha256(deb.read_bytes()).hexdigest()
        if digest != sha256:
            raise ConfigError(f"corpus: {deb.name} has sha256 {digest}, expected {sha256}")
        _run(["dpkg", "-x", str(deb), str(root)], work)
    logger.info("[train] reading the King James text out of bible-kjv %s", PACKAGES[0][1])
    program = root / "usr" / "bin" / "bible"
    # -f: no pretty-printing (one "Ge1:1 text" line per verse); -p: the unpacked data, not /usr/lib's.
    return _run([str(program), "-f", "-p", str(root / "usr" / "lib"), _WHOLE_BIBLE], work)


def _download(work: Path, name: str, version: str) -> Path:
    _run(["apt-get", "download", f"{name}={version}"], work)
    found = sorted(work.glob(f"{name}_*.deb"))
    if len(found) != 1:
        raise ConfigError(f"corpus: apt-get download {name}={version} left {len(found)} .deb files")
    return found[0]


def _run(cmd: list[str], cwd: Path) -> str:
    try:
        done = subprocess.run(
            cmd, cwd=cwd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"corpus: {cmd[0]} failed: {e}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        hint = " (run `apt-get update` first?)" if cmd[0] == "apt-get" else ""
        raise ConfigError(f"corpus: {' '.join(cmd[:3])} exited {done.returncode}: {last}{hint}")
    return done.stdout
