"""The server as a systemd unit, for `llmgw store migrate-to-postgres`: whether it runs,
stopping and starting it, and waiting until it answers `/healthz`.

Every call goes through `systemctl` as PATH finds it; that is the one seam, and the tests
put a stand-in first on PATH. Where there is no systemctl, or no systemd behind it, the
unit counts as not running, and the state-directory lock says whether a server runs.
"""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request

from llmgw.config import ServerConfig
from llmgw.core.names import hostport
from llmgw.store import StoreError

SYSTEMCTL_TIMEOUT_S = 300.0  # a stop waits for the unit's own TimeoutStopSec (90 s by default)
HEALTH_TIMEOUT_S = 60.0
_PROBE_TIMEOUT_S = 2.0
_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


class Unit:
    """One systemd unit, by name."""

    def __init__(self, name: str) -> None:
        self.name = name

    def state(self) -> str:
        """`systemctl is-active`'s word ("active", "failed", ...); "absent" without systemctl."""
        if shutil.which("systemctl") is None:
            return "absent"
        done = self._systemctl("is-active", check=False)
        return done.stdout.strip() or "unknown"

    def stop(self) -> None:
        self._systemctl("stop")

    def start(self) -> None:
        self._systemctl("start")

    def _systemctl(self, verb: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        argv = ["systemctl", verb, self.name]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                                  timeout=SYSTEMCTL_TIMEOUT_S, check=False)
        except FileNotFoundError:
            raise StoreError("systemctl is not installed") from None
        except subprocess.TimeoutExpired:
            raise StoreError(f"`{' '.join(argv)}` did not finish in "
                             f"{SYSTEMCTL_TIMEOUT_S:g} s") from None
        if check and done.returncode != 0:
            said = " / ".join(line for line in done.stderr.splitlines() if line.strip())
            raise StoreError(f"`{' '.join(argv)}` failed (exit {done.returncode})"
                             + (f": {said}" if said else ""))
        return done

    def wait_healthy(self, config: ServerConfig, timeout_s: float = HEALTH_TIMEOUT_S) -> str:
        """Wait until the server answers /healthz with status ok (its store answering);
        returns the URL. StoreError at the deadline, or at once when the unit stopped."""
        url, context = health_url(config)
        deadline = time.monotonic() + timeout_s
        while True:
            said = _probe(url, context)
            if said == "ok":
                return url
            state = self.state()
            if state in ("failed", "inactive"):
                raise StoreError(f"{self.name} is {state} again after it was started: see "
                                 f"`journalctl -u {self.name}` for why")
            if time.monotonic() > deadline:
                raise StoreError(f"{self.name} did not answer {url} with status ok within "
                                 f"{timeout_s:g} s ({said})")
            time.sleep(0.25)


def health_url(config: ServerConfig) -> tuple[str, ssl.SSLContext | None]:
    """Where this machine reaches the server's /healthz, and the TLS context for it."""
    listen = config.listen
    host = _WILDCARDS.get(listen.host, listen.host)
    if config.tls is None:
        return f"http://{hostport(host, listen.port)}/healthz", None
    context = ssl.create_default_context(cafile=config.tls.ca_file)
    # The certificate names the addresses agents dial, which a wildcard listener's
    # loopback need not be among; the cluster CA still vouches for the server.
    context.check_hostname = False
    return f"https://{hostport(host, listen.port)}/healthz", context


def _probe(url: str, context: ssl.SSLContext | None) -> str:
    """`ok`, or what the server (or the network) said instead."""
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    try:
        with urllib.request.build_opener(*handlers).open(url, timeout=_PROBE_TIMEOUT_S) as got:
            health = json.loads(got.read(65536))
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return str(getattr(exc, "reason", exc))
    if health.get("status") == "ok":
        return "ok"
    return f"status {health.get('status')!r}, store {health.get('store')!r}"
