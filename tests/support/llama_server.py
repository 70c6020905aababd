"""llama.cpp's own `llama-server`, built from the llama.cpp that the installed
llama-cpp-python vendors, and run on loopback for the tests.

The binary must come from those exact sources: the seq-state files its slot save writes
and its slot restore reads are the format (and the kernels the bytes) of that llama.cpp,
which is what kvgraft's llama.cpp integration reads and writes through the binding. It is
built once per llama-cpp-python version into `.services/llama-server/<version>/` (ignored
by git, removed by `make clean`) and reused by later runs on the machine; the build runs
in a scratch directory beside it and is renamed into place when complete, under a file
lock, so concurrent test workers build it once and never see half a build.

    python -m tests.support.llama_server     # build (if needed) and print the binary's path
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from tests.support.daemons import _die_with_parent, free_ports

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".services" / "llama-server"
DIST = "llama-cpp-python"

# The options of the llama-cpp-python build the Makefile runs (GGML_NATIVE=ON, Release,
# llama.cpp's default kernels: LLAMAFILE, OpenMP, the CPU's own instruction sets), so the
# server computes the same KV bytes as the binding. Static libraries make the binary
# self-contained, so it can be moved out of its build tree. Nothing is fetched: no web UI
# (neither built with npm nor downloaded, the server runs without one), no TLS.
# LLAMA_CURL is gone from this llama.cpp (setting it only warns that it is ignored); the
# tests never download a model.
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
)
BUILD_JOBS = 2
LOG_KEPT = 64 * 1024  # bytes of a successful build's log kept beside the binary


class SourcesUnavailable(RuntimeError):
    """The llama-cpp-python sdist could not be had (no index reachable, not installed)."""


class BuildFailed(RuntimeError):
    """cmake could not configure or build llama-server from the sources."""


class ToolchainMissing(RuntimeError):
    """A tool the build needs is not installed."""


def installed_version() -> str:
    try:
        return metadata.version(DIST)
    except metadata.PackageNotFoundError:
        raise SourcesUnavailable(f"{DIST} is not installed") from None


def missing_toolchain() -> list[str]:
    """The build tools that are not on PATH (cmake, a C and a C++ compiler, ninja or make)."""
    missing = [] if shutil.which("cmake") else ["cmake"]
    if not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        missing.append("a C compiler")
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler")
    if not (shutil.which("ninja") or shutil.which("make")):
        missing.append("ninja or make")
    return missing


@dataclass(frozen=True, slots=True)
class Built:
    """A llama-server binary and how it was made."""

    binary: Path
    version: str  # llama-cpp-python's
    seconds: float  # the build's wall time (download, configure, compile), when it ran
    cached: bool  # found built by an earlier run


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run(step: str, argv: list[str], log: Path, *, timeout: float = 3600) -> None:
    with open(log, "ab") as out:
        out.write(f"$ {' '.join(argv)}\n".encode())
        out.flush()
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out,
                              stderr=subprocess.STDOUT, timeout=timeout, check=False)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise BuildFailed(f"{step} exited {proc.returncode}:\n{tail}")


def _sources(version: str, work: Path, log: Path) -> Path:
    """vendor/llama.cpp of the llama-cpp-python sdist of `version`, extracted into `work`."""
    download = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                f"{DIST}=={version}", "-d", str(work / "sdist")]
    try:
        _run("pip download", download, log, timeout=600)
    except BuildFailed as e:
        raise SourcesUnavailable(f"pip could not download the {DIST} {version} sdist: "
                                 f"{e}") from None
    archives = sorted((work / "sdist").glob("*.tar.gz"))
    if len(archives) != 1:
        raise SourcesUnavailable(f"expected one sdist archive, found {archives}")
    with tarfile.open(archives[0]) as tar:
        top = tar.getnames()[0].split("/")[0]
        prefix = f"{top}/vendor/llama.cpp/"
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        if not members:
            raise SourcesUnavailable(f"{archives[0].name} has no vendor/llama.cpp")
        tar.extractall(work / "src", members=members, filter="data")
    return work / "src" / prefix


def _build(version: str, stage: Path) -> dict[str, float]:
    """Download, configure and compile into the scratch directory `stage`, leaving
    `stage/llama-server` and the log's end in `stage/build.log`; the seconds of each step."""
    log = stage / "build.log"
    work = stage / "work"
    work.mkdir()
    steps: dict[str, float] = {}
    t0 = time.monotonic()
    src = _sources(version, work, log)
    steps["download_s"] = time.monotonic() - t0
    build = work / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    t0 = time.monotonic()
    _run("cmake (configure)",
         ["cmake", "-S", str(src), "-B", str(build), *generator, *CMAKE_OPTIONS], log)
    steps["configure_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    _run("cmake --build", ["cmake", "--build", str(build), "--target", "llama-server",
                           "-j", str(BUILD_JOBS)], log)
    steps["compile_s"] = time.monotonic() - t0
    shutil.copy2(build / "bin" / "llama-server", stage / "llama-server")
    shutil.rmtree(work)
    # the compiler's warnings make megabytes of it; the end says what was built
    text = log.read_bytes()
    log.write_bytes(text[-LOG_KEPT:])
    return {k: round(v, 1) for k, v in steps.items()}


