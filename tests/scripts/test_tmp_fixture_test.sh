#!/usr/bin/env bash
# Every test that is told to write under ZINF_TEST_TMPDIR must require the fixture that creates
# that directory, so that the first `ctest` in a fresh build directory, or `ctest -R` of any one
# test, finds it whatever order the tests run in (tests/gpu/pinned_path_test.cpp once failed
# there: only the engine tests' ScratchDir created test-tmp/).
# Usage: tests/scripts/test_tmp_fixture_test.sh <build dir>
set -euo pipefail
build=${1:?build dir}
ctest --test-dir "$build" --show-only=json-v1 >"$build/test_tmp_fixture.json"
python3 - "$build/test_tmp_fixture.json" <<'PY'
import json, sys
tests = json.load(open(sys.argv[1]))["tests"]
def props(t):
    return {p["name"]: p["value"] for p in t.get("properties", [])}
setup = {}
for t in tests:
    for f in props(t).get("FIXTURES_SETUP", []):
        setup[f] = t
bad, writers = [], 0
for t in tests:
    p = props(t)
    dirs = [e.split("=", 1)[1] for e in p.get("ENVIRONMENT", []) if e.startswith("ZINF_TEST_TMPDIR=")]
    if not dirs:
        continue
    writers += 1
    ok = False
    for f in p.get("FIXTURES_REQUIRED", []):
        s = setup.get(f)
        if s and "make_directory" in s.get("command", []) and dirs[0] in s.get("command", []):
            ok = True
    if not ok:
        bad.append(t["name"])
print(f"{writers} tests write under ZINF_TEST_TMPDIR; {len(bad)} without the fixture that creates it")
for name in bad[:20]:
    print("  no fixture:", name)
sys.exit(1 if bad or writers == 0 else 0)
PY
