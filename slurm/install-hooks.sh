#!/usr/bin/env bash
# Install TrainMover's SLURM Prolog/Epilog: writes DEST/prolog and DEST/epilog, two /bin/sh wrappers that run
# slurm/hooks.py with an absolute interpreter path (slurmd gives hooks no PATH), then runs each once to check it.
#
#   slurm/install-hooks.sh --python /opt/trainmover/.venv/bin/python --dest /etc/slurm/trainmover \
#       [--state-dir DIR] [--log FILE] [-- extra hooks.py options, e.g. --min-free-mem-mb 4096]
#
# --python: an interpreter with psutil (pyzmq for the epilog's notice; pynvml where GPUs exist), e.g. the venv of
# scripts/setup.sh. --state-dir: bake in a shared TrainMover state dir (default: each job user's ~/.trainmover).
# --log: append one JSON line per hook run. Then, in slurm.conf on every node:
#   Prolog=DEST/prolog
#   Epilog=DEST/epilog
#   PrologFlags=Alloc
# and `scontrol reconfigure`. See docs/slurm.md, "Admin, once".
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PY="" DEST="" STATE="" LOG=""
while [ $# -gt 0 ]; do
    case $1 in --python|--dest|--state-dir|--log)
        [ $# -ge 2 ] || { echo "install-hooks: error: $1 needs a value" >&2; exit 2; } ;;
    esac
    case $1 in
        --python) PY=$2; shift 2 ;;
        --dest) DEST=$2; shift 2 ;;
        --state-dir) STATE=$2; shift 2 ;;
        --log) LOG=$2; shift 2 ;;
        --) shift; break ;;
        *) echo "install-hooks: error: unknown option $1" >&2; exit 2 ;;
    esac
done
[ -n "$PY" ] && [ -n "$DEST" ] || { echo "usage: $0 --python PYTHON --dest DIR [--state-dir DIR] [--log FILE] [-- hook options]" >&2; exit 2; }
case $PY in */*) ;; *) PY=$(command -v "$PY" || true) ;; esac
[ -n "$PY" ] && [ -e "$PY" ] && PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"  # absolute; keeps a venv's symlink
[ -x "$PY" ] || { echo "install-hooks: error: --python must be an executable interpreter" >&2; exit 2; }
"$PY" -I -c "import psutil" 2>/dev/null || { echo "install-hooks: error: $PY has no psutil" >&2; exit 2; }

q() {  # quote for /bin/sh (single quotes; refuse paths that contain one)
    case $1 in *"'"*) echo "install-hooks: error: path with a single quote: $1" >&2; exit 2 ;; esac
    printf "'%s'" "$1"
}
opts=""
[ -n "$STATE" ] && opts="$opts --state-dir $(q "$STATE")"
[ -n "$LOG" ] && opts="$opts --log $(q "$LOG")"
for a in "$@"; do opts="$opts $(q "$a")"; done
mkdir -p "$DEST"
for hook in prolog epilog; do
    cat > "$DEST/$hook.tmp" <<EOF
#!/bin/sh
# TrainMover SLURM $hook, written by slurm/install-hooks.sh. slurmd runs it as root with no PATH.
exec $(q "$PY") -I $(q "$HERE/hooks.py") $hook$opts
EOF
    chmod 755 "$DEST/$hook.tmp"
done
# Check both once, as slurmd would run them (bare environment, no job): each must exit 0. Only then do they replace
# the installed ones: a hook that fails would fail every job's prolog on the node (and SLURM drains it).
for hook in prolog epilog; do
    start=$(date +%s%N)
    env -i SLURMD_NODENAME=install-check "$DEST/$hook.tmp" 2>"$DEST/$hook.err" || {
        echo "install-hooks: error: the new $hook failed its check ($(tail -n 1 "$DEST/$hook.err")): nothing was installed" >&2
        rm -f "$DEST/prolog.tmp" "$DEST/epilog.tmp" "$DEST/$hook.err"; exit 1; }
    rm -f "$DEST/$hook.err"
    echo "$DEST/$hook: ok in $(( ($(date +%s%N) - start) / 1000000 )) ms"
done
for hook in prolog epilog; do
    mv "$DEST/$hook.tmp" "$DEST/$hook"
done
