"""``llmgw bundle`` as an operator runs it: keygen, create (a tar) on the connected side,
verify and import on the control plane; refusals exit 2 with one line that says what was
wrong, and leave the mirror as it was."""

from __future__ import annotations

import hashlib
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

from llmgw.bundle import mirror, signing
from tests.bundle.conftest import BUILDS, GGUF, LLMGW_VERSION, REPO, VERSION, snapshot


def llmgw(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmgw", "bundle", *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def server_yaml(path: Path, state_dir: Path, trusted: list[str]) -> Path:
    keys = "".join(f"    - {line}\n" for line in trusted)
    path.write_text(f"state_dir: {state_dir}\nbundle:\n  trusted_keys:\n{keys}"
                    if trusted else f"state_dir: {state_dir}\n")
    return path


def test_keygen_writes_a_private_key_and_prints_its_public_line(tmp_path):
    key = tmp_path / "signing.pem"
    made = llmgw("keygen", key)
    assert made.returncode == 0, made.stderr
    line = made.stdout.strip()
    assert line.startswith("llmgw-bundle-ed25519:")
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    public = signing.load_private_key(key).public_key()
    assert signing.public_line(public) == line
    assert f"key {signing.key_id(public)}" in made.stderr

    again = llmgw("keygen", key)
    assert again.returncode == 2
    assert again.stderr.strip() == (f"llmgw bundle keygen: {key} exists; llmgw never replaces "
                                    "a signing key: choose another file, or remove that one "
                                    "if it is no longer needed")
    assert signing.public_line(signing.load_private_key(key).public_key()) == line


def test_create_verify_and_import_through_the_cli(parts, tmp_path):
    out = tmp_path / "bundle.tar"
    made = llmgw("create", out, "--tar", "--key", parts.key,
                 "--engine", f"llama.cpp@{VERSION}", *[a for b in BUILDS for a in ("--build", b)],
                 "--release-url", parts.release_url,
                 "--model", f"smollm2=hf://{REPO}:*.gguf", "--hub", parts.hub.url,
                 "--wheels", parts.wheels, "--llmgw-version", LLMGW_VERSION,
                 "--expires-in", "30d")
    assert made.returncode == 0, made.stderr
    with tarfile.open(out) as tar:
        manifest = tar.extractfile("manifest.json").read()  # type: ignore[union-attr]
    sha = hashlib.sha256(manifest).hexdigest()
    key_id = signing.key_id(signing.load_public_key(parts.trusted))
    assert made.stdout.splitlines() == [f"manifest sha256 {sha}", f"key id {key_id}"]
    assert "carry the manifest's sha256 apart" in made.stderr

    good = llmgw("verify", out, "--trusted-key", parts.trusted, "--sha256", sha)
    assert good.returncode == 0, good.stderr
    assert good.stdout.startswith(f"{out}: good: signed by key {key_id}")
    assert f"llama.cpp {VERSION} (2 files)" in good.stdout
    assert f"model smollm2: {REPO}@" in good.stdout

    wrong = llmgw("verify", out, "--trusted-key", parts.trusted, "--sha256", "1" * 64)
    assert wrong.returncode == 2
    assert wrong.stderr == (f"llmgw bundle verify: the manifest's sha256 is {sha}, not the "
                            f"{'1' * 64} you carried: this is not the bundle that was made\n")

    state = tmp_path / "state"
    config = server_yaml(tmp_path / "server.yaml", state, [parts.trusted])
    imported = llmgw("import", out, "--config", config, "--sha256", sha)
    assert imported.returncode == 0, imported.stderr
    folder = state / "mirror"
    assert imported.stdout.startswith(f"{folder}: imported bundle ")
    assert f"llmgw {LLMGW_VERSION} (wheels, 2 files)" in imported.stdout
    current = mirror.current_manifest(folder)
    assert current is not None and hashlib.sha256(
        (folder / "current" / "manifest.json").read_bytes()).hexdigest() == sha
    [model] = current.models
    assert mirror.file_path(folder, model.files[0]).read_bytes() == parts.model_files[GGUF]

    same = llmgw("import", out, "--config", config)
    assert same.returncode == 0 and "already the current one; nothing changed" in same.stdout


def test_refusals_exit_2_with_one_line_and_leave_the_mirror_as_it_was(
        parts, made, bundle, mirror_dir, tmp_path):
    config = server_yaml(tmp_path / "server.yaml", tmp_path / "state", [parts.trusted])
    # The configured mirror is the one the fixture filled.
    config.write_text(config.read_text() + f"  mirror_dir: {mirror_dir}\n")
    before = snapshot(mirror_dir)
    damaged = bundle
    gguf = next((damaged / "files").rglob(GGUF))
    gguf.write_bytes(gguf.read_bytes()[:-1] + b"!")

    bad = llmgw("import", damaged, "--config", config)
    assert bad.returncode == 2
    [line] = bad.stderr.splitlines()
    assert line.startswith(f"llmgw bundle import: {damaged}: files/models/{REPO}/")
    assert line.endswith(f"the file was changed or damaged (the mirror {mirror_dir} is "
                         "unchanged)")
    assert snapshot(mirror_dir) == before

    untrusted = server_yaml(tmp_path / "untrusted.yaml", tmp_path / "state", [])
    nokey = llmgw("verify", made.path, "--config", untrusted)
    assert nokey.returncode == 2
    assert nokey.stderr.startswith("llmgw bundle verify: no key is trusted: list the bundle "
                                   "signer's public key in server.yaml's bundle.trusted_keys")

    unpinned = llmgw("create", tmp_path / "x", "--key", parts.key, "--engine",
                     "comfyui@0.3.0")
    assert unpinned.returncode == 2
    assert "GitHub publishes no digest for ComfyUI's tag archive v0.3.0.tar.gz, so it " \
           "cannot be checked without one: give --engine-sha256 v0.3.0.tar.gz=SHA256" \
           in unpinned.stderr
    assert not (tmp_path / "x").exists()
