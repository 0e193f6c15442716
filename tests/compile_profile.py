"""Where the suite's time goes, test by test: a pytest plugin, off unless named.

    .venv/bin/python -m pytest -n auto --dist loadgroup -p tests.compile_profile tests
    .venv/bin/python -m tests.compile_profile          # the table of the last such run

Each worker writes one JSON list to .compile-profile/ (git-ignored; S3DJAX_COMPILE_PROFILE names another folder): per
test, its wall seconds, XLA's backend compile seconds and executables, tracing and lowering seconds, and
persistent-cache hits. A test that starts a process of its own (a command line, the GPU suite) shows its wall time
only.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import sys
import time

import pytest

FOLDER = os.environ.get("S3DJAX_COMPILE_PROFILE") or os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".compile-profile")
EVENTS = {"/jax/core/compile/backend_compile_duration": "compile_s",
          "/jax/core/compile/jaxpr_trace_duration": "trace_s",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s"}
_now = collections.Counter()
_rows = []


def pytest_configure(config):
    from jax import monitoring

    def on_duration(event, seconds, **_):
        if event in EVENTS:
            _now[EVENTS[event]] += seconds
            _now["executables"] += event.endswith("backend_compile_duration")

    monitoring.register_event_duration_secs_listener(on_duration)
    monitoring.register_event_listener(lambda event, **_: _now.update(cache_hits=event.endswith("cache_hits")))
    if not hasattr(config, "workerinput"):  # the controller (or a run without workers): start afresh
        for path in glob.glob(os.path.join(FOLDER, "*.json")):
            os.remove(path)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # runs where the test runs: a worker, not xdist's controller
    _now.clear()
    start = time.perf_counter()
    yield
    row = {"test": item.nodeid, "wall_s": time.perf_counter() - start}
    _rows.append({**row, **{k: _now[k] for k in (*EVENTS.values(), "executables", "cache_hits")}})


def pytest_sessionfinish(session):
    if not _rows:
        return
    os.makedirs(FOLDER, exist_ok=True)
    worker = getattr(session.config, "workerinput", {}).get("workerid", "main")  # not the environment's: a test's
    with open(os.path.join(FOLDER, f"{worker}.json"), "w") as f:                 # pytest inherits a worker's
        json.dump(_rows, f)


def table(rows: list[dict], top: int = 30) -> str:
    """The totals, each module's share and the slowest tests, as markdown."""
    keys = ("wall_s", "compile_s", "trace_s", "lower_s", "executables", "cache_hits")
    total = {k: sum(r[k] for r in rows) for k in keys}
    modules = collections.defaultdict(collections.Counter)
    for r in rows:
        modules[r["test"].split("::")[0]].update({k: r[k] for k in keys})
    head = "| {} | wall s | compile s | trace s | lower s | executables | cache hits |\n| --- |" + " --- |" * 6
    line = lambda name, r: f"| {name} | " + " | ".join(f"{r[k]:.0f}" for k in keys) + " |"  # noqa: E731
    out = [f"{len(rows)} tests; worker-seconds {total['wall_s']:.0f}, of which XLA compiled {total['compile_s']:.0f} "
           f"({total['executables']} executables, {total['cache_hits']} from the persistent cache), traced "
           f"{total['trace_s']:.0f} and lowered {total['lower_s']:.0f}.", "", head.format("module")]
    out += [line(m, r) for m, r in sorted(modules.items(), key=lambda kv: -kv[1]["wall_s"])[:top]]
    out += ["", head.format("test")] + [line(r["test"], r) for r in sorted(rows, key=lambda r: -r["wall_s"])[:top]]
    return "\n".join(out)


if __name__ == "__main__":
    found = [r for path in glob.glob(os.path.join(FOLDER, "*.json")) for r in json.load(open(path))]
    if not found:
        print(f"error: no profile in {FOLDER}; run pytest with -p tests.compile_profile first", file=sys.stderr)
        sys.exit(2)
    print(table(found))
