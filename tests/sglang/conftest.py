"""hpkv's SGLang backend under SGLang's own HiCacheController and host pools, on CPU torch.

Run in ``.venv-sglang`` (``make test-sglang``); see :mod:`tests.sglang.cpu` for the one
placeholder (torchvision, which the code under test never calls). The hpkv fixtures (shm_dir,
storage_dir, the HPKV_* scrub, valkey_server) come from tests/conftest.py.
"""

from tests.sglang.cpu import install_torchvision_placeholder

install_torchvision_placeholder()
