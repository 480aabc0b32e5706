#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py): the CUDA paths written but never run, in at most 5 minutes, as ONE JSON
# line on stdout (progress on stderr). Run it whenever a GPU machine is lent:
#
#     bash scripts/gpu-check.sh            # exit 0: skipped (no GPU) or every check passed; 1: a check did not pass
#
# Without a GPU it says so and exits 0 at once (no set-up). With one, on a fresh checkout: when .venv is missing it
# is created (seeing the system's packages, so a CUDA torch installed there is kept) and scripts/setup.sh runs; when
# the set-up fails (no network) the checks run with the first Python whose torch sees CUDA. worker._C is rebuilt
# against that torch unless it was built for it already. torch.version.cuda is in the line (``torch_cuda``).
# Env: TM_GPU_CHECK_BUDGET_S (default 290): the whole run's bound; TM_GPU_CHECK_ONLY: a comma-separated subset.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
BUDGET_S=${TM_GPU_CHECK_BUDGET_S:-290}
START=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
say() { echo "gpu-check: $*" >&2; }
json_line() {  # mode reason: a line for when Python cannot say it
    printf '{"gpu_check": 1, "mode": "%s", "device": "none", "torch_cuda": null, "ok": %s, "s": %s, "checks": {}, "reason": "%s"}\n' \
        "$1" "$([ "$1" = skipped ] && echo true || echo false)" "$(( $(date +%s) - START ))" "${2//\"/\'}"
}
has_torch() { "$1" -c "import torch" >/dev/null 2>&1; }
sees_cuda() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; }

# 1. No GPU: skip at once. torch is not imported (seconds on a loaded host): its version file is read instead.
if ! { [ -e /dev/nvidia0 ] || nvidia-smi -L >/dev/null 2>&1; }; then
    PY=.venv/bin/python; [ -x "$PY" ] || PY=python3
    "$PY" - "$START" <<'PYEOF' 2>/dev/null || json_line skipped "no NVIDIA device on this machine"
import ast, importlib.util, json, os, sys, time
spec = importlib.util.find_spec("torch")
found = {}
if spec and spec.origin:
    with open(os.path.join(os.path.dirname(spec.origin), "version.py")) as f:
        for node in ast.parse(f.read()).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant):
                target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                found[getattr(target, "id", "")] = node.value.value
print(json.dumps({"gpu_check": 1, "mode": "skipped", "device": "none", "torch": found.get("__version__"),
                  "torch_cuda": found.get("cuda"), "ok": True, "s": round(time.time() - int(sys.argv[1]), 2),
                  "checks": {}, "reason": "no NVIDIA device on this machine"}))
PYEOF
    exit 0
fi

# 2. Set-up on a fresh machine.
SETUP="kept .venv"
if [ ! -x .venv/bin/python ]; then
    PY=${PYTHON:-python3}
    say "no .venv: creating it (with the system's packages) and running scripts/setup.sh"
    if "$PY" -m venv --system-site-packages .venv \
        && PIP_DEFAULT_TIMEOUT=10 PIP_RETRIES=1 TM_SKIP_SLURM=1 TM_SKIP_BROWSER=1 timeout $(( $(left) / 2 )) bash scripts/setup.sh >&2; then
        SETUP="ran scripts/setup.sh"
    else
        SETUP="scripts/setup.sh failed"
    fi
fi
PY=""
for candidate in .venv/bin/python ${PYTHON:-} python3; do
    if command -v "$candidate" >/dev/null && sees_cuda "$candidate"; then PY=$candidate; break; fi
done
if [ -z "$PY" ]; then
    json_line error "a GPU is present but no Python here has a torch that sees CUDA ($SETUP)"
    exit 1
fi
say "python $PY: $("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')"

# 3. worker._C built against this torch (a checkout's .so may come from another machine's torch).
STAMP=build/gpu-check-torch.txt
WANT=$("$PY" -c 'import sys, torch; print(sys.executable, torch.__version__, torch.version.cuda)')
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ] || ! "$PY" -c "import torch, worker._C" >/dev/null 2>&1; then
    say "building worker._C against this torch"
    if timeout $(( $(left) / 2 )) "$PY" setup.py -q build_ext --inplace >&2; then
        mkdir -p build && echo "$WANT" > "$STAMP"
        SETUP="$SETUP; built worker._C"
    else
        SETUP="$SETUP; building worker._C failed"
    fi
fi

# 4. The checks, within what is left of the budget.
REMAINING=$(left)
if [ "$REMAINING" -lt 30 ]; then
    json_line error "set-up left ${REMAINING} s of ${BUDGET_S} s for the checks ($SETUP)"
    exit 1
fi
OUT=$(mktemp)
TM_GPU_CHECK_SETUP="$SETUP" timeout -k 5 "$REMAINING" "$PY" -m benchmarks.gpu_check --device auto \
    --budget-s $(( REMAINING - 15 )) \
    ${TM_GPU_CHECK_ONLY:+--only "$TM_GPU_CHECK_ONLY"} > "$OUT"
CODE=$?
if [ "$CODE" = 124 ] || [ "$CODE" = 137 ] || ! grep -q '^{' "$OUT"; then
    json_line error "the checks did not finish within ${REMAINING} s (exit $CODE; $SETUP)"
    rm -f "$OUT"
    exit 1
fi
cat "$OUT"
rm -f "$OUT"
exit "$CODE"
