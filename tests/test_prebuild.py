"""`python -m inferd.commands.prebuild` (what `make install` runs) fails loudly when the native
kernels cannot be built: a non-zero exit and one line on stderr saying why and how to go without
them on purpose; INFERD_NO_NATIVE=1 is that purpose, and exits 0. Every failing build runs in a
fresh TORCH_EXTENSIONS_DIR under tmp_path, so the real extension cache is neither reused nor touched."""
import os
import shutil
import subprocess
import sys

import pytest

from inferd.kernels import native


def _prebuild(env_over: dict, tmp_path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("INFERD_NO_NATIVE", "INFERD_ISA")}
    env.update(env_over)
    return subprocess.run([sys.executable, "-m", "inferd.commands.prebuild"], env=env, capture_output=True,
                          text=True, timeout=600, cwd=tmp_path, check=False)


def _without_compiler(tmp_path, cxx) -> dict:
    """PATH holding ninja alone (no gcc, g++, c++, cc), CXX and CC set to `cxx`, an empty extensions cache."""
    ninja = shutil.which("ninja")
    if ninja is None:
        pytest.skip("ninja is not installed: torch refuses to build before any compiler runs")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ninja").symlink_to(ninja)
    return {"PATH": str(bin_dir), "CXX": str(cxx), "CC": str(cxx), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}


def _one_line(stderr: str) -> str:
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def test_prebuild_without_a_compiler_exits_non_zero_with_one_line(tmp_path):
    cxx = tmp_path / "no-such-c++"
    r = _prebuild(_without_compiler(tmp_path, cxx), tmp_path)
    assert r.returncode != 0
    line = _one_line(r.stderr)
    assert "native kernels could not be built" in line
    assert f"{cxx}: not found" in line  # the compiler's own complaint, not ninja's command line
    assert "INFERD_NO_NATIVE=1" in line


def test_prebuild_reports_the_compilers_first_error(tmp_path):
    """A compiler that runs and fails to compile: the line carries its first error, not the command
    ninja ran (it answers --version as g++ does: torch asks before building)."""
    cxx = tmp_path / "failing-c++"
    cxx.write_text(f"#!{sys.executable}\nimport sys\n"
                   "if '-c' not in sys.argv:\n    print('g++ (GCC) 13.2.0')\n    sys.exit(0)\n"
                   "sys.stderr.write('kernel.cpp: In function f:\\nkernel.cpp:3:1: error: boom\\nmore\\n')\n"
                   "sys.exit(1)\n")
    cxx.chmod(0o755)
    r = _prebuild(_without_compiler(tmp_path, cxx), tmp_path)
    assert r.returncode != 0
    line = _one_line(r.stderr)
    assert "could not be built: kernel.cpp:3:1: error: boom;" in line and "INFERD_NO_NATIVE=1" in line


def test_prebuild_with_native_off_by_request_exits_zero(tmp_path):
    r = _prebuild({"INFERD_NO_NATIVE": "1", "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}, tmp_path)
    assert r.returncode == 0
    assert "off by request" in _one_line(r.stderr)
    assert not (tmp_path / "ext").exists()  # nothing was built


def test_prebuild_of_a_built_library_exits_zero():
    """The suite's own build (the same library in the same cache the native tests load): ready, 0."""
    if native.load() is None:
        pytest.skip(f"the native kernels do not build here: {native.build_error()}")
    env = {k: v for k, v in os.environ.items() if k not in ("INFERD_NO_NATIVE", "INFERD_ISA")}
    r = subprocess.run([sys.executable, "-m", "inferd.commands.prebuild"], capture_output=True, text=True,
                       timeout=600, env=env, check=False)
    assert r.returncode == 0
    assert f"{native.build_name()}: ready" in _one_line(r.stderr)


@pytest.mark.parametrize("message,want", [
    ("Ninja is required to load C++ extensions (pip install ninja to get it)",
     "Ninja is required to load C++ extensions (pip install ninja to get it)"),
    (("Error building extension 'x': [1/3] c++ -c a.cpp -o a.o\nFAILED: a.o \nc++ -c a.cpp -o a.o\n"
      "a.cpp: In function 'int f()':\na.cpp:2:3: error: 'g' was not declared in this scope\n    2 |   g();\n"
      "[2/3] c++ -c b.cpp -o b.o\nninja: build stopped: subcommand failed.\n"),
     "a.cpp:2:3: error: 'g' was not declared in this scope"),
    (("Error building extension 'x': [3/3] c++ a.o -o x.so\nFAILED: x.so \nc++ a.o -o x.so\n"
      "ld: cannot find -lgomp: No such file or directory\ncollect2: error: ld returned 1 exit status\n"),
     "ld: cannot find -lgomp: No such file or directory"),
])
def test_failure_line_is_the_first_error_after_the_failed_command(message, want):
    assert native.failure_line(message) == want
