"""Weights on disk: what a scan counts as held (complete weights only), the manifest of
weights placed by hand, what an engine is given, and ``llmgw weights``. Real files in a
temporary directory; manifests written here by hand so the reader is checked against an
independent writer."""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from llmgw.agent.weights import (
    MANIFEST,
    WeightsError,
    WeightsStore,
    model_path,
    read_manifest,
    write_manifest,
)
from llmgw.agent.weights.fetch import fraction
from llmgw.cli.weights import main
from llmgw.core.weights import directory_name

KEY = "org/model@main"
FILES = {"config.json": b'{"layers": 2}\n', "weights/model.safetensors": b"w" * 4096}


def git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def place(root: Path, name: str, files: dict[str, bytes], *, key: str = KEY,
          entries: list[dict] | None = None, checksums: str = "sha256") -> Path:
    """Weights as an operator or an earlier fetch leaves them: files plus a manifest
    written here, not by the code under test."""
    d = root / name
    d.mkdir(parents=True)
    for path, data in files.items():
        (d / path).parent.mkdir(parents=True, exist_ok=True)
        (d / path).write_bytes(data)
    if entries is None:
        entries = []
        for path, data in files.items():
            entry = {"path": path, "size": len(data)}
            if checksums in ("sha256", "both"):
                entry["sha256"] = hashlib.sha256(data).hexdigest()
            if checksums in ("git", "both"):
                entry["git_oid"] = git_oid(data)
            entries.append(entry)
    manifest = {"version": 1, "key": key, "source": "", "revision": "main", "files": entries}
    (d / MANIFEST).write_text(json.dumps(manifest))
    return d


def store(*dirs: Path | tuple[Path, bool]) -> WeightsStore:
    return WeightsStore([d if isinstance(d, tuple) else (d, False) for d in dirs])


def only(store_: WeightsStore):
    [result] = store_.scan()
    return result


# --- scan ----------------------------------------------------------------------------------


def test_complete_weights_are_held_with_disk_figures(tmp_path):
    place(tmp_path, "model", FILES)
    place(tmp_path, "other", {"a.bin": b"a"}, key="org/other@v1", checksums="git")
    result = only(store(tmp_path))
    assert result.held == ["org/model@main", "org/other@v1"]
    assert result.note == ""
    assert result.path == str(tmp_path) and result.shared is False
    assert 0 < result.free_mib <= result.total_mib


def test_git_oid_is_the_id_git_gives_the_blob(tmp_path):
    data = b"hello weights\n" * 100
    (tmp_path / "probe").write_bytes(data)
    by_git = subprocess.run(["git", "hash-object", str(tmp_path / "probe")], check=True,
                            capture_output=True, text=True).stdout.strip()
    (tmp_path / "probe").unlink()
    good = place(tmp_path / "w", "good", {"f": data}, key="good",
                 entries=[{"path": "f", "size": len(data), "git_oid": by_git}])
    place(tmp_path / "w", "bad", {"f": data}, key="bad",
          entries=[{"path": "f", "size": len(data), "git_oid": "0" * 40}])
    result = only(store(tmp_path / "w"))
    assert result.held == ["good"]
    assert f"bad: f has git_oid {by_git}, the manifest says {'0' * 40}" in result.note
    assert good.is_dir()


def test_a_missing_file_means_not_held(tmp_path):
    d = place(tmp_path, "qwen--abc", FILES)
    (d / "config.json").unlink()
    result = only(store(tmp_path))
    assert result.held == []
    assert result.note == "qwen--abc: config.json is missing"


def test_a_short_file_means_not_held_and_says_how_short(tmp_path):
    d = place(tmp_path, "qwen--abc", {"model.safetensors": b""},
              entries=[{"path": "model.safetensors", "size": 15_200_000_000}])
    # A sparse file: a half-finished download of a 15.2 GB file, without writing 3 GB.
    with open(d / "model.safetensors", "r+b") as f:
        f.truncate(3_100_000_000)
    result = only(store(tmp_path))
    assert result.held == []
    assert result.note == "qwen--abc: model.safetensors is 3.1 of 15.2 GB"


