"""Naming model weights: where a profile's weights come from, and the key that says a
node holds them.

A profile names a source, a Hugging Face-style repository:

- ``hf://ORG/NAME`` or ``hf://ORG/NAME@REVISION``: fetched from the agent's hub (the
  public hub, or the offline mirror an air-gapped cluster points its agents at);
- ``https://HOST/ORG/NAME`` (optionally ``/tree/REVISION``): that host's repository.

and optionally ``files``, glob patterns of the files it needs (a GGUF repository holds a
dozen quantisations; a profile wants one). The *key* names what is held, independently of
the host it came from, so a copy fetched through the mirror counts the same as one from
the hub: ``ORG/NAME@REVISION`` plus the patterns when there are any. A profile without a
source keys its weights by the model's name, which an operator writes in the manifest of
weights placed by hand.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

_REPO_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")
_PATTERN = re.compile(r"[A-Za-z0-9._*?\[\]/-]{1,200}")
DEFAULT_REVISION = "main"


class SourceError(ValueError):
    """A weights source or file pattern that cannot be used; the message says how to fix it."""


@dataclass(frozen=True, slots=True)
class Source:
    repo: str  # ORG/NAME
    revision: str = DEFAULT_REVISION
    # The repository's host (scheme://host[:port]); None means the agent's configured hub.
    endpoint: str | None = None


def _check_repo(repo: str, text: str) -> str:
    parts = repo.split("/")
    if len(parts) != 2 or not all(_REPO_PART.fullmatch(p) for p in parts) or ".." in repo:
        raise SourceError(
            f"weights source {text!r}: the repository must be ORG/NAME (letters, digits, "
            "._-), for example hf://Qwen/Qwen2.5-0.5B-Instruct"
        )
    return repo


def _check_revision(revision: str, text: str) -> str:
    if not _REVISION.fullmatch(revision) or ".." in revision:
        raise SourceError(
            f"weights source {text!r}: revision {revision!r} is not a branch, tag or commit"
        )
    return revision


def parse_source(text: str) -> Source:
    """``hf://ORG/NAME[@REV]`` or ``http(s)://HOST/ORG/NAME[/tree/REV]`` -> Source."""
    if text.startswith("hf://"):
        repo, _, revision = text[len("hf://"):].partition("@")
        return Source(_check_repo(repo, text), _check_revision(revision or DEFAULT_REVISION,
                                                               text))
    parts = urlsplit(text)
    if parts.scheme in ("http", "https") and parts.hostname:
        if parts.query or parts.fragment or parts.username or parts.password:
            raise SourceError(f"weights source {text!r}: write the repository URL without "
                              "credentials, query or fragment (a token goes in agent.yaml)")
        segments = [s for s in parts.path.split("/") if s]
        revision = DEFAULT_REVISION
        if len(segments) >= 4 and segments[2] == "tree":
            revision = "/".join(segments[3:])
            segments = segments[:2]
        if len(segments) != 2:
            raise SourceError(
                f"weights source {text!r}: expected https://HOST/ORG/NAME, for example "
                "https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct"
            )
        repo = "/".join(segments)
        return Source(_check_repo(repo, text), _check_revision(revision, text),
                      f"{parts.scheme}://{parts.netloc}")
    raise SourceError(
        f"weights source {text!r}: use hf://ORG/NAME[@REVISION] or a repository URL "
        "https://HOST/ORG/NAME"
    )


def check_patterns(patterns: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    for pattern in patterns:
        if not _PATTERN.fullmatch(pattern) or ".." in pattern or pattern.startswith("/"):
            raise SourceError(
                f"file pattern {pattern!r} is not allowed: use a relative glob of letters, "
                "digits and ._-*?[]/, for example '*Q4_K_M.gguf'"
            )
    return tuple(sorted(set(patterns)))


def weights_key(source: Source, patterns: tuple[str, ...] = ()) -> str:
    """What a node reports when it holds these weights: host-independent."""
    key = f"{source.repo}@{source.revision}"
    return f"{key}[{','.join(sorted(patterns))}]" if patterns else key


def directory_name(key: str) -> str:
    """The directory a key is kept in, below a weights directory: one safe path element,
    readable, and distinct for every key."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "--", key.split("[", 1)[0]).strip("-.")[:100]
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return f"{readable or 'weights'}--{digest}"
