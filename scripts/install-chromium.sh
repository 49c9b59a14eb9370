#!/usr/bin/env bash
# Debian's chromium for the browser tests (Playwright cannot download its own here).
set -e
if [ "$(id -u)" -ne 0 ]; then echo "need root to apt-get install chromium" >&2; exit 1; fi
apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null