def test_a_wrong_sha256_means_not_held_and_names_both(tmp_path):
    d = place(tmp_path, "m", FILES)
    (d / "config.json").write_bytes(b'{"layers": 3}\n')  # same size, other content
    result = only(store(tmp_path))
    assert result.held == []
    expected = hashlib.sha256(FILES["config.json"]).hexdigest()
    got = hashlib.sha256(b'{"layers": 3}\n').hexdigest()
    assert result.note == f"m: config.json has sha256 {got}, the manifest says {expected}"


def test_no_manifest_and_empty_directories_are_not_weights(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "model.safetensors").write_bytes(b"w" * 10)
    (tmp_path / ".partial-y-1234").mkdir()  # a fetch in progress: not worth a note
    (tmp_path / "README").write_text("files beside the models are not models")
    result = only(store(tmp_path))
    assert result.held == []
    assert result.note == "half: no manifest; x: no manifest"


def test_an_empty_file_list_is_not_weights(tmp_path):
    place(tmp_path, "m", {}, entries=[])
    assert only(store(tmp_path)).note == "m: the manifest lists no files"


@pytest.mark.parametrize("bad", ["../outside.bin", "/etc/hostname", "a/../../outside.bin",
                                 "a\\b", "a//b", ""])
def test_manifest_paths_that_leave_the_directory_are_refused(tmp_path, bad):
    data = b"outside"
    (tmp_path / "outside.bin").write_bytes(data)
    (tmp_path / "w" / "m" / "a").mkdir(parents=True)
    (tmp_path / "w" / "m" / MANIFEST).write_text(json.dumps({
        "version": 1, "key": "escape", "files": [
            {"path": bad, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}]}))
    result = only(store(tmp_path / "w"))
    assert result.held == []
    assert result.note.startswith("m: the manifest names") and "not a safe relative path" \
        in result.note


def test_a_symlink_out_of_the_directory_is_refused_and_one_inside_is_fine(tmp_path):
    data = b"tensor" * 10
    (tmp_path / "elsewhere.bin").write_bytes(data)
    entry = [{"path": "model.bin", "size": len(data),
              "sha256": hashlib.sha256(data).hexdigest()}]
    out = place(tmp_path / "w", "out", {}, key="out", entries=entry)
    (out / "model.bin").symlink_to(tmp_path / "elsewhere.bin")
    inside = place(tmp_path / "w", "in", {"blobs/abc": data}, key="in", entries=entry)
    (inside / "model.bin").symlink_to("blobs/abc")
    result = only(store(tmp_path / "w"))
    assert result.held == ["in"]
    assert result.note == "out: model.bin leads outside the directory"


@pytest.mark.parametrize("text, why", [
    ("{not json", "is not a valid manifest"),
    (json.dumps({"version": 2, "key": "k", "files": []}), "has version 2"),
    (json.dumps({"version": 1, "key": "k", "files": [{"path": "a", "size": -1}]}),
     "is not a valid manifest"),
    (json.dumps({"version": 1, "key": "k", "files": [{"path": "a", "size": 1,
                                                      "sha256": "XYZ"}]}),
     "is not a valid manifest"),
])
def test_an_invalid_manifest_is_noted(tmp_path, text, why):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / MANIFEST).write_text(text)
    result = only(store(tmp_path))
    assert result.held == []
    assert result.note.startswith(f"m: {MANIFEST} ") and why in result.note


def test_an_unreadable_manifest_is_noted(tmp_path):
    (tmp_path / "m" / MANIFEST).mkdir(parents=True)  # a directory where the file should be
    result = only(store(tmp_path))
    assert result.note == f"m: cannot read {MANIFEST}: Is a directory"


