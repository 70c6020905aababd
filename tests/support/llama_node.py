"""One llama-cpp-python process with the registry prompt cache (a "node"): it completes each
prompt greedily in order, publishes what it computed, and prints one JSON line.

    python -m tests.support.llama_node SPEC_JSON

SPEC: {"model": gguf path, "prompts": [text, ...], "repository": name, "max_tokens": n,
"lookup_timeout": s, "threads": n}; the registry comes from the KVGRAFT_* environment.
Output: {"results": [{"text", "prompt_tokens", "seconds"}, ...], "counters": {...}}.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from kvgraft.client import Registry
    from kvgraft.integrations.llamacpp import Settings, load_model
    from kvgraft.integrations.llamacpp.cache import CacheSettings, RegistryCache

    registry = Registry.from_env()
    lm = load_model(spec["model"], cache_dir=registry.config.cache_dir,
                    settings=Settings(threads=spec.get("threads", 2)))
    settings = CacheSettings(spec["repository"],
                             lookup_timeout=float(spec.get("lookup_timeout", 30.0)))
    cache = RegistryCache(registry, lm, repository=spec["repository"], settings=settings)
    lm.llm.set_cache(cache)
    results = []
    for prompt in spec["prompts"]:
        t0 = time.perf_counter()
        out = lm.llm.create_completion(prompt, max_tokens=spec.get("max_tokens", 8),
                                       temperature=0.0)
        results.append({"text": out["choices"][0]["text"],
                        "prompt_tokens": out["usage"]["prompt_tokens"],
                        "seconds": round(time.perf_counter() - t0, 4)})
    cache.close()
    return {"results": results, "counters": cache.counters.snapshot()}


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))))
