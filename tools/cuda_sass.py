#!/usr/bin/env python3
"""CubeCL's generated CUDA -> PTX -> cubin -> SASS, on a machine without a GPU.

The kernel sources come from a GPU run's compilation log (a `cubecl.toml` with
`[compilation.logger] level = "full"` and `file = "…"`); `--split LOG DIR` writes each kernel of
the log whose name matches `--match` (default `flash`) to `DIR/NN_name.cu`. Each `.cu` given then
compiles as CubeCL compiles it on the device (NVRTC, `--gpu-architecture=compute_90a`,
`-lineinfo`), and `ptxas -v` / `cuobjdump -sass` report registers, spills and the SASS beside it
(`name.ptx`, `name.sass`).

Needs, in a virtual environment (nothing of it on the system):
    python3 -m venv /tmp/nv && /tmp/nv/bin/pip install nvidia-cuda-nvrtc-cu12 \
        nvidia-cuda-runtime-cu12 nvidia-cuda-nvcc-cu12 triton
and runs under that interpreter: /tmp/nv/bin/python tools/cuda_sass.py KERNEL.cu …
(Triton's wheel carries `ptxas` and `cuobjdump`; the NVIDIA wheels NVRTC and the headers.)
docs/architecture.md §15 tells what it found.
"""
import argparse
import ctypes
import os
import re
import subprocess
import sys
import sysconfig


def split(log, out, match):
    os.makedirs(out, exist_ok=True)
    text = open(log, errors="replace").read()
    n = 0
    for block in text.split("[START_KERNEL_COMPILATION]")[1:]:
        m = re.search(r"```[a-z]*\n(.*)\n```", block, re.S)
        if not m:
            continue
        src = m.group(1)
        name = re.search(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)", src)
        name = name.group(1) if name else "unknown"
        if match in name:
            n += 1
            open(os.path.join(out, f"{n:02d}_{name[:60]}.cu"), "w").write(src)
    print(f"{n} kernels into {out}")


def compile_one(path, site):
    nv = ctypes.CDLL(f"{site}/nvidia/cuda_nvrtc/lib/libnvrtc.so.12")
    prog = ctypes.c_void_p()
    if nv.nvrtcCreateProgram(ctypes.byref(prog), open(path, "rb").read(), b"k.cu", 0, None, None):
        sys.exit("nvrtcCreateProgram failed")
    opts = [
        b"--gpu-architecture=compute_90a",
        f"--include-path={site}/nvidia/cuda_nvcc/include".encode(),
        f"--include-path={site}/nvidia/cuda_runtime/include".encode(),
        b"-lineinfo",
    ]
    rc = nv.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    if rc:
        nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nv.nvrtcGetProgramLog(prog, log)
        sys.exit(f"{path}: NVRTC failed\n{log.value.decode()[:4000]}")
    nv.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    nv.nvrtcGetPTX(prog, ptx)
    base = os.path.splitext(path)[0]
    open(base + ".ptx", "wb").write(ptx.value)
    bin_dir = f"{site}/triton/backends/nvidia/bin"
    out = subprocess.run(
        [f"{bin_dir}/ptxas", "-arch=sm_90a", "-v", "-o", base + ".cubin", base + ".ptx"],
        capture_output=True, text=True, check=True,
    )
    sass = subprocess.run(
        [f"{bin_dir}/cuobjdump", "-sass", base + ".cubin"], capture_output=True, text=True
    ).stdout
    open(base + ".sass", "w").write(sass)
    os.remove(base + ".cubin")
    used = [l.split("info    : ")[-1] for l in out.stderr.splitlines() if "Used" in l or "spill" in l]
    print(f"{os.path.basename(path)}: {'; '.join(used)}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--split", nargs=2, metavar=("LOG", "DIR"))
    p.add_argument("--match", default="flash")
    p.add_argument("kernels", nargs="*")
    a = p.parse_args()
    if a.split:
        split(*a.split, a.match)
    site = sysconfig.get_paths()["purelib"]
    for k in a.kernels:
        compile_one(k, site)


if __name__ == "__main__":
    main()
