"""What `llmgw store migrate-to-postgres --install` decides before it runs anything: which
package manager, which packages, which names; and where it asks the server for /healthz."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from llmgw import pki
from llmgw.agent.install.ospkg import PackageManager
from llmgw.cli.gateway_unit import health_url
from llmgw.cli.pg_setup import check_name, install_commands, package_manager
from llmgw.config import Listen, ServerConfig, ServerTls
from llmgw.store import StoreError


def test_nixos_is_told_to_declare_postgresql() -> None:
    with pytest.raises(StoreError) as refused:
        package_manager({"ID": "nixos", "PRETTY_NAME": "NixOS 25.05"})
    assert str(refused.value) == (
        "this is NixOS: set services.postgresql (with ensureDatabases and ensureUsers) in "
        "the configuration, then give --url instead of --install")


@pytest.mark.parametrize("release", [
    {"ID": "arch", "PRETTY_NAME": "Arch Linux"},
    {"ID": "opensuse-leap", "ID_LIKE": "suse opensuse", "PRETTY_NAME": "openSUSE Leap 15.6"},
])
def test_other_families_are_told_to_give_a_url(release: dict[str, str]) -> None:
    with pytest.raises(StoreError) as refused:
        package_manager(release)
    assert str(refused.value) == (
        f"--install knows apt-get (Debian, Ubuntu) and dnf (Fedora, RHEL), not "
        f"{release['PRETTY_NAME']}: install PostgreSQL, make a role and a database, and "
        "give --url")


def test_the_packages_of_each_family() -> None:
    apt = PackageManager("apt-get", "debian", "/usr/bin/apt-get", "/usr/bin/dpkg-query")
    dnf = PackageManager("dnf", "rhel", "/usr/bin/dnf", "/usr/bin/rpm")
    assert install_commands(apt) == [
        ["/usr/bin/apt-get", "update", "-q"],
        ["/usr/bin/apt-get", "install", "-y", "-q", "--no-install-recommends", "postgresql"],
    ]
    assert install_commands(dnf) == [
        ["/usr/bin/dnf", "install", "-y", "-q", "postgresql-server", "postgresql"]]


@pytest.mark.parametrize("name", ["llmgw", "_x1", "a" * 63])
def test_names_written_as_they_are(name: str) -> None:
    assert check_name("--role", name) == name


@pytest.mark.parametrize("name", ["LLMGW", "1x", "a-b", 'x"; DROP ROLE postgres; --', "a" * 64, ""])
def test_names_that_would_need_quoting_are_refused(name: str) -> None:
    with pytest.raises(StoreError, match="is not a name --install makes"):
        check_name("--role", name)


@pytest.mark.parametrize(("host", "url"), [
    ("127.0.0.1", "http://127.0.0.1:9000/healthz"),
    ("0.0.0.0", "http://127.0.0.1:9000/healthz"),
    ("::", "http://[::1]:9000/healthz"),
    ("10.1.2.3", "http://10.1.2.3:9000/healthz"),
])
def test_the_health_url_is_the_listener_seen_from_here(host: str, url: str) -> None:
    config = ServerConfig(listen=Listen(host=host, port=9000, allow_plain_http=True))
    assert health_url(config) == (url, None)


def test_over_tls_the_cluster_ca_vouches_for_the_server(tmp_path: Path) -> None:
    _, ca_pem = pki.create_ca()
    (tmp_path / "ca.pem").write_bytes(ca_pem)
    tls = ServerTls(ca_file=str(tmp_path / "ca.pem"), ca_key_file="k", cert_file="c",
                    key_file="k")
    url, context = health_url(ServerConfig(listen=Listen(host="0.0.0.0", port=8080), tls=tls))
    assert url == "https://127.0.0.1:8080/healthz"
    assert context.verify_mode == ssl.CERT_REQUIRED and not context.check_hostname
    assert len(context.get_ca_certs()) == 1
