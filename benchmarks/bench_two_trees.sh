#!/usr/bin/env bash
# Runs one `dslab bench` command with two source trees of dslab on the same machine, one after the
# other, and prints each run's ratios side by side: a refactor's "same ratios as before" check.
#
#   bash benchmarks/bench_two_trees.sh OLD_TREE SUITE [dslab bench options...]
#
# OLD_TREE is a copy of the other version's repository (e.g. `git archive COMMIT | tar -x -C
# .before`); its package runs from there (PYTHONPATH) and this checkout's from here. Reports go
# to $OUT (or ./gpu-out)/before and /after. Source benchmarks/gpu_setup.sh first on a lent GPU.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: bash benchmarks/bench_two_trees.sh OLD_TREE SUITE [dslab bench options...]" >&2
  exit 2
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
old="$(cd "$1" && pwd)"
suite="$2"
shift 2
options=("$@")
[ -f "$old/dslab/__init__.py" ] || { echo "bench_two_trees: $old holds no dslab package" >&2; exit 2; }
[ -e "$here/$suite" ] || { echo "bench_two_trees: no suite $suite in $here" >&2; exit 2; }
out="${OUT:-$here/gpu-out}"
mkdir -p "$out/before" "$out/after"
run() {  # tree, label
  (cd "$1" && PYTHONPATH="$1${PYTHONPATH:+:$PYTHONPATH}" python3 -c 'import dslab, sys; print("dslab from", dslab.__file__, file=sys.stderr)' &&
   PYTHONPATH="$1${PYTHONPATH:+:$PYTHONPATH}" python3 -m dslab.cli bench "$here/$suite" --out "$out/$2" "${options[@]}") \
    > "$out/$2/bench_$(basename "$suite").log" 2>&1
}
run "$old" before || { tail -20 "$out/before/bench_$(basename "$suite").log"; exit 1; }
run "$here" after || { tail -20 "$out/after/bench_$(basename "$suite").log"; exit 1; }
python3 - "$out" "$(basename "$suite")" <<'EOF'
import json, sys
from pathlib import Path
out, suite = Path(sys.argv[1]), sys.argv[2]
rows = {}
for label in ("before", "after"):
    (report,) = sorted((out / label / suite).glob("*/run.json"))[-1:]
    data = json.loads(report.read_text())
    print(f"{label}: {report.parent.name} {data['status']}, source digest "
          f"{(data['environment'].get('dslab') or {}).get('source_digest')}")
    for case, ratios in (data.get("ratios") or {}).items():
        for name, value in ratios.items():
            rows.setdefault((case, name), {})[label] = value
print(f"\n{'case':<14} {'ratio':<28} {'before':>8} {'after':>8}")
for (case, name), values in rows.items():
    cells = " ".join(f"{values[k]:>8.3f}" if k in values else f"{'-':>8}" for k in ("before", "after"))
    print(f"{case:<14} {name:<28} {cells}")
EOF
