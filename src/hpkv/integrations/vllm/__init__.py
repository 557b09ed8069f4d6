"""hpkv's vLLM integration: the HpkvConnectorV1 KV connector and its plugin registration.

vLLM calls :func:`register` through the ``vllm.general_plugins`` entry point in
every process it starts; it makes ``"kv_connector":"HpkvConnectorV1"`` resolve
to hpkv's connector. ``VLLM_ENABLE_HPKV=0`` turns the registration off.
"""

from __future__ import annotations

import os

CONNECTOR_NAME = "HpkvConnectorV1"
MODULE = "hpkv.integrations.vllm.connector"


def register() -> None:
    if os.environ.get("VLLM_ENABLE_HPKV", "1").strip().lower() in ("0", "false", "no", "off"):
        return
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, MODULE, CONNECTOR_NAME)
    from hpkv.integrations.vllm.prometheus import install_collector

    install_collector()