def ensure_llama_server(version: str | None = None) -> Built:
    """The llama-server of llama-cpp-python `version` (the installed one by default), built
    on first use. Raises ToolchainMissing, SourcesUnavailable or BuildFailed."""
    version = version or installed_version()
    dest = CACHE / version
    binary = dest / "llama-server"
    if binary.is_file():
        return Built(binary, version, _recorded_seconds(dest), cached=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    with _locked(CACHE / f"{version}.lock"):
        if binary.is_file():  # another worker built it while this one waited
            return Built(binary, version, _recorded_seconds(dest), cached=True)
        missing = missing_toolchain()
        if missing:
            raise ToolchainMissing(f"missing: {', '.join(missing)}")
        # what a build killed midway left (the lock is held: nobody is building it now)
        for stale in CACHE.glob(f".build-{version}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        stage = Path(tempfile.mkdtemp(prefix=f".build-{version}-", dir=CACHE))
        try:
            t0 = time.monotonic()
            steps = _build(version, stage)
            seconds = round(time.monotonic() - t0, 1)
            (stage / "build.json").write_text(json.dumps({
                "llama_cpp_python": version, "seconds": seconds, **steps, "jobs": BUILD_JOBS,
                "cmake_options": list(CMAKE_OPTIONS), "cpus": os.cpu_count(),
                "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1))
            stage.chmod(0o755)  # mkdtemp's 0700 would keep it from other users
            if dest.exists():  # a directory left without its binary: replaced whole
                shutil.rmtree(dest)
            os.rename(stage, dest)
        except BaseException:
            # the log of a failed build is kept for a look; the scratch tree is not
            log = stage / "build.log"
            if log.is_file():
                shutil.copyfile(log, CACHE / f"{version}.failed.log")
            shutil.rmtree(stage, ignore_errors=True)
            raise
    return Built(binary, version, seconds, cached=False)


def _recorded_seconds(dest: Path) -> float:
    try:
        return float(json.loads((dest / "build.json").read_text())["seconds"])
    except (OSError, ValueError, KeyError):
        return 0.0


@dataclass(slots=True)
class LlamaServer:
    """A running llama-server on loopback: `post` its HTTP API, `stop` it."""

    process: subprocess.Popen[bytes]
    url: str
    log: Path
    _opener: urllib.request.OpenerDirector = field(
        # No proxy: the server is on loopback whatever HTTP_PROXY says.
        default_factory=lambda: urllib.request.build_opener(urllib.request.ProxyHandler({})))

    def request(self, method: str, path: str, body: dict[str, Any] | None = None,
                timeout: float = 600) -> tuple[int, Any]:
        """(HTTP status, the JSON answer) of one request; errors are answers too."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with self._opener.open(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw)
            except ValueError:
                return e.code, raw.decode(errors="replace")

    def post(self, path: str, body: dict[str, Any], timeout: float = 600) -> Any:
        """The JSON answer of a POST that must succeed."""
        status, answer = self.request("POST", path, body, timeout)
        if status != 200:
            raise AssertionError(f"POST {path}: HTTP {status}: {answer}\n{self.tail()}")
        return answer

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def start_llama_server(binary: Path, model: Path, log: Path, *, args: list[str],
                       timeout: float = 120) -> LlamaServer:
    """Start `binary` on a free loopback port serving `model` with `args`, and wait until
    its /health answers 200 (the model loaded). Raises RuntimeError with the log's tail if
    it exits or does not become ready."""
    port = free_ports(1)[0]
    argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            *args]
    with open(log, "wb") as out:
        out.write(f"$ {' '.join(argv)}\n".encode())
        out.flush()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    server = LlamaServer(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError):
            status, _ = server.request("GET", "/health", timeout=2)
            if status == 200:
                return server
        if proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"llama-server did not become ready on {server.url} "
                               f"(exit {proc.returncode}):\n{server.tail()}")
        time.sleep(0.2)


if __name__ == "__main__":
    built = ensure_llama_server()
    how = "cached" if built.cached else "built"
    print(f"{built.binary} ({how}; build took {built.seconds:.0f} s)")
