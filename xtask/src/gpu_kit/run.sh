#!/usr/bin/env bash
# Bonfire's GPU kit: runs every check of `gpu_check` on this machine's NVIDIA GPUs, each in its
# own process under a time limit, and ends with `N passed, N failed, N skipped`. Needs only the
# NVIDIA driver (libcuda.so.1); NCCL (libnccl.so.2) and NVRTC (libnvrtc.so.12) are looked for
# and the checks that need a missing one are skipped, saying where it comes from.
# CubeCL's kernels also need CUDA's headers for NVRTC (cuda_fp16.h; found and CUDA_PATH set).
# Exit status: 0 when no check failed (a machine without a GPU: SKIPPED, 0), 1 otherwise.
# All checks together stop after BONFIRE_GPU_KIT_BUDGET seconds (default 470: under 8 minutes).
# Built by `cargo xtask gpu-kit` (docs/gpu.md). Options: `--only NAME[,NAME]`, `--list`,
# `--args "ARGS"` (given to every check run, e.g. `--args "--batch 4 --torch-compile"`);
# `--unpack` only unpacks the kit's program and prints its path (bin/train, bin/parity use it).
set -u
KIT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CHECKS="$KIT/CHECKS" # `gpu_check list`, written when the kit was built
BUDGET="${BONFIRE_GPU_KIT_BUDGET:-470}"

# The kit's program, gzipped in the kit: unpacked on first use under $TMPDIR, in a folder named
# by the archive's checksum (the kit's folder stays as it was built, and may be read-only);
# prints its path. A kit holding the program itself (`bin/gpu_check`) uses it as it is.
unpack() {
  local gz="$KIT/bin/gpu_check.gz" sum out
  if [ ! -e "$gz" ] && [ -x "$KIT/bin/gpu_check" ]; then
    echo "$KIT/bin/gpu_check"; return 0
  fi
  sum=$(cksum <"$gz" 2>/dev/null | cut -d' ' -f1)
  out="${TMPDIR:-/tmp}/bonfire-gpu-kit-$(id -u)/$sum/gpu_check"
  if [ -n "$sum" ] && [ -x "$out" ]; then
    echo "$out"; return 0
  fi
  if [ -n "$sum" ] && mkdir -p "$(dirname "$out")" && gzip -dc "$gz" >"$out.part" &&
     chmod +x "$out.part" && mv -f "$out.part" "$out"; then
    echo "$out"; return 0
  fi
  rm -f "$out.part" 2>/dev/null
  echo "run: cannot unpack $gz into ${TMPDIR:-/tmp} (is gzip installed? is it writable?)" >&2
  return 1
}

ONLY=""
ARGS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --only) ONLY="${2:-}"; shift 2 ;;
    --args) ARGS="${2:-}"; shift 2 ;;
    --list) cat "$CHECKS"; exit 0 ;;
    --unpack) unpack; exit $? ;;
    *) echo "run: unknown option $1 (options: --only NAME[,NAME], --args ARGS, --list, --unpack)"; exit 2 ;;
  esac
done
for name in $(echo "$ONLY" | tr ',' ' '); do
  cut -f1 "$CHECKS" | grep -qx "$name" || { echo "run: no check $name (--list names them)"; exit 2; }
done
[ -f "$KIT/VERSION" ] && echo "gpu-kit: $(cat "$KIT/VERSION")"
began=$(date +%s)

# The GPUs: nvidia-smi when present, else the device nodes (a container without the tools).
gpus=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L | grep -c '^GPU ')
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader 2>/dev/null |
    sed 's/^/gpu-kit: GPU /'
else
  for node in /dev/nvidia[0-9]*; do [ -e "$node" ] && gpus=$((gpus + 1)); done
fi
total=$(grep -c . "$CHECKS")
if [ "$gpus" -eq 0 ]; then
  echo "SKIPPED: no NVIDIA GPU on this machine (nvidia-smi lists none and there is no" \
       "/dev/nvidia0); none of the $total checks was run"
  echo "0 passed, 0 failed, $total skipped"
  exit 0
fi
echo "gpu-kit: $gpus GPU(s)"
if ! BIN=$(unpack); then
  echo "0 passed, $total failed, 0 skipped"
  exit 1
fi
if ! probe=$("$BIN" list 2>&1 >/dev/null); then
  echo "gpu-kit: the kit's program cannot run on this machine: $probe"
  echo "0 passed, $total failed, 0 skipped"
  exit 1
fi

# Where a library may be: the loader's cache and path, CUDA's usual places, and pip's nvidia
# wheels (PyTorch's environment carries NCCL, NVRTC and CUDA's headers there: nvidia/nccl/lib,
# nvidia/cu13/{lib,include}, nvidia/cuda_nvrtc/lib, nvidia/cuda_runtime/include, …).
sites=""
for s in /usr/local/lib/python3*/*-packages /usr/lib/python3*/*-packages \
         "$HOME"/.local/lib/python3*/site-packages /opt/conda/lib/python3*/site-packages \
         ${VIRTUAL_ENV:+$VIRTUAL_ENV/lib/python3*/site-packages} \
         $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null); do
  [ -d "$s/nvidia" ] && case " $sites " in *" $s "*) ;; *) sites="$sites $s" ;; esac
