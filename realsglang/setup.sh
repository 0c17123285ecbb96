#!/usr/bin/env bash
# Install the released sglang 0.5.23 as a CPU prefill-decode stack (no GPU, registries only) into a
# cache directory: $REAL_SGLANG_HOME, default ~/.cache/sglang-watchdog/real-sglang.
#
#   venv/    sglang 0.5.23 (--no-deps) + torch 2.14.1 + mooncake TCP transfer, pinned by constraints.txt
#   model/   a tiny random Llama (2 layers, hidden 128) with a locally trained byte-level tokenizer
#
# The routers are not installed here: sglang-router 0.3.2 and smg 1.13 come with the project's own
# .venv (pyproject's dev extra). Idempotent: a stamp holds the hash of every input of this script;
# a second run with the same inputs only re-checks the import (seconds). About 5 minutes and 7 GiB
# the first time (torch's CUDA wheels: the CPU-only torch cannot be used because PyPI's torchvision
# links the CUDA torch libraries, and sglang imports torchvision at start).
#
# Debian packages: libibverbs1 (mooncake's transfer engine links it even for TCP) and nftables (the
# transfer-stall fault). Installed here when run as root; .ci/run installs them too.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
home=${REAL_SGLANG_HOME:-$HOME/.cache/sglang-watchdog/real-sglang}
python=${PYTHON:-python3}
stamp="$home/.installed"

inputs_hash() {
    (cd "$here" && cat setup.sh constraints.txt make_model.py shim/realsglang_cpu_patch.py \
        shim/sgl_kernel/__init__.py | sha256sum | cut -d' ' -f1)
}

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    if ! dpkg -s libibverbs1 nftables >/dev/null 2>&1; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            libibverbs1 nftables >/dev/null
    fi
fi

want=$(inputs_hash)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$home/venv/bin/python" ]; then
    echo "real-sglang: up to date in $home"
    exit 0
fi

mkdir -p "$home/dl"
test -x "$home/venv/bin/python" || "$python" -m venv "$home/venv"
pip=("$home/venv/bin/python" -m pip install --quiet --disable-pip-version-check -c "$here/constraints.txt")

echo "real-sglang: installing torch (CUDA wheels, run on CPU) into $home/venv"
"${pip[@]}" torch torchvision
echo "real-sglang: installing sglang 0.5.23 without its GPU kernel packages"
"$home/venv/bin/python" -m pip download --quiet --no-deps sglang==0.5.23 -d "$home/dl"
"$home/venv/bin/python" -m pip install --quiet --no-deps "$home"/dl/sglang-0.5.23-*.whl
"${pip[@]}" -r "$here/requirements.txt"
echo "real-sglang: installing mooncake (TCP transfer engine, no CUDA)"
"${pip[@]}" mooncake-transfer-engine-non-cuda==0.3.13.post1

# The two local pieces (each file's docstring cites the SGLang lines that make it necessary).
site=$("$home/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$site/sgl_kernel"
cp -r "$here/shim/sgl_kernel" "$site/"
cp "$here/shim/realsglang_cpu_patch.py" "$site/"
echo "import realsglang_cpu_patch" > "$site/realsglang_cpu_patch.pth"

"$home/venv/bin/python" "$here/make_model.py" "$home/model"
SGLANG_USE_CPU_ENGINE=1 "$home/venv/bin/python" -c \
    "import sglang.launch_server, sglang.srt.disaggregation.mooncake.conn, realsglang_cpu_patch"
echo "$want" > "$stamp"
echo "real-sglang: ready in $home"