def test_unchanged_files_are_not_hashed_again(tmp_path):
    """The cache is keyed by (path, size, mtime, inode): a same-size rewrite with its mtime
    put back is invisible to it, which proves no second read happened; touching the mtime
    makes the next scan read the file again and see the damage."""
    d = place(tmp_path, "m", FILES)
    s = store(tmp_path)
    assert only(s).held == [KEY]
    target = d / "weights" / "model.safetensors"
    before = target.stat()
    with open(target, "r+b") as f:  # in place: same inode, same size
        f.write(b"X")
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert target.stat().st_ino == before.st_ino
    assert only(s).held == [KEY], "the unchanged (by its stat) file was hashed again"
    assert store(tmp_path).scan()[0].held == [], "a fresh store must read the file"
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns + 1))
    assert only(s).held == []
    assert "weights/model.safetensors has sha256" in only(s).note


def test_directories_keep_their_order_and_shared_flag(tmp_path):
    place(tmp_path / "filer", "m", FILES)
    (tmp_path / "local").mkdir()
    s = store((tmp_path / "local", False), (tmp_path / "filer", True))
    local, filer = s.scan()
    assert (local.path, local.shared, local.held) == (str(tmp_path / "local"), False, [])
    assert (filer.path, filer.shared, filer.held) == (str(tmp_path / "filer"), True, [KEY])


