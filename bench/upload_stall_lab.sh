#!/usr/bin/env bash
# bench/upload_stall.py across a real lab link (issue 35): `dilococtl lab up --object-store` in a home of
# its own, then the bench runs on site0's node and uploads to site1's SeaweedFS, so every PUT crosses
# the shaped, delayed WAN link. Root only; the lab is always taken down. Arguments go to the bench:
#   RATE=100mbit RTT=20ms bench/upload_stall_lab.sh --preset small --rounds 6 --compute-s 8
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${RATE:-100mbit}
RTT=${RTT:-20ms}
export DILOCOCTL_HOME="$(mktemp -d /tmp/upload-stall-lab-XXXXXX)"
trap '.venv/bin/dilococtl lab down >&2 || true; rm -rf "$DILOCOCTL_HOME"' EXIT
.venv/bin/dilococtl lab up --sites 2 --rate "$RATE" --rtt "$RTT" --object-store >&2
read -r ns url < <(.venv/bin/python - "$DILOCOCTL_HOME/lab" <<'PY'
import json, sys
from pathlib import Path
lab = Path(sys.argv[1])
node = json.loads((lab / "state.json").read_text())["nodes"][0]
stores = {s["site"]: s for s in json.loads((lab / "object-store.json").read_text())}
other = next(s for name, s in stores.items() if name != node["site"])
print(node["netns"], f"s3://{other['bucket']}/bench?endpoint_url=http://{other['address']}:{other['ports'][0]}")
PY
)
echo "# $ns uploads to $url across $RATE, RTT $RTT" >&2
set -a
. "$DILOCOCTL_HOME/lab/s3.env"
set +a
cpu() {  # CPU seconds the lab's SeaweedFS servers have used so far (they share this machine's cores)
  local t=0 pid
  for pid in $(pgrep -f "weed server" || true); do
    t=$((t + $(awk '{print $14 + $15}' "/proc/$pid/stat" 2>/dev/null || echo 0)))
  done
  awk -v t="$t" -v hz="$(getconf CLK_TCK)" 'BEGIN { printf "%.1f", t / hz }'
}
before=$(cpu)
ip netns exec "$ns" .venv/bin/python bench/upload_stall.py --store "$url" --link-mbps "${RATE%mbit}" "$@"
echo "# the SeaweedFS servers used $(awk -v a="$(cpu)" -v b="$before" 'BEGIN { print a - b }') CPU seconds during the bench" >&2
