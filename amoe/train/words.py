"""How much of a text is English: the share of its words found in a dictionary (Debian's wamerican list)."""

from __future__ import annotations

import re
from pathlib import Path

from amoe.errors import ConfigError

# Debian's wamerican package (SCOWL's American English list, size 50).
DICTIONARY = Path("/usr/share/dict/american-english")
_WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)*")


def load_dictionary(path: Path = DICTIONARY) -> frozenset[str]:
    try:
        return frozenset(path.read_text(encoding="utf-8").split())
    except OSError as e:
        raise ConfigError(
            f"{path}: {e.strerror} (install Debian's wamerican: apt-get install wamerican)"
        ) from None


def words(text: str) -> list[str]:
    return _WORD.findall(text)


def dictionary_fraction(text: str, dictionary: frozenset[str]) -> float:
    """Share of the words of `text` that are dictionary words, as written or lower-cased (0 for no words)."""
    found = words(text)
    if not found:
        return 0.0
    return sum(w in dictionary or w.lower() in dictionary for w in found) / len(found)


def served_completion(base_url: str, prompt: str, max_tokens: int) -> str:
    """A server's greedy completion of `prompt` (OpenAI completions API, the first model it lists)."""
    import httpx

    try:
        with httpx.Client(base_url=base_url.rstrip("/"), timeout=120) as client:
            model = client.get("/v1/models").raise_for_status().json()["data"][0]["id"]
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            return client.post("/v1/completions", json=body).raise_for_status().json()["choices"][0]["text"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"{base_url}: no completion: {e}") from None