def test_missing_and_unusable_directories_are_noted_not_raised(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    s = store(tmp_path / "missing", tmp_path / "file")
    missing, not_dir = s.scan()
    assert missing.note == f"{tmp_path / 'missing'} does not exist" and missing.held == []
    assert not_dir.note == f"{tmp_path / 'file'} is not a directory"


def test_prepare_creates_directories_and_reports_what_it_could_not(tmp_path):
    (tmp_path / "file").write_text("in the way")
    s = store(tmp_path / "a" / "b", tmp_path / "file" / "sub")
    done = s.prepare()
    assert done == [f"created {tmp_path / 'a' / 'b'}",
                    f"cannot create {tmp_path / 'file' / 'sub'}: Not a directory"]
    assert stat.S_IMODE((tmp_path / "a" / "b").stat().st_mode) == 0o755
    created, failed = s.scan()
    assert created.note == "" and created.total_mib > 0
    assert failed.note == f"cannot create {tmp_path / 'file' / 'sub'}: Not a directory"
    assert s.prepare() == [f"cannot create {tmp_path / 'file' / 'sub'}: Not a directory"]


def test_prepare_never_creates_a_shared_directory_that_is_not_there(tmp_path):
    s = store((tmp_path / "local", False), (tmp_path / "nfs", True))
    note = f"shared directory {tmp_path / 'nfs'} is missing: is the filer mounted?"
    assert s.prepare() == [f"created {tmp_path / 'local'}", note]
    assert not (tmp_path / "nfs").exists()
    assert [d.note for d in s.scan()] == ["", note]


def test_prepare_removes_unfinished_downloads_only_where_no_other_node_writes(tmp_path):
    for d in ("local", "filer"):
        (tmp_path / d / ".partial-m--abc-1234" / "sub").mkdir(parents=True)
    s = store((tmp_path / "local", False), (tmp_path / "filer", True))
    assert s.prepare() == [
        f"removed the unfinished download {tmp_path / 'local' / '.partial-m--abc-1234'}"]
    assert not (tmp_path / "local" / ".partial-m--abc-1234").exists()
    assert (tmp_path / "filer" / ".partial-m--abc-1234").exists()


def test_find_gives_the_first_complete_copy(tmp_path):
    broken = place(tmp_path / "one", directory_name(KEY), FILES)
    (broken / "config.json").unlink()
    by_hand = place(tmp_path / "two", "my-copy", FILES)
    place(tmp_path / "three", directory_name(KEY), FILES)
    s = store(tmp_path / "one", tmp_path / "two", tmp_path / "three", tmp_path / "missing")
    assert s.find(KEY) == by_hand
    assert s.find("org/other@main") is None


# --- write_manifest ------------------------------------------------------------------------


def test_write_manifest_hashes_every_file_and_the_scan_holds_it(tmp_path):
    d = tmp_path / "w" / "my-model"
    for path, data in {**FILES, ".gitattributes": b"*.bin lfs\n",
                       ".git/HEAD": b"ref: main\n", "empty": b""}.items():
        (d / path).parent.mkdir(parents=True, exist_ok=True)
        (d / path).write_bytes(data)
    seen = []
    path = write_manifest(d, "My Model", "hf://org/model@v2",
                          on_file=lambda p, n: seen.append((p, n)))
    assert path == d / MANIFEST
    raw = json.loads(path.read_text())
    assert (raw["version"], raw["key"], raw["source"], raw["revision"]) == \
        (1, "My Model", "hf://org/model@v2", "v2")
    expected = sorted([".gitattributes", "config.json", "empty", "weights/model.safetensors"])
    assert [f["path"] for f in raw["files"]] == expected
    assert [p for p, _ in seen] == expected
    for f in raw["files"]:
        data = (d / f["path"]).read_bytes()
        assert f["size"] == len(data) and f["sha256"] == hashlib.sha256(data).hexdigest()
    assert [p.name for p in d.iterdir() if p.name.endswith(".tmp")] == []
    assert only(store(tmp_path / "w")).held == ["My Model"]
    write_manifest(d, "My Model")  # again: the manifest does not list itself
    assert [f.path for f in read_manifest(d).files] == expected


def test_write_manifest_refuses_links_that_leave_the_directory(tmp_path):
    (tmp_path / "secret").write_text("elsewhere")
    d = tmp_path / "m"
    d.mkdir()
    (d / "a.bin").write_bytes(b"a")
    (d / "link").symlink_to(tmp_path / "secret")
    with pytest.raises(WeightsError, match=r"link links to .*/secret, outside .*copy the file"):
        write_manifest(d, "k")
    assert not (d / MANIFEST).exists()
    (d / "link").unlink()
    (d / "dirlink").symlink_to(tmp_path)
    with pytest.raises(WeightsError, match="dirlink links to"):
        write_manifest(d, "k")


def test_write_manifest_lists_links_inside_the_directory(tmp_path):
    d = tmp_path / "m"
    (d / "blobs").mkdir(parents=True)
    (d / "blobs" / "abc").write_bytes(b"tensor")
    (d / "model.bin").symlink_to("blobs/abc")
    write_manifest(d, "k")
    assert {f.path: f.size for f in read_manifest(d).files} == {"blobs/abc": 6, "model.bin": 6}


@pytest.mark.parametrize("setup, key, source, message", [
    ("empty", "k", "", "holds no files"),
    ("missing", "k", "", "is not a directory"),
    ("file", "", "", "key ''"),
    ("file", "k", "ftp://x/y", "weights source 'ftp://x/y'"),
])
def test_write_manifest_refusals(tmp_path, setup, key, source, message):
    d = tmp_path / "m"
    if setup != "missing":
        d.mkdir()
    if setup == "file":
        (d / "a").write_bytes(b"a")
    with pytest.raises(WeightsError, match=message):
        write_manifest(d, key, source)
    assert not (d / MANIFEST).exists()


# --- model_path ----------------------------------------------------------------------------


def ggufs(tmp_path: Path, *names: str) -> Path:
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    for name in names:
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(b"GGUF")
    return d


def test_model_path_gives_other_engines_the_directory(tmp_path):
    d = ggufs(tmp_path, "a.gguf")
    assert model_path(d, "vllm") == d
    assert model_path(d, "sglang") == d


def test_model_path_gives_llama_cpp_its_gguf(tmp_path):
    d = ggufs(tmp_path, "README.md", "qwen-q4_k_m.gguf", "mmproj-f16.gguf")
    assert model_path(d, "llama.cpp") == d / "qwen-q4_k_m.gguf"


def test_model_path_gives_the_first_part_of_a_split_gguf(tmp_path):
    d = ggufs(tmp_path, "Q4/m-00002-of-00003.gguf", "Q4/m-00001-of-00003.gguf",
              "Q4/m-00003-of-00003.gguf")
    assert model_path(d, "llama.cpp") == d / "Q4" / "m-00001-of-00003.gguf"


def test_model_path_follows_the_manifest_when_there_is_one(tmp_path):
    d = ggufs(tmp_path, "a.gguf", "b.gguf")
    (d / MANIFEST).write_text(json.dumps(
        {"version": 1, "key": "k", "files": [{"path": "b.gguf", "size": 4}]}))
    assert model_path(d, "llama.cpp") == d / "b.gguf"


@pytest.mark.parametrize("names, message", [
    ((), "holds no .gguf file"),
    (("config.json", "model.safetensors"), "holds no .gguf file"),
    (("a-Q4_K_M.gguf", "a-Q8_0.gguf"), r"several GGUF files \(a-Q4_K_M.gguf, a-Q8_0.gguf\)"),
    (("m-00002-of-00002.gguf", "n-00001-of-00002.gguf"), "several GGUF files"),
    (("m-00002-of-00003.gguf", "m-00003-of-00003.gguf"), "without its first part"),
])
def test_model_path_refusals(tmp_path, names, message):
    d = ggufs(tmp_path, *names)
    with pytest.raises(WeightsError, match=message):
        model_path(d, "llama.cpp")


def test_progress_figures():
    assert fraction(3_100_000_000, 15_200_000_000) == "3.1/15.2 GB"
    assert fraction(0, 1_000_000_000) == "0.0/1.0 GB"
    assert fraction(250_000_000, 999_000_000) == "250.0/999.0 MB"


# --- llmgw weights -------------------------------------------------------------------------


def agent_yaml(tmp_path: Path, *dirs: tuple[Path, bool]) -> Path:
    lines = ["servers: [http://127.0.0.1:8080]", "weights:", "  directories:"]
    for d, shared in dirs:
        lines += [f"    - path: {d}", f"      shared: {str(shared).lower()}"]
    path = tmp_path / "agent.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_cli_manifest_then_list(tmp_path, capsys):
    d = tmp_path / "w" / "by-hand"
    d.mkdir(parents=True)
    (d / "model.gguf").write_bytes(b"GGUF" * 100)
    assert main(["weights", "manifest", str(d), "--key", "SmolLM2",
                 "--source", "hf://org/smol@main"]) == 0
    out, err = capsys.readouterr()
    assert f"wrote {d / MANIFEST}: SmolLM2, 1 file, 400 bytes" in out
    assert "hashing model.gguf (400 bytes)" in err
    config = agent_yaml(tmp_path, (tmp_path / "w", False), (tmp_path / "filer", True))
    (tmp_path / "filer").mkdir()
    assert main(["weights", "list", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "SmolLM2" in out and str(tmp_path / "filer") in out and "yes" in out
    assert main(["weights", "list", "--config", str(config), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(d["path"], d["shared"], d["held"]) for d in listed] == [
        (str(tmp_path / "w"), False, ["SmolLM2"]), (str(tmp_path / "filer"), True, [])]


def test_cli_list_exits_1_when_a_directory_has_problems(tmp_path, capsys):
    d = place(tmp_path / "w", "m", FILES)
    (d / "config.json").unlink()
    config = agent_yaml(tmp_path, (tmp_path / "w", False))
    assert main(["weights", "list", "--config", str(config), "--json"]) == 1
    [listed] = json.loads(capsys.readouterr().out)
    assert listed["held"] == [] and listed["note"] == "m: config.json is missing"
    assert main(["weights", "list", "--config", str(config)]) == 1
    assert "config.json is missing" in capsys.readouterr().out


def test_cli_usage_and_config_errors_exit_2(tmp_path, capsys):
    assert main(["weights", "manifest", str(tmp_path)]) == 2  # no --key
    assert main(["weights", "list", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("servers: [http://127.0.0.1:8080]\nweights: {directories: []}\n")
    assert main(["weights", "list", "--config", str(bad)]) == 2
    assert main(["weights", "manifest", str(tmp_path), "--key", "k", "--source", "x"]) == 2
    assert "weights source 'x'" in capsys.readouterr().err


def test_cli_manifest_failure_exits_1(tmp_path, capsys):
    assert main(["weights", "manifest", str(tmp_path / "missing"), "--key", "k"]) == 1
    assert "is not a directory" in capsys.readouterr().err


def _in_a_child_as_nobody(cwd: Path, work: Callable[[], object]) -> object:
    """``work()``'s JSON-able result, computed in a forked child that entered ``cwd`` and
    then, when the test runs as root (who reads anything), became nobody for good: real,
    effective and saved ids, no groups, no capabilities left. A fork, not a new interpreter:
    the child has every module it needs already, so it reads nothing from the checkout, the
    virtualenv or the Python install, wherever they lie and whoever may read them."""
    nobody = pwd.getpwnam("nobody") if os.geteuid() == 0 else None
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: whatever happens, it reports and exits here, never returns
        try:
            os.close(read_end)
            os.chdir(cwd)
            if nobody is not None:
                os.setgroups([])
                os.setgid(nobody.pw_gid)
                os.setuid(nobody.pw_uid)
            status = Path("/proc/self/status")
            caps = [line.split()[1] for line in status.read_text().splitlines()
                    if line.startswith("CapEff:")] if status.exists() else []
            report = {"ids": [*os.getresuid(), *os.getresgid()], "caps": caps,
                      "result": work()}
        except BaseException as err:  # the parent reports it
            report = {"error": repr(err)}
        try:
            with os.fdopen(write_end, "w") as out:
                out.write(json.dumps(report))
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as got:
        report = json.loads(got.read() or '{"error": "the child died without a word"}')
    os.waitpid(pid, 0)
    assert "error" not in report, report["error"]
    if nobody is not None:
        assert 0 not in report["ids"], f"the child still runs as root: {report['ids']}"
        assert all(int(c, 16) == 0 for c in report["caps"]), report["caps"]
    return report["result"]


def test_an_unreadable_directory_is_noted(tmp_path):
    """Permission denied, as the agent's user meets it: root reads anything, so as root the
    scan runs in a child process as nobody. The child enters tmp_path before it gives up
    root, so where tmp_path lies (a private directory, say) does not matter: paths are
    looked up from there, and tmp_path itself is opened to everyone."""
    tmp_path.chmod(0o755)
    (tmp_path / "locked").mkdir(mode=0o000)
    (tmp_path / "sealed").mkdir()
    (tmp_path / "sealed" / "m").mkdir(mode=0o000)
    try:
        store = WeightsStore([("locked", False), ("sealed", False)])
        notes = _in_a_child_as_nobody(tmp_path, lambda: [d.note for d in store.scan()])
    finally:
        for d in (tmp_path / "locked", tmp_path / "sealed" / "m"):
            d.chmod(0o755)
    assert notes == ["cannot read locked: Permission denied",
                     f"m: cannot read {MANIFEST}: Permission denied"]


def test_the_store_from_agent_yaml_reads_the_token_file(tmp_path):
    from llmgw.config import AgentConfig, Weights, WeightsDirectory

    def weights(token_file):
        return AgentConfig(servers=["http://127.0.0.1:8080"], weights=Weights(
            directories=[WeightsDirectory(path=str(tmp_path / "w"), shared=True)],
            hub="http://mirror.example:8080/", token_file=token_file))

    (tmp_path / "token").write_text("hf_abc\n")
    s = WeightsStore.from_config(weights(str(tmp_path / "token")))
    assert (s.token, s.hub) == ("hf_abc", "http://mirror.example:8080")
    assert [(d.path, d.shared) for d in s.directories] == [(tmp_path / "w", True)]
    assert WeightsStore.from_config(weights(None)).token is None
    with pytest.raises(WeightsError, match=r"weights.token_file .*/nope: cannot read: No such"):
        WeightsStore.from_config(weights(str(tmp_path / "nope")))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(WeightsError, match=r"weights.token_file .*/empty is empty"):
        WeightsStore.from_config(weights(str(tmp_path / "empty")))
