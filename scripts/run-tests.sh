#!/usr/bin/env bash
# Runs ruff (format and lint), then the whole suite. pytest's exit 5 ("no tests ran") is turned into a failure,
# and a run that collected fewer tests than the floor below fails too, so an
# import error that silently empties a directory can never pass as green. Then the claims
# check (python -m tools.claims) proves the README and docs against this run. A suite that leaves a
# tracked file modified (a test writing into the working tree) fails as well.
set -uo pipefail
cd "$(dirname "$0")/.."
MIN_TESTS=${FURLONG_MIN_TESTS:-600}
mkdir -p .reports; report=.reports/junit.xml
# Style first (seconds): ruff's formatter and linter, configured in pyproject.toml.
LINT=(furlong tests tools benchmarks examples)
.venv/bin/ruff format --check -q "${LINT[@]}" || { echo "FAIL: ruff format (run: .venv/bin/ruff format ${LINT[*]})" >&2; exit 1; }
.venv/bin/ruff check -q "${LINT[@]}" || { echo "FAIL: ruff check (run: .venv/bin/ruff check --fix ${LINT[*]})" >&2; exit 1; }
# Tracked files as the suite found them (skipped outside a git checkout, e.g. an unpacked sdist).
tracked() { git diff --no-ext-diff HEAD -- . 2>/dev/null | git hash-object --stdin; git status --porcelain --untracked-files=no; }
in_git=0; git rev-parse --is-inside-work-tree >/dev/null 2>&1 && in_git=1
[ "$in_git" -eq 1 ] && before=$(tracked)
# Two workers by default (FURLONG_TEST_WORKERS=1 runs serially): much of the suite waits on servers and
# subprocesses starting, which a second worker overlaps. Whole files go to one worker (module fixtures
# such as a shared chaos run stay shared), each worker's processes get one thread so two workers do not
# oversubscribe the cores. Files go out in collection order (tests/conftest.py puts the longest first), not
# xdist's default of files with the most tests first, which left the longest run alone at the end.
# With FURLONG_BUILD_ENVS=1 (`make test`) the connectors' virtual environments that are missing build in the
# background while the suite runs: the builds wait mostly on the package index, and a first build of the four
# took ~2.5 min that the suite used to wait through. The tests marked `envs` run last (tests/conftest.py), and
# each takes its environment through `venvs.ensure`, which waits on the build's lock (or builds it itself).
# At the lowest priority: the builds' CPU (pip's byte-compiling) then fills what the tests leave idle instead
# of slowing the first tests (at the default priority the longest test ran 1.7x slower beside them).
envs_pid=""
if [ "${FURLONG_BUILD_ENVS:-0}" = 1 ]; then
  nice -n 19 .venv/bin/furlong envs setup --all >.reports/envs.log 2>&1 &
  envs_pid=$!
fi
workers=${FURLONG_TEST_WORKERS:-2}
par=()
if [ "$workers" -gt 1 ] && .venv/bin/python -c "import xdist" 2>/dev/null; then
  par=(-n "$workers" --dist loadfile --no-loadscope-reorder); export OMP_NUM_THREADS=1
fi
.venv/bin/python -m pytest -q -p no:cacheprovider "${par[@]}" --junitxml="$report" "$@"
rc=$?
if [ "$in_git" -eq 1 ] && [ "$(tracked)" != "$before" ]; then
  echo "FAIL: the suite modified tracked files (a test must write under tmp_path, not the working tree):" >&2
  git status --porcelain --untracked-files=no >&2
  exit 1
fi
if [ -n "$envs_pid" ] && ! wait "$envs_pid"; then
  echo "FAIL: furlong envs setup --all (.reports/envs.log):" >&2; tail -n 20 .reports/envs.log >&2; exit 1
fi
if [ "$rc" -eq 5 ]; then echo "FAIL: pytest ran no tests" >&2; exit 1; fi
if [ "$rc" -ne 0 ]; then exit "$rc"; fi
ran=$(.venv/bin/python -c "import sys,xml.etree.ElementTree as E; r=E.parse(sys.argv[1]).getroot(); s=r if r.tag=='testsuite' else r.find('testsuite'); print(int(s.get('tests'))-int(s.get('skipped')))" "$report")
if [ $# -eq 0 ] && [ "$ran" -lt "$MIN_TESTS" ]; then echo "FAIL: only $ran tests ran (floor $MIN_TESTS)" >&2; exit 1; fi
echo "OK: $ran tests ran and passed"
# Then the claims check: README/docs links and anchors, counts, figures, and every feature the
# manifest calls working/partial proven by tests that passed in the report just written. A run
# of part of the suite (arguments given) only fails on listed tests that ran and did not pass.
claims=(); [ $# -eq 0 ] || claims=(--partial-run)
.venv/bin/python -m tools.claims --junit "$report" "${claims[@]}" || { echo "FAIL: claims check" >&2; exit 1; }
