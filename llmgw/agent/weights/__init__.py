"""Model weights on a node: which complete weights its directories hold, and fetching the
missing ones from a Hugging Face-style hub.

A model's weights are one directory holding the files and ``llmgw-manifest.json``, which
names the key (see core.weights) and every file with its size and checksum. Weights are
*complete* only when every listed file is there with that size and checksum: an empty
directory and a half-finished download look alike, and placement must never be sent to
either. Fetched weights live at ``<weights dir>/<directory_name(key)>``; weights placed by
hand may sit in any direct subdirectory, with a manifest ``llmgw weights manifest`` wrote.

Concurrency: ``scan()`` and ``find()`` are synchronous and may hash gigabytes, so the agent
runs them in a thread; digests are cached by (path, size, mtime_ns, inode), so a scan
repeated every minute reads nothing that did not change. ``ensure()`` runs on the event
loop, one fetch per key at a time; disk writes and hashing go to a thread in chunks of at
most ``CHUNK`` bytes. A fetch writes into ``.partial-<name>-<random>`` beside its final
place and renames it in only when every file checked out, so a failure of any kind leaves
nothing behind and touches nothing that was complete.

The package: ``manifest`` (the manifest format, path checks, hashing and completeness),
``fetch`` (the hub: listing, downloading, free space, progress) and ``store``
(``WeightsStore``, which ties them together).
"""

from llmgw.agent.weights.fetch import MAX_FILES
from llmgw.agent.weights.manifest import (
    CHUNK,
    MANIFEST,
    MANIFEST_VERSION,
    Manifest,
    ManifestFile,
    WeightsError,
    check_path,
    model_path,
    read_manifest,
    write_manifest,
)
from llmgw.agent.weights.store import PARTIAL_PREFIX, WeightsStore

__all__ = [
    "CHUNK",
    "MANIFEST",
    "MANIFEST_VERSION",
    "MAX_FILES",
    "PARTIAL_PREFIX",
    "Manifest",
    "ManifestFile",
    "WeightsError",
    "WeightsStore",
    "check_path",
    "model_path",
    "read_manifest",
    "write_manifest",
]
