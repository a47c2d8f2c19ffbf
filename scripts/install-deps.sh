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
  libpcre2-dev             # Unicode regexes of byte-level BPE pre-tokenizers (Llama 3)
  nlohmann-json3-dev       # config.json, safetensors headers, state.json, metrics
  libtomlplusplus-dev      # run.toml training configs
  libzstd-dev zlib1g-dev   # compressed corpora
  libxxhash-dev            # content hashes for dedup
  libgtest-dev libgmock-dev  # tests
  libbenchmark-dev         # benches
  chromium                 # renders the run report in tests/tools/test_report.cpp (headless); measured on Debian 12:
                           # 24 packages, 395 MB installed, 15 s to install
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]} == 0)); then
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
sudo=""
if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
