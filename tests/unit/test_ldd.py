"""ldd's complaints made readable: the parser over real ldd output kept in tests/data/ldd,
and library_problems over binaries built here with gcc whose libraries are then taken
away or replaced by older ones."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from llmgw.agent.install.ldd import library_problems, parse_ldd

SAMPLES = Path(__file__).parent.parent / "data" / "ldd"

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("ldd") is None,
                               reason="needs gcc and ldd to build and inspect a binary")


@pytest.mark.parametrize(("sample", "problems"), [
    ("all-found.txt", []),
    ("not-dynamic.txt", []),
    ("missing-cudart.txt", ["libcudart.so.12 is missing"]),
    # Three complaints about one library, two version families: one line, newest of each.
    ("glibcxx-too-old.txt",
     ["libstdc++.so.6 is too old (needs CXXABI_1.3.13, GLIBCXX_3.4.30)"]),
    ("no-such-file.txt", ["./nonexistent: No such file or directory"]),
])
def test_real_ldd_output_reads_as_one_line_per_library(sample, problems):
    assert parse_ldd((SAMPLES / sample).read_text()) == problems


def test_the_newest_version_asked_for_is_named_once():
    output = (
        "./llama-server: /lib64/libstdc++.so.6: version `GLIBCXX_3.4.29' not found "
        "(required by ./llama-server)\n"
        "./llama-server: /lib64/libstdc++.so.6: version `GLIBCXX_3.4.30' not found "
        "(required by /opt/llmgw/engines/llama.cpp/b6000/build/bin/libllama.so)\n"
        "./llama-server: /lib64/libstdc++.so.6: version `GLIBCXX_3.4.9' not found "
        "(required by ./llama-server)\n"
        "./llama-server: /lib64/libc.so.6: version `GLIBC_2.34' not found "
        "(required by ./llama-server)\n"
        "\tlibgomp.so.1 => not found\n"
        "\tlibgomp.so.1 => not found\n"
    )
    assert parse_ldd(output) == [
        "libstdc++.so.6 is too old (needs GLIBCXX_3.4.30)",
        "libc.so.6 is too old (needs GLIBC_2.34)",
        "libgomp.so.1 is missing",
    ]


def gcc(*args: str | Path, cwd: Path) -> None:
    subprocess.run(["gcc", *map(str, args)], cwd=cwd, check=True, capture_output=True,
                   timeout=60)


def shared_lib(directory: Path, soname: str, source: str, version_script: str = "") -> Path:
    (directory / f"{soname}.c").write_text(source)
    args: list[str | Path] = ["-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", soname,
                              f"{soname}.c"]
    if version_script:
        (directory / f"{soname}.map").write_text(version_script)
        args.append(f"-Wl,--version-script={soname}.map")
    gcc(*args, cwd=directory)
    return directory / soname


def program(directory: Path, name: str, source: str, *libs: str) -> Path:
    (directory / f"{name}.c").write_text(source)
    # $ORIGIN: libraries beside the binary, as llama.cpp's release archives ship them.
    gcc("-o", name, f"{name}.c", "-L.", *(f"-l:{lib}" for lib in libs),
        "-Wl,-rpath,$ORIGIN", cwd=directory)
    return directory / name


@needs_gcc
def test_a_binary_whose_library_was_deleted(tmp_path):
    lib = shared_lib(tmp_path, "libllmgw-probe.so.1", "int probe(void) { return 7; }")
    binary = program(tmp_path, "llama-server", "int probe(void);\n"
                     "int main(void) { return probe() == 7 ? 0 : 1; }\n",
                     "libllmgw-probe.so.1")
    assert library_problems(binary) == []
    assert subprocess.run([binary], timeout=30).returncode == 0
    lib.unlink()
    assert library_problems(binary) == ["libllmgw-probe.so.1 is missing"]


NEW_CXX = """GLIBCXX_3.4 { global: cxx_base; local: *; };
GLIBCXX_3.4.29 { global: cxx_29; } GLIBCXX_3.4;
GLIBCXX_3.4.30 { global: cxx_30; } GLIBCXX_3.4.29;
"""
OLD_CXX = """GLIBCXX_3.4 { global: cxx_base; local: *; };
GLIBCXX_3.4.29 { global: cxx_29; } GLIBCXX_3.4;
"""


@needs_gcc
def test_a_library_older_than_the_build_is_named_too_old(tmp_path):
    # A libstdc++.so.6 stand-in with GCC 12's symbol versions to build against, then one
    # that stops at GCC 11's: the loader finds the library, not the version.
    shared_lib(tmp_path, "libstdc++.so.6", "int cxx_base(void) { return 0; }\n"
               "int cxx_29(void) { return 29; }\nint cxx_30(void) { return 30; }\n", NEW_CXX)
    binary = program(tmp_path, "llama-server", "int cxx_30(void);\n"
                     "int main(void) { return cxx_30() == 30 ? 0 : 1; }\n", "libstdc++.so.6")
    assert library_problems(binary) == []
    shared_lib(tmp_path, "libstdc++.so.6", "int cxx_base(void) { return 0; }\n"
               "int cxx_29(void) { return 29; }\n", OLD_CXX)
    assert library_problems(binary) == ["libstdc++.so.6 is too old (needs GLIBCXX_3.4.30)"]


def test_a_script_has_no_libraries_to_miss(tmp_path):
    script = tmp_path / "run"
    script.write_text("#!/bin/sh\necho version: 1\n")
    script.chmod(0o755)
    assert library_problems(script) == []
