#!/usr/bin/env bash
# Renders a run's report.html in headless Chromium and saves a screenshot, to look at
# the page as a browser shows it (offline: the page fetches nothing).
#
#   bash xtask/scripts/report-screenshot.sh runs/<name> [out.png]
#
# Needs Debian's chromium (`apt-get install chromium`). Writes the report first with
# the release binary when it is built, else through cargo.
set -euo pipefail
run=${1:?usage: report-screenshot.sh RUN_DIR [OUT.png]}
out=${2:-$run/report.png}
cd "$(dirname "$0")/../.."
if [ -x target/release/metronome ]; then
    target/release/metronome report "$run"
else
    cargo run --quiet -p metronome-cli -- report "$run"
fi
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
# The flags keep a root, offline Chromium from reaching for the network or a sandbox.
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --user-data-dir="$profile" --hide-scrollbars --window-size=1100,4200 \
    --screenshot="$(realpath -m "$out")" "file://$(realpath "$run")/report.html" 2>/dev/null
echo "screenshot: $out"