done
dirs=$(echo "${LD_LIBRARY_PATH:-}" | tr ':' ' ')
dirs="$dirs /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib /usr/local/cuda/lib64"
dirs="$dirs /usr/local/cuda/targets/x86_64-linux/lib /usr/local/nvidia/lib64 /usr/local/nvidia/lib"
dirs="$dirs /usr/lib/wsl/lib /opt/conda/lib"
for s in $sites; do
  for d in "$s"/nvidia/*/lib; do [ -d "$d" ] && dirs="$dirs $d"; done
done
# find_lib NAME...: the first path of one of NAME, or nothing.
find_lib() {
  local name d
  for name in "$@"; do
    if command -v ldconfig >/dev/null 2>&1; then
      local hit
      hit=$(ldconfig -p 2>/dev/null | awk -v n="$name" '$1 == n { print $NF; exit }')
      [ -n "$hit" ] && { echo "$hit"; return; }
    fi
    for d in $dirs; do
      [ -e "$d/$name" ] && { echo "$d/$name"; return; }
    done
  done
}
declare -A have where
where[cuda]="the NVIDIA driver (install the driver; in a container, run it with the GPU runtime)"
where[nccl]="NCCL: apt install libnccl2 (NVIDIA's CUDA repository) or pip install nvidia-nccl-cu12"
where[nvrtc]="NVRTC: the CUDA toolkit (apt install cuda-nvrtc-12-8) or pip install nvidia-cuda-nvrtc-cu12"
for lib in cuda:libcuda.so.1 nccl:libnccl.so.2 "nvrtc:libnvrtc.so.12 libnvrtc.so libnvrtc.so.13"; do
  key=${lib%%:*}
  path=$(find_lib ${lib#*:})
  if [ -n "$path" ]; then
    have[$key]=1
    echo "gpu-kit: lib$key: $path"
    dir=$(dirname "$path")
    case ":${LD_LIBRARY_PATH:-}:" in *":$dir:"*) ;; *) export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;; esac
    if [ "$(basename "$path")" = libnvrtc.so.13 ]; then
      # The program loads NVRTC as libnvrtc.so.12 or libnvrtc.so (CUDA 12.8's names): give
      # CUDA 13's (PyTorch's cu13 wheels) the second name, in a folder of the kit's own.
      links="${TMPDIR:-/tmp}/bonfire-gpu-kit-$(id -u)/lib"
      mkdir -p "$links" && ln -sf "$path" "$links/libnvrtc.so" &&
        export LD_LIBRARY_PATH="$links:$LD_LIBRARY_PATH"
    fi
  else
    have[$key]=0
    echo "gpu-kit: lib$key: MISSING — ${where[$key]}"
  fi
done
# CubeCL's C++ path hands NVRTC its kernels with CUDA's headers (cuda_fp16.h, …) from
# $CUDA_PATH/include (else /usr/local/cuda, /opt/cuda): find a folder that has them, pip's
# nvidia-cuda-runtime wheel included, and point CUDA_PATH at it.
headers=""
wheels=""
for s in $sites; do wheels="$wheels $(echo "$s"/nvidia/*)"; done
for d in ${CUDA_PATH:-} /usr/local/cuda /opt/cuda /usr $wheels; do
  if [ -e "$d/include/cuda_fp16.h" ]; then headers=$d; break; fi
done
if [ -n "$headers" ]; then
  export CUDA_PATH="$headers"
  echo "gpu-kit: CUDA headers: $headers/include"
elif [ "${have[nvrtc]}" = 1 ]; then
  have[nvrtc]=0
  echo "gpu-kit: CUDA headers: MISSING (no cuda_fp16.h under \$CUDA_PATH/include, /usr/local/cuda/include," \
       "/opt/cuda/include) — NVRTC needs them: the CUDA toolkit, or pip install nvidia-cuda-runtime-cu12" \
       "(then CUDA_PATH=<site-packages>/nvidia/cuda_runtime)"
fi

passed=0 failed=0 skipped=0
logs="$KIT/logs"
# The program runs unpacked under $TMPDIR: the checks find the kit's fixtures by this name.
export BONFIRE_GPU_KIT_FIXTURES="$KIT/bin/fixtures"
mkdir -p "$logs"
while IFS=$'\t' read -r name min_gpus secs needs what; do
  [ -z "$name" ] && continue
  if [ -n "$ONLY" ] && ! echo ",$ONLY," | grep -q ",$name,"; then
    continue
  fi
  missing=""
  [ "${have[cuda]}" = 1 ] || missing=" libcuda"
  for need in $(echo "$needs" | tr ',-' '  '); do
    [ "${have[$need]:-0}" = 1 ] || missing="$missing lib$need"
    [ "$need" = nvrtc ] && [ -z "$headers" ] && missing="$missing cuda-headers"
  done
  if [ -n "$missing" ]; then
    echo "SKIPPED $name: missing$missing"
    skipped=$((skipped + 1)); continue
  fi
  if [ "$gpus" -lt "$min_gpus" ]; then
    echo "SKIPPED $name: needs $min_gpus GPUs, found $gpus"
    skipped=$((skipped + 1)); continue
  fi
  left=$(( began + BUDGET - $(date +%s) ))
  if [ "$left" -le 0 ]; then
    echo "FAILED $name: the kit's ${BUDGET} s were spent before it could start"
    failed=$((failed + 1)); continue
  fi
  [ "$secs" -gt "$left" ] && secs=$left
  echo "==> $name (limit ${secs} s): $what"
  start=$(date +%s)
  # shellcheck disable=SC2086 # ARGS is split into the check's arguments
  timeout -k 10 "$secs" "$BIN" "$name" $ARGS >"$logs/$name.log" 2>&1
  rc=$?
  took=$(( $(date +%s) - start ))
  sed 's/^/    /' "$logs/$name.log" | tail -n 40
  if [ $rc -eq 0 ]; then
    echo "PASSED $name (${took} s)"; passed=$((passed + 1))
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    echo "FAILED $name: over its ${secs} s limit (log: $logs/$name.log)"; failed=$((failed + 1))
  else
    echo "FAILED $name: exit $rc (${took} s; log: $logs/$name.log)"; failed=$((failed + 1))
  fi
done <"$CHECKS"
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
