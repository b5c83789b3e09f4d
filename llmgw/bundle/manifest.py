"""A bundle's manifest: everything an air-gapped cluster would otherwise download, each
file with its size and sha256, and what the files are (llmgw's release, engine builds,
model files pinned by revision).

The manifest is JSON, encoded one way only (:func:`encode`: keys sorted, no spaces), and
those exact bytes are what the bundle's signature covers and what an operator's carried
sha256 is of. A bundle on disk (a directory, or a tar of one):

    manifest.json        the manifest
    manifest.sig         its Ed25519 signature (signing.py)
    files/<path>         every file the manifest lists, at its path

Paths are relative, ``/``-separated, and every element is a plain name (:func:`check_path`)
checked before any path is built from it: no ``..``, nothing starting with a dot (the
mirror keeps its own files dotted), no empty element, no backslash.

    llmgw/<version>/<file>                          llmgw's wheels, or its Nix cache
    engines/<engine>/<version>/<file>               an engine's archives or wheels
    models/<org>/<name>/<revision>/<path>           a model's files at one revision
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Literal

import msgspec

FORMAT = 1
MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
FILES = "files"
# How deep a path may go, and how long it may be: a model repository's own folders fit.
MAX_DEPTH = 16
MAX_PATH = 1024

_ELEMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+=@-]{0,254}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
# The folder under llmgw/<version>/ that holds a Nix binary cache.
NIX_CACHE = "nix"
# A Nix store path: Nix's base-32 hash (no e, o, t, u), then a name of Nix's characters.
_STORE_PATH = re.compile(
    r"/nix/store/([0-9a-df-np-sv-z]{32})-[A-Za-z0-9+_?=-][A-Za-z0-9+._?=-]{0,210}")
# `nix key convert-secret-to-public`: NAME:base64 of an Ed25519 public key (32 bytes).
_NIX_PUBLIC_KEY = re.compile(r"[A-Za-z0-9._+=@-]{1,128}:[A-Za-z0-9+/]{43}=")


class BundleError(Exception):
    """A bundle that cannot be used; the message says what is wrong and what to do."""


class _Struct(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class BundleFile(_Struct, kw_only=True):
    path: str
    size: int
    sha256: str


class LlmgwRelease(_Struct, kw_only=True):
    """llmgw itself: its wheels (``uv.lock``'s, per platform) or its Nix closure as a
    binary cache (under ``llmgw/<version>/nix``) signed with ``nix_public_key``, whose
    ``roots`` are the store paths to copy out of it."""

    version: str
    kind: Literal["wheels", "nix"]
    files: list[str] = []
    platforms: list[str] = []
    nix_public_key: str = ""
    roots: list[str] = []


class EngineBuild(_Struct, kw_only=True):
    """One engine version's files: llama.cpp's archives per build variant, or a Python
    engine's wheels with the ``--require-hashes`` list that installs them."""

    name: str
    version: str
    files: list[str] = []


class ModelFiles(_Struct, kw_only=True):
    """A model's files at one revision (a commit): ``repo`` is ORG/NAME on the hub."""

    name: str
    repo: str
    revision: str
    files: list[str] = []


class Manifest(_Struct, kw_only=True):
    format: int = FORMAT
    # The llmgw release the bundle is made for; an import refuses an older bundle than
    # the mirror holds (by created_at) unless asked to go back.
    llmgw_version: str
    created_at: datetime
    expires_at: datetime
    # signing.key_id of the key that signed it.
    key_id: str
    llmgw: LlmgwRelease | None = None
    engines: list[EngineBuild] = []
    models: list[ModelFiles] = []
    files: list[BundleFile] = []


_ENCODER = msgspec.json.Encoder(order="sorted")


def encode(manifest: Manifest) -> bytes:
    """The manifest's one encoding: what is signed and what its sha256 is of."""
    return _ENCODER.encode(manifest)


def decode(data: bytes, source: str = MANIFEST) -> Manifest:
    """Read and check a manifest: its format, every path, every sha256, that each entry's
    files are listed once and that nothing is listed twice."""
    try:
        manifest = msgspec.json.decode(data, type=Manifest)
    except msgspec.ValidationError as err:
        raise BundleError(f"{source}: not a bundle manifest: {err}") from None
    except msgspec.DecodeError as err:
        raise BundleError(f"{source}: not valid JSON: {err}") from None
    if manifest.format != FORMAT:
        raise BundleError(f"{source}: format {manifest.format}; this llmgw reads format "
                          f"{FORMAT}: make the bundle with a matching llmgw")
    listed: set[str] = set()
    for entry in manifest.files:
        check_path(entry.path)
        if entry.path in listed:
            raise BundleError(f"{source}: {entry.path} is listed twice")
        if entry.size < 0 or not _SHA256.fullmatch(entry.sha256):
            raise BundleError(f"{source}: {entry.path}: size and sha256 (64 hex digits, "
                              "lower case) are required")
        listed.add(entry.path)
    parts: list[tuple[str, list[str]]] = []
    if manifest.llmgw is not None:
        check_element(manifest.llmgw.version, "llmgw version")
        _check_release(manifest.llmgw, source)
        parts.append((f"llmgw {manifest.llmgw.version}", manifest.llmgw.files))
    for engine in manifest.engines:
        check_element(engine.name, "engine name")
        check_element(engine.version, f"{engine.name} version")
        parts.append((f"{engine.name} {engine.version}", engine.files))
    for model in manifest.models:
        for element in model.repo.split("/"):
            check_element(element, f"model {model.name}'s repository")
        if model.repo.count("/") != 1:
            raise BundleError(f"{source}: model {model.name}: repo {model.repo!r} is not "
                              "ORG/NAME")
        check_element(model.revision, f"model {model.name}'s revision")
        parts.append((f"model {model.name}", model.files))
    for what, files in parts:
        for path in files:
            if path not in listed:
                raise BundleError(f"{source}: {what} names {path}, which the manifest's "
                                  "file list does not have")
    return manifest


def _check_release(release: LlmgwRelease, source: str) -> None:
    """A Nix closure has a Nix public key and roots, each with its narinfo in the bundle;
    wheels have neither."""
    what = f"{source}: llmgw {release.version}"
    if release.kind != "nix":
        if release.roots or release.nix_public_key:
            raise BundleError(f"{what}: roots and nix_public_key belong to a Nix closure "
                              f"(kind nix), not to {release.kind}")
        return
    if not _NIX_PUBLIC_KEY.fullmatch(release.nix_public_key):
        raise BundleError(f"{what}: nix_public_key {release.nix_public_key!r} is not a Nix "
                          "public key (NAME:base64 of 32 bytes)")
    if not release.roots:
        raise BundleError(f"{what}: a Nix closure names its roots (the store paths to copy)")
    for root in release.roots:
        hash_part = check_store_path(root, f"{what}: root")
        narinfo = f"llmgw/{release.version}/{NIX_CACHE}/{hash_part}.narinfo"
        if narinfo not in release.files:
            raise BundleError(f"{what}: the root {root} has no {narinfo} in the bundle")


def check_store_path(path: str, what: str = "store path") -> str:
    """A Nix store path (/nix/store/<hash>-<name>), which is never a bundle path; its hash
    part, which names its narinfo in a binary cache."""
    match = _STORE_PATH.fullmatch(path)
    if not match:
        raise BundleError(f"{what} {path!r} is not a Nix store path (/nix/store/HASH-NAME)")
    return match[1]


def check_element(name: str, what: str) -> str:
    """One plain path element: letters, digits and ``._+=@-``, not starting with a dot."""
    if not _ELEMENT.fullmatch(name):
        raise BundleError(f"{what} {name!r} is not one plain path element (letters, digits "
                          "and ._+=@-, not starting with a dot)")
    return name


def check_path(path: str) -> str:
    """A relative path of plain elements (:func:`check_element`), at most MAX_DEPTH deep."""
    if not path or len(path) > MAX_PATH or path.startswith("/") or "\\" in path:
        raise BundleError(f"{path!r} is not a relative path of at most {MAX_PATH} "
                          "characters")
    elements = path.split("/")
    if len(elements) > MAX_DEPTH:
        raise BundleError(f"{path!r} is more than {MAX_DEPTH} folders deep")
    for element in elements:
        check_element(element, f"{path!r}: the element")
    return path


def engine_path(engine: str, version: str, file: str) -> str:
    return check_path(f"engines/{engine}/{version}/{file}")


def model_path(repo: str, revision: str, file: str) -> str:
    return check_path(f"models/{repo}/{revision}/{file}")


def llmgw_path(version: str, file: str) -> str:
    return check_path(f"llmgw/{version}/{file}")
