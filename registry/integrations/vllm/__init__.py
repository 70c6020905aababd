"""Serving kvgraft grafts from vLLM (needs the [vllm] extra).

    LLM(model=..., kv_transfer_config=KVTransferConfig(
        kv_connector="KvgraftConnector", kv_connector_module_path="kvgraft.integrations.vllm",
        kv_role="kv_both", kv_connector_extra_config={"repository": "docs/vllm"}))

The connector restores the longest registry prefix of each prompt for the model and engine
vLLM serves (identity-checked, every byte verified) and publishes the prompts it computes.
See docs/vllm.md.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
    import vllm  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    from kvgraft.errors import MissingExtra

    raise MissingExtra("serving grafts from vLLM", "vllm") from e

from kvgraft.integrations.vllm.connector import KvgraftConnector

__all__ = ["KvgraftConnector"]
