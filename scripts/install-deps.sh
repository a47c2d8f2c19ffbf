#!/usr/bin/env bash
# Installs the Debian packages tuna builds against, when they are missing. Safe to run again: it only
# calls apt-get when a package is absent. `make demo` and `make test` run it first.
set -euo pipefail

packages=(
  g++ make pkg-config
  libopenblas-dev          # BLAS for the CPU backend's GEMMs
  libopenblas-openmp-dev   # its OpenMP build, which the Makefile links: GEMMs on tuna's OpenMP threads
  libopenmpi-dev openmpi-bin  # launching ranks (mpirun), host collectives
  libsentencepiece-dev sentencepiece  # tokenizer library and spm_* command-line tools
  libpcre2-dev             # Unicode regexes of tokenizer.json pre-tokenizers and normalizers (Llama 3's Split)
  libutf8proc-dev          # Unicode normalization (NFC, NFKC, ...), case and character classes of tokenizer.json
  nlohmann-json3-dev       # config.json, safetensors headers, state.json, metrics
  libtomlplusplus-dev      # run.toml training configs
  libzstd-dev zlib1g-dev   # compressed corpora
  libxxhash-dev            # content hashes for dedup
  libgtest-dev libgmock-dev  # tests
  libbenchmark-dev         # benches
  python3 python3-venv     # the virtual environment of the gguf package (below)
  chromium                 # renders the run report in tests/tools/test_report.cpp (headless); measured on Debian 12:
                           # 24 packages, 395 MB installed, 15 s to install
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]} > 0)); then
  echo "install-deps: installing ${missing[*]}"
  sudo=""
  if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The gguf package from PyPI (with numpy: about 20 MB), llama.cpp's own GGUF reader and reference quantizers:
# the tests read tuna's GGUF exports back with it (tools/reference/check_gguf.py). It goes into a virtual
# environment of the build directory, so the system's Python is left as it is.
venv="${TUNA_BUILD_DIR:-build}/venv"
if ! "$venv/bin/python3" -c 'import gguf, numpy' 2>/dev/null; then
  echo "install-deps: installing the gguf Python package into $venv"
  python3 -m venv "$venv"
  "$venv/bin/python3" -m pip install -q --disable-pip-version-check gguf==0.19.0
fi
