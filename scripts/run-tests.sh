#!/usr/bin/env bash
# Runs the whole suite. pytest's exit 5 ("no tests ran") is turned into a failure,
# and a run that collected fewer tests than the floor below fails too, so an
# import error that silently empties a directory can never pass as green.
set -uo pipefail
cd "$(dirname "$0")/.."
MIN_TESTS=${FURLONG_MIN_TESTS:-20}
mkdir -p .reports; report=.reports/junit.xml
.venv/bin/python -m pytest -q -p no:cacheprovider --junitxml="$report" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "FAIL: pytest ran no tests" >&2; exit 1; fi
if [ "$rc" -ne 0 ]; then exit "$rc"; fi
ran=$(.venv/bin/python -c "import sys,xml.etree.ElementTree as E; r=E.parse(sys.argv[1]).getroot(); s=r if r.tag=='testsuite' else r.find('testsuite'); print(int(s.get('tests'))-int(s.get('skipped')))" "$report")
if [ $# -eq 0 ] && [ "$ran" -lt "$MIN_TESTS" ]; then echo "FAIL: only $ran tests ran (floor $MIN_TESTS)" >&2; exit 1; fi
echo "OK: $ran tests ran and passed"
