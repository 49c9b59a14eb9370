"""`--dist loadfile` that survives a crashed worker: xdist 3.8's file scheduler can hang the whole run.

Why: a test past its pytest timeout ends its worker process (`timeout_method = "thread"`), xdist replaces the
worker, and its `LoadScopeScheduling` (which `loadfile` is) then (1) puts every file the dead worker had
*finished* back on the queue as empty work units that no worker ever completes, (2) can leave a replacement
worker holding a single test, which a worker never runs until it is sent a next one or told to shut down,
and (3) re-runs the test that crashed. (1) and (2) end a run with every worker idle and the controller
waiting forever (pytest-xdist issues #1378, #1327; #784 for loadfile) — a red run turned into a hung one.

This scheduler, used by `tests/conftest.py` through xdist's `pytest_xdist_make_scheduler` hook, keeps the
file grouping and the order and fixes the three: only unfinished files go back (to the front of the queue),
the crashed test counts as done (xdist has already reported it failed), and a worker is topped up until it
holds more than two tests or the queue is empty, then told to shut down so it runs what it holds.
"""

from __future__ import annotations

from typing import Any

from xdist.scheduler.loadfile import LoadFileScheduling


class CrashSafeLoadFile(LoadFileScheduling):
    def remove_node(self, node: Any) -> str | None:
        workload = self.assigned_work.pop(node)
        pending = {scope: unit for scope, unit in workload.items() if not all(unit.values())}
        if not pending:
            return None
        # Units are assigned and run in order, so the first unfinished test of the first unfinished unit was running.
        crashitem = next(nodeid for nodeid, done in next(iter(pending.values())).items() if not done)
        next(iter(pending.values()))[crashitem] = True
        for scope, unit in reversed(list(pending.items())):
            if not all(unit.values()):
                self.workqueue[scope] = unit
                self.workqueue.move_to_end(scope, last=False)
        for other in list(self.assigned_work):
            self._reschedule(other)
        return crashitem

    def _reschedule(self, node: Any) -> None:
        if node.shutting_down:
            return
        while self.workqueue and self._pending_of(self.assigned_work.get(node, {})) <= 2:
            self._assign_work_unit(node)
        if not self.workqueue:
            node.shutdown()


def pytest_xdist_make_scheduler(config: Any, log: Any) -> Any:
    if config.getvalue("dist") == "loadfile":
        return CrashSafeLoadFile(config, log)
    return None
