#!/usr/bin/env bash
# device_check.sh OUTDIR: every GPU check of the project in one command, on a machine with one NVIDIA GPU,
# torch with CUDA, and no network (no vLLM needed). About 6 minutes on one H100.
#
#   scripts/device_check.sh OUTDIR          # PYTHON=python3 by default; NIXL_WHEELS=.whl by default
#
# 1. mma_preload is built (make -C mma_preload); without it the script stops (exit 2): the "under
#    mma_preload" figures would otherwise be native copies.
# 2. scripts/gpu_connector_check.py at 8k and 32k tokens (32 layers, 7B-like), with --mma: the byte checks
#    in all 10 KV layouts, the overlap timings (no-load, bulk, layerwise, stall, hidden fraction) and the
#    host->device copy sizes, natively and under mma_preload.
# 3. mma_preload/gpu_check.sh: the interposer's bytes, stream order and overhead against the real runtime.
# 4. NIXL, where importable (else installed from NIXL_WHEELS, else skipped with a line saying so):
#    scripts/gpu_nixl_check.py (DRAM<->VRAM over UCX) and scripts/gpu_gds_check.py (GDS / GDS_MT file reads
#    into VRAM, layer-major, next to POSIX + host->device copies).
# Writes OUTDIR/device_check.json (every part), OUTDIR/device_check.md (the tables) and OUTDIR/device_check.log.
# Exit status: 0 when every check that ran passed, 1 when one failed, 2 when mma_preload cannot be built,
# 77 when there is no GPU.
set -uo pipefail
out=${1:?usage: scripts/device_check.sh OUTDIR}
root=$(CDPATH= cd -- "$(dirname -- "$0")/.." && pwd)
PY=${PYTHON:-python3}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
# GDS reads files on the repository's disk (the temp dir may be tmpfs, which has no O_DIRECT).
gds_dir="$root/.device-check-gds"
trap 'rm -rf "$work" "$gds_dir"' EXIT
log="$out/device_check.log"
: >"$log"
say() { echo "[$(date +%T)] $*" | tee -a "$log"; }
step() {  # step NAME TIMEOUT_S CMD...: run, log, record the status
  local name=$1 limit=$2; shift 2
  say "== $name"
  timeout "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  echo "$name $rc" >>"$work/status"
  say "== $name: exit $rc"
  return 0
}

export PYTHONUNBUFFERED=1
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  say "no usable GPU (torch.cuda.is_available() is False)"
  exit 77
fi
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))' | tee -a "$log"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv 2>&1 | tee -a "$log"

if ! make -C "$root/mma_preload" build/libmma_preload.so >>"$log" 2>&1; then
  say "mma_preload could not be built (make -C mma_preload; see $log): refusing to report 'under mma_preload' figures"
  exit 2
fi

step connector-8k 180 "$PY" "$root/scripts/gpu_connector_check.py" --device cuda --tokens 8192 --mma --out-dir "$work/c8k"
step connector-32k 270 "$PY" "$root/scripts/gpu_connector_check.py" --device cuda --tokens 32768 --reps 3 --mma --out-dir "$work/c32k"
step mma-gpu-check 120 "$root/mma_preload/gpu_check.sh" "$PY"

wheels=${NIXL_WHEELS:-$root/.whl}
if ! "$PY" -c 'import nixl' 2>/dev/null && ls "$wheels"/nixl*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" "$wheels"/nixl*.whl >>"$log" 2>&1
  export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
fi
if "$PY" -c 'import nixl._api' >>"$log" 2>&1; then
  step nixl-dram-vram 60 "$PY" "$root/scripts/gpu_nixl_check.py" --mib 256 --json "$work/nixl.json"
  step nixl-dram-vram-1024-descs 60 "$PY" "$root/scripts/gpu_nixl_check.py" --mib 256 --descs 1024 --json "$work/nixl-descs.json"
  mkdir -p "$gds_dir"
  df -T "$gds_dir" | tee -a "$log"
  step gds 120 "$PY" "$root/scripts/gpu_gds_check.py" --device cuda --objects 16 --dir "$gds_dir" --json "$work/gds.json"
else
  say "nixl not importable and no wheels in $wheels: NIXL DRAM<->VRAM and GDS checks skipped"
fi

"$PY" - "$work" "$out" <<'EOF'
import json, os, sys
work, out = sys.argv[1], sys.argv[2]
def load(path):
    path = os.path.join(work, path)
    return json.load(open(path)) if os.path.exists(path) else None
status = dict(line.split() for line in open(os.path.join(work, "status")))
result = {"status": {k: int(v) for k, v in status.items()},
          "connector_8k": load("c8k/gpu_connector.json"), "connector_32k": load("c32k/gpu_connector.json"),
          "nixl": load("nixl.json"), "nixl_1024_descs": load("nixl-descs.json"), "gds": load("gds.json")}
json.dump(result, open(os.path.join(out, "device_check.json"), "w"), indent=1)
md = ["# device_check", "", "| check | exit |", "|---|---|", *[f"| {k} | {v} |" for k, v in status.items()], ""]
for name in ("c8k", "c32k"):
    path = os.path.join(work, name, "gpu_connector.md")
    if os.path.exists(path):
        md += [f"## connector, {name[1:]}", "", open(path).read()]
for name, key in (("NIXL DRAM<->VRAM, 256 MiB", "nixl"), ("NIXL, 256 MiB in 1024 descriptors", "nixl_1024_descs")):
    part = result[key]
    if part:
        md += [f"## {name}", "", *[f"- {d}: median {part[d]['median_gbps']:.2f} GB/s, mismatched reads {part[d]['mismatched_reads']}"
                                   for d in ("dram_to_vram", "vram_to_dram")], ""]
if result["gds"]:
    md += ["## GDS reads (layer-major into VRAM)", "", f"nvidia-fs loaded: {result['gds']['nvidia_fs']}", ""]
    for name, row in result["gds"]["plugins"].items():
        md.append(f"- {name}: " + (row["refused"] if "refused" in row else
                  f"median {row['median_gbps']} GB/s (min {row['min_gbps']}, max {row['max_gbps']}), byte-exact {row['byte_exact']}"
                  + (", cuFile compatibility mode" if row.get("compat_mode") else "")))
open(os.path.join(out, "device_check.md"), "w").write("\n".join(md) + "\n")
print("\n".join(md))
sys.exit(0 if all(int(v) == 0 for v in status.values()) else 1)
EOF
