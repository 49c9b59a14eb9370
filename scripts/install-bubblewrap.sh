#!/usr/bin/env bash
# Debian's bubblewrap (bwrap): the namespaces the local sandbox runs model-written code in.
# Without it LocalSandbox refuses to run code (unless envs.sandbox_unsafe_allow=true).
set -e
if [ "$(id -u)" -ne 0 ]; then echo "need root to apt-get install bubblewrap (or ask your admin for it)" >&2; exit 1; fi
apt-get update -qq && apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null
