#!/usr/bin/env bash
# Runs every test of the workspace, installing what the tests need first.
# The CubeCL kernel tests run Burn's Wgpu backend on Mesa's software Vulkan driver (lavapipe).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1; then
    echo "test.sh: installing the software Vulkan driver (mesa-vulkan-drivers) for the kernel tests"
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mesa-vulkan-drivers >/dev/null) || {
            echo "test.sh: could not install mesa-vulkan-drivers; install it (Debian/Ubuntu: apt-get install mesa-vulkan-drivers) and rerun" >&2
            exit 1
        }
    else
        echo "test.sh: the software Vulkan driver is missing; install mesa-vulkan-drivers (as root: apt-get install mesa-vulkan-drivers) and rerun" >&2
        exit 1
    fi
fi

# `wgpu`: the CubeCL kernel tests run on Wgpu over lavapipe (installed above); `learner`:
# burn-train's Learner, sharded (`wildfire::learner`).
cargo test --workspace --all-targets --features wgpu,learner "$@"
cargo test --workspace --doc --features wgpu,learner "$@"
