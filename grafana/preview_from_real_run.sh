#!/usr/bin/env bash
# Renders docs/dashboard.png from a REAL tuning run: `autotune run` (controller + 4 CPU ranks)
# scraped by a real Prometheus, the dashboard's own queries drawn by render_preview.py.
#   ./grafana/preview_from_real_run.sh [OUT.png]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/dashboard.png}
work=$(mktemp -d)
ctl=19700; base=19710; prom=19090
cat > "$work/prometheus.yml" <<YML
global: {scrape_interval: 1s, evaluation_interval: 1s}
rule_files: ["$PWD/rules/prometheus/alerts.yml"]
scrape_configs:
  - job_name: autotune
    honor_labels: true
    static_configs: [{targets: ["127.0.0.1:$ctl", "127.0.0.1:$base", "127.0.0.1:$((base+1))", "127.0.0.1:$((base+2))", "127.0.0.1:$((base+3))"]}]
YML
prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/data" \
  --web.listen-address=127.0.0.1:$prom --log.level=warn > "$work/prom.log" 2>&1 &
prom_pid=$!
trap 'kill $prom_pid $run_pid 2>/dev/null || true' EXIT
.venv/bin/autotune run --budget 6 --steps 60 --study "$work/study" \
  --metrics-port $ctl --rank-metrics-port $base > "$work/run.log" 2>&1 &
run_pid=$!
# Render while the last trial trains, so rank panels and the tuning history both have data.
until grep -q "^    4 " "$work/run.log"; do
  kill -0 $run_pid 2>/dev/null || { cat "$work/run.log"; exit 1; }
  sleep 2
done
sleep 20
.venv/bin/python grafana/render_preview.py --prom http://127.0.0.1:$prom --job autotune --span 240 --out "$out"
wait $run_pid
echo "wrote $out (study: $work/study)"
