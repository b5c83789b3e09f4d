"""The release before this one, run beside the current code by the upgrade tests.

``PREVIOUS`` is commit f1b6077 (4 December 2026), the last before the leader's lease
(d53ad37): the newest commit whose llmgw/wire.py and migrations both differ from the
current ones. Its agent knows no leader term on Welcome, StartShard or StopShard; its
server knows no leases table (migration 0005) and elects no leader. When a release is cut,
move the pin to the newest commit whose wire.py or migrations differ from the new
release's, so that the tests cross what changed.

Its code comes from git (``git archive``), so these tests need the repository's history:
a clone, not a source tarball or a shallow clone. Without it they fail under CI=true and
are skipped elsewhere, as the PostgreSQL tests are (tests/pg.py).
"""

from __future__ import annotations

import compileall
import io
import subprocess
import sys
import tarfile
import types
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.integration.cluster import Cluster, _start, wait_for
from tests.pg import postgres_required

PREVIOUS = "f1b6077a29e7f21f3596260cc68a97445b08aca4"
ROOT = Path(__file__).resolve().parents[2]
# Runs under the previous release's code: only what that release has may be used there.
STORE_SCRIPT = Path(__file__).resolve().parent / "old_release_store.py"


def _git(*args: str) -> bytes:
    try:
        return subprocess.run(["git", "-C", str(ROOT), *args], check=True,
                              capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", b"").decode(errors="replace").strip() or exc
        reason = (f"the previous release (commit {PREVIOUS[:12]}) is not in this checkout's "
                  f"git history ({detail}); the upgrade tests run it beside the current code: "
                  "run them in a full clone (git fetch --unshallow)")
        if postgres_required():  # CI=true: the history is there, or the run fails
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)


def extract(dest: Path) -> Path:
    """The previous release's llmgw/ and migrations/ under ``dest``, compiled once so that
    each process started from it does not compile it again."""
    archive = _git("archive", "--format=tar", PREVIOUS, "llmgw", "migrations")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    compileall.compile_dir(dest / "llmgw", quiet=1, workers=0)
    return dest


def previous_wire() -> types.ModuleType:
    """The previous release's llmgw/wire.py, as a module of its own."""
    name = "tests.upgrade._previous_wire"
    module = types.ModuleType(name)
    module.__file__ = f"{PREVIOUS[:12]}:llmgw/wire.py"
    # msgspec resolves the Structs' annotations through sys.modules.
    sys.modules[name] = module
    exec(compile(_git("show", f"{PREVIOUS}:llmgw/wire.py"), module.__file__, "exec"),
         module.__dict__)
    return module


def prefix(tree: Path) -> tuple[str, ...]:
    """What runs a command on ``tree``'s code: its directory first on the path, so that
    ``python -m llmgw`` imports it rather than the checkout's (which the environment's
    editable install names)."""
    return ("env", "-C", str(tree), f"PYTHONPATH={tree}")


def run_store_script(tree: Path, *args: str) -> str:
    done = subprocess.run([*prefix(tree), sys.executable, str(STORE_SCRIPT), *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"the previous release's store failed:\n{done.stderr}"
    return done.stdout


@dataclass
class ReleaseCluster(Cluster):
    """A cluster whose server runs the code in ``tree`` (extract()), on a store that code
    made; this checkout's code, as Cluster's, once ``tree`` is None."""

    tree: Path | None = field(kw_only=True)

    def start_server(self) -> None:
        if self.tree is None:
            super().start_server()
            return
        path = self.write_server_config()
        if not self.api_key:
            self.api_key = run_store_script(self.tree, "make-key",
                                            str(self.server_state / "llmgw.db")).strip()
        self.server = _start(["server", "--config", str(path)], self.root / "server.log",
                             prefix(self.tree))
        wait_for(lambda: httpx.get(f"{self.base_url}/healthz").status_code == 200, 30,
                 "the previous release's server to answer /healthz")
        self.admin_token = (self.server_state / "secrets" / "admin-token").read_text().strip()
